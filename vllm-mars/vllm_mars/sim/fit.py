"""Fit a profile's efficiency coefficients to timed engine steps (numpy only).

Each timed step is ``seconds = o + s*n_seq + u*F_lin/P + ua*F_attn/P + v*B/W + fixed`` where each part
(linear layers, each attention part) contributes its FLOPs or its bytes, whichever bound it (the
roofline max). For a fixed assignment of parts to "compute" or "memory" the model is linear in the
non-negative unknowns (o, s, u = 1/mfu, ua = 1/attn_mfu, v = 1/bw_eff), solved by exact NNLS
(every subset of columns; there are five) on relative errors: rows weighted by 1/(the model's time
for the step, from the round before), so the fit estimates each batch's mean time, which a run's
total time adds up (weights of 1/measured seconds favour the steps that happened to run fast: the
fit came out 2-5 % under the grid's total time on a quiet machine); and by Huber weights of the
gross outliers only (residuals over ``HUBER_K`` robust sigmas: steps stalled by another job on a
shared machine). The assignment is then recomputed with the new coefficients, until it stops changing.
"""

from __future__ import annotations

import itertools
import json
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from vllm_mars.backend import Sample
from vllm_mars.sim.profile import Efficiency, Profile

__all__ = ["FitResult", "PointError", "Sample", "fit_profile", "load_samples", "nnls", "step_label", "step_speed"]

#: efficiency written for a term the data show to be free (coefficient 0): effectively infinite speed
FREE = 1e6
#: iteratively re-weighted rounds (at least) before the fit may stop
HUBER_ROUNDS = 6
#: a step's residual beyond this many robust sigmas (1.4826 x the median absolute relative residual)
#: counts less (Huber). 3, not the textbook 1.345: step times are skewed to the right on a quiet
#: machine too (the steps a real run records have the same tail), and a tighter cut trims that tail,
#: which biased the fit 1-3 % under the grid's total time (2026-12-05, `mars profile` grids of
#: benchmark/perf/RESULTS.md "Sim fidelity")
HUBER_K = 3.0
COLUMNS = ("step_overhead_s", "per_seq_overhead_s", "1/mfu", "1/attn_mfu", "1/bw_eff")


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
    #: (predicted total seconds - measured total) / measured total, over all steps
    total_err: float = 0.0

    def table(self) -> str:
        lines = [f"{'grid point':32s} {'steps':>5s} {'measured ms':>12s} {'model ms':>10s} {'error':>8s}"]
        for p in self.points:
            lines.append(f"{p.label:32s} {p.steps:5d} {p.measured_s * 1e3:12.3f} {p.predicted_s * 1e3:10.3f} "
                         f"{p.rel_err * 100:+7.1f}%")
        lines.append(f"rms relative error over all steps: {self.rms_rel_err * 100:.1f}%; error of the total "
                     f"time of all steps: {self.total_err * 100:+.1f}%")
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


def _huber_weights(rel: np.ndarray, k: float = HUBER_K) -> np.ndarray:
    """Huber weights of relative residuals (scale: 1.4826 x median absolute residual), so a few steps
    slowed by another job on the machine do not pull the fit."""
    scale = 1.4826 * float(np.median(np.abs(rel))) or 1.0
    r = np.abs(rel) / scale
    return np.where(r <= k, 1.0, k / np.maximum(r, 1e-12))


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


LOSSES = ("relative", "absolute")


