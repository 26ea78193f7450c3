"""The cost model a cost-pricing policy runs on: the configured one, else an online fit of this
engine's step times (:class:`~vllm_mars.costmodel.OnlineCostFit`), under sync or async scheduling.

A step's time is taken when its output is processed: from when it was scheduled or the previous
output was processed, whichever is later. Under sync scheduling that is the schedule; under async
scheduling (vLLM's default on GPU) the next step is scheduled while this one runs, and the device
starts it when the one before is done, which is about when that one's output is processed.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from typing import Any

from vllm_mars.clock import Clock
from vllm_mars.costmodel import OnlineCostFit

logger = logging.getLogger("vllm_mars.engine.scheduler")  # operators filter the scheduler's lines


class StepCostFit:
    """Hands ``policy`` its cost model and keeps it fitted from the engine's steps.

    The scheduler calls :meth:`scheduled` after each ``schedule()`` that produced work while
    :attr:`fit` is set, :meth:`processed` from ``update_from_output`` while steps are pending, and
    :meth:`check_warning` after a step with work while :attr:`warning_due`.
    """

    def __init__(self, policy: Any, cfg: Any, clock: Clock, policy_name: str) -> None:
        self.policy = policy
        self.clock = clock
        self.policy_name = policy_name
        self.fit: OnlineCostFit | None = None
        #: Steps scheduled and not yet processed, oldest first: (output, when scheduled, prefill
        #: chunks, decoding calls); at most the engine's steps in flight plus one.
        self.pending: deque[tuple[Any, float, list[tuple[int, int]], int]] = deque()
        #: When the last step's output was processed (a step in flight starts no earlier).
        self._last_output_at = -math.inf
        self.warning_due = False
        #: While set, steps do not count as the run's first work for the uncalibrated warning.
        self.deferred = False
        if not policy.uses_cost:
            return
        if cfg.cost_model is not None:
            policy.set_cost_model(cfg.cost_model)
        elif cfg.online_cost:
            self.fit = OnlineCostFit()
        # Said at the first step that schedules work, not here: the driver pins its calibration
        # right after the engine starts, and a warning now would be false for every run it drives.
        self.warning_due = not policy.cost.calibrated

    def pin(self, model: Any) -> None:
        """Pin a calibrated cost model (the driver's calibration); online fitting stops."""
        self.policy.set_cost_model(model)
        self.fit = None
        if self.policy.uses_cost:
            logger.info("MarsScheduler: policy %s now prices rebuilds with %s (pinned)",
                        self.policy_name, getattr(model, "source", model))

    def check_warning(self) -> None:
        """At the run's first step with work: warn when the policy prices with the default."""
        if self.deferred:
            return
        self.warning_due = False
        policy = self.policy
        if not policy.cost.calibrated:
            logger.warning("MarsScheduler: policy %s prices rebuilds with the UNCALIBRATED default cost model "
                           "(%s)%s; pass additional_config['mars']['cost_model'] (mars serve --cost-model)",
                           self.policy_name, policy.cost.source,
                           " until the online fit of step times has enough steps" if self.fit else "")

    def scheduled(self, out: Any, requests: dict[str, Any]) -> None:
        """Note what step ``out`` computes: its prefill chunks (tokens, context) and decodes."""
        prefill, decodes = [], 0
        for rid, n in out.num_scheduled_tokens.items():
            req = requests.get(rid)
            if req is None:
                continue
            ctx = req.num_computed_tokens - n  # vLLM has advanced it by this step's tokens
            if n == 1 and ctx >= req.num_tokens - 1:
                decodes += 1
            else:
                prefill.append((n, max(ctx, 0)))
        pending = self.pending
        if len(pending) > 4:  # outputs never processed (cannot happen in vLLM's loops): forget them
            pending.popleft()
        pending.append((out, self.clock.now(), prefill, decodes))

    def processed(self, scheduler_output: Any) -> None:
        """Time the step whose output is being processed; refit every 16 steps."""
        pending = self.pending
        work = None
        while pending:  # vLLM processes outputs in the order it scheduled them
            entry = pending.popleft()
            if entry[0] is scheduler_output:
                work = entry
                break
        if work is None:
            return
        now = self.clock.now()
        start = max(work[1], self._last_output_at)
        self._last_output_at = now
        fit = self.fit
        if fit is None:
            return
        fit.observe(now - start, work[2], work[3])
        if fit.steps % 16 == 0 and (model := fit.model()) is not None:
            policy = self.policy
            if policy.cost_pinned:
                self.fit = None
            elif model is not policy.cost:
                first = not policy.cost.calibrated
                policy.set_cost_model(model, pinned=False)
                if first:
                    logger.info("MarsScheduler: policy %s now prices rebuilds with %s", self.policy_name,
                                model.source)
