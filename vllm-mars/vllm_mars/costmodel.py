"""The one cost model of an engine: seconds per prefill chunk, per rebuild, per decode step.

Used alike by the policies (reload/rebuild cost of a context), the admission controller (the
rebuild cost an admission would cause) and the metrics (a workflow's ideal time alone). Pure
Python: no vllm or torch import.

Model (one engine step, seconds)::

    step = step_overhead_s
         + sum over prefill chunks (n tokens after c context tokens):
               prefill_s_per_token * n + attn_s_per_token_ctx * n * (c + (n - 1) / 2)
         + sum over decoding calls (context c): decode_s + decode_s_per_ctx_token * c

Where it comes from (``source`` says which; ``calibrated`` is False only for the built-in
default, and a policy that runs on that default says so in its log and stats):

* :meth:`CostModel.fit_steps`: fitted to a step-time function (``Profile.cost_model()`` fits its
  ``step_seconds``; ``vllm_mars.sim.profile.load_cost_model`` reads a cost-model JSON or a profile);
* :meth:`CostModel.from_solo_calls`: the driver's calibration by solo calls on the idle engine;
* :class:`OnlineCostFit`: least squares over the engine's own measured step times;
* :meth:`CostModel.from_dict`: the serialised form that travels in ``additional_config["mars"]``
  (``cost_model``) and in admission options.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

DEFAULT_SOURCE = "default (uncalibrated: 2e-4 s/token, a 7-8B model on one datacenter GPU)"


@dataclass(frozen=True)
class CostModel:
    """Seconds of engine work (see the module docstring for the formula)."""

    #: Fixed cost of one engine step (scheduling, launch, sampling).
    step_overhead_s: float = 0.0
    #: Prefill cost per token (the linear, MLP/projection part).
    prefill_s_per_token: float = 2e-4
    #: Attention cost per (new token x context token) pair.
    attn_s_per_token_ctx: float = 0.0
    #: Cost of one decoding call in a step (batch-1 decode step minus the step overhead).
    decode_s: float = 0.0
    #: Extra decode cost per context token.
    decode_s_per_ctx_token: float = 0.0
    #: Fixed cost of a call outside the engine steps (request handling, first-step extras).
    call_overhead_s: float = 0.0
    #: Prefill tokens a step carries for its fixed cost (see :meth:`free_prefill_tokens`); 0: not
    #: measured, the prefill line's intercept over its cost per token.
    free_chunk_tokens: float = 0.0
    #: Where the numbers came from.
    source: str = DEFAULT_SOURCE
    #: False only for the built-in default.
    calibrated: bool = False

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.name in ("source", "calibrated"):
                continue
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (v >= 0) or math.isinf(v):
                raise ValueError(f"cost model field {f.name!r} must be a finite number >= 0, got {v!r}")
        if self.prefill_s_per_token + self.attn_s_per_token_ctx <= 0:
            raise ValueError("cost model: prefill_s_per_token and attn_s_per_token_ctx are both 0 (free prefill)")
        if not isinstance(self.source, str) or not isinstance(self.calibrated, bool):
            raise ValueError("cost model: 'source' must be a string and 'calibrated' true or false")  # noqa: TRY004

    # -- queries --------------------------------------------------------------------------------
    def prefill_s(self, tokens: int, context: int = 0) -> float:
        """Seconds to compute ``tokens`` new tokens after ``context`` tokens already in KV."""
        if tokens <= 0:
            return 0.0
        return tokens * (self.prefill_s_per_token + self.attn_s_per_token_ctx * (context + (tokens - 1) / 2))

    def rebuild_s(self, tokens: int) -> float:
        """Seconds to recompute a lost context of ``tokens`` tokens from scratch."""
        return self.prefill_s(tokens, 0)

    def decode_step_s(self, context: int = 0) -> float:
        """One decoding call's share of a step at ``context`` tokens (no step overhead)."""
        return self.decode_s + self.decode_s_per_ctx_token * max(context, 0)

    def free_prefill_tokens(self) -> int:
        """Prefill tokens a step's fixed cost is worth: where the prefill's linear cost reaches
        the fixed part of its step (on a GPU mostly the weight read every step pays, which a chunk
        of up to this many tokens rides nearly free; on a CPU overhead, which such a chunk at most
        doubles). ``free_chunk_tokens`` when measured (:meth:`fit_steps`; :meth:`from_solo_calls`
        with a mid-size prompt), else the intercept of the prefill line
        (the step overhead plus a call's fixed part, whichever the fit filled) over its cost per
        token. Decides how far a prefill chunk grows beside running decodes."""
        if self.free_chunk_tokens > 0:
            return int(self.free_chunk_tokens)
        return int((self.step_overhead_s + self.call_overhead_s) / self.prefill_s_per_token)

    def step_s(self, prefill: Sequence[tuple[int, int]] = (), decode: Sequence[int] = ()) -> float:
        """One engine step: ``prefill`` = (chunk tokens, context before it), ``decode`` = contexts."""
        return (self.step_overhead_s + sum(self.prefill_s(n, c) for n, c in prefill)
                + sum(self.decode_step_s(c) for c in decode))

    def call_s(self, new_prompt_tokens: int, output_tokens: int, context: int = 0) -> float:
        """A call alone on an idle engine: one prefill step of the uncached prompt (after
        ``context`` cached tokens), then ``output_tokens - 1`` decode steps."""
        new = max(new_prompt_tokens, 0)
        total = context + new
        steps = max(output_tokens - 1, 0)
        return (self.call_overhead_s + self.step_overhead_s + self.prefill_s(new, context)
                + steps * (self.step_overhead_s + self.decode_s)
                + self.decode_s_per_ctx_token * (steps * total + steps * (steps - 1) / 2))

    # -- serialisation ----------------------------------------------------------------------------
    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str = "cost model") -> CostModel:
        """From :meth:`as_dict` output; unknown keys are a ValueError naming ``where`` and the valid ones."""
        if not isinstance(d, Mapping):
            raise ValueError(f"{where} must be a JSON object, got {type(d).__name__}")  # noqa: TRY004
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"{where}: unknown key(s) {unknown}; valid: {', '.join(sorted(known))}")
        d = dict(d)
        d.setdefault("calibrated", "source" in d)
        try:
            return cls(**d)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{where}: {e}") from None

    @classmethod
    def load(cls, path: str) -> CostModel:
        """From a serialised cost model (a JSON object with ``prefill_s_per_token``); ValueError
        naming the file otherwise. A step-time profile gives its cost model through
        ``vllm_mars.sim.profile.load_cost_model`` (this module stands below the profiles)."""
        p = Path(path)
        try:
            d = json.loads(p.read_text())
        except FileNotFoundError:
            raise ValueError(f"{path}: no such cost-model file") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{path}:{getattr(e, 'lineno', 1)}: not JSON: {getattr(e, 'msg', e)}") from None
        if not (isinstance(d, dict) and "prefill_s_per_token" in d):
            raise ValueError(f"{path}: not a serialised cost model (no 'prefill_s_per_token'; a step-time "
                             "profile gives one through vllm_mars.sim.profile.load_cost_model)")
        return cls.from_dict(d, where=str(path))

    # -- constructors -----------------------------------------------------------------------------
    @classmethod
    def from_solo_calls(cls, short: tuple[int, float], long: tuple[int, float], long_decode: tuple[int, float],
                        source: str = "calibrated by solo calls", mid: tuple[int, float] | None = None) -> CostModel:
        """From solo latencies: (prompt P1, t(P1, 1 token)), (P2, t(P2, 1)), (outputs N, t(P2, N)).

        Linear prefill; the one-token call's fixed part is ``call_overhead_s`` and each further
        output token costs ``decode_s`` (solo calls cannot split it from the step overhead).
        With ``mid`` = (Pm, t(Pm, 1)), P1 < Pm < P2, ``free_chunk_tokens`` is measured too, on the
        line through the short and the mid prefill (the long one's attention makes its line steeper
        and its knee too early): that line's intercept over its slope.
        """
        (p1, t1), (p2, t2), (n, t3) = short, long, long_decode
        if p2 <= p1 or n <= 1:
            raise ValueError("from_solo_calls needs P2 > P1 and N > 1")
        a = max((t2 - t1) / (p2 - p1), 1e-9)
        c = max(t1 - a * p1, 0.0)
        per_step = max((t3 - t2) / (n - 1), 0.0)
        free = 0.0
        if mid is not None:
            if not p1 < mid[0] < p2:
                raise ValueError("from_solo_calls needs P1 < Pm < P2")
            free = _free_tokens(short, mid)
        return cls(prefill_s_per_token=a, decode_s=per_step, call_overhead_s=c, free_chunk_tokens=free,
                   source=source, calibrated=True)

    @classmethod
    def fit_prefill(cls, samples: Iterable[tuple[int, float]], quadratic: bool = False,
                    source: str = "fitted to (tokens, seconds) prefill samples") -> CostModel:
        """Least squares of ``overhead + a * n (+ b * n * (n - 1) / 2)`` over measured prefills of
        ``n`` tokens from an empty context; negative coefficients are clipped to 0."""
        rows = [((1.0, float(n), n * (n - 1) / 2.0) if quadratic else (1.0, float(n)), float(t))
                for n, t in samples]
        need = 3 if quadratic else 2
        if len(rows) < need:
            raise ValueError(f"need at least {need} (tokens, seconds) samples, got {len(rows)}")
        coef = _lstsq(rows)
        return cls(step_overhead_s=coef[0], prefill_s_per_token=max(coef[1], 1e-12),
                   attn_s_per_token_ctx=coef[2] if quadratic else 0.0, source=source, calibrated=True)

    @classmethod
    def fit_steps(cls, step: Callable[[Sequence[tuple[int, int]], Sequence[int]], float], *, budget: int = 8192,
                  max_len: int = 32768, source: str = "fitted to a step-time function") -> CostModel:
        """Fit to a step-time function ``step(prefill=[(chunk, ctx)], decode=[ctx, ...])`` (a
        profile's ``step_seconds``: ``Profile.cost_model()``).

        Samples single-chunk prefill steps over the step budget and contexts up to ``max_len``, and
        single-decode steps, then least squares on the model's features.
        """
        budget = max(int(budget), 16)
        max_len = max(int(max_len), 2 * budget)
        rows = []
        for n in sorted({16, budget // 8, budget // 4, budget // 2, budget}):
            for c in (0, max_len // 8, max_len // 2):
                rows.append(((1.0, float(n), n * (c + (n - 1) / 2.0)), float(step([(n, c)], []))))
        overhead, a, b = _lstsq(rows)
        drows = []
        for c in (16, max_len // 4, max_len // 2, max_len - 1):
            drows.append(((1.0, float(c)), float(step([], [c])) - overhead))
        d0, d1 = _lstsq(drows)
        short, mid = min(32, budget // 4), budget // 2
        free = _free_tokens((short, step([(short, 0)], [])), (mid, step([(mid, 0)], [])))
        return cls(step_overhead_s=overhead, prefill_s_per_token=max(a, 1e-12), attn_s_per_token_ctx=b,
                   decode_s=d0, decode_s_per_ctx_token=d1, free_chunk_tokens=free, source=source, calibrated=True)


def _free_tokens(short: tuple[int, float], mid: tuple[int, float]) -> float:
    """Prefill tokens a step's fixed cost is worth, from two prefills of (tokens, seconds): the
    line through them, its intercept over its slope (0 when either is not positive). A short and a
    mid-size prefill: the attention of a long one steepens the line and puts the knee too early."""
    (p1, t1), (pm, tm) = short, mid
    slope = (tm - t1) / (pm - p1)
    fixed = t1 - slope * p1
    return fixed / slope if slope > 1e-12 and fixed > 0 else 0.0


def _lstsq(rows: Sequence[tuple[Sequence[float], float]]) -> list[float]:
    """Non-negative least squares over (features, seconds) rows (tiny systems)."""
    k = len(rows[0][0])
    xtx = [[sum(x[i] * x[j] for x, _ in rows) for j in range(k)] for i in range(k)]
    xty = [sum(x[i] * t for x, t in rows) for i in range(k)]
    coef = _solve_nonneg(xtx, xty)
    if coef is None:
        raise ValueError("degenerate samples: need distinct token counts")
    return coef


class OnlineCostFit:
    """Learns a :class:`CostModel` from the engine's own step times (exponentially forgotten
    least squares over ``[1, prefill tokens, attention pairs, decoding calls]``).

    ``observe`` is called once per executed step; :meth:`model` returns None until ``min_steps``
    steps were seen, ``min_steps // 4`` of them with prefill work. It refits only while the steps
    it still remembers hold prefill work (a forgotten count of at least ``min_steps // 8``), and
    keeps the last model when a refit finds no linear prefill cost (the remembered chunks all of
    long contexts, where it is collinear with attention): such a refit prices a short chunk at
    nothing and puts the prefill knee at billions of tokens (5 % of the refits of an ILR-3 run on
    the H200 MoE profile, ``benchmark/perf/online_knee.py``).
    """

    _K = 4

    def __init__(self, min_steps: int = 32, forget: float = 0.995) -> None:
        self.min_steps = min_steps
        self.forget = forget
        self.steps = 0
        self._prefill_steps = 0
        self._prefill_weight = 0.0  # prefill steps, forgotten like the sums
        self._xtx = [[0.0] * self._K for _ in range(self._K)]
        self._xty = [0.0] * self._K
        self._cached: CostModel | None = None
        self._dirty = 0

    def observe(self, seconds: float, prefill: Iterable[tuple[int, int]], num_decode: int) -> None:
        if not seconds > 0:
            return
        n = pairs = 0.0
        for chunk, ctx in prefill:
            n += chunk
            pairs += chunk * (ctx + (chunk - 1) / 2.0)
        if n == 0 and num_decode == 0:
            return
        x = (1.0, n, pairs, float(num_decode))
        lam = self.forget
        for i in range(self._K):
            self._xty[i] = lam * self._xty[i] + x[i] * seconds
            row = self._xtx[i]
            for j in range(self._K):
                row[j] = lam * row[j] + x[i] * x[j]
        self.steps += 1
        self._prefill_steps += n > 0
        self._prefill_weight = lam * self._prefill_weight + (n > 0)
        self._dirty += 1

    def model(self) -> CostModel | None:
        if self.steps < self.min_steps or self._prefill_steps < self.min_steps // 4:
            return None
        if self._cached is not None and (self._dirty < 16 or self._prefill_weight < self.min_steps // 8):
            return self._cached
        coef = _solve_nonneg(self._xtx, self._xty)
        if coef is None or coef[1] + coef[2] <= 0 or (coef[1] <= 0 and self._cached is not None):
            # (a refit whose remembered prefills cannot separate the linear cost from attention,
            # long-context chunks alike, would price a short chunk at nothing: the last model stands)
            return self._cached
        self._dirty = 0
        self._cached = CostModel(step_overhead_s=coef[0], prefill_s_per_token=max(coef[1], 1e-12),
                                 attn_s_per_token_ctx=coef[2], decode_s=coef[3],
                                 source=f"online fit of {self.steps} engine step times", calibrated=True)
        return self._cached


def _solve_nonneg(xtx: list[list[float]], xty: list[float]) -> list[float] | None:
    """Solve the normal equations (diagonally scaled); a column whose coefficient goes negative is
    dropped and the rest refitted. None when the system is singular."""
    k = len(xty)
    active = list(range(k))
    while active:
        scale = [math.sqrt(xtx[i][i]) or 1.0 for i in range(k)]
        m = len(active)
        a = [[xtx[i][j] / (scale[i] * scale[j]) for j in active] + [xty[i] / scale[i]] for i in active]
        for i in range(m):
            a[i][i] += 1e-9
        ok = True
        for i in range(m):
            p = max(range(i, m), key=lambda r: abs(a[r][i]))
            a[i], a[p] = a[p], a[i]
            if abs(a[i][i]) < 1e-12:
                ok = False
                break
            for r in range(m):
                if r != i:
                    f = a[r][i] / a[i][i]
                    for c in range(i, m + 1):
                        a[r][c] -= f * a[i][c]
        if not ok:
            return None
        coef = {col: a[i][m] / a[i][i] / scale[col] for i, col in enumerate(active)}
        neg = [c for c in active if coef[c] < 0]
        if not neg:
            return [coef.get(i, 0.0) for i in range(k)]
        active.remove(min(neg, key=lambda c: coef[c] * scale[c]))
    return [0.0] * k  # every coefficient fitted negative: nothing above zero to explain


def from_polynomial(per_token: float, per_token2: float = 0.0, const: float = 0.0, source: str = "",
                    calibrated: bool = True) -> CostModel:
    """``T(C) = const + per_token * C + per_token2 * C^2`` (the baselines' published form) as a
    CostModel: ``const`` is the step overhead, ``per_token2`` the attention term (``attn = 2 *
    per_token2``, so ``rebuild_s(C) = per_token * C + per_token2 * C * (C - 1)``)."""
    return CostModel(step_overhead_s=const, prefill_s_per_token=per_token, attn_s_per_token_ctx=2 * per_token2,
                     source=source or "polynomial prefill model", calibrated=calibrated)


def uncalibrated() -> CostModel:
    """The built-in default (callers must say so when they run on it)."""
    return CostModel()


def with_source(model: CostModel, source: str) -> CostModel:
    return replace(model, source=source)
