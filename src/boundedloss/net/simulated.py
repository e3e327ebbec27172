"""The endpoint on a simulated network: everything above the seam - collectives, the
hook's exchange - runs unchanged, in virtual time, deterministically.

- :class:`SimRuntime` runs programs (a rank's loop, say: plain blocking code that
  calls an endpoint and waits on its futures) as greenlets that take turns: exactly one
  runs at a time, and the network's discrete-event loop runs only while every program
  waits. A program's wait on a future hands the turn back; the future's result (or its
  timeout, counted on the virtual clock) gives the turn back to it. So a run depends on
  the seed and the programs alone - never on the host's scheduler or speed - and a
  program's computing takes no virtual time. (A greenlet switches stacks within one
  thread: a program may block anywhere in plain code, and a turn costs a switch, not
  two threads handing over a lock and the GIL.)
- :class:`SimEndpoint` is an :class:`~.endpoint.Endpoint` whose core is a node of a
  :class:`~.fake.FakeNetwork` (its links, queues, loss and routes): the network's loop
  is its driver.

    net = FakeNetwork(seed=1, path=PathProfile(delay=50e-6))
    rt = SimRuntime(net)
    a = SimEndpoint(rt, ("10.0.0.1", 9000), session=7)
    b = SimEndpoint(rt, ("10.0.0.2", 9000), session=7)
    rt.spawn(lambda: a.send(b.address, payload, message_id=1).result())
    got = rt.spawn(lambda: b.receive(a.address, message_id=1, nbytes=n).result())
    rt.run()
    got.result()  # the ReceiveResult
"""

from __future__ import annotations

import gc
import math
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures._base import PENDING
from typing import Any

import greenlet

from .. import native
from ..protocol.auth import DatagramAuth
from ..protocol.mux import TransferMux
from ..protocol.types import TransportConfig
from .endpoint import Endpoint
from .fake import FakeNetwork, NodeProfile
from .native import NativeDataPath

#: network events between two looks at the wall clock for ``SimRuntime.run``'s tick
TICK_STEPS = 4096


class SimDeadlock(RuntimeError):
    """Every program waits, and nothing is left on the network to end a wait."""


class _Abort(BaseException):
    """Unwinds a program the runtime gave up on (another one failed)."""


class _ProgramGreenlet(greenlet.greenlet):
    """A program's greenlet, which knows its program (``SimRuntime.wait`` finds it)."""

    program: Program | None = None


class Program:
    """One program's greenlet and how it ended (``result()`` once the runtime has run)."""

    def __init__(self, runtime: SimRuntime, fn: Callable[[], Any], name: str):
        self.name = name
        self._fn = fn
        self._runtime = runtime
        self.value: Any = None
        self.error: BaseException | None = None
        self.aborted = False
        self.waiting: Future | None = None  # the future it waits on, if any
        self.finished: Future = SimFuture(runtime)  # resolved (None) once it has ended
        self.greenlet = _ProgramGreenlet(self._main)
        self.greenlet.program = self

    @property
    def done(self) -> bool:
        return self.finished.done()

    @property
    def ended(self) -> bool:
        """Its greenlet has returned (unwound, if it was aborted)."""
        return self.greenlet.dead

    def join(self, timeout: float | None = None) -> None:
        """Wait (in another program) until this one has ended."""
        self.finished.result(timeout)

    def result(self) -> Any:
        """What the program returned; what it raised, raised again."""
        if not self.done:
            raise RuntimeError(f"program {self.name} has not finished")
        if self.error is not None:
            raise self.error
        return self.value

    def _main(self) -> None:
        try:
            if not self.aborted:
                self.value = self._fn()
        except _Abort:
            pass
        except BaseException as e:  # noqa: BLE001 - handed to run()'s caller
            self.error = e
        finally:
            self._runtime.ended += 1
            self.finished.set_result(None)


