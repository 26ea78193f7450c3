"""A real run's recorded step times as the sim's step-time model (``--backend sim --step-trace``).

``StepTrace`` wraps a profile: everything (KV pool, limits, the cost model the policies price
rebuilds with) is the profile's, but step ``i`` of the sim costs what step ``i`` of the recorded run
took (``steps.jsonl`` of ``mars replay --backend inprocess --record-steps``; the calibration's steps
are skipped). Fed the same workload, the sim then reproduces that run only if its mechanism does:
arrivals and tool returns seen at the same step boundaries, the same batches, the same preemptions.
Each step's batch is compared with the recorded one; the first difference is reported
(:meth:`StepTrace.trace_stats`), and from there on the times no longer belong to the same batches. Steps
past the end of the recording cost the profile's time.

Arrivals follow the recording too. A real run's driver hands a call to the engine a little later than
the sim's does (the output hand-off to the asyncio thread, a timer's overshoot: 1-3 ms on the CPU
engine), and the real engine starts a step a little after a call arrives at an idle engine (its
wake-up); neither is in any step's time. So each recorded step lists the calls the real engine took in
before it (``added``), and the sim takes each call in before that same step, in the same order: a call
that arrives earlier waits (:meth:`StepTrace.hold`), so does one that arrives before a call the real
engine took in ahead of it for that step (:meth:`StepTrace.held`), and a step waits up to
``ARRIVAL_WAIT_S`` of virtual time for a call it should take in that has not arrived yet
(:meth:`StepTrace.awaits`). The decode fast-forward runs several steps without coming back to that wait,
but it stops at any loop timer, so a step before one that takes in a call not here yet ends on a timer
(:meth:`StepTrace._started`). Recordings without ``added`` replay with the sim's own arrival timing.
After an idle spell a real engine starts its step a little after the call arrives (later on a loaded
machine), and a policy that reads the clock (mars's MLFQ levels) decides by it: no replayed step starts
before its recorded start (``t``, :meth:`StepTrace.before_step`); a busy run's steps follow each other
as the recorded ones did.

Outputs follow the recording too. A recorded step's ``seconds`` is its whole cycle in the real stepper
loop (the engine step, then the snapshot, the output hand-off and the next calls' intake); ``t_out`` is
when its outputs were stamped, and ``seen`` when the driver saw each call it finished (milliseconds
later on a loaded machine). The replay charges a step up to its ``t_out`` and takes the next step's
calls in at that step's ``t``, so calls end and arrive on the policy's clock when the real ones did
(gap samples, retention expiry), and hands each output to the driver at its ``seen``
(:meth:`StepTrace.hand_over`), so a tool starts, and a finished root frees its admission, when the
real driver's did. Recordings without them charge whole cycles and hand outputs over at a step's end.

The scheduler reads the clock the recorded one read. A real engine's scheduler reads its own clock in a
call's ``add_request()`` (its arrival, a little before the step's ``t``), in ``schedule()`` (a little after
``t``: the engine core's own work comes first) and in ``update_from_output()`` (a call's end, a retention's
start: a little before ``t_out``); the replay's loop stands at the step's start and end there, tens of
microseconds (milliseconds on a loaded machine) away, and a decision on those readings (a retention's
expiry, an MLFQ level's aging, the priced reserve's measured holds and recoveries) can come out otherwise
(a new prompt's first chunk cut to the free blocks, or a call let in against the reserve, or not).
``--record-steps`` writes those readings (``t_added``, ``t_sched``, ``t_update``;
:class:`vllm_mars.engine.steps.StepRecorder`) and the replay's scheduler reads them in the same places
(:meth:`StepTrace.scheduler_now`); recordings without them replay on the loop's clock.

The driver's control loop ticks where the recorded run's ticked. A real run's loop sleeps
``interval_s`` between ticks, and on a loaded machine the sleeps overshoot (ticks at 1.236 s against
the sim's 1.200 s): a cost rule or window that compares waits with prices then decides at another
step. ``--record-steps`` writes down every tick under the first step that ended after it
(``steps.jsonl``'s ``ticks``: its run-clock time and the age of the engine reading it read;
``driver.runner.write_steps``). The replay's control loop waits on :meth:`StepTrace.next_tick`
instead of its timer: a loop timer at the recorded time, moved into the tick's window where the sim's
steps put that time outside (after the step whose state it read has ended, before the next one ends:
``ticks_moved``), reading the engine as the real engine's stepper hands it to the driver, a snapshot
of the state the last step left (:meth:`StepTrace.reading`), stamped as old as the recorded reading
was. Past the last recorded tick the loop runs on its timer again. Roots arrive when the recorded
run's did (``workflow_arrive`` in its ``events.jsonl``, :func:`recorded_arrivals`): a real arrival
timer overshoots its target too, and which of an arrival and a tick comes first decides an admission.

The policies price work as the recorded run's did: a real run's admission controller and scheduler
price with the driver's solo-call calibration on that engine, which its ``events.jsonl`` (beside
``steps.jsonl``) records in ``run_start``'s ``cost_model``; :meth:`StepTrace.cost_model` hands that to
the sim's controller and policies in place of the profile's fit, so mars admits roots at the moments
the real run did. A recording without it (no ``events.jsonl``, or a run without calibration) prices
with the profile's model.

Without it, a sim/real comparison mixes two errors: the step-time model's (a fitted profile charges
every step a smooth function of its batch, while a real engine on a shared machine has slow episodes)
and the mechanism's; the trace takes the first out.
"""

