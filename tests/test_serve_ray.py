"""mars on Ray Serve (issue 33): two tiny vLLM CPU replicas on a local Ray cluster, the admission
gate (the sidecar over the replicas, fed by MarsRouter) in front.

Real parts only: a local Ray cluster, Ray Serve, two real vLLM OpenAI servers with MarsScheduler
(one per replica), the real gate over HTTP. The replica "killed mid-run" is killed for real
(SIGKILL to its actor process; its vLLM server dies with it). Skipped without ``ray[serve]``.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest
from conftest import free_port

ray = pytest.importorskip("ray")
pytest.importorskip("ray.serve")

from vllm_mars import serve_ray
from vllm_mars.admission.sidecar import SidecarConfig
from vllm_mars.admission.sidecar.serving import ServerThread
from vllm_mars.admission.telemetry import parse_prometheus

BLOCKS = 64


def wait_until(pred, timeout: float, step: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(step)
    return pred()


@pytest.fixture(scope="module")
def gate(tiny_model, tmp_path_factory):
    from vllm_mars.engine.local import server_args

    logs = tmp_path_factory.mktemp("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, object_store_memory=80 << 20,
             runtime_env={"env_vars": {"PYTHONPATH": os.environ.get("PYTHONPATH", "")}})
    engine_pids: set[int] = set()
    try:
        argv = server_args(tiny_model, served_model_name="tiny", cpu=True, policy="mars", num_blocks=BLOCKS,
                           max_model_len=1024, max_num_seqs=4)[4:]
        handle = serve_ray.start(2, argv, replica_cpus=0.5, startup_timeout_s=300, log_dir=str(logs))
        cfg = SidecarConfig(backends=("http://unused",), controller="mars", port=free_port(),
                            idle_timeout_s=120.0)
        with ServerThread(serve_ray.gate_for(handle, cfg)) as th:
            g = th.app
            assert wait_until(lambda: len([b for b in g.backends if b.up]) == 2, 120), g.backends
            for b in g.backends:
                engine_pids.add(b.stats["engine_pid"])
            th.engine_pids = engine_pids
            yield th
    finally:
        # the killed replica's replacement may still be starting: leave Ray without waiting for it,
        # then end every engine process group the replicas recorded
        serve_ray.stop(wait=False, log_dir=str(logs))
        for pid in engine_pids:  # the replicas stop their servers; make sure no process is left on the box
            try:
                os.killpg(pid, signal.SIGKILL)  # (each server leads its own process group)
            except ProcessLookupError:
                pass


def chat(th, root: str, text: str, max_tokens: int = 4, last: bool = False, stream: bool = False):
    body = {"model": "tiny", "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
            "temperature": 0, "stream": stream, "ignore_eos": True}
    if last:
        body["vllm_xargs"] = {"mars_last_step": True}
    r = httpx.post(th.url + "/v1/chat/completions", json=body, headers={"X-MARS-Workflow": root}, timeout=240)
    assert r.status_code == 200, r.text[:500]
    return r


def replica_of(th, root: str) -> str:
    r = th.app.roots.get(root)
    assert r is not None and r.backend is not None, root
    return r.backend.name


def engine_metric(url: str, name: str) -> float:
    m = parse_prometheus(httpx.get(url + "/metrics", timeout=10).text)
    return sum(v for _, v in m.get(name, []))


def engine_idle(url: str) -> bool:
    return all(engine_metric(url, n) == 0 for n in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                                                     "vllm:kv_cache_usage_perc"))


def test_ray_replicas_pin_sessions_place_by_budget_and_survive_a_killed_replica(gate):
    g = gate.app
    reps = {b.name: b for b in g.backends}
    assert len(reps) == 2

    # a session's turns stay on its replica (the calls counted on each replica say where they went)
    text = "the quick brown fox jumps over the lazy dog " * 6
    chat(gate, "A", text)
    home = replica_of(gate, "A")
    other = next(n for n in reps if n != home)
    before = {n: b.pool.requests for n, b in reps.items()}
    for turn in range(3):
        text += f" turn {turn} answer and tool output " * 4
        chat(gate, "A", text)
        assert replica_of(gate, "A") == home
    assert reps[home].pool.requests - before[home] == 3 and reps[other].pool.requests == before[other]

    # calls through the Serve handle go where MarsRouter sends them: the pinned replica
    for name in reps:
        rid, status, _, _ = g.handle.call.remote("/v1/models", b"", [], "GET", mars_replica=name).result()
        assert (rid, status) == (name, 200)

    # a new root goes where the budget is: A's replica owes A's footprint, so B goes to the other one
    scores = {n: g.placement.score(b) for n, b in reps.items()}
    assert scores[other] > scores[home], scores
    chat(gate, "B", "a different task entirely " * 10)
    assert replica_of(gate, "B") == other

    # a replica killed mid-run loses no workflow: A's next turn is in flight on its replica when
    # the replica's process is killed; the call is answered from the other replica (A rebuilds
    # its context there) and A's later turns stay there
    victim = reps[home]
    pid, engine_pid = victim.stats["pid"], victim.stats["engine_pid"]
    out: dict = {}

    def long_turn() -> None:
        try:
            out["r"] = chat(gate, "A", text + " now write a long answer", max_tokens=600)
        except BaseException as e:  # noqa: BLE001 (reported by the assert below)
            out["e"] = e

    t = threading.Thread(target=long_turn)
    sent = victim.pool.requests
    t.start()
    assert wait_until(lambda: victim.pool.requests > sent, 30)
    # the call is decoding in the victim's engine (600 tokens: seconds on the CPU) when it dies
    assert wait_until(lambda: engine_metric(victim.url, "vllm:num_requests_running") >= 1, 30)
    os.kill(pid, signal.SIGKILL)  # the replica actor, and with it (its process group) its engine
    os.killpg(engine_pid, signal.SIGKILL)
    t0 = time.monotonic()
    t.join(240)
    assert not t.is_alive() and "e" not in out, out
    assert out["r"].json()["usage"]["completion_tokens"] == 600  # answered whole, by the other replica
    assert replica_of(gate, "A") == other
    assert g.counters["upstream_errors"] == 0  # resent, not failed: the client saw no error
    print(f"answered {time.monotonic() - t0:.1f} s after the kill")
    chat(gate, "A", text + " next turn", last=True)  # A's last step: it ends normally
    chat(gate, "B", "a different task entirely " * 10 + " more", last=True)
    assert g.counters["finished"] >= 2

    # leak check: nothing in flight, nothing admitted or queued at the gate, the surviving engine idle
    assert wait_until(lambda: g.in_flight == 0 and g.controller.num_active == 0 and g.controller.num_queued == 0,
                      10), (g.in_flight, g.controller.num_active, g.controller.num_queued)
    assert g.queue_budget.calls == 0 and g.queue_budget.bytes == 0
    assert not g.roots
    assert wait_until(lambda: engine_idle(reps[other].url), 60)


# -- the replica set the router feeds (plain data: Serve's RunningReplica fields the set reads) ----

class _Rep:
    def __init__(self, rid: str, stats: dict) -> None:
        self.replica_id = type("Id", (), {"unique_id": rid})()
        self.routing_stats = stats


def _stats(url: str, seq: int, free: int, total: int = 100) -> dict:
    return {"url": url, "seq": seq, "telemetry": {"free_blocks": free, "total_blocks": total, "block_size": 16,
                                                  "kv_usage": 1 - free / total}}


def test_replica_set_follows_serve_and_places_by_budget():
    from vllm_mars.admission.placement import Placement

    s = serve_ray.ReplicaSet(stale_s=5.0)
    changes = []
    s.on_change = changes.append
    # a replica that has not reported yet is no target; readings become Telemetry
    s.sync([_Rep("r1", _stats("http://h:1", 1, 80)), _Rep("r2", {})])
    assert list(s.by_id) == ["r1"] and s.by_id["r1"].up and changes == [True]
    s.sync([_Rep("r1", _stats("http://h:1", 2, 30)), _Rep("r2", _stats("http://h:2", 1, 90))])
    b1, b2 = s.by_id["r1"], s.by_id["r2"]
    assert (b1.telemetry.last.free_blocks, b2.telemetry.last.free_blocks) == (30, 90)
    assert Placement(s.backends, None).place("root") is b2  # the most budget
    # a failure sticks until a new reading (same seq: the same reading re-sent by Serve)
    b2.telemetry._fail("broken")
    s.sync([_Rep("r1", _stats("http://h:1", 2, 30)), _Rep("r2", _stats("http://h:2", 1, 90))])
    assert not b2.up and Placement(s.backends, None).place("root2") is b1
    s.sync([_Rep("r1", _stats("http://h:1", 2, 30)), _Rep("r2", _stats("http://h:2", 2, 90))])
    assert b2.up
    # a replica that left, or died, is gone from the set
    s.drop("r2")
    assert list(s.by_id) == ["r1"] and not b2.up and changes[-1] is True
    s.sync([])
    assert s.backends == []
    for b in (b1, b2):
        b.pool.close()


def test_the_router_scores_replicas_under_the_gate_admission_lock():
    """MarsRouter runs on Serve's router thread; scoring reads the gate's promises (and drops the
    landed ones): it takes the admission's lock, so it waits while the gate's loop holds it, then
    ranks by budget (no catch-all for a state changed under it)."""
    import asyncio
    import threading

    from vllm_mars.admission.base import PendingRoot, make_controller
    from vllm_mars.admission.placement import Placement, pooled_telemetry
    from vllm_mars.admission.replicas import ReplicaAdmission
    from vllm_mars.serve_ray.router import MarsRouter

    s = serve_ray.ReplicaSet(stale_s=5.0)
    s.sync([_Rep("r1", _stats("http://h:1", 1, 30)), _Rep("r2", _stats("http://h:2", 1, 90))])
    pl = s.placement = Placement(s.backends, None)
    adm = ReplicaAdmission(pl, lambda: make_controller("mars", {}))
    adm.observe(pooled_telemetry(pl.backends))
    router = MarsRouter.__new__(MarsRouter)  # no Serve: choose_replicas reads only the shared set
    router._set = s
    cands = [_Rep("r1", {}), _Rep("r2", {})]
    out: dict = {}
    t = threading.Thread(target=lambda: out.update(r=asyncio.run(router.choose_replicas(cands))), daemon=True)
    with adm.lock:
        t.start()
        t.join(0.3)
        assert "r" not in out  # waits for the gate's loop
    t.join(10)
    assert [[c.replica_id.unique_id for c in g] for g in out["r"]] == [["r2"], ["r1"]]
    adm.offer(PendingRoot("A", 0.0, 64))
    assert adm.backend_of("A") is s.by_id["r2"]
    adm.finish("A", 1.0)
    assert adm.num_active == adm.num_queued == 0 and all(not b.roots for b in s.backends)
    assert all(c.promised_blocks() == 0 for c in adm.ctrls)
    for b in s.backends:
        b.pool.close()


def test_a_dead_replica_server_is_told_from_a_live_one():
    """What decides a resend: a server that refuses, or whose listening socket nobody accepts on
    (a killed server's socket kept by a surviving child), gives no HTTP answer; a live one does."""
    import asyncio
    import socket

    from faulty_backend import FaultyBackend

    with FaultyBackend(free_port()) as fb:
        assert asyncio.run(serve_ray._answers_http(fb.url, 3.0))
    with socket.socket() as s:  # listening, never accepting
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        assert not asyncio.run(serve_ray._answers_http(f"http://127.0.0.1:{s.getsockname()[1]}", 0.5))
    assert not asyncio.run(serve_ray._answers_http(f"http://127.0.0.1:{free_port()}", 0.5))  # refused


def test_mars_serve_placement_reaches_the_gate(tiny_model):
    """``mars serve --ray --placement RULE``: the gate places new roots over the replicas by RULE."""
    import zlib

    from vllm_mars.cli import build_parser
    from vllm_mars.commands.admission import _sidecar_config

    args = build_parser().parse_args(["serve", tiny_model, "--ray", "--placement", "session-hash"])
    cfg = _sidecar_config(args, (serve_ray.RAY_BACKEND_LABEL,), args.host, args.port)
    s = serve_ray.ReplicaSet(stale_s=5.0)  # (gate_for's set is the module's live deployment's)
    g = serve_ray.RayGate(cfg, None, s)
    try:
        s.sync([_Rep("r1", _stats("http://h:1", 1, 90)), _Rep("r2", _stats("http://h:2", 1, 10))])
        g._replicas_changed()
        assert g.placement.rule == "session-hash"
        roots = [f"root-{k}" for k in range(6)]
        got = [g.placement.place(r).name for r in roots]
        assert got == [g.backends[zlib.crc32(r.encode()) % 2].name for r in roots]
        assert "r2" in got, "session hash, not the most budget (r1)"
    finally:
        for b in list(s.by_id.values()):
            b.pool.close()


@pytest.mark.parametrize(("flags", "message"), [
    (["--placement", "round-robin"], "--placement: only with --ray"),
    (["--ray", "--placement", "rr"], "--placement 'rr' unknown; allowed: mars, round-robin, session-hash"),
    (["--replicas", "2"], "--replicas: only with --ray"),
    (["--address", "10.0.0.1:6379", "--replica-gpus", "1"], "--address, --replica-gpus: only with --ray"),
    (["--ray", "--replicas", "0"], "--replicas 0: give at least 1"),
    (["--ray", "--replica-cpus", "nan"], "--replica-cpus nan: must be above 0"),
    (["--ray", "--replica-gpus", "-1"], "--replica-gpus -1.0: must be 0 or more"),
])
def test_mars_serve_ray_flags_are_checked_before_anything_starts(tiny_model, capsys, flags, message):
    from vllm_mars import cli

    assert cli.main(["serve", tiny_model, *flags]) == 2
    assert message in capsys.readouterr().err
