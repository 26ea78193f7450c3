"""The cluster in virtual time (``--backend sim --replicas N``) and the placement rules it shares
with the sidecar: each rule places a new root as specified, a workflow's turns and children stay on
its replica, one replica is byte-identical to the plain sim backend, and bad values are one-line
errors naming the option and the allowed values. Every run ends with each engine's leak check
(``SimBackend.close`` raises on a leak; ``leak_check`` in the run's engine stats)."""

from __future__ import annotations

import asyncio
import json
import zlib
from pathlib import Path

import pytest
from vllm_mars.admission.placement import PLACEMENT_RULES, Placement
from vllm_mars.driver.runner import ReplayConfig, run_replay
from vllm_mars.sim.cluster import SimCluster
from vllm_mars.sim.engine import SimBackend, get_profile
from vllm_mars.sim.loop import run_virtual

REPO = Path(__file__).resolve().parents[1]
COMPACT = REPO / "benchmark" / "workloads" / "compact.jsonl"
TINY = "cpu-tiny"  # 96 blocks x 32 tokens


def _run(tmp_path: Path, name: str, **kw) -> Path:
    cfg = ReplayConfig(workload=str(COMPACT), policy=kw.pop("policy", "mars"), rps=4.0, backend="sim", profile=TINY,
                       progress=False, plots=False, out=str(tmp_path / name), **kw)
    out, _ = run_replay(cfg)
    return out


def test_one_replica_is_byte_identical_to_the_plain_sim(tmp_path):
    plain = _run(tmp_path, "plain")
    one = _run(tmp_path, "one", replicas=1)
    for f in ("events.jsonl", "summary.json", "traces.jsonl"):
        assert (plain / f).read_bytes() == (one / f).read_bytes(), f
    s = json.loads((one / "summary.json").read_text())
    assert s["completed"] == 28 and s["engine"]["leak_check"] == "ok"
    rc = json.loads((one / "run_config.json").read_text())
    assert rc["replicas"] == 1 and rc["placement"] == "mars"


def _cluster(n: int, rule: str, clock, **kw) -> SimCluster:
    prof = get_profile(TINY)
    return SimCluster([SimBackend(prof, clock, **kw) for _ in range(n)], clock, rule=rule)


def _call(c: SimCluster, rid: str, root: str | None, n_tokens: int, out: int = 4, seed: int = 0):
    ids = [3 + (seed * 7919 + i * 31) % 4000 for i in range(n_tokens)]
    extra = {"mars_workflow": rid.split(":")[0], "mars_root": root} if root else {}
    return asyncio.ensure_future(c.generate(rid, ids, out, extra))


async def _settle(c: SimCluster, load: list[int]) -> None:
    """Loop passes until the engines hold the calls sent (``load``: requests per replica)."""
    for _ in range(50):
        if [Placement.load(r) for r in c.replicas] == load:
            return
        await asyncio.sleep(0)
    raise AssertionError(f"engines hold {[Placement.load(r) for r in c.replicas]} requests, not {load}")


def test_each_rule_places_new_roots_as_specified():
    async def main(rule: str) -> list[int]:
        loop = asyncio.get_running_loop()
        c = _cluster(3, rule, loop.time)
        await c.start()
        try:
            # replica 0 busy: 3 long calls (most of its KV, 3 requests); replica 2: 1 short call
            c._home["b0"] = c._home["b1"] = c._home["b2"] = c.replicas[0]  # (placed by hand for the setup)
            c._home["s"] = c.replicas[2]
            busy = [_call(c, f"b{i}:t0", f"b{i}", 700, out=400, seed=i) for i in range(3)]
            one = _call(c, "s:t0", "s", 40, out=400, seed=9)
            await _settle(c, [3, 0, 1])
            placed = [c.replicas.index(c._place(f"new{k}", [5] * 64)) for k in range(6)]
            for t in [*busy, one]:
                t.cancel()
            await asyncio.gather(*busy, one, return_exceptions=True)
            return placed
        finally:
            await c.close()

    assert run_virtual(main("round-robin")) == [0, 1, 2, 0, 1, 2], "round robin: in turn, whatever the load"
    sh = run_virtual(main("session-hash"))
    assert sh == [zlib.crc32(f"new{k}".encode()) % 3 for k in range(6)], "session hash: crc32(root) mod N"
    assert len(set(sh)) > 1
    # least loaded: the empty replica 1 while it has no more roots than 2 (the new roots send no call)
    assert run_virtual(main("least-loaded")) == [1, 1, 1, 1, 1, 1]
    # mars: by KV budget (replica 0's is held by the long prompts; 2's a little), then fewer roots
    assert run_virtual(main("mars"))[0] == 1


