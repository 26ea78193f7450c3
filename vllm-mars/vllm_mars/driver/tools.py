"""The CPU tool plane: simulated (sleep the recorded tool time; the default) or real execution.

Real mode runs one subprocess per tool call, pinned to one free core of ``CPU_TOOL`` (calls queue
for a core, as tools on a real tool host do), in a per-workflow workspace, inside a sandbox:
bubblewrap where it works, else Landlock, else none (with a warning). Both confine writes to the
workspace and reads to the workspace plus read-only system directories and the Python environment,
and deny the network unless allowed (``net``: all of it; ``net_allow``: TCP ports, Landlock only);
``protections`` says what is in force (``_sandbox_exec.describe``). Each call has a timeout after
which its whole process group is killed (rc 124).
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from vllm_mars.admission.base import ToolStats
from vllm_mars.driver._sandbox_exec import MARKER, SYSTEM_READ_DIRS, describe, landlock_abi
from vllm_mars.workflow import safe_dirname

logger = logging.getLogger(__name__)

SANDBOX_MODES = ("auto", "bwrap", "landlock", "none")
_EXEC = str(Path(__file__).with_name("_sandbox_exec.py"))
_TAIL = 2000


@dataclass
class ToolResult:
    """One tool call. Times are on the driver's run clock (seconds)."""

    tool: str | None
    enqueue_ts: float
    start_ts: float
    end_ts: float
    rc: int = 0
    timed_out: bool = False
    sandbox: str = "simulated"
    core: int | None = None
    stdout_tail: str = ""
    stderr_tail: str = ""

    @property
    def wait_s(self) -> float:
        return self.start_ts - self.enqueue_ts

    @property
    def duration_s(self) -> float:
        return self.end_ts - self.start_ts


def parse_cpu_list(spec: str | None) -> list[int]:
    """``"0-3,8,10-11"`` -> [0, 1, 2, 3, 8, 10, 11]. Empty/None -> []."""
    if not spec or not spec.strip():
        return []
    out: list[int] = []
    for part in spec.split(","):
        part = part.strip()
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if not m:
            raise ValueError(f"CPU list {spec!r}: bad element {part!r} (expected N or N-M, comma separated)")
        lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
        if hi < lo:
            raise ValueError(f"CPU list {spec!r}: range {part!r} is descending")
        out.extend(range(lo, hi + 1))
    return sorted(set(out))


class _Plane:
    mode = "base"

    def __init__(self, clock: Callable[[], float], workers: int | None) -> None:
        self.clock = clock
        self.workers = workers
        self.in_flight = 0
        self._ema_wait: float | None = None

    def _note_wait(self, wait: float) -> None:
        self._ema_wait = wait if self._ema_wait is None else 0.8 * self._ema_wait + 0.2 * wait

    def stats(self) -> ToolStats:
        return ToolStats(self.in_flight, self.workers, self._ema_wait)

    async def close(self) -> None:
        pass


class SimulatedTools(_Plane):
    """Sleep for the recorded tool time on one of ``workers`` tool cores (``CPU_TOOL``).

    Without ``workers`` calls never queue (the recording already holds any wait). With them, a call
    holds one core for its recorded time, and calls beyond the cores wait for one in arrival order,
    as on a tool host with that many cores (``RealTools``' one call per core): when tools, not KV,
    are oversubscribed, calls queue, and the wait is in the result and in the plane's telemetry
    (``in_flight`` counts the queued calls too: the tools the host is asked to run)."""

    mode = "simulated"

    def __init__(self, clock: Callable[[], float], workers: int | None = None) -> None:
        if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
            raise ValueError(f"simulated tools: workers must be a positive integer or None, got {workers!r}")
        super().__init__(clock, workers)
        self._free = workers
        self._queue: deque[asyncio.Future] = deque()

    async def run(self, workflow: str, turn: int, tool: str | None, cmd: str | None,
                  tool_s: float) -> ToolResult:
        t = self.clock()
        self.in_flight += 1
        held = False
        try:
            if self.workers is not None:
                if self._free > 0 and not self._queue:
                    self._free -= 1
                else:
                    fut = asyncio.get_running_loop().create_future()
                    self._queue.append(fut)
                    try:
                        await fut  # a finishing call hands its core straight to this one
                    except asyncio.CancelledError:
                        if fut.done() and not fut.cancelled():
                            self._release()  # handed a core while being cancelled: pass it on
                        else:
                            self._queue.remove(fut)
                        raise
                held = True
            start = self.clock()
            self._note_wait(start - t)
            if tool_s > 0:
                await asyncio.sleep(tool_s)
        finally:
            self.in_flight -= 1
            if held:
                self._release()
        return ToolResult(tool, t, start, self.clock())

    def _release(self) -> None:
        while self._queue:
            fut = self._queue.popleft()
            if not fut.done():
                fut.set_result(None)
                return
        self._free += 1


