"""Engine-side configuration: ``additional_config["mars"]`` (``--additional-config``).

The dict is flat: engine keys (below) plus the selected policy's own config fields, e.g.
``{"mars": {"policy": "mars", "aging_s": 30}}``. ``MARS_POLICY`` is a fallback for launchers that
cannot pass ``--additional-config``. Unknown keys and unknown policies are a ValueError that names
the valid ones, raised at engine start.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from vllm_mars.costmodel import CostModel
from vllm_mars.options import check_value
from vllm_mars.policies import config_fields, get_policy_class, make_policy

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


def check_engine_options(policy: str, policy_options: Mapping[str, Any] | None = None) -> None:
    """Validate a scheduler policy name and its options the way the engine will at start, so a
    launcher (``mars serve``, ``mars replay``) can fail in one line before starting vLLM."""
    make_policy(policy, policy_options)


#: Root arrivals per second: finite, at least one arrival per 1,000 s (a run must end), at most 1e6.
RPS_RANGE: dict[str, float] = {"minimum": 1e-3, "maximum": 1e6}


def check_rps(name: str, value: Any) -> float:
    """One arrival rate (a CLI flag, a TOML value, a config field); ValueError naming ``name``."""
    return float(check_value(name, float, value, **RPS_RANGE))


def rps_arg(text: str) -> float:
    """argparse ``type=`` for ``--rps``: checked at parse time (argparse names the flag)."""
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
