"""A scheduler rig: the real vLLM Scheduler / MarsScheduler with no model, driven step by step.

Used by tests, benchmarks and the simulator. Builds the scheduler from a config-only model dir
(no weights, no network), makes requests with workflow metadata in ``extra_args``, fakes the model
output of a step, and checks that nothing leaked.

    s = make_scheduler(policy="fcfs", num_blocks=64, block_size=16)
    s.add_request(make_request("a", prompt_len=100, max_tokens=8, workflow="wf1", turn=0))
    while s.has_requests():
        step(s)
    assert_no_leaks(s)
"""

from __future__ import annotations

import functools
import queue
import tempfile
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from vllm.config import CacheConfig, DeviceConfig, KVEventsConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, hash_block_tokens, init_none_hash
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine.core import EngineCore
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from vllm_mars.clock import Clock
from vllm_mars.engine.scheduler import MarsScheduler, MarsSchedulerMixin
from vllm_mars.tiny_model import write_config_only


@functools.cache
def config_only_model_dir() -> str:
    """A process-wide temp dir holding only the tiny model's config.json."""
    return str(write_config_only(Path(tempfile.mkdtemp(prefix="mars-cfg-only-"))))


#: vLLM's default prefix-caching hash (``--prefix-caching-hash-algo``); the rig and the sim use it.
DEFAULT_HASH = "sha256"


@functools.cache
def _hasher(block_size: int, hash_name: str = DEFAULT_HASH):
    fn = get_hash_fn_by_name(hash_name)
    init_none_hash(fn)
    return get_request_block_hasher(block_size, fn)


