"""The GPU path, checked on CPU: engine defaults per platform, engine arguments, the scheduler class
vLLM's async decision selects, chunk caps under speculative decoding, the connector refusal."""

from __future__ import annotations

import subprocess
import types
from pathlib import Path

import pytest
from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput
from vllm_mars.cli import main
from vllm_mars.driver.runner import ReplayConfig
from vllm_mars.engine import local
from vllm_mars.engine.rig import assert_no_leaks, fake_model_output, make_request, make_scheduler, step
from vllm_mars.engine.scheduler import AsyncMarsScheduler, MarsScheduler

REPO = Path(__file__).resolve().parents[1]


# -- item 6: MarsScheduler follows vLLM's async-scheduling decision; a named class is built as named --
@pytest.mark.parametrize("named", [MarsScheduler, AsyncMarsScheduler])
@pytest.mark.parametrize("async_on", [True, False])
def test_scheduler_class_follows_async_scheduling(named, async_on):
    s = make_scheduler("mars", num_blocks=64, scheduler_cls=named, async_scheduling=async_on)
    # vLLM builds its AsyncScheduler whenever it is named, whatever the config says; so do we.
    want = AsyncMarsScheduler if (async_on or named is AsyncMarsScheduler) else MarsScheduler
    assert type(s) is want
    assert s.mars_config.policy == "mars"  # initialised exactly once either way
    s.add_request(make_request("a", prompt_len=40, max_tokens=4))
    while s.has_requests():
        step(s)
    assert_no_leaks(s)


def test_real_cpu_engine_builds_the_variant_vllm_decides(tiny_model):
    """vLLM's CPU platform turns async scheduling off even when asked: MarsScheduler, the name the
    engine arguments give, then builds the synchronous scheduler the engine core drives. Naming
    AsyncMarsScheduler builds it as named (as vLLM builds its AsyncScheduler when named), and it
    still serves under the synchronous engine: every token, nothing left behind."""
    from vllm import SamplingParams
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    for named, built in (("MarsScheduler", MarsScheduler), ("AsyncMarsScheduler", AsyncMarsScheduler)):
        kw = local.engine_kwargs(tiny_model, policy="fcfs", num_blocks=16, max_model_len=256, max_num_seqs=4,
                                 max_num_batched_tokens=256, engine_args={"async_scheduling": True})
        kw["scheduler_cls"] = f"vllm_mars.engine.scheduler.{named}"
        engine = LLMEngine.from_engine_args(EngineArgs(**kw))
        try:
            sched = engine.engine_core.engine_core.scheduler
            assert engine.vllm_config.scheduler_config.async_scheduling is False
            assert type(sched) is built
            engine.add_request("r", {"prompt_token_ids": list(range(10, 50))},
                               SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.0))
            tokens = []
            while engine.has_unfinished_requests():
                for out in engine.step():
                    tokens = out.outputs[0].token_ids
            assert len(tokens) == 6
            assert_no_leaks(sched)
        finally:
            engine.engine_core.shutdown()


def test_engine_kwargs_name_one_class_on_both_platforms():
    assert local.engine_kwargs("m", cpu=True)["scheduler_cls"] == local.engine_kwargs("m", cpu=False)[
        "scheduler_cls"] == "vllm_mars.engine.scheduler.MarsScheduler"


# -- item 3: CPU workarounds only on the CPU build -------------------------------------------------
def test_cpu_settings_only_on_cpu():
    cpu = local.engine_kwargs("m", cpu=True)
    assert (cpu["dtype"], cpu["block_size"], cpu["kv_cache_memory_bytes"]) == ("bfloat16", 32, 256 << 20)
    gpu = local.engine_kwargs("m", cpu=False)
    for key in ("dtype", "block_size", "kv_cache_memory_bytes", "num_gpu_blocks_override", "enforce_eager"):
        assert key not in gpu, key
    mine = local.engine_kwargs("m", cpu=False, block_size=64, dtype="float16", num_blocks=500)
    assert (mine["block_size"], mine["dtype"], mine["num_gpu_blocks_override"]) == (64, "float16", 500)


def test_driver_pool_default_is_cpu_only(monkeypatch):
    cfg = ReplayConfig()
    monkeypatch.setattr(local, "on_cpu", lambda: True)
    assert cfg.engine_num_blocks() == local.DRIVER_CPU_NUM_BLOCKS
    assert cfg.effective_max_model_len() == min(cfg.max_model_len, (local.DRIVER_CPU_NUM_BLOCKS - 1) * 32)
    monkeypatch.setattr(local, "on_cpu", lambda: False)
    assert cfg.engine_num_blocks() is None  # vLLM sizes the pool from free GPU memory
    assert cfg.effective_max_model_len() == cfg.max_model_len
    assert ReplayConfig(num_blocks=0).engine_num_blocks() is None
    assert ReplayConfig(num_blocks=500, block_size=16).effective_max_model_len() == min(2048, 499 * 16)