class SimRuntime:
    """Programs taking turns on ``network``'s virtual clock (see the module)."""

    def __init__(self, network: FakeNetwork):
        self.network = network
        self._programs: list[Program] = []
        self._ready: deque[Program] = deque()
        #: the greenlet that runs the network's loop (run()'s caller): a waiting
        #: program switches back to it
        self._hub: greenlet.greenlet | None = None
        self.ended = 0  # programs that have ended

    @property
    def now(self) -> float:
        return self.network.now

    def spawn(self, fn: Callable[[], Any], name: str | None = None) -> Program:
        """Run ``fn()`` as a program: from the next :meth:`run` on, or, spawned by a
        program, once that one waits."""
        program = Program(self, fn, name or f"sim-program-{len(self._programs)}")
        self._programs.append(program)
        self._ready.append(program)
        return program

    def run(self, until: float | None = None, *,
            tick: Callable[[], None] | None = None, tick_s: float = 2.0) -> float:
        """Run the programs and the network until every program has finished (or the
        virtual clock passes ``until``). A program's error is raised here, once the
        others are unwound; so is :class:`SimDeadlock`. Returns the virtual time.
        ``tick``: called about every ``tick_s`` seconds of wall time while the network
        runs (to say how far it has got; it must not touch the simulation)."""
        network = self.network
        ready = self._ready
        next_time, step = network.next_time, network.step
        # (the wall clock read once every TICK_STEPS events: a read per event would cost)
        steps, tick_at = 0, time.monotonic() + tick_s
        # A run's live objects (transfers, futures, events) grow with it, and every full
        # collection scans them all to find little garbage: at 256 workers 42.6 s of a
        # run with them, 27.6 with no collection at all. So none while it runs (the few
        # cycles that outlive the young generations wait for its end), and young ones
        # every 20,000 allocations instead of 700: 29.3 s, the same peak memory.
        thresholds = gc.get_threshold()
        gc.set_threshold(20_000, thresholds[1], 10 ** 9)
        try:
            while True:
                while ready:
                    program = ready.popleft()
                    self._run_program(program)
                    if program.error is not None:  # (only the one that ran can have failed)
                        raise program.error
                if self.ended == len(self._programs):
                    return network.now
                while not ready:  # (the network's events until one readies a program)
                    t = next_time()
                    if t is None:
                        waiting = [p.name for p in self._programs if not p.done]
                        raise SimDeadlock(
                            f"every program waits and nothing is left to happen: {waiting}")
                    if until is not None and t > until:
                        network.now = until
                        return until
                    step()
                    if tick is not None:
                        steps += 1
                        if steps % TICK_STEPS == 0 and time.monotonic() >= tick_at:
                            tick()
                            tick_at = time.monotonic() + tick_s
        except BaseException:
            self._unwind()
            raise
        finally:
            gc.set_threshold(*thresholds)

    def close(self) -> None:
        """Unwind the programs that have not finished (their greenlets end)."""
        self._unwind()

    def sleep_until(self, t: float) -> None:
        """Called by a program: wait until the virtual clock reaches ``t``."""
        if t <= self.network.now:
            return
        alarm: Future = SimFuture(self)
        self.network.call_at(t, lambda: alarm.set_result(None))
        alarm.result()

    # ----------------------------------------------------------- for futures
    def wait(self, future: Future, timeout: float | None) -> None:
        """Called by a program: hand the turn back until ``future`` is done or
        ``timeout`` virtual seconds have passed."""
        program = getattr(greenlet.getcurrent(), "program", None)
        if program is None:
            raise RuntimeError("a simulated future is waited on from outside the "
                               "simulation (wait in a program, or after run())")
        if program.aborted:
            raise _Abort  # (unwinding: its cleanup may not wait any more)
        if future.done():
            return
        program.waiting = future
        # (the callbacks take the future as their argument: one that closed over it would
        # make a cycle - the future holds its callbacks - and what the future holds, a
        # receive's result and buffer, would outlive the round until a full collection,
        # which a run holds off; the alarm lets go of it once called or cancelled)
        if timeout is not None:
            alarm = self.network.call_at(self.network.now + max(0.0, timeout),
                                         lambda: self._wake(program, future))

            def done(f: Future) -> None:
                self.network.cancel(alarm)  # (a stale timeout would hold off SimDeadlock)
                self._wake(program, f)

            future.add_done_callback(done)
        else:
            future.add_done_callback(lambda f: self._wake(program, f))
        assert self._hub is not None  # (a program runs only from run())
        try:
            self._hub.switch()
        except greenlet.GreenletExit:  # (collected unfinished: unwind it)
            program.aborted = True
        if program.aborted:
            raise _Abort

    # ----------------------------------------------------------- internals
    def _wake(self, program: Program, future: Future) -> None:
        if program.waiting is future:
            program.waiting = None
            self._ready.append(program)

    def _run_program(self, program: Program) -> None:
        """Let ``program`` run until it waits or ends."""
        hub = self._hub = greenlet.getcurrent()
        glet = program.greenlet
        if glet.dead:
            return
        glet.parent = hub  # (where it goes when it ends)
        glet.switch()

    def _unwind(self) -> None:
        for program in self._programs:
            if not program.done:
                program.aborted = True
                program.waiting = None
                self._run_program(program)
        self._ready.clear()


