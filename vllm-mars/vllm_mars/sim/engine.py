"""The virtual-time engine: vLLM's scheduler stack with the forward pass replaced by a step-time profile.

``SimBackend`` implements the driver's ``Backend`` protocol. It builds the very scheduler the
in-process engine runs (``MarsScheduler`` with the run's policy, vLLM's KV cache manager, prefix
cache, preemption and KV events) through ``engine.rig`` over the profile's config-only model dir and
KV pool, with no model executor and no KV tensors (the pool is bookkeeping only). One engine step:

1. add the requests that arrived since the last step (as vLLM's engine core drains its input queue
   between steps), ``schedule()``;
2. describe the batch (prefill chunks with their context, decodes with theirs) and charge it
   ``profile.step_seconds(prefill, decode)``: ``await asyncio.sleep(dt)`` on the virtual-time loop;
3. ``update_from_output`` with one sampled token per request whose prefill completed (exact output
   lengths come from ``ignore_eos`` + ``max_tokens``), and hand first tokens and finished calls to
   the waiting driver coroutines, stamped at the virtual end of the step.

Decode fast-forward (``SimBackend.fast_forward``, on by default). While every running request is
decoding and nothing waits, a step's outcome is known without vLLM's
``schedule()``/``update_from_output()``: every request computes one token, and the only KV work is
at block boundaries. Such steps run here directly: the scheduler's policy
hooks (``MarsScheduler._mars_begin_step``/``_mars_end_step``, at the step's virtual start), vLLM's
``allocate_slots`` for exactly the requests whose step starts or fills a block (in running order,
as ``schedule()`` calls it), one computed token and vLLM's ``append_output_token_ids`` per request,
the step's time from the profile, and the clock advanced as ``advance_if_idle`` would. A step
during which something else on the loop is due (the admission tick every 0.2 virtual s, a tool's
end, the sampler) runs the same way and then sleeps through the loop, as the full path sleeps
between ``schedule()`` and ``update_from_output()``; the engine then starts over (what ran may have
submitted or aborted calls). Any step that could differ (an arrival, a finish, a prefill, a
possible preemption, an abort) runs the full path. Results are identical with it off
(tests/test_sim_fast_forward.py).

Runs of decode steps at once (``SimBackend._decode_run``). Once such a step has run the policy's
hooks, and when nothing waits that vLLM's waiting loop would reach, the steps after it are applied
as a run while the policy says its hooks are steady (``MarsScheduler._mars_steady_decodes``: the
running order stays, and the steps' ``on_scheduled`` come to one ``on_decode_steps`` per call;
autellix's quanta and promotions move every step, so it never is): each step is priced as above and
the clock advanced by it, up to the first step that starts at or after a retention's expiry, whose
new blocks could exceed the free ones, or during which something else on the loop is due (those run
one at a time). Then, in step order and running order within a step, each request whose step
starts or fills a block is brought to where that step finds it (computed and output tokens) and
``allocate_slots`` runs for it, so vLLM's free queue, hash map and removals come out as step by
step; then the remaining tokens and the policy's hooks at once (``_mars_decode_steps``).

Calls may wait during such steps when vLLM's waiting loop would admit none of them. It stops before
the queue's head when the running set or the token budget is full; otherwise the step, after the
policy's step hooks, sorts the queue as vLLM's loop does (the policies' keys do not read the KV
pool, so sorting before the decodes' allocations orders it as after them) and checks that the head cannot start
(``_WaitPlan``): its prefix-cache lookup (the last full-path step's, kept by a wrapper of the
scheduler's ``_get_local_prefix_cache_hit``, or a new one: a lookup changes nothing) stays the same
(no decode's new block evicts one of its hit blocks, no decode's full block is cached under one of
its hashes); vLLM's own block count for a one-token chunk beside that hit (and for the whole
sequence, which vLLM requires to fit), plus the watermark, exceeds the free blocks the decodes
leave, so no chunk the policy may choose fits; and no retained KV could be released to make it fit
(``engine.reclaim.reclaim_can_help``). The policy is then asked what vLLM's loop asks, in its order:
the gate (``max_num_active_reqs``) and the head's chunk cap (``_reserve_prefill_lookahead``). When the
check fails, the step goes on through vLLM's ``schedule()`` (``MarsScheduler._mars_schedule_begun``)
and the full path takes it.

Steps with prefill chunks (``SimBackend._prefill_steps``). A running call's later prefill chunks (its
first is an admission, on the full path) run here too, beside the decodes. After the policy's step
hooks have ordered the running set, the step is checked before anything is asked or allocated:
vLLM's chunk for each call (the token budget, the long-prefill cap, the model length; the policy's
cap can only shrink it) bounds the blocks the step may take, which must all be free (no allocation
fails, nobody is preempted); a chunk that may end a prefill must sample a token that cannot stop the
call; and where vLLM's waiting loop can run, its head cannot start (``_WaitPlan``, against every
block the step may take and every hash its chunks may cache). The step then runs as ``schedule()``
runs it: per running call in order, vLLM's chunk, the policy's cap (``_reserve_prefill_lookahead``,
asked once, as vLLM asks it) and ``allocate_slots`` until the budget is spent; the waiting loop's
questions; the computed tokens, the policy's end of step, the step's time (the batch as
``engine.rig.batch_shape`` describes it) and a token per decode. A chunk that ends a prefill gives
the call its first token as the full path does (vLLM's prefill stats, stamped at the step's end), and
the engine then starts over.

Async scheduling (a profile with overlapped CPU time, ``Efficiency.overlapped_*``: vLLM's
``--async-scheduling``). vLLM's engine core then schedules step k+1 while step k runs (a batch queue of
two: ``EngineCore.step_with_batch_queue``) and drains its input queue between the two, so a call that
arrives while a step runs misses the step already scheduled behind it and first runs in the one after
(one step more to its first token than under synchronous scheduling). Here: a call submitted while
the engine is in a step waits out one more step before it is added, when the scheduler holds other
requests (with none, the step behind was empty and vLLM schedules the call at once); a call submitted
while the engine idles is added at once.

The engine is one coroutine on the same loop as the driver (``vllm_mars.sim.loop``), so arrivals,
tools and the admission loop interleave with steps exactly in virtual time, and the scheduler's
injected clock is the loop's clock. The sim knows vLLM only through ``vllm_mars.engine``.

Why one module of about 900 lines: it is one class, one step loop, whose full path and fast-forward
share its per-step state and must give identical results; split apart, the paths that must agree
would live in different files.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from collections.abc import Mapping
from itertools import compress, filterfalse, repeat
from operator import add, attrgetter, not_
from pathlib import Path
from typing import Any

from vllm_mars.admission.telemetry import EngineSample, scheduler_reading
from vllm_mars.backend import CallResult
from vllm_mars.sim.loop import LoopClock, is_virtual

#: vLLM's RequestStatus.RUNNING, resolved by :func:`_ff_supported` (importing vLLM when this module is
#: imported made every ``mars`` command, ``mars sidecar --help`` included, pay vLLM's import time)
_RUNNING: Any = None
#: vLLM's RequestStatus.WAITING and PREEMPTED (the same)
_WAITING: Any = ()

logger = logging.getLogger(__name__)

#: Virtual seconds the engine waits when it holds requests but schedules none (a policy gate, a
#: retention expiry): a real engine spins through empty steps; a new request wakes it at once.
IDLE_STEP_S = 0.005
#: The token every simulated decode step samples (any id below the vocabulary works).
SIM_TOKEN = 42


def get_profile(name_or_path: str):
    """A step-time profile by shipped name or file (``vllm_mars.sim.profile.load_profile``)."""
    try:
        from vllm_mars.sim.profile import load_profile
    except ImportError:
        raise ValueError("step-time profiles (vllm_mars.sim.profile) are not in this build") from None
    return load_profile(name_or_path)


def config_vocab_size(model_dir: str) -> int:
    """``vocab_size`` of a config-only model dir (the sim needs no tokenizer)."""
    path = Path(model_dir) / "config.json"
    cfg = json.loads(path.read_text())
    vocab = cfg.get("vocab_size") or (cfg.get("text_config") or {}).get("vocab_size")
    if not isinstance(vocab, int) or vocab <= 0:
        raise ValueError(f"{path}: no positive integer vocab_size")
    return vocab


_NO_PREFILL: tuple = ()
#: a KV block's fields, read at C speed
_REF_CNT, _IS_NULL = attrgetter("ref_cnt"), attrgetter("is_null")


class _StepOut:
    """What ``MarsScheduler._mars_end_step`` reads of a fast-forwarded decode step's output."""

    __slots__ = ("num_scheduled_tokens", "total_num_scheduled_tokens")
    scheduled_new_reqs = ()

    def __init__(self) -> None:
        self.num_scheduled_tokens: dict[str, int] = {}
        self.total_num_scheduled_tokens = 0


