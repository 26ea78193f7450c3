"""PolicyQueue: vLLM's waiting-queue container, kept in a policy's order.

It is a full ``RequestQueue`` with vLLM's container meaning: ``bool(q)`` is ``len(q) > 0``; ``len``,
iteration and indexing (``q[0]`` the head, ``q[-1]`` the tail, slices too) follow scheduling
order; ``in`` finds a request. The policy's admission gate is not the queue's business: see
``MarsSchedulerMixin.max_num_active_reqs``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from vllm.v1.core.sched.request_queue import RequestQueue
from vllm.v1.request import Request


class PolicyQueue(RequestQueue):
    """Requests in ascending ``key`` order (the head first), sorted lazily when looked at.

    Kept in reverse order so the head pops from the end of the list; ``mark_dirty()`` says the
    keys may have changed (the scheduler calls it at every step of an ordering policy).
    """

    def __init__(self, key: Callable[[Request], Any]) -> None:
        self._key = key
        self._items: list[Request] = []
        self._dirty = False

    def mark_dirty(self) -> None:
        self._dirty = True

    def _sorted(self) -> list[Request]:
        if self._dirty:
            self._items.sort(key=self._key, reverse=True)
            self._dirty = False
        return self._items

    def add_request(self, request: Request) -> None:
        self._items.append(request)
        self._dirty = True

    def pop_request(self) -> Request:
        return self._sorted().pop()

    def peek_request(self) -> Request:
        items = self._sorted()
        if not items:
            raise IndexError("peek from an empty queue")
        return items[-1]

    def prepend_request(self, request: Request) -> None:
        self.add_request(request)

    def prepend_requests(self, requests: Iterable[Request]) -> None:
        self._items.extend(requests)
        self._dirty = True

    def remove_request(self, request: Request) -> None:
        self._items.remove(request)

    def remove_requests(self, requests: Iterable[Request]) -> None:
        drop = set(requests)
        self._items = [r for r in self._items if r not in drop]

    def __bool__(self) -> bool:
        return bool(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._sorted()[::-1])

    def __getitem__(self, index: int | slice) -> Request | list[Request]:
        return self._sorted()[::-1][index]

    def __contains__(self, request: object) -> bool:
        return request in self._items

    def __repr__(self) -> str:
        return f"PolicyQueue({[r.request_id for r in self]!r})"
