"""Seeded generator for the input-length regimes ILR-1..4 (and other synthetic presets).

The paper does not publish its ILR workloads; this is our operationalisation (SPEC section 5):
400 workflows per regime; initial context log-uniform in ILR-1 2k-8k, ILR-2 8k-24k, ILR-3 24k-64k,
ILR-4 64k-160k tokens, of which a shared system prompt (one of ``num_system_prompts``) takes the
first ``system_prefix_tokens`` (at most half); 4-20 turns (uniform); appended tool output
log-uniform 200-4000 tokens; output log-uniform 50-800 tokens; tool name and time from
:data:`~vllm_mars.workload.tooltime.WEKA_TOOL_MIX` (a lognormal mixture fitted to the weka traces
with published per-tool means). ``scale`` divides every token count after sampling, so the same
seed gives the same structure and tool times at any scale. Workflow i draws from its own generator
seeded by (preset, seed, i): the first N workflows do not depend on ``num_workflows``.

Presets are TOML files whose keys are :class:`IlrConfig` fields (``benchmark/workloads/ilr1.toml``
...; ``compact.toml`` makes the bundled ``compact.jsonl``).
"""

from __future__ import annotations

import dataclasses
import math
import os
import random
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_mars.options import check_options
from vllm_mars.workload.schema import Child, Segment, Turn, Workflow
from vllm_mars.workload.tooltime import WEKA_TOOL_MIX, ToolMix

#: Environment variable naming an extra directory of preset files.
ENV_PRESET_DIR = "MARS_WORKLOADS_DIR"
#: The repository's bundled presets (present in a source checkout / editable install).
BUNDLED_DIR = Path(__file__).resolve().parents[3] / "benchmark" / "workloads"


@dataclass(frozen=True)
class IlrConfig:
    """One synthetic workload regime. Ranges are inclusive ``[low, high]``."""

    #: Preset name (also the workflow-id prefix, lower-cased without dashes).
    name: str = "ILR-1"
    #: Root workflows to generate.
    num_workflows: int = 400
    #: Initial context (system prompt + task) in tokens, drawn log-uniformly.
    initial_tokens: tuple[int, int] = (2000, 8000)
    #: Shared system-prompt tokens at the start of the initial context (capped at half of it).
    system_prefix_tokens: int = 1024
    #: Distinct system prompts (agent types) the workflows pick from uniformly.
    num_system_prompts: int = 4
    #: LLM calls per workflow, drawn uniformly.
    turns: tuple[int, int] = (4, 20)
    #: Tool-output tokens appended before each call after the first, drawn log-uniformly.
    append_tokens: tuple[int, int] = (200, 4000)
    #: Output tokens per call, drawn log-uniformly.
    output_tokens: tuple[int, int] = (50, 800)
    #: Multiplies every sampled tool time.
    tool_time_scale: float = 1.0
    #: Tool times are clipped to [tool_min_s, tool_max_s] (after tool_time_scale).
    tool_min_s: float = 0.0
    tool_max_s: float = 300.0
    #: Probability that a non-last turn spawns a sub-agent (child workflow).
    child_prob: float = 0.0
    #: Turns of a child, drawn uniformly.
    child_turns: tuple[int, int] = (2, 4)
    #: Initial context of a child (its own system prompt + task), drawn log-uniformly.
    child_initial_tokens: tuple[int, int] = (500, 2000)
    #: Whether the parent's next turn waits for the child (a sub-agent called as a tool).
    child_parent_waits: bool = True
    #: Divides every token count (after sampling); >1 for CPU runs.
    scale: float = 1.0
    #: Base seed.
    seed: int = 0

    def __post_init__(self) -> None:
        for f in ("initial_tokens", "turns", "append_tokens", "output_tokens", "child_turns",
                  "child_initial_tokens"):
            v = getattr(self, f)
            if not (isinstance(v, tuple) and len(v) == 2 and all(isinstance(x, int) for x in v)
                    and 1 <= v[0] <= v[1]):
                raise ValueError(f"IlrConfig.{f} must be [low, high] integers with 1 <= low <= high, got {v!r}")
        if self.num_workflows < 1:
            raise ValueError(f"IlrConfig.num_workflows must be >= 1, got {self.num_workflows}")
        if self.system_prefix_tokens < 0 or self.num_system_prompts < 1:
            raise ValueError("IlrConfig.system_prefix_tokens must be >= 0 and num_system_prompts >= 1")
        if not 0.0 <= self.child_prob <= 1.0:
            raise ValueError(f"IlrConfig.child_prob must be in [0, 1], got {self.child_prob}")
        if self.scale <= 0 or self.tool_time_scale < 0:
            raise ValueError("IlrConfig.scale must be > 0 and tool_time_scale >= 0")
        ToolMix(WEKA_TOOL_MIX, self.tool_time_scale, self.tool_min_s, self.tool_max_s)  # validates

    @property
    def slug(self) -> str:
        return "".join(ch for ch in self.name.lower() if ch.isalnum())


