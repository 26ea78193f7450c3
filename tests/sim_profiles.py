"""A test-only step-time profile (the SIM_INTERFACE ``Profile`` shape) with a linear, hand-checkable cost."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from vllm_mars.costmodel import CostModel


@dataclass(frozen=True)
class LinearProfile:
    """step = overhead + per prefill chunk (a * chunk + b * chunk * context) + per decode (c + d * context)."""

    name: str = "test-linear"
    block_size: int = 16
    max_model_len: int = 4096
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 16
    capacity_tokens: int = 120 * 16
    overhead_s: float = 0.004
    prefill_s_per_token: float = 2e-4
    prefill_s_per_token_context: float = 1e-10
    decode_s: float = 1e-3
    decode_s_per_context: float = 1e-7

    def model_dir(self) -> str:
        from vllm_mars.engine.rig import config_only_model_dir

        return config_only_model_dir()

    def kv_capacity_tokens(self) -> int:
        return self.capacity_tokens

    def num_kv_blocks(self) -> int:
        return self.kv_capacity_tokens() // self.block_size

    def cost_model(self) -> CostModel:
        """The policies' cost model of this profile, fitted to its own step times as
        :meth:`vllm_mars.sim.profile.Profile.cost_model` fits a shipped one."""
        return CostModel.fit_steps(self.step_seconds, budget=self.max_num_batched_tokens,
                                   max_len=self.max_model_len, source=f"fitted to step-time profile {self.name!r}")

    def step_seconds(self, prefill: Sequence[tuple[int, int]], decode: Sequence[int]) -> float:
        t = self.overhead_s
        for chunk, ctx in prefill:
            t += chunk * self.prefill_s_per_token + chunk * ctx * self.prefill_s_per_token_context
        for ctx in decode:
            t += self.decode_s + ctx * self.decode_s_per_context
        return t


@dataclass(frozen=True)
class ConstantProfile(LinearProfile):
    """Every non-empty step takes ``step_s`` (to compare decisions with a fixed-step rig)."""

    name: str = "test-constant"
    step_s: float = 0.0625

    def step_seconds(self, prefill: Sequence[tuple[int, int]], decode: Sequence[int]) -> float:
        return self.step_s


def use_profiles(monkeypatch, *profiles) -> None:
    """Make ``--profile NAME`` resolve to these test profiles (by ``name``) for one test."""
    from vllm_mars.sim import engine as sim_engine

    by_name = {p.name: p for p in profiles}

    def get(name):
        if name not in by_name:
            raise ValueError(f"profile {name!r} unknown; available: {', '.join(by_name)}")
        return by_name[name]

    monkeypatch.setattr(sim_engine, "get_profile", get)
    from vllm_mars.driver import config as driver_config  # the RunPlan resolves profiles there

    if hasattr(driver_config, "get_profile"):
        monkeypatch.setattr(driver_config, "get_profile", get)
