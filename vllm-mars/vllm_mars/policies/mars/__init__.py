"""``mars``: the agent-centric in-engine scheduler (SPEC section 2), and its ablations.

One concern per module: :mod:`.config` (the knobs), :mod:`.policy` (order, quanta, elastic
chunks, reclamation, the prefill reserve), :mod:`.retention` (adaptive KV retention across tool
calls), :mod:`.ablations` (the registered ``mars-no-*`` policies, one mechanism off each).

Mechanisms, each switched by one config field (the ablation policies flip them):

* **MLFQ** (``mlfq``): levels 0 (highest) .. 3. A call enters by its *uncached* remaining prefill
  (``level_thresholds``); each level has a per-step prefill quantum (``quanta``); a prefill that
  spends its whole quantum with work left is demoted one level. Running calls are served in
  (level, decodes first, arrival) order, waiting calls in (level, preempted first, arrival) order.
* **Decode promotion** (``promote_decodes``): a call that is generating is at level 0.
* **Preempted first** (``preempted_first``) among the waiting calls of their level.
* **Aging** (``aging_s``): the effective level drops by one per aging period since the call was last
  given tokens, so a waiting call reaches level 0 within three periods. The period is ``aging_s``,
  or with ``scaled_mlfq`` ``aging_turns`` observed mean turn times (once a turn has finished).
* **Work-conserving quanta** (``scaled_mlfq``): a quantum binds only against competing work; a
  prefill may use the part of the step budget nobody else wants this step, but while another
  running call decodes only up to the prefill tokens a step's fixed cost is worth (the cost
  model's ``free_prefill_tokens``).
* **Elastic prefill** (``elastic``): a prefill chunk that does not fit the free KV blocks shrinks to
  what fits (down to one block) instead of making vLLM preempt somebody.
* **Reclamation** (``priority_reclaim``): vLLM preempts our largest ``victim_key`` first. With
  ``cost_reclaim``: the call whose computed KV is cheapest to rebuild (``self.cost``), then the
  lowest level, then the latest arrival; without: prefills before decodes, lowest level, largest
  KV. vLLM stops preempting as soon as the allocation fits; the scheduler releases retained KV
  (lowest ``retention_value`` first) before any preemption.
* **Adaptive retention** (``retention``): a finished, non-final turn keeps its KV for the tau that
  maximises ``P(gap <= tau) * saving - tau * cost``, from learned return gaps (per tool: the one
  the turn is about to run when known, else the previous one; then per workflow, then all;
  :mod:`vllm_mars.policies.gaps`). With ``value_retention`` the
  saving is the rebuild time times the calls it stalls and, under pressure, the cost is the waiting
  calls the blocks would serve; without it, a memory cost and no retention when free blocks are
  scarce (``min_free_fraction``).
* **Order when contexts are evicted** (``evicted_order``, on by default): while returning turns
  find less than ``evicted_share`` of their expected cached prefix (a slow EMA started as a running
  mean), order by the workflow's first arrival with no quanta. A pool that keeps contexts never
  switches; one that holds two or three contexts (H100 + a dense 32B model) switches after a few
  returning turns (``docs/mars.md``).
* **Prefill reserve** (``reserve_prefills``): a waiting call starts only when the free blocks also
  hold the running calls' remaining prefill; with ``reserve_priced`` a held call starts anyway when
  holding it is expected to cost more than the preemption it risks.

How each mechanism was measured, and the options retired on the way: ``docs/history.md``.

Every cost comes from ``self.cost`` (:class:`vllm_mars.costmodel.CostModel`), which the scheduler
sets from ``additional_config["mars"]["cost_model"]``, the driver's calibration, or an online fit.

Pure decision logic: no vllm or torch import.
"""

from vllm_mars.policies.mars import ablations as _ablations  # noqa: F401  (registers the mars-no-* policies)
from vllm_mars.policies.mars.config import MarsConfig
from vllm_mars.policies.mars.policy import MarsPolicy

__all__ = ["MarsConfig", "MarsPolicy"]
