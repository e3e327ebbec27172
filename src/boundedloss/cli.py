"""The `boundedloss` command line."""

from __future__ import annotations

import os
import sys
from typing import Any

import click
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from . import checks, native
from .aggregate import AGGREGATORS
from .bench import aggregate as aggregate_bench
from .bench import kernel_loss as kernel_loss_bench
from .bench import transport as transport_bench
from .bench import write_json
from .checks import FiniteFloatRange
from .collective import TOPOLOGIES, TRANSPOSE_UP_TO
from .experiments.compare import DEFAULT_NETWORK, NETWORKS, SCENARIOS
from .experiments.train import DEVICES, IMAGE_DATA, MODELS, PRECISIONS, TrainConfig
from .policy import SYSTEM_NAMES, PolicySpec, parse_policies, parse_policy
from .protocol import RECOVERY_MODES, probe_copies_for
from .protocol.credit import NAMED_CREDITS, CreditSetting
from .wire import DEFAULT_CHUNK_BYTES, MAX_CHUNK_BYTES

console = Console()
if not console.is_terminal:  # piped or logged: do not squeeze tables into 80 columns
    console = Console(width=160)
err_console = Console(stderr=True)

#: the defaults of ``boundedloss train`` are a TrainConfig's
TRAIN_DEFAULTS = TrainConfig()
MIN_CHUNK_BYTES = 16  # the commands' floor (the wire takes 1; each datagram adds a 48-byte header)

POLICY_HELP = (f"Each NAME ({', '.join(SYSTEM_NAMES)}), NAME:VALUE (a policy's leading "
               "parameter: mlt:0.02 is P = 2%) or NAME:KEY=VALUE[:KEY=VALUE...].")


def _parse_list(text: str, cast, what: str) -> tuple:
    try:
        values = tuple(cast(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise click.BadParameter(f"{what} must be a comma-separated list, got {text!r}") from None
    if not values:
        raise click.BadParameter(f"{what} is empty")
    return values


def _json_file(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """A --json path must be writable before a run starts, not after it ends."""
    if value is not None:
        _check(checks.writable_file, value, "--json")
    return value


def _interference(ctx: click.Context, param: click.Parameter, value: str):
    """--cpu-interference parsed once, here (None: the preset's)."""
    from .net.cpu import Interference

    if value == "preset":
        return None
    try:
        return Interference.parse(value)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None


def _wake(ctx: click.Context, param: click.Parameter, value: str) -> float | None:
    """--cpu-wake parsed once, here: seconds (None: the preset's)."""
    from .net.cpu import parse_wake_ms

    if value == "preset":
        return None
    try:
        return parse_wake_ms(value)
    except ValueError as e:
        raise click.BadParameter(f"{e}, or preset") from None


def _output_file(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """An output file must be writable before a run starts, not after it ends."""
    if value is not None:
        _check(checks.writable_file, value, param.opts[0])
    return value


#: compare's --credit default: each scenario's own
SCENARIO_CREDIT = "scenario"


def _size(text: str | None, option: str | None = None) -> int | None:
    """A size in bytes as tc writes it (256k, 4m), or None for none; one line if bad."""
    if text is None:
        return None
    from .emulate.units import parse_size

    try:
        return parse_size(text)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint=option) from None


def _optional_size(ctx: click.Context, param: click.Parameter, value: str | None
                   ) -> int | None:
    return _size(value)


def _bottleneck_spec(ctx: click.Context, param: click.Parameter, value: str | None):
    """``RATE[,BURST[,LIMIT]]`` in tc's units: a token-bucket bottleneck (None: none)."""
    if value is None:
        return None
    from .emulate.qdisc import Bottleneck

    parts = [p.strip() for p in value.split(",")]
    if len(parts) > 3 or not all(parts):
        raise click.BadParameter(f"{value!r}: give RATE[,BURST[,LIMIT]], e.g. 100mbit,32kb,64kb")
    try:
        return Bottleneck(*parts)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None


def _credit_setting(text: str) -> CreditSetting:
    """One ``--credit`` value: off, auto, or a size in bytes as tc writes it (64k, 1m)."""
    named = NAMED_CREDITS.get(text.strip().lower())
    return named if named is not None else CreditSetting(_size(text, "--credit"))


def _credit_size(ctx: click.Context, param: click.Parameter,
                 value: str) -> CreditSetting | str:
    """``--credit`` (train, compare, sim): off, auto or a size."""
    if value == SCENARIO_CREDIT and param.default == SCENARIO_CREDIT:
        return value
    return _credit_setting(value)


def _parse_credits(text: str, mtu: int) -> tuple[CreditSetting, ...]:
    """bench's ``--credit``: sizes, off and/or auto, each once, each holding two of the
    largest DATA datagrams at ``mtu``."""
    credits = tuple(_credit_setting(part) for part in _parse_list(text, str.strip, "--credit"))
    for credit in credits:
        _check(checks.credit_fits, credit.budget_bytes, mtu)
    _check(checks.distinct, [str(c) for c in credits], "--credit")
    return credits


def _out_folder(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    if value is not None:
        _check(checks.writable_folder, value, "--out")
    return value


def _check(check, *args: object) -> None:
    """Run one of ``checks``' checks; its ValueError becomes a one-line usage error."""
    try:
        check(*args)
    except ValueError as e:
        raise click.UsageError(str(e)) from None


def _parse_choices(text: str, choices: dict[str, bool], what: str) -> tuple[bool, ...]:
    """A comma-separated list of ``choices`` keys, as their values, each once."""
    names = _parse_list(text, str.strip, what)
    bad = [n for n in names if n not in choices]
    if bad:
        raise click.BadParameter(f"{bad[0]!r}: choose from {', '.join(choices)}",
                                 param_hint=what)
    if len(set(names)) != len(names):
        raise click.BadParameter(f"{text!r} names one twice", param_hint=what)
    return tuple(choices[n] for n in names)


def _joined(values) -> str:
    """A default list as the command line writes it."""
    return ",".join(f"{v:g}" if isinstance(v, float) else str(v) for v in values)


class PolicyParam(click.ParamType):
    """A policy (or, with ``many``, comma-separated policies) as
    :func:`~boundedloss.policy.parse_policy` reads it: one spelling for every command."""

    name = "policy"

    def __init__(self, many: bool = False):
        self.many = many

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> Any:
        if isinstance(value, PolicySpec) or (self.many and isinstance(value, tuple)):
            return value
        try:
            return parse_policies(value) if self.many else parse_policy(value)
        except ValueError as e:
            self.fail(str(e), param, ctx)


def _transport_table(rows, title: str) -> Table:
    t = Table(title=title)
    for col in ("chunk B", "message", "loss", "policy", "offload", "path", "auth",
                "goodput Gb/s", "vs no auth", "ceiling Gb/s", "ratio", "retx rounds",
                "retx frac", "delivered"):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(
            f"{r.chunk_bytes:,}",
            f"{r.message_bytes >> 20} MB",
            f"{r.loss:.0%}",
            r.policy,
            "on" if r.offload else "off",
            "native" if r.native else "python",
            "on" if r.auth else "off",
            f"{r.goodput_gbps:.2f}",
            "-" if r.auth_ratio is None else f"{r.auth_ratio:.2f}",
            f"{r.ceiling_gbps:.2f}",
            f"{r.ratio_to_ceiling:.2f}",
            f"{r.retransmit_rounds:g}",
            f"{r.retransmitted_fraction:.3f}",
            f"{r.delivered_fraction:.4f}",
        )
    return t


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="boundedloss")
def cli() -> None:
    """Bounded-loss gradient transport over UDP for data-parallel training."""


@cli.command()
@click.option("--out", "out_dir", default="runs/demo", show_default=True,
              callback=_out_folder,
              type=click.Path(file_okay=False), help="Report directory.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None,
              callback=_json_file,
              help="Rows as JSON (default: OUT/compare.json).")
def demo(out_dir: str, json_path: str | None) -> None:
    """The default comparison: `compare --scenario microburst` with every system, gloo
    included, on the kernel network (root, or a user namespace of its own); in-process
    loss only where no kernel network can be had (its first line says so)."""
    json_path = json_path or os.path.join(out_dir, "compare.json")
    _run_compare("microburst", None, json_path, out_dir, 1, None, None, 0, None, None,
                 _command_line(f"boundedloss demo --out {out_dir}"), network=DEFAULT_NETWORK,
                 title="boundedloss demo")


@cli.command()
@click.pass_context
def doctor(ctx: click.Context) -> None:
    """What the demo rests on, one line each: the compiled data path, authentication
    (OpenSSL), the kernel network (root, rootless, or why not and the command that fixes
    it) and a GPU. Exit status 1 when something the demo needs is broken."""
    from . import doctor as checkup

    checkup.own_user_namespace()  # without root: probe where the demo would build it
    findings = checkup.run_checks()
    for finding in findings:
        console.print(checkup.markup(finding), soft_wrap=True)
    if any(f.broken for f in findings):
        ctx.exit(1)


@cli.group()
def bench() -> None:
    """Benchmarks: print a table and write JSON."""


@bench.command("transport")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), required=True,
              callback=_json_file,
              help="Write the rows here (a JSON list).")
@click.option("--sizes", default=_joined(transport_bench.DEFAULT_MESSAGE_MB),
              show_default=True, help="Message sizes in MB.")
@click.option("--chunks", default=_joined(transport_bench.DEFAULT_CHUNK_SIZES),
              show_default=True, help="Chunk payload bytes.")
@click.option("--losses", default=_joined(transport_bench.DEFAULT_LOSSES),
              show_default=True, help="Injected loss rates.")
@click.option("--policies", type=PolicyParam(many=True),
              default=",".join(transport_bench.DEFAULT_POLICIES), show_default=True,
              help="Comma-separated policies, not gloo. " + POLICY_HELP)
@click.option("--offload", default="on,off", show_default=True,
              help="UDP segmentation offload and receive coalescing: on and/or off.")
@click.option("--paths", default="native,python", show_default=True,
              help="Data paths: native (compiled) and/or python (the reference).")
@click.option("--auth", "auth", default="on,off", show_default=True,
              help="Authenticated datagrams (a training job's default): on and/or off.")
@click.option("--repeats", default=3, show_default=True, type=click.IntRange(1, 50),
              help="Interleaved repeats; the median is reported.")
def bench_transport(json_path, sizes, chunks, losses, policies, offload, paths, auth,
                    repeats) -> None:
    """Goodput of message transfers on loopback against the machine's own limit."""
    offloads = _parse_choices(offload, {"on": True, "off": False}, "--offload")
    native_paths = _parse_choices(paths, {"native": True, "python": False}, "--paths")
    auths = _parse_choices(auth, {"on": True, "off": False}, "--auth")
    if any(native_paths) and not native.enabled():
        raise click.BadParameter(f"the compiled data path is not in use ({native.status()}); "
                                 "measure --paths python", param_hint="--paths")
    if any(native_paths) and any(auths) and not native.authenticates():
        raise click.BadParameter(native.AUTH_FALLBACK + "; measure --auth off or --paths "
                                 "python", param_hint="--auth")
    sizes_t = _parse_list(sizes, int, "--sizes")
    chunks_t = _parse_list(chunks, int, "--chunks")
    losses_t = _parse_list(losses, float, "--losses")
    if any(s <= 0 or s > 1024 for s in sizes_t):
        raise click.BadParameter("message sizes must be 1..1024 MB", param_hint="--sizes")
    if any(not MIN_CHUNK_BYTES <= c <= MAX_CHUNK_BYTES for c in chunks_t):
        raise click.BadParameter(f"chunk sizes must be {MIN_CHUNK_BYTES}..{MAX_CHUNK_BYTES}",
                                 param_hint="--chunks")
    if any(not 0 <= p < 1 for p in losses_t):
        raise click.BadParameter("loss rates must be in [0, 1)", param_hint="--losses")
    if not all(spec.uses_transport for spec in policies):
        raise click.BadParameter("gloo does not use the bounded-loss transport",
                                 param_hint="--policies")
    pols = tuple(str(spec) for spec in policies)
    _check(checks.distinct, pols, "--policies")
    with console.status("measuring...") as status:
        rows = transport_bench.run_transport_bench(
            message_mb=sizes_t, chunk_sizes=chunks_t, losses=losses_t, policies=pols,
            offloads=offloads, native_paths=native_paths, auths=auths, repeats=repeats,
            progress=lambda msg: status.update(msg),
        )
    console.print(_transport_table(rows, f"transport goodput (median of {repeats})"))
    write_json(rows, json_path)
    console.print(f"rows written to {json_path}")


@bench.command("aggregate")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), required=True,
              callback=_json_file,
              help="Write the rows here (a JSON list).")