class PrefixReusingHasher:
    """vLLM's request block hasher, reusing the block hashes of a known earlier token sequence.

    An agent's turn k prompt is its turn k-1 prompt + output + tool output, and vLLM hashes the
    whole prompt of every new request again (tens of thousands of tokens per turn). Block hashes
    are chained over the prefix, so turn k-1's hashes ARE turn k's first hashes wherever the
    tokens agree (compared here) and nothing else enters the hash (no LoRA, multimodal input,
    prompt embeddings or cache salt: checked). ``hint(request_id, tokens, hashes)`` before
    creating the request.

    The blocks after the known ones are hashed by vLLM's own ``hash_block_tokens`` (its hash
    function, its chaining, its ``NONE_HASH`` for the first block) in a loop over one slice of the
    new tokens, without vLLM's per-block extra-key lookup, which for such a request gives none.
    A request with LoRA, multimodal input, prompt embeddings or a cache salt goes through vLLM's
    hasher whole. The list returned is exactly vLLM's (``tests/test_sim_engine.py``).
    """

    def __init__(self, block_size: int, hash_name: str = DEFAULT_HASH) -> None:
        self.block_size = block_size
        self._base = _hasher(block_size, hash_name)  # (sets vLLM's NONE_HASH for the function)
        self._fn = get_hash_fn_by_name(hash_name)
        self._hints: dict[str, tuple[Sequence[int], list]] = {}
        #: blocks whose hash was reused / computed by vLLM's hasher
        self.reused = 0

    def hint(self, request_id: str, tokens: Sequence[int], hashes: list) -> None:
        self._hints[request_id] = (tokens, hashes)

    @staticmethod
    def prefix_of(request: Request) -> tuple[Sequence[int], list]:
        """(token ids, block hashes) of a finished request: the hint for the call that continues it."""
        return request.all_token_ids, request.block_hashes

    @staticmethod
    def _plain(request: Request) -> bool:
        """Nothing but the tokens enters the request's block hashes (vLLM's extra keys are None)."""
        return (request.lora_request is None and not request.mm_features and not request.cache_salt
                and request.prompt_embeds is None)

    def _extend(self, request: Request, n: int, parent: Any) -> list:
        """vLLM's hashes of the request's full blocks after its first ``n`` (``parent``: the hash of
        block ``n - 1``, None for none)."""
        bs = self.block_size
        start, end = n * bs, request.num_tokens // bs * bs
        if end <= start:
            return []
        tokens = request.all_token_ids[start:end]
        fn = self._fn
        out = []
        for i in range(0, end - start, bs):
            parent = hash_block_tokens(fn, parent, tokens[i:i + bs], None)
            out.append(parent)
        return out

    def __call__(self, request: Request) -> list:
        known = request.block_hashes
        if known:
            # A token appended to a live request (every decode step): vLLM's hasher hashes full
            # blocks only, so until the next block fills it returns [] (its own early stop, taken
            # here without the call); then it continues after the known blocks.
            n = len(known)
            if (n + 1) * self.block_size > request.num_tokens:
                return []
            return self._extend(request, n, known[-1]) if self._plain(request) else self._base(request)
        hint = self._hints.pop(request.request_id, None)
        if not self._plain(request):
            return self._base(request)
        if hint is not None:
            tokens, hashes = hint
            bs = self.block_size
            n = min(len(hashes), len(tokens) // bs, request.num_tokens // bs)
            m = n * bs
            head = tokens[:m]
            if n and request.all_token_ids[:m] == (head if isinstance(head, list) else list(head)):
                self.reused += n
                return hashes[:n] + self._extend(request, n, hashes[n - 1])
        return self._extend(request, 0, None)


def enable_engine_core_env_cache() -> None:
    """Cache vLLM's environment-variable lookups, as vLLM's EngineCore does once it is up
    (otherwise every KV cache event reads ``os.environ``)."""
    from vllm.envs import enable_envs_cache

    enable_envs_cache()


def make_vllm_config(*, policy: str = "fcfs", policy_options: Mapping[str, Any] | None = None,
                     block_size: int = 16, max_num_seqs: int = 256, max_num_batched_tokens: int = 2048,
                     max_model_len: int = 8192, enable_prefix_caching: bool = True,
                     long_prefill_token_threshold: int = 0, num_spec_tokens: int = 0,
                     async_scheduling: bool = False, model_dir: str | None = None,
                     kv_events: bool = False, scheduling_policy: str = "fcfs",
                     kv_transfer_config: Any = None) -> VllmConfig:
    """A VllmConfig over a config-only model dir (``model_dir``; default: the tiny model's config.json).

    ``num_spec_tokens > 0`` adds an n-gram speculative config (no draft model); vLLM's Scheduler
    reads it as ``vllm_config.num_speculative_tokens``. ``async_scheduling`` is set after the
    platform hook (which turns it off on CPU), as vLLM would have decided it on GPU.
    ``kv_events=True`` turns on vLLM's KV cache events with the null publisher, as the in-process
    backend does (``engine_kwargs(kv_events=True)``), so MarsScheduler counts block removals.
    ``scheduling_policy``: vLLM's ``--scheduling-policy`` (``fcfs`` or ``priority``).
    ``kv_transfer_config``: vLLM's KV connector (the sim's CPU offload tier, :mod:`vllm_mars.sim.offload`)."""
    model_config = ModelConfig(model=model_dir or config_only_model_dir(), dtype="bfloat16", seed=0,
                               skip_tokenizer_init=True, max_model_len=max_model_len)
    max_num_seqs = min(max_num_seqs, max_num_batched_tokens)  # vLLM requires seqs <= batched tokens
    scheduler_config = SchedulerConfig(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len, is_encoder_decoder=False, enable_chunked_prefill=True,
        policy=scheduling_policy, async_scheduling=False, long_prefill_token_threshold=long_prefill_token_threshold)
    cache_config = CacheConfig(block_size=block_size, enable_prefix_caching=enable_prefix_caching)
    mars = {"policy": policy, **dict(policy_options or {})}
    spec = None
    if num_spec_tokens:
        from vllm.config import ParallelConfig, SpeculativeConfig

        spec = SpeculativeConfig(method="ngram", num_speculative_tokens=num_spec_tokens, prompt_lookup_max=3,
                                 prompt_lookup_min=1, target_model_config=model_config,
                                 target_parallel_config=ParallelConfig())
    kw: dict[str, Any] = {}
    if kv_events:
        kw["kv_events_config"] = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
    if kv_transfer_config is not None:
        kw["kv_transfer_config"] = kv_transfer_config
    cfg = VllmConfig(model_config=model_config, scheduler_config=scheduler_config,
                     cache_config=cache_config, device_config=DeviceConfig(device="cpu"),
                     speculative_config=spec, additional_config={"mars": mars}, **kw)
    cfg.scheduler_config.async_scheduling = async_scheduling
    return cfg


def rig_kv_spec(block_size: int) -> FullAttentionSpec:
    """The placeholder KV spec of the rig's one layer (no tensors exist; its bytes mean nothing)."""
    return FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=64, dtype=torch.bfloat16)


