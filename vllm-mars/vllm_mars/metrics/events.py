"""The run's event log: ``events.jsonl``, one JSON object a line, each with ``ts`` and ``event``.

``ts`` is seconds since the run start on the driver's monotonic clock (``run_start`` carries the
wall-clock ``epoch`` of that instant). Event names (SPEC section 6): run_start, workflow_arrive,
admission_* (the controller's decisions), workflow_start, call_submit, call_first_token, call_end,
tool_enqueue, tool_start, tool_end, workflow_done, workflow_error, kv_sample, run_end.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any


class EventLog:
    """Append-only JSONL writer, flushed per line (a crashed run keeps what it logged)."""

    def __init__(self, path: str | Path, clock: Callable[[], float]) -> None:
        self.path = Path(path)
        self.clock = clock
        self._f = open(self.path, "w", buffering=1)  # noqa: SIM115 - closed by close()
        self._lock = threading.Lock()
        self.count = 0

    def emit(self, event: str, ts: float | None = None, **fields: Any) -> None:
        rec = {"ts": round(self.clock() if ts is None else ts, 6), "event": event, **fields}
        line = json.dumps(rec, separators=(",", ":"), default=str)
        with self._lock:
            self._f.write(line + "\n")
            self.count += 1

    def close(self) -> None:
        with self._lock:
            if not self._f.closed:
                self._f.close()


def read_jsonl(path: str | Path) -> Iterator[dict[str, Any]]:
    """Records of a JSONL file; a malformed line raises ValueError naming the file and line."""
    path = Path(path)
    with open(path) as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not valid JSON ({e.msg})") from None


def read_events(run_dir: str | Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / "events.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"{path}: no events.jsonl (is {run_dir} a run directory?)")
    return list(read_jsonl(path))
