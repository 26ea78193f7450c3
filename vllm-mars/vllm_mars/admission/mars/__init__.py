"""MARS admission: let root workflows into the active set only as fast as live KV (and CPU tool)
capacity allows (SPEC section 4). Pure Python: no vllm import; time and telemetry are injected.

One concern per module:

* :mod:`.config`: the knobs (:class:`MarsAdmissionConfig`) and their ranges;
* :mod:`.window`: the AIMD window, the pressure (stale telemetry, measured rebuilds or KV usage)
  that drives it, and the caps on it (CPU tool workers, KV usage);
* :mod:`.projection`: whole-life sizing, the active roots' contexts projected over their turns;
* :mod:`.cost`: the cost rule, a root's expected rebuild cost against its queueing cost;
* :mod:`.selection`: which queued roots go in at a tick, in which order;
* :mod:`.controller`: :class:`MarsAdmissionController`, what it learns from the feeder and the tick.

The controller ticks on its feeder's clock: ``tick`` is called every ``interval_s`` and after each
offer/finish, so a slot freed between arrivals is refilled at once. Each decision is an
:class:`~vllm_mars.admission.base.AdmissionEvent` carrying its inputs. Without a cost model the
controller says so in an ``admission_cost_model`` event and applies the footprint rules.
How the rules were measured, and the options retired on the way: ``docs/history.md``.
"""

from vllm_mars.admission.mars.config import MarsAdmissionConfig
from vllm_mars.admission.mars.controller import MarsAdmissionController

__all__ = ["MarsAdmissionConfig", "MarsAdmissionController"]
