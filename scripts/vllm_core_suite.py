"""vLLM 0.32.0's own scheduler test suite (``tests/v1/core``) under our scheduler classes.

Fetches the vllm 0.32.0 sdist from the package index (cached under the user cache dir, its sha256
checked against the index's), extracts its ``tests/`` tree, installs the suite's one missing test
dependency (``tblib``) into the cache, then runs the suite once with vLLM's stock classes (the
baseline, on this machine) and once per policy with ``create_scheduler`` building
``MarsScheduler`` / ``AsyncMarsScheduler`` (``scripts/vllm_core_plugin.py``). Reports, per policy,
how many of the tests that pass on stock pass, and names every loss.

    .venv/bin/python scripts/vllm_core_suite.py --policies fcfs,mars --check   # CI
    .venv/bin/python scripts/vllm_core_suite.py --all --out results.json      # every policy

``--check`` exits 1 when a policy loses a test that stock passes, unless the loss is one of the
policy's own decisions: its admission gate's (:data:`GATES`) or its victim ranking's
(:data:`VICTIMS`), the test passing with that decision turned off, or read by hand
(:data:`LISTED_LOSSES`). A policy the scheduler refuses to start here (its platform check, a KV
connector it needs: :func:`refusal`) is reported NOT RUN with the reason, in the output and in
results.json, and is not counted. Network failures fail loudly (exit 2): the suite is never
skipped silently.

Why not ``pip download --no-binary :all:``: pip prepares an sdist's metadata before it saves it,
and vLLM's ``setup.py`` needs its whole build toolchain (setuptools_rust, torch, cmake) for that.
The sdist is read from the same PEP 503 index pip uses (``PIP_INDEX_URL`` or pypi.org), checked
against the index's sha256.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
import urllib.request
import xml.etree.ElementTree as ET
from pathlib import Path

VLLM_VERSION = "0.32.0"
SDIST = f"vllm-{VLLM_VERSION}.tar.gz"
HERE = Path(__file__).resolve().parent
REPO = HERE.parent
#: The suite's test-only dependencies missing from our venv (tests/conftest.py imports tblib).
TEST_DEPS = ("tblib==3.2.2",)

#: The published config.json of the model the suite's ``create_scheduler`` names by default. The
#: scheduler tests read only the model's config (no weights, no tokenizer); this machine cannot
#: reach Hugging Face, so the config goes into an offline hub cache that the suite reads.
MODEL_CONFIGS: dict[str, dict] = {
    "facebook/opt-125m": {
        "_name_or_path": "facebook/opt-125m", "activation_dropout": 0.0, "activation_function": "relu",
        "architectures": ["OPTForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 2,
        "do_layer_norm_before": True, "dropout": 0.1, "eos_token_id": 2, "ffn_dim": 3072,
        "hidden_size": 768, "init_std": 0.02, "layerdrop": 0.0, "max_position_embeddings": 2048,
        "model_type": "opt", "num_attention_heads": 12, "num_hidden_layers": 12, "pad_token_id": 1,
        "prefix": "</s>", "torch_dtype": "float16", "transformers_version": "4.21.0.dev0",
        "use_cache": True, "vocab_size": 50272, "word_embed_proj_dim": 768,
    },
}
_SNAPSHOT = "0" * 40

#: Policies whose decisions gate admission (hold a waiting call vLLM's tests expect to start), with
#: the options that turn the gate off. A test such a policy loses is re-run with the gate off: if it
#: passes then, the loss is the gate's (listed with this reason); otherwise it is a defect.
_RESERVE = ({"reserve_prefills": False}, "as mars (prefill reserve)")
GATES: dict[str, tuple[dict, str]] = {
    "mars": ({"reserve_prefills": False}, ("mars's prefill reserve holds a waiting call while the "
                                           "running calls' decode growth needs the free blocks")),
    **{p: _RESERVE for p in ("mars-no-cost-reclaim", "mars-no-elastic", "mars-no-evicted-order", "mars-no-mlfq",
                             "mars-no-priced-reserve", "mars-no-retention", "mars-no-scaled-mlfq",
                             "mars-no-value-retention")},
}
_MARS_FAMILY = ("mars", *(p for p in GATES if p.startswith("mars-")), "mars-no-prefill-reserve")
#: Policies that rank their own preemption victim (SPEC: mars preempts the lowest level first, then
#: the largest KV holder; ``engine/reclaim.py``), with the option that hands the choice back to
#: vLLM's order: a loss that passes with it is the victim ranking's. None is lost now: the
#: fence test's failure, injected outside the scheduler's reclaim seam, used to meet a rank left
#: from an earlier step (the priorities the test sets); the running order now stands until the seam
#: ranks (``tests/test_victim_rank.py``).
VICTIMS: dict[str, tuple[dict, str]] = {
    p: ({"priority_reclaim": False}, "mars's priority-aware victim ranking") for p in _MARS_FAMILY}
#: Losses read by hand, where no option turns the deciding rule off (each checked by a run with the
#: rule patched off: RESULTS.md).
#: lightllm's gate is the policy (admit a call only when the predicted peak token demand fits);
#: these tests schedule a second request into a pool too small for both and expect it preempted.
_LIGHTLLM = ("gate: lightllm admits a call only when its predicted peak token demand fits, so the second "
             "request the test expects scheduled (then preempted) waits; passes with the gate patched off")
LISTED_LOSSES: dict[str, dict[str, str]] = {
    "lightllm": {t: _LIGHTLLM for t in (
        *(f"tests.v1.core.test_async_scheduler::test_kv_pressure_preempt_mid_handoff[{c}]"
          for c in ("kv_consumer-False", "kv_consumer-True", "kv_producer-False")),
        *(f"tests.v1.core.test_scheduler::test_kv_connector_handles_preemption[{c}]"
          for c in ("False-None-False-False", "False-None-False-True", "True-ec_consumer-False-False",
                    "True-ec_consumer-False-True")),
        "tests.v1.core.test_scheduler::test_preempt_during_execution")},
}


def cache_root() -> Path:
    from platformdirs import user_cache_dir

    return Path(os.environ.get("MARS_CORE_SUITE_CACHE") or user_cache_dir("vllm-mars")) / "vllm-core-suite"


def _index_url() -> str:
    url = os.environ.get("PIP_INDEX_URL")
    if not url:
        try:
            url = subprocess.run([sys.executable, "-m", "pip", "config", "get", "global.index-url"],
                                 capture_output=True, text=True, check=False).stdout.strip()
        except OSError:
            url = ""
    return (url or "https://pypi.org/simple").rstrip("/")


def fetch_sdist(cache: Path) -> Path:
    """The sdist in the cache, downloaded (and its hash checked) when missing."""
    cache.mkdir(parents=True, exist_ok=True)
    path = cache / SDIST
    sums = cache / (SDIST + ".sha256")
    if path.exists() and sums.exists():
        want = sums.read_text().strip()
        if hashlib.sha256(path.read_bytes()).hexdigest() == want:
            return path
    index = f"{_index_url()}/vllm/"
    try:
        with urllib.request.urlopen(index, timeout=60) as r:
            page = r.read().decode()
    except OSError as e:
        raise SystemExit(f"vllm_core_suite: cannot read the package index {index}: {e}") from e
    m = re.search(r'href="([^"]*/' + re.escape(SDIST) + r')#sha256=([0-9a-f]{64})"', page)
    if m is None:
        raise SystemExit(f"vllm_core_suite: {SDIST} (with a sha256) is not listed at {index}")
    url, want = m.group(1), m.group(2)
    if url.startswith("/"):
        url = re.match(r"https?://[^/]+", index).group(0) + url
    tmp = path.with_suffix(".part")
    try:
        with urllib.request.urlopen(url, timeout=300) as r, tmp.open("wb") as f:
            shutil.copyfileobj(r, f)
    except OSError as e:
        raise SystemExit(f"vllm_core_suite: cannot download {url}: {e}") from e
    got = hashlib.sha256(tmp.read_bytes()).hexdigest()
    if got != want:
        tmp.unlink()
        raise SystemExit(f"vllm_core_suite: {url} has sha256 {got}, the index says {want}")
    tmp.replace(path)
    sums.write_text(want + "\n")
    return path


def extract_tests(sdist: Path, cache: Path) -> Path:
    """``vllm-<version>/tests`` from the sdist, extracted once; returns the tree's root."""
    root = cache / f"vllm-{VLLM_VERSION}"
    stamp = root / ".mars-extracted"
    if stamp.exists():
        return root
    shutil.rmtree(root, ignore_errors=True)
    prefix = f"vllm-{VLLM_VERSION}/tests/"
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(prefix) and (m.isfile() or m.isdir())]
        tar.extractall(cache, members=members, filter="data")
    stamp.write_text(SDIST + "\n")
    return root


