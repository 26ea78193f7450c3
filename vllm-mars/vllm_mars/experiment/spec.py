"""An experiment file (TOML) parsed and validated into an :class:`Experiment`.

An experiment is a grid: workloads x their RPS levels x seeds = cells; in each cell every policy
runs once on the same workload and engine settings. Every error is one line naming the file and
the field (``ExperimentError``, a ValueError: the CLI exits 2).

Keys (top level): ``name``, ``description``, ``backend``, ``profile``, ``arrival``, ``seeds``,
``num_workflows``, ``policies``, ``[variants.LABEL]`` (``policy``, ``policy_options``,
``admission_options``, ``replay``: ReplayConfig fields of this variant's runs, e.g. the sim's
``replicas`` and ``placement``), ``status`` (``canonical``, ``ablation``, or ``retired COMMIT``: it no longer runs, COMMIT last ran
it), ``[replay]`` (any other ReplayConfig field), ``[[workloads]]`` (``name``,
one of ``preset`` / ``path`` / ``weka``, ``rps``, and optionally ``num_workflows``, ``scale``,
``arrival``, ``max_context``, ``max_tool_s``, ``policies``: a subset of the top-level list run on this
workload only), ``limit`` (another experiment's results.json: the no-thrash limit the report compares
mars with, see :mod:`vllm_mars.experiment.limit`), ``figures`` (``"all"`` or a list of the paper's
figures to draw, see :mod:`vllm_mars.experiment.figures`). Relative paths are relative to the file.
"""

from __future__ import annotations

import dataclasses
import math
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_mars.admission.base import make_controller
from vllm_mars.config import check_rps
from vllm_mars.driver.arrivals import ARRIVAL_PROCESSES
from vllm_mars.driver.config import BACKENDS, ReplayConfig
from vllm_mars.driver.control import check_policy
from vllm_mars.experiment.figures import FIGURES
from vllm_mars.experiment.limit import load_limit
from vllm_mars.policies import make_policy
from vllm_mars.sim import engine as sim_engine
from vllm_mars.workload.ilr import load_preset

TOP_KEYS = ("name", "description", "status", "backend", "profile", "arrival", "seeds", "num_workflows", "policies",
            "variants", "replay", "workloads", "limit", "figures")
WORKLOAD_KEYS = ("name", "preset", "path", "weka", "rps", "num_workflows", "scale", "arrival", "max_context",
                 "max_tool_s", "policies")
VARIANT_KEYS = ("policy", "policy_options", "admission_options", "replay")
#: ReplayConfig fields the grid sets itself (not allowed under [replay]).
GRID_FIELDS = ("workload", "policy", "rps", "seed", "out", "progress", "arrival", "num_workflows", "backend",
               "profile", "policy_options", "admission_options")
_LABEL = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
#: ``status = "retired COMMIT"``: the experiment no longer runs; COMMIT last ran it
_RETIRED = re.compile(r"^retired ([0-9a-f]{7,40})$")


class ExperimentError(ValueError):
    """A bad experiment file: ``FILE: FIELD: what is wrong``."""


@dataclass(frozen=True)
class WorkloadSpec:
    """One workload axis entry: exactly one source (``preset``, ``path`` or ``weka``)."""

    name: str
    rps: tuple[float, ...]
    preset: str | None = None
    path: str | None = None
    weka: str | None = None
    num_workflows: int | None = None
    scale: float | None = None
    arrival: str | None = None
    #: drop root workflows whose context (final prompt + last output) exceeds this many tokens
    max_context: int | None = None
    #: weka only: cap of a gap between calls (converter's --max-tool-s)
    max_tool_s: float | None = None
    #: the policies run on this workload (None: the experiment's list)
    policies: tuple[str, ...] | None = None


@dataclass(frozen=True)
class Cell:
    """One (workload, rps, seed) point of the grid."""

    workload: WorkloadSpec
    rps: float
    seed: int

    @property
    def key(self) -> str:
        return f"{self.workload.name}/rps{self.rps:g}/seed{self.seed}"


@dataclass(frozen=True)
class Experiment:
    path: Path
    name: str
    description: str
    policies: tuple[str, ...]
    variants: dict[str, dict[str, Any]]
    workloads: tuple[WorkloadSpec, ...]
    seeds: tuple[int, ...]
    base: ReplayConfig
    raw: dict[str, Any] = field(default_factory=dict)
    #: results.json of the no-thrash limit (``limit`` key or ``--limit``), None: no limit section
    limit: Path | None = None
    #: the paper's figures drawn into the results dir (:data:`vllm_mars.experiment.figures.FIGURES`)
    figures: tuple[str, ...] = ()

    def cells(self) -> list[Cell]:
        return [Cell(w, r, s) for w in self.workloads for r in w.rps for s in self.seeds]

    def policies_for(self, w: WorkloadSpec) -> tuple[str, ...]:
        return w.policies if w.policies is not None else self.policies

    def num_workflows(self, w: WorkloadSpec) -> int | None:
        return w.num_workflows if w.num_workflows is not None else self.base.num_workflows


