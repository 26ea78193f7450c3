"""Fit a profile's efficiency coefficients to timed engine steps (numpy only).

Each timed step is ``seconds = o + s*n_seq + u*F_lin/P + ua*F_attn/P + v*B/W + fixed`` where each part
(linear layers, each attention part) contributes its FLOPs or its bytes, whichever bound it (the
roofline max). For a fixed assignment of parts to "compute" or "memory" the model is linear in the
non-negative unknowns (o, s, u = 1/mfu, ua = 1/attn_mfu, v = 1/bw_eff), solved by exact NNLS
(every subset of columns; there are five) on relative errors (rows weighted by 1/seconds). The
assignment is then recomputed with the new coefficients, until it stops changing.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from vllm_mars.sim.profile import Efficiency, Profile

#: efficiency written for a term the data show to be free (coefficient 0): effectively infinite speed
FREE = 1e6
COLUMNS = ("step_overhead_s", "per_seq_overhead_s", "1/mfu", "1/attn_mfu", "1/bw_eff")


@dataclass(frozen=True)
class Sample:
    """One timed step and what was scheduled in it; ``label`` names its grid point."""

    prefill: tuple[tuple[int, int], ...]
    decode: tuple[int, ...]
    seconds: float
    label: str = ""


@dataclass(frozen=True)
class PointError:
    label: str
    steps: int
    measured_s: float
    predicted_s: float

    @property
    def rel_err(self) -> float:
        return (self.predicted_s - self.measured_s) / self.measured_s


@dataclass(frozen=True)
class FitResult:
    profile: Profile
    points: list[PointError]
    #: root-mean-square relative error over all steps
    rms_rel_err: float
    iterations: int

    def table(self) -> str:
        lines = [f"{'grid point':32s} {'steps':>5s} {'measured ms':>12s} {'model ms':>10s} {'error':>8s}"]
        for p in self.points:
            lines.append(f"{p.label:32s} {p.steps:5d} {p.measured_s * 1e3:12.3f} {p.predicted_s * 1e3:10.3f} "
                         f"{p.rel_err * 100:+7.1f}%")
        lines.append(f"rms relative error over all steps: {self.rms_rel_err * 100:.1f}%")
        return "\n".join(lines)


def nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Exact non-negative least squares for a few columns: the best feasible subset solution."""
    n = a.shape[1]
    live = [j for j in range(n) if np.any(a[:, j])]
    best, best_res = np.zeros(n), float(np.sum(b * b))
    for r in range(1, len(live) + 1):
        for cols in itertools.combinations(live, r):
            x, *_ = np.linalg.lstsq(a[:, cols], b, rcond=None)
            if np.any(x < 0):
                continue
            res = float(np.sum((a[:, cols] @ x - b) ** 2))
            if res < best_res:
                best_res, best = res, np.zeros(n)
                best[list(cols)] = x
    return best


def _design(profile: Profile, samples: Sequence[Sample], coef: np.ndarray) -> tuple[np.ndarray, np.ndarray, tuple]:
    hw = profile.hardware
    peak, bw = hw.peak_flops * hw.tp, hw.hbm_bandwidth * hw.tp
    _, _, u, ua, v = coef
    rows, fixed, assign = [], [], []
    for smp in samples:
        t = profile.step_terms(smp.prefill, smp.decode)
        lin_c = attn_c = mem = 0.0
        lin_compute = u * t.lin_flops / peak >= v * t.lin_bytes / bw
        if lin_compute:
            lin_c += t.lin_flops / peak
        else:
            mem += t.lin_bytes / bw
        marks = [lin_compute]
        for flops, bytes_ in t.attn:
            compute = ua * flops / peak >= v * bytes_ / bw
            marks.append(compute)
            if compute:
                attn_c += flops / peak
            else:
                mem += bytes_ / bw
        rows.append((1.0, float(t.n_seq), lin_c, attn_c, mem))
        fixed.append(t.fixed_s)
        assign.append(tuple(marks))
    return np.array(rows), np.array(fixed), tuple(assign)


def _efficiency(coef: np.ndarray, a: np.ndarray, prior: Efficiency, source: str) -> Efficiency:
    o, s, u, ua, v = (float(x) for x in coef)
    used = [bool(np.any(a[:, j])) for j in range(a.shape[1])]
    if not used[3]:
        ua = u  # no compute-bound attention in the data: attention compute at the linear layers' rate
    if not used[2]:
        u = ua

    def eff(x: float, prior_value: float) -> float:
        if x > 0:
            return 1.0 / x
        return FREE if prior_value else prior_value

    return Efficiency(mfu=eff(u, prior.mfu), bw_eff=eff(v, prior.bw_eff),
                      attn_mfu=eff(ua, prior.attn_mfu or prior.mfu), step_overhead_s=o,
                      per_seq_overhead_s=s, source=source)


def fit_profile(base: Profile, samples: Sequence[Sample], *, source: str = "", max_iter: int = 30) -> FitResult:
    """Fit ``base``'s efficiency to ``samples``; returns the fitted profile and its per-point errors."""
    samples = [s for s in samples if s.seconds > 0 and (s.prefill or s.decode)]
    if len(samples) < len(COLUMNS):
        raise ValueError(f"need at least {len(COLUMNS)} timed steps to fit, got {len(samples)}")
    e = base.efficiency
    coef = np.array([e.step_overhead_s, e.per_seq_overhead_s, 1 / e.mfu, 1 / (e.attn_mfu or e.mfu), 1 / e.bw_eff])
    y = np.array([s.seconds for s in samples])
    w = 1.0 / y
    seen = set()
    it = 0
    for it in range(1, max_iter + 1):
        a, fixed, assign = _design(base, samples, coef)
        coef = nnls(a * w[:, None], (y - fixed) * w)
        if assign in seen:
            break
        seen.add(assign)
    a, _, _ = _design(base, samples, coef)
    fitted = base.with_efficiency(_efficiency(coef, a, e, source))
    pred = np.array([fitted.step_seconds(s.prefill, s.decode) for s in samples])
    rel = (pred - y) / y
    rms = math.sqrt(float(np.mean(rel ** 2)))
    by_label: dict[str, list[int]] = {}
    for i, s in enumerate(samples):
        by_label.setdefault(s.label, []).append(i)
    points = [PointError(label, len(ix), statistics.median(y[ix]), statistics.median(pred[ix]))
              for label, ix in by_label.items()]
    src = f"{source}; rms relative step error {rms * 100:.1f}% over {len(samples)} steps".lstrip("; ")
    fitted = fitted.with_efficiency(_efficiency(coef, a, e, src))
    return FitResult(fitted, points, rms, it)
