"""The Policy protocol, the call view the engine hands to policies, and the policy registry.

A policy is pure decision logic: it imports neither vllm nor torch. ``engine/scheduler.py`` adapts
vLLM's requests to :class:`CallView` objects and applies the policy's answers at vLLM's seams:

====================  ==========================================================================
seam                  what the policy answers
====================  ==========================================================================
order                 ``waiting_key`` / ``running_key``: lower is served first (when ``orders``)
victim                ``victim_key``: the largest key is preempted first (default: running order;
                      under vLLM's priority policy the request's own priority ranks first)
admission gate        ``may_start``: whether the head of the waiting queue may start now
chunk cap             ``chunk_tokens``: how many prefill tokens a request may take this step
retention             ``retention_s``: keep a finished call's KV for this many seconds (0 = free)
bookkeeping           ``on_arrival`` / ``on_scheduled`` / ``on_preempted`` / ``on_finished``
====================  ==========================================================================

Class flags tell the scheduler which seams a policy uses, so a policy that uses none (``fcfs``)
costs nothing per step. All time comes from the injected clock (``self.clock.now()``).
"""

from __future__ import annotations

import dataclasses
import logging
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Protocol

from vllm_mars.clock import Clock, MonotonicClock
from vllm_mars.costmodel import CostModel, uncalibrated
from vllm_mars.options import check_options
from vllm_mars.registry import Registry
from vllm_mars.workflow import WorkflowInfo

logger = logging.getLogger(__name__)


class RequestLike(Protocol):
    """The members of vLLM's ``Request`` a CallView reads (duck-typed: no vllm import here)."""

    request_id: str
    priority: int
    num_prompt_tokens: int
    num_computed_tokens: int
    num_preemptions: int
    max_tokens: int
    status: Any

    @property
    def num_tokens(self) -> int: ...

    @property
    def num_output_tokens(self) -> int: ...


class CallView:
    """One LLM call as a policy sees it: stable facts plus live counters read from the request.

    ``state`` is the policy's own per-call scratch (any object); the engine never reads it.
    """

    __slots__ = (
        "_req",
        "arrival",
        "cached_tokens",
        "last_scheduled",
        "next_tool",
        "request_id",
        "seq",
        "state",
        "user_priority",
        "workflow",
    )

    #: Set by the engine to vLLM's ``RequestStatus.RUNNING`` (keeps this module free of vllm).
    RUNNING_STATUS: ClassVar[Any] = None

    def __init__(self, req: RequestLike, workflow: WorkflowInfo, arrival: float, seq: int) -> None:
        self._req = req
        self.request_id: str = req.request_id
        self.workflow = workflow
        self.arrival = arrival
        self.seq = seq
        #: The request's own vLLM priority (kept by the scheduler, which writes victim ranks into
        #: ``Request.priority``): under vLLM's priority policy it ranks victims before ``victim_key``.
        self.user_priority: int = req.priority
        self.state: Any = None
        #: Clock time the call was last given tokens (its arrival until then).
        self.last_scheduled = arrival
        #: Prompt tokens served from the prefix cache when first scheduled (-1 before that).
        self.cached_tokens = -1
        #: The tool this call's output calls, when known: the client's ``mars_next_tool``, replaced
        #: by the engine's tool-call parser (when configured) once the call has finished.
        self.next_tool: str | None = workflow.next_tool

    @property
    def num_prompt_tokens(self) -> int:
        return self._req.num_prompt_tokens

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens so far."""
        return self._req.num_tokens

    @property
    def num_computed_tokens(self) -> int:
        return self._req.num_computed_tokens

    @property
    def num_output_tokens(self) -> int:
        return self._req.num_output_tokens

    @property
    def max_tokens(self) -> int:
        return self._req.max_tokens

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens served from the prefix cache at first scheduling (-1 before that)."""
        return self.cached_tokens

    @property
    def num_preemptions(self) -> int:
        return self._req.num_preemptions

    @property
    def remaining_prefill(self) -> int:
        """Tokens still to compute before this call can sample (0 for a decoding call)."""
        return max(self._req.num_tokens - self._req.num_computed_tokens - 1, 0)

    @property
    def is_running(self) -> bool:
        """True while the call is in the engine's running list."""
        return self._req.status == CallView.RUNNING_STATUS

    @property
    def is_decoding(self) -> bool:
        return self.is_running and self._req.num_computed_tokens >= self._req.num_tokens - 1

    def __repr__(self) -> str:
        return (f"CallView({self.request_id!r}, wf={self.workflow.workflow!r}, turn={self.workflow.turn}, "
                f"computed={self.num_computed_tokens}/{self.num_tokens})")