def test_mars_rule_counts_the_roots_queued_at_a_replica():
    """Roots are placed when they arrive, before any is admitted: the ``mars`` rule nets a replica's
    budget of the footprints of the roots already queued there, so a burst of arrivals spreads
    instead of piling onto the replica that had a few blocks more."""
    from vllm_mars.admission.base import PendingRoot, make_controller

    async def main() -> list[int]:
        loop = asyncio.get_running_loop()
        c = _cluster(2, "mars", loop.time)
        await c.start()
        try:
            adm = c.bind_controller(make_controller("mars"), lambda: make_controller("mars"))
            c._home["s"] = c.replicas[1]  # replica 1 holds a short call: a few blocks less budget
            one = _call(c, "s:t0", "s", 100, out=400, seed=9)
            await _settle(c, [0, 1])
            for k in range(4):  # 4 arrivals of 20 blocks each, none admitted yet (no tick)
                adm.offer(PendingRoot(f"new{k}", loop.time(), 20 * 32))
            placed = [c.replicas.index(c._home[f"new{k}"]) for k in range(4)]
            assert adm.num_queued == 4 and adm.num_active == 0
            assert adm.promised_blocks([f"new{k}" for k in range(4) if placed[k] == 0]) > 0
            for k in range(4):
                adm.finish(f"new{k}", loop.time())
                c.end_root(f"new{k}")
            one.cancel()
            await asyncio.gather(one, return_exceptions=True)
            return placed
        finally:
            await c.close()

    assert run_virtual(main()) == [0, 1, 0, 1]


def test_session_hash_skips_a_down_replica_and_is_stable_across_instances():
    async def main():
        loop = asyncio.get_running_loop()
        c = _cluster(4, "session-hash", loop.time)
        await c.start()
        try:
            c.bind_controller(None)
            home = c.placement.place("root-x")
            again = Placement(c.replicas, None, rule="session-hash").place("root-x")
            assert home is again is c.replicas[zlib.crc32(b"root-x") % 4]
            home.up = False
            assert Placement(c.replicas, None, rule="session-hash").place("root-x") is \
                c.replicas[(zlib.crc32(b"root-x") + 1) % 4]
            home.up = True
        finally:
            await c.close()

    run_virtual(main())


