"""vLLM's CPU KV offload tier in the sim (vllm_mars.sim.offload): vLLM's own OffloadingConnector on
the scheduler side, a virtual-time transfer model for the worker side. Each scheduler run ends with
the leak check (no requests, every GPU block free) and the host tier's (no job, no request, every
held chunk a finished copy)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from vllm.v1.request import RequestStatus
from vllm_mars.driver.config import ReplayConfig, RunPlan
from vllm_mars.driver.runner import run_replay
from vllm_mars.engine.rig import assert_no_leaks, fake_model_output, make_request, make_scheduler, rig_kv_spec
from vllm_mars.metrics.events import read_events
from vllm_mars.policies import make_policy
from vllm_mars.sim.offload import (
    PCIE_BYTES_PER_S,
    HostTier,
    assert_host_tier_clean,
    drain,
    host_tier_accounting,
    host_tier_config,
    transfers_of,
)
from vllm_mars.sim.profile import load_profile

PROFILE = "h200-qwen3-coder-30b-a3b"
BS = 16


def _tier(gib: float = 1.0) -> HostTier:
    return HostTier.of(load_profile(PROFILE), gib)


def _scheduler(tier: HostTier, num_blocks: int = 40, policy: str = "fcfs"):
    return make_scheduler(policy, num_blocks=num_blocks, block_size=BS,
                          kv_transfer_config=host_tier_config(tier, rig_kv_spec(BS).page_size_bytes))


class _Steps:
    """Steps a rig scheduler with the tier's transfers on a virtual clock of ``dt`` per step."""

    def __init__(self, s, dt: float) -> None:
        self.s, self.dt, self.now = s, dt, 0.0
        self.x = transfers_of(s)
        self.first: dict[str, float] = {}

    def step(self) -> None:
        so = self.s.schedule()
        for rid in so.num_scheduled_tokens:
            self.first.setdefault(rid, self.now)
        self.now += self.x.start_step(so.kv_connector_metadata, self.now) + self.dt
        out = fake_model_output(self.s, so)
        out.kv_connector_output = self.x.finish_step(self.now)
        self.s.update_from_output(so, out)

    def run(self, rid: str, ids: list[int], max_tokens: int = 2) -> None:
        self.s.add_request(make_request(rid, prompt_token_ids=ids, max_tokens=max_tokens, block_size=BS))
        while self.s.has_requests():
            self.step()


def _close(s) -> None:
    drain(s, 42)
    assert_host_tier_clean(s)
    assert_no_leaks(s)


def test_host_capacity_and_link_follow_the_profiles_model():
    p = load_profile(PROFILE)
    tier = _tier(64.0)
    assert tier.block_bytes == p.kv_bytes_per_token() * p.block_size * p.hardware.tp
    assert tier.num_chunks == (64 << 30) // tier.block_bytes  # whole MiB-aligned blocks: no padding here
    assert tier.seconds(10) == pytest.approx(10 * tier.block_bytes / PCIE_BYTES_PER_S)
    s = _scheduler(tier)
    assert host_tier_accounting(s)["capacity"] == tier.num_chunks  # vLLM's manager got exactly that
    _close(s)


def test_a_returning_prompt_loads_from_the_host_and_waits_for_the_load():
    tier = _tier(1.0)
    s = _scheduler(tier)
    run = _Steps(s, dt=1e-4)  # steps far shorter than the load
    a = list(range(3, 3 + 320))  # 20 blocks
    run.run("a", a)
    run.run("flood", list(range(5000, 5600)))  # evicts a's blocks from the GPU prefix cache
    assert run.x.loads == 0
    t0 = run.now
    s.add_request(make_request("b", prompt_token_ids=a + [7] * 64, max_tokens=2, block_size=BS))
    run.step()
    assert s.requests["b"].status == RequestStatus.WAITING_FOR_REMOTE_KVS  # vLLM's async load
    while s.has_requests():
        run.step()
    loaded = run.x.load_blocks
    assert run.x.loads == 1 and loaded >= 15  # the prefix came from the host, not recomputed
    assert run.first["b"] >= t0 + tier.seconds(loaded)  # computed only once its load finished
    assert s.requests == {}
    _close(s)


def test_the_host_tier_evicts_least_recently_used_chunks_at_capacity():
    full = _tier(1.0)
    tier = HostTier(25 * full.block_bytes / (1 << 30), full.block_bytes, BS, full.bandwidth, full.tp)
    assert tier.num_chunks == 25
    s = _scheduler(tier)
    run = _Steps(s, dt=1e-3)
    a = list(range(3, 3 + 320))
    run.run("a", a)  # 20 chunks stored
    run.run("c", list(range(9000, 9320)))  # 20 more: 15 of a's chunks are evicted
    run.run("flood", list(range(5000, 5600)))  # 38 chunks: more than the tier holds, not stored
    acc = host_tier_accounting(s)
    assert acc["held"] == 25 == acc["evictable"]
    run.run("b", a + [7] * 64)
    # only what survived of a's prefix is loaded (vLLM's LRU evicts a request's tail chunks first)
    assert run.x.loads == 1 and 0 < run.x.load_blocks <= 5
    _close(s)


