"""MarsScheduler: vLLM's own Scheduler with a pluggable Policy applied at vLLM's seams.

Select it with ``scheduler_cls="vllm_mars.engine.scheduler.MarsScheduler"`` (``--scheduler-cls``)
and configure it with ``additional_config={"mars": {"policy": ...}}``. Where vLLM runs async
scheduling (GPU by default) it builds ``AsyncMarsScheduler`` instead (a plain Scheduler subclass
would silently lose the async overlap there). ``schedule()`` itself is never copied; the policy
acts through:

* order: ``self.running`` is sorted by the policy's ``running_key`` before each step and each
  request's ``priority`` set to its victim rank, with vLLM in PRIORITY mode, so vLLM's own
  preemption picks the policy's victim; the waiting queues are a :class:`PolicyQueue`;
* admission gate: :class:`PolicyQueue` reports itself empty while the policy holds its head;
* chunk caps: ``_reserve_prefill_lookahead``, called right before every ``allocate_slots``;
* retention: ``_free_blocks`` keeps a finished call's cached blocks referenced
  (:mod:`vllm_mars.engine.retention`), and a failed allocation releases retained KV first; with a
  ``tool_parser`` configured it first reads the tool the call is about to run from its output
  (:mod:`vllm_mars.engine.next_tool`).
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections import deque
from collections.abc import Iterable, Iterator
from typing import Any

from vllm.platforms import current_platform
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.request_queue import RequestQueue, SchedulingPolicy
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request, RequestStatus

from vllm_mars.clock import Clock, MonotonicClock
from vllm_mars.config import parse_engine_config
from vllm_mars.costmodel import OnlineCostFit
from vllm_mars.engine.compat import check_vllm_version
from vllm_mars.engine.retention import RetentionStore
from vllm_mars.policies import CallView, make_policy
from vllm_mars.workflow import WorkflowInfo, short_id, workflow_from_extra_args

logger = logging.getLogger(__name__)

#: Path of a JSON-lines log of call arrivals and ends (off when unset): lets tests and operators see
#: what reached the scheduler inside the EngineCore process.
ENV_SCHED_LOG = "MARS_SCHED_LOG"

_RUNNING = RequestStatus.RUNNING
_ABORTED = RequestStatus.FINISHED_ABORTED
#: Bound of the set of workflows already warned about a malformed tag (cleared when full).
_MAX_WARNED = 10_000


def _untagged(request_id: str) -> WorkflowInfo:
    """The workflow of a call served without (or despite) its tags: itself alone."""
    return WorkflowInfo(request_id, request_id, last_step=True, tagged=False)


def _safe_str(v: Any) -> str:
    try:
        return short_id(str(v))
    except ValueError:
        return f"<{type(v).__name__}>"


class PolicyQueue(RequestQueue):
    """A waiting queue in the policy's ``waiting_key`` order, sorted lazily when looked at.

    Kept in reverse order so the head pops from the end of the list. With a gate, the queue
    reports itself empty while the policy holds its head, which is how vLLM's waiting loop stops.
    Otherwise it behaves like vLLM's own queues: ``len``, iteration and indexing (``q[0]`` is the
    head, ``q[-1]`` the tail, slices too) all follow scheduling order, ``in`` finds a request.
    """

    def __init__(self, owner: MarsSchedulerMixin, gated: bool = False) -> None:
        self._owner = owner
        self._items: list[Request] = []
        self._dirty = False
        self._gated = gated

    def _key(self, request: Request) -> Any:
        return self._owner.mars_policy.waiting_key(self._owner._calls[request.request_id])

    def mark_dirty(self) -> None:
        self._dirty = True

    def _sorted(self) -> list[Request]:
        if self._dirty:
            self._items.sort(key=self._key, reverse=True)
            self._dirty = False
        return self._items

    def add_request(self, request: Request) -> None:
        self._items.append(request)
        self._dirty = True

    def pop_request(self) -> Request:
        return self._sorted().pop()

    def peek_request(self) -> Request:
        items = self._sorted()
        if not items:
            raise IndexError("peek from an empty queue")
        return items[-1]

    def prepend_request(self, request: Request) -> None:
        self.add_request(request)

    def prepend_requests(self, requests: Iterable[Request]) -> None:
        self._items.extend(requests)
        self._dirty = True

    def remove_request(self, request: Request) -> None:
        self._items.remove(request)

    def remove_requests(self, requests: Iterable[Request]) -> None:
        drop = set(requests)
        self._items = [r for r in self._items if r not in drop]

    def __bool__(self) -> bool:
        if not self._items:
            return False
        if self._gated:
            owner = self._owner
            # vLLM's waiting loop stops on a full running set right after asking whether the queue
            # is empty: no need to sort it (1000 waiting calls, every step) to answer the gate.
            if len(owner.running) + owner.num_waiting_for_streaming_input >= owner.max_num_active_reqs:
                return True
            return owner.mars_policy.may_start(owner._calls[self._sorted()[-1].request_id])
        return True

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._sorted()[::-1])

    def __getitem__(self, index: int | slice) -> Request | list[Request]:
        return self._sorted()[::-1][index]

    def __contains__(self, request: object) -> bool:
        return request in self._items

    def __repr__(self) -> str:
        return f"PolicyQueue({[r.request_id for r in self]!r}, gated={self._gated})"


class _CountingPublisher:
    """Wraps vLLM's KV-event publisher: counts stored and removed blocks, then forwards the batch.

    vLLM emits these events only when ``kv_events_config.enable_kv_cache_events`` is on (the
    ``null`` publisher is enough): a removal is a cached block evicted for reuse, the "KV block
    removals" of a thrashing run.
    """

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.blocks_stored = 0
        self.blocks_removed = 0

    def publish(self, batch: Any) -> None:
        for ev in batch.events:
            kind = type(ev).__name__
            if kind == "BlockRemoved":
                self.blocks_removed += len(ev.block_hashes)
            elif kind == "BlockStored":
                self.blocks_stored += len(ev.block_hashes)
        self._inner.publish(batch)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class _RemovalCounter:
    """Counts KV block removals where they would become events, with vLLM's KV events off."""

    def __init__(self) -> None:
        self.blocks_removed = 0
        self.blocks_stored = None  # not counted without events