def make_scheduler(policy: str = "fcfs", *, num_blocks: int = 1000, block_size: int = 16,
                   max_num_seqs: int = 256, max_num_batched_tokens: int = 2048, max_model_len: int = 8192,
                   enable_prefix_caching: bool = True, long_prefill_token_threshold: int = 0,
                   policy_options: Mapping[str, Any] | None = None, clock: Clock | None = None,
                   scheduler_cls: type[Scheduler] = MarsScheduler, stock: bool = False,
                   num_spec_tokens: int = 0, async_scheduling: bool | None = None,
                   model_dir: str | None = None, kv_events: bool = False, log_stats: bool = True,
                   scheduling_policy: str = "fcfs", kv_transfer_config: Any = None) -> Scheduler:
    """Build a scheduler over ``num_blocks`` KV blocks (one is vLLM's null block).

    ``stock=True`` builds vLLM's own Scheduler with the same configuration, for side-by-side tests.
    ``async_scheduling`` is vLLM's engine decision (default: whether ``scheduler_cls`` is an
    AsyncScheduler); MarsScheduler builds the variant that matches it.
    ``model_dir``/``kv_events``/``scheduling_policy``: see :func:`make_vllm_config`. No KV tensors exist: the pool is
    bookkeeping only, so its size costs no memory beyond one small Python object per block.
    """
    if async_scheduling is None:
        async_scheduling = issubclass(scheduler_cls, AsyncScheduler)
    vllm_config = make_vllm_config(
        policy=policy, policy_options=policy_options, block_size=block_size, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
        enable_prefix_caching=enable_prefix_caching,
        long_prefill_token_threshold=long_prefill_token_threshold, num_spec_tokens=num_spec_tokens,
        async_scheduling=async_scheduling, model_dir=model_dir, kv_events=kv_events,
        scheduling_policy=scheduling_policy, kv_transfer_config=kv_transfer_config)
    kv_cache_config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                                    kv_cache_groups=[KVCacheGroupSpec(["layer"], rig_kv_spec(block_size))])
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    cls = Scheduler if stock else scheduler_cls
    s = cls(vllm_config=vllm_config, kv_cache_config=kv_cache_config,
            structured_output_manager=StructuredOutputManager(vllm_config), block_size=block_size,
            log_stats=log_stats)
    if clock is not None and isinstance(s, MarsSchedulerMixin):
        s.set_clock(clock)
    return s


def make_request(request_id: str, prompt_len: int = 100, max_tokens: int = 16, *,
                 prompt_token_ids: Sequence[int] | None = None, block_size: int = 16, priority: int = 0,
                 workflow: str | None = None, root: str | None = None, parent: str | None = None,
                 turn: int | None = None, last_step: bool | None = None, tool: str | None = None,
                 extra_args: Mapping[str, Any] | None = None, arrival_time: float | None = None,
                 seed: int | None = None, hash_name: str = DEFAULT_HASH, ignore_eos: bool = True,
                 block_hasher: Callable[[Request], list] | None = None,
                 stop_token_ids: Sequence[int] | None = None, copy_prompt: bool = True) -> Request:
    """A vLLM Request (``ignore_eos`` by default) with workflow metadata in ``extra_args``.

    Without ``prompt_token_ids`` the prompt is ``prompt_len`` ids derived from ``seed`` (default:
    the request id), so two requests share a prefix only when given the same ids.
    ``copy_prompt=False``: ``prompt_token_ids`` is a list the request may keep as its prompt (vLLM
    keeps the list it is given), one the caller no longer changes.
    """
    if prompt_token_ids is None:
        base = seed if seed is not None else sum(map(ord, request_id)) * 7919
        prompt_token_ids = [(base + j * 31) % 4000 + 3 for j in range(prompt_len)]
    xargs: dict[str, Any] = dict(extra_args or {})
    for key, value in (("mars_workflow", workflow), ("mars_root", root), ("mars_parent", parent),
                       ("mars_turn", turn), ("mars_last_step", last_step), ("mars_tool", tool)):
        if value is not None:
            xargs[key] = value
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos, extra_args=xargs or None,
                        stop_token_ids=list(stop_token_ids) if stop_token_ids else None)
    kwargs = {"arrival_time": arrival_time} if arrival_time is not None else {}
    if copy_prompt or not isinstance(prompt_token_ids, list):
        prompt_token_ids = list(prompt_token_ids)
    return Request(request_id=request_id, prompt_token_ids=prompt_token_ids, sampling_params=sp,
                   pooling_params=None, priority=priority,
                   block_hasher=block_hasher or _hasher(block_size, hash_name), **kwargs)