def detect_sandbox() -> str:
    """The strongest write sandbox that works here: ``bwrap``, ``landlock`` or ``none``."""
    if shutil.which("bwrap"):
        probe = subprocess.run(["bwrap", "--ro-bind", "/", "/", "--dev", "/dev", "--unshare-all", "true"],
                               capture_output=True, check=False)
        if probe.returncode == 0:
            return "bwrap"
        logger.debug("bwrap present but unusable: %s", probe.stderr.decode(errors="replace")[-300:])
    if landlock_abi() >= 1:
        return "landlock"
    return "none"


def _port(p: object) -> int:
    if isinstance(p, bool) or not isinstance(p, (int, str)) or not str(p).isdigit() or not 0 < int(p) < 65536:
        raise ValueError(f"tool network allow-list: {p!r} is not a TCP port (1-65535)")
    return int(p)


def _strip_marker(err: bytes) -> str:
    """The tool's stderr without the sandbox's ``MARS_SANDBOX {...}`` line."""
    text = err.decode(errors="replace")
    if text.startswith(MARKER):
        text = text.split("\n", 1)[1] if "\n" in text else ""
    return text


def _safe_name(s: str) -> str:
    """A workflow's workspace directory name: one per workflow, never ``.``/``..`` (the one encoder)."""
    return safe_dirname(s)


