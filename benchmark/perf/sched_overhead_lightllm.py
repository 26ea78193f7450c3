"""``sched_overhead.py`` for ``lightllm``, with ``router_token_ratio=1.0``.

With LightLLM's default ratio (0.0: always "busy", every estimate is ``max_tokens``) its admission
rightly refuses to hold the harness's 256 decoding requests of ``max_tokens=7000`` in a
384k-token pool (256 x 7064 tokens), so the (256, *) steady state of ``sched_overhead.py`` is never
reached. With ratio 1.0 the estimate is the EMA (1024 tokens), 256 requests fit, and the gate runs
its full peak computation on every step, which is the cost we want to measure. Same harness, same
points, same alternating blocks; only the policy option differs.

    .venv/bin/python benchmark/perf/sched_overhead_lightllm.py --out benchmark/perf/results/x.json
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import sched_overhead

OPTIONS = {"router_token_ratio": 1.0}


def main() -> None:
    from vllm_mars.engine import rig

    make = rig.make_scheduler

    def make_scheduler(policy: str = "fcfs", **kw):
        if policy == "lightllm" and not kw.get("stock"):
            kw["policy_options"] = {**OPTIONS, **dict(kw.get("policy_options") or {})}
        return make(policy, **kw)

    rig.make_scheduler = make_scheduler
    if "--policies" not in sys.argv:
        sys.argv += ["--policies", "lightllm"]
    sched_overhead.main()


if __name__ == "__main__":
    main()
