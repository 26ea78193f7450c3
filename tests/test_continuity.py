"""Sessions that end themselves and identity that survives real clients (issue 12), on a virtual
clock with the real MARS admission controller: prefix continuity of generic session ids, side
calls, final answers ending workflows softly, returns ahead of new roots, the learned idle
timeout, and footprints re-estimated from agent calls."""

from __future__ import annotations

import pytest
from vllm_mars.admission.base import Telemetry
from vllm_mars.admission.continuity import Continuity, GapModel, ToolCallScan, prompt_prefix
from vllm_mars.admission.identity import identify
from vllm_mars.admission.mars import MarsAdmissionConfig, MarsAdmissionController
from vllm_mars.admission.roots import RootTable
from vllm_mars.clock import VirtualClock

TOOLS = [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}]


def chat(*contents: str, tools: bool = True) -> dict:
    msgs = [{"role": "system" if i == 0 else "user", "content": c} for i, c in enumerate(contents)]
    return {"model": "m", "messages": msgs, **({"tools": TOOLS, "tool_choice": "auto"} if tools else {})}


def oc(session: str) -> dict:
    return {"x-session-id": session, "x-session-affinity": session}


def test_generic_session_ids_never_merge_strangers():
    c = Continuity()
    seen = []
    for user in range(5):  # kv-cache-tester: every replayed user under one X-Session-ID
        for turn in range(3):
            body = chat("You are helpful.", f"user {user} question", *[f"more {k}" for k in range(turn)],
                        tools=False)
            ident, verdict = c.check(identify(oc("shared"), body), body)
            seen.append((user, ident.workflow, verdict.kind))
    wf = {u: {w for uu, w, _ in seen if uu == u} for u in range(5)}
    assert all(len(v) == 1 for v in wf.values())  # each user's turns stay one workflow ...
    assert len({next(iter(v)) for v in wf.values()}) == 5  # ... and the users are five workflows
    assert wf[0] == {"shared"} and wf[1] == {"shared~1"}
    firsts = [k for u, _, k in seen if u > 0][::3]
    assert firsts == ["new_workflow"] * 4


def test_opencode_title_call_is_a_side_call_of_its_session():
    c = Continuity()
    title = chat("You are a title generator.", "make a title for: fix the bug", tools=False)
    agent = chat("You are opencode.", "fix the bug")
    later = chat("You are opencode.", "fix the bug", "tool output here")
    i1, v1 = c.check(identify(oc("ses_1"), title), title)
    i2, v2 = c.check(identify(oc("ses_1"), agent), agent)
    i3, v3 = c.check(identify(oc("ses_1"), later), later)
    i4, v4 = c.check(identify(oc("ses_1"), title), title)  # a side call after the agent calls
    assert [i.workflow for i in (i1, i2, i3, i4)] == ["ses_1"] * 4
    assert [v.kind for v in (v1, v2, v3, v4)] == ["first", "continue", "continue", "side_call"]
    assert v4.event()["kind"] == "side_call"
    stranger = chat("You are opencode.", "another task entirely")
    i5, v5 = c.check(identify(oc("ses_1"), stranger), stranger)
    assert v5.kind == "new_workflow" and i5.workflow == i5.root == "ses_1~1"


def test_frontend_specific_ids_are_trusted():
    c = Continuity()
    h = {"session-id": "thr-1", "thread-id": "thr-1"}
    for body in ({"input": "first", "instructions": "A", "tools": TOOLS}, {"input": "compacted", "instructions": "B"}):
        ident, v = c.check(identify(h, body), body)
        assert ident.workflow == "thr-1" and v.kind == "continue"
    assert prompt_prefix({"instructions": "x", "input": [{"role": "user", "content": "y"}, {"z": 1}]}) == \
        prompt_prefix({"instructions": "x", "input": [{"role": "user", "content": "y"}]})


