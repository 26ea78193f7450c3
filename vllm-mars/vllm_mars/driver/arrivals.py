"""Arrival processes for root workflows: fixed ``i/rps``, Poisson, or the workload's own times."""

from __future__ import annotations

import random
from collections.abc import Sequence

ARRIVAL_PROCESSES = ("fixed", "poisson", "trace")


def arrival_times(n: int, *, process: str = "fixed", rps: float | None = None, seed: int = 0,
                  trace: Sequence[float | None] | None = None) -> list[float]:
    """Offsets (seconds from the run start) of ``n`` root arrivals, the earliest at 0.

    ``fixed``: root i at ``i / rps``. ``poisson``: exponential gaps with rate ``rps`` from
    ``Random(seed)``, first root at 0. ``trace``: the workload's own ``arrival_s`` values (each
    must be set), shifted so the earliest is 0, in the workload's order (not necessarily sorted);
    fixed and poisson times are non-decreasing.
    """
    if n < 0:
        raise ValueError(f"number of arrivals must be >= 0, got {n}")
    if process not in ARRIVAL_PROCESSES:
        raise ValueError(f"arrival process {process!r} unknown; allowed: {', '.join(ARRIVAL_PROCESSES)}")
    if process == "trace":
        if trace is None or len(trace) < n:
            raise ValueError(f"arrival process 'trace' needs {n} arrival times, got "
                             f"{0 if trace is None else len(trace)}")
        missing = [i for i, t in enumerate(trace[:n]) if t is None]
        if missing:
            raise ValueError(f"arrival process 'trace': workflow(s) at index {missing[:5]} have no arrival_s; "
                             "use --arrival fixed or poisson")
        times = [float(t) for t in trace[:n]]  # type: ignore[arg-type]
        if any(t < 0 for t in times):
            raise ValueError("arrival process 'trace': arrival_s must be >= 0")
        base = min(times, default=0.0)
        return [t - base for t in times]
    if rps is None or not rps > 0:
        raise ValueError(f"arrival process {process!r} needs rps > 0, got {rps!r}")
    if process == "fixed":
        return [i / rps for i in range(n)]
    rng = random.Random(seed)
    out, t = [], 0.0
    for i in range(n):
        if i:
            t += rng.expovariate(rps)
        out.append(t)
    return out