@click.option("--losses", default=_joined(aggregate_bench.DEFAULT_LOSSES),
              show_default=True, help="Chunk loss rates per worker.")
@click.option("--workers", default=aggregate_bench.DEFAULT_WORKERS, show_default=True,
              type=click.IntRange(2, 64))
@click.option("--chunk-bytes", default=DEFAULT_CHUNK_BYTES, show_default=True,
              type=click.IntRange(MIN_CHUNK_BYTES, MAX_CHUNK_BYTES))
@click.option("--patterns", default=aggregate_bench.DEFAULT_PATTERNS,
              show_default=True, type=click.IntRange(1, 1000),
              help="Seeded loss patterns averaged per row.")
@click.option("--seed", default=0, show_default=True, type=int)
def bench_aggregate(json_path, losses, workers, chunk_bytes, patterns, seed) -> None:
    """Error and speed of each aggregator on a real gradient (MLP on sklearn digits)."""
    losses_t = _parse_list(losses, float, "--losses")
    if any(not 0 <= p < 1 for p in losses_t):
        raise click.BadParameter("loss rates must be in [0, 1)", param_hint="--losses")
    with console.status("measuring...") as status:
        rows = aggregate_bench.run_aggregate_bench(
            losses=losses_t, workers=workers, chunk_bytes=chunk_bytes, patterns=patterns,
            seed=seed, progress=lambda msg: status.update(msg),
        )
    t = Table(title=f"aggregators on a real gradient ({rows[0].elements:,} floats, "
                    f"{workers} workers, {chunk_bytes} B chunks)")
    for col in ("aggregator", "hadamard", "loss", "rel L2 err", "max err", "GB/s"):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(r.aggregator, "yes" if r.hadamard else "no", f"{r.loss:.0%}",
                  f"{r.rel_l2_error:.4f}", f"{r.max_abs_error:.4f}", f"{r.throughput_gbs:.2f}")
    console.print(t)
    write_json(rows, json_path)
    console.print(f"rows written to {json_path}")
    speed = aggregate_bench.run_hadamard_speed()
    t = Table(title=f"Hadamard dispersion on a {speed[0].bucket_bytes >> 20} MB float32 "
                    f"bucket (median of {speed[0].repeats})")
    for col in ("operation", "path", "GB/s"):
        t.add_column(col, justify="right")
    for h in speed:
        t.add_row(h.operation, "native" if h.native else "numpy", f"{h.gbs:.2f}")
    console.print(t)
    speed_path = _beside(json_path, "hadamard")
    write_json(speed, speed_path)
    console.print(f"Hadamard rows written to {speed_path}")


def _beside(path: str, what: str) -> str:
    """``runs/agg.json`` -> ``runs/agg.what.json``: a second table's rows."""
    stem, dot, ext = path.rpartition(".")
    return f"{stem}.{what}.{ext}" if dot else f"{path}.{what}"


@bench.command("kernel-loss")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), required=True,
              callback=_json_file,
              help="Write the rows here (a JSON list).")
@click.option("--losses", default=_joined(kernel_loss_bench.DEFAULT_LOSSES),
              show_default=True,
              help="Kernel drop rates (nf_tables, every namespace, TCP and UDP).")
@click.option("--systems", type=PolicyParam(many=True),
              default=",".join(kernel_loss_bench.DEFAULT_SYSTEMS), show_default=True,
              help="Comma-separated. " + POLICY_HELP)
@click.option("--elements", default=kernel_loss_bench.DEFAULT_ELEMENTS,
              show_default=True, type=click.IntRange(1, 1 << 28),
              help="float32 values exchanged per round.")
@click.option("--rounds", default=kernel_loss_bench.DEFAULT_ROUNDS, show_default=True,
              type=click.IntRange(1, 100_000))
@click.option("--topology", "topologies", default=",".join(kernel_loss_bench.DEFAULT_TOPOLOGIES),
              show_default=True,
              help=f"boundedloss collectives, comma-separated: {', '.join(TOPOLOGIES)}.")