def fake_model_output(s: Scheduler, scheduler_output: Any, token: int = 42) -> ModelRunnerOutput:
    """One sampled token for every scheduled request whose prefill is complete this step."""
    ids = list(scheduler_output.num_scheduled_tokens)
    requests = s.requests
    return ModelRunnerOutput(
        req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
        sampled_token_ids=[[] if requests[r].is_prefill_chunk else [token] for r in ids])


def batch_shape(s: Scheduler, scheduler_output: Any) -> tuple[list[tuple[int, int]], list[int]]:
    """What the model would compute for ``scheduler_output`` (call right after ``schedule()``).

    Returns ``(prefill, decode)``: ``(chunk_tokens, context_tokens_before_chunk)`` per request
    computing prompt (or recomputed) tokens, and the context length per request decoding one
    token. vLLM has already advanced ``num_computed_tokens`` by the chunk inside ``schedule()``.
    """
    prefill: list[tuple[int, int]] = []
    decode: list[int] = []
    requests = s.requests
    for rid, n in scheduler_output.num_scheduled_tokens.items():
        r = requests[rid]
        before = r.num_computed_tokens - n
        if n == 1 and before >= r.num_prompt_tokens:
            decode.append(before)
        else:
            prefill.append((n, before))
    return prefill, decode


@dataclass(frozen=True)
class StepOutput:
    """One request's output of a step, as the engine core reports it."""

    request_id: str
    new_tokens: list[int]
    finished: bool
    finish_reason: str | None
    #: prompt tokens served from the prefix cache (on the request's first output), else None
    cached_tokens: int | None


def step_outputs(outputs: Mapping[int, Any]) -> list[StepOutput]:
    """The per-request outputs of ``update_from_output``'s return value, in vLLM's order."""
    out: list[StepOutput] = []
    for eco in outputs.values():
        for o in eco.outputs:
            stats = o.prefill_stats
            reason = o.finish_reason
            out.append(StepOutput(o.request_id, o.new_token_ids, reason is not None,
                                  None if reason is None else str(reason),
                                  None if stats is None else stats.num_cached_tokens))
    return out


def abort_request(s: Scheduler, request_id: str) -> None:
    """Abort a request as the engine core does when its client goes away."""
    if request_id in s.requests:
        s.finish_requests(request_id, RequestStatus.FINISHED_ABORTED)


def abort_all(s: Scheduler) -> None:
    """Abort every request still in the scheduler."""
    for rid in list(s.requests):
        abort_request(s, rid)


def step(s: Scheduler, token: int = 42):
    """schedule() + update_from_output() with a fake model. Returns (scheduler_output, outputs)."""
    so = s.schedule()
    return so, s.update_from_output(so, fake_model_output(s, so, token))


def run_to_completion(s: Scheduler, max_steps: int = 100_000) -> int:
    """Step until no request is left; returns the number of steps."""
    n = 0
    while s.has_requests():
        step(s)
        n += 1
        if n >= max_steps:
            raise RuntimeError(f"not finished after {max_steps} steps")
    return n


class _FakeExecutor:
    """The model executor calls EngineCore makes, answered at once with ``output_fn(s, so)``.

    The output is computed when the step is launched (``execute_model``), as a GPU would, so a
    later ``schedule()`` cannot change it; with tokens scheduled it is returned by ``sample_tokens``
    (vLLM's async path), otherwise by ``execute_model``.
    """

    def __init__(self, s: Scheduler, output_fn: Callable[[Scheduler, Any], ModelRunnerOutput]) -> None:
        self.s = s
        self.output_fn = output_fn
        self._pending: ModelRunnerOutput | None = None

    @staticmethod
    def _done(value: Any, non_block: bool) -> Any:
        if not non_block:
            return value
        f: Future = Future()
        f.set_result(value)
        return f

    def execute_model(self, scheduler_output: Any, non_block: bool = False) -> Any:
        if scheduler_output.total_num_scheduled_tokens == 0:
            return self._done(EMPTY_MODEL_RUNNER_OUTPUT, non_block)
        self._pending = self.output_fn(self.s, scheduler_output)
        return self._done(None, non_block)

    def sample_tokens(self, grammar_output: Any, non_block: bool = False) -> Any:
        out, self._pending = self._pending, None
        return self._done(out, non_block)