from __future__ import annotations

import asyncio
import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from vllm_mars.costmodel import CostModel
from vllm_mars.metrics.events import read_jsonl
from vllm_mars.sim.fit import load_samples

#: the longest a replayed step waits (virtual seconds) for a call the real engine took in before it
ARRIVAL_WAIT_S = 0.25
#: a replayed step waits for its recorded start only when that is later than this (seconds; the
#: recorded step times are rounded to 0.1 us, so a busy run's step starts agree to about this)
START_SLACK_S = 1e-5
#: virtual seconds a replayed control tick keeps inside its step window: after the step it read has
#: ended, before the next one ends (a timer due at the very instant a step ends would race the engine)
TICK_MARGIN_S = 1e-7


class _Tick:
    """A recorded control tick the driver waits on: the run step it runs before (``line``: it reads
    the engine as the step before left it), its run-clock time (``at``), its reading's age, and the
    future that the loop timer at its place resolves."""

    __slots__ = ("age", "at", "handle", "line", "waiter", "want")

    def __init__(self, line: int, at: float, age: float, waiter: asyncio.Future) -> None:
        self.line, self.at, self.age, self.waiter = line, at, age, waiter
        self.handle: asyncio.TimerHandle | None = None
        self.want = 0.0  # loop time of its recorded time, before it is moved into its window


def _noop() -> None:
    pass


class _SchedulerClock:
    """A replayed scheduler's clock (``Clock``): ``now()`` of :meth:`StepTrace.scheduler_now`, never
    behind a reading it gave (a real monotonic clock's readings, in the order the real scheduler read them)."""

    __slots__ = ("_last", "_read")

    def __init__(self, read: Any) -> None:
        self._read = read
        self._last = -math.inf

    def now(self) -> float:
        self._last = t = max(self._read(), self._last)
        return t


def _resolve(future: asyncio.Future, result: Any) -> None:
    if not future.done():  # (its caller may have given up)
        future.set_result(result)