class EngineView(Protocol):
    """What a policy may read about the engine (implemented by the scheduler)."""

    @property
    def block_size(self) -> int: ...

    @property
    def num_blocks(self) -> int:
        """Usable KV blocks (the pool minus vLLM's null block)."""
        ...

    def free_blocks(self) -> int:
        """Blocks allocatable now (free plus evictable cached; retained blocks are not free)."""
        ...

    def running_calls(self) -> list[CallView]: ...

    def waiting_calls(self) -> list[CallView]: ...

    @property
    def token_budget(self) -> int:
        """max_num_batched_tokens: the step's token budget."""
        ...


class FirstArrivals:
    """Key (workflow, program) -> the seq of its first call, for orders by first arrival; bounded:
    past ``limit`` keys the least recently seen is forgotten."""

    __slots__ = ("_seq", "limit")

    def __init__(self, limit: int) -> None:
        self._seq: OrderedDict[str, int] = OrderedDict()
        self.limit = limit

    def first(self, key: str, seq: int) -> int:
        """The seq of ``key``'s first call, ``seq`` when this is it."""
        d = self._seq
        first = d.get(key)
        if first is None:
            d[key] = seq
            if len(d) > self.limit:
                d.popitem(last=False)
            return seq
        d.move_to_end(key)
        return first

    def forget(self, key: str) -> None:
        self._seq.pop(key, None)


@dataclasses.dataclass(frozen=True)
class NoConfig:
    """A policy without parameters."""