class MarsSchedulerMixin:
    """The policy plumbing shared by MarsScheduler and AsyncMarsScheduler."""

    # Set by _mars_init; declared for readers.
    mars_policy: Any
    clock: Clock
    retention: RetentionStore

    def _mars_init(self) -> None:
        check_vllm_version()
        cfg = parse_engine_config(self.vllm_config.additional_config)
        self.mars_config = cfg
        self.clock = MonotonicClock()
        policy = make_policy(cfg.policy, cfg.policy_options, self.clock)
        policy.check_platform(str(current_platform.device_type))
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
        if policy.orders or policy.gates:
            if policy.orders:
                # vLLM's PRIORITY mode preempts max(priority); we set priority to victim rank.
                self.policy = SchedulingPolicy.PRIORITY
            self.waiting = PolicyQueue(self, gated=policy.gates)
            self.kv_holding_waiting = PolicyQueue(self)
        self._victims_ranked = True  # custom victim ranks are set lazily, when an allocation fails
        if policy.retains or (policy.orders and policy.custom_victims):
            self._wrap_allocate_for_reclaim()
        self._kv_events = None
        if self.kv_events_config is not None and self.kv_events_config.enable_kv_cache_events:
            self._kv_events = self.kv_event_publisher = _CountingPublisher(self.kv_event_publisher)
        policy.bind(self)
        path = os.environ.get(ENV_SCHED_LOG)
        self._sched_log = open(path, "a", buffering=1) if path else None  # noqa: SIM115 - closed in shutdown()
        self._warned: set[str] = set()
        self._init_cost_model(cfg)
        self._next_tool = None
        if cfg.tool_parser is not None and policy.retains:
            from vllm_mars.engine.next_tool import NextToolReader

            self._next_tool = NextToolReader.for_model(cfg.tool_parser, self.vllm_config.model_config)
            if self._next_tool is not None:
                logger.info("MarsScheduler: reading the next tool from outputs with vLLM's %s tool parser",
                            cfg.tool_parser)
        logger.info("MarsScheduler: policy=%s options=%s", cfg.policy, dict(cfg.policy_options))

    # -- the cost model -----------------------------------------------------------------------------
    def _init_cost_model(self, cfg: Any) -> None:
        """Hand a cost-pricing policy its model: the configured one, else an online fit of this
        engine's step times (sync or async scheduling: see :meth:`_record_step_work`). Running on
        the uncalibrated default is logged as a warning."""
        policy = self.mars_policy
        self._cost_fit: OnlineCostFit | None = None
        #: Steps scheduled and not yet processed, oldest first: (output, when scheduled, prefill
        #: chunks, decoding calls); at most the engine's steps in flight plus one.
        self._step_work: deque[tuple[Any, float, list[tuple[int, int]], int]] = deque()
        #: When the last step's output was processed (a step in flight starts no earlier).
        self._last_output_at = -math.inf
        self._cost_warning_due = False
        self._cost_warning_deferred = False
        if not policy.uses_cost:
            return
        if cfg.cost_model is not None:
            policy.set_cost_model(cfg.cost_model)
        elif cfg.online_cost:
            self._cost_fit = OnlineCostFit()
        # Said at the first step that schedules work, not here: the driver pins its calibration
        # right after the engine starts, and a warning now would be false for every run it drives.
        self._cost_warning_due = not policy.cost.calibrated

    def defer_cost_warning(self, deferred: bool) -> None:
        """While ``deferred``, steps do not count as the run's first work for the uncalibrated
        warning: the driver's calibration calls, after which it pins the model they measured."""
        self._cost_warning_deferred = deferred

    def _warn_if_uncalibrated(self) -> None:
        self._cost_warning_due = False
        policy = self.mars_policy
        if not policy.cost.calibrated:
            logger.warning("MarsScheduler: policy %s prices rebuilds with the UNCALIBRATED default cost model "
                           "(%s)%s; pass additional_config['mars']['cost_model'] (mars serve --cost-model)",
                           self.mars_config.policy, policy.cost.source,
                           " until the online fit of step times has enough steps" if self._cost_fit else "")

    def set_cost_model(self, model: Any) -> None:
        """Pin a calibrated cost model (the driver's calibration); online fitting stops."""
        self.mars_policy.set_cost_model(model)
        self._cost_fit = None
        if self.mars_policy.uses_cost:
            logger.info("MarsScheduler: policy %s now prices rebuilds with %s (pinned)",
                        self.mars_config.policy, getattr(model, "source", model))

    def _record_step_work(self, out: Any) -> None:
        """What step ``out`` computes, for the online fit. Its time is taken when its output is
        processed: from when it was scheduled or the previous output was processed, whichever is
        later. Under sync scheduling that is the schedule; under async scheduling (vLLM's default
        on GPU) the next step is scheduled while this one runs, and the device starts it when the
        one before is done, which is about when that one's output is processed."""
        requests = self.requests
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
        pending = self._step_work
        if len(pending) > 4:  # outputs never processed (cannot happen in vLLM's loops): forget them
            pending.popleft()
        pending.append((out, self.clock.now(), prefill, decodes))

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        pending = self._step_work
        work = None
        while pending:  # vLLM processes outputs in the order it scheduled them
            entry = pending.popleft()
            if entry[0] is scheduler_output:
                work = entry
                break
        if work is not None:
            now = self.clock.now()
            start = max(work[1], self._last_output_at)
            self._last_output_at = now
            fit = self._cost_fit
            if fit is not None:
                fit.observe(now - start, work[2], work[3])
                if fit.steps % 16 == 0 and (model := fit.model()) is not None:
                    policy = self.mars_policy
                    if policy.cost_pinned:
                        self._cost_fit = None
                    elif model is not policy.cost:
                        first = not policy.cost.calibrated
                        policy.set_cost_model(model, pinned=False)
                        if first:
                            logger.info("MarsScheduler: policy %s now prices rebuilds with %s",
                                        self.mars_config.policy, model.source)
        return super().update_from_output(scheduler_output, model_runner_output)

    # -- injectable clock -------------------------------------------------------------------------
    def set_clock(self, clock: Clock) -> None:
        """Use ``clock`` for all policy time (tests and the simulator pass a VirtualClock)."""
        if self.requests:
            raise RuntimeError("set the clock before the first request")
        self.clock = clock
        self.mars_policy.clock = clock

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
                self._log_event("arrive", call, prompt_tokens=request.num_prompt_tokens,
                                extra_args=request.sampling_params.extra_args if request.sampling_params else None)
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

    def schedule(self, throttle_prefills: bool = False):
        now = self.clock.now()
        self._mars_begin_step(now)
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
        # itself is asked afresh every time vLLM looks at the queue.

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
        if self._cost_fit is not None:
            self._record_step_work(out)
        if self._cost_warning_due and out.total_num_scheduled_tokens and not self._cost_warning_deferred:
            self._warn_if_uncalibrated()

    def _order_running(self) -> None:
        calls = self._calls
        policy = self.mars_policy
        rkey = policy.running_key
        running = self.running
        running.sort(key=lambda r: rkey(calls[r.request_id]))
        if policy.custom_victims:
            # Ranked only when vLLM is about to preempt (a running call's allocation failed):
            # most steps preempt nobody, and the rank is a sort with a Python key per call.
            self._victims_ranked = False
            return
        for i, r in enumerate(running):
            r.priority = i

    def _rank_victims(self) -> None:
        """Set each running request's ``priority`` to its victim rank (vLLM's PRIORITY mode
        preempts the largest). The keys read what the step's ordering pass filled in, and
        preemption happens only in vLLM's pass over the running calls, before any waiting call
        joins them, so a rank taken at the first failed allocation equals one taken at the step's
        start."""
        calls = self._calls
        vkey = self.mars_policy.victim_key
        for i, r in enumerate(sorted(self.running, key=lambda r: vkey(calls[r.request_id]))):
            r.priority = i
        self._victims_ranked = True

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
        within ``num_prefill_lookahead`` of the prefill end) sees the chunk that will run.
        """
        policy = self.mars_policy
        if policy.caps_chunks and request.num_tokens - num_computed_tokens > 1 and num_new_tokens > 1:
            cap = policy.chunk_tokens(self._calls[request.request_id], num_computed_tokens, num_new_tokens)
            num_new_tokens = max(0, min(num_new_tokens, cap))
        return super()._reserve_prefill_lookahead(request, num_computed_tokens, num_new_tokens)

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
                self._log_event("end", call, aborted=aborted, output_tokens=request.num_output_tokens,
                                cached_tokens=call.cached_tokens,
                                preemptions=request.num_preemptions, next_tool=short_id(call.next_tool))
            wf = info.workflow
            self._returning.pop(request.request_id, None)
            if aborted:
                if wf in self.retention:
                    self.retention.release(wf, self.clock.now(), "on_abort")
            elif policy.retains and info.tagged and not info.last_step:
                self._maybe_retain(request, call)
        super()._free_blocks(request)

    def _log_event(self, event: str, call: CallView, **fields: Any) -> None:
        """One JSON line per arrival/end; ids are capped (:func:`short_id`) and a value that cannot be
        written (e.g. an int beyond Python's str limit in extra_args) never fails the call."""
        wf = call.workflow
        rec = {"ts": self.clock.now(), "event": event, "policy": self.mars_config.policy,
               "request_id": short_id(call.request_id),
               "workflow": short_id(wf.workflow), "root": short_id(wf.root), "parent": short_id(wf.parent),
               "turn": wf.turn, "last_step": wf.last_step, "tool": short_id(wf.tool), "tagged": wf.tagged,
               **fields}
        if isinstance(rec.get("extra_args"), dict):
            rec["extra_args"] = {short_id(str(k)): short_id(v) for k, v in rec["extra_args"].items()}
        try:
            line = json.dumps(rec, default=str)
        except (TypeError, ValueError):
            rec["extra_args"] = "<not serialisable>"
            line = json.dumps(rec, default=_safe_str)
        self._sched_log.write(line + "\n")

    def shutdown(self) -> None:
        super().shutdown()
        log, self._sched_log = getattr(self, "_sched_log", None), None
        if log is not None:
            log.close()

    def _maybe_retain(self, request: Request, call: CallView) -> None:
        blocks = [b for group in self.kv_cache_manager.get_blocks(request.request_id).blocks
                  for b in group if b.block_hash is not None and not b.is_null]
        if not blocks:
            return
        tau = self.mars_policy.retention_s(call, len(blocks))
        if tau > 0:
            value = self.mars_policy.retention_value(call, len(blocks))
            self.retention.hold(call.workflow.workflow, request.request_id, blocks, self.clock.now(),
                                tau, value)

    def _wrap_allocate_for_reclaim(self) -> None:
        manager = self.kv_cache_manager
        allocate = manager.allocate_slots
        store = self.retention

        def allocate_slots(request, num_new_tokens, *args, **kwargs):
            blocks = allocate(request, num_new_tokens, *args, **kwargs)
            if blocks is None and store and self._reclaim_can_help(request, num_new_tokens, kwargs):
                # Retained KV of finished calls goes before anybody's running state.
                while blocks is None and store:
                    store.release_lowest_value(self.clock.now())
                    blocks = allocate(request, num_new_tokens, *args, **kwargs)
            if blocks is None and not self._victims_ranked and request.status == _RUNNING:
                self._rank_victims()  # vLLM preempts next, by these ranks
            return blocks

        manager.allocate_slots = allocate_slots

    def _reclaim_can_help(self, request: Request, num_new_tokens: int, kwargs: dict[str, Any]) -> bool:
        """False only when even releasing every retained block could not satisfy this allocation.

        A lower bound on the new blocks it needs (ignoring vLLM's watermark and cached hits that
        sit in the free queue) is compared with free + retained blocks; without that check a
        waiting call that cannot fit anyway would drop all retention every step.
        """
        groups = self.kv_cache_manager.coordinator.single_type_managers
        if len(groups) != 1:
            return True
        if kwargs.get("full_sequence_must_fit"):
            tokens = request.num_tokens
        else:
            tokens = (request.num_computed_tokens + kwargs.get("num_new_computed_tokens", 0)
                      + kwargs.get("num_external_computed_tokens", 0) + num_new_tokens)
        tokens = min(tokens, self.max_model_len)
        held = len(groups[0].req_to_blocks.get(request.request_id, ()))
        hit = kwargs.get("new_computed_blocks")
        hits = len(hit.blocks[0]) if hit is not None else 0
        need = -(-tokens // self.block_size) - held - hits
        return need <= self.free_blocks() + self.retention.num_blocks

    def count_block_removals(self) -> None:
        """Count KV block removals (cached blocks evicted for reuse) with vLLM's KV events OFF.

        The count is the number of hashes vLLM would publish as ``BlockRemoved`` events: every
        removal passes through ``BlockPool._emit_block_removed_events``, which returns at once when
        events are off. The simulator uses this: building and publishing one event object per block
        costs it a quarter of its time, and it only needs the number.
        """
        if self._kv_events is not None:
            return
        counter = _RemovalCounter()
        pool = self.kv_cache_manager.block_pool
        emit = pool._emit_block_removed_events

        def counting_emit(block_hashes):
            counter.blocks_removed += len(block_hashes)
            return emit(block_hashes)

        pool._emit_block_removed_events = counting_emit
        self._kv_events = counter

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
        """Engine-side counters for telemetry readers and tests."""
        st = self.retention.stats
        return {
            "policy": self.mars_config.policy,
            "free_blocks": self.free_blocks(),
            "num_blocks": self.num_blocks,
            "block_size": self.block_size,
            "retained_blocks": self.retention.num_blocks,
            "retained_workflows": len(self.retention),
            "preemptions": self.mars_num_preemptions,
            "recomputed_tokens": self.mars_recomputed_tokens,
            "prompt_tokens": self.mars_prompt_tokens,
            "prefix_hit_tokens": self.mars_prefix_hit_tokens,
            "retention": {k: v for k, v in vars(st).items() if not k.startswith("_")},
            "cost_model": self.mars_policy.cost.as_dict() if self.mars_policy.uses_cost else None,
            "policy_state": self.mars_policy.state(),
            # None unless vLLM's KV cache events are enabled (engine_kwargs(kv_events=True)).
            "kv_blocks_removed": self._kv_events.blocks_removed if self._kv_events else None,
            "kv_blocks_stored": self._kv_events.blocks_stored if self._kv_events else None,
        }


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