class RigEngineCore(EngineCore):
    """vLLM's own ``EngineCore.step`` / ``step_with_batch_queue`` over a rig scheduler, no model.

    ``EngineCore.__init__`` (executor, KV profiling) is deliberately skipped: only the members
    those two methods read are set. ``depth`` is the number of steps in flight while the next one
    is scheduled (``batch_queue_size = depth + 1``; vLLM's async scheduling runs depth 1).
    Aborts put on ``aborts_queue`` land right before the next output is processed, as in vLLM.
    """

    def __init__(self, s: Scheduler, depth: int = 1,
                 output_fn: Callable[[Scheduler, Any], ModelRunnerOutput] | None = None) -> None:
        self.scheduler = s
        self.vllm_config = s.vllm_config
        self.log_stats = False
        self.batch_queue_size = depth + 1
        self.batch_queue = deque(maxlen=self.batch_queue_size)
        self.model_executor = _FakeExecutor(s, output_fn or fake_model_output)
        self.is_mm_encoder_only = False
        self.is_pooling_model = False
        self.check_for_draft_tokens = False
        self.aborts_queue = queue.Queue()
        self._weight_version = "default"

    def in_flight_tokens(self) -> dict[str, int]:
        """Tokens per request of the steps launched and not yet processed."""
        out: dict[str, int] = {}
        for _future, so, _exec in self.batch_queue:
            for rid, n in so.num_scheduled_tokens.items():
                out[rid] = out.get(rid, 0) + n
        return out

    def run_step(self) -> list[Any]:
        """One engine-loop iteration (``step_with_batch_queue``); the EngineCoreOutput items."""
        outputs, _ = self.step_with_batch_queue()
        return [o for eco in (outputs or {}).values() for o in eco.outputs]

    def busy(self) -> bool:
        return self.scheduler.has_requests() or bool(self.batch_queue)


def kv_block_accounting(s: Scheduler) -> dict[str, int]:
    """Block counts by state; free + referenced == the pool minus the null block, always."""
    pool = s.kv_cache_manager.block_pool
    referenced = sum(1 for b in pool.blocks if not b.is_null and b.ref_cnt > 0)
    negative = sum(1 for b in pool.blocks if b.ref_cnt < 0)
    retained = s.retention.num_blocks if isinstance(s, MarsSchedulerMixin) else 0
    return {"total": pool.num_gpu_blocks - 1, "free": pool.get_num_free_blocks(),
            "referenced": referenced, "negative_refs": negative, "retained": retained}


def assert_block_invariants(s: Scheduler) -> None:
    """Per-step invariant: every block is either free or referenced, and no ref count is negative."""
    acc = kv_block_accounting(s)
    assert acc["negative_refs"] == 0, acc
    assert acc["free"] + acc["referenced"] == acc["total"], acc


def assert_no_leaks(s: Scheduler) -> None:
    """No request left, every KV block free, no retention left behind."""
    assert not s.requests, f"requests left: {sorted(s.requests)[:10]}"
    assert not s.running, f"running left: {[r.request_id for r in s.running][:10]}"
    assert len(s.waiting) == 0 and len(s.kv_holding_waiting) == 0, "waiting requests left"
    if isinstance(s, MarsSchedulerMixin):
        assert len(s.retention) == 0 and s.retention.num_blocks == 0, (
            f"retention left: {[e.workflow for e in s.retention.entries()]}")
        assert not s._calls, f"call views left: {sorted(s._calls)[:10]}"
        assert not s._returning, f"returning marks left: {s._returning}"
    for mgr in s.kv_cache_manager.coordinator.single_type_managers:
        assert not mgr.req_to_blocks, f"blocks still owned by {sorted(mgr.req_to_blocks)[:10]}"
    acc = kv_block_accounting(s)
    assert acc["referenced"] == 0 and acc["free"] == acc["total"], f"KV blocks leaked: {acc}"


def prompt_block_hashes(tokens: Sequence[int], block_size: int, hash_name: str = DEFAULT_HASH) -> list:
    """vLLM's block hashes of the full blocks of a prompt of ``tokens`` (as a request gets them)."""
    return list(make_request("mars-prefix-probe", prompt_token_ids=tokens, max_tokens=1, block_size=block_size,
                             hash_name=hash_name).block_hashes)


def cached_prefix_blocks(s: Scheduler, hashes: Sequence[Any]) -> int:
    """How many leading blocks of ``hashes`` scheduler ``s``'s prefix cache holds now (a read: no
    stats, no allocation, nothing touched)."""
    pool = s.kv_cache_manager.block_pool
    n = 0
    for h in hashes:
        if pool.get_cached_block(h, [0]) is None:
            break
        n += 1
    return n
