"""``autellix``: PLAS, program-level attained service (Autellix, Luo et al., arXiv 2502.13965).

Source: Autellix section 4.1 (PLAS: program-level attained service) and 4.2 (discretised
priorities, anti-starvation).

Rule
----
* Program service ``T_p`` = sum of the model-execution time ``t_k`` of the program's earlier
  *completed* calls (PLAS: ``p(c_j) = sum_{k<j} t_k``). The program is the root workflow
  (``mars_root``): a child session's calls count toward the program that spawned it.
* ``K = len(service_thresholds_s) + 1`` queues. A call enters the queue ``i`` whose service range
  ``[thr[i-1], thr[i])`` holds ``T_p`` at its arrival (not always the top queue, as plain MLFQ would).
* Within a queue: FCFS by call arrival. A call that receives ``quanta_s[i]`` seconds of service in
  queue ``i`` is demoted one queue (the last queue keeps it).
* Anti-starvation: a call in queue > 0 is promoted to the top queue when
  ``(W_p + W_c) / (T_p + T_c) >= beta``; after a promotion only ``W_c`` and ``T_c`` restart.
* Victim under KV pressure: the lowest queue first, among equals the largest KV holder
  (computed tokens), then the latest arrival.

Units (our choice where the paper is open)
------------------------------------------
Service is in **seconds of model time**, as the paper defines it, estimated from a per-step cost
model because a batched engine does not time each call: a step in which a call is given ``n``
tokens costs the call ``step_s + n * token_s`` seconds (a decode step of the batch plus the
marginal cost of its prefill tokens). Wait ``W`` is measured on the injected clock: the time a call
spent in the waiting queue (from arrival, and from each preemption, to its next scheduling); the
program's ``W_p`` sums its finished calls' waits. Calibrate ``step_s`` / ``token_s`` to the
hardware: when they underestimate real step time, waits look long relative to service and
promotion comes earlier (more FCFS-like).

Departures from the authors' system
-----------------------------------
* No proactive preemption and no swap: on vLLM V1 a preemption is a full recompute (Autellix's
  fork swapped with a custom kernel). A lower queue yields the step's token budget (running order)
  and is evicted first under KV pressure, but a running call is not evicted just because a
  higher-priority call arrived.
* No multi-engine load balancer (one engine here).

Parameters (``additional_config["mars"]`` keys)
-----------------------------------------------
See :class:`AutellixConfig`.
"""

from __future__ import annotations

import itertools
import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from vllm_mars.policies.base import CallView, Policy, register_policy


