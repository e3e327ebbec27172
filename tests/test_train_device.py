"""`train --device` and `--precision`: the settings checked before anything starts, where
each rank's model lives, and a real bfloat16 run whose gradients cross as bfloat16."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from boundedloss.cli import main
from boundedloss.experiments.compare import SCENARIOS, make_config
from boundedloss.experiments.train import TrainConfig, placement


@pytest.fixture
def no_gpu(monkeypatch):
    """A machine without a visible CUDA device, wherever the test runs."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.mark.parametrize("bad, says", [
    (dict(device="tpu"), "--device must be one of cpu, cuda"),
    (dict(precision="fp16"), "--precision must be one of fp32, bf16"),
    (dict(device="cuda", policy="tcp-ps"), "--policy tcp-ps runs on the CPU only"),
])
def test_train_config_refuses_a_device_or_precision_it_cannot_run(bad, says):
    with pytest.raises(ValueError, match=says):
        TrainConfig(**bad).validate()


def test_cuda_without_a_visible_gpu_is_refused_and_with_one_accepted(monkeypatch, no_gpu):
    with pytest.raises(ValueError, match="--device cuda: no CUDA device is visible"):
        TrainConfig(device="cuda", policy="gloo", precision="bf16").validate()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for policy in ("gloo", "dblp", "reliable"):
        TrainConfig(device="cuda", policy=policy, precision="bf16").validate()
    TrainConfig(precision="bf16").validate()  # (bf16 on the CPU needs no GPU)


def test_the_defaults_and_compares_runs_stay_on_the_cpu_in_float32():
    assert (TrainConfig().device, TrainConfig().precision) == ("cpu", "fp32")
    scenario = next(iter(SCENARIOS.values()))
    cfg = make_config(scenario, scenario.arms()[0], out="o", epochs=1, workers=2, seed=0)
    assert (cfg.device, cfg.precision) == ("cpu", "fp32")


def test_each_rank_takes_the_gpu_of_its_local_rank_modulo_the_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    cuda = TrainConfig(device="cuda", precision="bf16")
    assert [placement(cuda, r).device for r in range(4)] == [
        torch.device("cuda", i) for i in (0, 1, 0, 1)]
    assert placement(cuda, 3).dtype == torch.bfloat16
    monkeypatch.setenv("LOCAL_RANK", "2")  # (under torchrun: the rank on its host)
    assert placement(cuda, 5).device == torch.device("cuda", 0)
    cpu = placement(TrainConfig(), 3)
    assert (cpu.device, cpu.dtype) == (torch.device("cpu"), torch.float32)
    bf16 = placement(TrainConfig(precision="bf16"), 0)
    images, labels = bf16.put(torch.zeros(2, 3)), bf16.put(torch.arange(2))
    assert (images.dtype, labels.dtype) == (torch.bfloat16, torch.int64)


@pytest.mark.parametrize("argv, hint", [
    (["--device", "cuda"], "--device cuda: no CUDA device is visible"),
    (["--device", "cuda", "--policy", "gloo", "--precision", "bf16"],
     "no CUDA device is visible"),
    (["--device", "cuda", "--policy", "tcp-ps"], "tcp-ps runs on the CPU only"),
    (["--precision", "fp16"], "'fp16' is not one of 'fp32', 'bf16'"),
    (["--device", "gpu"], "'gpu' is not one of 'cpu', 'cuda'"),
])
def test_train_refuses_in_one_line_before_any_rank_starts(tmp_path, capsys, no_gpu, argv,
                                                          hint):
    out = tmp_path / "run"
    rc = main(["train", *argv, "--workers", "2", "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and hint in err, err
    assert not (out / "summary.json").exists() and not (out / "rounds.jsonl").exists()


def _summary(tmp_path, *args: str) -> dict:
    out = tmp_path / "-".join(args).replace(":", "")
    proc = subprocess.run(
        [sys.executable, "-m", "boundedloss.cli", "train", "--workers", "2", "--epochs", "1",
         "--steps-per-epoch", "4", "--out", str(out), *args],
        capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "120"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "bf16 on cpu" in proc.stdout  # (the report line says where and in what)
    return json.loads((out / "summary.json").read_text())


@pytest.mark.parametrize("policy", ["gloo", "dblp"])
def test_a_bf16_run_trains_in_bfloat16_and_the_hook_carries_it_as_such(tmp_path, policy):
    """Both arms alike: parameters (and so DDP's gradient buckets) in bfloat16. Ours:
    rank 0 (the server) takes in a bfloat16 bucket's datagrams a round - at least the
    2-byte values' chunks, and fewer than float32 values would need."""
    s = _summary(tmp_path, "--policy", policy, "--precision", "bf16")
    assert s["config"]["precision"] == "bf16" and s["config"]["device"] == "cpu"
    assert (s["device"], s["gpu"], s["param_dtype"]) == ("cpu", None, "bfloat16")
    assert s["rounds"] == 4 and math.isfinite(s["final_metric"])
    if policy == "gloo":
        assert s["datagrams_received"] is None
        return
    chunk = s["config"]["chunk_bytes"]
    accepted = (s["datagrams_received"] - sum(s["datagrams_dropped"].values())) / s["rounds"]
    bf16_chunks = math.ceil(s["parameters"] * 2 / chunk)
    fp32_chunks = math.ceil(s["parameters"] * 4 / chunk)
    assert bf16_chunks <= accepted < fp32_chunks, (accepted, bf16_chunks, fp32_chunks)
