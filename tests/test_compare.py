"""`boundedloss compare`: rows, ratios, report files, and usage errors."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import replace

import pytest
import torch

from boundedloss.cli import main
from boundedloss.emulate import available
from boundedloss.experiments.compare import (
    NETWORKS,
    ROW_FIELDS,
    SCENARIOS,
    add_ratios,
    burst_rounds,
    choose_network,
    make_config,
)
from boundedloss.experiments.report import PLOTS
from boundedloss.policy import DEFAULT_P_LOW, FixedBoundPolicy, parse_policy

KERNEL_OK, KERNEL_WHY = available()


def _row(policy, wall, burst, metric):
    return {"policy": policy, "wall_s": wall, "burst_round_ms_mean": burst,
            "final_metric": metric}


def test_ratios_on_synthetic_rows():
    rows = add_ratios([_row("reliable", 200.0, 500.0, 0.95), _row("baseline", 100.0, 300.0, 0.94),
                       _row("dblp", 75.0, 50.0, 0.93)])
    by = {r["policy"]: r for r in rows}
    assert by["baseline"]["speedup_burst_round_vs_baseline"] == 1.0
    assert by["baseline"]["time_reduction_vs_baseline"] == 0.0
    assert by["dblp"]["speedup_burst_round_vs_baseline"] == pytest.approx(6.0)
    assert by["dblp"]["time_reduction_vs_baseline"] == pytest.approx(0.25)
    assert by["reliable"]["time_reduction_vs_baseline"] == pytest.approx(-1.0)
    assert by["reliable"]["speedup_burst_round_vs_baseline"] == pytest.approx(0.6)
    assert by["dblp"]["metric_change_vs_reliable"] == pytest.approx(-0.02)
    assert by["reliable"]["metric_change_vs_reliable"] == 0.0


def test_ratios_without_references():
    rows = add_ratios([_row("dblp", 75.0, None, 0.93), _row("mlt", 80.0, 10.0, 0.9)])
    for r in rows:
        assert r["speedup_burst_round_vs_baseline"] is None
        assert r["time_reduction_vs_baseline"] is None
        assert r["metric_change_vs_reliable"] is None
    rows = add_ratios([_row("baseline", 10.0, None, 0.9), _row("dblp", 5.0, 2.0, 0.9)])
    assert rows[1]["speedup_burst_round_vs_baseline"] is None  # no baseline burst rounds
    assert rows[1]["time_reduction_vs_baseline"] == pytest.approx(0.5)


def test_burst_rounds_follow_the_spec():
    spec = SCENARIOS["microburst"].loss
    assert sorted(burst_rounds(spec, range(100))) == [7, 37, 67, 97]
    assert burst_rounds("bernoulli:0.01", range(60)) == set()
    assert sorted(burst_rounds("burst:rate=0.5,every=10,len=2,offset=3", range(25))) == [
        3, 4, 13, 14, 23, 24]


def test_baseline_is_mlt_at_p_low_and_gloo_runs_lossless():
    sc = SCENARIOS["microburst"]
    arms = {a.label: a for a in sc.arms(("gloo", "mlt", "baseline", "dblp"))}
    cfg = make_config(sc, arms["baseline"], out="x", epochs=2, workers=2, seed=0)
    assert (cfg.loss, cfg.aggregator) == (sc.loss, "zero")
    policy = parse_policy(cfg.policy).make()  # what the run's ranks build
    assert isinstance(policy, FixedBoundPolicy) and policy.p == DEFAULT_P_LOW == 0.008
    cfg = make_config(sc, arms["mlt"], out="x", epochs=2, workers=2, seed=0)
    assert parse_policy(cfg.policy).make().describe() == FixedBoundPolicy().describe()
    assert make_config(sc, arms["gloo"], out="x", epochs=2, workers=2, seed=0).loss == "none"
    assert cfg.probe_copies_max is None  # the transport's default unless asked
    assert make_config(sc, arms["dblp"], out="x", epochs=2, workers=2, seed=0,
                       probe_copies_max=1).probe_copies_max == 1
    assert [a.label for a in sc.arms()] == list(sc.default_policies)
    arm = sc.arms(["mlt:0.05"])[0]  # any policy the command line can write is an arm
    assert arm.label == "mlt:p=0.05" and arm.policy.fixed_bound == 0.05


def test_sweep_arms_cover_every_aggregator_and_rate():
    sc = SCENARIOS["lm-loss"]
    arms = sc.arms()
    assert arms[0].label == "lossless" and str(arms[0].policy) == "reliable"
    assert arms[0].loss == "none"
    lossy = arms[1:]
    assert len(lossy) == len(sc.sweep_rates) * len(sc.sweep_aggregators)
    assert {(a.aggregator, a.hadamard) for a in lossy} == set(sc.sweep_aggregators)
    assert {a.loss_rate for a in lossy} == set(sc.sweep_rates)
    for a in lossy:
        assert a.policy.name == "mlt" and a.policy.fixed_bound >= max(sc.sweep_rates)
        assert a.loss == f"bernoulli:{a.loss_rate:g}"
    assert len({a.label for a in arms}) == len(arms)
    assert "unbiased+hadamard@10%" in {a.label for a in arms}


def test_lm_loss_sharded_on_the_kernel_sets_each_arms_loss_on_the_network():
    """On the kernel network lm-loss's loss rate is the network's: gloo (lossless: the
    reference) and ours each at the kernel's rates, no loss injected in-process; under
    --sharded every arm is an FSDP2 run with no topology and no Hadamard transform."""
    sc = SCENARIOS["lm-loss"].on_kernel().run_as(sharded=True, precision="bf16")
    assert sc.reference == sc.baseline == "gloo@0%" and "FSDP2" in sc.full_description
    arms = sc.arms()
    assert [(a.label, a.policy.name, a.loss, a.loss_rate) for a in arms] == [
        ("gloo@0%", "gloo", "none", 0.0), ("gloo@1%", "gloo", "none", 0.01),
        ("unbiased@1%", "mlt", "none", 0.01), ("unbiased@10%", "mlt", "none", 0.1)]
    for arm in arms:
        cfg = make_config(sc, arm, out="o", epochs=1, workers=4, seed=0)
        cfg.validate()
        assert cfg.sharded and cfg.precision == "bf16" and cfg.topology is None
    # in-process, --sharded drops the sweep's Hadamard arms (FSDP2's shards take none)
    inproc = SCENARIOS["lm-loss"].run_as(sharded=True)
    assert not any(a.hadamard for a in inproc.arms()) and len(inproc.arms()) == 5
    with pytest.raises(ValueError, match="parameter-server scenario"):
        SCENARIOS["incast"].run_as(sharded=True)


def test_every_arm_runs_on_the_device_asked():
    """`compare --device cuda`: every arm's ranks train on the GPU, and rows say so."""
    sc = SCENARIOS["lm-loss"].on_kernel().run_as(sharded=True, precision="bf16",
                                                  device="cuda")
    assert (sc.sharded, sc.precision, sc.device) == (True, "bf16", "cuda")
    assert {make_config(sc, arm, out="o", epochs=1, workers=2, seed=0).device
            for arm in sc.arms()} == {"cuda"}
    assert SCENARIOS["microburst"].run_as().device == "cpu"
    with pytest.raises(ValueError, match="device must be one of"):
        SCENARIOS["microburst"].run_as(device="tpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is visible here")
