"""The sim's KV pool override (``num_blocks`` / ``kv_scale``): the configured capacity with the
profile's step times, no thrashing on an unbounded pool where the profile's pool preempts, and the
validation of bad values (one line naming the option and the allowed range). Every run ends with
the sim's leak check (``SimBackend.close`` raises on a leak; ``leak_check`` in run_end)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from vllm_mars.driver.runner import SIM_MAX_KV_BLOCKS, ReplayConfig, run_replay
from vllm_mars.sim.engine import SimBackend, get_profile
from vllm_mars.sim.loop import run_virtual

REPO = Path(__file__).resolve().parents[1]
COMPACT = REPO / "benchmark" / "workloads" / "compact.jsonl"
TINY = "cpu-tiny"  # 96 blocks x 32 tokens: the compact workload at 4 roots/s preempts on it


def _run(tmp_path: Path, name: str, **kw) -> dict:
    cfg = ReplayConfig(workload=str(COMPACT), policy="fcfs", rps=4.0, backend="sim",
                       profile=TINY, calibrate=False, progress=False, plots=False, out=str(tmp_path / name), **kw)
    out, _ = run_replay(cfg)
    summary = json.loads((out / "summary.json").read_text())
    summary["run_config"] = json.loads((out / "run_config.json").read_text())
    return summary


def test_scaled_pool_has_the_configured_capacity_and_the_profiles_step_times():
    prof = get_profile(TINY)
    base = prof.num_kv_blocks()
    cfg = ReplayConfig(backend="sim", profile=TINY, kv_scale=10.0)
    cfg.validate()
    assert cfg.with_profile().num_blocks == 10 * base and cfg.with_profile().kv_scale is None
    assert cfg.with_profile().with_profile() == cfg.with_profile(), "idempotent: the driver applies it twice"
    assert ReplayConfig(backend="sim", profile=TINY, num_blocks=500).with_profile().num_blocks == 500
    assert ReplayConfig(backend="sim", profile=TINY).with_profile().num_blocks == base

    async def main(num_blocks):
        backend = SimBackend(prof, asyncio.get_running_loop().time, num_blocks=num_blocks)
        await backend.start()
        t0 = asyncio.get_running_loop().time()
        await backend.generate("one", [11] * 300, 5, {})
        dt = asyncio.get_running_loop().time() - t0
        free = backend.sample().free_blocks
        await backend.close()  # the leak check
        return free, dt, backend.engine_stats()

    free_big, dt_big, stats = run_virtual(main(10 * base))
    free_base, dt_base, _ = run_virtual(main(None))
    assert free_big == 10 * base - 1 and free_base == base - 1  # vLLM's null block
    assert dt_big == dt_base, "the pool changes capacity, not step times"
    assert stats["leak_check"] == "ok"


def test_a_workload_that_preempts_on_the_profiles_pool_does_not_on_an_unbounded_one(tmp_path):
    small = _run(tmp_path, "base")
    big = _run(tmp_path, "big", kv_scale=50.0)
    assert small["completed"] == big["completed"] == 28
    assert small["preemptions"] > 0 and small["kv_blocks_removed"] > 0, "the check needs a thrashing pool"
    assert big["preemptions"] == 0 and big["kv_blocks_removed"] == 0 and big["recomputed_tokens"] == 0
    assert big["prefix_hit_rate"] > small["prefix_hit_rate"]
    assert big["run_config"]["num_blocks"] == 50 * get_profile(TINY).num_kv_blocks()
    for s in (small, big):
        assert s["engine"]["leak_check"] == "ok" and s["engine"]["free_blocks"] == s["engine"]["num_blocks"]
    assert big["engine"]["num_blocks"] == 50 * get_profile(TINY).num_kv_blocks() - 1


@pytest.mark.parametrize("kw, text", [
    ({"kv_scale": 0.0}, "kv_scale must be > 0"),
    ({"kv_scale": float("nan")}, "kv_scale must be a finite number"),
    ({"kv_scale": 1e9}, f"the sim's KV pool must be 2..{SIM_MAX_KV_BLOCKS} blocks (profile cpu-tiny: 96 blocks"),
    ({"kv_scale": 0.01}, "kv_scale 0.01 (0 blocks): the sim's KV pool must be 2.."),
    ({"num_blocks": SIM_MAX_KV_BLOCKS + 1}, f"num_blocks {SIM_MAX_KV_BLOCKS + 1}: the sim's KV pool must be"),
    ({"num_blocks": 1}, "num_blocks 1: the sim's KV pool must be 2.."),
    ({"num_blocks": 500, "kv_scale": 2.0}, "num_blocks and kv_scale both size the sim's KV pool"),
    ({"kv_scale": 2.0, "backend": "inprocess", "profile": None}, "kv_scale scales the sim profile's KV pool"),
])
def test_bad_pool_values_are_one_line_errors_naming_the_option(kw, text):
    cfg = {"backend": "sim", "profile": TINY, **kw}
    with pytest.raises(ValueError) as e:
        ReplayConfig(**cfg).validate()
    assert text in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_cli_pool_flags(tmp_path, capsys):
    from vllm_mars.cli import main

    base = ["replay", "--backend", "sim", "--profile", TINY, "--workload", str(COMPACT), "--no-progress",
            "--out", str(tmp_path / "r")]
    assert main([*base, "--kv-scale", "-2"]) == 2
    assert "kv_scale must be > 0" in capsys.readouterr().err
    assert main([*base, "--kv-scale", "2", "--num-blocks", "300"]) == 2
    assert "give one of them" in capsys.readouterr().err
    assert main([*base, "--max-num-seqs", "3"]) == 2
    assert "--max-num-seqs: the sim backend takes the engine shape from --profile" in capsys.readouterr().err
    assert main(["replay", "--kv-scale", "2", "--workload", str(COMPACT)]) == 2
    assert "--kv-scale scales the sim profile's KV pool" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()