def test_turns_and_children_stay_on_their_replica(tmp_path, monkeypatch):
    """Every call of a root (its turns and its children's) runs on the replica its first call was
    placed on; on a pool that evicts nothing, every later turn hits the prefix cache (a turn sent
    to another replica would miss it)."""
    seen: dict[str, set[int]] = {}
    real = SimBackend.generate

    async def spy(self, request_id, prompt_ids, max_tokens, extra_args, ignore_eos=True):
        if "mars_root" in extra_args:  # (the calibration's solo calls have none: an engine of their own)
            seen.setdefault(extra_args["mars_root"], set()).add(id(self))
        return await real(self, request_id, prompt_ids, max_tokens, extra_args, ignore_eos)

    monkeypatch.setattr(SimBackend, "generate", spy)
    for rule in PLACEMENT_RULES:
        seen.clear()
        out = _run(tmp_path, rule, replicas=3, placement=rule, kv_scale=20.0)
        s = json.loads((out / "summary.json").read_text())
        assert s["completed"] == 28 and s["engine"]["leak_check"] == "ok"
        assert len(seen) == 28 and all(len(v) == 1 for v in seen.values()), rule
        assert len({e for v in seen.values() for e in v}) == 3, f"{rule}: roots spread over the 3 replicas"
        cl = s["engine"]["cluster"]
        assert cl["placement"] == rule and sum(r["roots"] for r in cl["per_replica"]) == 28
        assert cl["imbalance"]["roots"] >= 1.0 and cl["imbalance"]["busy_s"] >= 1.0
        prev: dict[str, int] = {}
        for line in (out / "events.jsonl").read_text().splitlines():
            e = json.loads(line)
            if e["event"] != "call_end":
                continue
            if e["turn"] > 0:
                full = ((prev[e["workflow"]] - 1) // 32) * 32  # the last turn's KV (its last token has none)
                assert e["cached_tokens"] >= full, (rule, e)
            prev[e["workflow"]] = e["prompt_tokens"] + e["output_tokens"]


def test_a_cluster_sums_its_replicas_for_the_controller_and_the_summary(tmp_path):
    out = _run(tmp_path, "c4", replicas=4, placement="round-robin")
    s = json.loads((out / "summary.json").read_text())
    eng = s["engine"]
    prof = get_profile(TINY)
    assert eng["num_blocks"] == 4 * (prof.num_kv_blocks() - 1), "pooled: every replica's usable blocks"
    assert eng["free_blocks"] == eng["num_blocks"] and eng["leak_check"] == "ok"
    per = eng["cluster"]["per_replica"]
    assert [r["roots"] for r in per] == [7, 7, 7, 7], "round robin over 4: 28 roots, 7 each"
    assert eng["busy_s"] == pytest.approx(sum(r["busy_s"] for r in per))
    first = json.loads((out / "events.jsonl").read_text().splitlines()[1])
    assert first["event"] == "kv_sample" and first["total_blocks"] == eng["num_blocks"]


def test_each_replica_admits_its_own_roots_by_its_own_reading(tmp_path):
    """Per-replica admission: a root is placed when it arrives (round robin: the k-th arrival on
    replica k mod 3) and admitted by its replica's controller, which judges that replica's KV alone
    (one replica's blocks, not the fleet's)."""
    out = _run(tmp_path, "adm3", replicas=3, placement="round-robin")
    s = json.loads((out / "summary.json").read_text())
    assert s["completed"] == 28 and s["engine"]["leak_check"] == "ok"
    assert s["engine"]["cluster"]["admission"] == "per-replica"
    one = get_profile(TINY).num_kv_blocks() - 1
    order: list[str] = []
    admits: dict[str, dict] = {}
    for line in (out / "events.jsonl").read_text().splitlines():
        e = json.loads(line)
        if e["event"] == "workflow_arrive":
            order.append(e["workflow"])
        elif e["event"] == "admission_admit":
            admits[e["workflow"]] = e
    assert len(order) == len(admits) == 28
    for k, wf in enumerate(order):
        assert admits[wf]["replica"] == k % 3, (wf, admits[wf])
    seen = [a["total_blocks"] for a in admits.values() if a["total_blocks"] is not None]  # (None: before a reading)
    assert len(seen) > 20 and set(seen) == {one}, "each controller reads its own replica"
    assert s["engine"]["num_blocks"] == 3 * one


@pytest.mark.parametrize("kw, text", [
    ({"placement": "rr"}, "placement 'rr' unknown; allowed: mars, round-robin, session-hash, least-loaded"),
    ({"placement": "round-robin"}, "placement 'round-robin' places roots over replicas: give --replicas N"),
    ({"replicas": 0}, "replicas must be 1..1024, got 0"),
    ({"replicas": 2, "backend": "inprocess", "profile": None}, ("replicas runs N simulated engines: it needs "
                                                                "--backend sim")),
    ({"replicas": True}, "replicas must be int"),
])
def test_bad_cluster_options_are_one_line_errors(kw, text):
    base = {"backend": "sim", "profile": TINY, **kw}
    with pytest.raises(ValueError) as e:
        ReplayConfig(**base).validate()
    assert text in str(e.value) and "\n" not in str(e.value)


def test_placement_rule_is_checked_by_the_options_validator():
    with pytest.raises(ValueError, match="placement 'nope' unknown; allowed: mars, round-robin, session-hash, "
                                         "least-loaded"):
        Placement([], None, rule="nope")


def test_sidecar_placement_flag_is_validated_and_reaches_its_placement():
    import os
    import subprocess
    import sys

    from vllm_mars.admission.sidecar import Sidecar, SidecarConfig

    p = subprocess.run([sys.executable, "-m", "vllm_mars.cli", "sidecar", "--backend", "http://127.0.0.1:9",
                        "--placement", "rr"], check=False, capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert p.returncode == 2, p.stderr
    err = p.stderr.strip().splitlines()
    assert len(err) == 1 and "--placement 'rr' unknown; allowed: mars, round-robin, session-hash, least-loaded" \
        in err[0], p.stderr
    sc = Sidecar(SidecarConfig(backends=("http://127.0.0.1:9", "http://127.0.0.1:10"), placement="round-robin"))
    assert sc.placement.rule == "round-robin"
    assert [sc.placement.place(f"r{i}").url for i in range(4)] == ["http://127.0.0.1:9", "http://127.0.0.1:10"] * 2


def test_the_scale_out_experiment_sets_replicas_and_placement_per_variant(tmp_path):
    from vllm_mars.driver.compare import policy_config
    from vllm_mars.experiment.spec import ExperimentError, load_experiment

    exp = load_experiment(REPO / "experiments" / "scale_out" / "scale_out.toml")
    cfg = policy_config(exp.base, "rr-n16", exp.variants["rr-n16"], rps=3.2)
    assert (cfg.replicas, cfg.placement, cfg.policy) == (16, "round-robin", "mars")
    assert "window_max" not in cfg.admission_options, "each replica's controller has the one-engine defaults"
    assert cfg.kv_scale == 0.125 and cfg.backend == "sim"
    assert {w.name: (w.preset, w.num_workflows, w.rps, w.scale) for w in exp.workloads} == {
        "N1": ("ILR-2", 100, (0.2, 0.4), 8), "N4": ("ILR-2", 400, (0.8, 1.6), 8),
        "N16": ("ILR-2", 1600, (3.2, 6.4), 8), "N64": ("ILR-2", 6400, (12.8, 25.6), 8),
        "N1-ILR3": ("ILR-3", 100, (0.16, 0.32), 8), "N4-ILR3": ("ILR-3", 400, (0.64, 1.28), 8)}
    bad = tmp_path / "bad.toml"
    for table, text in (('{ replicas = 2, placement = "rr" }', "variants.x.replay: placement 'rr' unknown; allowed:"),
                        ("{ replicas = 2, rps = 3.0 }", "variants.x.replay.rps: unknown key"),
                        ('{ replicas = "2" }', "variants.x.replay: replicas must be int, got '2'")):
        bad.write_text(f'backend = "sim"\nprofile = "{TINY}"\npolicies = ["x"]\n[variants.x]\npolicy = "mars"\n'
                       f'replay = {table}\n[[workloads]]\nname = "w"\npreset = "ILR-1"\nrps = [1.0]\n')
        with pytest.raises(ExperimentError, match=text.replace("(", r"\(")):
            load_experiment(bad)


GOLDEN = REPO / "tests" / "data" / "sim_cluster_golden"


@pytest.mark.parametrize("n", [2, 4])
def test_cluster_runs_are_byte_identical_to_the_recorded_ones(tmp_path, n):
    """The per-replica admission moved into :mod:`vllm_mars.admission.replicas` (shared with the
    sidecar and the Ray gate) without changing a sim run: ``--replicas 2/4`` (``mars`` rule) give the
    events and summary recorded from the code before the move (main at ec28432, generated with this
    test's settings and gzipped; the workload's path is recorded as ``@COMPACT@``). The events were
    recorded again after the admission's slot-wait fix (docs/admission.md), which changed only the
    ``expected_queue_s`` field of some ``admission_admit`` events (12 lines at 2 replicas): no
    decision, no summary field; and again when a run's start was rewound to virtual time 0 after its
    calibration, which changed only the measured ``rebuild_share`` of some events (16 lines at 2
    replicas, 1 at 4: windows that ended a float's width apart): no decision, no summary field."""
    import gzip

    out = _run(tmp_path, f"r{n}", replicas=n, placement="mars")
    for f in ("summary.json", "events.jsonl"):
        want = gzip.decompress((GOLDEN / f"r{n}-mars.{f}.gz").read_bytes()).replace(
            b"@COMPACT@", str(COMPACT).encode())
        assert (out / f).read_bytes() == want, f"replicas={n}: {f} differs from the recorded run"
    s = json.loads((out / "summary.json").read_text())
    assert s["engine"]["leak_check"] == "ok" and s["engine"]["cluster"]["admission"] == "per-replica"
