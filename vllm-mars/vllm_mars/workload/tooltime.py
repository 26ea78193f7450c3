"""Tool-time model: a lognormal mixture whose components are tools.

Our operationalisation (SPEC section 5 leaves the shape open): each tool is a lognormal
component whose *mean* is fixed to a published per-tool mean (AgentCgroup's Claude-Code-on-
SWE-bench measurements: Bash 5.88 s, Read 0.08 s, Edit 0.04 s, Grep 0.05 s, WebFetch 15.6 s),
plus one free component (``long``: builds, test suites, waits) whose mean is fitted. The weights
and spreads (sigma of log time) are fitted by EM to the gaps between calls in the agentic-coding
traces of the public ``callanjfox/kv-cache-tester`` repository (``traces/``, 40 files) (gap = t[k+1] - t[k] - api_time[k], gaps above
``max_gap_s`` dropped as user idle). Every named tool keeps at least ``min_weight`` so each tool
still appears. :data:`WEKA_TOOL_MIX` holds the fitted result; ``tests/test_workload.py`` refits it
from the 40 traces' gaps (``tests/data/weka_gaps.json``) and checks the constants.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ToolSpec:
    """One mixture component."""

    #: Tool name (sent as ``mars_tool``).
    name: str
    #: Mixture weight (normalised over the catalogue).
    weight: float
    #: Mean tool time in seconds (the lognormal's mean, not its median).
    mean_s: float
    #: Sigma of log(time).
    sigma: float

    @property
    def mu(self) -> float:
        return math.log(self.mean_s) - self.sigma ** 2 / 2

    @property
    def median_s(self) -> float:
        return math.exp(self.mu)

    def sample(self, rng: random.Random) -> float:
        return rng.lognormvariate(self.mu, self.sigma)


#: Published per-tool means (seconds) that the fit keeps fixed; ``long`` is fitted freely.
PUBLISHED_MEANS: dict[str, float] = {"read": 0.08, "edit": 0.04, "grep": 0.05, "bash": 5.88, "web_fetch": 15.6}

#: Result of ``fit_tool_mixture(list(weka.iter_gaps("<kv-cache-tester>/traces")))`` (40 traces, 1066 gaps in (0, 300] s):
#: mixture median 8.1 s and p90 52 s vs the data's 8.6 s and 63 s.
WEKA_TOOL_MIX: tuple[ToolSpec, ...] = (
    ToolSpec("read", 0.019, 0.08, 0.5),
    ToolSpec("edit", 0.019, 0.04, 0.5),
    ToolSpec("grep", 0.019, 0.05, 0.5),
    ToolSpec("bash", 0.256, 5.88, 0.277),
    ToolSpec("web_fetch", 0.604, 15.6, 0.81),
    ToolSpec("long", 0.084, 144.182, 0.381),
)


@dataclass(frozen=True)
class ToolMix:
    """Sample (tool name, seconds) from a catalogue of ToolSpecs."""

    tools: tuple[ToolSpec, ...] = WEKA_TOOL_MIX
    #: Multiplies every sampled time (e.g. 0.1 for quick CPU runs).
    time_scale: float = 1.0
    #: Sampled times are clipped to [min_s, max_s] after scaling.
    min_s: float = 0.0
    max_s: float = 300.0

    def __post_init__(self) -> None:
        if not self.tools:
            raise ValueError("ToolMix.tools must not be empty")
        if any(t.weight < 0 or t.mean_s <= 0 or t.sigma <= 0 for t in self.tools):
            raise ValueError("ToolMix.tools: weight >= 0, mean_s > 0 and sigma > 0 are required")
        if self.min_s < 0 or self.max_s < self.min_s:
            raise ValueError(f"ToolMix: need 0 <= min_s <= max_s, got {self.min_s}, {self.max_s}")

    def sample(self, rng: random.Random) -> tuple[str, float]:
        tool = rng.choices(self.tools, weights=[t.weight for t in self.tools])[0]
        s = tool.sample(rng) * self.time_scale
        return tool.name, min(max(s, self.min_s), self.max_s)


# ---------------------------------------------------------------------- fitting
def _norm_logpdf(y: float, m: float, s: float) -> float:
    return -math.log(s) - 0.5 * math.log(2 * math.pi) - (y - m) ** 2 / (2 * s * s)


def _best_sigma(ys: Sequence[float], rs: Sequence[float], log_mean: float | None) -> tuple[float, float]:
    """M-step for one component: (mu, sigma) maximising the weighted log-likelihood.

    With ``log_mean`` fixed (the lognormal mean is published), mu = log_mean - sigma^2 / 2 and
    sigma is found by golden-section search; otherwise the closed-form weighted moments.
    """
    w = sum(rs)
    if log_mean is None:
        m = sum(r * y for r, y in zip(rs, ys)) / w
        v = sum(r * (y - m) ** 2 for r, y in zip(rs, ys)) / w
        return m, max(math.sqrt(v), 0.05)

    def nll(s: float) -> float:
        m = log_mean - s * s / 2
        return -sum(r * _norm_logpdf(y, m, s) for r, y in zip(rs, ys) if r > 1e-12)

    lo, hi = 0.05, 3.0
    g = (math.sqrt(5) - 1) / 2
    a, b = hi - g * (hi - lo), lo + g * (hi - lo)
    fa, fb = nll(a), nll(b)
    for _ in range(40):
        if fa < fb:
            hi, b, fb = b, a, fa
            a = hi - g * (hi - lo)
            fa = nll(a)
        else:
            lo, a, fa = a, b, fb
            b = lo + g * (hi - lo)
            fb = nll(b)
    s = (lo + hi) / 2
    return log_mean - s * s / 2, s


def fit_tool_mixture(gaps: Sequence[float], means: dict[str, float] | None = None,
                     min_weight: float = 0.02, iters: int = 60) -> tuple[ToolSpec, ...]:
    """EM fit of fixed-mean tool components plus one free ``long`` component to ``gaps`` (s)."""
    means = dict(PUBLISHED_MEANS if means is None else means)
    ys = [math.log(g) for g in gaps if g > 0]
    if len(ys) < 10:
        raise ValueError(f"need at least 10 positive gaps to fit, got {len(ys)}")
    names = [*means, "long"]
    fixed = [math.log(means[n]) for n in means] + [None]
    ys_sorted = sorted(ys)
    mu = [lm - 0.125 for lm in fixed[:-1]] + [ys_sorted[int(0.9 * len(ys))]]
    sig = [0.5] * len(names)
    wts = [1.0 / len(names)] * len(names)
    for _ in range(iters):
        resp = [[0.0] * len(ys) for _ in names]
        for i, y in enumerate(ys):
            lps = [math.log(max(wts[j], 1e-300)) + _norm_logpdf(y, mu[j], sig[j]) for j in range(len(names))]
            top = max(lps)
            ps = [math.exp(lp - top) for lp in lps]
            z = sum(ps)
            for j in range(len(names)):
                resp[j][i] = ps[j] / z
        for j in range(len(names)):
            wj = sum(resp[j])
            wts[j] = wj / len(ys)
            if wts[j] >= min_weight:  # a component the data barely touches keeps its prior spread
                mu[j], sig[j] = _best_sigma(ys, resp[j], fixed[j])
        # every named tool keeps min_weight; renormalise
        wts = [max(w, min_weight) for w in wts]
        z = sum(wts)
        wts = [w / z for w in wts]
    out = []
    for j, n in enumerate(names):
        mean = means[n] if n in means else math.exp(mu[j] + sig[j] ** 2 / 2)
        out.append(ToolSpec(n, round(wts[j], 3), round(mean, 3), round(sig[j], 3)))
    return tuple(out)


def mixture_quantile(tools: Sequence[ToolSpec], q: float, n: int = 20000, seed: int = 0) -> float:
    """Monte-Carlo quantile of a mixture (used by tests and docs)."""
    mix = ToolMix(tuple(tools), max_s=float("inf"))
    rng = random.Random(seed)
    xs = sorted(mix.sample(rng)[1] for _ in range(n))
    return xs[min(int(q * n), n - 1)]