@click.option("--mtu", default=kernel_loss_bench.DEFAULT_MTU, show_default=True,
              type=click.IntRange(576, 65535),
              help="The testbed links' MTU (9000: jumbo frames); chunks follow it.")
@click.option("--auth", "auth", default="on", show_default=True,
              help="boundedloss's datagrams authenticated (a training job's default): on "
                   "and/or off. Gloo authenticates nothing.")
@click.option("--bare/--no-bare", default=True, show_default=True,
              help="At 0% loss, first the machine's own limit: a bare-udp row, the "
                   "transpose allreduce's datagrams with the same offloads and nothing "
                   "else.")
@click.option("--repeats", default=1, show_default=True, type=click.IntRange(1, 50),
              help="Runs of every system, interleaved (every other repeat in reverse "
                   "order); a row's figures pool the rounds of all of them.")
@click.option("--ranks", default=kernel_loss_bench.DEFAULT_RANKS, show_default=True,
              type=click.IntRange(2, kernel_loss_bench.MAX_RANKS),
              help="The world: rank 0 in the server's namespace, one worker namespace "
                   "per other rank.")
@click.option("--credit", "credits", default="off", show_default=True,
              help="Our transport's receiver-driven credit, comma-separated, an arm each: "
                   "sizes (e.g. 256k), auto (each receiver sizes its own from the overflows "
                   "it sees) and/or off.")
def bench_kernel_loss(json_path, losses, systems, elements, rounds, topologies, mtu,
                      auth, bare, repeats, ranks, credits) -> None:
    """Round latency of a gradient exchange among --ranks ranks under real kernel loss
    (root, or a user namespace of its own where the kernel allows one)."""
    from .emulate import TestbedError, rootless

    losses_t = _parse_list(losses, float, "--losses")
    if any(not 0 <= p < 1 for p in losses_t):
        raise click.BadParameter("loss rates must be in [0, 1)", param_hint="--losses")
    systems_t = tuple(str(spec) for spec in systems)
    _check(checks.distinct, systems_t, "--systems")
    auths = _parse_choices(auth, {"on": True, "off": False}, "--auth")
    credits_t = _parse_credits(credits, mtu)
    topologies_t = _parse_list(topologies, str.strip, "--topology")
    bad = [t for t in topologies_t if t not in TOPOLOGIES]
    if bad or len(set(topologies_t)) != len(topologies_t):
        raise click.BadParameter(f"{topologies!r}: choose from {', '.join(TOPOLOGIES)}, "
                                 "each once", param_hint="--topology")
    if rootless.needed():
        rootless.reexec()  # the same command as root of a user namespace of its own
    try:
        with console.status("measuring...") as status:
            rows = kernel_loss_bench.run_kernel_loss_bench(
                losses=losses_t, systems=systems_t, elements=elements, rounds=rounds,
                topologies=topologies_t, mtu=mtu, auths=auths, bare=bare, repeats=repeats,
                ranks=ranks, credits=credits_t, progress=lambda m: status.update(m))
    except TestbedError as e:
        raise click.ClickException(str(e)) from e
    t = Table(title=f"{ranks}-rank exchange of {elements * 4 / 1e6:.1f} MB, kernel loss, "
                    f"MTU {mtu:,}" + (f", {rounds} rounds x {repeats} interleaved repeats"
                                      if repeats > 1 else ""))
    for col in ("system", "topology", "auth", "credit", "loss", "p50 ms", "p99 ms", "max ms",
                "mean ms", "delivered"):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(r.system, r.topology, r.auth,
                  str(CreditSetting(r.credit_bytes, r.credit_adaptive)),
                  f"{r.loss * 100:g}%", f"{r.p50_ms:.1f}",
                  f"{r.p99_ms:.1f}", f"{r.max_ms:.1f}", f"{r.mean_ms:.1f}",
                  f"{r.delivered_fraction:.4f}")
    console.print(t)
    write_json(rows, json_path)
    console.print(f"rows written to {json_path}")


CREDIT_HELP = ("Receiver-driven credit: the DATA bytes all senders toward one receiver "
               "may have in flight together (e.g. 64k; keep it under the queue in front "
               "of the receiver); auto: each receiver sizes its own, unbounded until a "
               "queue in front of it overflows; or off.")


CONGESTION_HELP = ("Sender-side congestion control: off (a first pass goes as fast as the "
                   "window and any credit allow) or delay (every pass paced at a rate per "
                   "peer a delay loop sets - random loss never lowers it - with a "
                   "TCP-fair floor beside loss-based flows). Both ends must say the same.")


def congestion_option():
    """``--congestion off|delay`` (train, sim), one of CONGESTION_MODES."""
    from .protocol.congestion import CONGESTION_MODES

    return click.option("--congestion", default="off", show_default=True,
                        type=click.Choice(list(CONGESTION_MODES)), help=CONGESTION_HELP)


def _check_ranks(ranks: set[int], world: int, what: str, hint: str) -> None:
    """A rank an option names must be in the smallest world simulated (one line if not)."""
    if ranks and max(ranks) >= world:
        raise click.BadParameter(f"{what}{max(ranks)}, but {world} workers have ranks 0 "
                                 f"to {world - 1}", param_hint=hint)


def _parse_congestions(text: str) -> tuple[str, ...]:
    """bench's ``--congestion``: CONGESTION_MODES names, comma-separated, each once."""
    from .protocol.congestion import CONGESTION_MODES

    names = _parse_list(text, str.strip, "--congestion")
    bad = [n for n in names if n not in CONGESTION_MODES]
    if bad:
        raise click.BadParameter(f"{bad[0]!r}: choose from {', '.join(CONGESTION_MODES)}",
                                 param_hint="--congestion")
    _check(checks.distinct, names, "--congestion")
    return tuple(names)


def credit_option(default: str = "off"):
    """``--credit SIZE|auto|off`` (train, compare, sim), parsed to a CreditSetting."""
    return click.option("--credit", default=default, show_default=True,
                        callback=_credit_size, help=CREDIT_HELP)


def probe_copies_option(fn):
    """``--recovery`` and ``--probe-copies-max`` (train, compare, bench burst), passed on
    as one ``probe_copies_max`` (None: not set on the command line)."""

    def resolve(ctx: click.Context, param: click.Parameter, value: int | None) -> int | None:
        recovery = ctx.params.pop("recovery", None)
        if recovery is None:
            return value
        implied = probe_copies_for(recovery)
        if value is not None and value != implied:
            raise click.BadParameter(
                f"--recovery {recovery} and --probe-copies-max {value} contradict each "
                "other: give one", param_hint="--probe-copies-max")
        return implied

    fn = click.option(
        "--probe-copies-max", default=None, type=click.IntRange(1, 1024), callback=resolve,
        help="Most copies a PROBE goes in (default: the transport's, 32); 1 is "
             "--recovery timeout.")(fn)
    return click.option(
        "--recovery", type=click.Choice(list(RECOVERY_MODES)), default=None, is_eager=True,
        expose_value=False,
        callback=lambda ctx, param, value: ctx.params.__setitem__("recovery", value),
        help="How a lost PROBE or its lost answer is recovered: copies = the transport's "
             "own (a PROBE goes in as many copies as the measured loss asks); timeout = "
             "one copy, so a loss costs a retransmission timeout, as in transports that "
             "recover by timeouts (the published DBLP baseline). Default: the "
             "scenario's (compare), else copies.")(fn)


@bench.command("fairness")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), required=True,
              callback=_json_file, help="Write the rows here (a JSON list).")
@click.option("--credit", "credits", default="off,48k", show_default=True,
              help="boundedloss's receiver-driven credit, comma-separated, a run each: "
                   "sizes, auto and/or off.")
@click.option("--congestion", "congestions", default="off", show_default=True,
              help="boundedloss's congestion control, comma-separated (off, delay): a run "
                   "for each with each --credit.")
@click.option("--seconds", default=8.0, show_default=True, type=FiniteFloatRange(3.0, 600.0),
              help="How long both flows run, each run.")
@click.option("--rate", default="100mbit", show_default=True,
              help="The bottleneck's rate (tc's units: 100mbit, 1gbit).")
@click.option("--queue", default="64kb", show_default=True,
              help="The bottleneck's queue (tc's units: 64kb).")
