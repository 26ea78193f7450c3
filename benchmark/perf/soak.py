"""Soak: ``mars serve`` on the real CPU engine with the tiny model under mixed traffic for
``--minutes``, with hostile clients throughout and the engine killed every ``--kill-every`` seconds.

Processes: ``mars serve`` (its vLLM server behind the sidecar, restarted by ``mars serve`` when it
dies), ``mars replay --backend http`` against the sidecar (replayed agent sessions at ``--rps``
roots/s, simulated tools; the driver sends a call again after a transient failure), and this
process, which runs the hostile clients, the probes, the engine killer and the sampler on threads.

- Hostile clients, in turn: request bodies drawn by the fuzz suite's Hypothesis strategy
  (``tests/test_sidecar_fuzz.py``: nesting, control characters, lone surrogates, encodings, sizes,
  wrongly typed tags) and its raw request heads; the hole tests' ids with control characters
  (``tests/test_sidecar_holes.py``); JSON nested 3,000 deep; slow-loris (heads and bodies trickled
  a byte at a time); disconnects (mid-body, mid-answer); a body over ``--max-body-bytes``. Each
  answer is classed by status; a 500, a reply without a status line or an empty reply is bad.
- Engine kills: SIGKILL to the vLLM API server and to its engine core, alternately; the time until
  the sidecar's /health is 200 again is the recovery time.
- Added latency of the sidecar, per probe: every ``--probe-every`` s the same one-token completion
  goes straight to the engine port (with the backend key) and through the sidecar (one long-lived
  probe workflow, so it is admitted once, not per call), three pairs back to back in alternating
  order; the probe's added latency = its fastest sidecar call - its fastest direct call (the
  single pairs' differences are reported too). Also the sidecar's CPU time per proxied call over
  the run (/proc; it includes the hostile traffic and the /metrics polls).
- Sampled every ``--sample-every`` s: RSS and open fds of the sidecar (the ``mars serve`` process),
  RSS of the engine (its process group), the sidecar's admission gauges.

At the end: the replay's workflows started / completed / lost, every admission slot and waiting
call freed (sidecar /metrics back to 0 within ``--drain`` s), the engine with no request left,
then ``mars serve`` stopped and no process of it left.

    PYTHONPATH=vllm-mars nice .venv/bin/python benchmark/perf/soak.py --minutes 30 --record
    PYTHONPATH=vllm-mars .venv/bin/python benchmark/perf/soak.py --minutes 0.5 --kill-every 15   # smoke
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import platform
import random
import secrets
import select
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
TESTS = REPO / "tests"

#: sidecar /metrics gauges that must be back to 0 at the end
GAUGES = ("mars_admission_active", "mars_admission_queued", "mars_sidecar_in_flight", "mars_sidecar_waiting_calls",
          "mars_sidecar_waiting_bytes")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


# -- /proc -------------------------------------------------------------------------------------------
def proc_rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next((int(x.split()[1]) << 10 for x in f if x.startswith("VmRSS:")), 0)
    except OSError:
        return 0


def proc_fds(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return 0


def proc_cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def all_procs(live: bool = False) -> list[tuple[int, int, int, str]]:
    """(pid, ppid, pgid, cmdline) of every process (``live``: not the zombies)."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if live and fields[0] in ("Z", "X"):
            continue
        out.append((int(d), int(fields[1]), int(fields[2]), cmd))
    return out


