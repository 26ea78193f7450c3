"""The sim's lean KV lookups (``engine.kv_lookups``: waiting requests' prefix-cache hits remembered,
first-output cached-token counts read cheaper) change nothing:
byte-identical ``summary.json`` and ``events.jsonl`` with it on and off, across policies, on a pool
small enough that calls wait at the head of the queue, evict each other's prefixes and are
preempted (each run ends with the sim's leak check); and it must answer most of the repeated
lookups, or the speed it buys is not there. The unit tests drive vLLM's own KV cache manager:
every answer the memo gives equals a fresh walk, as blocks are cached, evicted and reset, and every
cached-token count equals vLLM's own method's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_sim_fast_forward import _workload
from vllm_mars.driver.runner import ReplayConfig, run_replay
from vllm_mars.engine import kv_lookups
from vllm_mars.engine.kv_lookups import install_kv_lookups
from vllm_mars.engine.rig import assert_no_leaks, make_request, make_scheduler, step
from vllm_mars.sim import engine as sim_engine

PROFILE = "h200-qwen3-coder-30b-a3b"


def _run(tmp_path: Path, policy: str, memo: bool, monkeypatch, num_blocks: int = 330, rps: float = 1.5):
    monkeypatch.setattr(sim_engine.SimBackend, "lean_kv_lookups", memo)
    backends = []
    start = sim_engine.SimBackend.start

    async def recording_start(self):
        backends.append(self)
        return await start(self)

    monkeypatch.setattr(sim_engine.SimBackend, "start", recording_start)
    wl = tmp_path / "wl.jsonl"
    if not wl.exists():
        _workload(wl)
    out, _ = run_replay(ReplayConfig(workload=str(wl), policy=policy, rps=rps, backend="sim", profile=PROFILE,
                                     num_blocks=num_blocks, progress=False,
                                     out=str(tmp_path / f"{policy}-{memo}-{num_blocks}")))
    return out, max(backends, key=lambda b: b.steps)


@pytest.mark.parametrize("policy, num_blocks, rps", [
    ("mars", 330, 1.5), ("continuum", 330, 1.5), ("autellix", 330, 1.5), ("fcfs", 260, 4.0)])
def test_hit_memo_gives_byte_identical_runs(tmp_path, monkeypatch, policy, num_blocks, rps):
    on, run = _run(tmp_path, policy, True, monkeypatch, num_blocks, rps)
    off, off_run = _run(tmp_path, policy, False, monkeypatch, num_blocks, rps)
    assert (on / "summary.json").read_bytes() == (off / "summary.json").read_bytes()
    assert (on / "events.jsonl").read_bytes() == (off / "events.jsonl").read_bytes()
    summary = json.loads((on / "summary.json").read_text())
    assert summary["completed"] == 10 and summary["errors"] == 0
    assert summary["engine"]["leak_check"] == "ok"
    assert summary["engine"]["kv_blocks_removed"] > 0
    assert off_run.hit_memo is None and run.hit_memo is not None
    memo = run.hit_memo
    # requests waited at the head of the queue and were looked up again: the memo answered
    assert memo.hits > 0, (memo.hits, memo.walks)


def _fresh(memo, hashes, limit):
    blocks, length, uncached = memo._find(hashes, limit)  # vLLM's own walk, no memo
    return [[b.block_id for b in g] for g in blocks], length, uncached


def _memo(memo, hashes, limit):
    blocks, length, uncached = memo.find_longest_cache_hit(hashes, limit)
    return [[b.block_id for b in g] for g in blocks], length, uncached


@pytest.mark.parametrize("max_log", [kv_lookups.MAX_LOG, 3])
def test_every_memo_answer_is_vllms_walk(monkeypatch, max_log):
    """Cached, evicted, re-cached and reset prefixes: the memo answers as vLLM walks, and repeats
    are answered without a walk (also when its log of changed keys starts over every few keys)."""
    monkeypatch.setattr(kv_lookups, "MAX_LOG", max_log)
    s = make_scheduler("fcfs", num_blocks=41, block_size=16, max_num_batched_tokens=4096)
    memo = install_kv_lookups(s)
    assert memo is not None and s.kv_cache_manager.coordinator.find_longest_cache_hit == memo.find_longest_cache_hit
    prefix = list(range(100, 100 + 16 * 20))
    a = make_request("a", prompt_token_ids=prefix, max_tokens=2)
    s.add_request(a)
    while s.has_requests():
        step(s)
    # w extends a's prompt: 19 of its blocks are cached (the last prompt token is never a hit)
    w = make_request("w", prompt_token_ids=prefix + list(range(5000, 5000 + 16 * 25)), max_tokens=2)
    limit = w.num_tokens - 1
    first = _memo(memo, w.block_hashes, limit)
    assert first == _fresh(memo, w.block_hashes, limit) and first[1] == 16 * 20
    walks = memo.walks
    for _ in range(3):  # nothing changed: answered from the memo
        assert _memo(memo, w.block_hashes, limit) == first
    assert memo.walks == walks and memo.hits >= 3
    # another request takes blocks from the free queue's head, evicting part of a's prefix
    b = make_request("b", prompt_token_ids=list(range(9000, 9000 + 16 * 30)), max_tokens=2)
    s.add_request(b)
    while s.has_requests():
        step(s)
    assert s.kv_cache_manager.block_pool.get_num_free_blocks() == 40
    walks = memo.walks
    after = _memo(memo, w.block_hashes, limit)
    assert memo.walks == walks + 1 and after == _fresh(memo, w.block_hashes, limit)
    assert after[1] < first[1]
    # the memo's keys are what vLLM's walk probes: a longer limit, or another list, walks
    assert _memo(memo, w.block_hashes, 16 * 5) == _fresh(memo, w.block_hashes, 16 * 5)
    w2 = make_request("w2", prompt_token_ids=prefix + [7] * 40, max_tokens=2)
    assert _memo(memo, w2.block_hashes, w2.num_tokens - 1) == _fresh(memo, w2.block_hashes, w2.num_tokens - 1)
    # a's prefix computed again is found again (an insert of a probed key invalidates the answer);
    # a3 hits a2's blocks: the cached-token count is vLLM's at every step
    kvm = s.kv_cache_manager
    counts = []
    for rid, tokens in (("a2", prefix), ("a3", prefix + [11] * 50)):
        s.add_request(make_request(rid, prompt_token_ids=tokens, max_tokens=3))
        while s.has_requests():
            step(s)
            for r in s.running:
                counts.append(kvm.estimate_cached_tokens(r))
                assert counts[-1] == type(kvm).estimate_cached_tokens(kvm, r)
    assert max(counts) == 16 * 23 and min(counts) == 16 * 20
    again = _memo(memo, w.block_hashes, limit)
    assert again == _fresh(memo, w.block_hashes, limit) and again[1] == 16 * 20
    # vLLM's reset swaps the hash map: nothing is cached, and the memo follows
    assert s.reset_prefix_cache()
    assert _memo(memo, w.block_hashes, limit) == ([[]], 0, 0) == _fresh(memo, w.block_hashes, limit)
    assert_no_leaks(s)


def test_not_installed_where_the_walk_is_not_one_group_of_full_attention():
    s = make_scheduler("fcfs", num_blocks=40, block_size=16, enable_prefix_caching=False)
    assert install_kv_lookups(s) is None
