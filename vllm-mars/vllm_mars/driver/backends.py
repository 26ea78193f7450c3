"""Engines behind the ``Backend`` protocol (:mod:`vllm_mars.backend`): the in-process vLLM engine and an OpenAI HTTP server.

Both take token-id prompts (so lengths are exact and shared prefixes really are shared), generate
exactly ``max_tokens`` tokens (``ignore_eos``), carry the workflow metadata as ``extra_args`` /
``vllm_xargs`` (``mars_*`` keys, see ``vllm_mars.workflow``) and report engine state samples for
telemetry and metrics.

In-process: vLLM 0.32's ``AsyncLLM`` always runs the engine core in a child process (in-process
asyncio mode raises NotImplementedError), which hides the scheduler. The driver wants telemetry
straight from the scheduler, so this backend runs ``LLMEngine`` with
``VLLM_ENABLE_V1_MULTIPROCESSING=0`` on a dedicated stepper thread: requests go in through a
command queue, outputs come back to the asyncio loop with ``call_soon_threadsafe``, and the
scheduler (``engine.engine_core.engine_core.scheduler``) is sampled after every step.

Why one module of about 490 lines: both classes are the driver's two implementations of one
``Backend`` protocol with the request conventions above (token ids, ``ignore_eos``, ``mars_*``
metadata, engine samples), kept side by side so they stay alike; if it grows, the split is
in-process / HTTP, one module each.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import queue
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from vllm_mars.admission.base import Telemetry
from vllm_mars.admission.telemetry import (
    EngineSample,
    MetricsError,
    metric_sum,
    parse_prometheus,
    scheduler_reading,
    scheduler_sample,
    telemetry_from_metrics,
)
from vllm_mars.backend import CallResult
from vllm_mars.engine.local import (
    DRIVER_MAX_MODEL_LEN,
    DRIVER_MAX_NUM_BATCHED_TOKENS,
    DRIVER_MAX_NUM_SEQS,
    engine_kwargs,
)

logger = logging.getLogger(__name__)


class InProcessBackend:
    """vLLM's ``LLMEngine`` with MarsScheduler in this process, stepped on its own thread."""

    name = "inprocess"

    def __init__(self, model: str, clock: Callable[[], float], *, policy: str = "fcfs",
                 policy_options: Mapping[str, Any] | None = None, num_blocks: int | None = None,
                 block_size: int | None = None, max_model_len: int = DRIVER_MAX_MODEL_LEN,
                 max_num_seqs: int = DRIVER_MAX_NUM_SEQS, max_num_batched_tokens: int = DRIVER_MAX_NUM_BATCHED_TOKENS,
                 seed: int = 0, record_steps: bool = False, **engine_extra: Any) -> None:
        """Engine settings as :func:`vllm_mars.engine.local.engine_kwargs` takes them (None: its defaults)."""
        self.model = model
        self.clock = clock
        #: with record_steps: (prefill, decode, seconds, request ids added before it) of every engine
        #: step (seconds: its whole cycle in the stepper loop), for `mars profile --from-steps` and
        #: `mars replay --step-trace`
        self.step_times: list[tuple[list, list, float, list[str]]] | None = [] if record_steps else None
        #: index in step_times of the run's first step (the ones before it are the calibration's)
        self.run_first_step = 0
        #: with record_steps: the driver's control-loop ticks, (steps recorded when the reading it read
        #: was taken, the tick's run-clock time, the reading's age)
        self.control_ticks: list[tuple[int, float, float]] = []
        #: with record_steps: the run-clock time each step of ``step_times`` started, and the one its
        #: outputs were stamped with (its ``engine.step()`` returned; the rest of its cycle follows)
        self.step_starts: list[float] = []
        self.step_outputs: list[float] = []
        #: with record_steps: per step of ``step_times``, when the engine core entered the scheduler (run
        #: clock; the scheduler reads its own clock there): its ``schedule()``, its ``update_from_output()``,
        #: and each call's ``add_request()`` (in the order of the step's request ids added before it)
        self.step_clock: list[tuple[float | None, float | None, list[float | None]]] = []
        #: with record_steps: (step of ``step_times``, request id, run-clock time) of each finished call's
        #: output as the driver saw it (the hand-off to the asyncio thread and the caller's wake-up: later
        #: than the step's output stamp, by milliseconds on a loaded machine)
        self.outputs_seen: list[tuple[int, str, float]] = []
        self._recorder = None
        self.kwargs = dict(policy=policy, policy_options=dict(policy_options or {}), num_blocks=num_blocks,
                           block_size=block_size, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                           max_num_batched_tokens=max_num_batched_tokens, seed=seed, **engine_extra)
        self.vocab_size: int | None = None
        self.engine = None
        self.scheduler = None
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pending: dict[str, tuple[asyncio.Future, dict[str, Any]]] = {}
        #: the latest reading and how many recorded steps it shows: one tuple, so a reading and its
        #: place are read together off the stepper thread
        self._read: tuple[Telemetry, int] = (EngineSample(0.0), 0)
        self._seen = 0  # with record_steps: steps recorded so far (closed or pending; the stepper's)
        self._last_read = self._read
        self._stats: dict[str, Any] = {}
        self._error: BaseException | None = None

    async def start(self) -> None:
        if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") != "0":
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        # vllm is imported here, not at the top: only an engine that starts pays for it (seconds), and
        # only after VLLM_ENABLE_V1_MULTIPROCESSING=0 is set above (vllm reads it at import)
        from vllm.engine.arg_utils import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine

        kw = engine_kwargs(self.model, disable_log_stats=True, kv_events=True, **self.kwargs)
        self.engine = LLMEngine.from_engine_args(EngineArgs(**kw))
        core = getattr(self.engine.engine_core, "engine_core", None)
        if core is None:
            raise RuntimeError("the in-process backend needs VLLM_ENABLE_V1_MULTIPROCESSING=0 set before vllm "
                               "is imported (the engine core runs in another process)")
        self.scheduler = core.scheduler
        if self.step_times is not None:
            from vllm_mars.engine.steps import StepRecorder  # imports vllm (through engine.rig)

            self._recorder = StepRecorder(self.scheduler, clock=self.clock)
        self.vocab_size = self.engine.model_config.get_vocab_size()
        self._snapshot()
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="mars-engine-stepper", daemon=True)
        self._thread.start()

    # -- the stepper thread -----------------------------------------------------------------------
    def _run(self) -> None:
        from vllm import SamplingParams  # vllm: see start()
        from vllm.sampling_params import RequestOutputKind

        engine = self.engine
        # record_steps: each step's batch and its whole cycle in this loop (the step, the snapshot and
        # the output hand-off, and the next arrivals' add_request), ending where the next step starts
        # or where the loop goes idle; and the requests added to the engine before it (since the last
        # recorded step): where the real engine took each arrival, which a trace replay follows
        pending: tuple[list, list, float, list[str]] | None = None
        added: list[str] = []
        added_at: list[float | None] = []
        t_end = 0.0

        def close(t: float) -> None:
            nonlocal pending
            if pending is not None:
                self.step_times.append((pending[0], pending[1], t - pending[2], pending[3]))
                pending = None
        try:
            while not self._stop:
                while True:
                    try:
                        cmd = self._cmds.get_nowait()
                    except queue.Empty:
                        break
                    if cmd[0] == "abort":
                        engine.abort_request([cmd[1]])
                        continue
                    if cmd[0] == "reset":
                        ok = engine.reset_prefix_cache()
                        self._loop.call_soon_threadsafe(cmd[1].set_result, ok)
                        continue
                    if cmd[0] in ("mark", "flush"):  # the steps so far are complete
                        close(t_end)
                        if cmd[0] == "mark":  # the run starts: the steps so far were the calibration's
                            self.run_first_step = len(self.step_times)
                        else:
                            self._loop.call_soon_threadsafe(cmd[1].set_result, len(self.step_times))
                        continue
                    rid, prompt_ids, max_tokens, extra, ignore_eos = cmd
                    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos, temperature=0.0,
                                        extra_args=dict(extra), output_kind=RequestOutputKind.DELTA)
                    engine.add_request(rid, {"prompt_token_ids": prompt_ids}, sp)
                    if self._recorder is not None:
                        added.append(rid)
                        added_at.append(self._recorder.added_at)
                if not engine.has_unfinished_requests():
                    close(t_end)
                    self._wake.wait(0.05)
                    self._wake.clear()
                    self._snapshot()  # idle but alive: the sample stays fresh
                    continue
                t0 = time.perf_counter()
                close(t0)
                t0_run = self.clock() if self._recorder is not None else 0.0
                outs = engine.step()
                if self._recorder is not None:
                    batches = self._recorder.take()
                    if len(batches) == 1 and (batches[0][0] or batches[0][1]):
                        pending = (*batches[0], t0, added)
                        self.step_starts.append(t0_run)
                        rec = self._recorder
                        self.step_clock.append((rec.scheduled_at, rec.updated_at, added_at))
                        added, added_at = [], []
                        self._seen += 1
                now = self.clock()
                if len(self.step_outputs) < len(self.step_starts):  # (record_steps: a recorded step)
                    self.step_outputs.append(now)
                self._snapshot(now)
                for out in outs:
                    self._loop.call_soon_threadsafe(self._on_output, out, now, self._seen - 1)
                t_end = time.perf_counter()
            close(t_end)
        except BaseException as e:
            logger.exception("engine stepper failed")
            self._error = e
            self._loop.call_soon_threadsafe(self._fail_all, e)

    def _snapshot(self, now: float | None = None) -> None:
        # the reading only: the engine's counters (``engine_stats``: the policy's state and cost model
        # among them, a dict built per read) are read once, at close; read here, they made every step
        # of a policy with state longer than a fcfs step of the same batch
        self._read = (scheduler_reading(self.scheduler, self.clock() if now is None else now), self._seen)

    # -- the asyncio side -------------------------------------------------------------------------
    def _on_output(self, out: Any, now: float, step: int) -> None:
        entry = self._pending.get(out.request_id)
        if entry is None:
            return
        fut, acc = entry
        comp = out.outputs[0] if out.outputs else None
        if comp is not None and comp.token_ids:
            if acc["first"] is None:
                acc["first"] = now
            acc["ids"].extend(comp.token_ids)
        if out.num_cached_tokens is not None:
            acc["cached"] = out.num_cached_tokens
        if out.finished:
            del self._pending[out.request_id]
            if not fut.done():
                fut.set_result(CallResult(acc["ids"], acc["prompt"], acc["cached"],
                                          acc["first"], now, comp.finish_reason if comp else None))
                if self.step_times is not None:  # stamped right after the caller's wake-up ran
                    rid = out.request_id
                    fut.add_done_callback(lambda _, rid=rid: self.outputs_seen.append((step, rid, self.clock())))

    def _fail_all(self, e: BaseException) -> None:
        for fut, _ in self._pending.values():
            if not fut.done():
                fut.set_exception(RuntimeError(f"engine failed: {e!r}"))
        self._pending.clear()

    async def generate(self, request_id: str, prompt_ids: list[int], max_tokens: int,
                       extra_args: Mapping[str, Any], ignore_eos: bool = True) -> CallResult:
        if self._error is not None:
            raise RuntimeError(f"engine failed: {self._error!r}")
        fut = asyncio.get_running_loop().create_future()
        self._pending[request_id] = (fut, {"ids": [], "first": None, "cached": None, "prompt": len(prompt_ids)})
        self._cmds.put((request_id, list(prompt_ids), int(max_tokens), dict(extra_args), bool(ignore_eos)))
        self._wake.set()
        try:
            return await fut
        except asyncio.CancelledError:  # timed out or abandoned: the engine must not keep it
            await self.abort(request_id)
            raise

    def mark_run_start(self) -> None:
        """With record_steps: the steps recorded from now on are the run's (called before the run's
        first call; the stepper takes it in order with the calls, between steps)."""
        if self.step_times is not None:
            self._cmds.put(("mark",))
            self._wake.set()

    async def recorded_steps(self) -> int:
        """With record_steps, called while the engine is idle (its calls answered): closes the last
        step's cycle where the loop went idle and returns how many steps ``step_times`` holds."""
        if self.step_times is None:
            raise RuntimeError("recorded_steps needs record_steps=True")
        done = self._loop.create_future()
        self._cmds.put(("flush", done))
        self._wake.set()
        return await asyncio.wait_for(done, 30)

    async def abort(self, request_id: str) -> None:
        if self._pending.pop(request_id, None) is None:
            return  # finished (or never sent)
        self._cmds.put(("abort", request_id))
        self._wake.set()

    async def reset_prefix_cache(self) -> bool:
        """Empty the engine's prefix cache (on the stepper thread, between steps; the engine must be
        idle, as after calibration). Returns vLLM's answer (False: something still held blocks)."""
        done = self._loop.create_future()
        self._cmds.put(("reset", done))
        self._wake.set()
        return await asyncio.wait_for(done, 30)

    def set_cost_model(self, cost: Any) -> None:
        """Hand the calibrated cost model to the scheduler's policy (pinned: no online refits)."""
        setter = getattr(self.scheduler, "set_cost_model", None)
        if setter is not None:
            setter(cost)

    def sample(self) -> Telemetry:
        # Taken by the stepper thread after every step and every idle wait (50 ms): its ts is when
        # the engine was last seen alive, so a dead or stuck stepper shows up as stale telemetry.
        self._last_read = read = self._read
        return read[0]

    def note_control_tick(self, now: float, reading_ts: float) -> None:
        """With record_steps: the driver's control loop ticked at run-clock ``now`` on the reading
        ``sample()`` last returned, stamped ``reading_ts`` (``write_steps`` files it under the step
        that reading shows)."""
        if self.step_times is not None:
            self.control_ticks.append((self._last_read[1], now, now - reading_ts))

    def engine_stats(self) -> dict[str, Any]:
        """The engine's counters as :meth:`close` left them (empty before it)."""
        return dict(self._stats)

    async def close(self) -> None:
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30)
        if self.engine is not None:
            try:
                self.scheduler.release_retention()
            except Exception:
                logger.debug("retention release at close failed", exc_info=True)
            try:  # the stepper has stopped: the final reading and counters, read here once
                sample, self._stats = scheduler_sample(self.scheduler, self.clock())
                self._read = (sample, self._seen)
            except Exception:
                logger.debug("engine counters at close failed", exc_info=True)
            try:
                self.engine.engine_core.shutdown()
            except Exception:
                logger.debug("engine shutdown failed", exc_info=True)
            self.engine = None
            self.scheduler = None


