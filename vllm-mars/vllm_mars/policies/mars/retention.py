"""Adaptive KV retention across tool calls (``retention``): a finished, non-final turn keeps its
KV for the tau that maximises ``P(gap <= tau) * saving - tau * cost``, from learned return gaps (per
tool: the one the turn is about to run when known, else the previous one; then per workflow, then
all: :mod:`vllm_mars.policies.gaps`). With ``value_retention`` the saving is the rebuild time times
the calls it stalls and, under pressure, the cost is the waiting calls the blocks would serve;
without it, a memory cost and no retention when free blocks are scarce (``min_free_fraction``)."""

from __future__ import annotations

from vllm_mars.policies.base import CallView, Policy
from vllm_mars.policies.gaps import GapSamples, GapTracker, gap_tool
from vllm_mars.policies.mars.config import MarsConfig


class MarsRetention(Policy):
    """The retention half of :class:`~vllm_mars.policies.mars.MarsPolicy`."""

    config: MarsConfig
    gaps: GapTracker

    def _gap_samples(self, call: CallView) -> GapSamples | None:
        # The tool about to run (else the previous one), else this workflow's own gaps, else all.
        return self.gaps.samples(tool=gap_tool(call), workflow=call.workflow.workflow,
                                 min_samples=self.config.min_gap_samples, tool_first=True)

    def _pressure(self) -> tuple[int, int, int]:
        """(blocks the waiting calls lack beyond the free ones, waiting calls, running calls), with
        the finishing call's blocks still held."""
        engine = self.engine
        bs = engine.block_size
        waiting = engine.waiting_calls()
        need = sum(-(-c.remaining_prefill // bs) for c in waiting)
        return need - engine.free_blocks(), len(waiting), len(engine.running_calls())

    def choose_retention(self, call: CallView, num_blocks: int) -> tuple[float, float]:
        """(tau seconds, expected net value) for keeping ``num_blocks`` of ``call``.

        Value = ``P(gap <= tau) * saving - tau * cost_per_s``. With ``value_retention`` both are in
        call-seconds: the saving is the rebuild time (cost model) times the calls it stalls (the
        returning call and the running batch); under pressure (waiting calls lack blocks) the cost
        per second is the waiting calls those blocks would serve (their share of the deficit);
        without pressure, the pool-share memory cost. Without ``value_retention``: the rebuild time
        against the memory cost, and no retention below ``min_free_fraction`` free.
        """
        cfg = self.config
        engine = self.engine
        total = max(engine.num_blocks, 1)
        # Once released, this call's blocks would be free (evictable) again.
        free_after = engine.free_blocks() + num_blocks
        reload_s = self.cost.rebuild_s(call.num_tokens)
        # Memory cost per second held: the share of the pool held, scaled by pressure (used over
        # free once this call's blocks are released): ~0 on an idle engine, steep near full.
        free_frac = free_after / total
        cost_per_s = cfg.memory_cost_weight * (num_blocks / total) * (1.0 - min(free_frac, 1.0)) / free_frac
        if cfg.value_retention:
            deficit, n_waiting, n_running = self._pressure()
            reload_s *= 1 + n_running
            if deficit > 0 and n_waiting:
                # Each second held keeps min(blocks, deficit) blocks from the waiting calls.
                cost_per_s = n_waiting * min(num_blocks, deficit) / max(deficit, 1)
        elif (free_after - num_blocks) / total < cfg.min_free_fraction:
            return 0.0, 0.0
        samples = self._gap_samples(call)
        if samples is None:
            tau = min(cfg.cold_start_tau_s, cfg.max_retention_s)
            value = reload_s - tau * cost_per_s
            return (tau, value) if tau > 0 and value > 0 else (0.0, 0.0)
        best_tau, best = 0.0, 0.0
        gaps = samples.values()  # sorted
        n = len(gaps)
        for i, tau in enumerate(gaps):
            if tau > cfg.max_retention_s:
                break
            if i + 1 < n and gaps[i + 1] == tau:
                continue  # P(gap <= tau) counts all equal samples
            v = (i + 1) / n * reload_s - tau * cost_per_s
            if v > best:
                best_tau, best = tau, v
        return best_tau, best

    def retention_s(self, call: CallView, num_blocks: int) -> float:
        if not self.config.retention:
            return 0.0
        tau, value = self.choose_retention(call, num_blocks)
        call.state.retention_value = value
        if tau <= 0:
            return 0.0
        # A small margin over the chosen gap: the return is observed at arrival, then scheduled.
        return tau * 1.05 + 1e-3

    def retention_value(self, call: CallView, num_blocks: int) -> float:
        return call.state.retention_value