def _as_float_tuple(name: str, value: Any) -> tuple[float, ...]:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = (value,)
    try:
        out = tuple(float(v) for v in value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a list of numbers, got {value!r}") from None
    if any(not math.isfinite(v) for v in out):
        raise ValueError(f"{name} must be finite numbers, got {value!r}")
    return out


@dataclass(frozen=True)
class AutellixConfig:
    #: Upper service bounds (seconds of model time) of queues 0..K-2; K = len + 1 (default K = 4).
    #: Defaults match the preview's token thresholds (2048, 8192, 32768) at ``token_s``.
    service_thresholds_s: tuple[float, ...] = (0.4, 1.6, 6.4)
    #: Service (seconds) a call may receive in each queue before demotion; one per queue.
    quanta_s: tuple[float, ...] = (0.5, 1.0, 2.0, 4.0)
    #: Anti-starvation threshold on (W_p + W_c) / (T_p + T_c) (the preview's 2.0).
    beta: float = 2.0
    #: Model time of one engine step for each call scheduled in it (seconds).
    step_s: float = 0.015
    #: Marginal model time per scheduled token (seconds; the preview's prefill-reload default).
    token_s: float = 0.0002
    #: Programs remembered at once (least recently seen forgotten first).
    max_programs: int = 65536

    def __post_init__(self) -> None:
        thr = _as_float_tuple("service_thresholds_s", self.service_thresholds_s)
        quanta = _as_float_tuple("quanta_s", self.quanta_s)
        object.__setattr__(self, "service_thresholds_s", thr)
        object.__setattr__(self, "quanta_s", quanta)
        if any(t <= 0 for t in thr) or any(b <= a for a, b in itertools.pairwise(thr)):
            raise ValueError(f"service_thresholds_s must be positive and increasing, got {thr}")
        if len(quanta) != len(thr) + 1:
            raise ValueError(f"quanta_s needs one value per queue ({len(thr) + 1}), got {len(quanta)}")
        if any(q <= 0 for q in quanta):
            raise ValueError(f"quanta_s must be > 0, got {quanta}")
        if not self.beta > 0:
            raise ValueError(f"beta must be > 0, got {self.beta}")
        if self.step_s < 0 or self.token_s < 0 or self.step_s + self.token_s <= 0:
            raise ValueError(f"step_s and token_s must be >= 0 and not both 0, got {self.step_s}, {self.token_s}")
        if self.max_programs < 1:
            raise ValueError(f"max_programs must be >= 1, got {self.max_programs}")


class _Program:
    __slots__ = ("service", "wait")

    def __init__(self) -> None:
        self.service = 0.0  # T_p: model time of the program's completed calls
        self.wait = 0.0  # W_p: queue wait of the program's completed calls


class _CallState:
    __slots__ = (
        "level",
        "level_service",
        "program",
        "queued_since",
        "ratio_service",
        "ratio_wait",
        "service",
        "wait",
    )

    def __init__(self, program: _Program, level: int, now: float) -> None:
        self.program = program
        self.level = level
        self.level_service = 0.0  # service received in the current queue
        self.service = 0.0  # total model time of this call (added to T_p at the end)
        self.ratio_service = 0.0  # T_c (restarts on promotion)
        self.wait = 0.0  # total queue wait of this call (added to W_p at the end)
        self.ratio_wait = 0.0  # closed part of W_c (restarts on promotion)
        self.queued_since: float | None = now  # open waiting interval


@register_policy
class AutellixPolicy(Policy):
    """PLAS over K discretised queues with quantum demotion and beta anti-starvation."""

    name = "autellix"
    Config = AutellixConfig
    orders = True
    tracks_service = True
    custom_victims = True

    def __init__(self, config: AutellixConfig | None = None, clock=None) -> None:
        super().__init__(config, clock)
        self._programs: OrderedDict[str, _Program] = OrderedDict()
        self._thresholds = self.config.service_thresholds_s
        self._top = len(self._thresholds)

    # -- helpers ----------------------------------------------------------------------------------
    def _program(self, pid: str) -> _Program:
        p = self._programs.get(pid)
        if p is None:
            p = self._programs[pid] = _Program()
            if len(self._programs) > self.config.max_programs:
                self._programs.popitem(last=False)
        else:
            self._programs.move_to_end(pid)
        return p

    def entry_level(self, service_s: float) -> int:
        """Queue whose service range holds ``service_s``."""
        for i, t in enumerate(self._thresholds):
            if service_s < t:
                return i
        return self._top

    def _level(self, call: CallView) -> int:
        st: _CallState = call.state
        if st.level > 0:
            w = st.ratio_wait
            if st.queued_since is not None:
                w += self.clock.now() - st.queued_since
            p = st.program
            denom = p.service + st.ratio_service
            if denom <= 0 or (p.wait + w) / denom >= self.config.beta:
                self._promote(st)
        return st.level

    def _promote(self, st: _CallState) -> None:
        st.level = 0
        st.level_service = 0.0
        st.ratio_service = 0.0
        st.ratio_wait = 0.0
        if st.queued_since is not None:
            st.queued_since = self.clock.now()

    # -- bookkeeping ------------------------------------------------------------------------------
    def on_arrival(self, call: CallView) -> None:
        program = self._program(call.workflow.root)
        call.state = _CallState(program, self.entry_level(program.service), self.clock.now())

    def on_scheduled(self, call: CallView, num_tokens: int) -> None:
        st: _CallState = call.state
        if st.queued_since is not None:
            waited = max(self.clock.now() - st.queued_since, 0.0)
            st.wait += waited
            st.ratio_wait += waited
            st.queued_since = None
        cost = self.config.step_s + num_tokens * self.config.token_s
        st.service += cost
        st.ratio_service += cost
        st.level_service += cost
        if st.level < self._top and st.level_service >= self.config.quanta_s[st.level]:
            st.level += 1
            st.level_service = 0.0

    def on_preempted(self, call: CallView) -> None:
        st: _CallState = call.state
        if st.queued_since is None:
            st.queued_since = self.clock.now()

    def on_finished(self, call: CallView, aborted: bool) -> None:
        st: _CallState = call.state
        if st is None:
            return
        p = st.program
        p.service += st.service
        p.wait += st.wait
        wf = call.workflow
        if wf.last_step and wf.workflow == wf.root:
            self._programs.pop(wf.root, None)

    # -- decisions --------------------------------------------------------------------------------
    def waiting_key(self, call: CallView) -> Any:
        return (self._level(call), call.seq)

    def running_key(self, call: CallView) -> Any:
        return (self._level(call), call.seq)

    def victim_key(self, call: CallView) -> Any:
        return (call.state.level, call.num_computed_tokens, call.seq)

    # -- introspection (tests, logs) --------------------------------------------------------------
    def program_service(self, root: str) -> float:
        p = self._programs.get(root)
        return p.service if p is not None else 0.0
