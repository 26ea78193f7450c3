"""Converters for the agent frontends' own session logs: Codex rollouts, OpenCode's session store and
OpenHands conversation directories, each session a workflow (sub-agent sessions as children).

What every frontend records, per LLM call: the prompt's token count (the provider's usage), the
output's, when the call ended, and the tool calls it made with when each started and ended. From
that (:class:`Call`) one builder (:func:`build_workflow`) makes the workflow:

* turn k's ``output_tokens`` = the call's output (reasoning included); turn 0's prompt is the
  first call's input tokens, unique to the session;
* turn k's ``append_tokens`` makes its prompt as long as the recorded input: ``in_k - (in_{k-1} +
  out_{k-1})``; where the recorded input is shorter (the frontend compacted its context), turn k
  compacts (schema v2): it keeps what the provider reported cached for that call (0 when it does
  not say) and the rest of ``in_k`` is new summary;
* the tool time after turn k is the span of its tool calls (first start to last end); when the next
  call answers a new user message, it runs until that message (tool ``"user"`` if the call made no
  tool call): the user's gap is replayed as tool time; clipped to ``max_tool_s``;
* roots arrive when their session started, relative to the earliest session converted;
* a sub-agent session starts after the last parent call that ended before it started, and the
  parent waits for it (the frontends run sub-agents as blocking tool calls); that call's tool time
  excludes the sub-agent's duration (the replay runs both at once, as the weka converter does).

``scale`` divides every token count (at least 1 output token). No prefix is shared between
sessions: a log records token counts, not which tokens two sessions have in common.

Formats, one module each (read from real logs of the pinned versions; tests/data/sessions/ has
captured samples): :mod:`.codex` (Codex 0.171 rollouts), :mod:`.opencode` (OpenCode 1.18's
``opencode.db`` or the older ``storage/``), :mod:`.openhands` (OpenHands SDK 1.58 conversation
directories). The builder and the shared field readers are in :mod:`.build`.
"""

from __future__ import annotations

from vllm_mars.workload.sessions.build import (
           DEFAULT_MAX_TOOL_S,
           Call,
           Session,
           build_workflow,
           build_workflows,
)
from vllm_mars.workload.sessions.codex import convert_codex, read_codex_rollout
from vllm_mars.workload.sessions.opencode import convert_opencode, read_opencode
from vllm_mars.workload.sessions.openhands import convert_openhands, read_openhands_conversation

__all__ = ["CONVERTERS", "DEFAULT_MAX_TOOL_S", "Call", "Session", "build_workflow", "build_workflows",
           "convert_codex", "convert_opencode", "convert_openhands", "read_codex_rollout", "read_opencode",
           "read_openhands_conversation"]

CONVERTERS = {"codex": convert_codex, "opencode": convert_opencode, "openhands": convert_openhands}