def bench_fairness(json_path, credits, congestions, seconds, rate, queue) -> None:
    """One boundedloss transfer and one TCP bulk flow share a bottleneck on the kernel
    testbed: each one's share of it (root, or a user namespace of its own)."""
    from dataclasses import replace

    from .bench import fairness
    from .emulate import TestbedError, rootless

    credits_t = _parse_credits(credits, 1500)
    congestions_t = _parse_congestions(congestions)
    try:
        bottleneck = replace(fairness.DEFAULT_BOTTLENECK, rate=rate, limit=queue)
        bottleneck.check_mtu(1500)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--rate/--queue") from None
    if rootless.needed():
        rootless.reexec()
    try:
        with console.status("measuring...") as status:
            rows = fairness.run_fairness_bench(credits=credits_t, congestions=congestions_t,
                                               seconds=seconds,
                                               bottleneck=bottleneck,
                                               progress=lambda m: status.update(m))
    except (TestbedError, RuntimeError) as e:  # (a flow that failed says which, in one line)
        raise click.ClickException(str(e)) from e
    t = Table(title=f"one boundedloss transfer and one TCP flow through "
                    f"{bottleneck.describe()}")
    for col in ("credit", "congestion", "seconds", "TCP Mbit/s", "ours Mbit/s", "TCP share",
                "our share", "utilization", "queue drops"):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(str(CreditSetting(r.credit_bytes, r.credit_adaptive)), r.congestion,
                  f"{r.seconds:.1f}", f"{r.tcp_mbps:.1f}", f"{r.boundedloss_mbps:.1f}",
                  f"{r.tcp_share:.0%}", f"{r.boundedloss_share:.0%}", f"{r.utilization:.0%}",
                  f"{r.queue_drop_fraction:.1%}")
    console.print(t)
    write_json(rows, json_path)
    console.print(f"rows written to {json_path}")


@bench.command("burst")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), required=True,
              callback=_json_file,
              help="Write the rows here (a JSON list).")
@click.option("--rates", default="0.6,0.7,0.8,0.9", show_default=True,
              help="Loss at the server's receiver during the burst round.")
@click.option("--message-mb", default=0.34, show_default=True,
              type=FiniteFloatRange(0.001, 1024), help="Each worker's push (0.34: the digits MLP).")
@click.option("--link-gbps", default=10.0, show_default=True, type=FiniteFloatRange(0.001, 1e4))
@click.option("--rtt-us", default=100.0, show_default=True, type=FiniteFloatRange(0, 1e6))
@click.option("--workers", default=3, show_default=True, type=click.IntRange(1, 256))
@click.option("--seeds", default=20, show_default=True, type=click.IntRange(1, 10_000),
              help="Rounds simulated per arm; the median is reported.")
@probe_copies_option
def bench_burst(json_path, rates, message_mb, link_gbps, rtt_us, workers, seeds,
                probe_copies_max) -> None:
    """A parameter-server round inside a microburst, simulated on a virtual clock: the
    protocol's own burst speedup (DBLP outside a CLR against P = P_low) on a line-rate
    network, where a datagram costs no CPU."""
    from .bench.burst import run_burst_bench

    rates_t = _parse_list(rates, float, "--rates")
    if any(not 0 <= q < 1 for q in rates_t):
        raise click.BadParameter("burst loss rates must be in [0, 1)", param_hint="--rates")
    with console.status("simulating...") as status:
        rows = run_burst_bench(rates=list(rates_t), message_mb=message_mb, link_gbps=link_gbps,
                               rtt_us=rtt_us, workers=workers, seeds=seeds,
                               probe_copies_max=probe_copies_max,
                               progress=lambda m: status.update(m))
    copies = "" if probe_copies_max is None else f", PROBE copies <= {probe_copies_max}"
    t = Table(title=f"PS round in a microburst, simulated: {workers} workers x "
                    f"{message_mb:g} MB, {link_gbps:g} Gb/s, RTT {rtt_us:g} us{copies} "
                    f"(median of {seeds})")
    for col in ("burst loss", "normal round ms", "baseline ms", "dblp ms", "speedup",
                "pushes alone ms (baseline/dblp)", "push speedup",
                "passes (baseline/dblp)", "datagrams (baseline/dblp)"):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(f"{r.burst_loss:.0%}", f"{r.normal_round_ms:.2f}", f"{r.baseline_round_ms:.2f}",
                  f"{r.dblp_round_ms:.2f}", f"{r.speedup:.2f}x",
                  f"{r.baseline_push_ms:.2f} / {r.dblp_push_ms:.2f}", f"{r.push_speedup:.2f}x",
                  f"{r.baseline_passes:g} / {r.dblp_passes:g}",
                  f"{r.baseline_datagrams:,.0f} / {r.dblp_datagrams:,.0f}")
    console.print(t)
    write_json(rows, json_path)
    console.print(f"rows written to {json_path}")


@cli.command()
@click.option("--policy", type=PolicyParam(), default=TRAIN_DEFAULTS.policy, show_default=True,
              help="gloo: DDP's own allreduce over TCP (the reliable baseline); baseline: "
                   "MLT at DBLP's P_low. " + POLICY_HELP.replace("Each NAME", "NAME"))
@click.option("--topology", type=click.Choice(list(TOPOLOGIES)), default=None,
              help="Parameter server (rank 0), transpose allreduce or two-level allreduce "
                   f"(default: allreduce up to {TRANSPOSE_UP_TO} workers, two-level above; not "
                   "with --sharded).")
@click.option("--workers", default=TRAIN_DEFAULTS.workers, show_default=True,
              type=click.IntRange(2, 64), help="Local worker processes (ignored under torchrun).")
@click.option("--model", type=click.Choice(list(MODELS)), default=TRAIN_DEFAULTS.model,
              show_default=True, help="mlp/cnn on images (--data); charlm on stdlib text.")
@click.option("--data", type=click.Choice(list(IMAGE_DATA)), default=None,
              help="The images mlp/cnn train on (default: digits, sklearn's 8x8); "
                   "fashion-mnist: 28x28, from Debian's dataset-fashion-mnist package.")
@click.option("--epochs", default=TRAIN_DEFAULTS.epochs, show_default=True,
              type=click.IntRange(1, 10_000))
@click.option("--seed", default=TRAIN_DEFAULTS.seed, show_default=True, type=int)
@click.option("--loss", "loss_spec", default=TRAIN_DEFAULTS.loss, show_default=True,
              help="Injected loss at receivers, e.g. bernoulli:0.05, ge:rate=0.02,burst=8, "
                   "burst:rate=0.8,every=20,len=1,rank=0 (join with +).")
@click.option("--aggregator", type=click.Choice(list(AGGREGATORS)),
              default=TRAIN_DEFAULTS.aggregator, show_default=True,
              help="What a lost chunk becomes.")
@click.option("--hadamard/--no-hadamard", default=TRAIN_DEFAULTS.hadamard, show_default=True,
              help="Randomized Hadamard dispersion of every message.")
@click.option("--stale-broadcast/--reliable-broadcast", default=None,
              help="Broadcast results (--sharded: all-gather parameters) under the bound, "
                   "lost values keep their last value. Default: reliable; stale with "
                   "--sharded.")
@click.option("--chunk-bytes", default=TRAIN_DEFAULTS.chunk_bytes, show_default=True,
              type=click.IntRange(MIN_CHUNK_BYTES, MAX_CHUNK_BYTES))
@click.option("--deadline", default=TRAIN_DEFAULTS.receive_deadline, show_default=True,
              type=FiniteFloatRange(0.1, 3600),
              help="Receive deadline in seconds; a silent peer fails the run after it.")
@click.option("--lr", default=TRAIN_DEFAULTS.lr, show_default=True,
              type=FiniteFloatRange(0, 100))
@click.option("--batch-size", default=TRAIN_DEFAULTS.batch_size, show_default=True,
              type=click.IntRange(1, 4096))
@click.option("--steps-per-epoch", default=None, type=click.IntRange(1, 1_000_000),
              help="Default: one pass over each rank's share (charlm: 40).")
@probe_copies_option
@click.option("--guard-rounds", default=None, type=click.IntRange(0, 1_000_000),
              help="The loss guard: a bucket whose first-pass loss stays above the "
                   "policy's bound for this many rounds in a row is received reliably "
                   "until it is back within it (0: off). Default: the hook's (on for "
                   "bounded policies, 3 rounds).")