class Policy:
    """Base class of every scheduling policy: defaults reproduce vLLM's own behaviour."""

    name: ClassVar[str] = ""
    #: Frozen dataclass of the policy's parameters; fields are the accepted config keys.
    Config: ClassVar[type] = NoConfig
    #: Seams in use. The scheduler skips the work of every seam whose flag is False.
    orders: ClassVar[bool] = False
    gates: ClassVar[bool] = False
    caps_chunks: ClassVar[bool] = False
    #: True when the policy's decisions need vLLM's KV offloading connector (the engine refuses
    #: to start without one, rather than silently dropping what the policy meant to swap).
    needs_kv_connector: ClassVar[bool] = False
    retains: ClassVar[bool] = False
    tracks_service: ClassVar[bool] = False
    #: True when victim order is not simply the reverse of running order.
    custom_victims: ClassVar[bool] = False
    #: True when decisions price (re)computation with ``self.cost``: the scheduler then hands the
    #: policy a calibrated model (``additional_config["mars"]["cost_model"]``) or fits one online
    #: from the engine's step times, and says so while the policy runs on the uncalibrated default.
    uses_cost: ClassVar[bool] = False

    def __init__(self, config: Any = None, clock: Clock | None = None) -> None:
        self.config = config if config is not None else self.Config()
        self.clock: Clock = clock or MonotonicClock()
        self.engine: EngineView | None = None
        #: The engine's cost model (:mod:`vllm_mars.costmodel`); the default until one is set.
        self.cost: CostModel = uncalibrated()
        #: True once a model was set from outside (calibration, profile): online fits stop.
        self.cost_pinned = False

    def set_cost_model(self, model: CostModel, pinned: bool = True) -> None:
        """Price work with ``model`` from now on. ``pinned``: a calibrated model from outside (the
        driver's solo-call calibration, a profile); the scheduler's online fit no longer replaces it."""
        if pinned or not self.cost_pinned:
            if model.source != self.cost.source:
                logger.info("policy %s: cost model from %s", self.name, model.source)
            self.cost = model
            self.cost_pinned = self.cost_pinned or pinned

    def bind(self, engine: EngineView) -> None:
        """Called once by the scheduler before the first request."""
        self.engine = engine

    def check_platform(self, platform: str) -> None:
        """Raise ValueError when the policy cannot run on ``platform`` ("cpu", "cuda", ...)."""

    def state(self) -> dict[str, Any]:
        """The policy's own adaptive state for ``mars_stats()["policy_state"]`` (JSON-able; none here)."""
        return {}

    # bookkeeping -----------------------------------------------------------------------------
    def begin_step(self) -> None:
        """At the start of each ``schedule()`` (when ``orders`` or ``caps_chunks``)."""

    def on_arrival(self, call: CallView) -> None:
        pass

    def on_scheduled(self, call: CallView, num_tokens: int) -> None:
        """After each step's schedule, for every call given tokens (when ``tracks_service``)."""

    def on_preempted(self, call: CallView) -> None:
        pass

    def on_finished(self, call: CallView, aborted: bool) -> None:
        pass

    # runs of decode-only steps (the simulator applies them at once: vllm_mars.sim.engine) -------
    def steady_decodes(self, calls: Sequence[CallView]) -> bool:
        """Whether more decode-only steps of exactly these running calls, in this order (the last
        step's ordering pass, with each call scheduled one token in that step), change nothing but
        what :meth:`on_decode_steps` does: every further step's ``begin_step``, ``running_key`` (the
        order stays) and ``on_scheduled(call, 1)`` (when ``tracks_service``) together equal one
        :meth:`on_decode_steps` per call. The default holds for a policy that keeps none of these
        hooks; a policy that keeps one says so itself."""
        cls = type(self)
        return (cls.begin_step is Policy.begin_step
                and (not self.orders or cls.running_key is Policy.running_key)
                and (not self.tracks_service or cls.on_scheduled is Policy.on_scheduled))

    def on_decode_steps(self, call: CallView, steps: int) -> None:
        """``steps`` decode-only steps' ``on_scheduled(call, 1)`` at once, for a call that
        :meth:`steady_decodes` accepted (when ``tracks_service``; its request already counts the
        steps' tokens as computed)."""

    # decisions -------------------------------------------------------------------------------
    def waiting_key(self, call: CallView) -> Any:
        """Order of the waiting queue, lower first (used when ``orders``)."""
        return (call.seq,)

    def running_key(self, call: CallView) -> Any:
        """Service order of running calls, lower first (used when ``orders``)."""
        return (call.seq,)

    def victim_key(self, call: CallView) -> Any:
        """Preemption order, the largest first (used when ``custom_victims``)."""
        return self.running_key(call)

    def may_start(self, call: CallView) -> bool:
        """Whether the head waiting call may start now (used when ``gates``)."""
        return True

    def chunk_tokens(self, call: CallView, num_computed: int, num_new: int) -> int:
        """Tokens this call may compute this step, 0..num_new (used when ``caps_chunks``)."""
        return num_new

    def retention_s(self, call: CallView, num_blocks: int) -> float:
        """Seconds to keep a finished call's ``num_blocks`` cached blocks referenced (``retains``).

        Called when a call finishes normally and is not its workflow's last step. 0 frees now.
        """
        return 0.0

    def retention_value(self, call: CallView, num_blocks: int) -> float:
        """Expected value of a retention; under pressure the lowest value is released first."""
        return 0.0


# registry ------------------------------------------------------------------------------------
_REGISTRY: Registry = Registry("policy")
#: Class decorator: register a policy class under its ``name``.
register_policy = _REGISTRY.register


def available_policies() -> list[str]:
    """Registered policy names, sorted."""
    return sorted(_REGISTRY)


def get_policy_class(name: str) -> type[Policy]:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"unknown policy {name!r}; available policies: {', '.join(available_policies())}"
        ) from None


def config_fields(cls: type[Policy]) -> list[str]:
    return [f.name for f in dataclasses.fields(cls.Config)]


def make_policy(name: str, options: Mapping[str, Any] | None = None, clock: Clock | None = None) -> Policy:
    """Build a policy from its name and its config options (unknown keys are a ValueError)."""
    cls = get_policy_class(name)
    try:
        config = check_options(cls.Config, options, owner="config", context=f" for policy {name!r}")
    except ValueError as e:
        msg = str(e)
        raise ValueError(msg if msg.startswith("unknown") else f"invalid config for policy {name!r}: {msg}") from None
    return cls(config, clock)
