"""vLLM's KV block pool for the sim, with its per-block bookkeeping done in fewer Python calls.

An agent's turn re-prefills a 24k-64k-token context whenever its prefix was evicted: vLLM's pool
then evicts and caches again ~3,700 blocks of 16 tokens, one at a time, each through a handful of
method and property calls (``get_new_blocks`` -> ``_maybe_evict_cached_block`` ->
``_remove_cached_block_hashes`` -> ``BlockHashToBlockMap.pop``; ``cache_full_blocks`` ->
``make_block_hash_with_group_id`` -> ``_insert_block_hash`` -> ``contain``/``set_block_hash``/
``insert``), and every scheduling attempt of a waiting call walks its whole prefix through
``get_cached_block``. In the sim, with no GPU work to hide it, that is a large share of a run.

:class:`SimBlockPool` subclasses vLLM's ``BlockPool`` and overrides ``get_new_blocks``,
``cache_full_blocks``, ``touch`` and ``free_blocks`` with loops that read and write the same fields
directly; :class:`SimFullAttentionManager` answers the full-attention prefix lookup with one walk of
the hash map at C speed (``map``/``takewhile``) and counts a hit's free blocks the same way; and
:class:`SimKVCacheManager` reads a request's cached-token estimate (its prefill stats, once per
request) from its last cached blocks. The sim engine hands requests whose block-hash list also
keeps each hash's key in vLLM's hash map (:class:`KeyedHashes`: hash + group suffix, made once per
request and taken over by the next turn), which the lookup and the caching of full blocks read
instead of joining them again. The result is vLLM's, exactly: the same blocks
handed out, the same free-queue (LRU eviction) order, the same hash map contents and order, the same
removals reported through ``_emit_block_removed_events`` (in one call per operation instead of one
per block: the same hashes in the same order, so the same KV events and the same removal count).
Every case off the common path calls vLLM's own code: a block under two hashes, a hash held by two
blocks, a metrics collector, KV events on (``cache_full_blocks``), a block mask, block sizes that
differ from the hash block size, EAGLE, DCP, more than one KV cache group. tests/test_sim_blockpool.py
checks all of it against the stock pool on random operation sequences, a scheduler with these classes
against one without step by step, and whole sim runs byte-identical with them on and off.

:func:`install` turns a built scheduler's pool, KV cache manager and full-attention manager into these classes in
place (``__class__``), so every reference vLLM and the scheduler hold (scheduler, coordinator,
managers, the blocks' ``pool``, retention) sees them. Only the sim installs it (``vllm_mars.sim.engine``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from functools import partial
from itertools import islice, repeat, takewhile
from operator import add, attrgetter, eq, is_not
from typing import Any, Self

from vllm.v1.core.block_pool import BlockHashToBlockMap, BlockPool
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import KVCacheBlock, make_block_hash_with_group_id
from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
from vllm.v1.kv_cache_interface import FullAttentionSpec

#: Whether the sim installs these classes (off only to show that results do not depend on it).
ENABLED = True

_FOUND = partial(is_not, None)
#: a block's fields read at C speed (KVCacheBlock has slots; its properties are Python calls)
_REF_CNT = attrgetter("ref_cnt")
_IS_NULL = attrgetter("is_null")
_HASH_TOKENS = attrgetter("_block_hash_num_tokens")


_SUFFIXES: dict[int, bytes] = {}


def _group_suffix(group_id: int) -> bytes:
    """What vLLM appends to a block hash to key it by KV cache group (its own packing)."""
    suffix = _SUFFIXES.get(group_id)
    if suffix is None:
        suffix = _SUFFIXES[group_id] = make_block_hash_with_group_id(b"", group_id)
    return suffix


class KeyedHashes(list):
    """A request's block hashes (vLLM's list: the same values in the same order) that also keeps
    each one joined with a KV cache group's suffix: the key vLLM's hash map holds the block under.

    vLLM joins them again on every prefix lookup (a waiting call's lookup walks thousands of blocks,
    once per attempt) and on every caching of full blocks, and a new ``bytes`` key also computes its
    hash again. Here each key is made once per request (:meth:`keys`, on first use) and the next
    turn's request takes over the keys of the blocks it shares with the previous one
    (:func:`key_hashes`), so the walks and the caching look up ready keys whose hash is cached. Only
    appends keep the keys (vLLM only extends a request's hashes); any other change of the list
    drops them, and they are made again from the hashes when next asked for.
    """

    __slots__ = ("_keys", "_suffix")

    def __init__(self, hashes: Iterable = (), suffix: bytes = b"", keys: Sequence[bytes] = ()) -> None:
        super().__init__(hashes)
        self._suffix = suffix
        self._keys: list[bytes] = list(keys[:len(self)])

    def keys(self, suffix: bytes, n: int) -> list[bytes] | None:
        """The keys of at least the first ``n`` hashes (fewer when the list is shorter) under
        ``suffix``; None for another suffix than the list's."""
        if suffix != self._suffix:
            return None
        keys = self._keys
        have = len(keys)
        if have < n:
            keys.extend(map(add, self[have:n], repeat(suffix)))
        return keys

    def _changed(self) -> None:
        self._keys = []

    def __setitem__(self, index: Any, value: Any) -> None:
        super().__setitem__(index, value)
        self._changed()

    def __delitem__(self, index: Any) -> None:
        super().__delitem__(index)
        self._changed()

    def __imul__(self, n: Any) -> Self:
        super().__imul__(n)
        self._changed()
        return self

    def insert(self, index: Any, value: Any) -> None:
        super().insert(index, value)
        self._changed()

    def pop(self, index: Any = -1) -> Any:
        value = super().pop(index)
        self._changed()
        return value

    def remove(self, value: Any) -> None:
        super().remove(value)
        self._changed()

    def clear(self) -> None:
        super().clear()
        self._changed()

    def sort(self, *args: Any, **kwargs: Any) -> None:
        super().sort(*args, **kwargs)
        self._changed()

    def reverse(self) -> None:
        super().reverse()
        self._changed()


def key_hashes(request: Any, group_id: int = 0, before: Any = None) -> None:
    """Turn ``request``'s block hashes into :class:`KeyedHashes` (keyed for ``group_id``), taking
    over the keys of ``before`` (an earlier request's hashes: the previous turn's) for the leading
    hashes the two have equal (equal hashes, equal keys)."""
    hashes = request.block_hashes
    suffix = _group_suffix(group_id)
    keys: list[bytes] = []
    if type(before) is KeyedHashes and before._suffix == suffix and before._keys and hashes:
        n = min(len(hashes), len(before._keys))
        if hashes[:n] == before[:n]:  # the common case, compared at C speed
            keys = before._keys[:n]
        else:
            keys = before._keys[:len(list(takewhile(bool, map(eq, hashes, before))))]
    request.block_hashes = KeyedHashes(hashes, suffix, keys)


def _packing_is_concatenation() -> bool:
    return all(make_block_hash_with_group_id(b"\x01\x02", g) == b"\x01\x02" + _group_suffix(g) for g in (0, 1, 7))


class SimBlockPool(BlockPool):
    """vLLM's BlockPool with leaner per-block loops (module docstring); same observable state."""

    def _lean(self) -> bool:
        """The common case the lean loops cover: caching on, no metrics collector, no block under
        a second hash, vLLM's own hash map type."""
        return (self.enable_caching and self.metrics_collector is None and not self.cached_block_hashes_by_block
                and type(self.cached_block_hash_to_block) is BlockHashToBlockMap)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        if not self._lean() or num_blocks > self.free_block_queue.num_free_blocks:
            return super().get_new_blocks(num_blocks)
        blocks = self.free_block_queue.popleft_n(num_blocks)
        if self._reuse_watchers:
            self._notify_reuse(blocks)
        cache = self.cached_block_hash_to_block._cache
        removed: list = []
        for block in blocks:
            key = block._block_hash
            if key is not None:
                held = cache.pop(key, None)
                if held is block:  # the block is the hash's only holder: evicted
                    removed.append(key)
                    block._block_hash = None
                    block._block_hash_num_tokens = None
                else:  # not found, or held with others: put it back, vLLM's removal decides
                    if held is not None:
                        cache[key] = held
                    removed += self._remove_cached_block_hashes(block)
            if block.ref_cnt:
                raise AssertionError(f"free block {block.block_id} has ref_cnt {block.ref_cnt}")
            block.ref_cnt = 1
        if removed:
            self._emit_block_removed_events(removed)
        return blocks

    def cache_full_blocks(self, request: Any, blocks: list[KVCacheBlock], num_cached_blocks: int,
                          num_full_blocks: int, block_size: int, kv_cache_group_id: int,
                          block_mask: list[bool] | None = None) -> None:
        hashes = request.block_hashes
        if (num_cached_blocks >= num_full_blocks or block_mask is not None or self.enable_kv_cache_events
                or block_size != self.hash_block_size or len(hashes) < num_full_blocks
                or type(self.cached_block_hash_to_block) is not BlockHashToBlockMap):
            return super().cache_full_blocks(request, blocks, num_cached_blocks, num_full_blocks, block_size,
                                             kv_cache_group_id, block_mask)
        suffix = _group_suffix(kv_cache_group_id)
        cache = self.cached_block_hash_to_block._cache
        num_tokens = num_cached_blocks * block_size
        ready = hashes.keys(suffix, num_full_blocks) if type(hashes) is KeyedHashes else None
        keys = (ready[num_cached_blocks:num_full_blocks] if ready is not None
                else map(add, hashes[num_cached_blocks:num_full_blocks], repeat(suffix)))
        for block, key in zip(blocks[num_cached_blocks:num_full_blocks], keys):
            num_tokens += block_size
            if block.is_null:
                continue
            if block._block_hash is None and key not in cache:  # a new hash on an unhashed block
                cache[key] = block
                block._block_hash = key
                block._block_hash_num_tokens = num_tokens
            else:
                self._cache_one(block, key, num_tokens)

    def _cache_one(self, block: KVCacheBlock, key: bytes, num_tokens: int) -> None:
        """One block of ``cache_full_blocks`` off the common path, by vLLM's own steps."""
        if block.block_hash is not None:
            # vLLM's own check: only a partial block promoted to full may carry a hash here
            assert block.block_hash_num_tokens is not None and block.block_hash_num_tokens < num_tokens
            self._emit_block_removed_events(self._remove_cached_block_hashes(block))
        self._insert_block_hash(key, block, num_tokens=num_tokens)

    def touch(self, blocks: Sequence[KVCacheBlock]) -> None:
        if self.metrics_collector is not None:
            return super().touch(blocks)
        queue = self.free_block_queue
        taken = 0
        try:
            for block in blocks:
                if not block.ref_cnt and not block.is_null:  # in the free queue: unlink it
                    prev, nxt = block.prev_free_block, block.next_free_block
                    if prev is None or nxt is None:
                        queue.remove(block)  # raises vLLM's error for a block not in the queue
                    prev.next_free_block = nxt
                    nxt.prev_free_block = prev
                    block.prev_free_block = block.next_free_block = None
                    taken += 1
                block.ref_cnt += 1
        finally:
            queue.num_free_blocks -= taken

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        if not self.enable_caching:
            return super().free_blocks(ordered_blocks)
        evict_first: list[KVCacheBlock] = []  # unhashed: reused first (prepended)
        evict_last: list[KVCacheBlock] = []  # hashed: LRU (appended)
        others: dict[BlockPool, list[KVCacheBlock]] = {}
        for block in ordered_blocks:
            pool = block.pool
            if pool is not self and pool is not None:
                others.setdefault(pool, []).append(block)
                continue
            refs = block.ref_cnt - 1
            block.ref_cnt = refs
            if not refs and not block.is_null:
                (evict_first if block._block_hash is None else evict_last).append(block)
        self.free_block_queue.prepend_n(evict_first)
        self.free_block_queue.append_n(evict_last)
        for pool, blocks in others.items():
            pool.free_blocks(blocks)


class SimFullAttentionManager(FullAttentionManager):
    """vLLM's full-attention manager whose prefix lookup walks the hash map at C speed."""

    @classmethod
    def find_longest_cache_hit(cls, block_hashes: Any, max_length: int, kv_cache_group_ids: list[int],
                               block_pool: BlockPool, kv_cache_spec: Any, drop_eagle_block: bool,
                               alignment_tokens: int, dcp_world_size: int = 1,
                               pcp_world_size: int = 1) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        block_size = kv_cache_spec.block_size
        if (dcp_world_size != 1 or drop_eagle_block or len(kv_cache_group_ids) != 1
                or type(kv_cache_spec) is not FullAttentionSpec or block_size != block_pool.hash_block_size
                or alignment_tokens != block_size
                or type(block_pool.cached_block_hash_to_block) is not BlockHashToBlockMap):
            return super().find_longest_cache_hit(
                block_hashes, max_length, kv_cache_group_ids, block_pool, kv_cache_spec, drop_eagle_block,
                alignment_tokens, dcp_world_size=dcp_world_size, pcp_world_size=pcp_world_size)
        # The longest run of cached blocks from the start (vLLM stops at the first miss too); a
        # hash held by several blocks answers its first, as vLLM's get_one_block does.
        n = max_length // block_size
        suffix = _group_suffix(kv_cache_group_ids[0])
        ready = block_hashes.keys(suffix, n) if type(block_hashes) is KeyedHashes else None
        keys = islice(ready, min(n, len(block_hashes))) if ready is not None else map(
            add, islice(block_hashes, n), repeat(suffix))
        held = list(takewhile(_FOUND, map(block_pool.cached_block_hash_to_block._cache.get, keys)))
        if not set(map(type, held)) <= {KVCacheBlock}:
            held = [h if isinstance(h, KVCacheBlock) else next(iter(h.values())) for h in held]
        return (held,), len(held) * block_size

    @classmethod
    def _get_num_evictable_blocks(cls, blocks: Sequence[KVCacheBlock]) -> int:
        """The prefix-hit blocks now in the free queue (unreferenced, not the null block)."""
        unreferenced = list(map(_REF_CNT, blocks)).count(0)
        if unreferenced and any(map(_IS_NULL, blocks)):
            return super()._get_num_evictable_blocks(blocks)
        return unreferenced


class SimKVCacheManager(KVCacheManager):
    """vLLM's KV cache manager whose estimate of a request's cached tokens (read once per request,
    for its prefill stats) reads the request's last cached blocks (:func:`cached_tokens`)."""

    def estimate_cached_tokens(self, request: Any) -> int:
        groups = self.kv_cache_config.kv_cache_groups
        if len(groups) != 1 or type(groups[0].kv_cache_spec) is not FullAttentionSpec:
            return super().estimate_cached_tokens(request)
        spec = groups[0].kv_cache_spec
        if not spec.prefix_cacheable:
            return 0
        return cached_tokens(self.get_blocks(request.request_id).blocks[0], spec.block_size)


def cached_tokens(blocks: Sequence[KVCacheBlock], block_size: int) -> int:
    """vLLM's estimate of a request's cached tokens over its ``blocks`` (in request order): the most
    prefix tokens any of them is cached under, 0 for none.

    A block at position ``j`` of a request is cached under at most ``(j + 1) * block_size`` prefix
    tokens (its own block hash, a hit found under the request's hash at ``j``, or a partial entry
    inside it). So when the last block cached under any hash is cached under exactly
    ``(j + 1) * block_size`` tokens, none before it has more and that is the maximum: read from the
    end, one or two blocks (the unfilled tail). Otherwise every block is read, as vLLM does."""
    j = len(blocks)
    for block in reversed(blocks):
        j -= 1
        n = block._block_hash_num_tokens
        if n:
            if n == (j + 1) * block_size:
                return n
            break
    return max(filter(None, map(_HASH_TOKENS, blocks)), default=0)


def install(scheduler: Any) -> bool:
    """Turn ``scheduler``'s vLLM block pool, KV cache manager and full-attention managers into the
    sim's classes, in place. False (nothing changed) when the pool or manager is not vLLM's own
    class or vLLM keys hashes differently from what the lean loops assume."""
    manager = scheduler.kv_cache_manager
    coordinator = manager.coordinator
    pool = coordinator.block_pool
    if type(pool) is not BlockPool or type(manager) is not KVCacheManager or not _packing_is_concatenation():
        return False
    pool.__class__ = SimBlockPool
    manager.__class__ = SimKVCacheManager
    for single in coordinator.single_type_managers:
        if type(single) is FullAttentionManager:
            single.__class__ = SimFullAttentionManager
    return True