@click.option("--checkpoint-every", default=TRAIN_DEFAULTS.checkpoint_every,
              type=click.IntRange(0, 1_000_000), show_default=True,
              help="Every rank writes OUT/checkpoint.rank<r>.pt every this many epochs "
                   "(model, optimizer, scheduler and the hook's state_dict); 0: never.")
@click.option("--resume", default=None,
              type=click.Path(exists=True, file_okay=False, dir_okay=True),
              help="Go on from the checkpoints in this folder (every rank's, of one epoch).")
@click.option("--auth/--no-auth", default=TRAIN_DEFAULTS.auth, show_default=True,
              help="Authenticate every datagram with a per-job key, from the secret in "
                   "BOUNDEDLOSS_SECRET or --secret-file (the same on every rank), else a "
                   "random one handed out over torch.distributed's store in plaintext. "
                   "--no-auth: anyone who can send to the job's UDP ports can write into "
                   "its gradients (warns once).")
@click.option("--secret-file", default=None, type=click.Path(dir_okay=False),
              help="A file holding the job's secret (sets BOUNDEDLOSS_SECRET_FILE for the "
                   "workers; give every rank the same).")
@click.option("--device", type=click.Choice(list(DEVICES)), default=TRAIN_DEFAULTS.device,
              show_default=True,
              help="Where every rank's model, data and gradient buckets live; cuda: rank r "
                   "on cuda:(r mod the GPUs visible), several ranks may share one.")
@click.option("--precision", type=click.Choice(list(PRECISIONS)),
              default=TRAIN_DEFAULTS.precision, show_default=True,
              help="The model's parameters and inputs, and so DDP's gradient buckets: "
                   "float32 or bfloat16 (every policy, gloo too).")
@click.option("--sharded", is_flag=True, default=TRAIN_DEFAULTS.sharded,
              help="FSDP2 (fully_shard) instead of DDP: gloo is FSDP2's own collectives, "
                   "our policies its reduce-scatter and all-gather; bf16 is its mixed "
                   "precision over float32 master parameters. Not with --topology, "
                   "--hadamard, --checkpoint-every, --resume or tcp-ps.")
@credit_option()
@congestion_option()
@click.option("--mlp-hidden", default=TRAIN_DEFAULTS.mlp_hidden, show_default=True,
              type=click.IntRange(1, 1 << 16), help="The MLP's hidden width (--model mlp).")
@click.option("--out", default=TRAIN_DEFAULTS.out, show_default=True,
              type=click.Path(file_okay=False), callback=_out_folder)
def train(policy, topology, workers, model, data, epochs, seed, loss_spec, aggregator,
          hadamard, stale_broadcast, chunk_bytes, deadline, lr, batch_size, steps_per_epoch,
          probe_copies_max, guard_rounds, checkpoint_every, resume, auth, secret_file,
          device, precision, sharded, credit, congestion, mlp_hidden, out) -> None:
    """Data-parallel training with the bounded-loss DDP hook, or FSDP2 with --sharded
    (starts local workers, or runs as one rank under torchrun)."""
    from .experiments.train import run_rank_and_exit, run_training
    from .net.loss import parse_loss_spec
    from .protocol.auth import AuthenticationError
    from .secret import SECRET_ENV, SECRET_FILE_ENV, read_secret_file, secret_from_env

    try:
        parse_loss_spec(loss_spec)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--loss") from None
    _check(checks.loss_ranks_exist, loss_spec, workers)
    if not policy.uses_transport and loss_spec not in ("none", ""):
        raise click.BadParameter(f"{policy} runs over TCP: in-process loss cannot reach it "
                                 "(use the kernel testbed)", param_hint="--loss")
    cfg = TrainConfig(policy=str(policy), topology=topology, workers=workers, model=model,
                      data=data, epochs=epochs, seed=seed, loss=loss_spec, out=out,
                      aggregator=aggregator, batch_size=batch_size, lr=lr, chunk_bytes=chunk_bytes,
                      receive_deadline=deadline, hadamard=hadamard,
                      stale_broadcast=stale_broadcast, steps_per_epoch=steps_per_epoch,
                      probe_copies_max=probe_copies_max, guard_rounds=guard_rounds,
                      checkpoint_every=checkpoint_every, resume=resume, auth=auth,
                      device=device, precision=precision, sharded=sharded,
                      credit_bytes=credit.budget_bytes, credit_adaptive=credit.adaptive,
                      congestion=congestion, mlp_hidden=mlp_hidden)
    try:
        cfg.validate()  # (before any rank starts: one line, nothing started)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    if secret_file is not None:
        if not auth:
            raise click.BadParameter("a secret with --no-auth: authenticate, or give no "
                                     "secret", param_hint="--secret-file")
        if SECRET_ENV in os.environ:
            raise click.BadParameter(f"{SECRET_ENV} is set too: give one secret",
                                     param_hint="--secret-file")
        try:
            read_secret_file(secret_file, "--secret-file")
        except AuthenticationError as e:
            raise click.UsageError(str(e)) from None
        # the ranks read it (local workers and testbed ranks inherit the environment)
        os.environ[SECRET_FILE_ENV] = os.path.abspath(secret_file)
    elif auth and policy.uses_transport:
        try:
            secret_from_env()
        except AuthenticationError as e:
            raise click.UsageError(str(e)) from None

    def report(summary: dict) -> None:
        ran_on = summary["device"] + (f" ({summary['gpu']})" if summary["gpu"] else "")
        console.print(f"final {summary['metric_name']}: [bold]{summary['final_metric']:.4f}[/] "
                      f"in {summary['wall_s']:.1f} s ({summary['rounds']} rounds, {precision} "
                      f"on {escape(ran_on)}{', FSDP2' if sharded else ''}); logs in {out}/")

    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        # one rank under torchrun: exits like every launched rank (see run_rank_and_exit)
        cfg.validate()
        rank = int(os.environ["RANK"])
        run_rank_and_exit(cfg, rank, int(os.environ["WORLD_SIZE"]),
                          report=report if rank == 0 else None)
    report(run_training(cfg))


