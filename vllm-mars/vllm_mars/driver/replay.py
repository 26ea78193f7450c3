"""``Replay``: one run's loop. Roots arrive by the arrival process and are offered to the admission
controller; admitted roots run as one asyncio task each (children as their own tasks, sharing the
root's slot). A call's prompt is token ids that grow turn by turn (turn k = turn k-1 + its actual
output + the tool output); each call generates exactly the recorded output length (``ignore_eos``).
Tools run on the tool plane after each call. A control loop feeds the controller telemetry every
``interval_s`` and ticks it; a sampler logs ``kv_sample`` events and drives the progress bar.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

from vllm_mars.admission.base import PendingRoot, Telemetry
from vllm_mars.costmodel import CostModel
from vllm_mars.driver.clock import RunClock
from vllm_mars.driver.config import ReplayConfig, RunPlan
from vllm_mars.driver.live import run_live
from vllm_mars.driver.progress import Progress
from vllm_mars.driver.tools import make_tool_plane, parse_cpu_list
from vllm_mars.metrics.events import EventLog
from vllm_mars.metrics.ideal import ideal_time
from vllm_mars.workload.materialize import cycle_roots

logger = logging.getLogger(__name__)


def select_plans(plans: list, n: int | None) -> list:
    """The first ``n`` roots, cycling the file with ids suffixed ``~k`` on the k-th repeat. Token
    workloads are cycled before their ids are drawn (``load_plans(num_workflows=...)``: a repeat has
    its own tokens); this renames already-built plans (live tasks: a repeat has the same text)."""
    def renamed(p, suffix, root, parent):
        wid = p.workflow_id + suffix
        kids = [(k, renamed(c, suffix, root, wid)) for k, c in p.children]
        return replace(p, workflow_id=wid, root_id=root, parent_id=parent, children=kids)

    return cycle_roots(plans, n, lambda p, suffix: renamed(p, suffix, p.workflow_id + suffix, None))


def check_context(plans: list, max_model_len: int) -> None:
    for root in plans:
        for p in root.walk():
            peak = getattr(p, "peak_context_tokens", None)  # token plans (compaction: not the last call)
            need = peak() if peak else p.final_prompt_tokens() + (p.turns[-1].output_tokens if p.turns else 0)
            if need > max_model_len:
                raise ValueError(f"workflow {p.workflow_id!r} reaches {need} tokens of context, above "
                                 f"max_model_len={max_model_len}; raise --max-model-len or scale the workload down")


class Replay:
    """One run's state (see the module docstring)."""

    def __init__(self, plan: RunPlan | ReplayConfig, out: Path, backend, plans: list, arrivals: list[float],
                 clock: RunClock, cost: CostModel | None) -> None:
        """``plan``: the run's plan (a ReplayConfig is resolved here, for tests that build a Replay)."""
        self.plan = plan = plan if isinstance(plan, RunPlan) else RunPlan.of(plan)
        self.cfg = cfg = plan.cfg
        self.out = out
        self.backend = backend
        self.plans = {p.workflow_id: p for p in plans}
        self.order = [p.workflow_id for p in plans]
        self.arrivals = dict(zip(self.order, arrivals))
        self.clock = clock
        self.cost = cost
        self.policy = plan.policy
        self.ctrl = plan.controller(cost)
        bind = getattr(backend, "bind_controller", None)  # a sim cluster: one controller per replica
        if bind is not None:
            self.ctrl = bind(self.ctrl, lambda: plan.controller(cost),
                             lambda wid: getattr(self.plans.get(wid), "initial_ids", None))
        cores = parse_cpu_list(cfg.cpu_tool)
        self.tools = make_tool_plane(cfg.tools, clock, root=out / "workspaces", cores=cores,
                                     timeout_s=cfg.tool_timeout_s, sandbox=cfg.sandbox, net_allow=cfg.tool_net_allow)
        self.events = EventLog(out / "events.jsonl", clock)
        self.traces = open(out / "traces.jsonl", "w", buffering=1)  # noqa: SIM115 - closed in run()
        self.progress = Progress(len(plans), cfg.policy, cfg.progress)
        self.sample_interval = plan.sample_interval_s
        self.call_timeout = plan.call_timeout_s
        self.tasks: set[asyncio.Task] = set()
        self.remaining = len(plans)
        self.all_done = asyncio.Event()
        self.hit = [0, 0]  # recent cached, prompt tokens for the telemetry's prefix hit rate
        self.arrivals_actual: dict[str, float] = {}
        #: (tokenizer, LiveOptions) when the workload is mas_task_v1 (live agents), else None
        self.live: tuple | None = None

    # -- admission ----------------------------------------------------------------------------------
    def _flush_admission(self) -> None:
        for ev in self.ctrl.take_events():
            data = {k: v for k, v in ev.data.items() if k not in ("ts", "event")}
            self.events.emit(ev.event, ts=ev.ts, **data)

    def _tick(self) -> None:
        now = self.clock()
        for wid in self.ctrl.tick(now):
            self.events.emit("workflow_start", workflow=wid, root=wid,
                             admission_wait_s=round(now - self.arrivals_actual[wid], 6))
            self._spawn(self._run_root(wid))
        self._flush_admission()

    def _spawn(self, coro) -> asyncio.Task:
        t = asyncio.create_task(coro)
        self.tasks.add(t)
        t.add_done_callback(self.tasks.discard)
        return t

    def _reading_ts(self, s: Telemetry) -> float:
        """The run-clock time of an engine reading. A backend caches its latest reading, and the one
        it holds when the run starts was taken on the clock before its restart (the calibration's
        last step: seconds later than the run's now). A reading can never be newer than now, so that
        one counts as now (the engine refreshes it within a step or an idle wait). Kept as stamped,
        the controller held it as its newest telemetry, rejected every real reading as older until
        the run clock caught up (3.5 s into the embedded default), and then measured every block
        evicted so far as one interval's rebuilds."""
        now = self.clock()
        return now if s.ts == 0.0 or s.ts > now else s.ts

    def _telemetry(self, age: float | None = None) -> Telemetry:
        """The controller's reading: the engine's, the driver's hit rate and the tool plane. ``age``: a
        step-trace replay's tick, stamped as old as the recorded tick's reading was."""
        s = self.backend.sample()
        ts = self.tools.stats()
        cached, prompt = self.hit
        # A tool plane without a worker count (simulated tools and no CPU_TOOL) has no CPU capacity
        # to run out of: the recorded tool times already hold any contention. Report no CPU signal
        # rather than "n tools on an unknown number of cores".
        cpu = ts.workers is not None
        # Every engine field passes through (waiting, retained blocks and preemptions were once
        # dropped here, so a controller never saw calls queued in the engine); the driver adds its
        # own clock, the hit rate of the calls it saw and the tool plane.
        stamp = self._reading_ts(s) if age is None else self.clock() - age
        return replace(s, ts=stamp, prefix_hit_rate=(cached / prompt) if prompt else None,
                       tools_in_flight=ts.in_flight if cpu else None, tool_workers=ts.workers,
                       tool_queue_wait_s=ts.ema_queue_wait_s if cpu else None)

    async def _arrivals(self) -> None:
        for wid in sorted(self.order, key=lambda w: self.arrivals[w]):
            delay = self.arrivals[wid] - self.clock()
            if delay > 0:
                await asyncio.sleep(delay)
            plan = self.plans[wid]
            now = self.clock()
            self.arrivals_actual[wid] = now
            t_ideal = ideal_time(plan, self.cost) if self.cost else None
            self.events.emit("workflow_arrive", workflow=wid, root=wid, target_ts=round(self.arrivals[wid], 6),
                             prefill_tokens=plan.prefill_estimate, turns=plan.num_turns,
                             children=sum(1 for _ in plan.walk()) - 1,
                             t_ideal_s=None if t_ideal is None else round(t_ideal, 6))
            self.ctrl.offer(PendingRoot(wid, now, plan.prefill_estimate, {"turns": plan.num_turns}))
            self._tick()

    async def _control(self) -> None:
        """Feed the controller a reading and tick it every ``interval_s``. A run recording its steps
        notes where each tick ran (``InProcessBackend.note_control_tick``); a step-trace replay
        ticks where the recorded run's loop ticked instead (``StepTrace.next_tick``: at its time,
        between the same steps, on a reading as old), then on the timer past the last."""
        trace = getattr(self.backend, "recorded_ticks", None)
        trace = trace() if trace is not None else None
        if trace is not None:
            await self._control_traced(trace)
        note = getattr(self.backend, "note_control_tick", None)
        while not self.all_done.is_set():
            t = self._telemetry()
            if note is not None:
                note(self.clock(), t.ts)
            self.ctrl.observe(t)
            self._tick()
            try:
                await asyncio.wait_for(self.all_done.wait(), self.ctrl.interval_s)
            except TimeoutError:
                pass

    async def _control_traced(self, trace) -> None:
        """The control loop's recorded ticks (see ``_control``); returns past the last one, an
        interval after it, or when the run is done."""
        done = asyncio.ensure_future(self.all_done.wait())
        try:
            while not self.all_done.is_set():
                due = trace.next_tick()
                if due is None:  # past the recorded ticks: the controller's own timer from here
                    await asyncio.wait((done,), timeout=self.ctrl.interval_s)
                    return
                await asyncio.wait((due, done), return_when=asyncio.FIRST_COMPLETED)
                if not due.done():
                    due.cancel()
                    return
                self.ctrl.observe(self._telemetry(due.result()))
                self._tick()
        finally:
            done.cancel()

    def _sample(self) -> None:
        s = self.backend.sample()
        tstats = self.tools.stats()
        engine = {k: v for k, v in s.as_dict().items() if k != "ts"}
        self.events.emit("kv_sample", engine_ts=round(self._reading_ts(s), 6), **engine, active=self.ctrl.num_active,
                         queued=self.ctrl.num_queued, tools_in_flight=tstats.in_flight)
        self.progress.status(self.ctrl.num_active, self.ctrl.num_queued, s.kv_usage, self.clock())

    async def _sampler(self) -> None:
        while not self.all_done.is_set():
            self._sample()
            try:
                await asyncio.wait_for(self.all_done.wait(), self.sample_interval)
            except TimeoutError:
                pass

    # -- workflows ----------------------------------------------------------------------------------
    async def _run_root(self, wid: str) -> None:
        plan = self.plans[wid]
        final_tokens = None
        try:
            if self.live is not None:
                final_tokens = await run_live(self, plan, *self.live)
            else:
                final_tokens = await self._run_workflow(plan)
            self.events.emit("workflow_done", workflow=wid, root=wid, root_done=True,
                             e2e_s=round(self.clock() - self.arrivals_actual[wid], 6))
        except Exception as e:  # noqa: BLE001 - one workflow's failure is recorded, the run goes on
            logger.warning("workflow %s failed: %r", wid, e)
            self.events.emit("workflow_error", workflow=wid, root=wid, root_done=True, error=repr(e)[:500])
        finally:
            self.ctrl.finish(wid, self.clock(), final_tokens=final_tokens)
            end = getattr(self.backend, "end_root", None)  # a sim cluster releases the root's replica
            if end is not None:
                end(wid)
            self.remaining -= 1
            self.progress.done()
            if self.remaining == 0:
                self.all_done.set()
            else:
                self._tick()

    async def _run_workflow(self, plan) -> int:
        """Run ``plan``'s calls, tools and children; returns its final context length in tokens."""
        wid, root = plan.workflow_id, plan.root_id
        t_start = self.clock()
        if plan.parent_id is not None:
            self.events.emit("workflow_start", workflow=wid, root=root, parent=plan.parent_id)
        prompt = list(plan.initial_ids)
        rounds: list[dict] = []
        waiting_kids: list[asyncio.Task] = []
        other_kids: list[asyncio.Task] = []
        error = None
        try:
            last = len(plan.turns) - 1
            for k, turn in enumerate(plan.turns):
                if waiting_kids:
                    await asyncio.gather(*waiting_kids)
                    waiting_kids = []
                if k:
                    if getattr(turn, "keep_tokens", None) is not None:  # schema v2 compaction: restart
                        prompt = prompt[: turn.keep_tokens] + turn.summary_ids
                    prompt += turn.appended_ids
                prev_tool = plan.turns[k - 1].tool_name if k else None
                extra = {"mars_workflow": wid, "mars_root": root, "mars_turn": k, "mars_last_step": k == last,
                         "mars_prefill_tokens": len(prompt)}
                if plan.parent_id is not None:
                    extra["mars_parent"] = plan.parent_id
                if prev_tool:
                    extra["mars_tool"] = prev_tool
                if turn.tool_name and k < last:  # replay's stand-in for parsing the output's tool call
                    extra["mars_next_tool"] = turn.tool_name
                rid = f"{wid}:t{k}"
                submit = self.clock()
                if plan.parent_id is None and k:
                    self.ctrl.update_estimate(wid, len(prompt), submit)
                self.events.emit("call_submit", ts=submit, workflow=wid, root=root, turn=k, request_id=rid,
                                 prompt_tokens=len(prompt), max_tokens=turn.output_tokens)
                res = await asyncio.wait_for(self.backend.generate(rid, prompt, turn.output_tokens, extra),
                                             self.call_timeout)
                ttft = None if res.first_token_ts is None else res.first_token_ts - submit
                if res.first_token_ts is not None:
                    self.events.emit("call_first_token", ts=res.first_token_ts, workflow=wid, root=root, turn=k,
                                     request_id=rid, ttft_s=round(ttft, 6))
                self.events.emit("call_end", ts=res.end_ts, workflow=wid, root=root, turn=k, request_id=rid,
                                 prompt_tokens=res.prompt_tokens, cached_tokens=res.cached_tokens,
                                 output_tokens=len(res.output_ids), ttft_s=None if ttft is None else round(ttft, 6),
                                 latency_s=round(res.end_ts - submit, 6), finish_reason=res.finish_reason)
                if plan.parent_id is None and k == 0 and res.cached_tokens is not None:
                    self.ctrl.observe_cached(wid, res.cached_tokens)
                if res.cached_tokens is not None:
                    self.hit = [self.hit[0] * 0.9 + res.cached_tokens, self.hit[1] * 0.9 + res.prompt_tokens]
                if len(res.output_ids) != turn.output_tokens:
                    raise RuntimeError(f"{rid}: got {len(res.output_ids)} output tokens, asked for {turn.output_tokens}")
                rec: dict[str, Any] = {"turn": k, "request_id": rid, "submit_ts": submit,
                                       "first_token_ts": res.first_token_ts, "end_ts": res.end_ts, "ttft_s": ttft,
                                       "latency_s": res.end_ts - submit, "prompt_tokens": res.prompt_tokens,
                                       "cached_tokens": res.cached_tokens, "output_tokens": len(res.output_ids)}
                prompt += res.output_ids
                for after, child in plan.children:
                    if after == k:
                        task = self._spawn(self._run_workflow(child))
                        (waiting_kids if getattr(child, "parent_waits", True) else other_kids).append(task)
                if turn.tool_s > 0 or turn.tool_cmd:
                    rec["tool"] = await self._tool(plan, k, turn)
                rounds.append(rec)
            await asyncio.gather(*waiting_kids, *other_kids)
            return len(prompt)
        except Exception as e:
            error = repr(e)[:500]
            for t in waiting_kids + other_kids:
                t.cancel()
            raise
        finally:
            end = self.clock()
            trace = {"workflow": wid, "root": root, "parent": plan.parent_id, "start_ts": t_start, "end_ts": end,
                     "arrival_ts": self.arrivals_actual.get(wid), "rounds": rounds, "error": error,
                     "context_tokens": len(prompt)}
            if plan.parent_id is None:
                trace["e2e_s"] = end - self.arrivals_actual[wid]
            else:
                self.events.emit("workflow_done" if error is None else "workflow_error", workflow=wid, root=root,
                                 parent=plan.parent_id, root_done=False, **({"error": error} if error else {}))
            self.traces.write(json.dumps(trace, separators=(",", ":")) + "\n")

    async def _tool(self, plan, k: int, turn) -> dict[str, Any]:
        wid, root = plan.workflow_id, plan.root_id
        self.events.emit("tool_enqueue", workflow=wid, root=root, turn=k, tool=turn.tool_name)
        r = await self.tools.run(wid, k, turn.tool_name, turn.tool_cmd, turn.tool_s)
        self.events.emit("tool_start", ts=r.start_ts, workflow=wid, root=root, turn=k, tool=turn.tool_name,
                         core=r.core)
        self.events.emit("tool_end", ts=r.end_ts, workflow=wid, root=root, turn=k, tool=turn.tool_name,
                         rc=r.rc, timed_out=r.timed_out, wait_s=round(r.wait_s, 6),
                         duration_s=round(r.duration_s, 6), sandbox=r.sandbox)
        return {"tool": turn.tool_name, "enqueue_ts": r.enqueue_ts, "start_ts": r.start_ts, "end_ts": r.end_ts,
                "wait_s": r.wait_s, "duration_s": r.duration_s, "recorded_s": turn.tool_s, "rc": r.rc,
                "timed_out": r.timed_out, "sandbox": r.sandbox, "stdout_tail": r.stdout_tail,
                "stderr_tail": r.stderr_tail}

    async def run(self) -> None:
        self.events.emit("run_start", epoch=self.clock.epoch, policy=self.cfg.policy,
                         scheduler_policy=self.policy.scheduler_policy, controller=self.policy.controller,
                         backend=self.cfg.backend, workload=self.cfg.workload, rps=self.cfg.rps,
                         arrival=self.cfg.arrival, workflows=len(self.order), tools=self.cfg.tools,
                         sandbox=getattr(self.tools, "sandbox", None),
                         sandbox_protections=getattr(self.tools, "protections", None),
                         t_ideal_source=self.cost.source if self.cost else None,
                         cost_model=self.cost.as_dict() if self.cost else None)
        self._sample()
        workers = [asyncio.create_task(c) for c in (self._arrivals(), self._control(), self._sampler())]
        done_wait = asyncio.create_task(self.all_done.wait())
        try:
            # A worker that raises ends the run with its error (waiting on all_done alone would hang).
            pending: set[asyncio.Task] = {done_wait, *workers}
            while not self.all_done.is_set():
                finished, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for t in finished:
                    if t is not done_wait and t.exception() is not None:
                        raise t.exception()
            await asyncio.gather(*workers)
        finally:
            for w in (*workers, done_wait):
                w.cancel()
            for t in list(self.tasks):
                t.cancel()
            self._sample()
            self.progress.close()
            await self.tools.close()
            self.traces.close()