def fit_profile(base: Profile, samples: Sequence[Sample], *, source: str = "", max_iter: int = 30,
                loss: str = "relative") -> FitResult:
    """Fit ``base``'s efficiency to ``samples``; returns the fitted profile and its per-point errors.

    ``loss="relative"``: every step weighs the same in relative terms (to its modelled mean), with
    Huber down-weighting of gross outliers (a grid, where each point matters alike).
    ``loss="absolute"``: least squares on seconds, unbiased for the mean (recorded steps of a real
    run, whose total time is what E2E adds up)."""
    if loss not in LOSSES:
        raise ValueError(f"loss {loss!r} unknown; allowed: {', '.join(LOSSES)}")
    samples = [s for s in samples if s.seconds > 0 and (s.prefill or s.decode)]
    if len(samples) < len(COLUMNS):
        raise ValueError(f"need at least {len(COLUMNS)} timed steps to fit, got {len(samples)}")
    e = base.efficiency
    coef = np.array([e.step_overhead_s, e.per_seq_overhead_s, 1 / e.mfu, 1 / (e.attn_mfu or e.mfu), 1 / e.bw_eff])
    y = np.array([s.seconds for s in samples])
    # relative: 1/(the model's time of the step), starting from the measured time; absolute: one scale
    w = 1.0 / y if loss == "relative" else np.full_like(y, 1.0 / float(np.mean(y)))
    seen = set()
    it = 0
    robust = np.ones_like(y)
    for it in range(1, max_iter + 1):
        a, fixed, assign = _design(base, samples, coef)
        prev, coef = coef, nnls(a * (w * robust)[:, None], (y - fixed) * w * robust)
        settled = True
        if loss == "relative":
            pred = np.maximum(a @ coef + fixed, float(np.min(y)) * 1e-3)
            w = 1.0 / pred
            robust = _huber_weights((pred - y) / pred)
            settled = it >= HUBER_ROUNDS and bool(np.allclose(coef, prev, rtol=1e-4, atol=0.0))
        if assign in seen and settled:
            break
        seen.add(assign)
    a, _, _ = _design(base, samples, coef)
    # measured steps replace any kernel tables: the fitted profile is the roofline with these coefficients
    fitted = base.with_efficiency(_efficiency(coef, a, e, source), kernels=None)
    pred = np.array([fitted.step_seconds(s.prefill, s.decode) for s in samples])
    rel = (pred - y) / y
    rms = math.sqrt(float(np.mean(rel ** 2)))
    by_label: dict[str, list[int]] = {}
    for i, s in enumerate(samples):
        by_label.setdefault(s.label, []).append(i)
    points = [PointError(label, len(ix), statistics.median(y[ix]), statistics.median(pred[ix]))
              for label, ix in by_label.items()]
    total = float(np.sum(pred) / np.sum(y) - 1.0)
    src = (f"{source}; {loss} loss; rms relative step error {rms * 100:.1f}%, total time error {total * 100:+.1f}% "
           f"over {len(samples)} steps").lstrip("; ")
    fitted = fitted.with_efficiency(_efficiency(coef, a, e, src))
    return FitResult(fitted, points, rms, it, total)


def step_speed(profile: Profile, samples: Sequence[Sample]) -> float:
    """How slowly an engine ran against ``profile``: the samples' measured seconds over what the
    profile predicts for the same batches (1: as fast as the profile; 1.3: 30 % slower). Two runs
    of different policies on one box compare by it, the batch mix each policy made priced alike.
    ValueError when no sample has a batch."""
    timed = [s for s in samples if s.prefill or s.decode]
    pred = sum(profile.step_seconds(s.prefill, s.decode) for s in timed)
    if not timed or not pred > 0:
        raise ValueError("no timed steps with a batch to compare against the profile")
    return sum(s.seconds for s in timed) / pred


def step_label(prefill: Sequence[tuple[int, int]], decode: Sequence[int]) -> str:
    """A coarse label of a recorded batch (kind and token count rounded to a power of two)."""
    tokens = sum(c for c, _ in prefill) + len(decode)
    kind = "mixed" if prefill and decode else ("prefill" if prefill else "decode")
    return f"{kind} ~{1 << max(tokens.bit_length() - 1, 0)} tokens"


def load_samples(path: str, run_only: bool = False) -> list[Sample]:
    """Timed steps from a JSON-lines file (``steps.jsonl`` of a run with record_steps, or the
    ``--samples-out`` of ``mars profile``); ValueError naming file:line and field. ``run_only``: without
    the steps a run's calibration took before it (marked ``"calibration": true``)."""
    out: list[Sample] = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{n}"
            try:
                d = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: invalid JSON ({e.msg})") from None
            try:
                prefill = tuple((int(c), int(p)) for c, p in d["prefill"])
                decode = tuple(int(x) for x in d["decode"])
                seconds = float(d["seconds"])
            except KeyError as e:
                raise ValueError(f"{where}: missing field {e.args[0]!r}") from None
            except (TypeError, ValueError):
                raise ValueError(f"{where}: fields prefill ([[chunk, context], ...]), decode ([context, ...]) "
                                 "and seconds (number) expected") from None
            if not seconds > 0:
                raise ValueError(f"{where}: field 'seconds' must be > 0, got {seconds!r}")
            if run_only and d.get("calibration") is True:
                continue
            out.append(Sample(prefill, decode, seconds, str(d.get("label") or step_label(prefill, decode))))
    return out