def _err(path: Path, where: str, msg: str) -> ExperimentError:
    return ExperimentError(f"{path}: {where}: {msg}")


def _pos_int(path: Path, where: str, v: Any, minimum: int = 1) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise _err(path, where, f"expected an integer >= {minimum}, got {v!r}")
    return v


def _pos_float(path: Path, where: str, v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < math.inf:
        raise _err(path, where, f"expected a positive finite number, got {v!r}")
    return float(v)


def _str(path: Path, where: str, v: Any) -> str:
    if not isinstance(v, str) or not v:
        raise _err(path, where, f"expected a non-empty string, got {v!r}")
    return v


def _unknown(path: Path, where: str, table: dict, allowed: tuple[str, ...]) -> None:
    bad = sorted(set(table) - set(allowed))
    if bad:
        raise _err(path, f"{where}{bad[0]}", f"unknown key; allowed: {', '.join(allowed)}")


def _rps_value(path: Path, where: str, v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise _err(path, where, f"expected a positive number, got {v!r}")
    try:
        return check_rps("rps", v)
    except ValueError as e:
        raise _err(path, where, str(e)) from None


def _rps(path: Path, where: str, v: Any) -> tuple[float, ...]:
    if not isinstance(v, list) or not v:
        raise _err(path, where, f"expected a non-empty list of positive numbers, got {v!r}")
    vals = tuple(_rps_value(path, f"{where}[{i}]", x) for i, x in enumerate(v))
    if len(set(vals)) != len(vals):
        raise _err(path, where, f"repeated rps level in {list(vals)}")
    return vals


def _policies(path: Path, raw: dict, variants: dict[str, dict]) -> tuple[str, ...]:
    v = raw.get("policies")
    if not isinstance(v, list) or not v:
        raise _err(path, "policies", f"expected a non-empty list of policy names, got {v!r}")
    out = []
    for i, p in enumerate(v):
        p = _str(path, f"policies[{i}]", p)
        if p in out:
            raise _err(path, f"policies[{i}]", f"{p!r} is listed twice")
        if p not in variants:
            try:
                check_policy(p)
            except ValueError as e:
                raise _err(path, f"policies[{i}]", str(e)) from None
        out.append(p)
    return tuple(out)


def _variants(path: Path, raw: dict) -> dict[str, dict]:
    table = raw.get("variants", {})
    if not isinstance(table, dict):
        raise _err(path, "variants", "expected a table of [variants.LABEL] tables")
    out = {}
    for label, v in table.items():
        where = f"variants.{label}"
        if not _LABEL.match(label):
            raise _err(path, where, "a label is letters, digits, '.', '_' or '-' (it names a run directory)")
        if not isinstance(v, dict):
            raise _err(path, where, "expected a table")
        nested = [k for k, x in v.items() if k not in VARIANT_KEYS and isinstance(x, dict)]
        if nested:  # TOML split a dotted label: [variants.a-0.25] is variants -> "a-0" -> "25"
            raise _err(path, f"{where}.{nested[0]}", "a label with a '.' must be quoted in the "
                       f'table header: [variants."{label}.{nested[0]}"]')
        _unknown(path, f"{where}.", v, VARIANT_KEYS)
        pol = _str(path, f"{where}.policy", v.get("policy"))
        try:
            dp = check_policy(pol)
        except ValueError as e:
            raise _err(path, f"{where}.policy", str(e)) from None
        for key in ("policy_options", "admission_options"):
            if not isinstance(v.get(key, {}), dict):
                raise _err(path, f"{where}.{key}", "expected a table of options")
        try:
            make_policy(dp.scheduler_policy, v.get("policy_options"))
        except ValueError as e:
            raise _err(path, f"{where}.policy_options", str(e)) from None
        try:
            make_controller(dp.controller, v.get("admission_options"))
        except (ValueError, TypeError) as e:
            raise _err(path, f"{where}.admission_options", str(e)) from None
        out[label] = {"policy": pol, "policy_options": dict(v.get("policy_options", {})),
                      "admission_options": dict(v.get("admission_options", {}))}
        if "replay" in v:
            out[label]["replay"] = _variant_replay(path, f"{where}.replay", v["replay"])
    return out


def _variant_replay(path: Path, where: str, table: Any) -> dict[str, Any]:
    """A variant's own ReplayConfig fields (not those the grid sets), typed as in ``[replay]``."""
    if not isinstance(table, dict):
        raise _err(path, where, "expected a table of ReplayConfig fields")
    fields = {f.name: f for f in dataclasses.fields(ReplayConfig)}
    _unknown(path, f"{where}.", table, tuple(n for n in fields if n not in GRID_FIELDS))
    return {k: _typed(path, f"{where}.{k}", fields[k], v) for k, v in table.items()}


def _workload(path: Path, i: int, w: Any, arrivals: tuple[str, ...], policies: tuple[str, ...]) -> WorkloadSpec:
    where = f"workloads[{i}]"
    if not isinstance(w, dict):
        raise _err(path, where, "expected a table ([[workloads]])")
    _unknown(path, f"{where}.", w, WORKLOAD_KEYS)
    name = _str(path, f"{where}.name", w.get("name"))
    if not _LABEL.match(name):
        raise _err(path, f"{where}.name", "letters, digits, '.', '_' or '-' only (it names a directory)")
    sources = [k for k in ("preset", "path", "weka") if k in w]
    if len(sources) != 1:
        raise _err(path, where, f"give exactly one of preset, path, weka (got {sources or 'none'})")
    src = sources[0]
    val = _str(path, f"{where}.{src}", w[src])
    if src == "preset":
        p = path.parent / val
        try:
            load_preset(p if p.suffix == ".toml" else val)
        except ValueError as e:
            raise _err(path, f"{where}.preset", str(e)) from None
        if p.suffix == ".toml":
            val = str(p)
    else:
        p = (path.parent / val).resolve()
        if not p.exists():
            raise _err(path, f"{where}.{src}", f"{p} not found")
        val = str(p)
    arrival = w.get("arrival")
    if arrival is not None and arrival not in arrivals:
        raise _err(path, f"{where}.arrival", f"{arrival!r} unknown; allowed: {', '.join(arrivals)}")
    if src == "path" and "scale" in w:
        raise _err(path, f"{where}.scale", "a JSONL workload is used as is; scale applies to preset and weka")
    if src != "weka" and "max_tool_s" in w:
        raise _err(path, f"{where}.max_tool_s", "applies to weka traces only")
    pols = w.get("policies")
    if pols is not None:
        if not isinstance(pols, list) or not pols or not all(isinstance(p, str) for p in pols):
            raise _err(path, f"{where}.policies", f"expected a non-empty list of policy names, got {pols!r}")
        extra = [p for p in pols if p not in policies]
        if extra:
            raise _err(path, f"{where}.policies", f"{extra[0]!r} is not in the top-level policies "
                       f"(a workload runs a subset of them)")
        pols = tuple(p for p in policies if p in pols)
    return WorkloadSpec(
        name=name, rps=_rps(path, f"{where}.rps", w.get("rps")), **{src: val},
        num_workflows=None if "num_workflows" not in w else _pos_int(path, f"{where}.num_workflows",
                                                                     w["num_workflows"]),
        scale=None if "scale" not in w else _pos_float(path, f"{where}.scale", w["scale"]), arrival=arrival,
        max_context=None if "max_context" not in w else _pos_int(path, f"{where}.max_context", w["max_context"]),
        max_tool_s=None if "max_tool_s" not in w else _pos_float(path, f"{where}.max_tool_s", w["max_tool_s"]),
        policies=pols)


def _typed(path: Path, where: str, f: dataclasses.Field, v: Any) -> Any:
    """``v`` checked against the type of the ReplayConfig field's default (None defaults: any)."""
    default = f.default if f.default is not dataclasses.MISSING else None
    if default is None:
        return v
    ok = (isinstance(v, bool) if isinstance(default, bool) else
          isinstance(v, int) and not isinstance(v, bool) if isinstance(default, int) else
          isinstance(v, (int, float)) and not isinstance(v, bool) if isinstance(default, float) else
          isinstance(v, type(default)))
    if not ok:
        raise _err(path, where, f"expected {type(default).__name__}, got {v!r}")
    return float(v) if isinstance(default, float) else v


def _base(path: Path, raw: dict) -> ReplayConfig:
    fields = {f.name: f for f in dataclasses.fields(ReplayConfig)}
    kw: dict[str, Any] = {"progress": False, "plots": False}
    for key in ("backend", "profile", "arrival"):
        if key in raw:
            if key not in fields:
                raise _err(path, key, f"this build's replay has no {key!r} setting (is the sim backend merged?)")
            kw[key] = _str(path, key, raw[key])
    if kw.get("backend", "inprocess") not in BACKENDS:
        raise _err(path, "backend", f"{kw['backend']!r} unknown; allowed: {', '.join(BACKENDS)}")
    if "profile" in kw:
        prof = kw["profile"]
        if not Path(prof).is_absolute() and (path.parent / prof).is_file():
            kw["profile"] = prof = str((path.parent / prof).resolve())
        try:
            sim_engine.get_profile(prof)  # looked up at call time: tests swap the resolver
        except ValueError as e:
            raise _err(path, "profile", str(e)) from None
    if "num_workflows" in raw:
        kw["num_workflows"] = _pos_int(path, "num_workflows", raw["num_workflows"])
    replay = raw.get("replay", {})
    if not isinstance(replay, dict):
        raise _err(path, "replay", "expected a table of ReplayConfig fields")
    allowed = tuple(n for n in fields if n not in GRID_FIELDS)
    _unknown(path, "replay.", replay, allowed)
    for k, v in replay.items():
        kw[k] = _typed(path, f"replay.{k}", fields[k], v)
    try:
        cfg = ReplayConfig(**kw)
        cfg.validate()
    except (TypeError, ValueError) as e:
        raise _err(path, "replay", str(e)) from None
    return cfg


def load_experiment(path: str | Path) -> Experiment:
    """Parse and validate an experiment file; raises ExperimentError (one line) or FileNotFoundError."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"experiment file {path} not found")
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise ExperimentError(f"{path}: invalid TOML: {e}") from None
    _unknown(path, "", raw, TOP_KEYS)
    status = check_status(path, raw)
    if status.startswith("retired"):
        raise _err(path, "status", f"{status}: this experiment no longer runs on this code; its last results are "
                   f"in git history (git show {status.split()[1]}:experiments/results/{path.stem}/table.md)")
    name = _str(path, "name", raw.get("name", path.stem))
    if not _LABEL.match(name):
        raise _err(path, "name", "letters, digits, '.', '_' or '-' only")
    if "arrival" in raw and raw["arrival"] not in ARRIVAL_PROCESSES:
        raise _err(path, "arrival", f"{raw['arrival']!r} unknown; allowed: {', '.join(ARRIVAL_PROCESSES)}")
    seeds = raw.get("seeds", [0])
    if not isinstance(seeds, list) or not seeds:
        raise _err(path, "seeds", f"expected a non-empty list of integers >= 0, got {seeds!r}")
    seeds = tuple(_pos_int(path, f"seeds[{i}]", s, 0) for i, s in enumerate(seeds))
    if len(set(seeds)) != len(seeds):
        raise _err(path, "seeds", f"repeated seed in {list(seeds)}")
    variants = _variants(path, raw)
    policies = _policies(path, raw, variants)
    unused = sorted(set(variants) - set(policies))
    if unused:
        raise _err(path, f"variants.{unused[0]}", "defined but not listed in policies")
    wls = raw.get("workloads")
    if not isinstance(wls, list) or not wls:
        raise _err(path, "workloads", "expected at least one [[workloads]] table")
    workloads = tuple(_workload(path, i, w, ARRIVAL_PROCESSES, policies) for i, w in enumerate(wls))
    names = [w.name for w in workloads]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise _err(path, "workloads", f"workload name {dup[0]!r} is used twice")
    base = _base(path, raw)
    for label, v in variants.items():  # a variant's own replay fields, on the file's base
        if v.get("replay"):
            try:
                dataclasses.replace(base, **v["replay"]).validate()
            except (TypeError, ValueError) as e:
                raise _err(path, f"variants.{label}.replay", str(e)) from None
    limit = None
    if "limit" in raw:
        limit = (path.parent / _str(path, "limit", raw["limit"])).resolve()
        check_limit(limit, f"{path}: limit")
    return Experiment(path=path, name=name, description=str(raw.get("description", "")), policies=policies,
                      variants=variants, workloads=workloads, seeds=seeds, base=base, raw=raw, limit=limit,
                      figures=_figures(path, raw))


def _figures(path: Path, raw: dict[str, Any]) -> tuple[str, ...]:
    v = raw.get("figures", [])
    if v == "all":
        return tuple(FIGURES)
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise _err(path, "figures", f"expected \"all\" or a list of figure names ({', '.join(FIGURES)}), got {v!r}")
    bad = [x for x in v if x not in FIGURES]
    if bad:
        raise _err(path, "figures", f"{bad[0]!r} unknown; allowed: {', '.join(FIGURES)}, or \"all\"")
    return tuple(dict.fromkeys(v))


def check_status(path: Path, raw: dict[str, Any]) -> str:
    """The file's ``status`` (``canonical`` when not given), else ExperimentError naming the allowed values."""
    v = raw.get("status", "canonical")
    if not isinstance(v, str) or not (v in ("canonical", "ablation") or _RETIRED.match(v)):
        raise _err(path, "status", f"{v!r}: expected canonical, ablation or 'retired COMMIT' (the commit that "
                   "last ran it)")
    return v


def check_limit(path: Path, where: str) -> None:
    """A limit results.json that the report can read, else ExperimentError ``WHERE: what is wrong``."""
    try:
        load_limit(path)
    except ValueError as e:
        raise ExperimentError(f"{where}: {e}") from None