def _pairs(d: dict, field: str, first: Any, where: str, what: str) -> list[tuple[Any, float]] | None:
    """``d[field]`` as a list of (``first(x)``, seconds) pairs, None when absent; every number finite and
    >= 0, else a one-line error naming the place and the field."""
    value = d.get(field)
    if value is None:
        return None
    try:
        got = [(first(x), float(b)) for x, b in value]
    except (TypeError, ValueError):
        got = None
    if got is None or not all(math.isfinite(b) and b >= 0 and (first is not float or (math.isfinite(x) and x >= 0))
                              for x, b in got):
        raise ValueError(f"{where}: field {field!r} must be a list of {what}, got {value!r}")
    return got


def _seconds(t: Any) -> float | None:
    """``t`` as a finite float, None when it is not one (not recorded)."""
    return float(t) if isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t) else None


@dataclass
class _RunFields:
    """Per recorded run step (calibration steps left out): the calls the engine took in before it
    (``added``); its run-clock start (``t``), output stamp (``t_out``) and the scheduler's clock readings
    in its ``schedule()`` and ``update_from_output()`` (``t_sched``, ``t_update``; None: not recorded);
    (run step, at, age) of every recorded control tick (``ticks``, see ``driver.runner.write_steps``);
    the run-clock time the driver saw each finished call's output (``seen``), and the scheduler's
    reading in each call's ``add_request()`` (``t_added``)."""

    added: list[list[str]] = field(default_factory=list)
    t: list[float | None] = field(default_factory=list)
    t_out: list[float | None] = field(default_factory=list)
    t_sched: list[float | None] = field(default_factory=list)
    t_update: list[float | None] = field(default_factory=list)
    ticks: list[tuple[int, float, float]] = field(default_factory=list)
    seen: dict[str, float] = field(default_factory=dict)
    t_added: dict[str, float] = field(default_factory=dict)


def _read_run_fields(path: str) -> _RunFields:
    """The recorded run steps' fields (:class:`_RunFields`). ValueError naming the file, line and field
    (``load_samples`` validated the rest of the file)."""
    out = _RunFields()
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            d = json.loads(line)
            if d.get("calibration") is True:
                continue
            i = len(out.added)
            rids = [str(r) for r in d.get("added") or ()]
            out.added.append(rids)
            for name in ("t", "t_out", "t_sched", "t_update"):
                getattr(out, name).append(_seconds(d.get(name)))
            pairs = _pairs(d, "ticks", float, f"{path}:{n}", "[at, age] pairs of seconds >= 0")
            if pairs is not None:
                out.ticks += [(i, a, b) for a, b in pairs]
            got = _pairs(d, "seen", str, f"{path}:{n}", "[request id, seconds >= 0] pairs")
            if got is not None:
                out.seen.update(got)
            adds = d.get("t_added")
            if adds is not None:
                got = [_seconds(x) for x in adds] if isinstance(adds, list) else []
                if len(got) != len(rids) or any(x is None or x < 0 for x in got):
                    raise ValueError(f"{path}:{n}: field 't_added' must be a list of seconds >= 0, one per call "
                                     f"of 'added' ({len(rids)}), got {adds!r}")
                out.t_added.update(zip(rids, got))
    return out