def offline_hub(cache: Path) -> Path:
    """An ``HF_HOME`` whose hub cache holds :data:`MODEL_CONFIGS` (read with ``HF_HUB_OFFLINE=1``)."""
    home = cache / "hf"
    for name, config in MODEL_CONFIGS.items():
        repo = home / "hub" / ("models--" + name.replace("/", "--"))
        snap = repo / "snapshots" / _SNAPSHOT
        snap.mkdir(parents=True, exist_ok=True)
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / "main").write_text(_SNAPSHOT)
        (snap / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return home


def install_test_deps(cache: Path) -> Path:
    site = cache / "site"
    stamp = site / ".mars-deps"
    if stamp.exists() and stamp.read_text().split() == list(TEST_DEPS):
        return site
    shutil.rmtree(site, ignore_errors=True)
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check",
                        "--no-deps", "--target", str(site), *TEST_DEPS], check=False)
    if r.returncode:
        raise SystemExit(f"vllm_core_suite: pip could not install {TEST_DEPS} into {site}")
    stamp.write_text("\n".join(TEST_DEPS) + "\n")
    return site


def suite_files(root: Path, whole: bool) -> list[str]:
    """The test files to run: by default those that build a scheduler through ``create_scheduler``
    (no other test can see our classes, so the rest pass or fail alike under every policy)."""
    core = root / "tests" / "v1" / "core"
    if whole:
        return ["tests/v1/core"]
    files = sorted(str(p.relative_to(root)) for p in core.rglob("test_*.py")
                   if "create_scheduler" in p.read_text())
    if not files:
        raise SystemExit(f"vllm_core_suite: no test file under {core} calls create_scheduler")
    return files