class RealTools(_Plane):
    """Run each tool call as ``bash -c CMD`` in a sandboxed subprocess pinned to one tool core.

    A call without a command runs ``sleep <recorded tool time>`` the same way, so the CPU plane's
    process costs are real even for recorded traces.
    """

    mode = "real"

    def __init__(self, clock: Callable[[], float], root: str | Path, cores: Sequence[int] | None = None,
                 timeout_s: float = 300.0, sandbox: str = "auto", network: bool = False,
                 net_allow: Sequence[int] = (), read_paths: Sequence[str] | None = None) -> None:
        if sandbox not in SANDBOX_MODES:
            raise ValueError(f"tool sandbox {sandbox!r} unknown; allowed: {', '.join(SANDBOX_MODES)}")
        cores = list(cores) if cores else sorted(os.sched_getaffinity(0))
        allowed = os.sched_getaffinity(0)
        bad = [c for c in cores if c not in allowed]
        if bad:
            raise ValueError(f"CPU_TOOL cores {bad} are not available to this process (allowed: {sorted(allowed)})")
        if timeout_s <= 0:
            raise ValueError(f"tool timeout_s must be > 0, got {timeout_s}")
        super().__init__(clock, len(cores))
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.timeout_s = timeout_s
        self.network = network
        self.net_allow = sorted({_port(p) for p in net_allow})
        self.sandbox = detect_sandbox() if sandbox == "auto" else sandbox
        if self.sandbox == "none":
            logger.warning("real tools run WITHOUT a sandbox (no usable bwrap or Landlock here)")
        if self.sandbox == "bwrap" and self.net_allow and not network:
            raise ValueError("bubblewrap cannot allow single ports; use --sandbox landlock for a port allow-list")
        #: Extra read-only dirs: by default the Python environment, so tools can run python/pytest.
        self.read_paths = [str(Path(p).resolve()) for p in (
            read_paths if read_paths is not None else dict.fromkeys((sys.base_prefix, sys.prefix)))]
        self.protections = describe(self.sandbox, [str(self.root.resolve() / "<workflow>")],
                                    [*SYSTEM_READ_DIRS, *self.read_paths], network, self.net_allow)
        self._free = asyncio.Queue()
        for c in cores:
            self._free.put_nowait(c)
        self._procs: set[asyncio.subprocess.Process] = set()

    def workspace(self, workflow: str) -> Path:
        ws = (self.root / _safe_name(workflow)).resolve()
        if ws.parent != self.root.resolve():  # (cannot happen with the encoder: a second guard)
            raise ValueError(f"workflow id {workflow!r} does not name a directory under {self.root}")
        (ws / ".tmp").mkdir(parents=True, exist_ok=True)
        return ws

    async def run(self, workflow: str, turn: int, tool: str | None, cmd: str | None,
                  tool_s: float) -> ToolResult:
        enq = self.clock()
        self.in_flight += 1
        try:
            core = await self._free.get()
            try:
                start = self.clock()
                self._note_wait(start - enq)
                rc, timed_out, out, err = await self._exec(workflow, core, cmd or f"sleep {max(tool_s, 0):.3f}")
                return ToolResult(tool, enq, start, self.clock(), rc, timed_out, self.sandbox, core,
                                  out[-_TAIL:], err[-_TAIL:])
            finally:
                self._free.put_nowait(core)
        finally:
            self.in_flight -= 1

    async def _exec(self, workflow: str, core: int, cmd: str) -> tuple[int, bool, str, str]:
        ws = self.workspace(workflow)
        argv = [sys.executable, "-I", _EXEC, "--cpus", str(core), "--workspace", str(ws), "--mode", self.sandbox]
        for p in self.read_paths:
            argv += ["--read", p]
        for port in self.net_allow:
            argv += ["--net-allow", str(port)]
        if self.network:
            argv.append("--net")
        argv += ["--", "bash", "-c", cmd]
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(ws), "TMPDIR": str(ws / ".tmp"),
               "LANG": "C.UTF-8", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
               "PYTHONNOUSERSITE": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
        logger.debug("tool %s core %d: %s", workflow, core, shlex.quote(cmd))
        proc = await asyncio.create_subprocess_exec(*argv, cwd=str(ws), env=env, stdin=subprocess.DEVNULL,
                                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                                    start_new_session=True)
        self._procs.add(proc)
        try:
            out, err = await asyncio.wait_for(proc.communicate(), self.timeout_s)
            return proc.returncode or 0, False, out.decode(errors="replace"), _strip_marker(err)
        except TimeoutError:
            self._kill(proc)
            out, err = await proc.communicate()
            return 124, True, out.decode(errors="replace"), _strip_marker(err)
        finally:
            self._procs.discard(proc)

    @staticmethod
    def _kill(proc: asyncio.subprocess.Process) -> None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    async def close(self) -> None:
        for proc in list(self._procs):
            self._kill(proc)


def make_tool_plane(mode: str, clock: Callable[[], float], *, root: str | Path | None = None,
                    cores: Sequence[int] | None = None, timeout_s: float = 300.0,
                    sandbox: str = "auto", net_allow: Sequence[int] = ()) -> SimulatedTools | RealTools:
    if mode == "simulated":
        return SimulatedTools(clock, len(cores) if cores else None)
    if mode == "real":
        if root is None:
            raise ValueError("real tools need a workspace root")
        return RealTools(clock, root, cores, timeout_s, sandbox, net_allow=net_allow)
    raise ValueError(f"tool mode {mode!r} unknown; allowed: simulated, real")