def _run_compare(scenario: str, policies: tuple[PolicySpec, ...] | None, json_path: str,
                 out_dir: str,
                 repeats: int, epochs: int | None, workers: int | None, seed: int,
                 steps_per_epoch: int | None, loss_spec: str | None, command: str,
                 network: str = DEFAULT_NETWORK, probe_copies_max: int | None = None,
                 title: str = "boundedloss compare",
                 burst_every: tuple[int, ...] = (),
                 credit: CreditSetting | str = SCENARIO_CREDIT,
                 data: str | None = None, model: str | None = None,
                 sharded: bool = False, precision: str = "fp32", device: str = "cpu") -> None:
    """What `compare` and `demo` share: check the arguments, train every arm with a
    line per finished run, print the tables, write JSON and the report."""
    from dataclasses import replace

    from .experiments.compare import (
        choose_network,
        make_config,
        run_compare,
        with_burst_every,
        with_loss,
    )
    from .experiments.report import (
        PRINT_WIDTH,
        printed_tables,
        table_cells,
        write_report,
        write_sweep_report,
    )
    from .net.loss import parse_loss_spec

    sc = SCENARIOS[scenario]
    try:
        sc = sc.run_as(sharded=sharded, precision=precision, device=device)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--sharded") from None
    if not isinstance(credit, str):  # (SCENARIO_CREDIT: the scenario's own)
        _check(checks.credit_fits, credit.budget_bytes)
        sc = replace(sc, credit_bytes=credit.budget_bytes, credit_adaptive=credit.adaptive)
    if data is not None or model is not None:
        from .experiments.compare import with_images

        try:
            sc = with_images(sc, data, model)
            IMAGE_DATA[sc.data or "digits"].check()
        except (ValueError, FileNotFoundError) as e:
            raise click.BadParameter(str(e), param_hint="--data/--model") from None
    if sc.is_sweep:
        if policies is not None:
            raise click.BadParameter(
                f"scenario {sc.name} sweeps aggregators and loss rates under one policy "
                f"({sc.sweep_policy}); it takes no --policies", param_hint="--policies")
        if loss_spec is not None:
            raise click.BadParameter(f"scenario {sc.name} sets its own loss rates",
                                     param_hint="--loss")
    elif loss_spec is not None:
        try:
            parse_loss_spec(loss_spec)
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint="--loss") from None
        sc = with_loss(sc, loss_spec)
        if network == "auto":
            network = "in-process"  # a loss spec is an in-process what-if
    if burst_every:
        if any(n < 1 for n in burst_every):
            raise click.BadParameter("every N must be at least 1", param_hint="--burst-every")
        if sc.is_sweep or "burst:" not in sc.loss:
            raise click.BadParameter(f"scenario {sc.name} has no round bursts to sweep",
                                     param_hint="--burst-every")
        if network == "kernel":
            raise click.BadParameter("--burst-every sweeps in-process round bursts; the "
                                     "kernel network's bursts are timed",
                                     param_hint="--burst-every")
        network = "in-process"
    n_epochs = epochs or sc.epochs
    n_workers = workers or sc.workers
    if policies is not None:
        _check(checks.distinct, [str(p) for p in policies], "--policies")
    for arm in (sc.arms() if sc.is_sweep else sc.arms(policies)):
        _check(checks.loss_ranks_exist, arm.loss, n_workers)
        # (each arm's run as train checks it - a GPU that is not there, tcp-ps on one -
        # before the first arm starts)
        _check(make_config(sc, arm, out=out_dir, epochs=n_epochs, workers=n_workers,
                           seed=seed, steps_per_epoch=steps_per_epoch,
                           probe_copies_max=probe_copies_max).validate)
    # the arguments are good: now the network (which may re-run this command in a
    # user namespace of its own)
    userns_why = ""
    if network != "in-process" and sc.kernel is not None:
        from .emulate import rootless

        if rootless.needed():
            ok, userns_why = rootless.possible()
            if ok or network == "kernel":
                rootless.reexec()  # the testbed, as root of a user namespace of its own
    try:
        sc = choose_network(sc, network)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--network") from None
    if loss_spec is not None and sc.network == "kernel":
        sc = with_loss(sc, loss_spec)  # in-process loss on top of the kernel's
    if sc.network_note and userns_why:
        from .doctor import no_kernel_network
        from .emulate import rootless

        sc = replace(sc, network_note=no_kernel_network(rootless.unavailable(userns_why),
                                                        privileged=False))
    arms = sc.arms() if sc.is_sweep else sc.arms(policies)

    def done(res) -> None:
        s = res.stats()
        burst = s["burst_round_ms_mean"]
        console.print(
            f"[green]done[/] {res.policy} (repeat {res.repeat + 1}/{repeats}): "
            f"{s['wall_s']:.1f} s, round p50 {s['round_ms_p50']:.1f} ms"
            + ("" if sc.is_sweep else
               f", burst rounds {'-' if burst is None else f'{burst:.1f} ms'}")
            + f", {res.metric_name} {s['final_metric']:.4f}")

    total = len(arms) * repeats * max(1, len(burst_every))
    started = [0]

    def starting(arm, k) -> None:
        started[0] += 1
        console.print(f"[dim]run {started[0]}/{total}: {arm.label} "
                      f"({arm.policy}, {arm.aggregator}"
                      f"{'+hadamard' if arm.hadamard else ''}, "
                      + (f"kernel loss {arm.loss_rate:.0%})[/]"
                         if sc.network == "kernel" and sc.is_sweep else f"loss {arm.loss})[/]"))

    if sc.network == "kernel" and sc.kernel is not None:
        where = f"on the kernel network ({sc.kernel.summary()})"
    elif sc.kernel is not None and sc.network_note:
        where = f"with IN-PROCESS loss, gloo lossless ({escape(sc.network_note)})"
    else:
        where = "with in-process loss"
    if sc.sharded or sc.precision != "fp32" or sc.device != "cpu":
        where += f"; {'FSDP2, ' if sc.sharded else ''}{sc.precision} on {sc.device}"
    console.print(f"[bold]{title}[/]: {sc.name} {where}; "
                  f"{', '.join(a.label for a in arms)}; {n_workers} workers, {n_epochs} "
                  f"epochs, {repeats} repeat(s), {native.status()} data path",
                  soft_wrap=True)
    narrow = Console(width=min(console.width, PRINT_WIDTH))
    all_rows: list[dict] = []
    sweep = [(every, with_burst_every(sc, every), os.path.join(out_dir, f"every{every}"))
             for every in burst_every] if burst_every else [(None, sc, out_dir)]
    for every, sc_k, out_k in sweep:
        if every is not None:
            console.print(f"[bold]a burst every {every} rounds[/]: {sc_k.loss}")
        arms = sc_k.arms() if sc_k.is_sweep else sc_k.arms(policies)  # (their loss too)
        rows, runs = run_compare(sc_k, arms, out_k, repeats=repeats, epochs=n_epochs,
                                 workers=n_workers, seed=seed,
                                 steps_per_epoch=steps_per_epoch,
                                 probe_copies_max=probe_copies_max, progress=done,
                                 starting=starting)
        head = (f"{sc.name}, {sc.network} network{', FSDP2' if sc.sharded else ''}, "
                f"{sc.precision}{' on ' + sc.device if sc.device != 'cpu' else ''}: "
                f"{n_workers} workers, {n_epochs} epochs (median of {repeats})")
        if every is not None:
            head += f", a burst every {every} rounds"
        if sc.target_metric is not None:
            head += f"; target {rows[0]['metric_name']} {sc.target_metric:g}"
        for sub, columns in printed_tables(sc_k):
            t = Table(title=f"{head}{' - ' + sub if sub else ''}")
            for key, header, _ in columns:
                t.add_column(header, justify="left" if key == "policy" else "right",
                             no_wrap=key == "policy")  # (the arm whole)
            for r in rows:
                t.add_row(*table_cells(r, columns))
            narrow.print(t)
        settings = (f"{n_workers} workers, {n_epochs} epochs, seed {seed}, {repeats} "
                    f"repeat(s), {sc.network} network, "
                    f"{'FSDP2' if sc.sharded else 'DDP'} in {sc.precision} on {sc.device}, "
                    f"recovery {rows[0]['recovery']}"
                    + (f", {steps_per_epoch} steps/epoch" if steps_per_epoch else ""))
        report = write_report(rows, runs, sc_k, out_k, command, settings)
        console.print(f"report in {report}")
        for r in rows:
            r["burst_every"] = every
        all_rows += rows
    write_json(all_rows, json_path)
    if len(sweep) > 1:
        report = write_sweep_report(all_rows, sc, out_dir, command)
        console.print(f"the sweep over burst frequency: {report}")
    console.print(f"rows written to {json_path}")


def _command_line(default: str) -> str:
    """The command as the user typed it (for the report), else ``default``."""
    import shlex

    if sys.argv and sys.argv[1:2] in (["compare"], ["demo"]):
        return "boundedloss " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    return default


@cli.command()
@click.option("--scenario", required=True, type=click.Choice(list(SCENARIOS), case_sensitive=False),
              help="Policy scenarios compare policies; sweep scenarios aggregators and loss "
                   "rates.")
@click.option("--policies", type=PolicyParam(many=True), default=None,
              help="Comma-separated. " + POLICY_HELP + " Default: the scenario's. "
                   "Sweep scenarios take none.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), required=True,
              callback=_json_file,
              help="Write the rows here (a JSON list, one object per policy or arm).")
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False),
              callback=_out_folder,
              help="Report directory: report.md, PNG plots, runs/.")
@click.option("--repeats", default=1, show_default=True, type=click.IntRange(1, 50),
              help="Interleaved repeats; the median is reported.")
@click.option("--epochs", default=None, type=click.IntRange(1, 10_000),
              help="Default: the scenario's.")
@click.option("--workers", default=None, type=click.IntRange(2, 64),
              help="Default: the scenario's.")
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--steps-per-epoch", default=None, type=click.IntRange(1, 1_000_000),
              help="Default: one pass over each rank's share (charlm: 40).")
@click.option("--loss", "loss_spec", default=None,
              help="Override a policy scenario's in-process loss spec (what-if runs and "
                   "tests): then --network auto means in-process, and on --network "
                   "kernel it adds to the kernel network's loss.")
@click.option("--network", type=click.Choice(NETWORKS), default=DEFAULT_NETWORK, show_default=True,
              help="Where the loss happens for scenarios that have a kernel setup "
                   "(microburst, incast, lm-loss - whose arms each set the kernel's "
                   "random loss, gloo's too): kernel = the namespace testbed, which every "
                   "system - gloo's TCP too - crosses (root, or a user namespace of its "
                   "own); in-process = loss injected at our endpoints (gloo runs "
                   "lossless); auto = kernel when it can run here.")
