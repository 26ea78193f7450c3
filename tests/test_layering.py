"""The import floors of the options validator, the policies, the admission controllers and the
experiment grid: each reads its own imports (module-level and function-local alike), so a circle
cannot come back through a lazy import. Every rule here failed on 37ca66c."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "vllm-mars" / "vllm_mars"


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, at any depth of its code."""
    tree = ast.parse(path.read_text())
    out = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    out |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    # importlib.import_module("vllm_mars.x") with a literal name
    out |= {c.args[0].value for c in ast.walk(tree)
            if isinstance(c, ast.Call) and getattr(c.func, "attr", None) == "import_module"
            and c.args and isinstance(c.args[0], ast.Constant) and isinstance(c.args[0].value, str)}
    return out


def _files(rel: str) -> list[Path]:
    p = PKG / rel
    return sorted(p.rglob("*.py")) if p.is_dir() else [p]


def test_the_options_validator_is_the_ground_floor():
    assert not [m for m in _imports(PKG / "options.py") if m.startswith("vllm_mars")]


@pytest.mark.parametrize("rel, forbidden", [
    ("policies", ("vllm_mars.config", "vllm_mars.engine", "vllm_mars.driver", "vllm_mars.admission")),
    ("admission/mars", ("vllm_mars.config", "vllm_mars.engine", "vllm_mars.driver", "vllm_mars.policies",
                        "vllm_mars.admission.sidecar", "vllm_mars.admission.controller")),
    ("admission/base.py", ("vllm_mars.config", "vllm_mars.policies")),
    ("experiment/results.py", ("vllm_mars.experiment.grid",)),
    # the sidecar's lower floors: its config, waiting calls and server know nothing of its routes or state
    # (the config reads only the placement rules' names, from the placement floor below the sidecar)
    ("admission/sidecar/config.py", ("vllm_mars.admission.sidecar", "vllm_mars.admission.base",
                                     "vllm_mars.admission.mars", "vllm_mars.admission.roots")),
    ("admission/sidecar/held.py", ("vllm_mars.admission",)),
    ("admission/sidecar/serving.py", ("vllm_mars.admission",)),
    ("admission/sidecar/state.py", ("vllm_mars.admission.sidecar.app",)),
])
def test_no_import_runs_back_up(rel, forbidden):
    bad = {str(f.relative_to(PKG)): sorted(m for m in _imports(f) if m.startswith(forbidden))
           for f in _files(rel)}
    assert not {k: v for k, v in bad.items() if v}, bad


def test_the_mars_controller_and_policy_are_split_by_concern():
    # one concern per module, none past the size the house allows without a stated reason
    for rel in ("admission/mars", "policies/mars", "admission/sidecar"):
        for f in _files(rel):
            assert len(f.read_text().splitlines()) <= 450, f
    assert not (PKG / "admission" / "controller.py").exists()
    assert not (PKG / "policies" / "mars.py").exists()
    assert not (PKG / "admission" / "sidecar.py").exists()