def test_compare_on_a_gpu_that_is_not_there_stops_before_any_arm(tmp_path, capsys):
    rc = main(["compare", "--scenario", "lm-loss", "--device", "cuda",
               "--json", str(tmp_path / "r.json"), "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "no CUDA device is visible" in err
    assert not (tmp_path / "o").exists()


def test_ratios_against_gloo_are_at_the_same_kernel_loss():
    """A sweep on the kernel network: each arm against gloo at its own loss rate; an arm
    whose rate gloo did not run at gets no figure against gloo."""
    def row(label, system, rate, round_ms, metric):
        return {"policy": label, "transport_policy": system, "loss_rate": rate,
                "network": "kernel", "loss": "none", "wall_s": 10.0, "round_ms_p50": round_ms,
                "final_metric": metric}

    rows = add_ratios([row("gloo@0%", "gloo", 0.0, 20.0, 12.0),
                       row("gloo@1%", "gloo", 0.01, 80.0, 12.0),
                       row("unbiased@1%", "mlt", 0.01, 40.0, 12.06),
                       row("unbiased@10%", "mlt", 0.1, 50.0, 12.12)],
                      baseline="gloo@0%", reference="gloo@0%")
    by = {r["policy"]: r for r in rows}
    assert by["unbiased@1%"]["round_speedup_vs_gloo"] == pytest.approx(2.0)
    assert by["unbiased@1%"]["metric_change_vs_gloo"] == pytest.approx(0.06)
    assert by["unbiased@10%"]["gloo_crossed_same_network"] is False
    assert by["unbiased@10%"]["round_speedup_vs_gloo"] is None
    assert by["unbiased@10%"]["metric_rel_change_vs_reliable"] == pytest.approx(0.01)
    assert by["gloo@1%"]["round_speedup_vs_gloo"] == 1.0


def test_outside_clr_speedup_uses_the_dblp_runs_critical_rounds(tmp_path):
    """Burst rounds inside DBLP's critical regime are left out of the outside-CLR mean,
    for every arm alike."""
    from boundedloss.experiments.compare import Arm, RunResult, summarise

    sc = SCENARIOS["microburst"]

    def run(label, lat, phases=None):
        rounds = [{"round": i, "epoch": 0, "round_ms": v, "round_comm_ms": v / 2,
                   **({"phase": phases[i]} if phases else {})} for i, v in enumerate(lat)]
        return RunResult(label, 0, str(tmp_path), rounds, [],
                         {"wall_s": sum(lat) / 1e3, "final_metric": 0.9,
                          "metric_name": "accuracy"}, burst={1, 3},
                         arm=Arm(label, parse_policy("mlt"), ""))

    d = run("dblp", [10, 500, 10, 50], ["critical", "critical", "relaxed", "relaxed"])
    b = run("baseline", [10, 600, 10, 400])
    clr = [d.critical_rounds()]
    assert clr == [{0, 1}]
    rows = add_ratios([summarise("baseline", [b], sc, clr), summarise("dblp", [d], sc, clr)])
    by = {r["policy"]: r for r in rows}
    assert by["dblp"]["burst_round_ms_mean"] == 275.0
    assert by["dblp"]["burst_round_ms_mean_outside_clr"] == 50.0
    assert by["baseline"]["burst_round_ms_mean_outside_clr"] == 400.0
    assert by["dblp"]["speedup_burst_round_vs_baseline"] == pytest.approx(500 / 275)
    assert by["dblp"]["speedup_burst_round_outside_clr_vs_baseline"] == pytest.approx(8.0)
    assert by["dblp"]["burst_comm_ms_mean_outside_clr"] == 25.0
    assert by["dblp"]["speedup_burst_comm_vs_baseline"] == pytest.approx(500 / 275)
    assert by["dblp"]["speedup_burst_comm_outside_clr_vs_baseline"] == pytest.approx(8.0)


@pytest.mark.parametrize("args, hint", [
    (["--scenario", "nope"], "--scenario"),
    (["--scenario", "microburst", "--policies", "reliable,bogus"], "--policies"),
    (["--scenario", "microburst", "--policies", "mlt=0.01"], "write mlt:0.01"),
    (["--scenario", "microburst", "--policies", ","], "--policies"),
    (["--scenario", "microburst", "--loss", "bernoulli:2"], "--loss"),
    (["--scenario", "lm-loss", "--policies", "dblp"], "--policies"),
    (["--scenario", "random-loss", "--loss", "bernoulli:0.1"], "--loss"),
    (["--scenario", "random-loss", "--network", "kernel"], "--network"),
    (["--scenario", "incast", "--sharded"], "--sharded"),
    (["--scenario", "microburst", "--sharded", "--network", "in-process"], "--sharded"),
    (["--scenario", "lm-loss", "--sharded", "--precision", "fp16"], "--precision"),
    (["--scenario", "microburst", "--policies", "gloo,gloo"], "gloo is named twice"),
    (["--scenario", "incast", "--network", "wan"], "--network"),
    (["--scenario", "lm-loss", "--data", "fashion-mnist"], "trains charlm on text"),
    (["--scenario", "lm-loss", "--model", "cnn"], "trains charlm on text"),
    (["--scenario", "incast", "--credit", "1k"], "--credit 1024"),
    (["--scenario", "incast", "--policies", "tcp-ps,reliable", "--device", "cuda"],
     "runs on the CPU only"),
])
def test_bad_values_are_one_line_usage_errors(tmp_path, capsys, args, hint):
    rc = main(["compare", *args, "--json", str(tmp_path / "r.json"), "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.count("\n") == 1 and err.startswith("boundedloss: error:") and hint in err
    assert not (tmp_path / "r.json").exists()


def test_the_command_lines_choices_are_the_registries():
    """Every choice a command offers is read from its registry, not typed again."""
    from boundedloss.aggregate import AGGREGATORS
    from boundedloss.bench import kernel_loss, transport
    from boundedloss.cli import cli
    from boundedloss.collective import TOPOLOGIES
    from boundedloss.experiments.train import MODELS, TrainConfig
    from boundedloss.policy import parse_policies
    from boundedloss.protocol import TransportConfig

    def option(command: str, name: str):
        cmd = cli
        for part in command.split():
            cmd = cmd.commands[part]
        return next(p for p in cmd.params if p.name == name)

    assert list(option("train", "topology").type.choices) == list(TOPOLOGIES)
    assert list(option("train", "model").type.choices) == list(MODELS)
    assert list(option("train", "aggregator").type.choices) == list(AGGREGATORS)
    assert list(option("compare", "scenario").type.choices) == list(SCENARIOS)
    assert list(option("compare", "network").type.choices) == list(NETWORKS)
    # defaults: train's are a TrainConfig's, whose chunk size is the transport's
    defaults = TrainConfig()
    for name in ("policy", "topology", "model", "aggregator", "epochs", "chunk_bytes", "lr"):
        assert option("train", name).default == getattr(defaults, name), name
    assert defaults.chunk_bytes == TransportConfig().chunk_bytes
    assert option("train", "deadline").default == defaults.receive_deadline
    assert option("bench aggregate", "chunk_bytes").default == TransportConfig().chunk_bytes
    assert parse_policies(option("bench transport", "policies").default) == parse_policies(
        transport.DEFAULT_POLICIES)
    assert parse_policies(option("bench kernel-loss", "systems").default) == parse_policies(
        kernel_loss.DEFAULT_SYSTEMS)


@pytest.mark.parametrize("argv, hint", [
    (["train", "--policy", "tcp"], "unknown policy 'tcp'"),
    (["train", "--policy", "mlt:2"], "must be a fraction"),
    (["bench", "transport", "--policies", "reliable,mlt=0.01"], "write mlt:0.01"),
    (["bench", "transport", "--policies", "gloo"], "gloo does not use"),
    (["bench", "kernel-loss", "--systems", "gloo,nope"], "unknown policy 'nope'"),
])
def test_every_command_reads_a_policy_the_same_way(tmp_path, capsys, argv, hint):
    """train, bench transport and bench kernel-loss share compare's policy spelling:
    a bad one is one line that says how to write it."""
    rc = main([*argv, *(["--json", str(tmp_path / "r.json")] if argv[0] == "bench" else [])])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and hint in err, err
    assert not (tmp_path / "r.json").exists()


@pytest.mark.parametrize("argv, hint", [
    (["train", "--workers", "3", "--loss", "burst:rate=0.8,every=10,len=1,rank=7"],
     "rank=7 does not exist: the run has 3 ranks"),
    (["train", "--deadline", "nan"], "'--deadline': nan is not a finite number"),
    (["train", "--lr", "nan"], "'--lr': nan is not a finite number"),
    (["train", "--lr", "inf"], "'--lr'"),
    (["train", "--out", "{file}/sub"], "cannot be made: {file} is a file"),
    (["compare", "--scenario", "microburst", "--policies", "dblp,dblp", "--out", "{dir}/o",
      "--json", "{dir}/r.json"], "dblp is named twice"),
    (["compare", "--scenario", "microburst", "--workers", "2", "--out", "{dir}/o",
      "--json", "{dir}/r.json", "--loss", "bernoulli:0.01+burst:rate=0.8,every=5,len=1,rank=2"],
     "rank=2 does not exist: the run has 2 ranks"),
    (["compare", "--scenario", "microburst", "--out", "{dir}/o", "--json", "{file}/r.json"],
     "--json {file}/r.json cannot be written"),
    (["demo", "--out", "{file}"], "is a file"),
    (["bench", "transport", "--json", "{file}/x.json"], "cannot be written"),
    (["bench", "kernel-loss", "--systems", "gloo,gloo", "--json", "{dir}/k.json"],
     "gloo is named twice"),
    # (16 KB holds eleven datagrams of 1,500 bytes, but not two at MTU 9,000)
    (["bench", "kernel-loss", "--mtu", "9000", "--credit", "off,16k", "--json",
      "{dir}/k.json"], "--credit 16384"),
    (["sim", "--mtu", "9000", "--credit", "16k"], "--credit 16384"),
    (["sim", "--congestion", "bbr"], "'bbr' is not one of 'off', 'delay'"),
    (["sim", "--cpu-interference", "20"], "'20': give RATE,MEAN_MS"),
    (["sim", "--cpu-interference", "-1,3"], "finite rate and mean duration"),
    (["sim", "--cpu-wake", "-1"], "'-1': give a time in ms"),
    (["sim", "--cpu-wake", "soon"], "'soon': give a time in ms"),
    (["train", "--congestion", "bbr"], "'bbr' is not one of 'off', 'delay'"),
    (["bench", "fairness", "--congestion", "off,bbr", "--json", "{dir}/f.json"],
     "'bbr': choose from off, delay"),
    (["bench", "fairness", "--congestion", "delay,delay", "--json", "{dir}/f.json"],
     "--congestion names delay twice"),
    (["testbed", "up", "--subnet", "127.0.0.0/24"], "not loopback or link-local"),
])
def test_bad_arguments_fail_in_one_line_before_anything_starts(tmp_path, capsys, argv, hint):
    """Numbers finite and in range, ranks that exist, each name once, output folders
    writable: checked by every command before it starts a rank or a testbed."""
    a_file = tmp_path / "plain"
    a_file.write_text("")
    fill = {"file": str(a_file), "dir": str(tmp_path)}
    t0 = time.monotonic()
    rc = main([part.format(**fill) for part in argv])
    err = capsys.readouterr().err
    assert rc != 0 and err.count("\n") == 1 and hint.format(**fill) in err, err
    assert time.monotonic() - t0 < 5  # nothing was started
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plain"]  # nothing was written


def test_network_choice(monkeypatch):
    """microburst and incast run on the kernel testbed when it can (auto) or when asked
    (kernel: an error with the reason when it cannot; auto: in-process, with the reason
    kept for the first line); scenarios without a kernel setup stay in-process under
    auto and refuse kernel."""
    import boundedloss.emulate as emulate

    incast, micro, sweep = (SCENARIOS[n] for n in ("incast", "microburst", "random-loss"))
    from boundedloss.emulate import rootless

    monkeypatch.setattr(rootless, "needed", lambda: False)  # (root: no user namespace)
    monkeypatch.setattr(emulate, "available", lambda: (True, ""))
    k = choose_network(incast, "auto")
    assert (k.network, k.loss) == ("kernel", "none") and "kernel testbed" in k.description
    assert choose_network(incast, "kernel") == k
    assert choose_network(incast, "in-process") is incast
    m = choose_network(micro, "auto")
    assert (m.network, m.loss) == ("kernel", "none") and m.kernel is not None
    assert m.kernel.random_loss == 0.01 and m.kernel.bursts is not None
    assert m.kernel.bursts.rate == 0.8 and m.kernel.bursts.node == "server"
    # every system crosses the kernel network: gloo's arm is not made lossless by hand
    assert {a.label: a.loss for a in m.arms(("gloo", "dblp"))} == {"gloo": "none", "dblp": "none"}
    assert choose_network(sweep, "auto") is sweep
    with pytest.raises(ValueError, match="no kernel-testbed setup"):
        choose_network(sweep, "kernel")
    monkeypatch.setattr(emulate, "available", lambda: (False, "needs root"))
    fell = choose_network(incast, "auto")
    assert fell.network == "in-process"
    assert fell.network_note == "no kernel network here: needs root"
    with pytest.raises(ValueError, match="cannot run here: needs root"):
        choose_network(incast, "kernel")
    # where the cause is known, the note says the one command that fixes it
    monkeypatch.setattr(emulate, "available",
                        lambda: (False, "iptables: Failed to initialize nft: Protocol not "
                                        "supported"))
    note = choose_network(incast, "auto").network_note
    assert note.startswith("no kernel network here: iptables: Failed to initialize nft")
    assert note.endswith("; fix: sudo modprobe nf_tables") and "\n" not in note


def _epochs_run(metric_name, values, walls):
    from boundedloss.experiments.compare import RunResult

    return RunResult(policy="x", repeat=0, out="", rounds=[], summary={"metric_name": metric_name},
                     epochs=[{metric_name: v, "wall_s": w} for v, w in zip(values, walls)])


def test_another_data_set_is_timed_to_its_own_target():
    """--data fashion-mnist: every arm trains on it and is timed to 80% (digits' 95% is
    out of its reach); a scenario without a target keeps none; text scenarios refuse."""
    from boundedloss.experiments.compare import make_config, with_images

    micro = with_images(SCENARIOS["microburst"], "fashion-mnist")
    assert (micro.data, micro.target_metric) == ("fashion-mnist", 0.80)
    assert "fashion-mnist" in micro.on_kernel().full_description
    cfg = make_config(micro, micro.arms(("dblp",))[0], out="x", epochs=1, workers=3, seed=0)
    assert cfg.data == "fashion-mnist" and cfg.model == "mlp"
    assert with_images(SCENARIOS["incast"], "fashion-mnist").target_metric is None
    assert with_images(SCENARIOS["microburst"], "digits").target_metric == 0.95
    cnn = with_images(SCENARIOS["microburst"], "fashion-mnist", "cnn")
    assert (cnn.model, cnn.data, cnn.target_metric) == ("cnn", "fashion-mnist", 0.80)
    assert "CNN instead of the MLP" in cnn.full_description
    with pytest.raises(ValueError, match="charlm"):
        with_images(SCENARIOS["lm-loss"], "digits")


def test_time_to_target_is_the_first_epoch_that_reached_it():
    acc = _epochs_run("accuracy", [0.5, 0.96, 0.94, 0.97], [1.0, 2.0, 3.0, 4.0])
    assert acc.time_to_target(0.95) == 2.0  # the first to reach it, not the last
    assert acc.time_to_target(0.5) == 1.0  # reaching it exactly counts
    assert acc.time_to_target(0.99) is None and acc.time_to_target(None) is None
    ppl = _epochs_run("perplexity", [9.0, 6.0, 4.0], [1.0, 2.0, 3.0])  # lower is better
    assert ppl.time_to_target(6.0) == 2.0 and ppl.time_to_target(3.0) is None


def test_ratios_against_gloo():
    """On the kernel network every system - gloo's TCP too - crosses the same loss:
    the figures against gloo are like for like."""
    rows = [dict(_row("gloo", 16.0, 350.0, 0.9577), time_to_target_s=10.0,
                 normal_round_ms_p50=10.0),
            dict(_row("dblp", 4.0, 25.0, 0.9532), time_to_target_s=2.0,
                 normal_round_ms_p50=12.5),
            dict(_row("mlt", 5.0, None, 0.90), time_to_target_s=None, normal_round_ms_p50=None)]
    for r in rows:
        r.update(network="kernel", loss="none")
    by = {r["policy"]: r for r in add_ratios(rows)}
    assert all(r["gloo_crossed_same_network"] for r in rows)
    assert by["dblp"]["tta_speedup_vs_gloo"] == pytest.approx(5.0)
    assert by["dblp"]["wall_speedup_vs_gloo"] == pytest.approx(4.0)
    assert by["dblp"]["metric_change_vs_gloo"] == pytest.approx(-0.0045)
    assert by["dblp"]["burst_over_normal_round"] == pytest.approx(2.0)
    assert by["gloo"]["tta_speedup_vs_gloo"] == 1.0
    assert by["gloo"]["burst_over_normal_round"] == pytest.approx(35.0)
    assert by["mlt"]["tta_speedup_vs_gloo"] is None  # never reached the target
    assert by["mlt"]["burst_over_normal_round"] is None
    (alone,) = add_ratios([dict(_row("dblp", 4.0, 25.0, 0.95), time_to_target_s=2.0)])
    assert alone["tta_speedup_vs_gloo"] is None and alone["metric_change_vs_gloo"] is None


def test_printed_tables_fit_100_columns_with_nothing_cut():
    """What the command prints for the demo's scenario - the decision table, then the
    burst figures - fits 100 columns without a header or cell cut short."""
    import io

    from rich.console import Console
    from rich.table import Table

    from boundedloss.experiments.report import PRINT_WIDTH, printed_tables, table_cells

    sc = replace(SCENARIOS["microburst"], network="kernel")
    row = {k: 1234.5678 for k in ROW_FIELDS}
    row.update(policy="baseline", burst_rounds=43.0, tta_speedup_vs_gloo=10.12,
               wall_speedup_vs_gloo=10.12, metric_change_vs_gloo=-0.0123,
               time_reduction_vs_baseline=-4.243, delivered_fraction_mean=0.9961)
    tables = printed_tables(sc)
    assert [len(cols) for _, cols in tables] == [7, 9]
    assert {"time_to_target_s", "tta_speedup_vs_gloo", "final_metric"} <= {
        k for k, _, _ in tables[0][1]}
    for title, columns in tables:
        out = io.StringIO()
        console = Console(file=out, width=PRINT_WIDTH)
        t = Table(title=title)
        for _, header, _ in columns:
            t.add_column(header)
        t.add_row(*table_cells(row, columns))
        t.add_row(*table_cells({**row, "policy": "gloo", "ran_lossless": True}, columns))
        console.print(t)
        text = out.getvalue()
        assert "\u2026" not in text, text  # rich's ellipsis: something was cut
        assert max(len(line) for line in text.splitlines()) <= PRINT_WIDTH


def test_demo_falls_back_to_in_process_saying_so_in_its_first_line(tmp_path, monkeypatch, capsys):
    """Where no kernel network can be had, the comparison runs in-process and its first
    line says so, why, and the one command that fixes it; the rows say which network
    ran; gloo, which ran lossless, says so, and no figure stands against it."""
    import boundedloss.emulate as emulate
    from boundedloss.emulate import rootless

    why = "no ip netns on this host [nf_tables: Protocol not supported]"  # (markup-like)
    monkeypatch.setattr(emulate, "available", lambda: (False, why))
    monkeypatch.setattr(rootless, "needed", lambda: False)
    rc = main(["compare", "--scenario", "microburst", "--policies", "gloo,dblp", "--workers",
               "2", "--epochs", "1", "--steps-per-epoch", "2", "--json",
               str(tmp_path / "r.json"), "--out", str(tmp_path / "out")])
    assert rc == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    first = out.splitlines()[0]
    assert "IN-PROCESS" in first and why in first, first
    assert "fix: sudo modprobe nf_tables" in first, first
    assert "gloo (lossless)" in out
    gloo, dblp = json.loads((tmp_path / "r.json").read_text())
    assert (gloo["policy"], gloo["ran_lossless"], dblp["ran_lossless"]) == ("gloo", True, False)
    for row in (gloo, dblp):
        assert row["network"] == "in-process" and row["gloo_crossed_same_network"] is False
        assert {k: v for k, v in row.items() if k.endswith("_vs_gloo") and v is not None} == {}
    report = (tmp_path / "out" / "report.md").read_text()
    assert why in report and "| gloo (lossless) |" in report
    assert "No figure is given against gloo" in report


@pytest.mark.skipif(not KERNEL_OK, reason=f"kernel testbed needs root: {KERNEL_WHY}")
def test_microburst_on_the_kernel_network(tmp_path):
    """Every system - gloo's TCP too - crosses the same kernel network: random loss at
    every node and timed bursts at the server. Burst rounds are the rounds a burst
    overlapped; the time to target is the first epoch's that reached it; the testbed is
    gone afterwards."""
    from boundedloss.emulate import TimedBursts, leftovers
    from boundedloss.experiments.compare import run_compare

    before = set(leftovers())
    sc = choose_network(SCENARIOS["microburst"], "kernel")
    assert sc.kernel is not None
    # bursts half the time, so that a short run surely meets some - of 50%: at 80% a
    # TCP retransmission met 40% loss, and its backoffs once chained past gloo's
    # timeout (a 30 s step seen) - and a target every run reaches at its first epoch
    sc = replace(sc, target_metric=0.0, kernel=replace(
        sc.kernel, bursts=TimedBursts(rate=0.5, every_s=0.04, length_s=0.02)))
    rows, runs = run_compare(sc, sc.arms(("gloo", "dblp")), str(tmp_path), epochs=1,
                             workers=2, steps_per_epoch=20)
    by = {r["policy"]: r for r in rows}
    for name in ("gloo", "dblp"):
        (run,) = runs[name]
        assert by[name]["network"] == "kernel" and run.summary["rounds"] == 20
        assert 0 < len(run.burst) <= 20 and by[name]["burst_rounds"] == len(run.burst)
        assert by[name]["time_to_target_s"] == run.epochs[0]["wall_s"]
        for r in run.rounds:
            assert r["start_mono_s"] < r["end_mono_s"]
    assert by["gloo"]["tta_speedup_vs_gloo"] == 1.0
    assert by["dblp"]["tta_speedup_vs_gloo"] == pytest.approx(
        by["gloo"]["time_to_target_s"] / by["dblp"]["time_to_target_s"])
    assert set(leftovers()) <= before


@pytest.mark.skipif(not KERNEL_OK, reason=f"kernel testbed needs root: {KERNEL_WHY}")
def test_lm_loss_sharded_on_the_kernel_network(tmp_path, capsys):
    """`compare --scenario lm-loss --sharded --network kernel`: every arm an FSDP2 run on
    the testbed, at its own random loss - the kernel drops about that fraction of the
    packets, gloo's TCP included; rows say so; the testbed is gone afterwards."""
    from boundedloss.emulate import leftovers

    before = set(leftovers())
    js = tmp_path / "rows.json"
    rc = main(["compare", "--scenario", "lm-loss", "--sharded", "--network", "kernel",
               "--workers", "2", "--epochs", "1", "--steps-per-epoch", "3",
               "--json", str(js), "--out", str(tmp_path / "out")])
    out = capsys.readouterr().out
    assert rc == 0, out[-2000:]
    assert "FSDP2, fp32" in out
    rows = json.loads(js.read_text())
    assert [(r["policy"], r["loss_rate"]) for r in rows] == [
        ("gloo@0%", 0.0), ("gloo@1%", 0.01), ("unbiased@1%", 0.01), ("unbiased@10%", 0.1)]
    for r in rows:
        assert (r["network"], r["sharded"], r["precision"], r["loss"]) == (
            "kernel", True, "fp32", "none")
        assert r["metric_name"] == "perplexity" and r["final_metric"] > 1
    by = {r["policy"]: r for r in rows}
    assert by["gloo@0%"]["kernel_drop_fraction"] == 0.0
    assert 0.03 < by["unbiased@10%"]["kernel_drop_fraction"] < 0.2
    assert by["gloo@0%"]["metric_rel_change_vs_reliable"] == 0.0
    assert by["unbiased@1%"]["gloo_crossed_same_network"] is True
    assert by["unbiased@1%"]["round_speedup_vs_gloo"] == pytest.approx(
        by["gloo@1%"]["round_ms_p50"] / by["unbiased@1%"]["round_ms_p50"])
    assert by["unbiased@10%"]["round_speedup_vs_gloo"] is None  # (no gloo at 10%)
    config = json.loads((tmp_path / "out" / "runs" / "unbiased-10pct-r0" / "summary.json")
                        .read_text())["config"]
    assert config["sharded"] and config["workers"] == 2
    assert set(leftovers()) <= before


def test_bottleneck_figures_are_deltas_of_the_queue_counters():
    from boundedloss.emulate import QdiscStats
    from boundedloss.experiments.compare import bottleneck_figures

    def q(sent_bytes, sent, dropped):
        return QdiscStats("tbf", sent_bytes, sent, dropped, 0, 0, 0, 0)

    f = bottleneck_figures(q(1_000_000, 1000, 50), q(4_000_000, 3000, 1050))
    assert f == {"bottleneck_sent_mb": 3.0, "bottleneck_dropped": 1000.0,
                 "bottleneck_drop_fraction": pytest.approx(1000 / 3000)}
    assert bottleneck_figures(None, q(1, 1, 0)) == {}


@pytest.mark.skipif(not KERNEL_OK, reason=f"kernel testbed needs root: {KERNEL_WHY}")
def test_incast_on_the_kernel_testbed(tmp_path):
    """`compare --network kernel`: each rank in its own namespace, so the workers'
    pushes really cross the tbf into the server; its counters reach the row, and the
    testbed is gone afterwards."""
    from boundedloss.emulate import leftovers
    from boundedloss.experiments.compare import run_compare

    before = set(leftovers())
    sc = choose_network(SCENARIOS["incast"], "kernel")
    rows, runs = run_compare(sc, sc.arms(("ltp", "tcp-ps")), str(tmp_path), epochs=1,
                             workers=3, steps_per_epoch=3)
    row, tcp = rows
    assert row["network"] == "kernel" and runs["ltp"][0].summary["rounds"] == 3
    grad_mb = 4 * 85_002 / 1e6  # ImageMLP(hidden=256): 64-256-256-10
    # 2 workers x 3 rounds of pushes (LTP may close early: at least half of each)
    assert row["bottleneck_sent_mb"] > 2 * 3 * grad_mb / 2
    assert 0 <= row["bottleneck_drop_fraction"] < 1
    # the parameter server over TCP pushes through the same bottleneck, every byte
    assert tcp["policy"] == "tcp-ps" and tcp["bottleneck_sent_mb"] > 2 * 3 * grad_mb
    # ... and the nodes' TCP counters count its segments (ours: the rendezvous alone,
    # about a fifth as many)
    assert tcp["tcp_out_segs"] > 2 * 3 * grad_mb * 1e6 / 1448
    assert tcp["tcp_out_segs"] > 2 * row["tcp_out_segs"]
    assert tcp["tcp_timeouts_per_round"] == pytest.approx(tcp["tcp_timeouts"] / 3)
    assert {p.name for p in (tmp_path / "runs" / "ltp-r0").glob("rank*.log")} == {
        "rank0.log", "rank1.log", "rank2.log"}
    assert set(leftovers()) <= before


@pytest.mark.skipif(not KERNEL_OK, reason=f"kernel testbed needs root: {KERNEL_WHY}")
def test_incast_collapse_runs_with_credit_and_reports_throughput(tmp_path):
    """`compare --scenario incast-collapse`: our arm runs with the scenario's credit (its
    first pass granted by the server: its first DATA each round is ACKed with a share),
    every row has LTP's training throughput, and tcp-ps, the baseline, is 1.0x itself."""
    from boundedloss.experiments.compare import run_compare

    sc = choose_network(SCENARIOS["incast-collapse"], "kernel")
    assert sc.credit_bytes == 32 * 1024 and sc.baseline == "tcp-ps"
    rows, runs = run_compare(sc, sc.arms(("reliable", "tcp-ps")), str(tmp_path), epochs=1,
                             workers=3, steps_per_epoch=4)
    ours, tcp = rows
    config = runs["reliable"][0].summary["config"]
    assert config["credit_bytes"] == 32 * 1024 and config["mlp_hidden"] == 64
    for row in rows:  # samples: 4 rounds x 3 ranks x 32 a batch, over the rounds' time
        lat = [r["round_ms"] for r in runs[row["policy"]][0].rounds]
        assert row["samples_per_s"] == pytest.approx(4 * 3 * 32 / (sum(lat) / 1e3))
    assert ours["throughput_vs_baseline"] == pytest.approx(
        ours["samples_per_s"] / tcp["samples_per_s"])
    assert ours["bottleneck_sent_mb"] > 0


def test_compare_end_to_end(tmp_path):
    """Tiny run: 2 workers, 2 epochs of 4 rounds; a light burst schedule (rounds 1, 4, 7)
    so every policy meets bursts without the slow 80% retransmission storms. (reliable
    is left out to keep the suite short: the reference-arm arithmetic is tested above.)"""
    out = tmp_path / "report"
    js = tmp_path / "rows.json"
    proc = subprocess.run(
        [sys.executable, "-m", "boundedloss.cli", "compare", "--scenario", "microburst",
         "--policies", "baseline,dblp", "--workers", "2", "--epochs", "2",
         "--steps-per-epoch", "4", "--loss",
         "bernoulli:0.01+burst:rate=0.3,every=3,len=1,offset=1,rank=0",
         "--json", str(js), "--out", str(out)],
        capture_output=True, text=True, timeout=110,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count("done ") == 2  # one progress line per finished run
    rows = json.loads(js.read_text())
    assert [r["policy"] for r in rows] == ["baseline", "dblp"]
    for r in rows:
        assert set(ROW_FIELDS) <= set(r), set(ROW_FIELDS) - set(r)
        assert r["scenario"] == "microburst" and r["metric_name"] == "accuracy"
        assert r["burst_round_ms_mean"] > 0 and r["wall_s"] > 0
        assert r["round_ms_p50"] <= r["round_ms_p99"]
        assert 0 < r["delivered_fraction_mean"] <= 1
        assert 0 <= r["final_metric"] <= 1
        assert r["metric_change_vs_reliable"] is None  # no reliable run to compare with
    by = {r["policy"]: r for r in rows}
    assert by["baseline"]["speedup_burst_round_vs_baseline"] == 1.0
    assert by["baseline"]["time_reduction_vs_baseline"] == 0.0
    assert (by["baseline"]["transport_policy"], by["baseline"]["bound"]) == ("mlt", 0.008)
    d = by["dblp"]
    assert d["speedup_burst_round_vs_baseline"] == pytest.approx(
        by["baseline"]["burst_round_ms_mean"] / d["burst_round_ms_mean"])
    assert d["time_reduction_vs_baseline"] == pytest.approx(
        1 - d["wall_s"] / by["baseline"]["wall_s"])
    report = (out / "report.md").read_text()
    for png in PLOTS.values():
        assert (out / png).stat().st_size > 1000
        assert f"({png})" in report
    assert "boundedloss compare" in report and "| dblp |" in report


def test_sweep_end_to_end_in_process(tmp_path):
    """A two-arm sweep (lossless against zero-fill at 30% loss) through run_compare and
    the report: the lossy arm really loses gradient, the report has the sweep plot."""
    from dataclasses import replace

    from boundedloss.experiments.compare import run_compare
    from boundedloss.experiments.report import SWEEP_PLOT, write_report

    sc = replace(SCENARIOS["random-loss"], sweep_rates=(0.3,),
                 sweep_aggregators=(("zero", False),))
    rows, runs = run_compare(sc, sc.arms(), str(tmp_path), epochs=1, workers=2,
                             steps_per_epoch=3)
    by = {r["policy"]: r for r in rows}
    assert set(by) == {"lossless", "zero@30%"}
    assert by["lossless"]["delivered_fraction_mean"] == 1.0
    lossy = by["zero@30%"]
    assert lossy["loss_rate"] == 0.3 and lossy["aggregator"] == "zero"
    assert 0.4 < lossy["delivered_fraction_mean"] < 0.95  # first pass only, bound 40%
    assert lossy["metric_change_vs_reliable"] == pytest.approx(
        lossy["final_metric"] - by["lossless"]["final_metric"])
    assert by["lossless"]["metric_change_vs_reliable"] == 0.0
    report = write_report(rows, runs, sc, str(tmp_path / "rep"), "cmd", "tiny")
    assert (tmp_path / "rep" / SWEEP_PLOT).stat().st_size > 1000
    assert "| zero@30% |" in report.read_text()


def test_a_rounds_latency_is_its_slowest_ranks_step(tmp_path):
    from boundedloss.experiments.compare import read_run

    (tmp_path / "rounds.jsonl").write_text("".join(
        json.dumps({"round": i, "epoch": 0, "step_ms": v}) + "\n" for i, v in enumerate([5, 7, 9])))
    (tmp_path / "rounds.rank1.jsonl").write_text("".join(
        json.dumps({"round": i, "step_ms": v, "comm_ms": v - 2}) + "\n"
        for i, v in enumerate([6, 3, 30])))
    (tmp_path / "rounds.rank2.jsonl").write_text(json.dumps({"round": 0, "step_ms": 8}) + "\n")
    (tmp_path / "epochs.jsonl").write_text("")
    (tmp_path / "summary.json").write_text(json.dumps(
        {"wall_s": 1.0, "final_metric": 0.5, "metric_name": "accuracy"}))
    res = read_run("mlt", 0, str(tmp_path), "burst:rate=0.8,rounds=2")
    assert [r["round_ms"] for r in res.rounds] == [8, 7, 30]
    assert res.burst == {2}
    assert res.stats()["burst_round_ms_mean"] == 30
    # communication: rank 0 logged none (a gloo run), so there is none to take
    assert "round_comm_ms" not in res.rounds[0] and res.stats()["burst_comm_ms_mean"] is None
    rounds0 = [{"round": i, "epoch": 0, "step_ms": v, "comm_ms": v - 4}
               for i, v in enumerate([5, 7, 9])]
    (tmp_path / "rounds.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rounds0))
    res = read_run("mlt", 0, str(tmp_path), "burst:rate=0.8,rounds=2")
    assert [r["round_comm_ms"] for r in res.rounds] == [4, 3, 28]
    assert res.stats()["burst_comm_ms_mean"] == 28


def test_repeats_alternate_the_order_of_the_arms():
    from boundedloss.experiments.compare import arm_order

    arms = SCENARIOS["microburst"].arms(("reliable", "baseline", "dblp"))
    orders = [[a.label for a in arm_order(arms, k)] for k in range(3)]
    assert orders == [["reliable", "baseline", "dblp"], ["dblp", "baseline", "reliable"],
                      ["reliable", "baseline", "dblp"]]


def test_the_paper_scenario_recovers_by_timeouts_with_a_burst_every_ten_rounds():
    sc = SCENARIOS["microburst-paper"]
    assert sc.recovery == "timeout" and sc.epochs >= 30 and sc.target_metric is not None
    assert "burst:rate=0.8,every=10,len=1" in sc.loss and "rank=0" in sc.loss
    assert sc.default_policies == ("reliable", "baseline", "dblp")
    assert burst_rounds(sc.loss, range(40)) == {7, 17, 27, 37}
    assert SCENARIOS["microburst"].epochs == sc.epochs  # both run long: CLR the minority


def test_burst_frequency_sweep_rewrites_the_round_schedule():
    from boundedloss.experiments.compare import with_burst_every

    sc = SCENARIOS["microburst-paper"]
    for every, expect in ((30, {7, 37}), (5, {2, 7, 12, 17, 22, 27, 32, 37}),
                          (2, set(range(1, 40, 2)))):
        assert burst_rounds(with_burst_every(sc, every).loss, range(40)) == expect
    assert with_burst_every(sc, 5).loss.startswith("bernoulli:0.01+burst:")


def _comm_run(repeat, comm, burst, phases=None):
    from boundedloss.experiments.compare import RunResult

    rounds = [{"round": r, "epoch": r // 2, "round_comm_ms": c,
               "phase": (phases or {}).get(r // 2)} for r, c in enumerate(comm)]
    return RunResult(policy="x", repeat=repeat, out="", rounds=rounds, epochs=[],
                     summary={"metric_name": "accuracy"}, burst=set(burst))


def test_max_single_round_comm_speedup_outside_clr():
    from boundedloss.experiments.compare import max_burst_comm_speedup

    base = _comm_run(0, [10, 80, 10, 60, 10, 90], {1, 3, 5})
    dblp = _comm_run(0, [10, 20, 10, 10, 10, 45], {1, 3, 5},
                     phases={0: "critical", 1: "relaxed", 2: "relaxed"})
    assert max_burst_comm_speedup(base, dblp, set()) == 6.0  # round 3: 60 / 10
    assert max_burst_comm_speedup(base, dblp, {2, 3}) == 4.0  # round 3 in CLR: round 1's
    assert max_burst_comm_speedup(base, dblp, {0, 1, 2, 3, 4, 5}) is None
    assert max_burst_comm_speedup(base, dblp, None) is None  # no DBLP run: no CLR known
    assert dblp.clr_epoch_fraction() == pytest.approx(1 / 3)
    assert base.clr_epoch_fraction() is None


def test_recovery_timeout_is_one_probe_copy(tmp_path, capsys):
    """--recovery timeout is --probe-copies-max 1 (the same simulated rounds, field for
    field); contradicting them is a one-line error."""
    common = ["bench", "burst", "--rates", "0.8", "--seeds", "2"]
    assert main([*common, "--recovery", "timeout", "--json", str(tmp_path / "a.json")]) == 0
    assert main([*common, "--probe-copies-max", "1", "--json", str(tmp_path / "b.json")]) == 0
    assert main([*common, "--json", str(tmp_path / "c.json")]) == 0
    a, b, c = (json.loads((tmp_path / f"{n}.json").read_text()) for n in "abc")
    assert a == b and a != c
    capsys.readouterr()
    rc = main([*common, "--recovery", "timeout", "--probe-copies-max", "4",
               "--json", str(tmp_path / "d.json")])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "contradict" in err


def test_paper_scenario_swept_over_burst_frequency(tmp_path):
    """compare --scenario microburst-paper --burst-every: one comparison per frequency,
    every arm recovering by timeouts; rows say the frequency and the recovery; a sweep
    report beside the per-frequency reports."""
    out, js = tmp_path / "out", tmp_path / "rows.json"
    proc = subprocess.run(
        [sys.executable, "-m", "boundedloss.cli", "compare", "--scenario", "microburst-paper",
         "--policies", "baseline,dblp", "--workers", "2", "--epochs", "2",
         "--steps-per-epoch", "4", "--burst-every", "4,3", "--json", str(js),
         "--out", str(out)], capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(js.read_text())
    assert [(r["burst_every"], r["policy"]) for r in rows] == [
        (4, "baseline"), (4, "dblp"), (3, "baseline"), (3, "dblp")]
    for r in rows:
        assert (r["recovery"], r["probe_copies_max"], r["network"]) == ("timeout", 1,
                                                                      "in-process")
        assert set(ROW_FIELDS) <= set(r) and r["burst_rounds"] > 0
        assert "speedup_burst_comm_outside_clr_max_vs_baseline" in r
    # of rounds 0-7: 3 and 7 (offset 7 % 4), 1, 4 and 7 (offset 7 % 3)
    assert {r["burst_every"]: r["burst_rounds"] for r in rows} == {4: 2, 3: 3}
    for r in rows:  # each run met the bursts of its own frequency
        assert f"every={r['burst_every']}," in r["loss"]
        cfg = json.loads((out / f"every{r['burst_every']}" / "runs" / f"{r['policy']}-r0"
                          / "summary.json").read_text())["config"]
        assert f"every={r['burst_every']}," in cfg["loss"]
    for every in (4, 3):
        assert (out / f"every{every}" / "report.md").exists()
    assert "| 3 | dblp |" in (out / "sweep.md").read_text()


def test_compare_runs_every_policy_without_the_loss_guard():
    """The published systems have no guard; with it a bound below the network's loss
    would run as reliable, and the comparison would not be of the policies."""
    sc = SCENARIOS["microburst-paper"]
    for arm in sc.arms():
        cfg = make_config(sc, arm, out="x", epochs=1, workers=3, seed=0)
        assert cfg.guard_rounds == 0 and cfg.guard() is not None and not cfg.guard().enabled


def _trained(sc, policies, tmp_path):
    """Arms of ``sc`` and runs as if each had trained once: six rounds, bursts on rounds 1
    and 4, the target reached at the second epoch (gloo slowest to it)."""
    from boundedloss.experiments.compare import RunResult

    arms = sc.arms(policies)
    shape = {"gloo": (20.0, [10, 40, 10, 10, 40, 10]),
             "baseline": (8.0, [12, 300, 12, 12, 300, 12]),
             "dblp": (4.0, [12, 30, 12, 12, 30, 12])}
    runs = {}
    for arm in arms:
        wall, lat = shape[arm.label]
        rounds = [{"round": i, "epoch": i // 3, "round_ms": v,
                   **({} if arm.label == "gloo" else {"round_comm_ms": v / 2, "bound": 0.1})}
                  for i, v in enumerate(lat)]
        epochs = [{"accuracy": 0.9, "wall_s": wall / 2}, {"accuracy": 0.96, "wall_s": wall}]
        runs[arm.label] = [RunResult(arm.label, 0, str(tmp_path), rounds, epochs,
                                     {"wall_s": wall, "final_metric": 0.96,
                                      "metric_name": "accuracy"}, burst={1, 4}, arm=arm)]
    return arms, runs


def _report_cells(report: str) -> list[dict[str, str]]:
    """The Markdown table of a report as one {header: cell} per row."""
    lines = [ln for ln in report.splitlines() if ln.startswith("| ")]
    split = [[c.strip() for c in ln.strip("|").split("|")] for ln in lines]
    return [dict(zip(split[0], cells)) for cells in split[1:]]


def test_no_ratio_stands_against_a_gloo_that_ran_lossless(tmp_path):
    """In-process loss (the demo's fallback) cannot reach gloo's TCP: gloo's row says it
    ran lossless, every figure against it is None in the rows and empty in the printed
    tables and the report, and the burst figures against the baseline - our transports,
    which met the same in-process loss - still stand."""
    from boundedloss.experiments.compare import compare_rows
    from boundedloss.experiments.report import printed_tables, table_cells, write_report

    sc = SCENARIOS["microburst"]
    assert sc.network == "in-process"
    arms, runs = _trained(sc, ("gloo", "baseline", "dblp"), tmp_path)
    rows = compare_rows(sc, arms, runs)
    by = {r["policy"]: r for r in rows}
    assert [r["ran_lossless"] for r in rows] == [True, False, False]
    for r in rows:
        assert r["gloo_crossed_same_network"] is False
        vs_gloo = [k for k in r if k.endswith("_vs_gloo")]
        assert len(vs_gloo) >= 3 and all(r[k] is None for k in vs_gloo), r
    assert by["dblp"]["speedup_burst_round_vs_baseline"] == pytest.approx(10.0)
    assert by["dblp"]["time_reduction_vs_baseline"] == pytest.approx(0.5)
    assert json.loads(json.dumps(rows))[1]["tta_speedup_vs_gloo"] is None  # JSON null

    (_, decide), (_, burst) = printed_tables(sc)
    printed = {r["policy"]: dict(zip((h for _, h, _ in decide), table_cells(r, decide)))
               for r in rows}
    assert printed["gloo"]["system"] == "gloo (lossless)"
    assert printed["dblp"]["system"] == "dblp"
    for cells in printed.values():
        assert [v for h, v in cells.items() if "vs gloo" in h] == ["-", "-", "-"]
        assert cells["to target s"] != "-"
    assert dict(zip((h for _, h, _ in burst), table_cells(by["dblp"], burst)))[
        "vs base"] == "10.00x"

    report = write_report(rows, runs, sc, str(tmp_path / "rep"), "cmd", "tiny").read_text()
    table = _report_cells(report)
    assert [t["policy"] for t in table] == ["gloo (lossless)", "baseline", "dblp"]
    assert all(t["time to target vs gloo"] == "-" for t in table)
    assert table[2]["burst speedup vs baseline"] == "10.00"
    assert "No figure is given against gloo" in report
    assert "its ratio is gloo's time" not in report


def test_ratios_against_gloo_where_it_crossed_the_same_network(tmp_path):
    """On the kernel network gloo crosses the same loss as the others: its row is plain
    and every figure against it stands. With in-process loss on top for our transports
    alone, it did not: none stands, though gloo did not run lossless."""
    from boundedloss.experiments.compare import compare_rows, with_loss
    from boundedloss.experiments.report import DECISION_COLUMNS, table_cells, write_report

    sc = SCENARIOS["microburst"].on_kernel()
    arms, runs = _trained(sc, ("gloo", "baseline", "dblp"), tmp_path)
    by = {r["policy"]: r for r in compare_rows(sc, arms, runs)}
    assert all(r["gloo_crossed_same_network"] and not r["ran_lossless"] for r in by.values())
    assert by["dblp"]["tta_speedup_vs_gloo"] == pytest.approx(5.0)  # 20 s / 4 s
    assert by["dblp"]["wall_speedup_vs_gloo"] == pytest.approx(5.0)
    assert by["dblp"]["metric_change_vs_gloo"] == 0.0
    assert table_cells(by["gloo"], DECISION_COLUMNS)[:4] == ["gloo", "20.0", "20.0", "1.00x"]
    report = write_report(list(by.values()), runs, sc, str(tmp_path / "rep"), "cmd",
                          "tiny").read_text()
    assert [t["time to target vs gloo"] for t in _report_cells(report)] == [
        "1.00", "2.50", "5.00"]
    assert "its ratio is gloo's time" in report and "No figure is given" not in report

    on_top = with_loss(sc, "bernoulli:0.01")
    arms, runs = _trained(on_top, ("gloo", "dblp"), tmp_path)
    rows = compare_rows(on_top, arms, runs)
    assert [(r["ran_lossless"], r["gloo_crossed_same_network"]) for r in rows] == [
        (False, False), (False, False)]
    assert rows[1]["tta_speedup_vs_gloo"] is None and rows[1]["metric_change_vs_gloo"] is None