class StepTrace:
    """``profile`` with the step times of a recorded run, step by step (see the module docstring)."""

    arrival_wait_s = ARRIVAL_WAIT_S

    def __init__(self, profile: Any, path: str) -> None:
        self._profile = profile
        self.path = path
        self._samples = load_samples(path, run_only=True)
        if not self._samples:
            raise ValueError(f"{path}: no recorded run steps (record them with mars replay --backend inprocess "
                             "--record-steps)")
        self._next = 0
        self._first_mismatch: dict[str, Any] | None = None
        self._mismatches = 0
        #: the calls the real engine took in before each recorded step, and where (step, position); the
        #: run-clock time each recorded step started (None: not recorded); the recorded control ticks
        #: (run step, at, age)
        run = _read_run_fields(path)
        self._added, self._t, self._ticks, self._seen = run.added, run.t, run.ticks, run.seen
        #: what each recorded step charges: up to its output stamp where recorded (``t_out``: the rest of
        #: its cycle, the hand-off and the next calls' intake, passes before the next step's ``t``),
        #: else its whole cycle (``seconds``)
        self._charge = [s.seconds if t is None or o is None or not 0 < o - t <= s.seconds else o - t
                        for s, t, o in zip(self._samples, self._t, run.t_out)]
        #: the real scheduler's clock readings (run clock): in each step's schedule() and
        #: update_from_output(), in each call's add_request() (:meth:`scheduler_now`)
        self._t_sched, self._t_update, self._t_added = run.t_sched, run.t_update, run.t_added
        self.reads_clock = any(t is not None for t in run.t_sched)
        self._fixed: float | None = None  # the reading of the add_request()/update_from_output() in progress
        self._in_step: int | None = None  # the step whose policy hooks run (begun, not ended)
        self._charged: int | None = None  # the step charged last, until its update_from_output()
        self._where = {rid: (i, k) for i, rids in enumerate(self._added) for k, rid in enumerate(rids)}
        self._taken: set[str] = set()
        self._here: set[str] = set()  # the calls that reached the engine and wait to be taken in
        self._waited = -1  # the step that waits for a late call, and until when
        self._wait_until = 0.0
        self.recorded_cost = recorded_cost_model(path)
        #: when each root of the recorded run arrived (run clock), from its events.jsonl
        self.arrivals = recorded_arrivals(path)
        #: the next recorded control tick's index and the one armed
        self._k = 0
        self._tick: _Tick | None = None
        self._ticks_run = self._ticks_moved = 0
        self._ticks_moved_max = 0.0
        #: loop time at which each sim step ends (the engine's loop, set by attach)
        self._ends: list[float] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._clock: Any = None
        self._sched: Any = None
        #: the engine's reading as the step before the one in flight left it, and the calls taken in
        #: since (they are not in a real engine's reading until its next step)
        self._begun: Any = None
        self._taken_since = 0
        #: outputs handed over after their step's end (at the recorded ``seen``), and the longest wait
        self._outputs_late = 0
        self._outputs_late_max = 0.0

    def cost_model(self) -> CostModel:
        """The cost model the recorded run's policies priced with, else the profile's."""
        return self.recorded_cost if self.recorded_cost is not None else self._profile.cost_model()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._profile, name)

    def step_seconds(self, prefill, decode) -> float:
        i = self._next
        self._next += 1
        if i >= len(self._samples):
            dt = self._profile.step_seconds(prefill, decode)
            self._started(i, dt)
            return dt
        s = self._samples[i]
        dt = self._charge[i]
        self._charged = i
        self._started(i, dt)
        # the same batch: the same chunks and decodes, in any order (a step's time does not depend on it;
        # the decode fast-forward lists its decodes before a policy's step hook orders them)
        if sorted(tuple(p) for p in prefill) != sorted(s.prefill) or sorted(decode) != sorted(s.decode):
            self._mismatches += 1
            if self._first_mismatch is None:
                self._first_mismatch = {"step": i, "recorded": {"prefill": s.prefill, "decode": s.decode},
                                        "sim": {"prefill": [tuple(p) for p in prefill], "decode": list(decode)}}
        return dt

    def _started(self, i: int, dt: float) -> None:
        """Sim step ``i`` starts now and takes ``dt``: its window for the control ticks, and a loop timer
        at its end when the next recorded step takes in a call that is not here yet or starts later
        than that end (a fast-forward run stops at a timer, so that step is not run before the wait
        :meth:`before_step` asks for)."""
        loop = self._loop
        if loop is None:
            return
        now = loop.time()
        self._ends.append(now + dt)
        nxt = i + 1
        if nxt < len(self._added):
            start = self._t[nxt]
            if (any(r not in self._taken for r in self._added[nxt])
                    or start is not None and start > self._clock() + dt + START_SLACK_S):
                loop.call_at(now + dt, _noop)
        if self._tick is not None:
            self._arm()

    def hold(self, request_id: str) -> bool:
        """Whether the real engine took this call in before a later step than the next one."""
        where = self._where.get(request_id)
        return where is not None and where[0] > self._next

    def held(self, arrived: list[str], busy: bool) -> set[str]:
        """Of the calls that reached the engine now (``arrived``), those it keeps back: all of them
        until the next step's recorded start (``t``: the real engine took its calls in at the end of
        the step before, or on waking, right before it; a policy stamps a call's arrival, and
        releases expired retention, then); on a busy engine, the calls the real engine took in
        before a later step than the next one (:meth:`hold`); and the calls the real engine took in
        before the next step behind a call that is not here yet, until the step's wait for it ends
        (:meth:`awaits`). vLLM's waiting queue keeps the order calls are added in, so two calls whose
        tools end within a step of each other in another order than the real run's would otherwise
        be scheduled the other way round (a chunk budget split the other way)."""
        i = self._next
        self._here = here = set(arrived)
        if i >= len(self._added):
            return set()
        if self._waited == i and self._loop is not None and self._loop.time() >= self._wait_until:
            return {r for r in arrived if self.hold(r)} if busy else set()  # the wait is over
        t = self._t[i]
        if t is not None and self._clock is not None and t - self._clock() > START_SLACK_S:
            return here
        out = {r for r in arrived if self.hold(r)} if busy else set()
        behind = False
        for r in self._added[i]:
            if r in self._taken:
                continue
            if r not in here:
                behind = True
            elif behind:
                out.add(r)
        return out

    def order(self, request_id: str) -> tuple[int, int]:
        """Where the real engine took this call in (step, position); calls it never saw last."""
        return self._where.get(request_id, (len(self._added), 0))

    def took(self, request_id: str) -> None:
        """The sim took this call in (before its next step)."""
        self._taken.add(request_id)
        self._taken_since += 1

    async def before_step(self, wake: asyncio.Event) -> bool:
        """Wait, before the next step, for what the recorded run's engine waited for (True: it waited,
        and the engine takes in what arrived and asks again): a call it took in before this step that
        is not here yet (:meth:`awaits`: until it arrives, at most ``ARRIVAL_WAIT_S``), or the
        step's recorded start (``t``) while that is later than now. An idle real engine starts its
        step a little after a call arrives, later on a loaded machine, and a policy that reads the
        clock (MLFQ levels, retention expiry) decides by it: after an idle spell the replay starts
        each step when the real one started (busy, its steps follow each other as the recorded
        ones did)."""
        left = self.awaits()
        if left > 0:
            wake.clear()
            try:
                await asyncio.wait_for(wake.wait(), left)
            except TimeoutError:
                pass
            return True
        i = self._next
        t = self._t[i] if i < len(self._t) else None
        if t is not None:
            wait = t - self._clock()
            if wait > START_SLACK_S:
                await asyncio.sleep(wait)
                return True
        return False

    def awaits(self) -> float:
        """How long (virtual seconds) the next step still waits for a call the real engine took in
        before it that has not arrived here: until ``ARRIVAL_WAIT_S`` after the step first waited
        (other calls arriving meanwhile do not end the wait), then it runs without it (0)."""
        i = self._next
        if i >= len(self._added) or all(r in self._taken or r in self._here for r in self._added[i]):
            return 0.0
        now = self._loop.time() if self._loop is not None else 0.0
        if self._waited != i:
            self._waited, self._wait_until = i, now + self.arrival_wait_s
        return max(0.0, self._wait_until - now)

    def hand_over(self, request_id: str, future: asyncio.Future, result: Any) -> None:
        """A finished call's result, handed to the driver when the recorded run's driver saw it
        (``seen``: its output's hand-off to the driver's thread, a little after its step's end, more on
        a loaded machine), else now. What the driver does then (a tool's start, a workflow's end and
        the admission it frees) happens at the recorded moment: against the control ticks and the
        next steps, as in the recorded run."""
        at = self._seen.get(request_id)
        loop = self._loop
        if at is not None and loop is not None:
            when = loop.time() - self._clock() + at
            late = when - loop.time()
            if late > 0:
                self._outputs_late += 1
                self._outputs_late_max = max(self._outputs_late_max, late)
                loop.call_at(when, _resolve, future, result)
                return
        _resolve(future, result)

    # -- the control loop's ticks ---------------------------------------------------------------------
    def attach(self, backend: Any) -> None:
        """The sim engine starts (on its loop): ticks are timed on that loop, and the engine's reading
        is kept as the real engine's stepper hands it to the driver, a snapshot of the state the last
        step left, taken here where the next step begins, before anything of it (the policy's step
        start, retention expiry, allocations) changes the state."""
        from vllm_mars.admission.telemetry import scheduler_reading

        self._loop = asyncio.get_running_loop()
        self._clock = backend.clock
        s = self._sched = backend.scheduler
        begin = s._mars_begin_step

        def begin_step(now: float) -> None:
            self._begun = self._adjusted(scheduler_reading(s, self._clock()))
            self._taken_since = 0
            self._in_step, self._charged = self._next, None
            begin(now)

        s._mars_begin_step = begin_step
        if not self.reads_clock:
            return
        # the scheduler's clock reads what the real one read (scheduler_now): where, it learns here
        end, add, update = s._mars_end_step, s.add_request, s.update_from_output

        def end_step(out: Any, now: float) -> None:
            try:
                end(out, now)
            finally:
                self._in_step = None

        def add_request(request: Any) -> None:
            self._fixed = self._t_added.get(request.request_id)
            try:
                add(request)
            finally:
                self._fixed = None

        def update_from_output(scheduler_output: Any, model_output: Any) -> Any:
            i, self._charged = self._charged, None
            self._fixed = self._t_update[i] if i is not None and i < len(self._t_update) else None
            try:
                return update(scheduler_output, model_output)
            finally:
                self._fixed = None

        s._mars_end_step, s.add_request, s.update_from_output = end_step, add_request, update_from_output
        s.set_clock(_SchedulerClock(self.scheduler_now))

    def scheduler_now(self) -> float:
        """The sim scheduler's clock (loop time) on a recording of the real scheduler's readings: in a
        call's ``add_request()`` what the real one read there (``t_added``), in a step's
        ``update_from_output()`` its ``t_update``, and otherwise, from the recorded start of the step
        it is about to schedule or is scheduling (``t``), that step's ``t_sched``: the engine's own
        work before ``schedule()`` and its output processing after ``update_from_output()`` (tens of
        microseconds, milliseconds on a loaded machine) are not in the loop's step times, and a
        retention that expires within them, or an MLFQ level's aging, decided by them. Elsewhere
        (before a step's recorded start, past the recording) the loop's time."""
        loop_now, run_now = self._loop.time(), self._clock()
        r = self._fixed
        if r is None:
            i = self._next if self._in_step is None else self._in_step
            r = self._t_sched[i] if i < len(self._t_sched) else None
            if r is None:
                return loop_now
            t = self._t[i]
            if t is not None and run_now < t - START_SLACK_S:
                return loop_now
        return loop_now - run_now + r

    def _adjusted(self, r: Any) -> Any:
        return replace(r, waiting=r.waiting - self._taken_since) if self._taken_since and r.waiting else r

    def reading(self) -> Any:
        """The engine's reading now: the state the last step left (while a step runs, as the step before
        it left it), without the calls taken in since."""
        from vllm_mars.admission.telemetry import scheduler_reading

        if self._ends and self._loop.time() < self._ends[-1] and self._begun is not None:
            return self._begun
        return self._adjusted(scheduler_reading(self._sched, self._clock()))

    @property
    def has_ticks(self) -> bool:
        return bool(self._ticks)

    def next_tick(self) -> asyncio.Future | None:
        """A future that the next recorded control tick's place resolves with the age of the reading
        it read (None: no recorded tick is left). The place: at its recorded run-clock time, moved
        into its window when the sim's steps put that time outside: after the run step it read has
        ended, before the next one ends."""
        if self._k >= len(self._ticks) or self._loop is None:
            return None
        line, at, age = self._ticks[self._k]
        self._k += 1
        loop = self._loop
        self._tick = _Tick(line, at, age, loop.create_future())
        self._arm()
        return self._tick.waiter

    def _arm(self) -> None:
        t = self._tick
        line = t.line
        base = self._loop.time() - self._clock()  # the run start on the loop's clock
        t.want = base + t.at
        if line == 0:
            lo = base
        elif line - 1 < len(self._ends):  # the step it read has started (and its end is known)
            lo = self._ends[line - 1] + TICK_MARGIN_S
        else:
            return  # armed when that step starts
        due = max(t.want, lo, self._loop.time())
        if line < len(self._ends) and due > self._ends[line] - TICK_MARGIN_S:  # the next step ends first
            due = max(lo, self._ends[line] - TICK_MARGIN_S)
        if t.handle is not None:
            if t.handle.when() == due:
                return
            t.handle.cancel()
        t.handle = self._loop.call_at(due, self._fire, t)

    def _fire(self, t: _Tick) -> None:
        if self._tick is t:
            self._tick = None
        self._ticks_run += 1
        shift = abs(self._loop.time() - t.want)
        if shift > 1e-9:
            self._ticks_moved += 1
            self._ticks_moved_max = max(self._ticks_moved_max, shift)
        if not t.waiter.done():
            t.waiter.set_result(t.age)

    def trace_stats(self) -> dict[str, Any]:
        """Recorded steps, sim steps charged, batches that differed and the first of them (None: every
        recorded step's batch was the sim's)."""
        return {"file": self.path, "recorded_steps": len(self._samples), "sim_steps": self._next,
                "mismatched_steps": self._mismatches, "first_mismatch": self._first_mismatch,
                "cost_model": "recorded" if self.recorded_cost is not None else "profile",
                "recorded_ticks": len(self._ticks), "ticks_run": self._ticks_run,
                "ticks_moved": self._ticks_moved, "ticks_moved_max_s": round(self._ticks_moved_max, 6),
                "outputs_late": self._outputs_late, "outputs_late_max_s": round(self._outputs_late_max, 6)}


