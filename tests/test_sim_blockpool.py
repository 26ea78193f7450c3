"""The sim's block pool (``vllm_mars.sim.blockpool``) is vLLM's, observably: on random operation
sequences it hands out the same blocks, keeps the same free queue (LRU eviction order), hash map
(contents and order), per-block hashes and ref counts, and reports the same removals (KV events on,
or the sim's removal counter with events off) as vLLM's stock ``BlockPool``, and its prefix lookup
finds the same blocks as vLLM's ``FullAttentionManager``. Whole sim runs are byte-identical with it
on and off across policies and on a preempting cell (each run ends with the sim's leak check)."""

from __future__ import annotations

import json
import random
from functools import partial
from pathlib import Path

import pytest
from test_sim_fast_forward import PROFILE, _workload
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
from vllm_mars.driver.runner import ReplayConfig, run_replay
from vllm_mars.engine.kv_events import count_block_removals
from vllm_mars.engine.rig import (
    abort_request,
    assert_block_invariants,
    assert_no_leaks,
    fake_model_output,
    make_request,
    make_scheduler,
    rig_kv_spec,
    step_outputs,
)
from vllm_mars.sim import blockpool
from vllm_mars.sim import engine as sim_engine
from vllm_mars.sim.blockpool import (
    KeyedHashes,
    SimBlockPool,
    SimFullAttentionManager,
    SimKVCacheManager,
    cached_tokens,
    key_hashes,
)

BS = 16


def _state(pool: BlockPool) -> tuple:
    """Everything of a pool another component can observe."""
    queue = pool.free_block_queue
    return ([b.block_id for b in queue.get_all_free_blocks()], queue.num_free_blocks,
            [(b.ref_cnt, b.block_hash, b.block_hash_num_tokens, b.is_null) for b in pool.blocks],
            [(k, v.block_id if isinstance(v, KVCacheBlock) else list(v)) for k, v in
             pool.cached_block_hash_to_block._cache.items()],
            sorted((k, sorted(v)) for k, v in pool.cached_block_hashes_by_block.items()))


def _ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


class Each(tuple):
    """An argument with one value per pool (stock, sim)."""


class _Pair:
    """vLLM's pool and the sim's, driven with the same operations and compared after each."""

    def __init__(self, num_blocks: int, events: bool) -> None:
        self.events = events
        self.pools = (BlockPool(num_blocks, enable_caching=True, hash_block_size=BS, enable_kv_cache_events=events),
                      SimBlockPool(num_blocks, enable_caching=True, hash_block_size=BS, enable_kv_cache_events=events))
        self.counters = None if events else [count_block_removals(p) for p in self.pools]
        self.ops: list[str] = []

    def both(self, op: str, *args):
        """``pool.<op>(*args)`` on each pool (an :class:`Each` argument gives each pool its own
        value; a callable ``op`` is called as ``op(pool, *args)``); the two results, after checking
        the pools agree."""
        self.ops.append(str(op))
        results = []
        for i, pool in enumerate(self.pools):
            call = partial(op, pool) if callable(op) else getattr(pool, op)
            try:
                results.append(("ok", call(*(a[i] if isinstance(a, Each) else a for a in args))))
            except (AssertionError, RuntimeError, ValueError) as e:  # a refusal must be the same refusal
                results.append(("raised", type(e).__name__))
        assert results[0][0] == results[1][0], (self.ops[-5:], results)
        self.check()
        return results

    def check(self) -> None:
        stock, sim = self.pools
        assert _state(sim) == _state(stock), f"pools differ after {self.ops[-5:]}"
        if self.events:
            assert sim.take_events() == stock.take_events(), f"KV events differ after {self.ops[-5:]}"
        else:
            assert self.counters[1].blocks_removed == self.counters[0].blocks_removed


def _lookup(pool: BlockPool, cls, request, group: int):
    return cls.find_longest_cache_hit(request.block_hashes, request.num_tokens - 1, [group], pool, rig_kv_spec(BS),
                                      drop_eagle_block=False, alignment_tokens=BS)