@click.option("--burst-every", default=None,
              help="Comma-separated N: run the comparison once per burst frequency - a "
                   "burst every N rounds (the scenario's in-process round bursts) - each "
                   "in OUT/everyN, with a sweep report in OUT/sweep.md.")
@click.option("--sharded", is_flag=True, default=False,
              help="Every arm under FSDP2 (fully_shard) instead of DDP, as train --sharded: "
                   "gloo is FSDP2's own collectives, ours the hook's reduce-scatter and "
                   "all-gather (scenarios with the allreduce topology: lm-loss).")
@click.option("--precision", type=click.Choice(list(PRECISIONS)), default="fp32",
              show_default=True,
              help="Every arm's precision, as train --precision (with --sharded: FSDP2's "
                   "mixed precision over float32 master parameters).")
@click.option("--device", type=click.Choice(list(DEVICES)), default="cpu", show_default=True,
              help="Where every arm's ranks train, as train --device (cuda: rank r on "
                   "cuda:(r mod the GPUs visible); gloo's and our gradients cross the "
                   "network from host memory either way).")
@credit_option(default=SCENARIO_CREDIT)
@click.option("--data", type=click.Choice(list(IMAGE_DATA)), default=None,
              help="The images the scenario's model trains on (default: digits; "
                   "image scenarios only); fashion-mnist is timed to 80% accuracy.")
@click.option("--model", type=click.Choice(["mlp", "cnn"]), default=None,
              help="The image scenarios' model (default: the scenario's, mlp).")
@probe_copies_option
def compare(scenario, policies, json_path, out_dir, repeats, epochs, workers, seed,
            steps_per_epoch, loss_spec, network, burst_every, sharded, precision, device,
            credit, data, model, probe_copies_max) -> None:
    """Train several policies (or aggregators and loss rates) on one scenario - same
    model, data, seed and loss schedule; print a table, write JSON and a Markdown
    report with plots."""
    default = (f"boundedloss compare --scenario {scenario} --json {json_path} "
               f"--out {out_dir} --repeats {repeats} --seed {seed}")
    _run_compare(scenario, policies, json_path, out_dir, repeats, epochs, workers, seed,
                 steps_per_epoch, loss_spec, _command_line(default), network=network,
                 probe_copies_max=probe_copies_max, sharded=sharded, precision=precision,
                 device=device, burst_every=(_parse_list(burst_every, int, "--burst-every")
                              if burst_every is not None else ()), credit=credit, data=data,
                 model=model)


#: the systems a simulation can run: our policies, and the baselines over its TCP model
SIM_SYSTEMS = ("gloo", "tcp-ps", "reliable", "mlt", "ltp", "dblp")
#: what a simulation's ranks can wait at before each round (sim.barrier.BARRIERS' names)
SIM_BARRIERS = ("instant", "gloo")


@cli.command("sim")
@click.option("--workers", default="4,16,64", show_default=True,
              help="World sizes to simulate, comma-separated (2 to 1024).")
@click.option("--systems", type=PolicyParam(many=True), default="gloo,reliable,dblp",
              show_default=True,
              help=f"Comma-separated: {', '.join(SIM_SYSTEMS)} (gloo's ring allreduce and "
                   "tcp-ps over the simulator's TCP model), or a policy as NAME:VALUE.")
@click.option("--topology", "topologies", default=",".join(TOPOLOGIES), show_default=True,
              help=f"Collectives, comma-separated: {', '.join(TOPOLOGIES)} (by default every "
                   f"one: a job that names none takes allreduce up to {TRANSPOSE_UP_TO} ranks, "
                   "two-level above).")
@click.option("--losses", default="0,0.01", show_default=True,
              help="Random loss on every path, comma-separated rates in [0, 1).")
@click.option("--loss-model", "loss_models", multiple=True,
              help="A loss spec on every path, rows of its own (repeatable): e.g. "
                   "ge:rate=0.01,burst=8, burst:rate=0.8,window=0.05-0.06 (bursts as "
                   "time windows, in virtual seconds) or burst:rate=0.8,every_s=0.1,"
                   "len_s=0.01 (recurring); a burst with rank=R happens at rank R's "
                   "host.")
@click.option("--elements", default=1 << 20, show_default=True, type=click.IntRange(1, 1 << 28),
              help="float32 values exchanged per round.")
@click.option("--rounds", default=5, show_default=True, type=click.IntRange(1, 100_000))
@click.option("--link-gbps", default=10.0, show_default=True,
              type=FiniteFloatRange(0.001, 1e4), help="Every host's uplink and downlink.")
@click.option("--delay-us", default=5.0, show_default=True, type=FiniteFloatRange(0, 1e6),
              help="One-way delay of every path.")
@click.option("--queue-datagrams", default=1024, show_default=True,
              type=click.IntRange(1, 1 << 24),
              help="Drop-tail queue at the switch port toward each host, in datagrams.")
@click.option("--queue-bytes", default=None, callback=_optional_size,
              help="Each switch queue toward a host also holds at most this many bytes "
                   "(e.g. 256k).")
@click.option("--shared-buffer", default=None, callback=_optional_size,
              help="The switch's ports share one buffer of this many bytes (e.g. 4m), "
                   "each taking at most what is still free (a dynamic threshold).")
@click.option("--bottleneck", default=None, callback=_bottleneck_spec,
              help="The server's (rank 0's) downlink as a token bucket, as the kernel "
                   "testbed's incast has it (a tbf on the switch port into the server): "
                   "RATE[,BURST[,LIMIT]] in tc's units, e.g. 100mbit,32kb,64kb (the "
                   "defaults after RATE); its queue holds LIMIT bytes.")
@click.option("--background", "backgrounds", multiple=True,
              help="Other tenants' open-loop traffic from every host over the same links "
                   "and queues, rows of its own (repeatable): RATE[:poisson|onoff|pareto]"
                   "[,on_us=US][,shape=A][,to=RANK], RATE each host's mean load as a "
                   "fraction of its link's rate (e.g. 0.3:onoff, or 0.3:to=0 toward rank 0).")
@click.option("--mtu", default=9000, show_default=True, type=click.IntRange(576, 65535),
              help="The links' MTU; a chunk's datagram fills one packet.")
@click.option("--racks", default=1, show_default=True, type=click.IntRange(1, 1024),
              help="Racks under one spine, the workers spread evenly (1: one switch).")
@click.option("--oversubscription", default=1.0, show_default=True,
              type=FiniteFloatRange(1.0, 1e3),
              help="A rack's hosts' links together over its uplink to the spine.")
@click.option("--auth/--no-auth", default=True, show_default=True,
              help="Authenticate every datagram, as a job does.")
@credit_option()
@congestion_option()
@click.option("--cpu", default="none", show_default=True,
              type=click.Choice(["none", "this-machine", "cluster-node"]),
              help="What computing costs: nothing; this machine's measured costs with "
                   "every rank on its 2 cores; the same costs with a core per rank.")
@click.option("--cpu-interference", default="preset", show_default=True,
              metavar="RATE,MEAN_MS|off|preset", callback=_interference,
              help="The time the cores lose to work not simulated: spells a second on "
                   "each core and their mean length (ms), e.g. 5,4 (this-machine's, fitted "
                   "to the kernel testbed); preset: the --cpu preset's (none but "
                   "this-machine has one); off: none.")
@click.option("--cpu-wake", default="preset", show_default=True, metavar="MS|preset",
              callback=_wake,
              help="How long our hosts' I/O thread, woken by a datagram while every core "
                   "is busy, takes to run (ms; preset: the --cpu preset's, none; 1.5 fits "
                   "the kernel testbed's rows at MTU 1,500, not at 9,000). TCP hosts take "
                   "no notice.")
@click.option("--barrier", default="instant", show_default=True,
              type=click.Choice(SIM_BARRIERS),
              help="What the ranks wait at before each round: nothing that takes time, or "
                   "Gloo's barrier over the TCP model, as bench kernel-loss's ranks do (the "
                   "work a round leaves its hosts is then done while they wait). Rows say "
                   "barrier, between_rounds_ms, entry_spread_ms and entry_order_ms.")
