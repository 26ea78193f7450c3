"""Polling for tests that watch a server or a thread from outside."""
from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(pred: Callable[[], object], timeout: float = 10.0, step: float = 0.02) -> bool:
    """True as soon as ``pred()`` is truthy, False once ``timeout`` seconds pass without it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(step)
    return False