# -- mars serve --------------------------------------------------------------------------------------
class Serve:
    """``mars serve`` with the tiny model, as a user starts it."""

    def __init__(self, model: str, work: Path, args: argparse.Namespace) -> None:
        self.port, self.engine_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.engine_url = f"http://127.0.0.1:{self.engine_port}"
        self.key = secrets.token_urlsafe(24)
        self.log_path = work / "serve.log"
        self._log = open(self.log_path, "w")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "vllm_mars.cli", "serve", model, "--port", str(self.port),
             "--engine-port", str(self.engine_port), "--served-model-name", "tiny", "--device", "cpu",
             "--max-num-seqs", "8", "--num-blocks", str(args.num_blocks), "--backend-api-key", self.key,
             "--idle-timeout", str(args.idle_timeout), "--events", str(work / "admission.jsonl"),
             "--engine-log", str(work / "engine.log"), "--max-body-bytes", str(args.max_body_bytes)],
            stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)

    def health(self) -> int:
        import httpx

        try:
            return httpx.get(self.url + "/health", timeout=5).status_code
        except httpx.HTTPError:
            return 0

    def wait_up(self, timeout: float) -> float:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mars serve exited with {self.proc.returncode}:\n"
                                   + self.log_path.read_text()[-3000:])
            if self.health() == 200:
                return time.monotonic() - t0
            time.sleep(0.5)
        raise TimeoutError(f"mars serve not healthy within {timeout:.0f} s:\n" + self.log_path.read_text()[-3000:])

    def metrics(self) -> dict[str, float]:
        """The sidecar's /metrics: unlabelled series by name, labelled ones summed over their labels."""
        import httpx

        out: dict[str, float] = {}
        for line in httpx.get(self.url + "/metrics", timeout=10).text.splitlines():
            if line and not line.startswith("#"):
                name, v = line.split("{", 1)[0].split()[0], line.rsplit(" ", 1)[1]
                out[name] = out.get(name, 0.0) + float(v)
        return out

    def engine_metrics(self) -> dict[str, float]:
        import httpx

        out: dict[str, float] = {}
        r = httpx.get(self.engine_url + "/metrics", timeout=10, headers={"Authorization": f"Bearer {self.key}"})
        for line in r.text.splitlines():
            if line.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")):
                name, v = line.split("{", 1)[0], line.rsplit(" ", 1)[1]
                out[name] = out.get(name, 0.0) + float(v)
        return out

    def engine_procs(self) -> dict[str, int]:
        """The current vLLM server and its engine core: {"api_server": pid, "engine_core": pid}."""
        procs = all_procs()
        out: dict[str, int] = {}
        for pid, ppid, _, cmd in procs:
            if ppid == self.proc.pid and "vllm.entrypoints.openai.api_server" in cmd:
                out["api_server"] = pid
        if "api_server" in out:
            for pid, ppid, _, cmd in procs:
                if ppid == out["api_server"] and cmd.startswith("VLLM::EngineCore"):
                    out["engine_core"] = pid
        return out

    def engine_rss(self) -> int:
        api = self.engine_procs().get("api_server")
        if api is None:
            return 0
        return sum(proc_rss(pid) for pid, _, pgid, _ in all_procs() if pgid == api)

    def stop(self) -> list[str]:
        """SIGTERM (mars serve stops its vLLM server), then the processes of either left over (killed)."""
        groups = {self.proc.pid, *self.engine_procs().values()}
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self._log.close()
        deadline = time.monotonic() + 10  # processes still exiting (zombies, reaped by init, are gone)
        while True:
            left = [f"{pid} {cmd[:80]}" for pid, _, pgid, cmd in all_procs(live=True)
                    if pgid in groups and pid != os.getpid()]
            if not left or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        for g in groups:
            try:
                os.killpg(g, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        return left


# -- hostile clients ---------------------------------------------------------------------------------
def exchange(port: int, data: bytes, timeout: float = 30.0, chunks: list[bytes] | None = None,
             gap: float = 0.0, close_after: int | None = None) -> str:
    """Send ``data`` (then ``chunks`` with ``gap`` s between them) on a raw connection; the answer's
    status as text, or 'empty' (closed without a byte) / 'nostatus' (bytes that are no status line)
    / 'timeout'. ``close_after``: hang up after that many answer bytes."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            s.sendall(data)
            for c in chunks or ():
                if select.select([s], [], [], gap)[0]:
                    break  # the sidecar answered (408) while we trickled
                try:
                    s.sendall(c)
                except OSError:
                    break  # the sidecar gave up on us (408, or closed): read what it said
            out = b""
            # the head, and the whole (small) body of a 500: whose it is shows in it
            while (b"\r\n\r\n" not in out or (out.startswith(b"HTTP/1.1 500") and len(out) < 65536)) and \
                    (close_after is None or len(out) < close_after):
                try:
                    d = s.recv(65536)
                except TimeoutError:
                    return "timeout" if not out else _status(out)
                except ConnectionResetError:
                    break
                if not d:
                    break
                out += d
            return _status(out)
    except OSError as e:
        return f"connect:{type(e).__name__}"


#: the message of vLLM's EngineDeadError (its server answers a call in flight 500 with it)
_ENGINE_DEAD = b"EngineCore encountered an issue"


def _status(head: bytes) -> str:
    if not head:
        return "empty"
    if head.startswith(b"HTTP/1.1 ") and len(head) >= 12 and head[9:12].isdigit():
        if head[9:12] == b"500" and _ENGINE_DEAD in head:
            return "500-engine"  # vLLM's own answer for a call in flight when its engine core died
        return head[9:12].decode()
    return "nostatus"


def http_post(port: int, path: str, body: bytes, headers: dict[str, str] | None = None) -> bytes:
    head = [f"POST {path} HTTP/1.1", "host: x", "content-type: application/json", f"content-length: {len(body)}",
            "connection: close"]
    head += [f"{k}: {v}" for k, v in (headers or {}).items()]
    return ("\r\n".join(head) + "\r\n\r\n").encode("utf-8", "surrogateescape") + body


class Hostile:
    """The hostile clients (one thread): scenarios in turn until ``stop``; every answer's status counted."""

    def __init__(self, port: int, max_body: int, seed: int) -> None:
        sys.path.insert(0, str(TESTS))
        import test_sidecar_fuzz as fuzz
        import test_sidecar_holes as holes

        self.fuzz, self.holes = fuzz, holes
        self.port = port
        self.max_body = max_body
        self.rng = random.Random(seed)
        self.seed = seed
        self.statuses: dict[str, dict[str, int]] = {}
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.last_oversize = -math.inf
        self.slow: list[threading.Thread] = []

    def count(self, scenario: str, status: str) -> None:
        with self.lock:
            d = self.statuses.setdefault(scenario, {})
            d[status] = d.get(status, 0) + 1

    def bad(self) -> dict[str, int]:
        """Answers no hostile input may get: the sidecar's own 500 (not vLLM's 500 for a call its
        killed engine core dropped, passed through: ``500-engine``), no status line, an empty reply."""
        out: dict[str, int] = {}
        for sc, d in self.statuses.items():
            n = sum(v for k, v in d.items() if k in ("500", "nostatus", "empty"))
            if n:
                out[sc] = n
        return out

    def run(self) -> None:
        scenarios = [self.disconnects, self.oversize, self.slow_loris, self.ctrl_ids, self.nesting, self.fuzz_bodies,
                     self.fuzz_heads]
        i = 0
        while not self.stop.is_set():
            scenarios[i % len(scenarios)]()
            i += 1
            self.stop.wait(0.5)

    def fuzz_bodies(self) -> None:
        from hypothesis import HealthCheck, given, seed, settings

        @seed(self.rng.getrandbits(32))
        @settings(max_examples=6, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        @given(case=self.fuzz.bodies())
        def send(case):
            path, raw = case
            self.count("fuzz_body", exchange(self.port, http_post(self.port, path, raw)))

        send()

    def fuzz_heads(self) -> None:
        from hypothesis import HealthCheck, given, seed, settings
        from hypothesis import strategies as st

        @seed(self.rng.getrandbits(32))
        @settings(max_examples=4, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        @given(headers=st.lists(st.tuples(self.fuzz._hname, self.fuzz._hval), max_size=4),
               crlf=st.sampled_from([b"", b"\r", b"\n", b"\x00"]))
        def send(headers, crlf):
            body = b'{"model":"tiny","messages":[{"role":"user","content":"hi"}],"max_tokens":1}'
            lines = [b"POST /v1/chat/completions HTTP/1.1", b"host: x", b"content-type: application/json",
                     b"connection: close"]
            lines += [k + b": " + v for k, v in headers if k != b"content-length"]
            if crlf:
                lines.append(b"x-mars-workflow: a" + crlf + b"b")
            lines.append(b"content-length: " + str(len(body)).encode())
            self.count("fuzz_head", exchange(self.port, b"\r\n".join(lines) + b"\r\n\r\n" + body))

        send()

    def ctrl_ids(self) -> None:
        bad = self.rng.choice(self.holes.BAD_IDS)
        where = self.rng.choice(["xargs", "session_id", "prompt_cache_key"])
        body: dict = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        if where == "xargs":
            body["vllm_xargs"] = {"mars_workflow": bad}
        else:
            body[where] = bad
        self.count("ctrl_id", exchange(self.port, http_post(self.port, "/v1/chat/completions",
                                                            json.dumps(body).encode())))

    def nesting(self) -> None:
        nested = self.holes.nested(self.rng.choice([600, 900, 3000]))
        path, raw = self.rng.choice([
            ("/v1/chat/completions", '{"model":"tiny","messages":[{"role":"user","content":' + nested + "}]}"),
            ("/v1/completions", '{"model":"tiny","prompt":' + nested + "}"),
            ("/v1/responses", '{"model":"tiny","input":' + nested + "}")])
        self.count("nesting", exchange(self.port, http_post(self.port, path, raw.encode())))

    def slow_loris(self) -> None:
        """Trickle 2 heads and 2 bodies a byte every 0.5 s, on their own threads, each until the
        sidecar answers (408 at --header-timeout / --body-deadline) or closes; at most 8 at once."""
        def head():
            self.count("slow_head", exchange(self.port, b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n",
                                             chunks=[b"x"] * 400, gap=0.5, timeout=120))

        def body():
            self.count("slow_body", exchange(self.port, b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
                                                        b"content-length: 500\r\n\r\n{", chunks=[b" "] * 400,
                                             gap=0.5, timeout=120))

        self.slow = [t for t in self.slow if t.is_alive()]
        if len(self.slow) > 4:
            return
        for f in (head, head, body, body):
            t = threading.Thread(target=f, daemon=True)
            t.start()
            self.slow.append(t)

    def join(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for t in self.slow:
            t.join(max(0.0, deadline - time.monotonic()))

    def disconnects(self) -> None:
        # mid-body: promise 100 kB, send 5 kB, hang up
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=10) as s:
                s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 100000\r\n\r\n"
                          b'{"a": "' + b"z" * 5000)
            self.count("disconnect_body", "closed")
        except OSError as e:
            self.count("disconnect_body", f"connect:{type(e).__name__}")
        # mid-answer: a streamed call, hang up after the first bytes of the answer
        body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "count to ten"}],
                           "max_tokens": 32, "stream": True}).encode()
        st = exchange(self.port, http_post(self.port, "/v1/chat/completions", body,
                                           {"x-mars-workflow": f"hostile-dc-{self.rng.getrandbits(32):08x}"}),
                      close_after=16)
        self.count("disconnect_answer", st)

    def oversize(self) -> None:
        if time.monotonic() - self.last_oversize < 60:
            return
        self.last_oversize = time.monotonic()
        n = self.max_body + 4096
        head = (f"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                f"content-length: {n}\r\n\r\n").encode()
        block = b"[" * 65536
        self.count("oversize", exchange(self.port, head, chunks=[block] * (n // len(block) + 1), timeout=60))


# -- probes and sampler ------------------------------------------------------------------------------
class Probe:
    """Paired probes: the same one-token completion straight to the engine and through the sidecar."""

    def __init__(self, serve: Serve) -> None:
        import httpx

        self.serve = serve
        self.direct = httpx.Client(base_url=serve.engine_url, timeout=120,
                                   headers={"Authorization": f"Bearer {serve.key}"})
        self.side = httpx.Client(base_url=serve.url, timeout=120, headers={"X-MARS-Workflow": "soak-probe"})
        self.pairs: list[dict] = []
        self.n = 0

    def _one(self, client, direct: bool) -> tuple[float, int]:
        import httpx

        body = {"model": "tiny", "prompt": "soak probe", "max_tokens": 1, "temperature": 0.0}
        t0 = time.perf_counter()
        try:
            st = client.post("/v1/completions", json=body).status_code
        except httpx.HTTPError:
            st = 0
        return time.perf_counter() - t0, st

    def pair(self, t: float) -> None:
        """Three interleaved pairs; the probe's added latency is the fastest sidecar call less the
        fastest direct one (the minimum filters the scheduling noise of a loaded machine)."""
        d: list[float] = []
        s: list[float] = []
        sts: list[int] = []
        for i in range(3):
            self.n += 1
            for direct in ((True, False) if self.n % 2 else (False, True)):
                dt_, st = self._one(self.direct if direct else self.side, direct)
                (d if direct else s).append(dt_)
                sts.append(st)
        self.pairs.append({"t": round(t, 2), "direct_s": round(min(d), 6), "sidecar_s": round(min(s), 6),
                           "pair_added_s": [round(b - a, 6) for a, b in zip(d, s, strict=True)],
                           "ok": all(x == 200 for x in sts)})

    def close(self) -> None:
        self.direct.close()
        self.side.close()


def run_soak(args: argparse.Namespace) -> dict:
    from vllm_mars.tiny_model import build_tiny_model

    model = args.model or str(build_tiny_model())
    work = Path(args.out) if args.out else Path(os.environ.get("TMPDIR", "/tmp")) / f"mars-soak-{os.getpid()}"
    work.mkdir(parents=True, exist_ok=True)
    duration = args.minutes * 60.0
    serve = Serve(model, work, args)
    replay = None
    threads: list[threading.Thread] = []
    stop = threading.Event()
    try:
        startup_s = serve.wait_up(args.startup_timeout)
        print(f"soak: mars serve up in {startup_s:.0f} s ({serve.url}); {args.minutes} min, kill every "
              f"{args.kill_every} s; work dir {work}", flush=True)
        t0 = time.monotonic()
        cpu0 = proc_cpu_s(serve.proc.pid)
        m0 = serve.metrics()
        n_roots = max(1, math.ceil(args.rps * duration))
        replay_log = open(work / "replay.log", "w")  # noqa: SIM115 (closed below)
        replay = subprocess.Popen(
            [sys.executable, "-m", "vllm_mars.cli", "replay", "--backend", "http", "--url", serve.url, "--policy",
             "fcfs", "--rps", str(args.rps), "--arrival", "poisson", "--num-workflows", str(n_roots),
             "--seed", str(args.seed), "--no-calibrate", "--no-progress", "--out", str(work / "replay")],
            stdout=replay_log, stderr=subprocess.STDOUT, start_new_session=True)

        hostile = Hostile(serve.port, args.max_body_bytes, args.seed)
        probe = Probe(serve)
        samples: list[dict] = []
        kills: list[dict] = []

        def sampler() -> None:
            while not stop.is_set():
                t = time.monotonic() - t0
                try:
                    m = serve.metrics()
                except Exception:  # noqa: BLE001 - a sample the sidecar could not answer is recorded as such
                    m = {}
                samples.append({"t": round(t, 1), "sidecar_rss_mb": round(proc_rss(serve.proc.pid) / 2**20, 1),
                                "sidecar_fds": proc_fds(serve.proc.pid),
                                "engine_rss_mb": round(serve.engine_rss() / 2**20, 1),
                                **{k.removeprefix("mars_"): m.get(k) for k in GAUGES}})
                stop.wait(args.sample_every)

        def prober() -> None:
            while not stop.is_set() and time.monotonic() - t0 < duration:
                probe.pair(time.monotonic() - t0)
                stop.wait(args.probe_every)

        def killer() -> None:
            n = 0
            while args.kill_every > 0:
                nxt = t0 + (n + 1) * args.kill_every
                if nxt >= t0 + duration or stop.wait(max(0.0, nxt - time.monotonic())):
                    return
                procs = serve.engine_procs()
                target = "api_server" if n % 2 == 0 else "engine_core"
                pid = procs.get(target) or procs.get("api_server")
                n += 1
                if pid is None:
                    kills.append({"t": round(time.monotonic() - t0, 1), "target": None, "error": "no engine process"})
                    continue
                os.kill(pid, signal.SIGKILL)
                tk = time.monotonic()
                while time.monotonic() - tk < 5 and serve.health() == 200:
                    time.sleep(0.1)  # the sidecar notices (its next /metrics poll fails)
                down = serve.health() != 200
                while serve.health() != 200 and time.monotonic() - tk < args.startup_timeout:
                    time.sleep(0.5)
                kills.append({"t": round(tk - t0, 1), "target": target, "pid": pid, "seen_down": down,
                              "recovered_s": round(time.monotonic() - tk, 1), "up": serve.health() == 200})
                print(f"soak: killed the engine's {target} at {tk - t0:.0f} s; back after "
                      f"{time.monotonic() - tk:.0f} s", flush=True)

        threads = [threading.Thread(target=f, name=f.__name__, daemon=True)
                   for f in (sampler, prober, killer, hostile.run)]
        for t in threads:
            t.start()
        while time.monotonic() - t0 < duration and replay.poll() is None:
            time.sleep(1)
        hostile.stop.set()
        # traffic ends with the last replayed workflow (a kill's retries can take it past the duration)
        try:
            replay.wait(max(60.0, duration + args.drain + 900 - (time.monotonic() - t0)))
        except subprocess.TimeoutExpired:
            replay.kill()
            replay.wait()
        replay_log.close()
        t_traffic = time.monotonic() - t0
        for t in threads:
            if t.name != "sampler":
                t.join(120)
        hostile.join(150)  # the trickling connections get their 408s
        # every slot freed: the sidecar's gauges back to 0 (hostile roots end at --idle-timeout)
        deadline = time.monotonic() + args.drain
        final: dict[str, float] = {}
        while time.monotonic() < deadline:
            final = serve.metrics()
            if all(final.get(k, 1) == 0 for k in GAUGES):
                break
            time.sleep(0.5)
        drained_s = time.monotonic() - t0 - t_traffic
        engine_end = serve.engine_metrics()
        cpu1 = proc_cpu_s(serve.proc.pid)
        m1 = serve.metrics()
        stop.set()
        threads[0].join(30)
        probe.close()
    finally:
        stop.set()
        if replay is not None and replay.poll() is None:
            os.killpg(replay.pid, signal.SIGKILL)
            replay.wait()
        left = serve.stop()

    # -- the replay's workflows --
    events = [json.loads(x) for x in (work / "replay" / "events.jsonl").read_text().splitlines() if x.strip()] \
        if (work / "replay" / "events.jsonl").exists() else []
    started = sum(1 for e in events if e["event"] == "workflow_arrive")
    done = sum(1 for e in events if e["event"] == "workflow_done" and e.get("root_done"))
    errors = [e.get("error") for e in events if e["event"] == "workflow_error" and e.get("root_done")]
    run_end = next((e for e in events if e["event"] == "run_end"), {})
    calls = sum(1 for e in events if e["event"] == "call_end")
    # -- latency --
    ok = [p for p in probe.pairs if p["ok"]]
    added = [1000 * (p["sidecar_s"] - p["direct_s"]) for p in ok]
    raw = [1000 * x for p in ok for x in p["pair_added_s"]]
    upstream = "mars_backend_upstream_requests_total"
    proxied = m1.get(upstream, 0.0) - m0.get(upstream, 0.0)
    rss = [s["sidecar_rss_mb"] for s in samples if s["sidecar_rss_mb"]]
    erss = [s["engine_rss_mb"] for s in samples if s["engine_rss_mb"]]
    fds = [s["sidecar_fds"] for s in samples if s["sidecar_fds"]]
    settle = [s for s in samples if s["t"] >= min(120.0, duration / 4)]  # after the warm-up
    rss_settled = [s["sidecar_rss_mb"] for s in settle if s["sidecar_rss_mb"]] or rss
    res = {
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.node()} ({os.cpu_count()} cores, load average at end {os.getloadavg()[0]:.1f})",
        "command": "benchmark/perf/soak.py " + " ".join(sys.argv[1:]),
        "minutes": args.minutes, "startup_s": round(startup_s, 1), "traffic_s": round(t_traffic, 1),
        "workflows": {"started": started, "completed": done, "lost": started - done, "errors": errors[:10],
                      "calls": calls, "call_retries": (run_end.get("engine") or {}).get("call_retries"),
                      "replay_rc": replay.returncode},
        "kills": kills,
        "slots_freed": all(final.get(k, 1) == 0 for k in GAUGES), "drain_s": round(drained_s, 1),
        "final_gauges": {k: final.get(k) for k in GAUGES},
        "engine_end": engine_end,
        "processes_left": left,
        "sidecar_rss_mb": {"first": rss[0] if rss else None, "settled_first": rss_settled[0] if rss_settled else None,
                           "max": max(rss, default=None), "last": rss[-1] if rss else None},
        "engine_rss_mb": {"first": erss[0] if erss else None, "max": max(erss, default=None),
                          "last": erss[-1] if erss else None},
        "sidecar_fds": {"first": fds[0] if fds else None, "max": max(fds, default=None), "last": fds[-1] if fds else None},
        "added_latency_ms": {"probes": len(ok), "of": len(probe.pairs), "p50": _r(pct(added, 50)),
                             "p99": _r(pct(added, 99)), "mean": _r(statistics.fmean(added)) if added else None,
                             "single_pairs": {"n": len(raw), "p50": _r(pct(raw, 50)), "p99": _r(pct(raw, 99))}},
        "direct_ms": {"p50": _r(pct([1000 * p["direct_s"] for p in ok], 50)),
                      "p99": _r(pct([1000 * p["direct_s"] for p in ok], 99))},
        "sidecar_cpu_ms_per_call": _r(1000 * (cpu1 - cpu0) / proxied) if proxied else None,
        "proxied_calls": int(proxied),
        "hostile": {"statuses": hostile.statuses, "bad": hostile.bad()},
        "samples": samples[:: max(1, len(samples) // 60)],
    }
    (work / "soak.json").write_text(json.dumps(res, indent=1) + "\n")
    return res


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=30.0, help="traffic duration (default 30)")
    ap.add_argument("--kill-every", type=float, default=300.0, metavar="S",
                    help="SIGKILL the engine every S seconds, alternately its API server and its engine core "
                         "(default 300; 0: never)")
    ap.add_argument("--rps", type=float, default=0.2, help="replayed root workflows per second (default 0.2)")
    ap.add_argument("--probe-every", type=float, default=2.0, metavar="S", help="seconds between probe pairs")
    ap.add_argument("--sample-every", type=float, default=5.0, metavar="S", help="seconds between samples")
    ap.add_argument("--num-blocks", type=int, default=1024, help="the engine's KV blocks (default 1024)")
    ap.add_argument("--idle-timeout", type=float, default=15.0, metavar="S",
                    help="the sidecar's idle timeout: hostile roots that never finish end after it (default 15)")
    ap.add_argument("--max-body-bytes", type=int, default=16 << 20, help="the sidecar's body limit (default 16 MiB)")
    ap.add_argument("--drain", type=float, default=90.0, metavar="S",
                    help="seconds after the traffic for every slot to be freed (default 90)")
    ap.add_argument("--startup-timeout", type=float, default=600.0, metavar="S")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default=None, help="model dir (default: the tiny model)")
    ap.add_argument("--out", default=None, help="work directory (logs, replay run, soak.json)")
    ap.add_argument("--record", action="store_true", help="also write benchmark/perf/results/soak.json")
    args = ap.parse_args(argv)
    if not (args.minutes > 0 and math.isfinite(args.minutes)):
        ap.error("--minutes must be a positive number")
    if args.kill_every < 0 or args.rps <= 0:
        ap.error("--kill-every must be >= 0 and --rps > 0")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop: the cleanup in run_soak runs
    res = run_soak(args)
    if args.record:
        (HERE / "results" / "soak.json").write_text(json.dumps(res, indent=1) + "\n")
    short = {k: v for k, v in res.items() if k != "samples"}
    print(json.dumps(short, indent=1))
    good = res["workflows"]["lost"] == 0 and res["slots_freed"] and not res["hostile"]["bad"] and \
        not res["processes_left"] and all(k.get("up") for k in res["kills"])
    return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main())
