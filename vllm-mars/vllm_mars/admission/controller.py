"""MARS admission: let root workflows into the active set only as fast as live KV (and CPU tool)
capacity allows (SPEC section 4). Pure Python: no vllm import; time and telemetry are injected.

Rules, each a documented field of :class:`MarsAdmissionConfig`:

* **Guard margin.** ``budget = free_blocks - ceil(total * (1 - kv_target))`` minus the blocks
  promised to roots admitted since the last telemetry that could show them (fix of the preview,
  which ignored promised blocks). Zero free blocks is a zero budget, not "unknown".
* **AIMD window** ``W`` on active roots, updated at most once per ``interval_s``: x``dec_factor``
  when KV usage >= ``kv_high`` or the CPU tool plane is overloaded (in-flight per worker >=
  ``cpu_backlog_high`` or tool queue wait >= ``cpu_wait_high_s``) or telemetry is stale; +``inc``
  when usage <= ``kv_low``, the CPU plane is healthy and the budget is positive. Hysteresis as in
  the preview: overload is set at the high mark and cleared at the low one. The effective limit is
  ``min(W, cpu_cap, kv_cap)``, each >= ``window_min``.
* **Footprint** of a waiting root: ``ceil((prefill_tokens + turn_growth) / block_size)``: the KV its
  first call needs plus one turn of growth, checked against the budget (what is free now).
  ``turn_growth`` is an EMA of tokens added per turn, learned from each active root's next turn
  (``update_estimate``) and, for roots that never showed one, ``(final tokens - first prompt) /
  turns`` at their finish.
* **Whole-life sizing** (``size = "life"``): every active root's context is projected over its
  remaining turns (``turn_growth`` per turn, freed after its last); a root goes in only while the
  projection's peak with its whole life added stays within ``life_target`` of the pool; else its
  overflow is priced by the cost rule below. (With the footprint rules alone, reserving whole
  lives serialised small-KV runs: 26 s vs 10 s mean E2E on the compact demo, 48 blocks.)
* **Selection.** Light load (no pressure, everything queued fits the slots and the budget):
  arrival order. CPU overloaded: largest footprint first (fewer, heavier workflows). Otherwise
  smallest footprint first; a root that does not fit the remaining budget is skipped, never
  blocks the ones behind it.
* **KV-budgeted draining.** When only long roots (> ``long_prefill_tokens``) wait: arrival order
  within the live budget, at most one per tick while earlier admitted roots are active; if none
  fits and nothing is active, the oldest is admitted alone (no starvation).
* **Telemetry.** Missing (never seen, or no block counts): a fixed window of
  ``no_telemetry_window`` roots in arrival order, never blind. Stale (older than ``stale_s``):
  pressure (the window shrinks, the KV cap drops to ``window_min``) and the last budget minus
  promises is still enforced.

* **Cost-aware admission** (``admit = "cost"``, the default, with a cost model): in arrival order
  (``order = "life"``: the smallest projected life first),
  a root is admitted when its footprint fits the budget, or when the expected rebuild cost its
  overflow would cause, ``sum over its coming turns of rebuild_s(overflow tokens at that turn) *
  (1 + running calls)`` (contexts evicted during tool gaps are rebuilt at the next turn, and a
  rebuild stalls the running batch; ``overflow = "peak"`` charges the peak's gain at every turn), is
  below the expected cost of its queueing (the learned mean active time of a root over the number
  active: the wait for the next slot; ``queue_wait = "fit"``: the cheapest of waiting for the k
  soonest-ending roots plus the rebuilds still left then; ``"fit_within"``: that only while the
  active roots' own projection fits the pool; ``"pool"``: that only while the pool holds
  fewer than ``window_min`` of the contexts the roots will have (each grown by its remaining turns,
  the projection's horizon), so that no active set the controller keeps saves them across tool gaps,
  and fewer than half a call waits in the engine on average, so that holding does not relieve the
  batch either; ``"unkept"``, the default: that wherever the pool holds fewer than ``window_min`` of
  those contexts, whatever waits in the engine; else the wait for the next slot; ``slot_wait`` says how a slot's wait is estimated:
  the mean active time over the roots active, or when the active roots' own remaining turns end).
  The AIMD window starts at ``window_max`` and shrinks on
  *measured* thrashing: the share of engine time spent recomputing (preempted and evicted tokens,
  priced by the cost model) at ``rebuild_share_high`` shrinks it from the active count, while the
  pool keeps ``window_min`` of the roots' grown contexts (``rebuild_net``; where it keeps fewer, a
  smaller window does not save contexts). Work-conserving when rebuilds are cheap.
  Without a cost model the controller says so in an ``admission_cost_model`` event and applies
  the footprint rules (``admit = "footprint"``).
* **Charging** (``charge``): ``all`` roots count against the budget (ours), or only ``long`` ones
  (the preview: short roots go in arrival order while KV is not overloaded).

The controller ticks on its feeder's clock: ``tick`` is called every ``interval_s`` and after each
offer/finish, so a slot freed between arrivals is refilled at once (the preview only refilled on
arrivals). Each decision is an :class:`AdmissionEvent` carrying its inputs.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from vllm_mars.admission.base import (
    AdmissionEvent,
    ControllerBase,
    PendingRoot,
    Telemetry,
    WindowConfig,
    register_controller,
)
from vllm_mars.costmodel import CostModel

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class MarsAdmissionConfig(WindowConfig):
    """Knobs of the MARS admission controller (defaults from SPEC section 4 / the preview).
    ``window_max`` (the preview's active pool size P), ``window_init`` (None: ``window_min``, a
    slow start that grows +inc per interval), ``interval_s``, ``stale_s`` and
    ``no_telemetry_window`` come from :class:`WindowConfig`."""

    #: Lower bound of the window; pressure never pushes the limit below this.
    window_min: int = 4
    #: Upper bound of the window (the preview's active pool size P was 30). With the cost rule and
    #: "life" sizing, KV gates admission and the window is only the safety net: at 30 it queued
    #: roots with the pool a tenth free (paper grid ILR-2 at 0.4 rps: 286.9 s vs 285.8 s at 256).
    window_max: int = 256
    #: Multiplicative decrease factor under pressure.
    dec_factor: float = 0.7
    #: Additive increase per control interval when healthy.
    inc: int = 1
    #: Target KV usage: the guard margin keeps ``1 - kv_target`` of all blocks free; also the high watermark.
    kv_target: float = 0.9
    #: KV usage at or below which the window may grow (and the KV pressure state clears);
    #: None: ``kv_target - 0.05``.
    kv_low: float | None = None
    #: Tool calls in flight per tool worker at which the CPU plane counts as overloaded.
    cpu_backlog_high: float = 2.0
    #: In-flight per worker at or below which the CPU plane is healthy.
    cpu_backlog_low: float = 1.0
    #: Tool queue wait EMA (s) at which the CPU plane counts as overloaded.
    cpu_wait_high_s: float = 5.0
    #: Tool queue wait EMA (s) at or below which the CPU plane is healthy.
    cpu_wait_low_s: float = 2.0
    #: Prefill estimate above which a root is "long" (draining rules); <= 0 disables the split.
    long_prefill_tokens: int = 50_000
    #: Prompt tokens assumed for a root that arrives without any estimate.
    unknown_prefill_tokens: int = 2048
    #: Block size assumed until telemetry reports one.
    default_block_size: int = 16
    #: EMA weight of one finished workflow's per-turn growth ((final - first prompt) / turns).
    growth_alpha: float = 0.2
    #: Upper bound on the learned per-turn growth (tokens) added to footprints.
    turn_growth_max_tokens: int = 32_768
    #: Seconds after admission until telemetry is trusted to include a root's first prefill; until
    #: then its footprint counts as promised and is subtracted from the budget.
    promise_s: float = 1.0
    #: Admission rule: "cost" (fits, or its rebuild cost is below its queueing cost; needs a cost
    #: model) or "footprint" (fits the budget only).
    admit: str = "cost"
    #: Roots charged against the KV budget: "all" or "long" (only above ``long_prefill_tokens``).
    charge: str = "all"
    #: Share of engine time spent recomputing (measured) at which the window shrinks ("cost" rule).
    rebuild_share_high: float = 0.25
    #: ... and at or below which it may grow again.
    rebuild_share_low: float = 0.1
    #: LLM calls assumed per root that reports none (until learned from finished roots).
    default_turns: int = 4
    #: A cost model file (``CostModel`` JSON or a step-time profile) for the "cost" rule; the driver
    #: hands its calibrated model instead (``set_cost_model``).
    cost_model: str | None = None
    #: Root sizing: "life" (the active roots' projected contexts over their remaining turns, plus
    #: the candidate's whole life, must stay within ``life_target`` of the pool at every future turn)
    #: or "turn" (the prefix plus one turn of growth against the free blocks only).
    size: str = "life"
    #: "life" sizing: the share of the pool the projected peak may reach. Above ``kv_target``: the
    #: guard margin is for the blocks allocated now, and a projected peak is reached (if at all)
    #: only at the end of the roots' lives, when a retained context can still make room.
    life_target: float = 1.0
    #: Cost rule: a root's queueing cost is at least the time it has already waited (ski rental:
    #: it waits at most about what its admission is expected to cost in rebuilds). Off by default:
    #: on the paper grid it gains 1.03x at ILR-3 @ 0.08 and loses 1.72x at ILR-4 @ 0.08 (4x the
    #: thrash onset), where the queue is structural and admitting moves the wait onto the others as
    #: rebuilds (experiments/admission_tuning.toml).
    ski_rental: bool = False
    #: Cost rule, "life" sizing: how a candidate's projected overflow is priced. "turns": at each
    #: coming turn, what the candidate adds to the projection's excess over the pool then (an
    #: overflow reached only as the lives end is charged for the turns it lasts); "peak": the
    #: peak's gain, rebuilt at every one of its turns (the worst case). "turns" is the default:
    #: on the paper grid it is faster in 13 of 17 cells with pressure (up to 1.07x, 1.10x over the
    #: fastest baseline at ILR-3 @ 0.08 instead of 1.04x) and slower in the deepest overload on one
    #: seed (0.86x at ILR-4 @ 0.04 seed 1, still 2.3x the baselines) (paper_grid_ablations.toml,
    #: paper_grid_seeds.toml, variant mars-overflow-peak).
    overflow: str = "turns"
    #: Cost rule, "life" sizing: the queueing cost a held root is weighed against. "slot": the wait
    #: for the next slot (a root's mean active time over the roots active), as if that slot made it
    #: fit. "fit": the cheapest of waiting for the k soonest-ending roots (k slots) and then paying
    #: the rebuilds still left, ``min_k (k * slot wait + rebuild cost then)``: a root whose overflow a
    #: slot would not remove is not held for it. "fit_within": "fit" only while the active roots' own
    #: projection fits the pool, else "slot". "pool" (the default until the fifteenth stop): "fit" only where holding can
    #: neither keep contexts nor relieve the engine: the pool holds fewer than ``window_min`` of the
    #: contexts the roots will have (the active roots' and the candidate's mean, each grown by its
    #: remaining turns) and the EMA of calls waiting in the engine is below 0.5; else "slot". Against
    #: "slot" it is equal in all 21 H200 grid cells with pressure; of the 12 H100 cells faster in 3
    #: (ILR-1 @ 0.036 seed 0: 167.18 vs 167.60 s) and 0.5 % slower in 1 (ILR-2 @ 0.036 seed 0: 98.76
    #: vs 98.28 s); on the embedded default in virtual time faster at step speeds 0.35-1.0x and
    #: equal at 1.5x (benchmark/perf/cpu_default_speed_sim.py). With current contexts instead of
    #: grown ones it held roots longer at the H100 ILR-1 top cell (measured while the grid's cycled
    #: roots still shared their token ids; experiments/queue_wait_h100.toml).
    #: "fit" loses up to 1.87x in ILR-4's deep overload, where the roots it lets in cost more than
    #: their priced rebuilds (experiments/queue_wait.toml, queue_wait_h100.toml). "unkept" (the default): "fit"
    #: wherever the pool cannot keep the grown contexts, without "pool"'s idle-engine condition.
    #: With the priced prefill reserve: identical on the H200 pressure cells, 0.9999x on the 40 H100
    #: top cells, and the first setting at fcfs or above on the real CPU engine's embedded default
    #: in its fast regime (1.005x; 0.979x with "pool"), 1.24x in its slow one
    #: (experiments/queue_wait_unkept*.toml, benchmark/perf/RESULTS.md, fifteenth stop).
    queue_wait: str = "unkept"
    #: "life" sizing: what an active root's context counts for in the projection. "unique" (the
    #: default): its context less the prefix its first call found in the engine's prefix cache (KV
    #: it shares with other workflows, already counted with theirs; the feeder reports it,
    #: ``observe_cached``); "full": the whole context, as if no two workflows shared a block. On the
    #: weka traces at 0.1 sessions/s, whose repeats share their whole first prompt, "full" held the
    #: big sessions 360-570 s with nothing thrashing (0.887x-0.935x fcfs); "unique" is at fcfs
    #: (0.995x-1.006x), within 1 % of "full" in 20 of the 21 H200 pressure cells, 5 % slower in one
    #: (ILR-4 @ 0.08 seed 2), equal on the H100 grid but 3 of 46 cells (experiments/admission_shared.toml).
    shared: str = "unique"
    #: Cost rule: how the wait for a slot is estimated. "mean" (the default): a root's mean active
    #: time (admission to finish, an EMA over finished roots; before any finished, the longest
    #: active so far) over the roots active, as if their ends were spread evenly. "ends": when the
    #: active roots' own ends come: each root's remaining turns (its reported ``turns`` less those
    #: seen, as in the projection; the current one half done) times the learned time between a
    #: root's turns, the next slot at the soonest end and the k-th slot ("fit") at the k-th soonest;
    #: "mean" until a turn time is learned. "fit_ends": "ends" only where ``queue_wait`` reads the
    #: wait from the projection ("fit"; with "pool", where holding can neither keep contexts nor
    #: relieve the engine), "mean" elsewhere. The closer estimate admits more and loses where the
    #: pool thrashes: "ends" up to 1.81x slower on the H200 grid's ILR-4; "fit_ends" is "mean" there
    #: and within noise of it on the H100 grid and the embedded default in virtual time
    #: (experiments/slot_wait.toml, slot_wait_h100.toml, docs/admission.md).
    slot_wait: str = "mean"
    #: Cost rule: where the measured rebuild share shrinks the window (``rebuild_share_high``).
    #: "keepable" (the default): only while the pool keeps ``window_min`` of the contexts the roots
    #: will have (the "pool" keep test): where it keeps fewer, every context is evicted in its tool
    #: gaps however few roots are active, and a smaller window only queues roots. "always": wherever
    #: the share is high. On the real CPU engine's embedded default "always" fired on rebuilds the
    #: 48-block pool cannot avoid and held roots 2.1 s on average: 0.802x fcfs against 0.978x in the
    #: fast regime (``cpu_default_rounds.py --stretch 4.4``); identical in virtual time on the H200
    #: grid (the pool keeps contexts) and the CPU rig (the share never reaches 0.25 there); on the
    #: H100 grid "keepable" is the net off (experiments/aimd_net.toml, aimd_net_h100.toml).
    rebuild_net: str = "keepable"
    #: Cost rule: the order the queued roots are considered in (each admitted only as the rule
    #: allows; one that does not qualify is skipped). "arrival" (the default): first come, first
    #: served. "life": the smallest projected life first, its context times its predicted LLM calls
    #: (the KV-seconds it will hold; shortest job first for the mean wait), arrival breaking ties;
    #: a root that came back after a soft end first, as in the other orders.
    order: str = "arrival"

    def __post_init__(self) -> None:
        super().__post_init__()
        bad = self._bad
        if not 0.1 <= self.dec_factor <= 0.99:
            raise bad("dec_factor", "in [0.1, 0.99]")
        if self.inc < 0:
            raise bad("inc", ">= 0")
        if not 0.1 <= self.kv_target <= 0.999:
            raise bad("kv_target", "in [0.1, 0.999]")
        if self.kv_low is None:
            object.__setattr__(self, "kv_low", max(0.0, round(self.kv_target - 0.05, 6)))
        if not 0 <= self.kv_low < self.kv_target:
            raise bad("kv_low", f"in [0, kv_target={self.kv_target})")
        if not 0 < self.cpu_backlog_low <= self.cpu_backlog_high:
            raise bad("cpu_backlog_low", f"in (0, cpu_backlog_high={self.cpu_backlog_high}]")
        if not 0 <= self.cpu_wait_low_s <= self.cpu_wait_high_s:
            raise bad("cpu_wait_low_s", f"in [0, cpu_wait_high_s={self.cpu_wait_high_s}]")
        if self.unknown_prefill_tokens < 0:
            raise bad("unknown_prefill_tokens", ">= 0")
        if self.default_block_size < 1:
            raise bad("default_block_size", ">= 1")
        if not 0 < self.growth_alpha <= 1:
            raise bad("growth_alpha", "in (0, 1]")
        if self.turn_growth_max_tokens < 0:
            raise bad("turn_growth_max_tokens", ">= 0")
        if self.promise_s < 0:
            raise bad("promise_s", ">= 0")
        if self.admit not in ("cost", "footprint"):
            raise bad("admit", "'cost' or 'footprint'")
        if self.charge not in ("all", "long"):
            raise bad("charge", "'all' or 'long'")
        if not 0 <= self.rebuild_share_low <= self.rebuild_share_high:
            raise bad("rebuild_share_low", f"in [0, rebuild_share_high={self.rebuild_share_high}]")
        if self.default_turns < 1:
            raise bad("default_turns", ">= 1")
        if self.size not in ("life", "turn"):
            raise bad("size", "'life' or 'turn'")
        if not 0.1 <= self.life_target <= 2.0:
            raise bad("life_target", "in [0.1, 2.0]")
        if self.overflow not in ("peak", "turns"):
            raise bad("overflow", "'peak' or 'turns'")
        if self.queue_wait not in ("slot", "fit", "fit_within", "pool", "unkept"):
            raise bad("queue_wait", "'slot', 'fit', 'fit_within', 'pool' or 'unkept'")
        if self.shared not in ("unique", "full"):
            raise bad("shared", "'unique' or 'full'")
        if self.slot_wait not in ("mean", "ends", "fit_ends"):
            raise bad("slot_wait", "'mean', 'ends' or 'fit_ends'")
        if self.rebuild_net not in ("always", "keepable"):
            raise bad("rebuild_net", "'always' or 'keepable'")
        if self.order not in ("arrival", "life"):
            raise bad("order", "'arrival' or 'life'")


@dataclass
class _Active:
    workflow: str
    admitted_at: float
    blocks: int
    long: bool
    #: Its latest context: the prompt of its latest turn seen (the offer's estimate until then).
    prefill_tokens: int
    turns: int | None = None
    #: Turns observed so far.
    seen: int = 1
    #: Tokens of its first prompt found in the prefix cache (None: not reported).
    shared: int | None = None
    #: When its latest turn was seen (admission until then).
    turn_at: float = 0.0


@register_controller
class MarsAdmissionController(ControllerBase):
    """The MARS admission controller (see the module docstring for the rules)."""

    name = "mars"
    config_cls = MarsAdmissionConfig
    config: MarsAdmissionConfig
    _active: dict[str, _Active]

    def __init__(self, config: MarsAdmissionConfig | None = None) -> None:
        super().__init__(config)
        cfg = self.config
        self.cost: CostModel | None = None
        self._service_s = 0.0  # EMA of a root's active time (admission to finish)
        self._turn_s: float | None = None  # EMA of the time between a root's successive turns
        self._turns = float(cfg.default_turns)  # EMA of LLM calls per root
        self._rebuild_share: float | None = None  # measured share of engine time spent rebuilding
        self._waiting_ema: float | None = None  # EMA of calls waiting in the engine, per reading
        self._prev_rebuild: tuple[float, int] | None = None  # (ts, cumulative rebuilt tokens)
        self._cost_warned = False
        self._last_window_update: float | None = None
        self._kv_overloaded = False
        self._cpu_overloaded = False
        self._stale = False
        self._turn_growth = 0.0  # learned tokens added per turn (0 until a workflow reports)
        self._grown = 0  # turn-growth observations so far
        self._life_version = 0  # bumped when the active set or a root's progress changes
        self._life_cache: tuple[int, list[tuple[float, float]]] | None = None
        if cfg.cost_model:
            self.set_cost_model(CostModel.load(cfg.cost_model))

    def set_cost_model(self, model: CostModel | None) -> None:
        """Price rebuilds with ``model`` (the "cost" rule; None: the footprint rules)."""
        self.cost = model
        if model is not None and self.config.admit == "cost" and self.config.window_init is None:
            self.window = self.config.window_max  # work-conserving start; AIMD is the safety net
        self._emit(self._tel.ts if self._tel else 0.0, "admission_cost_model", {
            "rule": self._rule(), "source": None if model is None else model.source,
            "calibrated": None if model is None else model.calibrated})

    def _rule(self) -> str:
        return "cost" if self.config.admit == "cost" and self.cost is not None else "footprint"

    def _cost_mode(self) -> bool:
        """The cost rule with a measured rebuild share (else KV usage drives the window)."""
        return self._rule() == "cost" and self._rebuild_share is not None

    # -- feeding ----------------------------------------------------------------------------------
    def _on_finish(self, act: _Active, now: float, final_tokens: int | None, turns: int | None) -> None:
        """An admitted root ended. ``final_tokens``, when known, is its last call's prompt+output
        size and ``turns`` its number of LLM calls (else the ``turns`` key of the root's
        ``PendingRoot.meta``): together they refine the per-turn growth estimate."""
        a = self.config.growth_alpha
        took = max(now - act.admitted_at, 0.0)
        self._service_s = took if self._service_s <= 0 else (1 - a) * self._service_s + a * took
        n = turns if turns is not None else act.turns
        if n is not None and n > 0:
            self._turns = (1 - a) * self._turns + a * n
        self._life_version += 1
        if act.seen > 1:
            return  # its growth was learned turn by turn
        if final_tokens is not None and final_tokens > 0 and n is not None and n > 0:
            per_turn = min(self.config.turn_growth_max_tokens, max(0.0, (final_tokens - act.prefill_tokens) / n))
            self._turn_growth = (1 - a) * self._turn_growth + a * per_turn

    def observe(self, telemetry: Telemetry) -> None:
        super().observe(telemetry)
        if self._tel is telemetry:
            self._measure_rebuilds(telemetry)
            if telemetry.waiting is not None:
                w = float(telemetry.waiting)
                self._waiting_ema = w if self._waiting_ema is None else 0.8 * self._waiting_ema + 0.2 * w

    def _measure_rebuilds(self, t: Telemetry) -> None:
        """Share of engine time spent recomputing lost KV (preempted tokens + evicted blocks,
        priced per token by the cost model), an EMA over readings at least ``interval_s`` apart."""
        if self.cost is None or t.recomputed_tokens is None:
            return
        tokens = t.recomputed_tokens + (t.kv_blocks_removed or 0) * (t.block_size or self._block_size())
        prev = self._prev_rebuild
        if prev is None:
            self._prev_rebuild = (t.ts, tokens)
            self._rebuild_share = 0.0  # measurable from now on; nothing rebuilt yet
            return
        dt = t.ts - prev[0]
        if dt < self.config.interval_s:
            return
        share = min(1.0, max(0, tokens - prev[1]) * self.cost.prefill_s_per_token / dt)
        old = self._rebuild_share
        self._rebuild_share = share if old is None else 0.7 * old + 0.3 * share
        self._prev_rebuild = (t.ts, tokens)

    def _on_reestimate(self, act: _Active, prefill_tokens: int, now: float) -> None:
        # A later turn's prompt: the context grew by one turn (tool output, the previous answer).
        # Learned online from every active root, so early roots are sized before any finishes.
        if act.prefill_tokens and prefill_tokens > act.prefill_tokens:
            a = self.config.growth_alpha
            step = min(self.config.turn_growth_max_tokens, prefill_tokens - act.prefill_tokens)
            self._turn_growth = step if self._grown == 0 else (1 - a) * self._turn_growth + a * step
            self._grown += 1
            took = max(now - act.turn_at, 0.0)
            self._turn_s = took if self._turn_s is None else (1 - a) * self._turn_s + a * took
            act.turn_at = now
            act.seen += 1
            self._life_version += 1
        # growth is measured from the agent's context, not from a short side call it was offered on
        act.prefill_tokens = max(act.prefill_tokens, prefill_tokens)

    def _on_cached(self, act: _Active, cached_tokens: int) -> None:
        if act.shared is None:  # the first call's hit: the root had no KV of its own yet
            act.shared = cached_tokens
            if self.config.shared == "unique":
                self._life_version += 1
            self._emit(self._tel.ts if self._tel else 0.0, "admission_shared", {
                "workflow": act.workflow, "cached_tokens": cached_tokens, "prefill_tokens": act.prefill_tokens,
                "counted": self.config.shared})

    def _own_tokens(self, act: _Active) -> float:
        """What ``act``'s context adds to the pool: all of it, or (``shared = "unique"``) less the
        prefix its first call found cached."""
        if self.config.shared == "unique" and act.shared:
            return float(max(0, act.prefill_tokens - act.shared))
        return float(act.prefill_tokens)

    @property
    def turn_growth(self) -> float:
        """Learned tokens added per turn (footprints add one turn of it)."""
        return self._turn_growth

    # -- derived state ----------------------------------------------------------------------------
    def _block_size(self) -> int:
        t = self._tel
        return t.block_size if t is not None and t.block_size else self.config.default_block_size

    def _est_tokens(self, root: PendingRoot) -> int:
        return self.config.unknown_prefill_tokens if root.prefill_tokens is None else root.prefill_tokens

    def footprint_blocks(self, root: PendingRoot) -> int:
        """KV blocks this root is expected to need: its prefix plus one turn of learned growth."""
        return math.ceil((self._est_tokens(root) + self._turn_growth) / self._block_size())

    def _is_long(self, tokens: int) -> bool:
        lim = self.config.long_prefill_tokens
        return lim > 0 and tokens > lim

    def _telemetry_usable(self) -> bool:
        t = self._tel
        return t is not None and t.free_blocks is not None and bool(t.total_blocks)

    def _usage(self) -> float | None:
        t = self._tel
        if t is None:
            return None
        if t.kv_usage is not None:
            return t.kv_usage
        if t.free_blocks is not None and t.total_blocks:
            return 1.0 - t.free_blocks / t.total_blocks
        return None

    def budget_blocks(self) -> int | None:
        """Free blocks above the guard margin, minus promises; None when telemetry is missing."""
        if not self._telemetry_usable():
            return None
        t = self._tel
        assert t is not None and t.free_blocks is not None and t.total_blocks
        reserve = math.ceil(t.total_blocks * (1 - self.config.kv_target))
        return max(0, t.free_blocks - reserve - self._promised())

    def _cpu_state(self) -> tuple[float | None, bool, bool]:
        """(in-flight per worker, overloaded, healthy) with hysteresis on the overloaded flag."""
        cfg, t = self.config, self._tel
        ratio = wait = None
        if t is not None and t.tools_in_flight is not None:
            ratio = t.tools_in_flight / max(1, t.tool_workers or 1)
        if t is not None:
            wait = t.tool_queue_wait_s
        high = (ratio is not None and ratio >= cfg.cpu_backlog_high) or (
            wait is not None and wait >= cfg.cpu_wait_high_s)
        healthy = (ratio is None or ratio <= cfg.cpu_backlog_low) and (wait is None or wait <= cfg.cpu_wait_low_s)
        if high:
            overloaded = True
        elif healthy:
            overloaded = False
        else:
            overloaded = self._cpu_overloaded
        return ratio, overloaded, healthy

    def _caps(self) -> tuple[int, int]:
        cfg, t = self.config, self._tel
        lo, hi = cfg.window_min, cfg.window_max
        cpu_cap = hi
        if t is not None and t.tool_workers:
            mid = max(0.1, (cfg.cpu_backlog_low + cfg.cpu_backlog_high) / 2)
            cpu_cap = min(hi, max(lo, math.ceil(t.tool_workers * mid)))
        usage = self._usage()
        if self._stale:
            kv_cap = lo
        elif self._cost_mode():
            kv_cap = hi  # the AIMD window reacts to measured rebuilds
        elif usage is None or usage <= cfg.kv_low:
            kv_cap = hi
        elif usage >= cfg.kv_target:
            kv_cap = lo
        else:
            frac = (usage - cfg.kv_low) / (cfg.kv_target - cfg.kv_low)
            kv_cap = min(hi, max(lo, round(hi - frac * (hi - lo))))
        return cpu_cap, kv_cap

    def _set_pressure(self, now: float, kind: str, state: bool, inputs: dict) -> None:
        attr = {"kv": "_kv_overloaded", "cpu": "_cpu_overloaded", "telemetry": "_stale"}[kind]
        if getattr(self, attr) != state:
            setattr(self, attr, state)
            self._events.append(AdmissionEvent(now, "admission_pressure",
                                               {"controller": self.name, "kind": kind, "overloaded": state,
                                                **inputs}))

    def _inputs(self, now: float) -> dict:
        t = self._tel
        ratio, _, _ = self._cpu_state()
        return {
            "telemetry_age_s": None if t is None else round(now - t.ts, 6),
            "free_blocks": None if t is None else t.free_blocks,
            "total_blocks": None if t is None else t.total_blocks,
            "kv_usage": self._usage(),
            "tools_in_flight": None if t is None else t.tools_in_flight,
            "tool_workers": None if t is None else t.tool_workers,
            "tool_queue_wait_s": None if t is None else t.tool_queue_wait_s,
            "cpu_backlog_ratio": ratio,
            "engine_running": None if t is None else t.running,
            "engine_waiting": None if t is None else t.waiting,
            "engine_waiting_ema": None if self._waiting_ema is None else round(self._waiting_ema, 4),
        }

    # -- the control step -------------------------------------------------------------------------
    def _update_pressure(self, now: float) -> None:
        cfg, t = self.config, self._tel
        stale = t is not None and now - t.ts > cfg.stale_s
        kv = self._kv_overloaded
        usage = self._usage()
        if self._cost_mode():
            # Full KV is fine while rebuilds are cheap: pressure is measured rebuild time.
            share = self._rebuild_share
            applies = self._net_applies()
            if share >= cfg.rebuild_share_high and applies:
                kv = True
            elif share <= cfg.rebuild_share_low or not applies:
                kv = False
        elif usage is not None and not stale:
            if usage >= cfg.kv_target:
                kv = True
            elif usage <= cfg.kv_low:
                kv = False
        _, cpu, _ = self._cpu_state()
        if (stale, kv, cpu) == (self._stale, self._kv_overloaded, self._cpu_overloaded):
            return  # the hot path: nothing changed, build no event
        inputs = {**self._inputs(now), "rebuild_share": self._rebuild_share}
        self._set_pressure(now, "telemetry", stale, inputs)
        self._set_pressure(now, "kv", kv, inputs)
        self._set_pressure(now, "cpu", cpu, inputs)

    def _update_window(self, now: float) -> None:
        cfg = self.config
        if self._last_window_update is not None and now - self._last_window_update < cfg.interval_s - 1e-9:
            return
        self._last_window_update = now
        if not self._telemetry_usable() and self._tel is None:
            return  # nothing to react to; the fixed no-telemetry window applies
        prev = self.window
        _ratio, cpu_over, cpu_healthy = self._cpu_state()
        usage = self._usage()
        budget = self.budget_blocks()
        overloaded = self._kv_overloaded or cpu_over or self._stale
        if overloaded:
            base = self.window
            if self._cost_mode() and self._kv_overloaded:
                # Measured thrashing: decrease from what is in flight (a window above the active
                # count would not stop a single admission).
                base = min(base, max(len(self._active), 1))
            w = max(cfg.window_min, math.floor(base * cfg.dec_factor))
        elif cpu_healthy and (self._cost_mode() or (
                (usage is None or usage <= cfg.kv_low) and (budget is None or budget > 0))):
            w = min(cfg.window_max, self.window + cfg.inc)
        else:
            w = self.window
        cpu_cap, kv_cap = self._caps()
        w = max(cfg.window_min, min(w, cpu_cap, kv_cap))
        self.window = w
        if w != prev:
            self._events.append(AdmissionEvent(now, "admission_window", {
                "controller": self.name, "prev": prev, "new": w, "cpu_cap": cpu_cap, "kv_cap": kv_cap,
                "overloaded": overloaded, "kv_overloaded": self._kv_overloaded, "cpu_overloaded": cpu_over,
                "stale": self._stale, "cpu_healthy": cpu_healthy, "kv_budget_blocks": budget,
                **self._inputs(now)}))

    def limit(self) -> int:
        """Active-root limit now."""
        if not self._telemetry_usable():
            return min(self.config.no_telemetry_window, self.config.window_max)
        cpu_cap, kv_cap = self._caps()
        return max(self.config.window_min, min(self.window, cpu_cap, kv_cap))

    def tick(self, now: float) -> list[str]:
        if not self._cost_warned and self.config.admit == "cost" and self.cost is None:
            self._cost_warned = True
            logger.warning("mars admission: no cost model, so no cost-aware admission (footprint rules)")
            self._events.append(AdmissionEvent(now, "admission_cost_model", {
                "controller": self.name, "rule": "footprint", "source": None, "calibrated": False,
                "note": "no cost model: the footprint rules apply (pass cost_model, or run under the driver)"}))
        self._update_pressure(now)
        self._update_window(now)
        if not self._queue:
            return []
        limit = self.limit()
        slots = limit - len(self._active)
        budget = self.budget_blocks()
        # limit >= window_min >= 1, so an empty active set always has a slot
        admitted = self._select(slots, budget, now) if slots > 0 else []
        if not admitted:
            return []
        ctx = {"controller": self.name, "limit": limit, "window": self.window, "kv_budget_blocks": budget,
               "turn_growth_tokens": round(self._turn_growth, 1), "rule": self._rule(),
               "rebuild_share": self._rebuild_share, **self._inputs(now)}
        remaining = budget
        out = []
        for root, mode, blocks, why in admitted:
            tokens = self._est_tokens(root)
            if remaining is not None:
                remaining = max(0, remaining - blocks)
            turns = root.meta.get("turns") if root.meta else None
            self._admit(root, now, _Active(root.workflow, now, blocks, self._is_long(tokens), tokens,
                                           turns if isinstance(turns, int) else None, turn_at=now),
                        blocks, self.config.promise_s)
            self._life_version += 1
            out.append(root.workflow)
            self._events.append(AdmissionEvent(now, "admission_admit", {
                **ctx, "workflow": root.workflow, "mode": mode, "prefill_tokens_est": tokens,
                "footprint_blocks": blocks, "long": self._is_long(tokens), "kv_budget_remaining": remaining,
                "active": len(self._active), "queued": len(self._queue), "waited_s": round(now - root.arrival, 6),
                **why}))
        logger.debug("admitted %s (limit %s, budget %s)", out, limit, budget)
        return out

    def _select(self, slots: int, budget: int | None, now: float) -> list[tuple[PendingRoot, str, int, dict]]:
        """Pick up to ``slots`` roots: (root, mode, footprint blocks, decision inputs)."""
        queue = list(self._queue.values())
        if budget is None:  # missing telemetry: a small fixed window in arrival order
            return [(r, "no_telemetry_fcfs", self.footprint_blocks(r), {}) for r in queue[:slots]]
        cfg = self.config
        foot = {r.workflow: self.footprint_blocks(r) for r in queue}
        cost_rule = self._rule() == "cost"
        short = [r for r in queue if not self._is_long(self._est_tokens(r))]
        if not short and not cost_rule:
            return self._drain(queue, slots, budget, foot)
        _, cpu_over, cpu_healthy = self._cpu_state()
        usage = self._usage()
        light = (not (self._kv_overloaded or cpu_over or self._stale) and cpu_healthy
                 and (usage is None or usage <= cfg.kv_low) and budget > 0
                 and len(queue) <= slots and sum(foot.values()) <= budget)
        if cpu_over:
            order = sorted(queue, key=lambda r: (not self.returning(r), -foot[r.workflow], self._seq[r.workflow]))
            mode = "cpu_overloaded_large_first"
        elif cost_rule:
            order, mode = queue, "cost_fit"
            if cfg.order == "life" and len(queue) > 1:
                order = sorted(queue, key=lambda r: (
                    not self.returning(r),
                    self._est_tokens(r) * self._root_turns(r),
                    self._seq[r.workflow]))
        elif light:
            order, mode = queue, "light_fcfs"
        else:
            order = sorted(queue, key=lambda r: (not self.returning(r), foot[r.workflow], self._seq[r.workflow]))
            mode = "smallest_fit"
        queue_s = self._queue_cost_s(now) if cost_rule else None
        cap = self.life_capacity_tokens() if cfg.size == "life" else None
        items = self._life_items() if cap is not None else []
        peak = self._life_peak(items) if cap is not None else 0.0
        bs = self._block_size()
        out, remaining = [], budget
        for r in order:
            if len(out) >= slots:
                break
            b = foot[r.workflow]
            if cfg.charge == "long" and not self._is_long(self._est_tokens(r)) and not self._kv_overloaded:
                out.append((r, "short_uncharged", b, {}))  # the preview: short roots are not charged
                continue
            over, why, grown, with_peak = 0, {}, None, 0.0
            if cap is not None:
                # Whole life: the candidate's context over all its turns joins the projection; what
                # the peak gains beyond the capacity is its overflow.
                cand = (self._root_turns(r), float(self._est_tokens(r)))
                grown = sorted([*items, cand], reverse=True)
                with_peak = self._life_peak(grown)
                over = max(0, math.ceil((with_peak - max(cap, peak)) / bs))
                why = {"life_peak_tokens": round(with_peak), "life_capacity_tokens": round(cap)}
            if b <= remaining and over == 0:
                out.append((r, mode, b, why))
            elif cost_rule and not cpu_over:
                short = max(b - max(remaining, 0), 0)
                overflow = short + over
                if cap is not None and cfg.overflow == "turns":
                    per_turn = self._marginal_overflow(items, grown, cap)
                    rebuild_s = self._rebuild_cost_s(r, short, per_turn)
                    why = {**why, "overflow_turns": sum(1 for x in per_turn if x > 0)}
                else:
                    rebuild_s = self._rebuild_cost_s(r, overflow)
                wait_s = queue_s
                if rebuild_s >= wait_s and cap is not None and (
                        cfg.queue_wait == "fit" or (cfg.queue_wait == "fit_within" and peak <= cap)
                        or (cfg.queue_wait == "pool" and self._unkeepable(cap, items, cand))
                        or (cfg.queue_wait == "unkept" and not self._pool_keeps(cap, items, cand))):
                    wait_s, k = self._fit_wait_s(r, items, cand, cap, queue_s)
                    why = {**why, "wait_slots": k}
                # Ski rental: a root that has already waited as long as its admission would cost
                # goes in (never waits more than that for a slot the estimate promised sooner).
                if cfg.ski_rental:
                    wait_s = max(wait_s, now - r.arrival)
                if rebuild_s >= wait_s:
                    continue
                out.append((r, "cost_overflow", b, {**why, "overflow_blocks": overflow,
                                                    "expected_rebuild_s": round(rebuild_s, 6),
                                                    "expected_queue_s": round(wait_s, 6)}))
            else:
                continue
            remaining -= b
            if grown is not None:
                items, peak = grown, with_peak
        if not out and not self._active:
            oldest = queue[0]
            out.append((oldest, "oldest_alone", foot[oldest.workflow], {}))
        return out

    # -- whole-life sizing ("life") -----------------------------------------------------------------
    def _root_turns(self, root: PendingRoot) -> float:
        """LLM calls a queued root makes (its reported ``turns``, else the learned mean)."""
        return self._pred_turns(root.meta.get("turns") if root.meta else None)

    def _pred_turns(self, turns: object) -> float:
        """LLM calls a root makes: its own ``turns`` when it reports them, else the learned mean."""
        return float(turns) if isinstance(turns, int) and not isinstance(turns, bool) and turns >= 1 else self._turns

    def _life_items(self) -> list[tuple[float, float]]:
        """(remaining turns, current context tokens) of each active root, remaining turns first
        (cached until a root is admitted, finishes or shows a new turn)."""
        c = self._life_cache
        if c is not None and c[0] == self._life_version:
            return c[1]
        items = sorted(((max(self._pred_turns(a.turns) - a.seen + 1, 1.0), self._own_tokens(a))
                        for a in self._active.values()), reverse=True)
        self._life_cache = (self._life_version, items)
        return items

    def _life_peak(self, items: list[tuple[float, float]]) -> float:
        """Peak over the coming turns of the active contexts' sum (tokens). ``items`` sorted by
        remaining turns, most first: each context grows by the learned per-turn growth until its
        predicted last turn and is freed after it, so the sum peaks just before some root ends."""
        g = self._turn_growth
        peak = base = 0.0
        for n, (rem, ctx) in enumerate(items, 1):
            base += ctx
            peak = max(peak, base + g * rem * n)
        return peak

    def life_capacity_tokens(self) -> float | None:
        """Tokens the active roots may project to: ``life_target`` of the pool (None: no telemetry)."""
        if not self._telemetry_usable():
            return None
        t = self._tel
        assert t is not None and t.total_blocks
        return t.total_blocks * self._block_size() * self.config.life_target

    def _projection(self, items: list[tuple[float, float]]) -> list[float]:
        """The projected sum of the active contexts at each coming turn k = 1, 2, ... (tokens):
        the roots with at least k turns left, each grown by k turns of the learned growth."""
        if not items:
            return []
        g = self._turn_growth
        out = [0.0] * math.ceil(items[0][0])
        j = n = 0
        base = 0.0
        for k in range(len(out), 0, -1):
            while j < len(items) and items[j][0] >= k:
                base += items[j][1]
                n += 1
                j += 1
            out[k - 1] = base + g * k * n
        return out

    def _marginal_overflow(self, items: list[tuple[float, float]], grown: list[tuple[float, float]],
                           cap: float) -> list[float]:
        """Tokens the candidate adds beyond ``cap`` at each coming turn (``grown`` = ``items`` with
        the candidate)."""
        before, after = self._projection(items), self._projection(grown)
        return [max(0.0, a - cap) - max(0.0, (before[k] if k < len(before) else 0.0) - cap)
                for k, a in enumerate(after)]

    def _rebuild_cost_s(self, root: PendingRoot, overflow_blocks: int,
                        per_turn_tokens: list[float] | None = None) -> float:
        """Expected engine-time cost (call-seconds) of admitting ``root`` with ``overflow_blocks``
        beyond the budget: that much context is evicted during tool gaps and rebuilt once per turn,
        and each rebuild stalls the running batch. With ``per_turn_tokens`` (overflow "turns"),
        turn k rebuilds those tokens on top of the blocks short now, for the root's turns."""
        assert self.cost is not None
        turns = self._root_turns(root)
        t = self._tel
        running = t.running if t is not None and t.running is not None else len(self._active)
        bs = self._block_size()
        if per_turn_tokens is None:
            return turns * self.cost.rebuild_s(overflow_blocks * bs) * (1 + running)
        n = max(math.ceil(turns), len(per_turn_tokens))
        total = 0.0
        for k in range(n):
            tok = (overflow_blocks * bs if k < turns else 0) + (per_turn_tokens[k] if k < len(per_turn_tokens) else 0.0)
            if tok > 0:
                total += self.cost.rebuild_s(math.ceil(tok))
        return total * (1 + running)

    def _fit_wait_s(self, root: PendingRoot, items: list[tuple[float, float]], cand: tuple[float, float],
                    cap: float, slot_s: float, levels: int = 32) -> tuple[float, int]:
        """Queueing cost of holding ``root`` ("fit"): ``min over k`` of ``k * slot_s`` plus the
        rebuilds its overflow would still cost once the k soonest-ending active roots have left
        (the others grown by the turns that took). Returns (cost, k); k = 0: no level checked."""
        g = self._turn_growth
        best, best_k = math.inf, 0
        ends = sorted(items)  # soonest-ending first
        checked = 0
        for i, (rem, _) in enumerate(ends):
            if i + 1 < len(ends) and ends[i + 1][0] == rem:
                continue  # roots ending at the same turn leave together
            checked += 1
            if checked > levels:
                break
            k = i + 1
            # ``items`` order (most turns left first), as _projection needs
            later = [(x - rem, ctx + g * rem) for x, ctx in items if x > rem]
            grown = sorted([*later, cand], reverse=True)
            wait = self._slot_wait_s(k)
            cost = (k * slot_s if wait is None else wait) + self._rebuild_cost_s(
                root, 0, self._marginal_overflow(later, grown, cap))
            if cost < best:
                best, best_k = cost, k
            if not later:
                break
        return best, best_k

    def _unkeepable(self, cap: float, items: list[tuple[float, float]], cand: tuple[float, float]) -> bool:
        """``queue_wait = "pool"``: True when holding a root can neither keep contexts nor relieve
        the engine: the pool holds fewer than ``window_min`` of the contexts the roots will have
        (the active roots' and the candidate's mean, each grown by its remaining turns as in the
        projection that decides the hold), so at the fewest roots the controller ever keeps active
        they are still evicted in every tool gap, and no call waits in the engine. (Current
        contexts instead held a root 36.7 s on the H100 grid, ILR-1 @ 0.036 seed 0, where 4 of
        them fit the pool and their lives did not; measured while its cycled roots shared ids.)"""
        idle = self._waiting_ema is not None and self._waiting_ema < 0.5
        return idle and not self._pool_keeps(cap, items, cand)

    def _pool_keeps(self, cap: float, items: list[tuple[float, float]],
                    cand: tuple[float, float] | None = None) -> bool:
        """The pool (``cap`` tokens) holds ``window_min`` of the contexts the roots will have: the
        mean of the active roots' (and the candidate's) contexts, each grown by its remaining turns.
        True when there are none."""
        g = self._turn_growth
        ctx = [c + g * rem for rem, c in items] + ([cand[1] + g * cand[0]] if cand is not None else [])
        return not ctx or cap >= self.config.window_min * (sum(ctx) / len(ctx))

    def _net_applies(self) -> bool:
        """``rebuild_net = "keepable"``: measured rebuilds shrink the window only while the pool
        keeps ``window_min`` of the grown contexts (else fewer active roots are evicted all the same)."""
        if self.config.rebuild_net == "always":
            return True
        cap = self.life_capacity_tokens()
        return cap is None or self._pool_keeps(cap, self._life_items())

    def _queue_cost_s(self, now: float) -> float:
        """Expected wait for the next slot. ``slot_wait = "mean"``: a root's mean active time over the
        roots active (before any root finished, the longest one active so far); "ends": the
        soonest expected end of an active root (:meth:`_slot_wait_s`)."""
        if not self._active:
            return math.inf
        ends = self._slot_wait_s(1, fit=False)
        if ends is not None:
            return ends
        service = self._service_s or max(now - a.admitted_at for a in self._active.values())
        return service / len(self._active)

    def _slot_wait_s(self, k: int, fit: bool = True) -> float | None:
        """``slot_wait = "ends"`` (``"fit_ends"``: only for the projection's wait, ``fit``): the
        expected wait until ``k`` active roots have ended: the k-th fewest remaining turns (the
        current one half done on average) times the learned time between turns. None: "mean" (or
        "fit_ends" outside the projection's wait), or no turn time learned yet."""
        sw = self.config.slot_wait
        if not (sw == "ends" or (sw == "fit_ends" and fit)) or self._turn_s is None or not self._active:
            return None
        ends = sorted(rem for rem, _ in self._life_items())
        return (ends[min(k, len(ends)) - 1] - 0.5) * self._turn_s

    def _drain(self, queue: list[PendingRoot], slots: int, budget: int,
               foot: dict[str, int]) -> list[tuple[PendingRoot, str, int, dict]]:
        """Only long roots wait: arrival order within the live budget, one at a time while any
        earlier admission is active; the oldest alone when none fits and nothing is active."""
        cap = 1 if self._active else slots
        out, remaining = [], budget
        for r in queue:
            if len(out) >= cap:
                break
            b = foot[r.workflow]
            if b <= remaining:
                out.append((r, "drain_fit", b, {}))
                remaining -= b
        if not out and not self._active:
            out.append((queue[0], "drain_oldest_alone", foot[queue[0].workflow], {}))
        return out

    def snapshot(self) -> dict:
        """State for /metrics and debugging."""
        return {**super().snapshot(),
                "kv_budget_blocks": self.budget_blocks(), "turn_growth_tokens": self._turn_growth,
                "kv_overloaded": self._kv_overloaded, "cpu_overloaded": self._cpu_overloaded,
                "stale": self._stale, "rule": self._rule(), "rebuild_share": self._rebuild_share,
                "cost_model": None if self.cost is None else self.cost.as_dict()}