def run_suite(root: Path, site: Path, policy: str, out: Path, options: dict | None, files: list[str],
              pytest_args: list[str], timeout: float, tag: str | None = None) -> dict[str, str]:
    """One pytest run of tests/v1/core; returns {test id: passed|failed|error|skipped}."""
    tag = tag or policy
    xml = out / f"junit-{tag}.xml"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE), str(site), env.get("PYTHONPATH", "")) if p)
    env["MARS_CORE_POLICY"] = policy
    env["MARS_CORE_POLICY_OPTIONS"] = json.dumps(options or {})
    env["HF_HUB_OFFLINE"] = "1"  # the suite's model configs are not fetched here
    env["HF_HOME"] = str(offline_hub(root.parent))
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "vllm_core_plugin", "-p", "no:cacheprovider",
           "-W", "ignore::pytest.PytestUnknownMarkWarning", f"--junitxml={xml}", *files, *pytest_args]
    t0 = time.monotonic()
    log = out / f"pytest-{tag}.log"
    with log.open("w") as f:
        r = subprocess.run(cmd, cwd=root, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=timeout,
                           check=False)
    if r.returncode not in (0, 1) or not xml.exists():
        tail = log.read_text()[-3000:]
        raise SystemExit(f"vllm_core_suite: pytest for {policy} exited {r.returncode} (see {log}):\n{tail}")
    text = log.read_text()
    if policy == "stock":
        ok = "vllm_core_plugin: stock vLLM scheduler classes" in text
    else:
        m = re.search(rf"vllm_core_plugin: policy {re.escape(policy)}: schedulers built through the "
                      r"substitution: (.*)", text)
        ok = m is not None and m.group(1).strip() != "none"
    if not ok:
        raise SystemExit(f"vllm_core_suite: the plugin did not report its substitution for {tag} (see {log})")
    print(f"  {tag}: pytest took {time.monotonic() - t0:.0f} s", flush=True)
    return parse_junit(xml)


def parse_junit(xml: Path) -> dict[str, str]:
    results: dict[str, str] = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        tid = f"{case.get('classname', '')}::{case.get('name', '')}"
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed"}.get(child.tag, child.tag)
                break
        results[tid] = outcome
    return results


def compare(stock: dict[str, str], ours: dict[str, str]) -> tuple[int, int, list[str]]:
    """(stock passes, of which ours passes, the lost test ids)."""
    passed = [t for t, o in stock.items() if o == "passed"]
    lost = sorted(t for t in passed if ours.get(t) != "passed")
    return len(passed), len(passed) - len(lost), lost


def node_id(root: Path, test: str) -> str:
    """pytest's node id of a junit test id (``tests.v1.core.test_x.TestC::name``)."""
    classname, name = test.split("::", 1)
    parts = classname.split(".")
    for i in range(len(parts), 0, -1):
        path = "/".join(parts[:i]) + ".py"
        if (root / path).exists():
            return "::".join([path, *parts[i:], name])
    raise SystemExit(f"vllm_core_suite: no test file for {test}")


def refusal(policy: str, options: dict | None) -> str | None:
    """Why ``MarsScheduler`` refuses to start ``policy`` in this suite (None when it starts): the
    policy's own platform check, or a KV offloading connector it needs, which the suite's
    ``create_scheduler`` does not configure (the scheduler refuses to start without one)."""
    from vllm.platforms import current_platform

    from vllm_mars.policies import make_policy

    pol = make_policy(policy, options)
    platform = str(current_platform.device_type)
    try:
        pol.check_platform(platform)
    except ValueError as e:
        return f"refuses the {platform} build: {e}"
    if pol.needs_kv_connector:
        return ("needs a KV offloading connector, and the suite's create_scheduler configures none: the "
                "scheduler refuses to start")
    return None


