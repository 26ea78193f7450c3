"""MarsScheduler: vLLM's own Scheduler with a pluggable Policy applied at vLLM's seams.

Select it with ``scheduler_cls="vllm_mars.engine.scheduler.MarsScheduler"`` (``--scheduler-cls``)
and configure it with ``additional_config={"mars": {"policy": ...}}``. Where vLLM runs async
scheduling (GPU by default) it builds ``AsyncMarsScheduler`` instead (a plain Scheduler subclass
would silently lose the async overlap there). ``schedule()`` itself is never copied; this module
holds the seams, and each concern behind them lives in its own module:

* order: ``self.running`` is sorted by the policy's ``running_key`` before each step and each
  request's ``priority`` set to its victim rank, with vLLM in PRIORITY mode, so vLLM's own
  preemption picks the policy's victim (started with vLLM's ``priority`` scheduling policy, the
  request's own priority ranks first: :meth:`MarsSchedulerMixin._write_victim_ranks`); the waiting
  queues are a
  :class:`~vllm_mars.engine.policy_queue.PolicyQueue`;
* admission gate: ``max_num_active_reqs`` (vLLM's cap on admission into RUNNING, read by its
  waiting loop before each admission) is 0 while the policy holds the waiting head
  (:meth:`MarsSchedulerMixin.admits_waiting_head`);
* chunk caps: ``_reserve_prefill_lookahead``, called right before every ``allocate_slots``;
* retention: ``_free_blocks`` keeps a finished call's cached blocks referenced, and a failed
  allocation releases retained KV first (:mod:`~vllm_mars.engine.reclaim`,
  :mod:`~vllm_mars.engine.retention`); an idle engine core is woken when a retention expires
  (:mod:`~vllm_mars.engine.wakeup`); with a ``tool_parser`` configured the tool a call is about
  to run is read from its output first (:mod:`~vllm_mars.engine.next_tool`);
* the online cost fit: :mod:`~vllm_mars.engine.cost_fit`; the call log and stats:
  :mod:`~vllm_mars.engine.observe`; KV event counts: :mod:`~vllm_mars.engine.kv_events`.

Over 450 lines on purpose: what is left is one seam per vLLM Scheduler method the mixin overrides,
which must sit on the one class vLLM instantiates.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm.platforms import current_platform
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.request_queue import SchedulingPolicy
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request, RequestStatus

from vllm_mars.clock import Clock, MonotonicClock
from vllm_mars.config import parse_engine_config
from vllm_mars.engine import kv_events
from vllm_mars.engine.compat import check_vllm_version
from vllm_mars.engine.cost_fit import StepCostFit
from vllm_mars.engine.next_tool import NextToolReader
from vllm_mars.engine.observe import ENV_SCHED_LOG, SchedLog, scheduler_stats
from vllm_mars.engine.policy_queue import PolicyQueue
from vllm_mars.engine.reclaim import install_reclaim, retain_finished
from vllm_mars.engine.retention import RetentionStore
from vllm_mars.engine.wakeup import ExpiryWaker, engine_core_input_queue, wakeup_message
from vllm_mars.policies import CallView, make_policy
from vllm_mars.workflow import WorkflowInfo, short_id, workflow_from_extra_args

__all__ = ["ENV_SCHED_LOG", "AsyncMarsScheduler", "MarsScheduler", "MarsSchedulerMixin", "PolicyQueue"]

logger = logging.getLogger(__name__)

_RUNNING = RequestStatus.RUNNING
_ABORTED = RequestStatus.FINISHED_ABORTED
#: Bound of the set of workflows already warned about a malformed tag (cleared when full).
_MAX_WARNED = 10_000


class _VictimRank(int):
    """A victim rank the scheduler wrote into ``Request.priority``; any other value found there is
    the request's own vLLM priority."""

    __slots__ = ()


def _untagged(request_id: str) -> WorkflowInfo:
    """The workflow of a call served without (or despite) its tags: itself alone."""
    return WorkflowInfo(request_id, request_id, last_step=True, tagged=False)