def recorded_cost_model(steps_path: str) -> CostModel | None:
    """The cost model of the run that recorded ``steps_path``: ``run_start``'s ``cost_model`` in the
    ``events.jsonl`` beside it (None: no such file, or the run priced without one)."""
    events = Path(steps_path).with_name("events.jsonl")
    if not events.is_file():
        return None
    for d in read_jsonl(events):
        if isinstance(d, dict) and d.get("event") == "run_start":
            cost = d.get("cost_model")
            return None if cost is None else CostModel.from_dict(cost, where=f"{events}: run_start.cost_model")
    return None


def recorded_arrivals(steps_path: str) -> dict[str, float]:
    """When each root of the run that recorded ``steps_path`` arrived (run-clock seconds): the
    ``workflow_arrive`` events of the ``events.jsonl`` beside it ({}: no such file). A real run's
    arrival timer overshoots its target (by a millisecond, more on a loaded machine), which decides
    whether a root arrives before or after a control tick or a step."""
    events = Path(steps_path).with_name("events.jsonl")
    if not events.is_file():
        return {}
    out: dict[str, float] = {}
    for d in read_jsonl(events):
        if isinstance(d, dict) and d.get("event") == "workflow_arrive" and isinstance(d.get("ts"), (int, float)):
            out[str(d.get("workflow"))] = float(d["ts"])
    return out

