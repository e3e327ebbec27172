"""``boundedloss testbed up|down|status|run|set``: the kernel testbed from a shell.

``up`` builds a testbed and leaves it up, recording it in a small JSON state file
(``$BOUNDEDLOSS_STATE_DIR``, else ``/run/boundedloss`` as root, else
``/tmp/boundedloss-UID``) so later ``status``/``run``/``set``/``down`` calls find it.
``down`` also removes leftovers by name (``PREFIX`` + 6 hex digits + ``-...``) when there
is no state file. Errors print as one line (exit status 1), never as a traceback.

Without root, ``up`` builds the testbed as root of a user namespace of its own and leaves
one process holding it (the namespace's first process; the state file records it); the
other commands re-run themselves inside that namespace (``nsenter``), and ``down`` kills
the holder, which ends every process and namespace of the testbed at once. Nothing of
the host's namespaces, interfaces or firewall is touched.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

import click

from ..checks import FiniteFloatRange
from . import rootless
from .testbed import (
    SERVER,
    Bottleneck,
    Testbed,
    TestbedConfig,
    TestbedError,
    leftovers,
    require_privileges,
    sweep,
)
from .units import format_rate


def default_state_dir() -> Path:
    env = os.environ.get("BOUNDEDLOSS_STATE_DIR")
    if env:
        return Path(env)
    if os.geteuid() == 0 and os.access("/run", os.W_OK):
        return Path("/run/boundedloss")
    return Path(tempfile.gettempdir()) / f"boundedloss-{os.getuid()}"


def state_path(state_dir: str | os.PathLike | None, prefix: str) -> Path:
    return Path(state_dir or default_state_dir()) / f"{prefix}testbed.json"


def _load(path: Path) -> Testbed | None:
    try:
        return Testbed.from_state(json.loads(path.read_text()))
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError) as e:
        raise TestbedError(f"unreadable state file {path}: {e}; "
                           "`boundedloss testbed down` removes it and any leftovers") from None


def _save(path: Path, tb: Testbed) -> None:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(tb.to_state(), indent=2) + "\n")
    tmp.replace(path)


def _read_state(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _rootless(command: str, prefix: str, state_dir: str | None) -> dict | None:
    """Without root, for a command on a kept testbed: re-run it inside the recorded
    rootless testbed's namespaces (never returns) when its holder is alive; else the
    state found (a dead holder's, or None), or a one-line error where user namespaces
    cannot be had. With root (or inside already): None, and the command goes on."""
    if not rootless.needed():
        return None
    path = state_path(state_dir, prefix)
    state = _read_state(path)
    if state is not None and rootless.HOLDER_KEY in state:
        if rootless.holder_alive(state):
            args = sys.argv[sys.argv.index(command, 1):]
            env = {**os.environ, rootless.INSIDE: "1",
                   "BOUNDEDLOSS_STATE_DIR": str(path.parent)}
            sys.stdout.flush()
            os.execvpe("nsenter", rootless.enter_argv(
                state, [sys.executable, "-m", "boundedloss.cli", "testbed", *args]), env)
        return state
    ok, why = rootless.possible()
    if not ok:
        raise TestbedError(rootless.unavailable(why))
    return state


def _one_line_errors(fn):
    """TestbedError / ValueError -> ``Error: <one line>`` on stderr, exit status 1."""

    @functools.wraps(fn)
    def wrapper(*a, **kw):
        try:
            return fn(*a, **kw)
        except (TestbedError, ValueError) as e:
            raise click.ClickException(" ".join(str(e).split())) from None

    return wrapper


def _common(fn):
    fn = click.option("--state-dir", type=click.Path(file_okay=False), default=None,
                      help="Where the state file lives [default: $BOUNDEDLOSS_STATE_DIR, "
                           "/run/boundedloss as root, else /tmp/boundedloss-UID].")(fn)
    fn = click.option("--prefix", default="bl-", show_default=True,
                      help="Name prefix of everything the testbed creates.")(fn)
    return fn


def _bottleneck(rate: str | None, burst: str | None, limit: str | None) -> Bottleneck | None:
    if rate is None:
        if burst is not None or limit is not None:
            raise ValueError("--burst/--limit shape a bottleneck: give --rate too")
        return None
    return Bottleneck(rate, burst or "32kb", limit or "64kb")


@click.group(name="testbed")
def testbed() -> None:
    """Real-kernel testbed: network namespaces, a tbf bottleneck toward the server,
    nf_tables random loss, over netlink (root, or a user namespace of its own)."""


@testbed.command("up")
@click.option("--workers", type=click.IntRange(1, 64), default=4, show_default=True)
@click.option("--subnet", default="10.201.0.0/24", show_default=True,
              help="Private IPv4 range used only inside the testbed's namespaces.")
@click.option("--mtu", type=click.IntRange(576, 65535), default=1500, show_default=True)
@click.option("--rate", default=None, help="Bottleneck rate toward the server, e.g. 100mbit "
                                           "(no bottleneck without it).")
@click.option("--burst", default=None, help="tbf bucket, e.g. 32kb [default: 32kb].")
@click.option("--limit", default=None, help="tbf queue, e.g. 64kb [default: 64kb].")
@click.option("--loss", type=FiniteFloatRange(0, 1), default=0.0, show_default=True,
              help="Random drop probability of UDP arriving at --loss-node.")
@click.option("--loss-node", default=SERVER, show_default=True)
@_common
@_one_line_errors
def up_cmd(workers: int, subnet: str, mtu: int, rate: str | None, burst: str | None,
           limit: str | None, loss: float, loss_node: str, prefix: str,
           state_dir: str | None) -> None:
    """Build a testbed and leave it up (without root: in a user namespace of its own,
    held until `down`)."""
    path = state_path(state_dir, prefix)
    if rootless.needed():
        _up_rootless(path)
        return
    require_privileges()
    old = _load(path)
    if old is not None:
        if old.status().up:
            raise TestbedError(f"testbed {old.name} is already up (state {path}): "
                               "run `boundedloss testbed down` first")
        path.unlink(missing_ok=True)
    cfg = TestbedConfig(workers=workers, subnet=subnet, mtu=mtu, prefix=prefix,
                        bottleneck=_bottleneck(rate, burst, limit),
                        loss=loss if loss_node == SERVER else 0.0)
    tb = Testbed(cfg)
    with tb.guard_signals():  # Ctrl-C / SIGTERM while building: nothing is left behind
        tb.node(loss_node)
        tb.up()
        if loss and loss_node != SERVER:
            tb.set_loss(loss, loss_node)
        _save(path, tb)
    click.echo(f"testbed {tb.name} up ({workers} workers, mtu {mtu}); state: {path}")
    for node, addr in tb.addresses.items():
        click.echo(f"  {node:>7}  {addr:<15} netns {tb.namespace(node)}")
    click.echo(f"  bottleneck: {cfg.bottleneck.describe() if cfg.bottleneck else 'none'}")
    click.echo(f"  loss: {loss:g} on {loss_node}" if loss else "  loss: none")
    click.echo("run commands with: boundedloss testbed run --node w0 -- CMD ...")
    if os.environ.get(rootless.HOLD):
        rootless.hold()  # keep the user namespace (and so the testbed) until `down`


def _up_rootless(path: Path) -> None:
    """`up` without root: the same command as root of a user namespace of its own,
    which keeps holding the namespace once the testbed is built."""
    state = _read_state(path)
    if state is not None and rootless.holder_alive(state):
        raise TestbedError(f"testbed {state.get('name')} is already up (state {path}): "
                           "run `boundedloss testbed down` first")
    ok, why = rootless.possible()
    if not ok:
        raise TestbedError(rootless.unavailable(why))
    path.unlink(missing_ok=True)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
    args = sys.argv[sys.argv.index("up", 1):]
    rc, out = rootless.start_holder(
        [sys.executable, "-m", "boundedloss.cli", "testbed", *args], str(path),
        env={"BOUNDEDLOSS_STATE_DIR": str(path.parent)})
    click.echo(out, nl=False)
    if rc != 0:
        sys.exit(rc)
    click.echo("(without root: the testbed lives in a user namespace of its own; "
               "`boundedloss testbed down` ends it)")


@testbed.command("status")
@click.option("--json", "as_json", is_flag=True, help="Print the status as JSON.")
@_common
@_one_line_errors
def status_cmd(as_json: bool, prefix: str, state_dir: str | None) -> None:
    """Show the recorded testbed: nodes, addresses, bottleneck counters, loss rules."""
    path = state_path(state_dir, prefix)
    if rootless.needed():
        state = _rootless("status", prefix, state_dir)
        gone = state is not None  # a rootless testbed whose holder has ended
        if as_json:
            click.echo(json.dumps({"up": False, "state": str(path), "leftovers": []}))
        elif gone:
            click.echo(f"the testbed recorded in {path} has ended (its user namespace is "
                       "gone); `boundedloss testbed down` clears the record")
        else:
            click.echo(f"no testbed recorded in {path}")
        return
    require_privileges()
    tb = _load(path)
    left = leftovers(prefix)
    if tb is None:
        if as_json:
            click.echo(json.dumps({"up": False, "state": str(path), "leftovers": left}))
            return
        click.echo(f"no testbed recorded in {path}")
        if left:
            click.echo(f"leftovers named {prefix}*: {', '.join(left)} "
                       "(`boundedloss testbed down` removes them)")
        return
    st = tb.status()
    others = [x for x in left if x not in tb.namespaces().values()]
    if as_json:
        d = asdict(st)
        d.update(state=str(path), leftovers=others)
        click.echo(json.dumps(d, indent=2))
        return
    click.echo(f"testbed {st.name}: {'up' if st.up else 'NOT up (partly gone)'}; state {path}")
    for node, addr in st.addresses.items():
        ok = "" if st.namespaces.get(node) else "  (namespace missing)"
        ls = st.loss.get(node)
        # (seen counts every packet toward the node, TCP too where the rule is UDP's)
        loss = (f"  loss {ls.probability:g} ({ls.protocol}) dropped {ls.dropped_packets}"
                f" of {ls.seen_packets} forwarded" if ls and ls.protocol else "")
        click.echo(f"  {node:>7}  {addr:<15}{loss}{ok}")
    q = st.qdisc
    if q is not None:
        shape = (f" rate {format_rate(q.rate_bps)} burst {q.burst_bytes} B"
                 if q.rate_bps else "")
        click.echo(f"  to-server qdisc {q.kind}{shape}: sent {q.sent_packets} pkt "
                   f"{q.sent_bytes} B, dropped {q.dropped}, overlimits {q.overlimits}, "
                   f"backlog {q.backlog_packets} pkt")
    if others:
        click.echo(f"other leftovers named {prefix}*: {', '.join(others)}")


@testbed.command("run", context_settings={"ignore_unknown_options": True,
                                          "allow_interspersed_args": False})
@click.option("--node", required=True, help="server, w0..wN-1, or a worker index.")
@click.option("--timeout", type=float, default=None, help="Kill the command after this many s.")
@_common
@click.argument("cmd", nargs=-1, required=True, type=click.UNPROCESSED)
@_one_line_errors
def run_cmd(node: str, timeout: float | None, prefix: str, state_dir: str | None,
            cmd: tuple[str, ...]) -> None:
    """Run CMD in a node's namespace: `boundedloss testbed run --node w0 -- CMD ...`.
    Exits with CMD's exit status (124 on --timeout)."""
    path = state_path(state_dir, prefix)
    _no_testbed_without_root("run", prefix, state_dir, path)
    require_privileges()
    tb = _load(path)
    if tb is None:
        raise TestbedError(f"no testbed recorded in {path}: run `boundedloss testbed up` first")
    argv = tb.netns_argv(node, list(cmd))
    try:
        rc = subprocess.run(argv, timeout=timeout, env=tb.node_env()).returncode
    except subprocess.TimeoutExpired:
        click.echo(f"Error: {cmd[0]} timed out after {timeout:g} s", err=True)
        rc = 124
    except KeyboardInterrupt:
        rc = 130
    sys.exit(rc)


@testbed.command("set")
@click.option("--loss", type=FiniteFloatRange(0, 1), default=None,
              help="New drop probability (0 removes the rule).")
@click.option("--node", default=SERVER, show_default=True, help="Node for --loss.")
@click.option("--all-protocols", is_flag=True, help="--loss drops every protocol, not only UDP.")
@click.option("--rate", default=None)
@click.option("--burst", default=None)
@click.option("--limit", default=None)
@click.option("--no-bottleneck", is_flag=True, help="Remove the bottleneck.")
@_common
@_one_line_errors
def set_cmd(loss: float | None, node: str, all_protocols: bool, rate: str | None,
            burst: str | None, limit: str | None, no_bottleneck: bool, prefix: str,
            state_dir: str | None) -> None:
    """Change loss or the bottleneck of the running testbed."""
    path = state_path(state_dir, prefix)
    _no_testbed_without_root("set", prefix, state_dir, path)
    require_privileges()
    tb = _load(path)
    if tb is None:
        raise TestbedError(f"no testbed recorded in {path}: run `boundedloss testbed up` first")
    if no_bottleneck and rate is not None:
        raise ValueError("--no-bottleneck and --rate contradict each other")
    if loss is None and rate is None and burst is None and limit is None and not no_bottleneck:
        raise ValueError("nothing to set: give --loss and/or "
                         "--rate/--burst/--limit/--no-bottleneck")
    if loss is not None:
        tb.set_loss(loss, node, protocol="all" if all_protocols else "udp")
        click.echo(f"loss {loss:g} on {tb.node(node)}")
    if no_bottleneck or rate is not None or burst is not None or limit is not None:
        if no_bottleneck:
            b = None
        else:
            cur = tb.bottleneck or Bottleneck()
            if rate is None and tb.bottleneck is None:
                raise ValueError("no bottleneck yet: give --rate")
            b = Bottleneck(rate or cur.rate, burst or cur.burst, limit or cur.limit)
        tb.set_bottleneck(b)
        _save(path, tb)
        click.echo(f"bottleneck: {b.describe() if b else 'none'}")


@testbed.command("down")
@_common
@_one_line_errors
def down_cmd(prefix: str, state_dir: str | None) -> None:
    """Remove the recorded testbed and every leftover named PREFIX + id."""
    path = state_path(state_dir, prefix)
    if rootless.needed():
        state = _read_state(path)
        if state is not None and rootless.HOLDER_KEY in state:
            ended = rootless.end_holder(state)
            path.unlink(missing_ok=True)
            click.echo(f"removed testbed {state.get('name')} (its user namespace "
                       f"{'ended' if ended else 'had already ended'})")
            return
        ok, why = rootless.possible()
        if not ok:
            raise TestbedError(rootless.unavailable(why))
        click.echo(f"nothing of ours recorded in {path}")
        return
    require_privileges()
    removed: list[str] = []
    try:
        tb = _load(path)
    except TestbedError:
        tb = None  # unreadable: the sweep below still finds everything by name
    if tb is not None:
        removed += [ns for ns in tb.namespaces().values() if ns in set(leftovers(prefix))]
        tb.down()
    path.unlink(missing_ok=True)
    removed += sweep(prefix)
    if removed:
        click.echo(f"removed {len(removed)}: {', '.join(removed)}")
    else:
        click.echo(f"nothing of ours ({prefix}*) was up")


def _no_testbed_without_root(command: str, prefix: str, state_dir: str | None,
                             path: Path) -> None:
    """Without root: re-run inside the recorded rootless testbed, or say there is none."""
    if not rootless.needed():
        return
    state = _rootless(command, prefix, state_dir)
    if state is not None:
        raise TestbedError(f"the testbed recorded in {path} has ended (its user namespace "
                           "is gone): `boundedloss testbed down` clears the record")
    raise TestbedError(f"no testbed recorded in {path}: run `boundedloss testbed up` first")


main = testbed  # `python -m boundedloss.emulate.cli ...`

if __name__ == "__main__":  # pragma: no cover
    testbed()