class MarsSchedulerMixin:
    """The policy plumbing shared by MarsScheduler and AsyncMarsScheduler."""

    # Set by _mars_init; declared for readers.
    mars_policy: Any
    clock: Clock
    retention: RetentionStore
    #: Whether the policy gates admission (read by ``max_num_active_reqs`` from vLLM's __init__ on).
    _gate = False
    _max_active = 0

    def _mars_init(self) -> None:
        check_vllm_version()
        cfg = parse_engine_config(self.vllm_config.additional_config)
        self.mars_config = cfg
        self.clock = MonotonicClock()
        policy = make_policy(cfg.policy, cfg.policy_options, self.clock)
        # the platform the engine serves: the sim's connector names the GPU it models
        policy.check_platform(getattr(self.connector, "mars_platform", None) or str(current_platform.device_type))
        if policy.needs_kv_connector and self.connector is None:
            raise ValueError(
                f"policy {cfg.policy!r} needs a KV offloading connector and none is configured: start vLLM "
                "with --kv-offloading-size <GiB> (mars: --engine-arg kv_offloading_size=<GiB>)")
        self.mars_policy = policy
        self._calls: dict[str, CallView] = {}
        self._seq = 0
        self._returning: dict[str, str] = {}  # returning request id -> workflow with retained KV
        self.retention = RetentionStore(self.kv_cache_manager.block_pool)
        self.mars_num_preemptions = 0
        self.mars_recomputed_tokens = 0
        self.mars_prompt_tokens = 0  # prompt tokens of calls scheduled for the first time
        self.mars_prefix_hit_tokens = 0  # ... of which served from the prefix cache
        #: vLLM was started with its priority policy: the requests' own priorities rank victims first.
        self._user_priorities = self.policy == SchedulingPolicy.PRIORITY
        if policy.orders or policy.gates:
            if policy.orders:
                # vLLM's PRIORITY mode preempts max(priority); we set priority to victim rank.
                self.policy = SchedulingPolicy.PRIORITY
            calls = self._calls

            def key(request: Request) -> Any:
                return policy.waiting_key(calls[request.request_id])

            self.waiting = PolicyQueue(key)
            self.kv_holding_waiting = PolicyQueue(key)
        self._gate = bool(policy.gates)
        if not policy.caps_chunks and type(self)._reserve_prefill_lookahead is _mars_reserve_prefill_lookahead:
            # Nothing to cap: vLLM's own method, without a Python call in between.
            self._reserve_prefill_lookahead = _vllm_reserve_prefill_lookahead.__get__(self)
        self._victims_ranked = True  # custom victim ranks are set lazily, when an allocation fails
        if policy.retains or (policy.orders and policy.custom_victims):
            install_reclaim(self)
        self._kv_events = kv_events.count_events(self)
        policy.bind(self)
        self._sched_log = SchedLog.from_env(cfg.policy)
        self._warned: set[str] = set()
        self._cost = StepCostFit(policy, cfg, self.clock, cfg.policy)
        self._next_tool = None
        if cfg.tool_parser is not None and policy.retains:
            self._next_tool = NextToolReader.for_model(cfg.tool_parser, self.vllm_config.model_config)
            if self._next_tool is not None:
                logger.info("MarsScheduler: reading the next tool from outputs with vLLM's %s tool parser",
                            cfg.tool_parser)
        self._waker: ExpiryWaker | None = None
        queue = engine_core_input_queue() if policy.retains else None
        if queue is not None:
            message = wakeup_message()
            self._waker = ExpiryWaker(lambda: queue.put_nowait(message), lambda: self.clock.now())
        logger.info("MarsScheduler: policy=%s options=%s", cfg.policy, dict(cfg.policy_options))

    # -- the admission gate -----------------------------------------------------------------------
    @property
    def max_num_active_reqs(self) -> int:
        """vLLM's cap on requests admitted into RUNNING, read by its waiting loop right before it
        takes the next waiting request; 0 (admit nothing more this step) while the policy holds
        the head of the waiting queue. Requests holding KV blocks (``kv_holding_waiting``, drained
        first) are never held."""
        cap = self._max_active
        if (self._gate and self.waiting and not self.kv_holding_waiting
                # vLLM stops on a full running set anyway: no need to sort 1000 waiting calls
                and len(self.running) + self.num_waiting_for_streaming_input < cap
                and not self.admits_waiting_head()):
            return 0
        return cap

    @max_num_active_reqs.setter
    def max_num_active_reqs(self, value: int) -> None:
        self._max_active = value

    def admits_waiting_head(self) -> bool:
        """Whether the policy lets the head of the waiting queue start now."""
        return self.mars_policy.may_start(self._calls[self.waiting.peek_request().request_id])

    # -- the cost model ---------------------------------------------------------------------------
    def defer_cost_warning(self, deferred: bool) -> None:
        """While ``deferred``, steps do not count as the run's first work for the uncalibrated
        warning: the driver's calibration calls, after which it pins the model they measured."""
        self._cost.deferred = deferred

    def set_cost_model(self, model: Any) -> None:
        """Pin a calibrated cost model (the driver's calibration); online fitting stops."""
        self._cost.pin(model)

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        if self._cost.pending:
            self._cost.processed(scheduler_output)
        return super().update_from_output(scheduler_output, model_runner_output)

    # -- injectable clock -------------------------------------------------------------------------
    def set_clock(self, clock: Clock) -> None:
        """Use ``clock`` for all policy time (tests and the simulator pass a VirtualClock)."""
        if self.requests:
            raise RuntimeError("set the clock before the first request")
        self.clock = clock
        self.mars_policy.clock = clock
        self._cost.clock = clock

    # -- EngineView for policies ------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.kv_cache_manager.block_pool.num_gpu_blocks - 1  # minus the null block

    @property
    def token_budget(self) -> int:
        return self.max_num_scheduled_tokens

    def free_blocks(self) -> int:
        return self.kv_cache_manager.block_pool.get_num_free_blocks()

    def running_calls(self) -> list[CallView]:
        calls = self._calls
        # A call that finished this step is still in self.running while _free_blocks runs (its
        # view is already gone): skip it, so retention_s may look at the running batch.
        return [c for r in self.running if (c := calls.get(r.request_id)) is not None]

    def waiting_calls(self) -> list[CallView]:
        calls = self._calls
        return [calls[r.request_id] for q in (self.kv_holding_waiting, self.waiting) for r in q]

    def call(self, request_id: str) -> CallView | None:
        return self._calls.get(request_id)

    # -- seams ------------------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Admit a request to the policy. Nothing a client sends raises out of here: a malformed
        tag (or a policy that rejects the tagged call) makes it an untagged one-call workflow."""
        rid = request.request_id
        if rid not in self.requests:
            now = self.clock.now()
            if self.retention:
                self.retention.release_expired(now)
            wf = self._workflow_of(request)
            call = CallView(request, wf, now, self._seq)
            self._seq += 1
            try:
                self.mars_policy.on_arrival(call)
            except Exception as e:  # a client value the policy cannot take
                if not wf.tagged:
                    raise
                self._warn_bad_tag(request, wf.workflow, f"policy rejected the tags ({e!r})")
                wf = _untagged(rid)
                call = CallView(request, wf, now, call.seq)
                self.mars_policy.on_arrival(call)
            self._calls[rid] = call
            if wf.workflow in self.retention:
                self._returning[rid] = wf.workflow
            if self._sched_log is not None:
                self._sched_log.event("arrive", call, now, prompt_tokens=request.num_prompt_tokens,
                                      extra_args=request.sampling_params.extra_args
                                      if request.sampling_params else None)
        super().add_request(request)

    def _workflow_of(self, request: Request) -> WorkflowInfo:
        sp = request.sampling_params
        extra = sp.extra_args if sp is not None else None
        try:
            return workflow_from_extra_args(extra, request.request_id)
        except Exception as e:  # noqa: BLE001 - any bad tag: serve the call untagged
            claimed = extra.get("mars_workflow") if isinstance(extra, dict) else None
            self._warn_bad_tag(request, claimed if isinstance(claimed, str) else None, str(e))
            return _untagged(request.request_id)

    def _warn_bad_tag(self, request: Request, workflow: str | None, why: str) -> None:
        """Log a malformed tag once per claimed workflow (once per request when none is claimed)."""
        key = workflow if workflow is not None else request.request_id
        if key in self._warned:
            return
        if len(self._warned) >= _MAX_WARNED:
            self._warned.clear()
        self._warned.add(key)
        logger.warning("request %s (workflow %s): %s; serving it as an untagged one-call workflow",
                       short_id(request.request_id), short_id(workflow), why)

    def has_requests(self) -> bool:
        """vLLM's answer, or True once a retention is due on an engine core that would otherwise
        wait for input (it then steps, and ``schedule()`` releases it); before it waits, the
        next expiry is armed to wake it (:mod:`~vllm_mars.engine.wakeup`)."""
        if super().has_requests():
            return True
        waker = self._waker
        if waker is None or not self.retention:
            return False
        due = self.retention.next_expiry()
        if due <= self.clock.now():
            return True
        waker.arm(due)
        return False

    def schedule(self, throttle_prefills: bool = False):
        now = self.clock.now()
        self._mars_begin_step(now)
        return self._mars_schedule_begun(now, throttle_prefills)

    def _mars_schedule_begun(self, now: float, throttle_prefills: bool = False) -> Any:
        """vLLM's ``schedule()`` and the policy's end of the step, for a step whose
        ``_mars_begin_step(now)`` already ran (the simulator's fast-forward hands such a step back)."""
        out = super().schedule(throttle_prefills)
        self._mars_end_step(out, now)
        return out

    def _mars_begin_step(self, now: float) -> None:
        """The policy's part of a step before vLLM's ``schedule()`` (the simulator's decode
        fast-forward runs it for the steps it takes without ``schedule()``)."""
        policy = self.mars_policy
        if self.retention:
            self.retention.release_expired(now)
        if policy.orders or policy.caps_chunks:
            policy.begin_step()
        if policy.orders:
            self._order_running()
            self.waiting.mark_dirty()
            self.kv_holding_waiting.mark_dirty()
        # A gate without ordering keeps the static arrival order: nothing to re-sort; the gate
        # itself is asked afresh every time vLLM is about to admit a waiting call.

    def _mars_end_step(self, out: Any, now: float) -> None:
        """The policy's part of a step after vLLM's ``schedule()`` returned ``out`` (reads its
        ``scheduled_new_reqs``, ``num_scheduled_tokens`` and ``total_num_scheduled_tokens``)."""
        policy = self.mars_policy
        calls = self._calls
        for new in out.scheduled_new_reqs:
            call = calls.get(new.req_id)
            if call is not None and call.cached_tokens < 0:
                call.cached_tokens = new.num_computed_tokens
                self.mars_prefix_hit_tokens += new.num_computed_tokens
                self.mars_prompt_tokens += call.num_prompt_tokens
        if policy.orders or policy.tracks_service:
            track = policy.on_scheduled if policy.tracks_service else None
            for rid, n in out.num_scheduled_tokens.items():
                call = calls[rid]
                call.last_scheduled = now
                if track is not None:
                    track(call, n)
        if self._returning:
            self._release_returned(out.num_scheduled_tokens, now)
        cost = self._cost
        if cost.fit is not None:
            cost.scheduled(out, self.requests)
        if cost.warning_due and out.total_num_scheduled_tokens:
            cost.check_warning()

    def _mars_steady_decodes(self) -> bool:
        """Whether further decode-only steps of the running calls, in their order, change nothing
        of the policy's but what :meth:`_mars_decode_steps` applies (the simulator then applies a
        run of them at once). Asked after such a step ran through ``_mars_begin_step``/
        ``_mars_end_step``; a retention's expiry is the caller's to check."""
        returning = self._returning
        if returning and any(r.request_id in returning for r in self.running):
            return False
        return self._cost.fit is None and self.mars_policy.steady_decodes(self.running_calls())

    def _mars_decode_steps(self, steps: int, last_now: float) -> None:
        """The policy's part of ``steps`` decode-only steps at once, the last begun at ``last_now``:
        the state that many ``_mars_begin_step``/``_mars_end_step`` pairs leave when every running
        call is scheduled one token a step and :meth:`_mars_steady_decodes` held (no retention
        expired by ``last_now``: the caller's check). Their requests already count the tokens."""
        policy = self.mars_policy
        if policy.orders or policy.caps_chunks:
            policy.begin_step()
        if policy.orders:
            # the order stands (steady keys); what the ordering pass sets beside it
            if policy.custom_victims:
                self._victims_ranked = False
            self.waiting.mark_dirty()
            self.kv_holding_waiting.mark_dirty()
        if policy.orders or policy.tracks_service:
            calls = self._calls
            bulk = policy.on_decode_steps if policy.tracks_service else None
            for r in self.running:
                call = calls[r.request_id]
                call.last_scheduled = last_now
                if bulk is not None:
                    bulk(call, steps)
        cost = self._cost
        if cost.warning_due:
            cost.check_warning()

    def _order_running(self) -> None:
        calls = self._calls
        policy = self.mars_policy
        rkey = policy.running_key
        running = self.running
        running.sort(key=lambda r: rkey(calls[r.request_id]))
        if policy.custom_victims:
            # The policy's own rank is taken only when vLLM is about to preempt (a running call's
            # allocation failed, seen by the reclaim seam): most steps preempt nobody, and the rank
            # is a sort with a Python key per call. Until then the running order stands, so a
            # failure the seam does not see (a wrapper of allocate_slots outside ours) preempts by
            # this step's order, never by a rank left from an earlier step.
            self._victims_ranked = False
        self._write_victim_ranks(running)

    def _rank_victims(self) -> None:
        """Set each running request's ``priority`` to the policy's victim rank. The keys read what
        the step's ordering pass filled in, and preemption happens only in vLLM's pass over the
        running calls, before any waiting call joins them, so a rank taken at the first failed
        allocation equals one taken at the step's start."""
        calls = self._calls
        vkey = self.mars_policy.victim_key
        self._write_victim_ranks(sorted(self.running, key=lambda r: vkey(calls[r.request_id])))
        self._victims_ranked = True

    def _write_victim_ranks(self, ordered: list[Request]) -> None:
        """Write each request's victim rank into its ``priority`` (vLLM's PRIORITY mode preempts
        the largest), ``ordered`` from the last to go to the first. Under vLLM's fcfs policy the
        requests' own priorities decide nothing, as in stock vLLM. Under its priority policy they
        are the user's order: the largest is preempted first, as stock vLLM does, and ``ordered``
        breaks ties. A user's priority is read wherever the request holds a plain int rather than
        a rank written here (:class:`_VictimRank`), so one set after arrival counts too."""
        if not self._user_priorities:
            for i, r in enumerate(ordered):
                r.priority = i
            return
        calls = self._calls
        for r in ordered:
            if type(r.priority) is not _VictimRank:
                calls[r.request_id].user_priority = r.priority
        for i, r in enumerate(sorted(ordered, key=lambda r: calls[r.request_id].user_priority)):
            r.priority = _VictimRank(i)

    def _release_returned(self, scheduled: dict[str, int], now: float) -> None:
        for rid in [r for r in self._returning if r in scheduled]:
            wf = self._returning.pop(rid)
            self.retention.release(wf, now, "on_return")

    def _reserve_prefill_lookahead(self, request: Request, num_computed_tokens: int,
                                   num_new_tokens: int) -> int:
        """The policy's chunk cap, then vLLM's own prefill-lookahead guard on the capped chunk.

        Only prefill chunks are capped: a step with at most one known token left (a decode step,
        with or without draft tokens) passes untouched, so speculative decoding keeps its
        ``1 + num_spec_tokens`` rows. The cap comes first so that vLLM's guard (never end a chunk
        within ``num_prefill_lookahead`` of the prefill end) sees the chunk that will run. A
        policy that caps no chunk runs vLLM's method itself (see ``_mars_init``): this is called
        for every scheduled request of every step.
        """
        if num_new_tokens > 1 and request.num_tokens - num_computed_tokens > 1:
            cap = self.mars_policy.chunk_tokens(self._calls[request.request_id], num_computed_tokens,
                                                num_new_tokens)
            num_new_tokens = max(0, min(num_new_tokens, cap))
        return _vllm_reserve_prefill_lookahead(self, request, num_computed_tokens, num_new_tokens)

    def _preempt_request(self, request: Request, timestamp: float, drop_stale_output: bool = False) -> None:
        # Tokens of steps still in flight (async scheduling) were never computed: not recomputed work.
        recomputed = max(0, request.num_computed_tokens - request.num_in_flight_tokens)
        super()._preempt_request(request, timestamp, drop_stale_output)
        self.mars_num_preemptions += 1
        self.mars_recomputed_tokens += recomputed
        call = self._calls.get(request.request_id)
        if call is not None:
            self.mars_policy.on_preempted(call)

    def _free_blocks(self, request: Request) -> None:
        call = self._calls.pop(request.request_id, None)
        if call is not None:
            aborted = request.status == _ABORTED
            policy = self.mars_policy
            info = call.workflow
            if self._next_tool is not None and not aborted and info.tagged and not info.last_step:
                call.next_tool = self._next_tool.read(request.output_token_ids) or call.next_tool
            policy.on_finished(call, aborted)
            if self._sched_log is not None:
                self._sched_log.event("end", call, self.clock.now(), aborted=aborted,
                                      output_tokens=request.num_output_tokens, cached_tokens=call.cached_tokens,
                                      preemptions=request.num_preemptions, next_tool=short_id(call.next_tool))
            wf = info.workflow
            self._returning.pop(request.request_id, None)
            if aborted:
                if wf in self.retention:
                    self.retention.release(wf, self.clock.now(), "on_abort")
            elif policy.retains and info.tagged and not info.last_step:
                retain_finished(self, request, call)
        super()._free_blocks(request)

    def shutdown(self) -> None:
        super().shutdown()
        waker, self._waker = getattr(self, "_waker", None), None
        if waker is not None:
            waker.close()
        log, self._sched_log = getattr(self, "_sched_log", None), None
        if log is not None:
            log.close()

    def count_block_removals(self) -> None:
        """Count KV block removals (cached blocks evicted for reuse) with vLLM's KV events OFF
        (:func:`~vllm_mars.engine.kv_events.count_block_removals`); the simulator uses this."""
        if self._kv_events is None:
            self._kv_events = kv_events.count_block_removals(self.kv_cache_manager.block_pool)

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        """vLLM's reset, after dropping retained KV: a retained block is referenced, so vLLM's
        reset (and every pause/sleep that clears caches) would fail while any is held."""
        if self.retention:
            self.release_retention()
        self._returning.clear()
        return super().reset_prefix_cache(reset_running_requests, reset_connector)

    def release_retention(self, now: float | None = None) -> int:
        """Drop every retained entry (shutdown, tests). Returns the blocks released."""
        return self.retention.release_all(self.clock.now() if now is None else now)

    def mars_stats(self) -> dict[str, Any]:
        """Engine-side counters for telemetry readers and tests
        (:func:`~vllm_mars.engine.observe.scheduler_stats`)."""
        return scheduler_stats(self)


_vllm_reserve_prefill_lookahead = Scheduler._reserve_prefill_lookahead
_mars_reserve_prefill_lookahead = MarsSchedulerMixin._reserve_prefill_lookahead


def _chosen_class(named: type, async_scheduling: bool) -> type:
    """The class to build when ``named`` is constructed: ``MarsScheduler`` follows vLLM's
    async-scheduling decision (as vLLM itself picks ``AsyncScheduler`` when no class is named);
    any other class, ``AsyncMarsScheduler`` included, is built as named, as vLLM builds its own
    ``AsyncScheduler`` whatever the config says."""
    if named is MarsScheduler:
        return AsyncMarsScheduler if async_scheduling else MarsScheduler
    return named


class MarsScheduler(MarsSchedulerMixin, Scheduler):
    """vLLM's Scheduler with a MARS policy; builds an :class:`AsyncMarsScheduler` when async is on.

    vLLM decides ``scheduler_config.async_scheduling`` (VllmConfig's post-init, then the platform
    hook: on by default on CUDA, always off on CPU) before the engine core constructs the
    ``scheduler_cls``. Constructing ``MarsScheduler`` reads that decision, the way vLLM itself
    picks ``AsyncScheduler`` when no class is named, so the one documented name fits every engine
    (a synchronous scheduler under an async engine would lose the overlap). A class named
    explicitly is built as named, as vLLM builds ``AsyncScheduler`` when it is named: vLLM's own
    tests (``tests/v1/core``) build the async variant with async scheduling off in the config.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> MarsScheduler:  # noqa: PYI034 - may build the variant
        vllm_config = kwargs["vllm_config"] if "vllm_config" in kwargs else args[0]
        return super().__new__(_chosen_class(cls, bool(vllm_config.scheduler_config.async_scheduling)))

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._mars_init()
        async_on = bool(self.scheduler_config.async_scheduling)
        logger.info("%s built (async_scheduling=%s)", type(self).__name__, async_on)
        if isinstance(self, AsyncScheduler) != async_on:
            # A class named explicitly (AsyncMarsScheduler, a user subclass) is built as named.
            logger.warning("MARS scheduler mismatch: %s runs with async_scheduling=%s (name MarsScheduler "
                           "to get the variant that matches the engine)", type(self).__name__, async_on)


class AsyncMarsScheduler(MarsScheduler, AsyncScheduler):
    """vLLM's AsyncScheduler with a MARS policy (what :class:`MarsScheduler` builds under async)."""


# Policies read the live running state without importing vllm.
CallView.RUNNING_STATUS = _RUNNING