def test_tool_call_scan():
    def scan(*chunks: bytes) -> bool:
        s = ToolCallScan()
        for ch in chunks:
            s.feed(ch)
        return s.saw_tool_call

    assert scan(b'data: {"choices":[{"delta":{"tool_c', b'alls":[{"index":0,"id":"c1","function":{}}]}}]}\n\n')
    assert not scan(b'{"choices":[{"message":{"content":"done","tool_calls":[]},"finish_reason":"stop"}]}')
    assert scan(b'event: response.output_item.added\ndata: {"item":{"type":"function_call","name":"shell"}}\n\n')
    assert not scan(b'data: {"response":{"tools":[{"type":"function","name":"shell"}],"output":[]}}\n\n')


def test_gap_model_learns_a_bounded_idle_timeout():
    g = GapModel(max_s=600, min_s=5, min_samples=8)
    for _ in range(7):
        g.observe(10.0)
    assert g.timeout_s() == 600  # too few gaps: the configured bound
    g.observe(10.0)
    assert g.timeout_s() == 20.0  # p95 x margin 2
    for _ in range(600):  # the window (512) forgets the long gaps
        g.observe(0.1)
    assert g.timeout_s() == 5  # at least min_s
    with pytest.raises(ValueError, match="min_s"):
        GapModel(max_s=1, min_s=2)


def _table(window: int = 1, **kw) -> tuple[RootTable, MarsAdmissionController, VirtualClock]:
    clock = VirtualClock(100.0)
    ctl = MarsAdmissionController(MarsAdmissionConfig(window_min=window, window_max=window, window_init=window,
                                                      promise_s=5.0))
    ctl.observe(Telemetry(ts=100.0, free_blocks=1000, total_blocks=1000, block_size=16, kv_usage=0.0))
    return RootTable(ctl, clock, idle_timeout_s=600, failed_idle_timeout_s=5, **kw), ctl, clock


def _call(t: RootTable, clock: VirtualClock, session: str, tokens: int = 100, final: bool = False) -> None:
    ident = t.sessions.resolve(identify(oc(session), chat("s", session)))
    r = t.arrive(ident, tokens)
    assert r.admitted, session
    t.call_started(r, ident)
    clock.advance(1.0)
    t.call_ended(r, ident, ok=True, final_answer=final)


def test_final_answer_ends_softly_and_a_return_goes_ahead_of_new_roots():
    t, ctl, clock = _table(window=1)
    _call(t, clock, "A", final=False)  # a tool call: A keeps its slot
    assert ctl.is_active("A")
    b = t.arrive(identify(oc("B"), chat("s", "B")), 100)
    assert not b.admitted and ctl.is_queued("B")
    _call(t, clock, "A", final=True)  # A's final answer: slot released, B admitted at once
    assert not ctl.is_active("A") and ctl.is_active("B") and "A" in t.dormant
    ev = t.take_events()
    end = next(e for e in ev if e.event == "workflow_end_inferred")
    assert end.data["workflow"] == "A" and end.data["reason"] == "final_answer" and end.data["turns"] == 2
    c = t.arrive(identify(oc("C"), chat("s", "C")), 100)  # a new root, first in line ...
    clock.advance(3.0)
    a = t.arrive(identify(oc("A"), chat("s", "A")), 100)  # ... then A comes back: it goes first
    assert not a.admitted and a.returning and t.get("A") is a
    assert list(ctl._queue) == ["A", "C"]
    t.finish("B")
    assert ctl.is_active("A") and ctl.is_queued("C")
    resumed = next(e for e in t.take_events() if e.event == "workflow_resumed")
    assert resumed.data["workflow"] == "A" and resumed.data["gap_s"] == pytest.approx(3.0)
    # the same workflow: its sessions and turn counter went on
    assert t.sessions.resolve(identify(oc("A"), chat("s", "A"))).root == "A"
    assert t.call_started(a, identify(oc("A"), chat("s", "A"))) == 2
    assert t.counters["inferred_ends"] == 1 and t.counters["resumed"] == 1 and not c.admitted