class _Unlocked:
    """Stands for a SimFuture's condition: the simulation's programs take turns, one at
    a time, so no two touch a future at once, and none blocks on one (its wait hands
    the turn to the simulation) - a real Condition per future cost a lock each."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None

    def acquire(self) -> bool:  # (concurrent.futures.wait's, as_completed's)
        return True

    def release(self) -> None:
        return None

    def notify_all(self) -> None:
        return None

    def wait(self, timeout: float | None = None) -> bool:
        return False


_UNLOCKED = _Unlocked()


class SimFuture(Future):
    """A future whose wait, in a program, hands the turn to the simulation."""

    def __init__(self, runtime: SimRuntime):
        # (Future.__init__'s state, with _Unlocked for its Condition)
        self._condition = _UNLOCKED  # type: ignore[assignment]
        self._state = PENDING
        self._result = None
        self._exception = None
        self._waiters: list = []
        self._done_callbacks: list = []
        self._runtime = runtime

    def result(self, timeout: float | None = None) -> Any:
        if not self.done():
            self._runtime.wait(self, timeout)
        return super().result(timeout=0)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        if not self.done():
            self._runtime.wait(self, timeout)
        return super().exception(timeout=0)


def _compiled_path(mux: TransferMux) -> NativeDataPath | None:
    """A compiled data path attached to ``mux``, or None where it is not in use (not
    built, ``BOUNDEDLOSS_NATIVE=0``, or authenticating without OpenSSL in it)."""
    if not native.enabled() or (mux.auth is not None and not native.authenticates()):
        return None
    return NativeDataPath(mux)


class SimEndpoint(Endpoint):
    """An endpoint at ``address`` (an IPv4 ``(host, port)``, as a real one's) on the
    runtime's network; ``profile``: its links and queue there."""

    driver_name = "simulated host"

    def __init__(self, runtime: SimRuntime, address: tuple[str, int], *, session: int,
                 config: TransportConfig | None = None, auth_key: bytes | None = None,
                 profile: NodeProfile | None = None):
        self.runtime = runtime
        self.config = config or TransportConfig()
        self._address = (str(address[0]), int(address[1]))
        self.auth = None if auth_key is None else DatagramAuth(auth_key, self._address)
        self.trailer = 0 if self.auth is None else self.auth.trailer_bytes
        self.mux = TransferMux(session, self.config, auth=self.auth)
        #: the compiled data path over the core, as on a real host where it is in use
        #: (native.enabled(); the Python path with BOUNDEDLOSS_NATIVE=0): the DATA of
        #: open receives, the ACKs, the PROBE answers taken in C, the rest handed to the
        #: core - the same datagrams either way (tests/test_native.py's differential tests)
        self.data_path = _compiled_path(self.mux)
        self._start_api()
        # (a wake costs an event, not a thread's hand-over: every posted timer wakes it)
        self.sleeps_until = math.inf
        self._profile = profile or NodeProfile()
        runtime.network.attach(self._address, self.mux, self._profile, serviced=self._serviced,
                               receive=None if self.data_path is None else self.data_path.take)

    def clock(self) -> float:
        return self.runtime.network.now

    def send_many(self, messages, **kwargs) -> list[Future]:
        messages = list(messages)
        self._spend(len(messages))
        return super().send_many(messages, **kwargs)

    def _receive(self, messages: list[tuple], message_id: int, round_id: int,
                 policy) -> list[Future]:
        self._spend(len(messages))
        return super()._receive(messages, message_id, round_id, policy)

    def _spend(self, messages: int) -> None:
        """What one call posting ``messages`` cost the host's CPU (its profile's
        ``cpu``): the caller goes on once its main thread's share is done."""
        cpu = self._profile.cpu
        if cpu is None or messages == 0:
            return
        self._check_open()  # (a closed host has left the network: nothing to charge)
        done = self.runtime.network.charge(
            self._address, main=cpu.post_main + messages * cpu.message_main,
            io=cpu.post_io + messages * cpu.message_io)
        self.runtime.sleep_until(done)

    @property
    def address(self) -> tuple[str, int]:
        return self._address

    def _wake(self) -> None:
        self.wakeups += 1
        self.runtime.network.wake(self._address)

    def _new_future(self) -> Future:
        return SimFuture(self.runtime)

    def _resolve_address(self, peer) -> tuple[str, int]:
        return (str(peer[0]), int(peer[1]))

    def check_path(self, peer: tuple[str, int]) -> None:
        """(The simulated network carries a datagram of any size.)"""

    def _stop_driver(self) -> None:
        self.runtime.network.detach(self._address)

    def _serviced(self) -> None:
        if self.mux.has_finished:  # (after every datagram a host takes: most finish nothing)
            with self._lock:
                self._resolve(self.mux.pop_finished())
