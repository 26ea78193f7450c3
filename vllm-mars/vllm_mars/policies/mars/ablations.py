"""The registered ``mars-no-*`` ablations: ``mars`` with one mechanism switch of :class:`MarsConfig`
off each (admission stays whatever the driver policy says: these run with none)."""

from __future__ import annotations

import dataclasses
from typing import Any

from vllm_mars.policies.base import register_policy
from vllm_mars.policies.mars.config import MarsConfig
from vllm_mars.policies.mars.policy import MarsPolicy


def _ablation(name: str, doc: str, **defaults: Any) -> type[MarsPolicy]:
    fields = [(k, type(getattr(MarsConfig, k)), dataclasses.field(default=v)) for k, v in defaults.items()]
    cfg = dataclasses.make_dataclass(f"{name.title().replace('-', '')}Config", fields, bases=(MarsConfig,),
                                     frozen=True)
    cfg.__doc__ = f"``{name}``: MarsConfig with " + ", ".join(f"{k}={v}" for k, v in defaults.items())
    cls = type(name.title().replace("-", "") + "Policy", (MarsPolicy,),
               {"name": name, "Config": cfg, "__doc__": doc, "__module__": __name__})
    return register_policy(cls)


MarsNoMlfqPolicy = _ablation("mars-no-mlfq", "``mars`` with arrival order and no quanta (no MLFQ).",
                             mlfq=False)
MarsNoElasticPolicy = _ablation("mars-no-elastic", "``mars`` without elastic prefill resizing.",
                                elastic=False)
MarsNoRetentionPolicy = _ablation("mars-no-retention", "``mars`` without adaptive KV retention.",
                                  retention=False)
MarsNoCostReclaimPolicy = _ablation("mars-no-cost-reclaim", "``mars`` with the largest-KV victim rule.",
                                    cost_reclaim=False)
MarsNoValueRetentionPolicy = _ablation("mars-no-value-retention",
                                       "``mars`` with the free-share retention cut-off instead of value.",
                                       value_retention=False)
MarsNoPrefillReservePolicy = _ablation("mars-no-prefill-reserve",
                                       "``mars`` without reserving running prefills' KV at admission.",
                                       reserve_prefills=False)
MarsNoPricedReservePolicy = _ablation("mars-no-priced-reserve",
                                      "``mars`` whose prefill reserve holds every call it would hold (not priced).",
                                      reserve_priced=False)
MarsNoScaledMlfqPolicy = _ablation("mars-no-scaled-mlfq", "``mars`` with fixed quanta and fixed aging_s.",
                                   scaled_mlfq=False)
MarsNoEvictedOrderPolicy = _ablation("mars-no-evicted-order",
                                     "``mars`` that keeps the MLFQ order when the pool cannot keep contexts.",
                                     evicted_order=False)
