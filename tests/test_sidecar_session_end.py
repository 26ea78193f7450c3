"""Issue 30 (item 3): when a session ends. An OpenHands conversation ends with a ``finish`` tool call;
a client that offers no tools ends on a shorter learned gap; every end event names its rule.
The real sidecar in front of tests/faulty_backend.py (its ``finish`` answer is a chat completion that
calls the finish tool, as vLLM writes one), and the root lifecycle on a virtual clock."""

from __future__ import annotations

import json

import httpx
import pytest
from conftest import free_port
from faulty_backend import FINISH_BODY, OK_BODY, FaultyBackend
from polling import wait_until
from test_continuity import _table
from vllm_mars.admission.continuity import ToolCallScan
from vllm_mars.admission.identity import identify
from vllm_mars.admission.sidecar import SidecarConfig, SidecarThread

TOOLS = [{"type": "function", "function": {"name": "finish", "parameters": {"type": "object"}}},
         {"type": "function", "function": {"name": "terminal", "parameters": {"type": "object"}}}]
AGENT = {"model": "tiny", "messages": [{"role": "system", "content": "you are an agent"},
                                       {"role": "user", "content": "fix it"}], "tools": TOOLS}


def _scan(*chunks: bytes) -> ToolCallScan:
    s = ToolCallScan()
    for c in chunks:
        s.feed(c)
    return s


def test_finish_tool_call_is_recognised_in_every_shape():
    assert _scan(FINISH_BODY).finish_called
    whole = _scan(FINISH_BODY)
    split = _scan(*[FINISH_BODY[i:i + 7] for i in range(0, len(FINISH_BODY), 7)])
    assert whole.finish_called and split.finish_called
    sse = (b'data: {"choices":[{"delta":{"tool_calls":[{"index":0,"id":"c","type":"function","function":'
           b'{"name":"finish","arguments":""}}]}}]}\n\n')
    assert _scan(sse[:50], sse[50:]).finish_called
    # Responses: a function_call item (fields in vLLM's order, and the other order)
    assert _scan(b'{"output":[{"arguments":"{}","call_id":"c","name":"finish","type":"function_call"}]}').finish_called
    assert _scan(b'{"output":[{"type":"function_call","call_id":"c","name":"finish","arguments":"{}"}]}').finish_called
    # not a finish: another tool, the echoed tools list, or the word in text
    other = b'{"output":[{"type":"function_call","name":"terminal"}],"tools":[{"type":"function","name":"finish"}]}'
    s = _scan(other)
    assert s.saw_tool_call and not s.finish_called
    assert not _scan(OK_BODY.replace(b'"hi"', b'"I will call \\"name\\": \\"finish\\""')).finish_called
    term = FINISH_BODY.replace(b'"finish"', b'"terminal"')
    s = _scan(term)
    assert s.saw_tool_call and not s.finish_called


@pytest.fixture(scope="module")
def fake():
    with FaultyBackend(free_port()) as fb:
        yield fb


def test_openhands_finish_ends_the_session_at_once_and_events_name_the_rule(fake, tmp_path):
    events = tmp_path / "events.jsonl"
    cfg = SidecarConfig(backends=(fake.url,), port=free_port(), telemetry_interval_s=0.05,
                        events_path=str(events), controller_options={"interval_s": 0.02})
    with SidecarThread(cfg) as sc:
        assert wait_until(lambda: sc.app.any_up, 10)
        ctl = sc.app.controller
        body = {**AGENT, "prompt_cache_key": "conv-1"}  # what the OpenHands SDK sends
        r = httpx.post(sc.url + "/v1/chat/completions", json=body, timeout=10,
                       headers={"x-litellm-session-id": "conv-1", "X-Fault": "finish"})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["tool_calls"]
        assert not ctl.is_active("conv-1")  # ended with the call, not at the idle timeout
        # the finish route and a last step name their rules too
        assert httpx.post(sc.url + "/v1/chat/completions", json={**AGENT, "prompt_cache_key": "conv-2"}, timeout=10,
                          headers={"x-litellm-session-id": "conv-2", "X-Fault": "finish"}).status_code == 200
        assert not ctl.is_active("conv-2")
        r = httpx.post(sc.url + "/v1/chat/completions", json={**AGENT, "tool_choice": "none"}, timeout=10,
                       headers={"X-MARS-Workflow": "wf-3"})
        assert r.status_code == 200 and ctl.is_active("wf-3")
        assert httpx.post(sc.url + "/mars/v1/workflows/wf-3/finish", timeout=5).json()["ended"]
        r = httpx.post(sc.url + "/v1/chat/completions", json=AGENT, timeout=10,
                       headers={"X-MARS-Workflow": "wf-4", "X-MARS-Last-Step": "1"})
        assert r.status_code == 200 and not ctl.is_active("wf-4")
        assert wait_until(lambda: ctl.num_active == 0 and sc.app.in_flight == 0, 5)
    recs = [json.loads(x) for x in events.read_text().splitlines()]
    rules = {(e["workflow"], e["rule"]) for e in recs if e["event"] in ("workflow_end", "workflow_end_inferred")}
    assert {("conv-1", "finish_tool"), ("conv-2", "finish_tool"), ("wf-3", "finish_route"),
            ("wf-4", "last_step")} <= rules, rules


def _oc_call(t, clock, session: str, tools: bool, source_header: str = "x-session-id") -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": session}], **({"tools": TOOLS} if tools else {})}
    ident = t.sessions.resolve(identify({source_header: session}, body))
    r = t.arrive(ident, 100)
    assert r.admitted, session
    t.call_started(r, ident, tools)
    clock.advance(0.5)
    t.call_ended(r, ident, ok=True)


def test_a_client_without_tools_ends_on_a_shorter_learned_gap():
    t, ctl, clock = _table(window=8)
    _oc_call(t, clock, "plain", tools=False)  # kv-cache-tester: a session id, no tools
    _oc_call(t, clock, "agent", tools=True)  # an agent between tool calls
    _oc_call(t, clock, "explicit", tools=False, source_header="x-mars-workflow")  # a replay's own ids
    clock.advance(61.0)
    t.expire()
    assert not ctl.is_active("plain") and ctl.is_active("agent") and ctl.is_active("explicit")
    ends = [e.data for e in t.take_events() if e.event == "workflow_end_inferred"]
    assert [(e["workflow"], e["rule"]) for e in ends] == [("plain", "idle_timeout_no_tools")]
    assert ends[0]["idle_timeout_s"] <= 60
    clock.advance(600.0)
    t.expire()
    assert ctl.num_active == 0
    # the gap is learned: plain sessions that come back every 3 s end after ~2x their p95 gap
    for _ in range(10):
        _oc_call(t, clock, "p2", tools=False)
        clock.advance(3.0)
    assert t.plain_gaps.samples >= 8 and t.plain_gaps.timeout_s() < 10
    clock.advance(t.plain_gaps.timeout_s() + 0.1)
    t.expire()
    assert not ctl.is_active("p2")
