"""Events a second: SimPy's process-based loop against a bare heap loop like
FakeNetwork's, on the same work - 1,000 hosts each waking 1,000 times at pseudo-random
intervals. Why the simulator keeps its heap: SimPy is not a dependency; to run this,
``pip install simpy`` (or ``--target DIR`` and ``PYTHONPATH=DIR``).

    python tools/sim_event_loop.py
"""

import heapq
import random
import time

import simpy

HOSTS, WAKES = 1000, 1000

def with_simpy():
    env = simpy.Environment()
    def host(env, rng):
        for _ in range(WAKES):
            yield env.timeout(rng.random() * 1e-3)
    for h in range(HOSTS):
        env.process(host(env, random.Random(h)))
    t = time.perf_counter()
    env.run()
    return time.perf_counter() - t

def with_heap():
    events: list = []
    rngs = [random.Random(h) for h in range(HOSTS)]
    left = [WAKES] * HOSTS
    seq = 0
    for h in range(HOSTS):
        seq += 1
        heapq.heappush(events, (rngs[h].random() * 1e-3, seq, h))
    t = time.perf_counter()
    while events:
        now, _, h = heapq.heappop(events)
        left[h] -= 1
        if left[h]:
            seq += 1
            heapq.heappush(events, (now + rngs[h].random() * 1e-3, seq, h))
    return time.perf_counter() - t

n = HOSTS * WAKES
for name, f in (("simpy", with_simpy), ("heap", with_heap)) * 2:  # (interleaved)
    s = f()
    print(f"{name:6s} {n / s / 1e6:.2f} M events/s ({s:.2f} s)")
