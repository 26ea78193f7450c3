"""Two of vLLM's KV cache lookups answered with less work and the same answer (the simulator's).

**A waiting request's prefix-cache hit, remembered until the cache changes where it matters.**
vLLM looks up the longest cached prefix of a waiting request (``find_longest_cache_hit``: one hash
map probe per block, 1,500-4,000 blocks for an agent's context) every time the scheduler tries to
admit it, and when the request then does not fit it stays at the head of the queue and is looked up
again next step, and the step after. The answer depends only on the prefix cache's map from block
hash to block, for the hashes the walk probed (the hit's and the first miss's). So:

* the pool's ``BlockHashToBlockMap`` logs every key it inserts or pops (its ``insert``/``pop`` are
  wrapped on the instance: vLLM's code runs as it is);
* the coordinator's ``find_longest_cache_hit`` (wrapped likewise) keeps the last answer per
  request's block-hash list with the hashes it probed; the next call for the same list, length and
  limit returns a copy of that answer unless a logged key since then is one of those hashes, in
  which case vLLM walks again.

The answer is therefore always vLLM's own, block for block: a cached answer is returned only when
no key it depends on has changed. Installed only where that reasoning holds: one full-attention KV
cache group, hash block size = block size, no EAGLE, no context parallelism
(:func:`install_hit_memo` returns False otherwise). ``reset_prefix_cache`` swaps the map: the memo
sees the new map and starts over.

**The cached-token count of a request's first output** (``KVCacheManager.estimate_cached_tokens``:
the largest ``block_hash_num_tokens`` over the request's blocks, 0 when none) is read with C-level
iteration (``map``/``filter``/``max``) instead of a Python loop over a 2,000-4,000-block context:
the same maximum of the same attribute.

Both are wrapped on the instance (the house style of ``engine.reclaim``); both are checked against
vLLM's own methods in tests/test_sim_kv_lookups.py, and sim runs are byte-identical with them on and
off.
"""

from __future__ import annotations

from operator import attrgetter
from typing import Any

#: The memo holds this many requests' answers (the head of the waiting queue is the one re-walked)
MAX_ENTRIES = 32
#: Past this many logged keys the log starts over, keeping only the answer just given (the log holds
#: evicted keys alive: this bounds its memory to a few MB)
MAX_LOG = 1 << 16


class _Entry:
    __slots__ = ("blocks", "hashes", "length", "limit", "probed", "seen", "uncached", "n")

    def __init__(self, hashes: list, limit: int, result: tuple, probed: set, seen: int) -> None:
        self.hashes = hashes
        self.n = len(hashes)
        self.limit = limit
        self.blocks, self.length, self.uncached = result
        self.probed = probed
        self.seen = seen


class HitMemo:
    """The state behind :func:`install_hit_memo` (its counters are for tests and benchmarks)."""

    def __init__(self, coordinator: Any) -> None:
        self.coordinator = coordinator
        self.pool = coordinator.block_pool
        self.block_size = coordinator.block_size
        self._find = coordinator.find_longest_cache_hit
        self._map: Any = None
        self._log: list = []
        self._entries: dict[int, _Entry] = {}
        #: lookups answered from the memo / walked by vLLM
        self.hits = 0
        self.walks = 0
        coordinator.find_longest_cache_hit = self.find_longest_cache_hit

    def _watch(self, m: Any) -> None:
        """Log the keys of ``m`` (the pool's current hash map) from now on; forget every answer."""
        log: list = []
        append = log.append
        insert, pop = m.insert, m.pop

        def logged_insert(key, block):
            append(key)
            insert(key, block)

        def logged_pop(key, block_id):
            append(key)
            return pop(key, block_id)

        m.insert, m.pop = logged_insert, logged_pop
        self._map, self._log = m, log
        self._entries.clear()

    def find_longest_cache_hit(self, block_hashes: list, max_cache_hit_length: int) -> tuple:
        m = self.pool.cached_block_hash_to_block
        log = self._log
        if m is not self._map:
            self._watch(m)
            log = self._log
        key = id(block_hashes)
        e = self._entries.get(key)
        if (e is not None and e.hashes is block_hashes and e.n == len(block_hashes)
                and e.limit == max_cache_hit_length):
            probed = e.probed
            changed = False
            if len(log) > e.seen:
                for k in log[e.seen:]:  # (a slice: islice would step over the seen part again)
                    if k[:-4] in probed:
                        changed = True
                        break
                e.seen = len(log)
            if not changed:
                self.hits += 1
                self._trim(e)
                return tuple([list(g) for g in e.blocks]), e.length, e.uncached
        self.walks += 1
        result = self._find(block_hashes, max_cache_hit_length)
        blocks, length, uncached = result
        # The walk probed the hit's hashes and, below the limit, the first miss.
        limit = min(len(block_hashes), max_cache_hit_length // self.block_size)
        probed = set(block_hashes[: min(len(blocks[0]) + 1, limit)])
        entries = self._entries
        entries.pop(key, None)
        if len(entries) >= MAX_ENTRIES:
            del entries[next(iter(entries))]
        entries[key] = e = _Entry(block_hashes, max_cache_hit_length,
                                  (tuple([list(g) for g in blocks]), length, uncached), probed, len(log))
        self._trim(e)
        return result

    def _trim(self, current: _Entry) -> None:
        """Past ``MAX_LOG`` keys: clear the log (in place: the wrappers append to it), keeping only
        ``current``, which has seen all of it; the others walk again when asked."""
        log = self._log
        if len(log) > MAX_LOG:
            log.clear()
            current.seen = 0
            self._entries = {id(current.hashes): current}


def _cached_tokens(kvm: Any):
    """``kvm.estimate_cached_tokens`` for one prefix-cacheable full-attention group (module docstring)."""
    get_blocks = kvm.get_blocks
    num_tokens = attrgetter("block_hash_num_tokens")

    def estimate_cached_tokens(request: Any) -> int:
        (blocks,) = get_blocks(request.request_id).blocks
        return max(filter(None, map(num_tokens, blocks)), default=0)

    return estimate_cached_tokens


def install_kv_lookups(scheduler: Any) -> HitMemo | None:
    """Install both lookups on ``scheduler``'s KV cache manager (module docstring); the memo, or None
    where its reasoning does not hold (then nothing is installed)."""
    from vllm.v1.core.kv_cache_coordinator import UnitaryKVCacheCoordinator
    from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    kvm = scheduler.kv_cache_manager
    c = kvm.coordinator
    if type(c) is not UnitaryKVCacheCoordinator or not kvm.enable_caching:
        return None
    (mgr,) = c.single_type_managers
    (group,) = kvm.kv_cache_config.kv_cache_groups
    if (type(mgr) is not FullAttentionManager or type(group.kv_cache_spec) is not FullAttentionSpec
            or not group.kv_cache_spec.prefix_cacheable or c.eagle_group_ids or c.dcp_world_size != 1
            or c.pcp_world_size != 1 or c.block_pool.hash_block_size != c.block_size):
        return None
    kvm.estimate_cached_tokens = _cached_tokens(kvm)
    return HitMemo(c)
