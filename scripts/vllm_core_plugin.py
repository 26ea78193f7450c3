"""pytest plugin: vLLM's own ``tests/v1/core`` with our scheduler classes substituted.

Loaded by ``scripts/vllm_core_suite.py`` (``-p vllm_core_plugin``) in a pytest run of the suite
extracted from the vLLM sdist. With ``MARS_CORE_POLICY`` set to a registered policy, vLLM's test
helper ``create_scheduler`` (``tests/v1/core/utils.py``) builds ``MarsScheduler`` (which becomes
``AsyncMarsScheduler`` under ``async_scheduling=True``) with that policy, wherever a test leaves its
``scheduler_cls`` unset; a test that names its own class keeps it. With ``MARS_CORE_POLICY`` unset
or ``stock``, nothing is substituted: vLLM's own classes, the baseline.
``MARS_CORE_POLICY_OPTIONS`` (JSON object) adds the policy's options.

Nothing of vLLM's is copied or edited: the helper module is wrapped before the test modules import
its name.
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import sys

ENV_POLICY = "MARS_CORE_POLICY"
ENV_OPTIONS = "MARS_CORE_POLICY_OPTIONS"


def _policy() -> str | None:
    policy = os.environ.get(ENV_POLICY, "").strip()
    return None if policy in ("", "stock") else policy


def _mars_factory(policy: str, options: dict, async_scheduling: bool):
    """A ``scheduler_cls`` for ``create_scheduler``: our class for the variant the test asks for
    (as the helper itself picks ``AsyncScheduler`` or ``Scheduler``), configured with ``policy``."""
    from vllm_mars.engine.scheduler import AsyncMarsScheduler, MarsScheduler

    cls = AsyncMarsScheduler if async_scheduling else MarsScheduler

    def build(*args, vllm_config, **kwargs):
        extra = dict(vllm_config.additional_config or {})
        extra["mars"] = {"policy": policy, **options}
        vllm_config.additional_config = extra
        BUILT[cls.__name__] = BUILT.get(cls.__name__, 0) + 1
        return cls(*args, vllm_config=vllm_config, **kwargs)

    build.__name__ = f"{cls.__name__}[{policy}]"
    return build


#: Schedulers built through the substitution, by class (reported at the end of the run).
BUILT: dict[str, int] = {}


def pytest_configure(config) -> None:
    policy = _policy()
    config.addinivalue_line("markers", "cpu_test: vLLM's marker (tests that run without a GPU)")
    config.addinivalue_line("markers", "skip_global_cleanup: vLLM's marker")
    if policy is None:
        return
    options = json.loads(os.environ.get(ENV_OPTIONS) or "{}")
    if not isinstance(options, dict):
        raise SystemExit(f"{ENV_OPTIONS} must be a JSON object, got {options!r}")
    root = str(config.rootpath)
    if root not in sys.path:
        sys.path.insert(0, root)
    from tests.v1.core import utils  # vLLM's helper module, from the extracted sdist

    original = utils.create_scheduler
    signature = inspect.signature(original)

    @functools.wraps(original)
    def create_scheduler(*args, scheduler_cls=None, **kwargs):
        if scheduler_cls is None:
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            scheduler_cls = _mars_factory(policy, options, bool(bound.arguments["async_scheduling"]))
        return original(*args, scheduler_cls=scheduler_cls, **kwargs)

    utils.create_scheduler = create_scheduler
    # Proof in the run's header that the substitution is live (the driver script checks it).
    config._mars_core_policy = policy


def pytest_report_header(config) -> str:
    policy = getattr(config, "_mars_core_policy", None)
    if policy is None:
        return "vllm_core_plugin: stock vLLM scheduler classes"
    return f"vllm_core_plugin: create_scheduler builds MarsScheduler with policy {policy}"


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    """The proof the driver script checks that the substitution was (or was not) live."""
    if getattr(config, "_mars_core_policy", None) is None:
        terminalreporter.write_line("vllm_core_plugin: stock vLLM scheduler classes, nothing substituted")
        return
    built = ", ".join(f"{k} {v}" for k, v in sorted(BUILT.items())) or "none"
    terminalreporter.write_line(f"vllm_core_plugin: policy {config._mars_core_policy}: schedulers built "
                                f"through the substitution: {built}")
