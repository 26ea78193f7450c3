"""Engine-side configuration: ``additional_config["mars"]`` (``--additional-config``).

The dict is flat: engine keys (below) plus the selected policy's own config fields, e.g.
``{"mars": {"policy": "mars", "aging_s": 30}}``. ``MARS_POLICY`` is a fallback for launchers that
cannot pass ``--additional-config``. Unknown keys and unknown policies are a ValueError that names
the valid ones, raised at engine start.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from vllm_mars.costmodel import CostModel
from vllm_mars.policies import config_fields, get_policy_class

ENV_POLICY = "MARS_POLICY"
DEFAULT_POLICY = "fcfs"


@dataclass(frozen=True)
class EngineConfig:
    """What MarsScheduler reads at start."""

    #: Registered policy name (``vllm_mars.policies.available_policies()``).
    policy: str = DEFAULT_POLICY
    #: The policy's own config fields, validated by ``make_policy``.
    policy_options: Mapping[str, Any] = field(default_factory=dict)
    #: A calibrated cost model (``CostModel.as_dict()``) for policies that price work (None: the
    #: scheduler fits one online from its step times, and the policy says it is uncalibrated until then).
    cost_model: CostModel | None = None
    #: Fit the cost model online from the engine's step times while none is given.
    online_cost: bool = True
    #: vLLM tool-call parser name (``hermes``, ``qwen3_coder``, ...): read the tool a finished call
    #: is about to run from its output (:mod:`vllm_mars.engine.next_tool`). None: not read.
    tool_parser: str | None = None

    @property
    def engine_keys(self) -> tuple[str, ...]:
        return ENGINE_KEYS


ENGINE_KEYS = ("policy", "cost_model", "online_cost", "tool_parser")


def parse_engine_config(additional_config: Mapping[str, Any] | None,
                        environ: Mapping[str, str] | None = None) -> EngineConfig:
    """Read ``additional_config["mars"]`` (falling back to ``$MARS_POLICY``) into an EngineConfig."""
    environ = os.environ if environ is None else environ
    raw = (additional_config or {}).get("mars")
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise ValueError(f'additional_config["mars"] must be a JSON object, got {type(raw).__name__}')  # noqa: TRY004  (callers report ValueError as bad config)
    policy = raw.get("policy", environ.get(ENV_POLICY) or DEFAULT_POLICY)
    if not isinstance(policy, str):
        raise ValueError(f'additional_config["mars"]["policy"] must be a string, got {policy!r}')  # noqa: TRY004
    cls = get_policy_class(policy)  # ValueError listing the available policies
    known = set(ENGINE_KEYS) | set(config_fields(cls))
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(
            f'unknown key(s) {unknown} in additional_config["mars"] for policy {policy!r}; '
            f"valid keys: {', '.join(sorted(known))}"
        )
    options = {k: v for k, v in raw.items() if k not in ENGINE_KEYS}
    cost = raw.get("cost_model")
    if cost is not None:
        cost = CostModel.from_dict(cost, where='additional_config["mars"]["cost_model"]')
    online = raw.get("online_cost", True)
    if not isinstance(online, bool):
        raise ValueError(f'additional_config["mars"]["online_cost"] must be true or false, got {online!r}')  # noqa: TRY004
    parser = raw.get("tool_parser")
    if parser is not None and not (isinstance(parser, str) and parser.strip()):
        raise ValueError(f'additional_config["mars"]["tool_parser"] must be a parser name, got {parser!r}')
    if isinstance(parser, str) and parser.lower() == "none":
        parser = None
    return EngineConfig(policy=policy, policy_options=options, cost_model=cost, online_cost=online,
                        tool_parser=parser)


def check_value(name: str, annotation: Any, value: Any, *, minimum: float | None = None,
                maximum: float | None = None, above: float | None = None) -> Any:
    """Check one option against its annotation (``bool``, ``int``, ``float``, ``str``, ``X | None``;
    others pass) and an optional range; ValueError naming ``name``. Floats must be finite: NaN
    passes every ``<`` check, so a range alone never catches it. Returns ``value``."""
    ann = str(getattr(annotation, "__name__", annotation)).replace(" ", "")
    optional = "|None" in ann or "None|" in ann or ann.startswith("Optional[")
    base = ann.replace("|None", "").replace("None|", "").removeprefix("Optional[").removesuffix("]")
    if value is None:
        if optional or base not in _SCALARS:
            return value
        raise ValueError(f"{name} must be {base}, got None")
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    ok = {"bool": isinstance(value, bool), "int": number and isinstance(value, int),
          "float": number, "str": isinstance(value, str)}.get(base, True)
    if not ok:
        raise ValueError(f"{name} must be {base}, got {value!r}")
    if number:
        if not math.isfinite(value):
            raise ValueError(f"{name} must be a finite number, got {value!r}")
        if minimum is not None and value < minimum:
            raise ValueError(f"{name} must be >= {minimum:g}, got {value!r}")
        if above is not None and value <= above:
            raise ValueError(f"{name} must be > {above:g}, got {value!r}")
        if maximum is not None and value > maximum:
            raise ValueError(f"{name} must be <= {maximum:g}, got {value!r}")
    return value


_SCALARS = ("bool", "int", "float", "str")


def check_options(cls: type, options: Mapping[str, Any] | None, *, owner: str = "", context: str = "",
                  convert_lists: bool = False) -> Any:
    """The one options validator: build config dataclass ``cls`` from ``options``.

    Unknown keys, values of the wrong type (a bool where an int is due, an int where a bool is
    due) and non-finite floats are a ValueError naming the key and what is allowed; the
    dataclass's own ``__post_init__`` then checks ranges. ``owner``/``context`` word the unknown-key
    message (``unknown <owner> key(s) [...]<context>; valid keys: ...``). ``convert_lists`` turns
    JSON/TOML lists into tuples (for tuple fields).
    """
    options = dict(options or {})
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(options) - set(fields))
    if unknown:
        what = " ".join(w for w in ("unknown", owner, "key(s)") if w)
        raise ValueError(f"{what} {unknown}{context}; valid keys: {', '.join(fields) or '(none)'}")
    for k, v in options.items():
        check_value(f"{cls.__name__}.{k}", fields[k].type, v)
    if convert_lists:
        options = {k: tuple(v) if isinstance(v, list) else v for k, v in options.items()}
    try:
        return cls(**options)
    except TypeError as e:
        raise ValueError(f"{cls.__name__}: {e}") from None


def check_engine_options(policy: str, policy_options: Mapping[str, Any] | None = None) -> None:
    """Validate a scheduler policy name and its options the way the engine will at start, so a
    launcher (``mars serve``, ``mars replay``) can fail in one line before starting vLLM."""
    from vllm_mars.policies import make_policy

    make_policy(policy, policy_options)


#: Root arrivals per second: finite, at least one arrival per 1,000 s (a run must end), at most 1e6.
RPS_RANGE: dict[str, float] = {"minimum": 1e-3, "maximum": 1e6}


def check_rps(name: str, value: Any) -> float:
    """One arrival rate (a CLI flag, a TOML value, a config field); ValueError naming ``name``."""
    return float(check_value(name, float, value, **RPS_RANGE))


def rps_arg(text: str) -> float:
    """argparse ``type=`` for ``--rps``: checked at parse time (argparse names the flag)."""
    import argparse

    try:
        return check_rps("rps", float(text))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e) if "rps" in str(e) else f"expected a number, got {text!r}") from None


#: Ranges of ReplayConfig's numeric fields (``check_value`` keywords); ``None`` values skip the check.
REPLAY_RANGES: dict[str, dict[str, float]] = {
    "rps": RPS_RANGE,
    "num_workflows": {"minimum": 1, "maximum": 1e7},
    "seed": {"minimum": 0},
    "num_blocks": {"minimum": 0},  # 0: vLLM's own sizing
    "kv_scale": {"above": 0},  # the pool it gives is checked against the profile (sim_num_blocks)
    "block_size": {"minimum": 1, "maximum": 4096},
    "max_model_len": {"minimum": 1},
    "max_num_seqs": {"minimum": 1},
    "max_num_batched_tokens": {"minimum": 1},
    "tool_timeout_s": {"above": 0, "maximum": 86_400},
    "sample_interval_s": {"minimum": 0.01, "maximum": 3600},
    "call_timeout_s": {"above": 0, "maximum": 86_400},
}


def check_fields(obj: Any, ranges: Mapping[str, Mapping[str, float]], prefix: str = "") -> None:
    """``check_value`` on every field of dataclass instance ``obj`` (types from its annotations,
    ranges from ``ranges``); the error names ``prefix + field``."""
    for f in dataclasses.fields(obj):
        check_value(prefix + f.name, f.type, getattr(obj, f.name), **ranges.get(f.name, {}))


def dataclass_doc(cls: type) -> list[tuple[str, Any]]:
    """(field, default) pairs of a config dataclass, for ``mars policies`` listings."""
    out = []
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            out.append((f.name, f.default))
        elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            out.append((f.name, f.default_factory()))  # type: ignore[misc]
        else:
            out.append((f.name, None))
    return out