# -- item 2: engine arguments through, validated ---------------------------------------------------
def test_engine_arg_items_parse_and_validate():
    got = local.parse_engine_arg_items(["tensor-parallel-size=2", "gpu_memory_utilization=0.8",
                                        "kv_offloading_backend=native", "async_scheduling=false"])
    assert got == {"tensor_parallel_size": 2, "gpu_memory_utilization": 0.8,
                   "kv_offloading_backend": "native", "async_scheduling": False}
    for bad, msg in (("tensor_parallel_size", "expected KEY=VALUE"), ("nosuch=1", "not a vLLM 0.32 engine argument"),
                     ("scheduler_cls=x.Y", "not allowed"), ("additional_config={}", "--policy-option")):
        with pytest.raises(ValueError, match=msg):
            local.parse_engine_arg_items([bad])


def test_engine_args_reach_the_server_command():
    args = local.server_args("m", cpu=False, engine_args={"tensor_parallel_size": 2, "async_scheduling": False,
                                                           "enforce_eager": True})
    joined = " ".join(args)
    assert "--tensor-parallel-size 2" in joined and "--no-async-scheduling" in joined and "--enforce-eager" in joined


def test_driver_passes_engine_args_to_the_in_process_engine():
    from vllm_mars.driver.config import RunPlan

    cfg = ReplayConfig(model="m", num_blocks=64, engine_args={"kv_offloading_size": 4, "max_num_seqs": 8})
    backend = RunPlan.of(cfg).make_backend(lambda: 0.0)
    kw = local.engine_kwargs(backend.model, **backend.kwargs)
    assert kw["kv_offloading_size"] == 4 and kw["max_num_seqs"] == 8  # user arguments win
    assert kw["num_gpu_blocks_override"] == 64
    with pytest.raises(ValueError, match="in-process engine"):
        ReplayConfig(backend="http", url="http://x", engine_args={"tensor_parallel_size": 2}).validate()


def test_connector_policy_refused_without_connector():
    with pytest.raises(ValueError, match="none is configured: add --engine-arg kv_offloading_size"):
        local.check_policy_engine("infercept_swap", False, {})
    local.check_policy_engine("infercept_swap", False, {"kv_offloading_size": 4})
    with pytest.raises(ValueError, match="cannot run on the CPU build"):
        local.check_policy_engine("infercept_swap", True, {"kv_offloading_size": 4})


def test_scheduler_refuses_connector_policy_without_connector(monkeypatch):
    """A vLLM server started by hand (no mars launcher) still refuses: the scheduler checks too."""
    import vllm_mars.engine.scheduler as sched_mod

    monkeypatch.setattr(sched_mod, "current_platform", types.SimpleNamespace(device_type="cuda"))
    with pytest.raises(ValueError, match="needs a KV offloading connector and none is configured"):
        make_scheduler("infercept_swap", num_blocks=32)