@click.option("--like-testbed", is_flag=True,
              help="The network and CPU of bench kernel-loss's testbed (sets --link-gbps, "
                   "--delay-us, --queue-datagrams and --cpu), to compare row by row.")
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--jobs", "processes", default=1, show_default=True,
              type=click.IntRange(1, 1024),
              help="Rows simulated side by side, each in a process of its own, as memory "
                   "allows (the rows are the same; each row's wall_s is its own).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None,
              callback=_json_file, help="Write the rows here (a JSON list).")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), default=None,
              callback=_output_file,
              help="Draw round p50 and p99 against workers, log-log, here (a PNG).")
@click.pass_context
def sim(ctx, workers, systems, topologies, losses, loss_models, elements, rounds, link_gbps,
        delay_us, queue_datagrams, queue_bytes, shared_buffer, bottleneck, backgrounds, mtu,
        racks, oversubscription, auth, credit, congestion, cpu, cpu_interference, cpu_wake,
        barrier, like_testbed, seed, processes, json_path, plot_path) -> None:
    """Simulate a gradient exchange among many workers - the product's own core and
    collectives over a simulated network, in virtual time."""
    from .net.background import parse_background
    from .sim import LIKE_TESTBED, plan_jobs, run_sweep
    from .sim.job import LIKE_TESTBED_MTU, burst_ranks, check_loss_model
    from .sim.memory import shortfall

    if like_testbed:
        given = [f"--{name.replace('_', '-')}" for name in LIKE_TESTBED
                 if ctx.get_parameter_source(name) is not click.core.ParameterSource.DEFAULT]
        if given:
            raise click.UsageError(f"--like-testbed sets {', '.join(given)}: give one or "
                                   "the other")
        link_gbps, delay_us, queue_datagrams, cpu = (
            LIKE_TESTBED["link_gbps"], LIKE_TESTBED["delay_us"],
            LIKE_TESTBED["queue_datagrams"], LIKE_TESTBED["cpu"])
        if ctx.get_parameter_source("mtu") is click.core.ParameterSource.DEFAULT:
            mtu = LIKE_TESTBED_MTU

    workers_t = _parse_list(workers, int, "--workers")
    if any(not 2 <= w <= 1024 for w in workers_t):
        raise click.BadParameter("world sizes must be 2 to 1024", param_hint="--workers")
    if min(workers_t) < racks:
        raise click.BadParameter(f"{min(workers_t)} workers cannot fill {racks} racks",
                                 param_hint="--racks")
    unknown = [str(s) for s in systems if s.name not in SIM_SYSTEMS]
    if unknown:
        raise click.BadParameter(f"{unknown[0]!r}: the simulator runs {', '.join(SIM_SYSTEMS)}",
                                 param_hint="--systems")
    topologies_t = _parse_list(topologies, str.strip, "--topology")
    bad = [t for t in topologies_t if t not in TOPOLOGIES]
    if bad:
        raise click.BadParameter(f"{bad[0]!r}: choose from {', '.join(TOPOLOGIES)}",
                                 param_hint="--topology")
    losses_t = _parse_list(losses, float, "--losses")
    if any(not 0 <= p < 1 for p in losses_t):
        raise click.BadParameter("loss rates must be in [0, 1)", param_hint="--losses")
    # (the simulated job's chunk fills the MTU)
    _check(checks.credit_fits, credit.budget_bytes, mtu)
    for spec in loss_models:
        try:
            ranks = burst_ranks(check_loss_model(spec))
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint="--loss-model") from None
        _check_ranks(ranks, min(workers_t), f"{spec!r}: a burst at rank ", "--loss-model")
    try:
        backgrounds_t = tuple(parse_background(spec) for spec in backgrounds)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--background") from None
    _check_ranks({b.toward for b in backgrounds_t if b.toward is not None}, min(workers_t),
                 "to=", "--background")
    jobs = plan_jobs(workers_t, tuple(str(s) for s in systems), topologies_t, losses_t,
                     loss_models=tuple(loss_models), backgrounds=backgrounds_t or (None,),
                     elements=elements, rounds=rounds, seed=seed, link_gbps=link_gbps,
                     delay_us=delay_us, queue_datagrams=queue_datagrams, mtu=mtu,
                     auth=auth, cpu=cpu, racks=racks, oversubscription=oversubscription,
                     credit_bytes=credit.budget_bytes, credit_adaptive=credit.adaptive,
                     queue_bytes=queue_bytes,
                     shared_buffer_bytes=shared_buffer, congestion=congestion,
                     bottleneck=bottleneck, cpu_interference=cpu_interference,
                     cpu_wake_s=cpu_wake, barrier=barrier)
    short = shortfall(jobs)
    if short is not None:
        raise click.UsageError(short.message())
    with console.status("simulating...") as status:
        rows = run_sweep(jobs, progress=lambda m: status.update(m), processes=processes)
    fabric = (f", {racks} racks under a spine ({oversubscription:g}:1)" if racks > 1 else "")
    credit_note = ("" if credit.budget_bytes is None
                   else ", credit each receiver sizes (auto)" if credit.adaptive
                   else f", credit {credit.budget_bytes:,} bytes per receiver")
    if congestion != "off":
        credit_note += f", congestion control {congestion}"
    queues = f"queues of {queue_datagrams} datagrams" + (
        "" if queue_bytes is None else f" or {queue_bytes:,} bytes") + (
        "" if shared_buffer is None else f" sharing {shared_buffer:,} bytes") + (
        "" if bottleneck is None else f", rank 0 behind a {bottleneck.describe()}")
    t = Table(title=f"simulated exchange of {elements * 4 / 1e6:.1f} MB, {link_gbps:g} Gb/s "
                    f"links, {delay_us:g} us paths, {queues}"
                    f"{fabric}, CPU {cpu}{credit_note} (virtual time)")
    background_cols = ("background", "bg MB", "bg drops") if backgrounds_t else ()
    # (bursts in time: the rounds that met one, against the others)
    burst_cols = ("burst rounds", "burst/rnd") if any(r.burst_rounds for r in rows) else ()
    for col in ("workers", "system", "topology", "loss", *background_cols, "p50 ms",
                "p99 ms", "mean ms", *burst_cols, "datagrams", "queue drops", "wall s"):
        t.add_column(col, justify="right")
    for r in rows:
        background_cells = ((r.background or "none", f"{r.background_bytes / 1e6:,.1f}",
                             f"{r.background_drops:,}") if backgrounds_t else ())
        ratio = r.burst_over_normal_round
        burst_cells = ((f"{r.burst_rounds:,}", "-" if ratio is None else f"{ratio:.2f}x")
                       if burst_cols else ())
        t.add_row(str(r.workers), r.system, r.topology, r.loss_model or f"{r.loss * 100:g}%",
                  *background_cells, f"{r.p50_ms:.2f}",
                  f"{r.p99_ms:.2f}", f"{r.mean_ms:.2f}", *burst_cells,
                  f"{r.sim_datagrams:,}", f"{r.queue_drops + r.fabric_drops:,}",
                  f"{r.wall_s:.1f}")
    console.print(t)
    if json_path is not None:
        write_json(rows, json_path)
        console.print(f"rows written to {json_path}")
    if plot_path is not None:
        from pathlib import Path

        from .sim.plot import plot_scaling

        plot_scaling(rows, Path(plot_path))
        console.print(f"plot written to {plot_path}")


from .emulate.cli import testbed  # noqa: E402 - `boundedloss testbed ...`

cli.add_command(testbed)


def main(argv: list[str] | None = None) -> int:
    """Entry point: usage errors become one line on stderr, exit code 2."""
    from .emulate import rootless

    try:
        if rootless.inside():
            rootless.loopback_up()  # (whatever the command does in there needs loopback)
        rc = cli.main(args=argv, prog_name="boundedloss", standalone_mode=False)
    except click.exceptions.Abort:
        err_console.print("boundedloss: aborted")
        return 130
    except click.UsageError as e:
        msg = e.format_message().replace("\n", " ")
        sys.stderr.write(f"boundedloss: error: {msg} (see --help)\n")
        return 2
    except click.ClickException as e:
        sys.stderr.write(f"boundedloss: error: {e.format_message()}\n")
        return e.exit_code
    except KeyboardInterrupt:
        sys.stderr.write("boundedloss: interrupted\n")
        return 130
    except (OSError, RuntimeError, TimeoutError, ValueError) as e:
        sys.stderr.write(f"boundedloss: error: {e}\n")
        return 1
    return rc if isinstance(rc, int) else 0  # (a command's ctx.exit(code))


if __name__ == "__main__":
    sys.exit(main())