def _ff_supported(s: Any) -> bool:
    """Whether the scheduler's configuration lets decode steps be fast-forwarded at all: ours, sync,
    no connector, speculation, LoRA, pause, deferred frees or online cost fit in play."""
    global _RUNNING, _WAITING
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.request import RequestStatus

    _RUNNING = RequestStatus.RUNNING  # (read by _decode_ready, which runs only after this)
    _WAITING = (RequestStatus.WAITING, RequestStatus.PREEMPTED)
    kvm = s.kv_cache_manager
    return (hasattr(s, "_mars_begin_step") and not isinstance(s, AsyncScheduler)
            and not getattr(s, "prefix_replay_tokens", 0) and not getattr(kvm, "retained_hit_group_ids", ())
            and len(kvm.coordinator.single_type_managers) == 1 and not s.num_spec_tokens
            and s.connector is None and getattr(s, "ec_connector", None) is None
            and not s.defer_block_free and s.vllm_config.speculative_config is None
            and s.lora_config is None and not getattr(s, "need_mamba_block_aligned_split", False)
            and getattr(getattr(s, "_cost", None), "fit", None) is None and s.num_lookahead_tokens == 0)


class _Blocked:
    """A waiting call whose prefix-cache lookup and allocation failed in the last full-path step, with
    what vLLM's waiting loop needs of it: while its lookup gives the same blocks and even a one-token
    chunk cannot be allocated, a decode step admits nobody and the fast-forward may run it."""

    __slots__ = ("hashes", "hit", "hit_blocks", "request")

    def __init__(self, request: Any, hit_blocks: Any, hit: int, block_size: int) -> None:
        self.request = request
        self.hit_blocks = hit_blocks  # vLLM's KVCacheBlocks of the lookup
        self.hit = hit  # tokens it found cached
        #: the call's block hashes up to the first one its lookup did not find: a block cached under
        #: one of them could change the lookup
        self.hashes = frozenset(request.block_hashes[:hit // block_size + 1])


class _WaitPlan:
    """vLLM's waiting loop at a blocked head beside ``n`` decodes (module docstring): the blocks its
    allocation needs, the chunk the loop asks the policy to cap, and the checks that it still fails."""

    __slots__ = ("_chunk", "_whole", "can_help", "chunk", "evictable", "hashes", "head", "hit", "need",
                 "reclaim_args", "retained", "sched")

    def __init__(self, s: Any, blocked: _Blocked, n: int) -> None:
        kvm = s.kv_cache_manager
        head, hit = blocked.request, blocked.hit
        hit_blocks = blocked.hit_blocks.blocks
        self.sched, self.head, self.hit, self.hashes = s, head, hit, blocked.hashes
        # the hit's blocks that sit in the free queue: allocating one for a decode evicts it
        # (at C speed: a hit is thousands of blocks)
        held = hit_blocks[0]
        self.evictable = set(map(id, filterfalse(_IS_NULL, compress(held, map(not_, map(_REF_CNT, held))))))
        # The blocks its allocation needs by vLLM's count, beside scheduled calls (the watermark):
        # for a one-token chunk (more tokens need no fewer) and, when vLLM admits only what fits
        # whole, for the whole sequence. Above the free blocks a step leaves, no chunk fits.
        count = kvm.coordinator.get_num_blocks_to_allocate
        rid, end_prefill = head.request_id, max(head.num_prompt_tokens, head.num_tokens - 1)
        need = count(request_id=rid, num_tokens=min(hit + 1, kvm.max_model_len), new_computed_blocks=hit_blocks,
                     num_encoder_tokens=0, total_computed_tokens=hit, num_local_computed_tokens=hit,
                     num_tokens_main_model=hit + 1, prefill_end=end_prefill)
        if s.scheduler_reserve_full_isl:
            full = min(head.num_tokens, kvm.max_model_len)
            need = max(need, count(request_id=rid, num_tokens=full, new_computed_blocks=hit_blocks,
                                   num_encoder_tokens=0, total_computed_tokens=hit, num_local_computed_tokens=hit,
                                   num_tokens_main_model=full, apply_admission_cap=True, prefill_end=end_prefill))
        self.need = need + kvm.watermark_blocks
        # what the reclaim seam is asked after the failure (one token: the fewest blocks)
        self.reclaim_args = {"num_new_computed_tokens": hit, "new_computed_blocks": blocked.hit_blocks,
                             "full_sequence_must_fit": bool(s.scheduler_reserve_full_isl)}
        self.retained = s.retention.num_blocks
        from vllm_mars.engine.reclaim import reclaim_can_help

        self.can_help = reclaim_can_help
        # the chunk vLLM's loop asks the policy to cap, computed as vLLM does (``chunk_for``)
        cfg = s.scheduler_config
        chunk = head.num_tokens - hit
        cap = _long_prefill_cap(s)
        if 0 < cap < chunk:
            chunk = cap
        self._chunk = chunk
        self._whole = not cfg.enable_chunked_prefill and not s.is_mm_encoder_only
        self.chunk = self.chunk_for(_step_budget(s) - n)

    def chunk_for(self, budget: int) -> int:
        """The head's chunk with ``budget`` tokens left after the running calls (0: vLLM stops before
        asking the policy)."""
        if self._whole and self._chunk > budget:
            return 0
        return min(self._chunk, budget)

    def fails(self, pool: Any, new: int, fills: list, bs: int, popped: int | None = None,
              cached: tuple = ()) -> bool:
        """Whether the head's allocation fails after this step's allocations (``new`` blocks taken
        at least, ``popped`` at most: default ``new``; ``fills``: decodes filling a block;
        ``cached``: (request, first, end) block-hash index ranges that prefill chunks may cache) and
        its lookup gives the same blocks then."""
        free = pool.get_num_free_blocks() - new
        if self.need <= free:
            return False
        popped = new if popped is None else popped
        if popped and self.evictable:
            b = pool.free_block_queue.fake_free_list_head
            evictable = self.evictable
            if any(id(b := b.next_free_block) in evictable for _ in range(popped)):
                return False  # a new block would evict one of its hit's blocks
        hashes = self.hashes
        if fills and any(r.block_hashes[(r.num_computed_tokens + 1) // bs - 1] in hashes for r in fills):
            return False  # a decode's full block would be cached under one of its hashes
        if any(not hashes.isdisjoint(r.block_hashes[lo:hi]) for r, lo, hi in cached):
            return False  # so would one of a prefill chunk's
        # with retained KV the reclaim seam would release some if that could make it fit
        s = self.sched
        return not (s.retention and self.can_help(s, self.head, 1, self.reclaim_args, free))


def _blocked_head(s: Any, looked: Any) -> _Blocked | None:
    """The record of the last lookup of a full-path ``schedule()`` (``looked``: request, lookup
    result) when that call is still waiting with nothing computed: vLLM's waiting loop stopped at it
    (after a lookup, vLLM either schedules the call or stops)."""
    if looked is None:
        return None
    request, (blocks, hit, _, diverged) = looked
    if (diverged or request.status not in _WAITING or request.num_computed_tokens
            or request.request_id not in s.requests):
        return None
    return _Blocked(request, blocks, hit, s.block_size)


def _step_budget(s: Any) -> int:
    """The tokens one step schedules at most (vLLM's token and input budgets; no draft slots)."""
    return min(s.max_num_scheduled_tokens, s.scheduler_config.max_num_batched_tokens)


def _long_prefill_cap(s: Any) -> int:
    """vLLM's cap on one request's chunk this step (0: none), from the calls it counts."""
    cfg = s.scheduler_config
    num_running, num_waiting = s.get_request_counts()
    eligible = num_running + num_waiting
    cap = cfg.long_prefill_token_threshold if eligible > 1 else 0
    if cap > 0 and s.adaptive_long_prefill_threshold:
        cap = max(cap, cfg.max_num_batched_tokens // eligible)
    return cap


def _plain(r: Any, step: int) -> bool:
    """Whether running request ``r`` is stepped plainly: nothing speculative, structured, multimodal,
    pooled, stale or in flight about it, and the token the sim samples cannot stop it (only its
    length can)."""
    sp = r.sampling_params
    return (r.status == _RUNNING and not r.spec_token_ids and not r.num_output_placeholders
            and not r.num_in_flight_tokens and not r.num_stale_output_tokens and not r.has_encoder_inputs
            and r.pooling_params is None and r.structured_output_request is None and sp is not None
            and sp.eos_token_id != SIM_TOKEN and SIM_TOKEN not in (sp.stop_token_ids or ())
            and sp.repetition_detection is None and getattr(r, "next_decode_eligible_step", 0) <= step + 1)


def _prefill_ready(r: Any, step: int) -> bool:
    """Whether running request ``r`` is in its prefill with at least two tokens to compute, stepped
    plainly (``_plain``)."""
    return r.num_computed_tokens < r.num_tokens - 1 and _plain(r, step)


def _decode_ready(r: Any, step: int) -> bool:
    """Whether running request ``r`` decodes exactly one plain token in the next step: its prompt is
    computed (an output token is the one left: a prompt's last token is a prefill chunk, priced and
    delivered as one) and it is stepped plainly (``_plain``)."""
    return (r.num_computed_tokens == r.num_tokens - 1 and r.num_output_tokens > 0 and _plain(r, step)
            and r.num_output_tokens >= r.sampling_params.min_tokens)


class _Call:
    __slots__ = ("cached", "first", "future", "ids", "last_step", "prompt_tokens", "request", "workflow")

    def __init__(self, future: asyncio.Future, prompt_tokens: int, workflow: str | None, last_step: bool) -> None:
        self.future = future
        self.prompt_tokens = prompt_tokens
        self.workflow = workflow
        self.last_step = last_step
        self.request: Any = None
        self.ids: list[int] = []
        self.first: float | None = None
        self.cached: int | None = None


class SimBackend:
    """The driver's Backend over the virtual-time engine (see the module docstring)."""

    name = "sim"
    #: Decode fast-forward (module docstring). Off only to show that results do not depend on it.
    fast_forward = True
    #: Runs of the fast-forward's decode-only steps applied at once (module docstring); off only to
    #: show that results do not depend on it.
    decode_runs = True

    def __init__(self, profile: Any, clock, *, policy: str = "fcfs",
                 policy_options: Mapping[str, Any] | None = None, seed: int = 0,
                 max_model_len: int | None = None, num_blocks: int | None = None,
                 kv_offloading_size: float | None = None) -> None:
        self.profile = profile
        #: KV blocks of the pool (None: the profile's); the step times are the profile's either way
        self.num_blocks = num_blocks
        #: GiB of vLLM's CPU KV offload tier (None: none); see vllm_mars.sim.offload
        self.kv_offloading_size = kv_offloading_size
        self._xfer: Any = None
        self.clock = clock
        self.policy = policy
        self.policy_options = dict(policy_options or {})
        self.seed = seed
        self.max_model_len = max_model_len or profile.max_model_len
        self.vocab_size: int | None = None
        self.scheduler = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None
        self._incoming: list[tuple[str, list[int], int, dict[str, Any], bool]] = []
        self._aborts: list[str] = []
        self._calls: dict[str, _Call] = {}
        #: workflow -> (token ids, block hashes) of its last finished call: the next turn's prompt
        #: starts with them, so vLLM's block hashes of that prefix are reused, not recomputed
        self._prefix: dict[str, tuple[Any, list]] = {}
        self._hasher: Any = None
        #: whether new requests' block hashes are sim_blockpool.KeyedHashes (set at start)
        self._keyed = False
        self._wake = asyncio.Event()
        self._stats: dict[str, Any] = {}
        self._error: BaseException | None = None
        #: the last prefix-cache lookup of the step (request, vLLM's result) and, from it, the waiting
        #: call that failed to start in the last full-path step (the fast-forward's _Blocked)
        self._looked: tuple[Any, Any] | None = None
        self._blocked: _Blocked | None = None
        self._lookup: Any = None  # vLLM's prefix-cache lookup (the scheduler's, unwrapped)
        #: engine counters: steps run, virtual seconds busy, empty steps
        self.steps = 0
        self.busy_s = 0.0
        self.idle_steps = 0
        #: of ``steps``, those the decode fast-forward ran; of those, the ones it slept through the loop
        self.ff_steps = 0
        self.ff_crossed = 0
        #: of ``ff_steps``, those run while calls waited (vLLM's waiting loop would have admitted none)
        self.ff_waiting = 0
        #: of ``ff_steps``, those with prefill chunks in the running set
        self.ff_prefill = 0
        #: of ``ff_steps``, those applied in runs at once (``_decode_run``)
        self.ff_bulk = 0
        #: after a decode-only step of the fast-forward: (vLLM's step count, the running calls) then
        self._ran: tuple[int, list] | None = None
        self.leak_error: str | None = None
        #: The profile's cost model (set at start): the policies' and the driver's rebuild prices.
        self.cost_model: Any = None
        #: --step-trace (``vllm_mars.sim.step_trace.StepTrace``, the profile): set at start
        self._trace: Any = None
        #: async scheduling (module docstring): whether a call that arrives during a step waits one more
        #: (set at start, from the profile); the calls that arrived during a step; whether the engine idles
        self._lag = False
        self._lagged: set[str] = set()
        self._idle = True

    async def start(self) -> None:
        from vllm_mars.engine.rig import PrefixReusingHasher, enable_engine_core_env_cache, make_scheduler
        from vllm_mars.sim import blockpool as sim_blockpool

        loop = asyncio.get_running_loop()
        if not is_virtual(loop):
            raise RuntimeError("the sim backend runs on a virtual-time loop (vllm_mars.sim.loop.run_virtual)")
        p = self.profile
        model_dir = p.model_dir()
        self.vocab_size = config_vocab_size(model_dir)
        # The profile prices rebuilds from the first step (the driver hands the same model to the
        # controller and pins it after its calibration calls): the policies never start on the
        # uncalibrated default. Its attention term prices long-context rebuilds, which a linear
        # solo-call fit misses.
        self.cost_model = p.cost_model()
        options = dict(self.policy_options)
        options.setdefault("cost_model", self.cost_model.as_dict())
        connector = None
        if self.kv_offloading_size is not None:
            from vllm_mars.engine.rig import rig_kv_spec
            from vllm_mars.sim.offload import HostTier, host_tier_config

            tier = HostTier.of(p, self.kv_offloading_size)
            connector = host_tier_config(tier, rig_kv_spec(p.block_size).page_size_bytes)
        self.scheduler = make_scheduler(
            self.policy, num_blocks=self.num_blocks or p.num_kv_blocks(), block_size=p.block_size, max_num_seqs=p.max_num_seqs,
            max_num_batched_tokens=p.max_num_batched_tokens, max_model_len=self.max_model_len,
            policy_options=options, clock=LoopClock(loop), model_dir=model_dir, log_stats=False,
            kv_transfer_config=connector)
        if connector is not None:
            from vllm_mars.sim.offload import transfers_of

            self._xfer = transfers_of(self.scheduler)
        if sim_blockpool.ENABLED:  # vLLM's pool with leaner per-block loops, same results (sim/blockpool.py)
            # with one KV cache group, requests carry their hash-map keys (sim_blockpool.KeyedHashes)
            self._keyed = (sim_blockpool.install(self.scheduler)
                           and len(self.scheduler.kv_cache_config.kv_cache_groups) == 1)
        # KV block removals are counted where vLLM would emit them as events, without the events
        self.scheduler.count_block_removals()
        enable_engine_core_env_cache()
        self._hasher = PrefixReusingHasher(p.block_size)
        self._loop = loop
        self._stats = self.scheduler.mars_stats()
        eff = getattr(p, "efficiency", None)  # overlapped CPU time = vLLM's async scheduling (module docstring)
        self._lag = bool(eff is not None and (eff.overlapped_step_s or eff.overlapped_per_seq_s))
        if hasattr(p, "trace_stats"):  # --step-trace: the recorded run's readings and control ticks
            self._trace = p
            p.attach(self)
        self._task = loop.create_task(self._run(), name="mars-sim-engine")

    # -- the engine coroutine -----------------------------------------------------------------------
    async def _run(self) -> None:
        from vllm_mars.engine.rig import (
            abort_request,
            batch_shape,
            fake_model_output,
            make_request,
            step_outputs,
        )

        s = self.scheduler
        loop = self._loop
        profile = self.profile
        block_size = self.profile.block_size
        advance = loop.advance_if_idle
        ff = self._fast_forward if self.fast_forward and _ff_supported(s) else None
        if ff is not None:
            lookup = self._lookup = s._get_local_prefix_cache_hit

            def recording_lookup(request: Any) -> Any:  # vLLM's lookup; its last call is kept
                got = lookup(request)
                self._looked = (request, got)
                return got

            s._get_local_prefix_cache_hit = recording_lookup
        xfer = self._xfer  # the CPU offload tier's transfers (None: no tier; vllm_mars.sim.offload)
        trace = self._trace  # --step-trace
        keyed = self._keyed
        from vllm_mars.sim.blockpool import key_hashes
        try:
            while True:
                if self._aborts or self._incoming:
                    self._blocked = None  # the waiting queue changes: a full-path step looks again
                if self._aborts:
                    for rid in self._aborts:
                        abort_request(s, rid)
                    self._aborts.clear()
                if self._incoming:
                    now = loop.time()
                    hasher = self._hasher
                    incoming, held = self._incoming, []
                    if trace is not None:  # a recorded run's arrivals (sim/step_trace.py)
                        keep = trace.held([c[0] for c in incoming], s.has_requests())
                        held = [c for c in incoming if c[0] in keep]
                        incoming = sorted((c for c in incoming if c[0] not in keep), key=lambda c: trace.order(c[0]))
                    if self._lagged:  # async: calls that arrived during the last step miss the step behind it
                        late, self._lagged = self._lagged, set()
                        if s.has_requests():
                            held += [c for c in incoming if c[0] in late]
                            incoming = [c for c in incoming if c[0] not in late]
                    for rid, ids, max_tokens, extra, ignore_eos in incoming:
                        if trace is not None:
                            trace.took(rid)
                        call = self._calls[rid]
                        known = self._prefix.get(call.workflow) if call.workflow else None
                        if known is not None:
                            hasher.hint(rid, *known)
                        call.request = make_request(rid, prompt_token_ids=ids, max_tokens=max_tokens,
                                                    extra_args=extra, block_size=block_size, arrival_time=now,
                                                    ignore_eos=ignore_eos, block_hasher=hasher, copy_prompt=False)
                        if keyed:
                            key_hashes(call.request, 0, known[1] if known is not None else None)
                        s.add_request(call.request)
                    self._incoming = held
                if not s.has_requests():
                    self._wake.clear()
                    if trace is not None and self._incoming:  # calls held for the recorded intake order
                        await trace.before_step(self._wake)
                    else:
                        self._idle = True
                        await self._wake.wait()
                        self._idle = False
                    continue
                if trace is not None and await trace.before_step(self._wake):  # what the real engine waited for
                    continue
                self._looked = None
                got = await ff() if ff is not None else False
                if got is True:
                    continue  # it ended on a step across a timer: back to the arrivals and aborts
                # the fast-forward hands back a step it began (its scheduler output) or none
                so = s.schedule() if got is False else got
                if ff is not None:
                    self._blocked = _blocked_head(s, self._looked)
                prefill, decode = batch_shape(s, so)
                if prefill or decode:
                    dt = profile.step_seconds(prefill, decode)
                    if not dt > 0:
                        raise RuntimeError(f"profile {profile.name!r}: step_seconds returned {dt!r} for a "
                                           f"non-empty batch")
                    if xfer is not None:  # a flushed store delays the step
                        dt += xfer.start_step(so.kv_connector_metadata, loop.time())
                    self.steps += 1
                    self.busy_s += dt
                    if not advance(dt):  # others run during the step: sleep through the loop
                        await asyncio.sleep(dt)
                    out = fake_model_output(s, so, SIM_TOKEN)
                    if xfer is not None:
                        out.kv_connector_output = xfer.finish_step(loop.time())
                    outs = s.update_from_output(so, out)
                else:
                    out = fake_model_output(s, so, SIM_TOKEN)
                    idle = IDLE_STEP_S
                    if xfer is not None:
                        wait = xfer.start_step(so.kv_connector_metadata, loop.time())
                        if wait > 0:
                            await asyncio.sleep(wait)
                        out.kv_connector_output = xfer.finish_step(loop.time())
                    outs = s.update_from_output(so, out)
                    self.idle_steps += 1
                    self._wake.clear()
                    if xfer is not None:  # sleep until the next transfer ends, not a whole idle step
                        idle = xfer.idle_s(loop.time(), IDLE_STEP_S)
                    self._idle = True  # an empty step: vLLM's engine core takes a new call at once
                    try:
                        await asyncio.wait_for(self._wake.wait(), idle)
                    except TimeoutError:
                        pass
                    self._idle = False
                now = self.clock()  # the run clock: the driver stamps submits with it (0 = run start)
                for o in step_outputs(outs):
                    self._deliver(o, now)
        except BaseException as e:
            if not isinstance(e, asyncio.CancelledError):
                logger.exception("sim engine failed")
                self._error = e
            for call in self._calls.values():
                if not call.future.done():
                    call.future.set_exception(RuntimeError(f"sim engine failed: {e!r}"))
            self._calls.clear()
            raise

    async def _fast_forward(self) -> Any:
        """Run the decode-only steps that are due now without vLLM's schedule/update (module
        docstring). Returns False before the first step that needs the full path (that step runs
        next), True after a step during which something else on the loop ran (a timer, a wake-up):
        that step slept through the loop as the full path does, and the caller starts over; or the
        output of a step it began whose waiting call changed (vLLM scheduled it: the full path goes on)."""
        s = self.scheduler
        running = s.running
        n = len(running)
        if (not n or self._incoming or self._aborts or len(s.kv_holding_waiting)
                or n > s.max_num_scheduled_tokens or n > s.scheduler_config.max_num_batched_tokens):
            return False
        # How many steps every running request decodes without finishing (the finishing step and
        # the one at the model-length limit run the full path).
        bs = s.block_size
        max_len = s.max_model_len
        step0 = s.current_step
        horizon = None
        prefills = False
        for r in running:
            c = r.num_computed_tokens
            if not _decode_ready(r, step0):
                if _prefill_ready(r, step0):
                    prefills = True
                    continue
                return False
            left = min(r.max_tokens - r.num_output_tokens, max_len - c - 2)
            if horizon is None or left < horizon:
                horizon = left
        if prefills:
            # steps with prefill chunks: a chunk that ends the prefill runs the full path
            return await self._prefill_steps(horizon - 1 if horizon is not None else 1 << 62)
        horizon -= 1
        if horizon <= 0:
            return False
        kvm = s.kv_cache_manager
        pool = kvm.block_pool
        waiting = s.waiting
        # Calls wait: vLLM's waiting loop runs after the decodes. It stops before the queue's head
        # when the running set or the token budget is full; else it reaches the head, which must
        # fail to start (``_WaitPlan``, checked in each step after the policy's step hooks).
        waits = bool(len(waiting)) and (n + s.num_waiting_for_streaming_input < s._max_active
                                        and n < s.max_num_scheduled_tokens
                                        and n < s.scheduler_config.max_num_batched_tokens)
        plan = None
        loop = self._loop
        profile = self.profile
        lookahead = s.num_lookahead_tokens
        begin, end = s._mars_begin_step, s._mars_end_step
        idle, advance = loop.idle_for, loop.advance_if_idle
        token = SIM_TOKEN
        # Requests whose step starts a block (needs one) or fills one (caches it), by step mod bs.
        starts: list[list] = [[] for _ in range(bs)]
        fills: list[list] = [[] for _ in range(bs)]
        for r in running:
            c = r.num_computed_tokens
            starts[-c % bs].append(r)
            fills[(bs - 1 - c) % bs].append(r)
        done = 0
        out = _StepOut()
        crossed = False
        handed = None
        # runs of steps at once (``_decode_run``) once a step here has run the policy's hooks; not
        # beside a waiting loop, nor on a recorded trace (it hands out its steps one ask at a time)
        bulk = self.decode_runs and not waits and self._trace is None
        # (the engine's last step was one of these, of the same running calls: its hooks ran)
        ran = self._ran
        ready = bulk and ran is not None and ran[0] == s.current_step and ran[1] == running
        while done < horizon:
            if ready:
                ready = False
                got, crossed = await self._decode_run(horizon - done, done, starts, fills)
                if got:
                    done += got
                    if crossed:
                        break
                    continue
            k = done % bs
            new = starts[k]
            if new and len(new) > pool.get_num_free_blocks():
                break  # an allocation could fail: vLLM preempts; the full path runs it
            decode = [r.num_computed_tokens for r in running]  # (in running order before the step hooks)
            now = s.clock.now()  # the loop's time, or a recorded run's reading (sim/step_trace.py), as schedule()
            begin(now)
            if waits:
                # the head as vLLM's loop will see it (it sorts the queue there, as here)
                head = waiting.peek_request()
                if plan is None or plan.head is not head or plan.retained != s.retention.num_blocks:
                    plan = self._wait_plan(head, n)
                if plan is None or not plan.fails(pool, len(new), fills[k], bs):
                    # it could start: this step goes on through vLLM's schedule(), on the full path,
                    # which prices it
                    handed = now
                    break
            # Priced only once the step is known to run here: each step asks its time once (a
            # recorded trace, sim/step_trace.py, hands out the next recorded step per ask).
            dt = profile.step_seconds(_NO_PREFILL, decode)
            if not dt > 0:
                raise RuntimeError(f"profile {profile.name!r}: step_seconds returned {dt!r} for a non-empty batch")
            # Something else runs before the step ends (a timer, a ready callback): the step still
            # runs here, and sleeps through the loop as the full path does; the caller starts over.
            crossed = not idle(dt)
            # schedule(): one token each, allocate_slots where a block starts or fills
            s.current_step += 1
            kvm.new_step_starts()
            events = new + fills[k]
            if events:
                if len(events) > 1:
                    index = {id(r): i for i, r in enumerate(running)}
                    events.sort(key=lambda r: index[id(r)])
                for r in events:
                    if kvm.allocate_slots(r, 1, num_lookahead_tokens=lookahead) is None:
                        raise RuntimeError(f"sim fast-forward: allocation failed for {r.request_id}")
                kvm.take_new_block_ids()
            # the waiting loop: the gate (the policy's, when it gates) and the head's chunk cap, asked
            # as vLLM asks them; its allocation then fails (``_WaitPlan.fails``) and the loop stops
            if waits and n + s.num_waiting_for_streaming_input < s.max_num_active_reqs and plan.chunk:
                s._reserve_prefill_lookahead(plan.head, plan.hit, plan.chunk)
            s.prefill_capacity_bound = len(waiting) > len(s.deferred_waiting)  # (vLLM's, after its loop)
            s.finished_req_ids = set()
            s.reset_preempted_req_ids = set()
            out.num_scheduled_tokens = scheduled = {}
            for r in running:
                r.num_computed_tokens += 1
                scheduled[r.request_id] = 1
            out.total_num_scheduled_tokens = n
            end(out, now)
            # the step runs: clock, counters; update_from_output(): one sampled token each
            self.steps += 1
            self.busy_s += dt
            if crossed:
                await asyncio.sleep(dt)
            elif not advance(dt):
                raise RuntimeError("sim fast-forward: the loop stopped being idle during a step")
            for r in running:
                r.append_output_token_ids(token)
            done += 1
            if crossed:
                break
            ready = bulk
        if done:
            if not s.use_v2_model_runner:
                s.prev_step_scheduled_req_ids.clear()
                s.prev_step_scheduled_req_ids.update(r.request_id for r in running)
            calls = self._calls
            for r in running:
                call = calls.get(r.request_id)
                if call is not None:
                    call.ids.extend([token] * done)
            self.ff_steps += done
            self.ff_crossed += crossed
            if len(waiting):
                self.ff_waiting += done
            self._ran = (s.current_step, running[:])
        if handed is not None:
            return s._mars_schedule_begun(handed)
        return crossed if done else False

    async def _decode_run(self, limit: int, done: int, starts: list, fills: list) -> tuple[int, bool]:
        """Up to ``limit`` more of ``_fast_forward``'s decode-only steps applied at once, after one
        of them ran there (its ``done``-th; ``starts``/``fills``: its requests whose step starts or
        fills a block, by step mod block size). Only while the policy's hooks are steady
        (``MarsScheduler._mars_steady_decodes``) and each step would run there alike: its start
        before any retention expires, its new blocks within the free ones; the last may be one
        during which something else on the loop is due. Each step is priced as there and the clock
        advanced by it; then, in step order and running order within a step, each request whose
        step starts or fills a block is brought to where that step finds it (computed tokens, output
        tokens) and ``allocate_slots`` runs as there; then the computed tokens and the policy's
        hooks at once (``_mars_decode_steps``) and the output tokens, the last step's after its
        sleep through the loop when something was due. Returns the steps applied (0: none) and
        whether the last slept through the loop."""
        s = self.scheduler
        if limit <= 0 or not s._mars_steady_decodes():
            return 0, False
        running = s.running
        kvm = s.kv_cache_manager
        bs = s.block_size
        loop = self._loop
        advance = loop.advance_if_idle
        price = self.profile.step_seconds
        expiry = s.retention.next_expiry() if s.retention else math.inf
        free = kvm.block_pool.get_num_free_blocks()
        base = [r.num_computed_tokens for r in running]
        busy = self.busy_s
        now = loop.time()
        last = now
        k = need = 0
        crossing = 0.0  # the last step's time when something else on the loop is due during it
        while k < limit and now < expiry:
            new = len(starts[(done + k) % bs])
            if need + new > free:
                break  # an allocation could fail: the step runs one at a time
            dt = price(_NO_PREFILL, list(map(add, base, repeat(k))))
            if not dt > 0:
                raise RuntimeError(f"profile {self.profile.name!r}: step_seconds returned {dt!r} for a non-empty batch")
            need += new
            busy += dt
            last = now
            k += 1
            if not advance(dt):
                crossing = dt  # it runs, then sleeps through the loop; the caller starts over
                break
            now = loop.time()
        if not k:
            return 0, False
        self.busy_s = busy
        self.steps += k
        lookahead = s.num_lookahead_tokens
        token = SIM_TOKEN
        index = {id(r): i for i, r in enumerate(running)}
        appended = [0] * len(running)  # output tokens each request got in this run so far
        new_step, take = kvm.new_step_starts, kvm.take_new_block_ids
        allocate = kvm.allocate_slots
        for j in range(k):
            new_step()
            b = (done + j) % bs
            events = starts[b] + fills[b]
            if not events:
                continue
            if len(events) > 1:
                events.sort(key=lambda r: index[id(r)])
            for r in events:
                i = index[id(r)]
                m = j - appended[i]
                if m:
                    r.num_computed_tokens = base[i] + j
                    r.append_output_token_ids([token] * m)
                    appended[i] = j
                if allocate(r, 1, num_lookahead_tokens=lookahead) is None:
                    raise RuntimeError(f"sim fast-forward: allocation failed for {r.request_id}")
            take()
        for i, r in enumerate(running):
            r.num_computed_tokens = base[i] + k
        s.current_step += k
        s.prefill_capacity_bound = len(s.waiting) > len(s.deferred_waiting)  # (vLLM's, after its loop)
        s.finished_req_ids = set()
        s.reset_preempted_req_ids = set()
        s._mars_decode_steps(k, last)
        if crossing:
            # the steps before it sampled their tokens; its own come after its sleep, as there
            for i, r in enumerate(running):
                m = k - 1 - appended[i]
                if m:
                    r.append_output_token_ids([token] * m if m > 1 else token)
            await asyncio.sleep(crossing)
            for r in running:
                r.append_output_token_ids(token)
        else:
            for i, r in enumerate(running):
                m = k - appended[i]
                r.append_output_token_ids([token] * m if m > 1 else token)
        self.ff_bulk += k
        return k, bool(crossing)

    async def _prefill_steps(self, horizon: int) -> Any:
        """The fast-forward's steps whose running set holds prefill chunks beside decodes (returns
        as ``_fast_forward``). After the policy's step hooks order the running set, each step is
        checked before anything is asked or allocated: no chunk may end a prefill (its upper bound,
        vLLM's chunk before the policy's cap, stays short of it), every allocation fits (vLLM's
        block counts at those upper bounds, beside the decodes' new blocks, within the free
        blocks) and vLLM's waiting loop, where it can run, starts nobody (``_WaitPlan``, against
        every block the step may take and every hash its chunks may cache). Then the step runs as
        ``schedule()`` runs it: in running order vLLM's chunk, the policy's cap
        (``_reserve_prefill_lookahead``) and ``allocate_slots`` per call until the budget is spent,
        the waiting loop's questions, the policy's end of step; then the step's time and one token
        per decode. A failed check hands the step (hooks begun) to vLLM's ``schedule()``."""
        s = self.scheduler
        running = s.running
        n = len(running)
        kvm = s.kv_cache_manager
        pool = kvm.block_pool
        req_blocks = kvm.coordinator.single_type_managers[0].req_to_blocks
        waiting = s.waiting
        loop = self._loop
        profile = self.profile
        bs = s.block_size
        max_len = s.max_model_len
        sampled = s.num_sampled_tokens_per_step
        lookahead = s.num_lookahead_tokens
        begin, end = s._mars_begin_step, s._mars_end_step
        cap_chunk = s._reserve_prefill_lookahead
        # whether the chunk may come out below vLLM's (the policy's cap, vLLM's lookahead guard)
        capped = s.mars_policy.caps_chunks or bool(getattr(s, "num_prefill_lookahead", 0))
        budget0 = _step_budget(s)
        thr = _long_prefill_cap(s)
        waits = bool(len(waiting)) and n + s.num_waiting_for_streaming_input < s._max_active
        token = SIM_TOKEN
        outs0 = [(r, r.num_output_tokens) for r in running]  # (the hooks may reorder running)
        plan = None
        done = 0
        out = _StepOut()
        crossed = ended = False
        handed = None
        scheduled: dict[str, int] = {}
        while done < horizon:
            now = s.clock.now()  # (as in _fast_forward)
            begin(now)
            # The checks, on the order the hooks gave: upper bounds of each chunk and its blocks.
            budget = budget0
            need = 0  # new blocks at most
            dnew = 0  # of which the decodes' (exact when the waiting loop runs: then all are scheduled)
            fills = []
            cached = []
            ok = True
            for r in running:
                if budget <= 0:
                    break
                c = r.num_computed_tokens
                if c == r.num_tokens - 1:  # a decode
                    if not c % bs:
                        dnew += 1
                    elif not (c + 1) % bs:
                        fills.append(r)
                    budget -= 1
                    continue
                k = r.num_tokens - c
                if 0 < thr < k:
                    k = thr
                k = min(k, budget, max_len - c - sampled)
                if k >= r.num_tokens - c and not (r.num_output_tokens + 1 < r.max_tokens
                                                  and r.num_tokens + 1 < max_len):
                    ok = False  # the chunk could end the prefill with a token that stops it
                    break
                need += -(-(c + k) // bs) - len(req_blocks[r.request_id])
                cached.append((r, c // bs, (c + k) // bs))
                if not capped:
                    budget -= k  # exact; a capped chunk may leave budget to the calls after it
            need += dnew
            if ok and need > pool.get_num_free_blocks():
                ok = False  # an allocation could fail: vLLM preempts
            left_max = budget if not capped else budget0  # (only whether the waiting loop can run)
            if ok and waits and left_max > 0:
                head = waiting.peek_request()
                if plan is None or plan.head is not head or plan.retained != s.retention.num_blocks:
                    plan = self._wait_plan(head, n)
                ok = plan is not None and plan.fails(pool, dnew, fills, bs, need, cached)
            if not ok:
                handed = now
                break
            # schedule(): the running calls in order, as vLLM schedules them
            s.current_step += 1
            kvm.new_step_starts()
            budget = budget0
            scheduled = {}
            prefill = []
            decode = []
            chunked = []  # the calls that computed a prefill chunk
            for r in running:
                if budget <= 0:
                    break
                c = r.num_computed_tokens
                if c == r.num_tokens - 1:
                    if (not c % bs or not (c + 1) % bs) and kvm.allocate_slots(
                            r, 1, num_lookahead_tokens=lookahead) is None:
                        raise RuntimeError(f"sim fast-forward: allocation failed for {r.request_id}")
                    scheduled[r.request_id] = 1
                    decode.append(c)
                    budget -= 1
                    continue
                k = r.num_tokens - c
                if 0 < thr < k:
                    k = thr
                k = cap_chunk(r, c, min(k, budget, max_len - c - sampled))
                if not k:
                    continue
                if kvm.allocate_slots(r, k, num_lookahead_tokens=lookahead) is None:
                    raise RuntimeError(f"sim fast-forward: allocation failed for {r.request_id}")
                scheduled[r.request_id] = k
                chunked.append(r)
                if k == 1 and c >= r.num_prompt_tokens:
                    decode.append(c)  # (as engine.rig.batch_shape counts it)
                else:
                    prefill.append((k, c))
                budget -= k
            kvm.take_new_block_ids()
            # the waiting loop: the gate and the head's chunk cap, asked as vLLM asks them; the
            # head's allocation then fails (checked above) and the loop stops
            if waits and budget > 0 and n + s.num_waiting_for_streaming_input < s.max_num_active_reqs:
                chunk = plan.chunk_for(budget)
                if chunk:
                    cap_chunk(plan.head, plan.hit, chunk)
            s.prefill_capacity_bound = len(waiting) > len(s.deferred_waiting)  # (vLLM's, after its loop)
            s.finished_req_ids = set()
            s.reset_preempted_req_ids = set()
            requests = s.requests
            for rid, k in scheduled.items():
                requests[rid].num_computed_tokens += k
            ended = False  # a chunk ended its prefill (it samples) or left one prompt token
            sampling = []  # of which those that sample their first token
            for r in chunked:
                c = r.num_computed_tokens
                if c >= r.num_tokens - 1:
                    ended = True
                    if c == r.num_tokens:
                        r.is_prefill_chunk = False
                        s._inflight_prefills.discard(r)
                        if r.num_output_tokens == 0:
                            sampling.append(r)
            out.num_scheduled_tokens = scheduled
            out.total_num_scheduled_tokens = budget0 - budget
            end(out, now)
            # the step runs: its time, the clock, counters; update_from_output(): a token per decode
            dt = profile.step_seconds(prefill, decode)
            if not dt > 0:
                raise RuntimeError(f"profile {profile.name!r}: step_seconds returned {dt!r} for a non-empty batch")
            crossed = not loop.idle_for(dt)
            self.steps += 1
            self.busy_s += dt
            if crossed:
                await asyncio.sleep(dt)
            elif not loop.advance_if_idle(dt):
                raise RuntimeError("sim fast-forward: the loop stopped being idle during a step")
            for rid in scheduled:
                r = requests[rid]
                if r.num_computed_tokens == r.num_tokens:
                    r.append_output_token_ids(token)
            done += 1
            if sampling:
                # the first output: vLLM's prefill stats, the delivery's stamp (as ``_deliver``)
                stamp = self.clock()
                for r in sampling:
                    stats = r.take_prefill_stats()
                    if stats is not None:
                        stats.finalize(kvm.estimate_cached_tokens(r))
                    call = self._calls.get(r.request_id)
                    if call is not None:
                        if call.first is None:
                            call.first = stamp
                        if stats is not None:
                            call.cached = stats.num_cached_tokens
            if crossed or ended:
                break  # (after a prefill ended the caller starts over: the call decodes now, or not)
        if done:
            if not s.use_v2_model_runner:
                s.prev_step_scheduled_req_ids.clear()
                s.prev_step_scheduled_req_ids.update(scheduled)
            calls = self._calls
            for r, before in outs0:
                call = calls.get(r.request_id)
                if call is not None and r.num_output_tokens > before:
                    call.ids.extend([token] * (r.num_output_tokens - before))
            self.ff_steps += done
            self.ff_prefill += done
            self.ff_crossed += crossed
            if len(waiting):
                self.ff_waiting += done
        if handed is not None:
            return s._mars_schedule_begun(handed)
        return (crossed or ended) if done else False

    def _wait_plan(self, head: Any, n: int) -> _WaitPlan | None:
        """What the waiting loop does with ``head`` beside ``n`` decodes: the last full-path step's
        lookup of it (``_Blocked``) or a new one (a lookup changes nothing), None when it cannot say."""
        s = self.scheduler
        blocked = self._blocked
        if blocked is None or blocked.request is not head:
            store = s.retention
            if store and s.scheduler_reserve_full_isl:
                # the reclaim seam would release retained KV even without a cache hit: no lookup
                tokens = min(head.num_tokens, s.max_model_len)
                if -(-tokens // s.block_size) <= s.free_blocks() + store.num_blocks:
                    return None
            blocked = self._blocked = _blocked_head(s, (head, self._lookup(head)))
        if blocked is None or head.num_stale_output_tokens:
            return None
        return _WaitPlan(s, blocked, n)

    def _deliver(self, o: Any, now: float) -> None:
        call = self._calls.get(o.request_id)
        if call is None:
            return
        if o.new_tokens:
            if call.first is None:
                call.first = now
            call.ids.extend(o.new_tokens)
        if o.cached_tokens is not None:
            call.cached = o.cached_tokens
        if o.finished:
            del self._calls[o.request_id]
            if call.workflow:
                if call.last_step:
                    self._prefix.pop(call.workflow, None)
                else:
                    self._prefix[call.workflow] = self._hasher.prefix_of(call.request)
            if not call.future.done():
                res = CallResult(call.ids, call.prompt_tokens, call.cached, call.first, now, o.finish_reason)
                if self._trace is not None:  # --step-trace: when the recorded run's driver saw it
                    self._trace.hand_over(o.request_id, call.future, res)
                else:
                    call.future.set_result(res)

    # -- Backend protocol -----------------------------------------------------------------------------
    async def generate(self, request_id: str, prompt_ids: list[int], max_tokens: int,
                       extra_args: Mapping[str, Any], ignore_eos: bool = True) -> CallResult:
        if self._error is not None:
            raise RuntimeError(f"sim engine failed: {self._error!r}")
        fut = self._loop.create_future()
        wf = extra_args.get("mars_workflow")
        self._calls[request_id] = _Call(fut, len(prompt_ids), wf if isinstance(wf, str) else None,
                                        bool(extra_args.get("mars_last_step")))
        self._incoming.append((request_id, list(prompt_ids), int(max_tokens), dict(extra_args), bool(ignore_eos)))
        if self._lag and not self._idle:
            self._lagged.add(request_id)
        self._wake.set()
        try:
            return await fut
        except asyncio.CancelledError:
            # The caller gave up (a call timeout, a cancelled workflow): abort it in the engine,
            # as vLLM's engine core does when its client goes away.
            if self._calls.pop(request_id, None) is not None:
                self._aborts.append(request_id)
                self._incoming = [c for c in self._incoming if c[0] != request_id]
                self._lagged.discard(request_id)
                self._wake.set()
            raise

    def sample(self) -> EngineSample:
        """The scheduler's state at this virtual instant (--step-trace: as the last step left it, as
        the real engine's stepper hands it over; ``StepTrace.reading``)."""
        if self._trace is not None:
            return self._trace.reading()
        return scheduler_reading(self.scheduler, self.clock())

    def recorded_arrivals(self, workflows: list[str], planned: list[float]) -> list[float]:
        """--step-trace: the arrival time of each of ``workflows`` in the recorded run (its events.jsonl),
        else the planned one (``StepTrace.arrivals``)."""
        got = self._trace.arrivals if self._trace is not None else {}
        return [got.get(w, t) for w, t in zip(workflows, planned)]

    def recorded_ticks(self) -> Any:
        """--step-trace with recorded control ticks: the trace the driver's control loop follows
        (``StepTrace.next_tick``); else None."""
        return self._trace if self._trace is not None and self._trace.has_ticks else None

    def engine_stats(self) -> dict[str, Any]:
        s = self.scheduler  # (None once closed: its last counters were kept then)
        out = dict(self._stats if s is None else s.mars_stats())
        out.update(profile=self.profile.name, steps=self.steps, busy_s=round(self.busy_s, 6),
                   idle_steps=self.idle_steps, leak_check=self.leak_error or "ok",
                   hash_blocks_reused=self._hasher.reused if self._hasher else 0)
        if self._xfer is not None:
            out["offload"] = self._xfer.stats()
        if self._trace is not None:  # --step-trace (vllm_mars.sim.step_trace)
            out["step_trace"] = self._trace.trace_stats()
        return out

    async def close(self) -> None:
        """Stop the engine, release retention, and check that nothing leaked (raises if it did)."""
        from vllm_mars.engine.rig import abort_all, assert_no_leaks

        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except BaseException as e:  # noqa: BLE001 - its failure was recorded and delivered
                logger.debug("sim engine stopped: %r", e)
            self._task = None
        s = self.scheduler
        if s is None:
            return
        abort_all(s)  # a cancelled run: abort what is still in flight, as a client disconnect would
        s.release_retention()
        try:
            if self._xfer is not None:
                from vllm_mars.sim.offload import assert_host_tier_clean, drain

                drain(s, SIM_TOKEN)  # the stores of the last finished calls, then every transfer
                assert_host_tier_clean(s)
            self._stats = s.mars_stats()
            assert_no_leaks(s)
        except AssertionError as e:
            self.leak_error = f"leak: {e}"
        self.scheduler = None
        if self.leak_error:
            raise RuntimeError(f"sim engine: {self.leak_error}")