def explain_losses(root: Path, site: Path, policy: str, out: Path, options: dict | None, lost: list[str],
                   timeout: float) -> dict[str, str]:
    """The reason for each loss of ``policy``: a listed reason, its gate's or its victim ranking's
    (when the test passes with that decision turned off), or UNEXPLAINED."""
    listed = LISTED_LOSSES.get(policy, {})
    why = {t: listed[t] for t in lost if t in listed}
    for kind, switches in (("gate", GATES), ("victim", VICTIMS)):
        rest = [t for t in lost if t not in why]
        if rest and policy in switches:
            off, reason = switches[policy]
            again = run_suite(root, site, policy, out, {**(options or {}), **off}, [node_id(root, t) for t in rest],
                              [], timeout, tag=f"{policy}-{kind}-off")
            why.update({t: f"{kind}: {reason}" for t in rest if again.get(t) == "passed"})
    return {t: why.get(t, "UNEXPLAINED") for t in lost}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policies", default="fcfs,mars", help="comma-separated policies (default fcfs,mars)")
    ap.add_argument("--all", action="store_true", help="every registered policy")
    ap.add_argument("--policy-options", default="{}", help='JSON {policy: {option: value}}')
    ap.add_argument("--check", action="store_true",
                    help="exit 1 when a policy loses a test stock passes (beyond its listed gating losses)")
    ap.add_argument("--out", default=None, help="directory for logs, junit XML and results.json "
                                                "(default: the cache dir's runs/)")
    ap.add_argument("--whole", action="store_true",
                    help="run all of tests/v1/core (default: the files that call create_scheduler)")
    ap.add_argument("--baseline", default=None,
                    help="reuse the stock run (junit-stock.xml) of an earlier --out directory on this machine")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per pytest run (default 3600)")
    ap.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --), e.g. -k async")
    args = ap.parse_args(argv)

    from vllm_mars.policies import available_policies

    policies = list(available_policies()) if args.all else [p for p in args.policies.split(",") if p]
    unknown = [p for p in policies if p not in available_policies()]
    if unknown:
        ap.error(f"unknown policies {unknown}; available: {', '.join(available_policies())}")
    options = json.loads(args.policy_options)
    if not isinstance(options, dict) or not all(isinstance(v, dict) for v in options.values()):
        ap.error('--policy-options must be a JSON object {"policy": {"option": value}}')

    cache = cache_root()
    sdist = fetch_sdist(cache)
    root = extract_tests(sdist, cache)
    site = install_test_deps(cache)
    out = Path(args.out) if args.out else cache / "runs" / time.strftime("%Y%m%dT%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    print(f"vllm_core_suite: vLLM {VLLM_VERSION} tests/v1/core from {sdist}; logs in {out}", flush=True)

    files = suite_files(root, args.whole)
    if args.baseline:
        stock = parse_junit(Path(args.baseline) / "junit-stock.xml")
    else:
        stock = run_suite(root, site, "stock", out, None, files, args.pytest_args, args.timeout)
    summary = {"vllm": VLLM_VERSION, "date": time.strftime("%Y-%m-%d"), "files": files, "tests": len(stock),
               "stock_passed": sum(o == "passed" for o in stock.values()), "policies": {}}
    print(f"stock: {summary['stock_passed']} of {len(stock)} tests pass", flush=True)
    bad = False
    for policy in policies:
        why_not = refusal(policy, options.get(policy))
        if why_not is not None:
            # Not a loss: the scheduler refuses to start the policy here, in every test alike.
            summary["policies"][policy] = {"not_run": why_not}
            print(f"{policy}: NOT RUN: {why_not}", flush=True)
            continue
        ours = run_suite(root, site, policy, out, options.get(policy), files, args.pytest_args, args.timeout)
        # With a selection (-k, node ids) only the tests both runs ran are compared.
        n, kept, lost = compare({t: o for t, o in stock.items() if t in ours} if args.pytest_args else stock, ours)
        why = explain_losses(root, site, policy, out, options.get(policy), lost, args.timeout)
        unexplained = [t for t in lost if why[t] == "UNEXPLAINED"]
        summary["policies"][policy] = {"passed_of_stock": kept, "stock_passed": n, "lost": why,
                                       "gained": sorted(t for t, o in ours.items()
                                                        if o == "passed" and stock.get(t) != "passed")}
        print(f"{policy}: {kept} of the {n} stock passes pass"
              + (f"; lost {len(lost)} ({len(unexplained)} unexplained)" if lost else ""), flush=True)
        for t in lost:
            print(f"    LOST {t}: {why[t]}", flush=True)
        bad |= bool(unexplained)
        (out / "results.json").write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    (out / "results.json").write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    print(f"wrote {out / 'results.json'}")
    return 1 if args.check and bad else 0


if __name__ == "__main__":
    sys.exit(main())