def _random_run(seed: int, events: bool, num_blocks: int = 96, steps: int = 400) -> dict[str, int]:
    """Random admissions (with and without using the prefix hit, so a hash can be held by two
    blocks), growth, frees in several orders, evictions, partial-block entries (a block under a
    second hash), prefix-cache resets; returns how often the interesting cases happened."""
    rng = random.Random(seed)
    pair = _Pair(num_blocks, events)
    families = [[rng.randrange(3, 4000) for _ in range(40 * BS)] for _ in range(4)]
    owners: list[dict] = []  # per live request: its Request, its blocks in each pool, blocks cached
    seen = {"hits": 0, "evictions": 0, "duplicates": 0, "partial": 0, "resets": 0, "refused": 0, "estimated": 0,
            "keys_taken_over": 0}
    last: dict[int, KeyedHashes] = {}  # per family: the last request's keyed hashes
    for step in range(steps):
        for o in owners:  # each live request's cached-token estimate, as vLLM's max over its blocks
            vllms = max((b.block_hash_num_tokens or 0 for b in o["blocks"][0]), default=0)
            assert cached_tokens(o["blocks"][1], BS) == vllms, (step, pair.ops[-5:])
            seen["estimated"] += vllms > 0
        roll = rng.random()
        if roll < 0.45 or not owners:
            fam = rng.choice(families)
            cut = rng.randrange(1, len(fam))
            tokens = fam[:cut] + [rng.randrange(3, 4000) for _ in range(rng.randrange(0, 3 * BS))]
            req = make_request(f"r{step}", prompt_token_ids=tokens, max_tokens=4, block_size=BS)
            group = 0 if rng.random() < 0.85 else 1
            if rng.random() < 0.6:
                # the sim's keyed hashes (both pools see the same list: vLLM's reads it as a list),
                # keyed for group 0 or 1, taking over an earlier request's keys for the hashes that
                # are its very objects (as the sim's hasher hands a turn the previous turn's)
                fam_id = families.index(fam)
                before = last.get(fam_id)
                if before is not None and rng.random() < 0.7:
                    same = 0
                    while same < min(len(before), len(req.block_hashes)) and before[same] == req.block_hashes[same]:
                        same += 1
                    req.block_hashes[:same] = before[:same]
                key_hashes(req, rng.choice((0, 0, 1)), before)
                seen["keys_taken_over"] += len(req.block_hashes._keys)
                last[fam_id] = req.block_hashes
            hits = pair.both(_lookup, Each((FullAttentionManager, SimFullAttentionManager)), req, group)
            (stock_hit, stock_len), (sim_hit, sim_len) = hits[0][1], hits[1][1]
            assert [_ids(g) for g in sim_hit] == [_ids(g) for g in stock_hit] and sim_len == stock_len
            for i, cls in enumerate((FullAttentionManager, SimFullAttentionManager)):  # free-capacity count
                hit_blocks = hits[i][1][0][0]
                with_null = list(hit_blocks) + [pair.pools[i].null_block]
                counts = [cls._get_num_evictable_blocks(hit_blocks), cls._get_num_evictable_blocks(with_null)]
                if i == 0:
                    stock_counts = counts
            assert counts == stock_counts
            use_hit = rng.random() < 0.75
            hit = [list(stock_hit[0]), list(sim_hit[0])] if use_hit else [[], []]
            seen["hits"] += bool(hit[0])
            seen["duplicates"] += bool(stock_hit[0]) and not use_hit
            need = -(-len(tokens) // BS) - len(hit[0])
            if need > pair.pools[0].get_num_free_blocks() - sum(b.ref_cnt == 0 for b in hit[0]):
                # vLLM's refusal: asking for more blocks than are free
                res = pair.both("get_new_blocks", pair.pools[0].get_num_free_blocks() + 1)
                assert res[0][0] == "raised"
                seen["refused"] += 1
                continue
            before = len(pair.pools[0].cached_block_hash_to_block)
            pair.both("touch", Each(hit))
            new = pair.both("get_new_blocks", need)
            assert _ids(new[0][1]) == _ids(new[1][1])
            seen["evictions"] += len(pair.pools[0].cached_block_hash_to_block) < before  # cached blocks reused
            blocks = [hit[0] + new[0][1], hit[1] + new[1][1]]
            full = min(len(tokens) // BS, len(blocks[0]))
            cached = len(hit[0])
            upto = rng.randrange(cached, full + 1)
            pair.both("cache_full_blocks", req, Each(blocks), cached, upto, BS, group)
            owners.append({"req": req, "blocks": blocks, "cached": upto, "full": full, "group": group})
        elif roll < 0.60:
            o = rng.choice(owners)
            if o["cached"] < o["full"]:
                upto = rng.randrange(o["cached"] + 1, o["full"] + 1)
                pair.both("cache_full_blocks", o["req"], Each(o["blocks"]), o["cached"], upto, BS, o["group"])
                o["cached"] = upto
        elif roll < 0.85:
            o = owners.pop(rng.randrange(len(owners)))
            order = rng.choice(["reversed", "forward", "shuffled"])
            perm = list(range(len(o["blocks"][0])))
            if order == "reversed":
                perm.reverse()
            elif order == "shuffled":
                rng.shuffle(perm)
            pair.both("free_blocks", Each(iter([blocks[j] for j in perm]) for blocks in o["blocks"]))
        elif roll < 0.92:
            ids = {rng.randrange(1, num_blocks) for _ in range(rng.randrange(1, 6))}
            pair.both("evict_blocks", ids)
        elif roll < 0.97:
            o = rng.choice(owners)
            if o["cached"] >= 2:  # a block reachable from an earlier boundary too: a second hash
                k = rng.randrange(1, o["cached"])
                pair.both("cache_partial_block", o["req"], Each(b[k] for b in o["blocks"]), k * BS, o["group"], BS)
                seen["partial"] += 1
        else:
            for o in owners:
                pair.both("free_blocks", Each(reversed(b) for b in o["blocks"]))
            owners.clear()
            res = pair.both("reset_prefix_cache")
            seen["resets"] += res[0][1] is True
    for o in owners:
        pair.both("free_blocks", Each(reversed(b) for b in o["blocks"]))
    stock = pair.pools[0]
    assert stock.get_num_free_blocks() == stock.num_gpu_blocks - 1  # every block back (the null block aside)
    return seen


@pytest.mark.parametrize("events", [False, True])
@pytest.mark.parametrize("seed", range(6))
def test_random_operations_match_vllms_pool(seed, events):
    seen = _random_run(seed, events)
    # the sequences reach the cases that matter: prefix hits, evictions of cached blocks, a hash
    # held by two blocks, blocks under a second hash, refusals, resets
    assert seen["hits"] and seen["evictions"] and seen["duplicates"] and seen["partial"] and seen["estimated"], seen
    assert seen["keys_taken_over"], seen


def test_keyed_hashes_are_vllms_keys_and_only_appends_keep_them():
    """``KeyedHashes`` holds vLLM's own hash-map keys (its packing of hash and group id) for its
    hashes; appending keeps them, any other change drops them (they are made again from the
    hashes), and a later request takes over the keys of exactly the leading hashes it shares as
    the same objects."""
    from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

    req = make_request("a", prompt_token_ids=list(range(3, 3 + 10 * BS)), block_size=BS)
    key_hashes(req, 1)
    hashes = req.block_hashes
    assert type(hashes) is KeyedHashes and list(hashes) == make_request(
        "a", prompt_token_ids=list(range(3, 3 + 10 * BS)), block_size=BS).block_hashes
    suffix = make_block_hash_with_group_id(b"", 1)
    assert hashes.keys(make_block_hash_with_group_id(b"", 0), 4) is None  # another group's: not these
    assert hashes.keys(suffix, 4)[:4] == [make_block_hash_with_group_id(h, 1) for h in hashes[:4]]
    assert hashes.keys(suffix, 99) == [make_block_hash_with_group_id(h, 1) for h in hashes]
    hashes.extend([b"x" * 32])  # vLLM's growth: the keys stay, the new one is made when asked
    assert len(hashes._keys) == 10 and hashes.keys(suffix, 11)[-1] == b"x" * 32 + suffix
    for change in (lambda h: h.__setitem__(2, b"y" * 32), lambda h: h.__delitem__(slice(5, None)),
                   lambda h: h.pop(), lambda h: h.insert(0, b"z" * 32), lambda h: h.clear(), lambda h: h.reverse(),
                   lambda h: h.sort(), lambda h: h.remove(h[0]), lambda h: h.__imul__(1)):
        h = KeyedHashes(hashes, suffix, hashes.keys(suffix, len(hashes)))
        assert len(h._keys) == len(h)
        change(h)
        assert h._keys == [] and h.keys(suffix, len(h)) == [x + suffix for x in h]
    # a next turn whose tokens part at block 8: it takes over the keys of its first 8 hashes
    tokens = list(range(3, 3 + 8 * BS)) + [7] * (4 * BS)
    for shared in (True, False):  # its first hashes the very objects (the sim's hasher) or equal copies
        nxt = make_request("b", prompt_token_ids=tokens, block_size=BS)
        if shared:
            nxt.block_hashes[:8] = hashes[:8]
        assert nxt.block_hashes[:8] == hashes[:8] and nxt.block_hashes[8] != hashes[8]
        key_hashes(nxt, 1, hashes)
        assert len(nxt.block_hashes._keys) == 8 and all(a is b for a, b in zip(nxt.block_hashes._keys, hashes._keys))
        assert nxt.block_hashes.keys(suffix, 12) == [x + suffix for x in nxt.block_hashes]
    nxt = make_request("c", prompt_token_ids=list(range(3, 3 + 12 * BS)), block_size=BS)
    key_hashes(nxt, 1, hashes)  # all 10 keyed hashes equal (the 11th, appended above, is not)
    assert nxt.block_hashes._keys == hashes._keys[:10]
    key_hashes(nxt, 0, hashes)  # another group: nothing taken over
    assert nxt.block_hashes._keys == []


def test_random_operations_cover_refusals_and_resets():
    totals: dict[str, int] = {}
    for seed in range(6, 10):
        for k, v in _random_run(seed, False, num_blocks=48).items():
            totals[k] = totals.get(k, 0) + v
    assert totals["refused"] and totals["resets"], totals


def test_a_scheduler_with_the_sim_classes_decides_as_vllms():
    """Two MarsSchedulers (fcfs) on a small pool, one with the sim's classes installed: random
    arrivals with shared prefixes, aborts and preemptions give the same decisions, outputs (the
    cached-token counts included), pool state and removal counts every step; both end leak-free."""
    rng = random.Random(7)
    kw = {"num_blocks": 120, "block_size": BS, "max_num_seqs": 16, "max_num_batched_tokens": 256}
    stock, ours = make_scheduler("fcfs", **kw), make_scheduler("fcfs", **kw)
    assert blockpool.install(ours) and not blockpool.install(ours)  # once; a second time changes nothing
    assert type(ours.kv_cache_manager) is SimKVCacheManager and type(stock.kv_cache_manager.block_pool) is BlockPool
    counters = [count_block_removals(s.kv_cache_manager.block_pool) for s in (stock, ours)]
    prefixes = [[rng.randrange(3, 4000) for _ in range(rng.choice((40, 96, 200)))] for _ in range(4)]
    preemptions = cached = created = 0
    for n in range(400):
        if n < 300 and rng.random() < 0.4:
            ids = list(rng.choice(prefixes)) + [rng.randrange(3, 4000) for _ in range(rng.randint(1, 150))]
            kwargs = {"request_id": f"r{n}", "prompt_token_ids": ids, "max_tokens": rng.randint(1, 60)}
            for s in (stock, ours):
                req = make_request(**kwargs, block_size=BS)
                if s is ours:
                    key_hashes(req)  # as the sim engine keys its requests' hashes
                s.add_request(req)
        if rng.random() < 0.03 and stock.requests:
            rid = rng.choice(sorted(stock.requests))
            for s in (stock, ours):
                abort_request(s, rid)
        outs = []
        for s in (stock, ours):
            so = s.schedule()
            result = s.update_from_output(so, fake_model_output(s, so))
            # the prefill stats whole: their cache-creation count is vLLM's estimate of cached tokens
            stats = [repr(o.prefill_stats) for eco in result.values() for o in eco.outputs]
            outs.append((dict(so.num_scheduled_tokens), sorted(so.preempted_req_ids or ()), step_outputs(result),
                         stats))
        assert outs[0] == outs[1], f"step {n} differs"
        preemptions += len(outs[0][1])
        cached += sum(o.cached_tokens or 0 for o in outs[0][2])
        created += sum("num_cache_creation_tokens=0)" not in t for t in outs[0][3] if t != "None")
        assert _state(ours.kv_cache_manager.block_pool) == _state(stock.kv_cache_manager.block_pool)
        assert counters[0].blocks_removed == counters[1].blocks_removed
        assert_block_invariants(ours)
        if n >= 300 and not stock.has_requests():
            break
    assert not stock.has_requests() and not ours.has_requests()
    assert preemptions > 0 and cached > 0 and created > 0 and counters[0].blocks_removed > 0
    assert_no_leaks(stock)
    assert_no_leaks(ours)


def _run(tmp_path: Path, policy: str, on: bool, monkeypatch, *, rps: float = 1.5, num_blocks: int = 330):
    monkeypatch.setattr(blockpool, "ENABLED", on)
    pools = []
    start = sim_engine.SimBackend.start

    async def recording_start(self):
        await start(self)
        pools.append(self.scheduler.kv_cache_manager.block_pool)

    monkeypatch.setattr(sim_engine.SimBackend, "start", recording_start)
    wl = tmp_path / "wl.jsonl"
    if not wl.exists():
        _workload(wl)
    out, _ = run_replay(ReplayConfig(workload=str(wl), policy=policy, rps=rps, backend="sim", profile=PROFILE,
                                     num_blocks=num_blocks, progress=False, out=str(tmp_path / f"{policy}-{on}")))
    assert pools and all(type(p) is (SimBlockPool if on else BlockPool) for p in pools)
    return out


def _identical(on: Path, off: Path) -> dict:
    assert (on / "summary.json").read_bytes() == (off / "summary.json").read_bytes()
    assert (on / "events.jsonl").read_bytes() == (off / "events.jsonl").read_bytes()
    summary = json.loads((on / "summary.json").read_text())
    assert summary["completed"] == 10 and summary["errors"] == 0
    assert summary["engine"]["leak_check"] == "ok"
    return summary


@pytest.mark.parametrize("policy", ["mars", "fcfs", "continuum", "autellix", "infercept"])
def test_sim_runs_are_byte_identical_with_the_pool_on_and_off(tmp_path, monkeypatch, policy):
    summary = _identical(_run(tmp_path, policy, True, monkeypatch), _run(tmp_path, policy, False, monkeypatch))
    assert summary["engine"]["kv_blocks_removed"] > 0  # the pool evicts cached prefixes in this cell


def test_a_preempting_cell_is_identical_too(tmp_path, monkeypatch):
    on = _run(tmp_path, "fcfs", True, monkeypatch, rps=4.0, num_blocks=260)
    summary = _identical(on, _run(tmp_path, "fcfs", False, monkeypatch, rps=4.0, num_blocks=260))
    assert summary["preemptions"] > 0