#: answers after which the HTTP backend sends a call again: the server (or the sidecar in front of
#: it) lost its engine, or says to retry later
_RETRY_STATUS = frozenset({502, 503, 504})
#: a 500 (what vLLM answers a call whose engine core died under it) is sent again this many times
_RETRY_500 = 3
#: the longest wait between two tries of a call
_RETRY_MAX_S = 10.0


class _Transient(Exception):
    """A call's try failed in a way that sending it again can fix."""

    def __init__(self, msg: str, retry_after: float | None = None, status: int | None = None) -> None:
        super().__init__(msg)
        self.retry_after = retry_after
        self.status = status


def _retry_after(headers: Mapping[str, str]) -> float | None:
    try:
        v = float(headers.get("retry-after", ""))
    except ValueError:
        return None
    return v if math.isfinite(v) and v >= 0 else None


#: counters the HTTP backend reports as deltas since its start
_COUNTERS = ("vllm:num_preemptions", "vllm:prefix_cache_hits", "vllm:prefix_cache_queries")


class HTTPBackend:
    """An OpenAI-compatible vLLM server: ``/v1/completions`` with token-id prompts and ``vllm_xargs``.

    Telemetry comes from the server's ``/metrics`` (KV usage, running/waiting, preemptions), polled
    every ``poll_s``, read by the sidecar's parser (:func:`telemetry_from_metrics`): the same total
    blocks (vLLM's null block excluded) and the same usage over data-parallel engines.
    """

    name = "http"

    def __init__(self, url: str, clock: Callable[[], float], *, model: str | None = None,
                 api_key: str | None = None, timeout_s: float = 600.0, poll_s: float = 0.2,
                 vocab_size: int | None = None) -> None:
        self.url = url.rstrip("/")
        self.clock = clock
        self.model = model
        self.api_key = api_key
        self.timeout_s = timeout_s
        self.poll_s = poll_s
        self.vocab_size = vocab_size
        self._client = None
        self._poller: asyncio.Task | None = None
        self._streams: dict[str, asyncio.Task] = {}
        self._sample = Telemetry(0.0)
        self._metrics: dict[str, float] = {}
        self._metrics0: dict[str, float] | None = None
        self._hit_counters: tuple[float, float] | None = None
        #: calls sent again after a transient failure (see _stream)
        self.retries = 0

    async def start(self) -> None:
        import httpx  # not a dependency of the package (vllm's, and the dev extra's): only http runs need it

        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        self._client = httpx.AsyncClient(base_url=self.url, headers=headers,
                                         timeout=httpx.Timeout(self.timeout_s, connect=10.0),
                                         limits=httpx.Limits(max_connections=1024, max_keepalive_connections=256))
        try:
            r = await self._client.get("/v1/models")
            r.raise_for_status()
        except (httpx.HTTPError, OSError) as e:
            await self._client.aclose()
            raise ConnectionError(f"--backend http --url {self.url}: cannot reach the server's /v1/models "
                                  f"({type(e).__name__}: {e})") from None
        models = [m["id"] for m in r.json().get("data", [])]
        if self.model is None:
            if not models:
                raise RuntimeError(f"HTTP backend {self.url}: the server lists no model")
            self.model = models[0]
        if self.vocab_size is None:
            self.vocab_size = 4096  # safe lower bound for the tiny model and any real tokenizer
        await self._poll_once()
        self._metrics0 = dict(self._metrics)
        self._poller = asyncio.create_task(self._poll())

    async def _poll_once(self) -> None:
        import httpx  # see start()

        try:
            r = await self._client.get("/metrics")
            r.raise_for_status()
        except httpx.HTTPError as e:
            logger.debug("metrics poll failed: %s", e)
            return
        m = parse_prometheus(r.text)
        try:
            tel, self._hit_counters = telemetry_from_metrics(m, self.clock(), self._hit_counters)
        except MetricsError as e:
            logger.debug("metrics poll: %s", e)
            return
        self._metrics = {name: v for name in _COUNTERS
                         if (v := metric_sum(m, name + "_total", name)) is not None}
        if self._metrics0 is None:  # the first reading is the baseline
            self._metrics0 = dict(self._metrics)
        base = self._metrics0
        if tel.preemptions is not None:
            tel = replace(tel, preemptions=int(tel.preemptions - base.get("vllm:num_preemptions", 0.0)))
        self._sample = tel

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.poll_s)
            await self._poll_once()

    async def generate(self, request_id: str, prompt_ids: list[int], max_tokens: int,
                       extra_args: Mapping[str, Any], ignore_eos: bool = True) -> CallResult:
        # The stream runs as its own task so abort() can cancel it: closing the connection is how
        # vLLM's server learns to abort the request (and free its KV).
        task = asyncio.ensure_future(self._stream(request_id, prompt_ids, max_tokens, extra_args, ignore_eos))
        self._streams[request_id] = task
        try:
            return await task
        finally:
            self._streams.pop(request_id, None)

    async def abort(self, request_id: str) -> None:
        task = self._streams.pop(request_id, None)
        if task is not None and not task.done():
            task.cancel()
            try:
                await task
            except (asyncio.CancelledError, Exception) as e:  # noqa: BLE001 - it is being thrown away
                logger.debug("aborted %s: %r", request_id, e)

    async def _stream(self, request_id: str, prompt_ids: list[int], max_tokens: int,
                      extra_args: Mapping[str, Any], ignore_eos: bool) -> CallResult:
        """One call, sent again after a transient failure (connection refused or lost, 502/503/504,
        a stream cut off or ended by a 502 error event: the server or the sidecar lost its engine)
        until it succeeds; the caller's call timeout bounds the whole. A 500 (answer or error
        event) is sent again at most ``_RETRY_500`` times. Nothing of a failed try is kept: replay
        asks for a fixed output, so the call is simply run again."""
        import httpx  # see start()

        tries = fives = 0
        while True:
            try:
                return await self._stream_once(request_id, prompt_ids, max_tokens, extra_args, ignore_eos)
            except (_Transient, httpx.TransportError) as e:
                if isinstance(e, _Transient) and e.status == 500:
                    fives += 1
                    if fives > _RETRY_500:
                        raise RuntimeError(f"{request_id}: {e} ({fives} times)") from None
                tries += 1
                self.retries += 1
                wait = min(_RETRY_MAX_S, 0.5 * 2 ** min(tries - 1, 4))
                if isinstance(e, _Transient) and e.retry_after is not None:
                    wait = min(_RETRY_MAX_S, max(wait, e.retry_after))
                logger.warning("%s: %s; sending it again in %.1f s (try %d)", request_id,
                               e if isinstance(e, _Transient) else f"{type(e).__name__}: {e}", wait, tries + 1)
                await asyncio.sleep(wait)

    async def _stream_once(self, request_id: str, prompt_ids: list[int], max_tokens: int,
                           extra_args: Mapping[str, Any], ignore_eos: bool) -> CallResult:
        xargs = {k: (int(v) if isinstance(v, bool) else v) for k, v in extra_args.items() if v is not None}
        body = {"model": self.model, "prompt": list(prompt_ids), "max_tokens": int(max_tokens),
                "ignore_eos": ignore_eos, "temperature": 0.0, "stream": True, "return_token_ids": True,
                "stream_options": {"include_usage": True}, "vllm_xargs": xargs}
        ids: list[int] = []
        first = None
        usage: dict[str, Any] = {}
        finish = None
        done = False
        async with self._client.stream("POST", "/v1/completions", json=body,
                                       headers={"X-Request-Id": request_id}) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")
                if r.status_code in _RETRY_STATUS or r.status_code == 500:
                    raise _Transient(f"HTTP {r.status_code}: {text[:200]}", _retry_after(r.headers), r.status_code)
                raise RuntimeError(f"{request_id}: HTTP {r.status_code}: {text[:500]}")
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if chunk.get("error"):
                    err = chunk["error"]
                    code = err.get("code") if isinstance(err, dict) else None
                    if code in _RETRY_STATUS or code == 500:
                        raise _Transient(f"error event {code} mid-stream: {str(err.get('message'))[:200]}", None,
                                         code)
                    raise RuntimeError(f"{request_id}: server error {err}")
                for ch in chunk.get("choices") or ():
                    toks = ch.get("token_ids") or []
                    if toks and first is None:
                        first = self.clock()
                    ids.extend(toks)
                    finish = ch.get("finish_reason") or finish
                if chunk.get("usage"):
                    usage = chunk["usage"]
        if not done:
            raise _Transient(f"the stream ended without [DONE] after {len(ids)} tokens")
        details = usage.get("prompt_tokens_details") or {}
        return CallResult(ids, int(usage.get("prompt_tokens", len(prompt_ids))), details.get("cached_tokens"),
                          first, self.clock(), finish)

    def sample(self) -> Telemetry:
        return self._sample

    def engine_stats(self) -> dict[str, Any]:
        base = self._metrics0 or {}
        m = self._metrics
        out: dict[str, Any] = {"source": f"{self.url}/metrics", "call_retries": self.retries}
        for key, name in (("preemptions", "vllm:num_preemptions"), ("prefix_cache_hits", "vllm:prefix_cache_hits"),
                          ("prefix_cache_queries", "vllm:prefix_cache_queries")):
            if name in m:
                out[key] = int(m[name] - base.get(name, 0.0))
        return out

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            try:
                await self._poller
            except asyncio.CancelledError:
                pass
        if self._client is not None:
            await self._poll_once()
            await self._client.aclose()
            self._client = None