@pytest.mark.parametrize("argv", [
    ["replay", "--policy", "infercept_swap", "--no-progress"],
    ["replay", "--engine-arg", "nosuch=1"],
    ["compare", "--engine-arg", "scheduler_cls=x"],
    ["serve", "/nonexistent-model", "--engine-arg", "bogus_field=3"],
])
def test_cli_refuses_before_starting(argv, capsys, tmp_path):
    assert main([*argv, "--out", str(tmp_path / "o")] if argv[0] != "serve" else argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "error:" in err[0], err
    assert not (tmp_path / "o").exists()


def test_run_replay_sh_maps_tp_memory_and_length(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "MARS_BIN": "/bin/echo", "TP": "2", "GPU_MEMORY_UTILIZATION": "0.85",
           "MAX_MODEL_LEN": "8192", "ENGINE_ARGS": "kv_offloading_size=4 enforce_eager=true"}
    out = subprocess.run(["bash", str(REPO / "scripts" / "run_replay.sh")], env=env, capture_output=True,
                         text=True, check=True).stdout
    for want in ("--engine-arg tensor_parallel_size=2", "--engine-arg gpu_memory_utilization=0.85",
                 "--max-model-len 8192", "--engine-arg kv_offloading_size=4", "--engine-arg enforce_eager=true"):
        assert want in out, out


# -- item 4: speculative decoding keeps its draft rows; vLLM's lookahead guard keeps its word ------
def _capped(s, cap: int):
    s.mars_policy.caps_chunks = True
    s.mars_policy.chunk_tokens = lambda call, num_computed, num_new: min(num_new, cap)


def test_chunk_cap_spares_decode_steps_with_draft_tokens():
    s = make_scheduler("mars", num_blocks=64, num_spec_tokens=3)
    assert s.num_spec_tokens == 3
    _capped(s, 2)
    s.add_request(make_request("a", prompt_len=9, max_tokens=12))
    decode_rows = []
    while s.has_requests():
        so = s.schedule()
        n = so.num_scheduled_tokens.get("a", 0)
        drafts = so.scheduled_spec_decode_tokens.get("a", [])
        if drafts:
            decode_rows.append(n)
            assert n == 1 + len(drafts), (n, drafts)  # never cut to the prefill cap
        else:
            assert n <= 2  # prefill chunks (and plain decode) stay capped
        out = fake_model_output(s, so)
        s.update_from_output(so, ModelRunnerOutput(req_ids=out.req_ids, req_id_to_index=out.req_id_to_index,
                                                   sampled_token_ids=out.sampled_token_ids))
        if "a" in s.requests and not s.requests["a"].is_prefill_chunk:
            s.update_draft_token_ids(DraftTokenIds(["a"], [[5, 6, 7]]))  # what EngineCore.post_step does
    assert decode_rows and all(n == 4 for n in decode_rows)
    assert_no_leaks(s)


def test_chunk_cap_keeps_vllm_prefill_lookahead_guard():
    s = make_scheduler("mars", num_blocks=64)
    s.num_prefill_lookahead = 3  # what a multi-module MTP drafter with 3 modules sets
    _capped(s, 8)
    s.add_request(make_request("a", prompt_len=18, max_tokens=2))
    ends = []
    while "a" in s.requests:
        r = s.requests["a"]
        before = r.num_computed_tokens
        so = s.schedule()
        n = so.num_scheduled_tokens.get("a", 0)
        if before < r.num_prompt_tokens:
            ends.append(r.num_prompt_tokens - before - n)
        s.update_from_output(so, fake_model_output(s, so))
    while s.has_requests():
        step(s)
    assert ends[-1] == 0 and len(ends) >= 3
    assert all(rem == 0 or rem >= 3 for rem in ends), ends  # never end a chunk inside the lookahead
    assert_no_leaks(s)


def test_setup_driver_check(tmp_path):
    """scripts/setup.sh --check-gpu-only against a fake nvidia-smi (no GPU needed)."""
    fake = tmp_path / "bin"
    fake.mkdir()

    def run(driver: str | None):
        smi = fake / "nvidia-smi"
        if driver is None:
            smi.unlink(missing_ok=True)
        else:
            smi.write_text("#!/bin/sh\ncase \"$*\" in *-L*) echo 'GPU 0: NVIDIA H100 (UUID: x)';; "
                           f"*driver_version*) echo '{driver}';; esac\n")
            smi.chmod(0o755)
        return subprocess.run(["bash", str(REPO / "scripts" / "setup.sh"), "--check-gpu-only"],
                              env={"PATH": f"{fake}:/usr/bin:/bin"}, capture_output=True, text=True, check=False)

    old = run("575.57.08")
    assert old.returncode == 1 and "580" in old.stderr and "575.57.08" in old.stderr, old.stderr
    ok = run("580.65.06")
    assert ok.returncode == 0 and "gpu" in ok.stdout, (ok.stdout, ok.stderr)
    newer = run("590.10")
    assert newer.returncode == 0
    none = run(None)
    assert none.returncode == 0 and "cpu" in none.stdout


@pytest.mark.gpu
def test_gpu_engine_uses_vllm_sizing(tiny_model):
    """On GPU nothing CPU-only is forced: vLLM picks the block size and sizes the pool."""
    from vllm import LLM

    llm = LLM(**local.engine_kwargs(tiny_model, policy="fcfs", cpu=False, gpu_memory_utilization=0.2))
    sched = llm.llm_engine.engine_core.engine_core.scheduler
    assert isinstance(sched, AsyncMarsScheduler)
    assert sched.num_blocks > local.DRIVER_CPU_NUM_BLOCKS  # sized from free GPU memory, not 96
    assert_no_leaks(sched)


@pytest.mark.gpu
def test_gpu_engine_refuses_infercept_swap_without_connector(tiny_model):
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    kw = local.engine_kwargs(tiny_model, policy="fcfs", cpu=False, gpu_memory_utilization=0.2)
    kw["additional_config"] = {"mars": {"policy": "infercept_swap"}}  # a hand-made launch, no connector
    with pytest.raises(Exception, match="needs a KV offloading connector"):
        LLMEngine.from_engine_args(EngineArgs(**kw))
