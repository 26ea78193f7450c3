"""MARS admission's whole-life sizing on the virtual-time engine (vLLM's own scheduler, a linear
step-time profile): roots whose contexts grow past the pool over their turns are admitted only as
their projected peak fits, so the pool does not thrash; with the mechanism off
(``mars-no-life-admission``: the prefix plus one turn against the free blocks) the same workload
evicts and recomputes contexts. Each run ends with the sim's leak check."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from sim_profiles import LinearProfile, use_profiles
from vllm_mars.driver.runner import ReplayConfig, run_replay
from vllm_mars.metrics.events import read_events

RPS = 0.5
PROFILE = dataclasses.replace(LinearProfile(), name="test-growing", capacity_tokens=250 * 16,
                              prefill_s_per_token=1e-3)


@pytest.fixture
def growing_profile(monkeypatch):
    use_profiles(monkeypatch, PROFILE)
    return PROFILE


def _workload(path: Path, n: int = 8, turns: int = 10, shared_prefix: int = 0) -> Path:
    """``n`` workflows of ``turns`` turns, each turn adding ~150 tokens after a 2 s tool: a root
    starts at 150 tokens (it fits anywhere) and ends at ~1650 (two or three fill the pool). At
    ``RPS`` the first turns' growth is seen before most roots arrive."""
    lines = []
    for i in range(n):
        ts = [{"output_tokens": 30, "tool_s": 2.0, "tool": "bash"}]
        ts += [{"append_tokens": 120, "output_tokens": 30, "tool_s": 2.0, "tool": "bash"} for _ in range(turns - 2)]
        ts += [{"append_tokens": 120, "output_tokens": 30}]
        line = {"schema": "mars_workload_v1", "workflow_id": f"g{i}", "prompt_tokens": 150 + i, "turns": ts}
        if shared_prefix:
            line["prefix"] = [{"key": "sys", "tokens": shared_prefix}]
        lines.append(json.dumps(line))
    path.write_text("\n".join(lines) + "\n")
    return path


def _run(tmp_path: Path, policy: str, shared_prefix: int = 0, **admission) -> tuple[dict, list[dict]]:
    wl = _workload(tmp_path / f"wl{shared_prefix}.jsonl", shared_prefix=shared_prefix)
    cfg = ReplayConfig(workload=str(wl), policy=policy, rps=RPS, backend="sim",
                       profile=PROFILE.name, progress=False, out=str(tmp_path / (policy + "".join(admission))),
                       admission_options=admission)
    out, _ = run_replay(cfg)
    events = read_events(out)
    end = [e for e in events if e["event"] == "run_end"][-1]["engine"]
    assert end["leak_check"] == "ok" and end["free_blocks"] == end["num_blocks"] and end["retained_blocks"] == 0
    return json.loads((out / "summary.json").read_text()), events


def test_life_sizing_keeps_growing_roots_from_thrashing_the_pool(tmp_path, growing_profile):
    life, ev = _run(tmp_path, "mars")
    turn, _ = _run(tmp_path, "mars-no-life-admission")
    assert life["completed"] == turn["completed"] == 8
    admits = [e for e in ev if e["event"] == "admission_admit"]
    assert any(e.get("life_peak_tokens") for e in admits), "the projection is in the admission events"
    # Off, contexts admitted on their first turn outgrow the pool and are evicted during tools and
    # rebuilt; on, the projection admits them as they fit: more prefix hits, fewer evictions, and
    # here a faster run (31.5 s vs 33.9 s mean E2E).
    hit = {k: s["engine"]["prefix_hit_tokens"] / s["engine"]["prompt_tokens"] for k, s in (("life", life), ("turn", turn))}
    removed = {k: s["engine"]["kv_blocks_removed"] for k, s in (("life", life), ("turn", turn))}
    assert hit["life"] > hit["turn"] + 0.03, hit
    assert removed["life"] < 0.92 * removed["turn"], removed
    assert life["e2e_s"]["mean"] < 0.97 * turn["e2e_s"]["mean"], (life["e2e_s"]["mean"], turn["e2e_s"]["mean"])


def test_the_driver_reports_shared_prefixes_to_the_admission(tmp_path, growing_profile):
    # Every root starts with the same 800-token system prompt (25 of the pool's 250 blocks): each
    # later root's first call finds it cached and the driver reports the hit (an
    # ``admission_shared`` event), so the projection counts it once, not once per active root
    # (test_admission_controller.py::test_shared_prefix_counts_once_in_the_projection).
    summary, ev = _run(tmp_path, "mars", shared_prefix=800)
    assert summary["completed"] == 8
    shared = [e for e in ev if e["event"] == "admission_shared"]
    assert len(shared) == 8 and all(e["counted"] == "unique" for e in shared)
    assert sum(1 for e in shared if e["cached_tokens"] >= 768) >= 6, [e["cached_tokens"] for e in shared]