FIELDS = {f.name: f for f in dataclasses.fields(IlrConfig)}


def config_from_mapping(raw: dict[str, Any], where: str = "<preset>") -> IlrConfig:
    """Build an IlrConfig from a TOML/JSON mapping; unknown keys are an error naming the valid ones."""
    try:
        return check_options(IlrConfig, raw, convert_lists=True)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


def preset_dirs() -> list[Path]:
    dirs = [Path(d) for d in os.environ.get(ENV_PRESET_DIR, "").split(os.pathsep) if d]
    return [*dirs, BUNDLED_DIR]


def available_presets() -> list[str]:
    names: set[str] = set()
    for d in preset_dirs():
        if d.is_dir():
            for p in d.glob("*.toml"):
                names.add(p.stem)
    return sorted(names)


def load_preset(name_or_path: str | Path, **overrides: Any) -> IlrConfig:
    """A preset by name (``ILR-1``, ``ilr1``, ``compact``) or TOML path, with field overrides."""
    p = Path(name_or_path)
    if not p.is_file():
        stem = "".join(ch for ch in str(name_or_path).lower() if ch.isalnum())
        hits = [d / f"{stem}.toml" for d in preset_dirs() if (d / f"{stem}.toml").is_file()]
        if not hits:
            raise ValueError(f"unknown workload preset {str(name_or_path)!r}; available: "
                             f"{', '.join(available_presets()) or '(none found)'} "
                             f"(searched {', '.join(map(str, preset_dirs()))})")
        p = hits[0]
    try:
        raw = tomllib.loads(p.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{p}: invalid TOML: {e}") from None
    raw.update({k: v for k, v in overrides.items() if v is not None})
    return config_from_mapping(raw, str(p))


# ---------------------------------------------------------------------- generation
def _loguniform(rng: random.Random, band: tuple[int, int]) -> int:
    lo, hi = band
    return round(math.exp(rng.uniform(math.log(lo), math.log(hi))))


def _sc(n: int, scale: float) -> int:
    return max(1, round(n / scale))


def _turns(rng: random.Random, cfg: IlrConfig, tools: ToolMix, n: int) -> list[Turn]:
    out = []
    for k in range(n):
        append = _sc(_loguniform(rng, cfg.append_tokens), cfg.scale) if k else 0
        output = _sc(_loguniform(rng, cfg.output_tokens), cfg.scale)
        tool, tool_s = tools.sample(rng) if k + 1 < n else (None, 0.0)
        out.append(Turn(append_tokens=append, output_tokens=output, tool=tool, tool_s=round(tool_s, 3)))
    return out


def _initial(rng: random.Random, cfg: IlrConfig, band: tuple[int, int], key: str) -> tuple[list[Segment], int]:
    total = _loguniform(rng, band)
    sys_n = min(cfg.system_prefix_tokens, total // 2)
    prefix = [Segment(key=key, tokens=_sc(sys_n, cfg.scale))] if sys_n else []
    return prefix, _sc(total - sys_n, cfg.scale)


def generate_one(cfg: IlrConfig, i: int) -> Workflow:
    """Root workflow ``i`` of the regime (independent of num_workflows)."""
    rng = random.Random(f"{cfg.slug}/{cfg.seed}/{i}")
    tools = ToolMix(WEKA_TOOL_MIX, cfg.tool_time_scale, cfg.tool_min_s, cfg.tool_max_s)
    agent = rng.randrange(cfg.num_system_prompts)
    prefix, task = _initial(rng, cfg, cfg.initial_tokens, f"{cfg.slug}-system-{agent}")
    turns = _turns(rng, cfg, tools, rng.randint(*cfg.turns))
    wid = f"{cfg.slug}-{i:04d}"
    children = []
    for k in range(len(turns) - 1):
        if cfg.child_prob and rng.random() < cfg.child_prob:
            cprefix, ctask = _initial(rng, cfg, cfg.child_initial_tokens, f"{cfg.slug}-subagent-{agent}")
            child = Workflow(workflow_id=f"{wid}.c{len(children)}", prefix=cprefix, prompt_tokens=ctask,
                             turns=_turns(rng, cfg, tools, rng.randint(*cfg.child_turns)),
                             source=f"preset:{cfg.name}")
            children.append(Child(after_turn=k, parent_waits=cfg.child_parent_waits, workflow=child))
    return Workflow(workflow_id=wid, prefix=prefix, prompt_tokens=task, turns=turns, children=children,
                    source=f"preset:{cfg.name}",
                    meta={"preset": cfg.name, "seed": cfg.seed, "scale": cfg.scale, "index": i})


def generate(cfg: IlrConfig) -> list[Workflow]:
    """``cfg.num_workflows`` root workflows (arrival left to the driver)."""
    return [generate_one(cfg, i) for i in range(cfg.num_workflows)]