def _workload(path: Path, n: int = 6) -> Path:
    """``n`` workflows of 3,000-3,500 tokens, three turns, tools of 2-8 s: 600 GPU blocks thrash."""
    lines = []
    for i in range(n):
        turns = [{"output_tokens": 40, "tool_s": 2.0 + i, "tool": "bash"},
                 {"append_tokens": 200, "output_tokens": 30, "tool_s": 3.0, "tool": "bash"},
                 {"append_tokens": 100, "output_tokens": 50}]
        lines.append(json.dumps({"schema": "mars_workload_v1", "workflow_id": f"w{i}",
                                 "prefix": [{"tokens": 256, "key": "sys"}], "prompt_tokens": 3000 + 100 * i,
                                 "turns": turns}))
    path.write_text("\n".join(lines) + "\n")
    return path


def _replay(tmp_path: Path, policy: str, gib: float | None) -> dict:
    out = tmp_path / f"{policy}-{gib}"
    cfg = ReplayConfig(workload=str(_workload(tmp_path / "wl.jsonl")), policy=policy, backend="sim", profile=PROFILE,
                       num_blocks=600, rps=2.0, engine_args={} if gib is None else {"kv_offloading_size": gib},
                       out=str(out), progress=False, plots=False)
    run_replay(cfg)
    summary = json.loads((out / "summary.json").read_text())
    end = [e for e in read_events(out) if e["event"] == "run_end"]
    assert end and end[0]["engine"] == summary["engine"]
    return summary


def test_infercept_swap_runs_on_the_sim_tier_and_swaps_instead_of_recomputing(tmp_path):
    swap = _replay(tmp_path, "infercept_swap", 8.0)
    plain = _replay(tmp_path, "infercept", None)
    for s in (swap, plain):
        assert s["completed"] == s["workflows"] == 6 and s["engine"]["leak_check"] == "ok"
    off = swap["engine"]["offload"]
    assert off["loads"] > 0 and off["load_tokens"] > 0 and off["load_s"] > 0 and off["stores"] > 0
    assert off["host_blocks"] == _tier(8.0).num_chunks
    assert "offload" not in plain["engine"]

    def prefilled(s):
        return s["engine"]["prompt_tokens"] - s["engine"]["prefix_hit_tokens"]

    # what the host tier loaded is not prefilled again
    assert prefilled(swap) < prefilled(plain) - off["load_tokens"] // 2
    # swap releases at interceptions (a load costs less than holding), infercept preserves
    assert swap["engine"]["retention"]["released_on_expiry"] == 0 < plain["engine"]["retention"]["released_on_expiry"]


def test_the_sim_needs_the_tier_for_infercept_swap_and_models_no_other_engine_argument(tmp_path):
    wl = str(_workload(tmp_path / "wl.jsonl", 1))

    def plan(policy="fcfs", **engine_args):
        return RunPlan.of(ReplayConfig(workload=wl, policy=policy, backend="sim", profile=PROFILE,
                                       engine_args=engine_args))

    with pytest.raises(ValueError, match="none is configured: add --engine-arg kv_offloading_size"):
        plan("infercept_swap")
    assert plan("infercept_swap", kv_offloading_size=4).engine.kv_offloading_size == 4.0
    assert plan().engine.kv_offloading_size is None
    with pytest.raises(ValueError, match="--engine-arg max_num_seqs: the sim takes its engine from --profile"):
        plan(max_num_seqs=8)
    with pytest.raises(ValueError, match="kv_offloading_backend='lmcache'.*allowed: native"):
        plan(kv_offloading_size=4, kv_offloading_backend="lmcache")
    with pytest.raises(ValueError, match="kv_offloading_size=-1: expected a positive number of GiB"):
        plan(kv_offloading_size=-1)


def test_an_experiment_variant_gives_infercept_swap_its_tier(tmp_path):
    from vllm_mars.driver.compare import policy_config
    from vllm_mars.experiment.spec import load_experiment

    toml = tmp_path / "x.toml"
    toml.write_text(f'name = "x"\nbackend = "sim"\nprofile = "{PROFILE}"\npolicies = ["infercept_swap", "mars"]\n'
                    + '[variants.infercept_swap]\npolicy = "infercept_swap"\n'
                    + 'replay = { engine_args = { kv_offloading_size = 64 } }\n'
                    + '[[workloads]]\nname = "w"\npreset = "ILR-1"\nrps = [1.0]\n')
    exp = load_experiment(toml)
    swap = policy_config(exp.base, "infercept_swap", exp.variants["infercept_swap"], rps=1.0)
    assert RunPlan.of(swap).engine.kv_offloading_size == 64.0
    assert RunPlan.of(policy_config(exp.base, "mars", None, rps=1.0)).engine.kv_offloading_size is None


def test_infercept_swap_prices_the_load_of_the_engines_tier():
    pol = make_policy("infercept_swap")
    assert pol.swap_waste(1000, 3000) == pytest.approx(4e-5 * 1000 * 1000)  # no engine: InferCept's constant
    assert make_policy("infercept_swap", {"swap_s_per_token": 1e-6}).swap_waste(1000, 3000) == pytest.approx(1.0)
    tier = _tier(1.0)
    s = _scheduler(tier, policy="infercept_swap")  # the sim's connector: the scheduler accepts the policy
    assert s.mars_policy.swap_waste(1000, 3000) == pytest.approx(tier.seconds_per_token * 1000 * 1000)
    _close(s)
