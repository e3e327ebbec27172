"""Fashion-MNIST from Debian's package: the IDX reader on files written here (whole,
truncated, not IDX), the one-line refusal when the package is missing, and a short real
`train --data fashion-mnist` run where the package is installed."""

from __future__ import annotations

import gzip
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from boundedloss.cli import main
from boundedloss.experiments.train import TrainConfig
from boundedloss.workloads import fashion_mnist
from boundedloss.workloads.idx import IdxError, parse_idx, read_idx_gz

INSTALLED = all((fashion_mnist.DATA_DIR / n).is_file()
                for pair in fashion_mnist.FILES.values() for n in pair)
needs_package = pytest.mark.skipif(
    not INSTALLED, reason=f"Debian's {fashion_mnist.PACKAGE} is not installed "
                          f"(no {fashion_mnist.DATA_DIR}; .ci/run installs it as root)")


def idx_bytes(array: np.ndarray, code: int) -> bytes:
    """``array`` as an IDX file: magic, big-endian dimensions, big-endian values."""
    big = array.astype(array.dtype.newbyteorder(">"))
    return (struct.pack(">HBB", 0, code, array.ndim)
            + struct.pack(f">{array.ndim}I", *array.shape) + big.tobytes())


def write_gz(path: Path, raw: bytes) -> Path:
    path.write_bytes(gzip.compress(raw))
    return path


def test_a_whole_idx_file_reads_back_as_written(tmp_path):
    images = np.random.default_rng(0).integers(0, 256, (5, 4, 3), dtype=np.uint8)
    read = read_idx_gz(write_gz(tmp_path / "i.gz", idx_bytes(images, 0x08)))
    np.testing.assert_array_equal(read, images)
    wide = np.array([[1, -2], [70_000, -1]], dtype=np.int32)  # (big-endian on disk)
    read = read_idx_gz(write_gz(tmp_path / "w.gz", idx_bytes(wide, 0x0C)))
    np.testing.assert_array_equal(read, wide)
    assert read.dtype == np.int32 and read.dtype.isnative


@pytest.mark.parametrize("damage, says", [
    (lambda raw: raw[:-1], "truncated"),
    (lambda raw: raw[:9], "truncated in its header"),
    (lambda raw: raw[:2], "shorter than an IDX header"),
    (lambda raw: raw + b"\0", "longer than its header says"),
    (lambda raw: b"\x1f\x8b" + raw[2:], "not an IDX file"),  # (a gzip inside a gzip)
    (lambda raw: raw[:2] + b"\x07" + raw[3:], "not an IDX file"),  # no such type
    (lambda raw: raw[:3] + b"\0" + raw[4:], "not an IDX file"),  # 0 dimensions
])
def test_a_damaged_idx_file_is_an_error_naming_it(tmp_path, damage, says):
    raw = idx_bytes(np.zeros((3, 2, 2), dtype=np.uint8), 0x08)
    path = write_gz(tmp_path / "bad.gz", damage(raw))
    with pytest.raises(IdxError, match=says) as caught:
        read_idx_gz(path)
    assert str(path) in str(caught.value) and "\n" not in str(caught.value)


def test_a_truncated_or_foreign_gzip_is_an_idx_error(tmp_path):
    whole = gzip.compress(idx_bytes(np.zeros((100, 28, 28), dtype=np.uint8), 0x08))
    for name, content in (("cut.gz", whole[: len(whole) // 2]), ("plain.gz", b"IDX?" * 8)):
        (tmp_path / name).write_bytes(content)
        with pytest.raises(IdxError, match="not a whole gzip file"):
            read_idx_gz(tmp_path / name)
    with pytest.raises(IdxError):
        parse_idx(b"")


def fake_fashion_mnist(directory: Path, n: int = 6, label_code: int = 0x08,
                       top_label: int = 9) -> Path:
    rng = np.random.default_rng(1)
    for images_name, labels_name in fashion_mnist.FILES.values():
        write_gz(directory / images_name,
                 idx_bytes(rng.integers(0, 256, (n, 28, 28), dtype=np.uint8), 0x08))
        labels = np.arange(n) % (top_label + 1)
        dtype = np.uint8 if label_code == 0x08 else np.int32
        write_gz(directory / labels_name, idx_bytes(labels.astype(dtype), label_code))
    return directory


def test_the_loader_scales_a_whole_set_and_refuses_wrong_labels(tmp_path):
    data = fashion_mnist.load_fashion_mnist(fake_fashion_mnist(tmp_path))
    assert tuple(data.x_train.shape) == (6, 1, 28, 28) and data.side == 28
    assert 0.0 <= float(data.x_test.min()) and float(data.x_test.max()) <= 1.0
    assert data.y_train.tolist() == [0, 1, 2, 3, 4, 5]
    with pytest.raises(IdxError, match="a label of 10"):
        fashion_mnist.load_fashion_mnist(fake_fashion_mnist(tmp_path, n=11, top_label=10))
    with pytest.raises(IdxError, match="int32 labels of shape"):
        fashion_mnist.load_fashion_mnist(fake_fashion_mnist(tmp_path, label_code=0x0C))


def test_missing_files_are_one_line_naming_the_package(tmp_path, monkeypatch, capsys):
    with pytest.raises(FileNotFoundError) as caught:
        fashion_mnist.load_fashion_mnist(tmp_path)
    line = str(caught.value)
    assert "\n" not in line and "apt-get install dataset-fashion-mnist" in line, line
    # train: the same line, before any rank starts
    monkeypatch.setattr(fashion_mnist, "DATA_DIR", tmp_path)
    out = tmp_path / "run"
    rc = main(["train", "--model", "cnn", "--data", "fashion-mnist", "--workers", "2",
               "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1, err
    assert "--data fashion-mnist: Fashion-MNIST is not installed" in err
    assert "apt-get install dataset-fashion-mnist" in err
    assert not out.exists()


def test_data_is_for_the_image_models_only():
    with pytest.raises(ValueError, match="--data is for --model mlp or cnn"):
        TrainConfig(model="charlm", data="digits").validate()
    assert TrainConfig(model="cnn").data_name == "digits"
    assert TrainConfig(model="charlm").data_name == "stdlib-text"


@needs_package
def test_a_short_fashion_mnist_run_beats_chance(tmp_path):
    """2 ranks, 1 epoch of 30 steps of 32 images each: well above chance (10%)."""
    out = tmp_path / "fm"
    proc = subprocess.run(
        [sys.executable, "-m", "boundedloss.cli", "train", "--model", "cnn",
         "--data", "fashion-mnist", "--workers", "2", "--epochs", "1",
         "--steps-per-epoch", "30", "--out", str(out)],
        capture_output=True, text=True, timeout=180, env={**os.environ, "COLUMNS": "120"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["data"] == "fashion-mnist" and summary["config"]["data"] == "fashion-mnist"
    assert summary["rounds"] == 30 and summary["final_metric"] > 0.5, summary["final_metric"]