def test_idle_timeout_adapts_to_return_gaps():
    t, ctl, clock = _table(window=4, gaps=GapModel(max_s=600, min_s=1.0, min_samples=4))
    ident = identify(oc("A"), chat("s", "A"))
    r = t.arrive(ident, 100)
    for _ in range(5):  # tool time of 2 s between calls
        t.call_started(r, ident)
        clock.advance(0.5)
        t.call_ended(r, ident, ok=True)
        clock.advance(2.0)
    assert t.gaps.timeout_s() == pytest.approx(4.0)  # p95 of 2 s x 2
    clock.advance(1.0)  # idle 3 s: within the learned timeout
    assert t.expire() == []
    clock.advance(1.5)  # idle 4.5 s
    assert t.expire() == ["A"] and not ctl.is_active("A") and "A" in t.dormant
    end = next(e for e in t.take_events() if e.event == "workflow_end_inferred")
    assert end.data["reason"] == "idle_timeout" and end.data["idle_s"] == pytest.approx(4.5)
    assert t.finish("A") and "A" not in t.dormant  # the finish route ends a dormant workflow for good
    assert "A" not in t.turns and len(t.sessions) == 0


def test_dormant_workflows_are_bounded():
    t, _ctl, clock = _table(window=1, dormant_capacity=2)
    for wf in ("A", "B", "C"):
        _call(t, clock, wf, final=True)
    assert list(t.dormant) == ["B", "C"] and "A" not in t.turns and len(t.sessions) == 2


def test_footprint_reestimated_from_the_agent_call():
    t, ctl, clock = _table(window=1)
    _call(t, clock, "X")  # holds the only slot
    title = t.arrive(identify(oc("S"), chat("title", "t")), 541)  # offered on its short title call
    assert ctl._queue["S"].prefill_tokens == 541
    t.prompt_seen(title, 5214)  # the agent's real prompt arrives while it waits
    assert ctl._queue["S"].prefill_tokens == 5214 and title.blocks == ctl.footprint_blocks(ctl._queue["S"])
    t.finish("X")
    assert ctl.is_active("S")
    promised = ctl.promised_blocks()
    t.prompt_seen(title, 8000)  # admitted: the outstanding promise grows
    assert ctl.promised_blocks() > promised and ctl._active["S"].prefill_tokens == 8000
    t.prompt_seen(title, 100)  # smaller prompts change nothing
    assert title.prompt_max == 8000


def test_final_answer_waits_for_a_side_call_in_flight():
    t, ctl, _clock = _table(window=2)
    side = identify(oc("S"), chat("title", "t", tools=False))
    agent = identify(oc("S"), chat("s", "S"))
    r = t.arrive(side, 50)
    t.call_started(r, side)  # the title call, still streaming ...
    t.call_started(r, agent)
    t.call_ended(r, agent, ok=True, final_answer=True)  # ... when the agent's final answer ends
    assert ctl.is_active("S")
    t.call_ended(r, side, ok=True)
    assert not ctl.is_active("S") and "S" in t.dormant


