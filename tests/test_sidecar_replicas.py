"""The sidecar with several backends admits per backend (:mod:`vllm_mars.admission.replicas`, the
logic the Ray gate and the cluster sim use too): a root is placed when it arrives and waits at its
backend's own controller, so a root queued at a full backend does not hold up one placed on a free
backend; a root's turns stay on its backend; a backend that dies sends its roots to a live one (a
queued root queues there, an admitted root's next call is resent there) and loses none. Each test
ends with the leak check: nothing active, queued, in flight or placed, and the engine idle."""

from __future__ import annotations

import threading
import time

import httpx
from conftest import free_port
from faulty_backend import FaultyBackend
from polling import wait_until
from vllm_mars.admission.replicas import ReplicaAdmission
from vllm_mars.admission.sidecar import SidecarConfig, SidecarThread
from vllm_mars.admission.telemetry import parse_prometheus

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4,
        "temperature": 0}


def chat(sc, root: str, timeout: float = 60) -> httpx.Response:
    return httpx.post(sc.url + "/v1/chat/completions", json=CHAT, headers={"X-MARS-Workflow": root}, timeout=timeout)


def finish(sc, root: str) -> None:
    assert httpx.post(f"{sc.url}/mars/v1/workflows/{root}/finish", timeout=10).status_code == 200


