"""Workflow identity from the exact headers and body fields each frontend sends (research notes C.1-C.4)."""

from __future__ import annotations

import pytest
from vllm_mars.admission.identity import (
    SessionTable,
    apply_to_body,
    estimate_prompt_tokens,
    identify,
)
from vllm_mars.workflow import workflow_from_extra_args

MSG = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def test_openhands_root_and_child():
    # SDK >= 1.25: header x-litellm-session-id = this conversation, body prompt_cache_key = root conversation
    root = identify({"x-litellm-session-id": "conv-1", "user-agent": "litellm/1.80"},
                    {**MSG, "prompt_cache_key": "conv-1"})
    assert (root.workflow, root.root, root.parent, root.source) == ("conv-1", "conv-1", None, "openhands")
    assert root.is_root
    child = identify({"x-litellm-session-id": "conv-2"}, {**MSG, "prompt_cache_key": "conv-1"})
    assert (child.workflow, child.root, child.parent) == ("conv-2", "conv-1", "conv-1")
    assert not child.is_root


def test_opencode_root_and_child():
    h = {"x-session-affinity": "ses_A", "x-session-id": "ses_A", "user-agent": "opencode/1.2.3"}
    root = identify(h, MSG)
    assert (root.workflow, root.root, root.parent, root.source) == ("ses_A", "ses_A", None, "opencode")
    # the task tool: a new session with x-parent-session-id; setCacheKey puts the child's own key in the body
    ch = identify({"x-session-affinity": "ses_B", "x-session-id": "ses_B", "x-parent-session-id": "ses_A"},
                  {**MSG, "prompt_cache_key": "ses_B"})
    assert (ch.workflow, ch.root, ch.parent) == ("ses_B", "ses_A", "ses_A")


def test_codex_root_child_and_fork():
    h = {"session_id": "thr-1", "thread-id": "thr-1", "x-client-request-id": "req-9",
         "x-codex-turn-metadata": '{"session_id":"thr-1","turn_id":"t3"}'}
    body = {"model": "m", "input": [{"role": "user", "content": [{"type": "input_text", "text": "fix"}]}],
            "prompt_cache_key": "thr-1", "client_metadata": {}}
    root = identify(h, body)
    assert (root.workflow, root.root, root.parent, root.source) == ("thr-1", "thr-1", None, "codex")
    child = identify({"session_id": "thr-2", "x-codex-parent-thread-id": "thr-1", "x-openai-subagent": "collab_spawn"},
                     {**body, "prompt_cache_key": "thr-1"})
    assert (child.workflow, child.root, child.parent) == ("thr-2", "thr-1", "thr-1")
    fork = identify({"session-id": "thr-3"}, {**body, "prompt_cache_key": "thr-3"})
    assert fork.is_root and fork.workflow == "thr-3"


def test_explicit_headers_win_and_carry_turn_metadata():
    ident = identify({"x-mars-workflow": "wf-7", "x-mars-parent": "wf-1", "x-mars-turn": "4",
                      "x-mars-last-step": "true", "x-session-id": "ignored"}, MSG)
    assert (ident.workflow, ident.root, ident.parent, ident.source) == ("wf-7", "wf-1", "wf-1", "mars")
    assert ident.turn == 4 and ident.last_step is True
    assert identify({"x-mars-workflow-id": "wf-0042"}, MSG).workflow == "wf-0042"


def test_vllm_xargs_identity():
    ident = identify({}, {**MSG, "vllm_xargs": {"mars_workflow": "w", "mars_root": "r", "mars_turn": 2,
                                                 "mars_last_step": False, "mars_tool": "bash",
                                                 "mars_prefill_tokens": 900, "other": 1}})
    assert (ident.workflow, ident.root, ident.turn, ident.last_step, ident.tool, ident.prefill_tokens) == (
        "w", "r", 2, False, "bash", 900)


def test_native_session_id_and_plain_client():
    assert identify({}, {**MSG, "session_id": "s1"}).source == "session_id"
    a = identify({"user-agent": "curl/8"}, MSG)
    b = identify({}, MSG)
    assert a.anonymous and a.is_root and a.last_step is True and a.workflow != b.workflow


@pytest.mark.parametrize("headers,body,match", [
    ({}, {**MSG, "vllm_xargs": [1]}, "vllm_xargs"),
    ({"x-mars-workflow": "w", "x-mars-turn": "-1"}, MSG, "X-MARS-Turn"),
    ({"x-mars-workflow": "w", "x-mars-last-step": "maybe"}, MSG, "X-MARS-Last-Step"),
    ({}, {**MSG, "prompt_cache_key": {"a": 1}}, "prompt_cache_key"),
])
def test_malformed_identity_fields(headers, body, match):
    with pytest.raises(ValueError, match=match):
        identify(headers, body)


def test_session_table_resolves_grandchildren():
    t = SessionTable()
    t.resolve(identify({"x-session-id": "A"}, MSG))
    t.resolve(identify({"x-session-id": "B", "x-parent-session-id": "A"}, MSG))
    c = t.resolve(identify({"x-session-id": "C", "x-parent-session-id": "B"}, MSG))
    assert (c.workflow, c.parent, c.root) == ("C", "B", "A")
    t.forget_root("A")
    assert len(t) == 0


def test_apply_to_body_round_trips_through_workflow_parser():
    ident = identify({"x-litellm-session-id": "c2"}, {**MSG, "prompt_cache_key": "c1"})
    body = apply_to_body({**MSG, "vllm_xargs": {"keep": "me"}}, ident, turn=3)
    x = body["vllm_xargs"]
    assert x["keep"] == "me"
    info = workflow_from_extra_args(x, "req-1")
    assert (info.workflow, info.root, info.parent, info.turn) == ("c2", "c1", "c1", 3)


def test_estimate_prompt_tokens():
    assert estimate_prompt_tokens({"messages": [{"role": "user", "content": "x" * 400}]}) == 100
    assert estimate_prompt_tokens({"prompt": "y" * 40}) == 10
    assert estimate_prompt_tokens({"input": [{"content": [{"type": "input_text", "text": "z" * 8}]}]}) == 2