# -- through the sidecar, against the real server --------------------------------------------------------
def test_sidecar_splits_strangers_under_one_session_id(openai_server, tmp_path):
    """Over HTTP: three replayed users under one X-Session-ID are three workflows (the engine's own log
    and the x-mars-workflow header say so), and a user's next turn finds its own workflow again.
    (Final answers over HTTP: tests/test_frontends.py, against `mars serve`, which enables tool
    calling; this shared server has none.)"""
    import json

    import httpx
    from conftest import free_port
    from vllm_mars.admission.sidecar import SidecarConfig, SidecarThread

    events = tmp_path / "adm.jsonl"
    cfg = SidecarConfig(backends=(openai_server.url,), controller="mars", port=free_port(), telemetry_interval_s=0.1,
                        controller_options={"window_min": 4, "window_max": 4, "interval_s": 0.05},
                        events_path=str(events))

    def post(sc, body, session):
        r = httpx.post(sc.url + "/v1/chat/completions", json={**body, "model": "tiny", "max_tokens": 4},
                       headers=oc(session), timeout=60)
        assert r.status_code == 200, r.text
        assert r.headers["x-mars-root"] == r.headers["x-mars-workflow"]
        return r.headers["x-mars-workflow"]

    with SidecarThread(cfg) as sc:
        got = [post(sc, chat("sys", f"cont-user {u}", tools=False), "cont-shared") for u in range(3)]
        assert got == ["cont-shared", "cont-shared~1", "cont-shared~2"]
        assert post(sc, chat("sys", "cont-user 1", "turn 2", tools=False), "cont-shared") == "cont-shared~1"
        ctl = sc.app.controller
        assert ctl.num_active == 3  # no tools offered: no final answer inferred, the slots stay
        for wf in got:
            httpx.post(f"{sc.url}/mars/v1/workflows/{wf}/finish", timeout=5)
        assert ctl.num_active == 0
    recs = [json.loads(x) for x in openai_server.sched_log.read_text().splitlines()]
    arrivals = [(r["workflow"], r["turn"]) for r in recs
                if r["event"] == "arrive" and str(r["workflow"]).startswith("cont-")]
    assert arrivals == [("cont-shared", 0), ("cont-shared~1", 0), ("cont-shared~2", 0), ("cont-shared~1", 1)]
    evs = [json.loads(x) for x in events.read_text().splitlines()]
    assert [e["kind"] for e in evs if e["event"] == "workflow_continuity"] == ["new_workflow", "new_workflow"]


def test_sidecar_agent_turns_teach_the_controller_growth_and_size_roots_by_their_life():
    """Behind the sidecar each larger agent prompt is a new turn: the one controller learns the
    per-turn growth from it (before any root ends) and the whole-life rule then holds a root that
    the free blocks alone would admit. 1000 blocks x 16 = 16k tokens; no cost model, so no cost
    overflow: the projection decides."""
    t, ctl, clock = _table(window=4)
    for s in ("A", "B"):
        _call(t, clock, s, tokens=1000)
    for turn in range(1, 4):
        for s in ("A", "B"):
            ident = t.sessions.resolve(identify(oc(s), chat("s", s)))
            r = t.arrive(ident, 1000 + 1500 * turn)
            t.prompt_seen(r, 1000 + 1500 * turn)
            t.call_started(r, ident)
            clock.advance(1.0)
            t.call_ended(r, ident, ok=True, final_answer=False)
    assert ctl.turn_growth == pytest.approx(1500)
    # A and B: 5500 tokens each, (default_turns 4 - 4 seen + 1) = 1 turn to go: 14k projected; C's
    # whole life (1000 + 4 x 1500) lifts the peak to 16.5k, past the 16k pool. With size="turn" C
    # would be admitted: its first turn fits the 600 free blocks.
    ctl.observe(Telemetry(ts=clock.now(), free_blocks=600, total_blocks=1000, block_size=16, kv_usage=0.4))
    c = t.arrive(identify(oc("C"), chat("s", "C")), 1000)
    assert not c.admitted and ctl.is_queued("C")


def test_the_sidecar_reports_what_a_roots_first_call_found_cached():
    t, ctl, _ = _table(window=4)
    ident = identify(oc("A"), chat("s", "A"))
    r = t.arrive(ident, 100)
    t.call_started(r, ident)
    r.cached = 64  # the proxy read prompt_tokens_details.cached_tokens of the response
    t.call_ended(r, ident, ok=True)
    assert ctl._active["A"].shared == 64
    t.call_started(r, ident)  # a later turn's hit is its own context, not shared KV
    r.cached = 90
    t.call_ended(r, ident, ok=True)
    assert ctl._active["A"].shared == 64