def in_background(sc, root: str) -> tuple[threading.Thread, dict]:
    """A call of ``root`` on a thread (it waits while its root is queued); the result lands in ``out``."""
    out: dict = {}

    def run() -> None:
        try:
            out["r"] = chat(sc, root)
        except BaseException as e:  # noqa: BLE001 (reported by the caller's asserts)
            out["e"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def home(sc, root: str):
    return sc.call(lambda: sc.app.admission.backend_of(root))


def assert_no_leak(sc) -> None:
    app = sc.app
    assert wait_until(lambda: app.in_flight == 0 and app.controller.num_active == 0
                      and app.controller.num_queued == 0, 10), (app.in_flight, app.controller.num_active,
                                                                app.controller.num_queued)
    assert not app.roots and app.queue_budget.calls == 0
    assert all(not b.roots for b in app.admission.backends), [b.roots for b in app.admission.backends]


def engine_idle(url: str) -> bool:
    m = parse_prometheus(httpx.get(url + "/metrics", timeout=10).text)
    return all(sum(v for _, v in m.get(n, [])) == 0
               for n in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"))


def test_a_root_queued_at_a_full_backend_does_not_block_one_on_a_free_backend(openai_server):
    """One real server reached by two names: two backends, each with its own cap-1 controller,
    round-robin placement. A and B fill both; C waits at A's backend, D at B's. B finishing
    admits D (queued behind C in arrival order, but on the backend that has room), C keeps waiting
    until A ends. One pooled cap-2 controller would admit C first (the head of its queue)."""
    port = openai_server.url.rsplit(":", 1)[1]
    urls = (f"http://127.0.0.1:{port}", f"http://localhost:{port}")
    cfg = SidecarConfig(backends=urls, controller="cap", controller_options={"cap": 1}, placement="round-robin",
                        port=free_port(), telemetry_interval_s=0.1)
    with SidecarThread(cfg) as sc:
        adm = sc.app.admission
        assert isinstance(adm, ReplicaAdmission) and sc.app.controller is adm and len(adm.ctrls) == 2
        assert chat(sc, "A").status_code == 200
        assert chat(sc, "B").status_code == 200  # (one pooled cap-1 controller would hold B here)
        ba, bb = home(sc, "A"), home(sc, "B")
        assert ba is not bb and sc.app.roots["A"].backend is ba and sc.app.roots["B"].backend is bb
        tc, oc = in_background(sc, "C")
        assert wait_until(lambda: sc.app.roots.get("C") is not None)
        td, od = in_background(sc, "D")
        assert wait_until(lambda: sc.app.roots.get("D") is not None)
        assert home(sc, "C") is ba and home(sc, "D") is bb, "placed when they arrived, before admission"
        assert sc.app.controller.num_queued == 2 and not oc and not od
        assert sc.call(lambda: [c.num_queued for c in adm.ctrls]) == [1, 1]
        text = httpx.get(sc.url + "/metrics", timeout=10).text
        for u in urls:
            assert f'mars_backend_admission_queued{{backend="{u}"}} 1' in text, text
            assert f'mars_backend_admission_active{{backend="{u}"}} 1' in text

        finish(sc, "B")
        td.join(30)
        assert od["r"].status_code == 200, od
        assert sc.app.roots["D"].backend is bb
        time.sleep(0.5)  # several ticks: C stays queued at its full backend
        assert tc.is_alive() and not oc and not sc.app.roots["C"].admitted

        assert chat(sc, "A").status_code == 200  # A's later turn: still on its backend
        assert sc.app.roots["A"].backend is ba and ba.roots >= {"A", "C"} and "A" not in bb.roots
        r = httpx.post(sc.url + "/v1/chat/completions", json=CHAT, timeout=60,
                       headers={"x-session-id": "A-child", "x-parent-session-id": "A"})
        assert r.status_code == 200 and sc.app.roots["A"].backend is ba  # a child runs on its root's backend
        finish(sc, "A")
        tc.join(30)
        assert oc["r"].status_code == 200, oc
        assert sc.app.roots["C"].backend is ba
        text = httpx.get(sc.url + "/metrics", timeout=10).text
        assert "mars_admission_limit 2" in text  # the two backends' caps
        for root in ("C", "D"):
            finish(sc, root)
        assert_no_leak(sc)
    assert wait_until(lambda: engine_idle(openai_server.url), 30)


def test_a_dead_backend_sends_its_roots_to_a_live_one():
    """Two backends (real TCP servers with canned /metrics; a killed process closes the port), a
    cap-1 controller each, round robin. A on f1 and B on f2 are admitted; C queues at f1. f1 dies:
    C queues again at f2 (f2 is full: B), A's next call is resent to f2 and answered (A keeps
    running; it leaves f1's controller and is counted active at f2's at once, over its cap). B
    ending leaves f2 at its cap (A): C waits until A ends too."""
    f1 = FaultyBackend(free_port()).__enter__()
    try:
        _dead_backend_case(f1)
    finally:
        if f1._thread.is_alive():
            f1.__exit__(None, None, None)


def _dead_backend_case(f1: FaultyBackend) -> None:
    with FaultyBackend(free_port()) as f2:
        cfg = SidecarConfig(backends=(f1.url, f2.url), controller="cap", controller_options={"cap": 1},
                            placement="round-robin", port=free_port(), telemetry_interval_s=0.05,
                            backend_wait_s=10.0)
        with SidecarThread(cfg) as sc:
            adm = sc.app.admission
            assert chat(sc, "A").status_code == 200 and chat(sc, "B").status_code == 200
            b1, b2 = home(sc, "A"), home(sc, "B")
            assert (b1.url, b2.url) == (f1.url, f2.url) and (f1.posts, f2.posts) == (1, 1)
            tc, oc = in_background(sc, "C")
            assert wait_until(lambda: sc.app.roots.get("C") is not None)
            assert home(sc, "C") is b1 and not oc

            f1.__exit__(None, None, None)  # f1's process dies: its port closes
            assert wait_until(lambda: home(sc, "C") is b2, 10), "a root queued at a dead backend queues at a live one"
            assert not b1.up and tc.is_alive() and not oc  # f2 is full (B): C waits there

            r = chat(sc, "A")  # A's backend refuses: the call is resent to f2, A keeps its admission
            assert r.status_code == 200 and f2.posts == 2 and f1.posts == 1
            assert sc.app.roots["A"].backend is b2 and home(sc, "A") is b2 and sc.app.roots["A"].admitted
            assert sc.app.counters["upstream_errors"] == 0

            assert sc.call(lambda: (adm.ctrls[1].num_active, adm.ctrls[1].num_queued)) == (2, 1)  # A, B; C
            finish(sc, "B")
            time.sleep(0.5)
            assert tc.is_alive() and not oc and not sc.app.roots["C"].admitted  # A holds f2's one slot
            finish(sc, "A")
            tc.join(30)
            assert oc["r"].status_code == 200, oc
            assert sc.app.roots["C"].backend is b2 and f2.posts == 3
            assert sc.call(lambda: (adm.ctrls[0].num_active, adm.ctrls[0].num_queued)) == (0, 0)
            finish(sc, "C")
            assert_no_leak(sc)


# -- the Ray gate's replica set (plain data: the Serve RunningReplica fields the set reads) ---------

class _Rep:
    def __init__(self, rid: str, free: int) -> None:
        self.replica_id = type("Id", (), {"unique_id": rid})()
        self.routing_stats = {"url": f"http://127.0.0.1:9/{rid}", "seq": 1, "telemetry": {
            "free_blocks": free, "total_blocks": 100, "block_size": 16, "kv_usage": 1 - free / 100}}


def _ray_fleet(cap: int = 1, rule: str = "round-robin"):
    """The gate's admission over Serve's replica set (as MarsRouter feeds it), two replicas."""
    from vllm_mars.admission.base import make_controller
    from vllm_mars.admission.placement import Placement
    from vllm_mars.serve_ray.replica import ReplicaSet

    rs = ReplicaSet()
    pl = rs.placement = Placement([], None, rule=rule)
    adm = ReplicaAdmission(pl, lambda: make_controller("cap", {"cap": cap}))
    assert adm.ctrls == [] and pl.controller is adm
    rs.sync([_Rep("r1", 50), _Rep("r2", 50)])
    adm.observe(_pooled(pl))
    return rs, pl, adm


def _pooled(pl):
    from vllm_mars.admission.placement import pooled_telemetry

    return pooled_telemetry(pl.backends)


def _assert_adm_empty(adm, *backends) -> None:
    assert adm.num_active == adm.num_queued == 0 and not any(b.roots for b in backends)
    assert all(c.promised_blocks() == 0 for c in adm.ctrls)


def test_ray_replicas_get_a_controller_as_they_join_and_a_leaving_one_is_retired():
    """A controller per replica, made when the replica first reports. A replica that leaves has its
    controller retired: its queued roots queue at a live replica ahead of new roots, its admitted
    root is adopted there at once (counted active, over the window: it runs already), and the dead
    controller leaves the summed window/limit, /metrics and the events (its admitted count stays in
    the total). A replica that comes back under the same id is a new backend with a fresh controller."""
    from vllm_mars.admission.base import PendingRoot

    rs, pl, adm = _ray_fleet()
    b1, b2 = rs.by_id["r1"], rs.by_id["r2"]
    assert adm.backends == [b1, b2] and len(adm.ctrls) == 2 and adm.limit() == 2
    for k, wf in enumerate("ABCD"):
        adm.offer(PendingRoot(wf, float(k), 64))
    assert [adm.backend_of(w) for w in "ABCD"] == [b1, b2, b1, b2]
    assert adm.tick(4.0) == ["A", "B"] and adm.num_queued == 2
    adm.take_events()
    assert adm.promised_blocks(b1.roots) == adm.footprint_blocks(PendingRoot("C", 0.0, 64)) == 0  # (cap: no model)

    rs.drop("r1")  # r1 dies: Serve drops it
    adm.observe(_pooled(pl))
    assert adm.backends == [b2] and len(adm.ctrls) == 1 and adm.retired == 1
    assert adm.backend_of("A") is adm.backend_of("C") is b2 and not b1.roots and b2.roots == {"A", "B", "C", "D"}
    snap = adm.snapshot()
    assert adm.limit() == snap["limit"] == 1 and snap["window"] == 1 and [p["backend"] for p in snap["per_replica"]] \
        == ["r2"]
    assert adm.num_active == snap["active"] == 2 and adm.num_queued == 2  # A counted at once, over r2's window
    assert adm.num_admitted == 2  # r1's admission of A still counts once; adopting A is no new admission
    assert adm.tick(5.0) == []  # r2 is over its window: nothing new
    adm.finish("B", 5.0)
    assert adm.tick(5.0) == []  # A (running) still holds r2's one slot
    adm.finish("A", 6.0)
    assert adm.tick(6.0) == ["C"]  # C (moved while queued) before D (arrived earlier, not moved)
    adm.finish("C", 7.0)
    assert adm.tick(7.0) == ["D"]

    rs.sync([_Rep("r2", 50), _Rep("r1", 90)])  # r1 comes back (same id): a new backend, a fresh controller
    adm.observe(_pooled(pl))
    b1new = rs.by_id["r1"]
    assert b1new is not b1 and adm.backends == [b2, b1new] and len(adm.ctrls) == 2 and adm.limit() == 2
    assert adm.ctrls[1].num_admitted == 0 and adm.ctrls[1].num_active == 0
    adm.offer(PendingRoot("E", 8.0, 64))
    assert adm.backend_of("E") in (b2, b1new) and adm.tick(8.0) == (["E"] if adm.backend_of("E") is b1new else [])
    for wf in "DE":
        adm.finish(wf, 9.0)
    assert adm.tick(9.0) == []
    _assert_adm_empty(adm, b1, b2, b1new)
    assert all(e.data["replica"] in ("r1", "r2") for e in adm.take_events())


def test_a_root_moved_while_admitted_is_counted_at_its_new_backend_at_once():
    """A backend that is down (still in the fleet): the feeder moves its admitted root A. A runs at
    once on the new backend, so it is active there at once (before: queued until a slot freed,
    uncounted while it ran) and a root queued there waits while A holds the slot. With the mars
    controller, A's footprint is promised at its new backend (the placement sees it)."""
    from vllm_mars.admission.base import PendingRoot, make_controller
    from vllm_mars.admission.placement import Placement

    rs, pl, adm = _ray_fleet(cap=2)
    b1, b2 = rs.by_id["r1"], rs.by_id["r2"]
    for k, wf in enumerate("ABCDE"):
        adm.offer(PendingRoot(wf, float(k), 64))
    assert adm.tick(5.0) == ["A", "C", "B", "D"] and adm.backend_of("E") is b1  # E waits at r1
    adm.release("A", b1)
    assert adm.place("A") is b2  # r1 unreachable for A's call: A moves (r2 is the only other one)
    assert adm.ctrls[1].num_active == 3 and adm.ctrls[1].is_active("A")  # over r2's window of 2, counted
    adm.finish("B", 6.0)
    adm.finish("C", 6.0)  # r1 has room again: E goes in there
    assert adm.tick(6.0) == ["E"] and adm.ctrls[1].num_active == 2  # r2: A and D, at its window
    assert adm.num_admitted == 5  # A's adoption is no second admission
    for wf in "ADE":
        adm.finish(wf, 8.0)
    adm.tick(8.0)
    _assert_adm_empty(adm, b1, b2)

    # the mars controller: the adopted root's footprint is promised where it went
    mars = make_controller("mars", {})
    before = mars.promised_blocks()
    mars.adopt(PendingRoot("G", 1.0, 640, {"returning": True, "moved": True}), 1.0)
    fp = mars.footprint_blocks(PendingRoot("G", 1.0, 640))
    assert mars.is_active("G") and fp > 0 and mars.promised_blocks(["G"]) == fp == mars.promised_blocks() - before
    assert mars.num_queued == 0 and mars.tick(1.5) == []
    mars.finish("G", 2.0)
    assert mars.num_active == 0 and mars.promised_blocks() == 0
    assert isinstance(pl, Placement)


def test_the_admission_state_is_read_and_changed_under_one_lock():
    """The Serve router thread scores replicas (reads that also update promises) while the gate's
    loop changes roots: every admission method and the router's scoring take ``adm.lock``. A thread
    holding the lock holds back both; with it released, both complete."""
    from vllm_mars.admission.base import PendingRoot

    rs, pl, adm = _ray_fleet()
    done: dict[str, bool] = {}

    def offer() -> None:
        adm.offer(PendingRoot("A", 0.0, 64))
        done["offer"] = True

    def score() -> None:
        with adm.lock:
            done["score"] = pl.score(rs.by_id["r1"]) is not None

    held = threading.Event()
    release = threading.Event()

    def hold() -> None:
        with adm.lock:
            held.set()
            release.wait(10)

    h = threading.Thread(target=hold, daemon=True)
    h.start()
    assert held.wait(5)
    ts = [threading.Thread(target=f, daemon=True) for f in (offer, score)]
    for t in ts:
        t.start()
    time.sleep(0.2)
    assert done == {}  # both wait for the lock
    release.set()
    for t in [h, *ts]:
        t.join(5)
    assert done == {"offer": True, "score": True}
    adm.finish("A", 1.0)
    _assert_adm_empty(adm, *rs.by_id.values())
