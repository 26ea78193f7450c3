"""Calls waiting for admission: a bound on how many and how many body bytes, and bodies kept out of
memory while they wait.

A waiting call holds no parsed body: its raw bytes stay in memory only below ``spill_bytes`` and go
to a file otherwise (read back and deleted at admission, deleted when the call gives up), so the
sidecar's memory per waiting call is a few hundred bytes plus at most ``spill_bytes``.
:class:`QueueBudget` bounds waiting calls in number and in bytes (spilled or not); a call that
does not fit gets 503 with ``Retry-After``. Its byte bound covers every request body the sidecar
holds, not only waiting ones: a body's bytes are reserved chunk by chunk as they arrive and its
parsed size (an upper bound from its JSON value count) before it is parsed, until its call ends.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
import os
import tempfile
from dataclasses import dataclass

logger = logging.getLogger(__name__)


@dataclass
class QueueBudget:
    """Calls and body bytes allowed to wait for admission at once."""

    max_calls: int
    max_bytes: int
    calls: int = 0
    bytes: int = 0

    def take(self, size: int) -> bool:
        """Reserve room for one waiting call of ``size`` bytes; False when it does not fit."""
        if self.calls + 1 > self.max_calls or self.bytes + size > self.max_bytes:
            return False
        self.calls += 1
        self.bytes += size
        return True

    def give(self, size: int) -> None:
        self.calls -= 1
        self.bytes -= size

    def take_bytes(self, n: int) -> bool:
        """Reserve ``n`` bytes of request body held in the sidecar (read, parsed, waiting or being
        forwarded); False when they do not fit."""
        if self.bytes + n > self.max_bytes:
            return False
        self.bytes += n
        return True

    def give_bytes(self, n: int) -> None:
        self.bytes -= n


def _libc_trim() -> object | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc.malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


_TRIM = _libc_trim()


def give_back_memory() -> None:
    """Return freed heap memory to the OS (glibc ``malloc_trim``) after a large body was spilled
    and dropped: concurrent large uploads otherwise leave their peak in the RSS. A no-op off glibc."""
    if _TRIM is not None:
        _TRIM(0)  # type: ignore[operator]


def _spill(data: bytes, spill_dir: str | None) -> str:
    fd, path = tempfile.mkstemp(prefix="mars-body-", dir=spill_dir)
    try:
        view = memoryview(data)
        while view:
            n = os.write(fd, view)
            view = view[n:]
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    os.close(fd)
    return path


def _unspill(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    finally:
        os.unlink(path)


class HeldBody:
    """One waiting call's body: in memory when small, else in a file until :meth:`take`."""

    __slots__ = ("_data", "_path", "size")

    def __init__(self, size: int, data: bytes | None, path: str | None) -> None:
        self.size = size
        self._data = data
        self._path = path

    @classmethod
    async def hold(cls, data: bytes, spill_bytes: int, spill_dir: str | None) -> HeldBody:
        if len(data) <= spill_bytes:
            return cls(len(data), data, None)
        path = await asyncio.to_thread(_spill, data, spill_dir)
        return cls(len(data), None, path)

    @property
    def spilled(self) -> bool:
        return self._path is not None

    async def take(self) -> bytes:
        """The body (a spilled one is read back and its file deleted)."""
        if self._path is None:
            data, self._data = self._data, None
            assert data is not None
            return data
        path, self._path = self._path, None
        return await asyncio.to_thread(_unspill, path)

    def discard(self) -> None:
        """Drop the body (the call gave up); deletes its file."""
        self._data = None
        if self._path is not None:
            try:
                os.unlink(self._path)
            except OSError as e:
                logger.warning("could not delete spilled body %s: %s", self._path, e)
            self._path = None
