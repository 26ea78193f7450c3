"""The scripted model: the tiny model says a task's scripted solution, token for token.

With a random-weight model no agent loop ever runs: it never asks for a tool. ``mars serve
--scripted TASKS`` makes the engine emit, for a prompt that belongs to one of the tasks in TASKS (a
``mas_task_v1`` JSONL whose tasks carry a ``payload.script``), the next assistant turn of that
task's solution: a tool call in the model's own format (Qwen3 / hermes: ``<tool_call>\\n{"name":
..., "arguments": {...}}\\n</tool_call>``), which vLLM's own tool parser turns into the API's
``tool_calls``, or the final text. The frontend then really runs the tool and its output really
grows the next prompt.

What it is chosen from is only what the frontend sent, as the model sees it (the prompt tokens):

* the task: the ``task_id=ID`` line of the task prompt (``mars agents run`` writes it);
* the frontend's tool names, from the tools the chat template renders (Codex ``exec_command``,
  OpenCode ``bash``/``read``/``edit``/``write``, OpenHands ``terminal``/``file_editor``/``finish``):
  each script step is rendered for that frontend's tools;
* the step: how many tool results the prompt holds;
* the working directory, where the frontend states it (Codex ``<cwd>``, OpenCode "Working
  directory:", the task prompt's "The workspace is ..."), for tools that take absolute paths.

A prompt that matches no task, or that offers no tools (a title or summary side call of a known
task gets a short fixed text), is left to the model. The seam is a vLLM v1 logits processor
(``--logits-processors``): it masks every token but the script's next one (then the end-of-turn
token), so the sampler, detokenizer, tool parser, server, sidecar and scheduler all run as usual.
The chat template (``SCRIPTED_CHAT_TEMPLATE``, passed with ``--chat-template``) renders tools, tool
calls and tool results the way Qwen's does, so the prompt holds what a real model would see.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_mars.workload.mas_task import load_tasks

logger = logging.getLogger(__name__)

#: vLLM ``additional_config`` key that turns scripting on: ``{"tasks": PATH}``
CONFIG_KEY = "mars_scripted"
#: the logits processor's qualified name (``--logits-processors``)
PROCESSOR = "vllm_mars.engine.scripted:ScriptedLogitsProcessor"
#: what a script step may do
OPS = ("run", "view", "replace", "write", "finish")

SCRIPTED_CHAT_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n"
    "{%- if messages and messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n{% endif %}"
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n<tools>\n"
    "{%- for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags.<|im_end|>\n{% endif %}"
    "{%- for m in messages %}"
    "{%- if m['role'] == 'system' and loop.first and tools %}"
    "{%- elif m['role'] == 'assistant' %}<|im_start|>assistant\n"
    "{%- if m['content'] %}{{ m['content'] }}{% endif %}"
    "{%- if m['tool_calls'] %}{% for tc in m['tool_calls'] %}\n<tool_call>\n"
    "{\"name\": \"{{ tc['function']['name'] }}\", \"arguments\": {{ tc['function']['arguments'] | tojson }}}"
    "\n</tool_call>{% endfor %}{% endif %}<|im_end|>\n"
    "{%- elif m['role'] == 'tool' %}<|im_start|>tool\n{{ m['content'] }}<|im_end|>\n"
    "{%- else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_TASK_RE = re.compile(r"task_id=([A-Za-z0-9_.-]+)")
_TOOL_NAME_RE = re.compile(r'"name": "([A-Za-z0-9_.-]+)"')
_CWD_RES = (re.compile(r"<cwd>([^<\n]+)</cwd>"), re.compile(r"Working directory: (/[^\s<]+)"),
            re.compile(r"The workspace is (/[^\s<]+?)\.?(?:\s|<|$)"))
_TOOLS_HEAD = "# Tools\n\nYou may call one or more functions"


@dataclass(frozen=True)
class Step:
    """One scripted step: ``op`` (one of OPS) and its arguments."""

    op: str
    cmd: str | None = None
    path: str | None = None
    old: str | None = None
    new: str | None = None
    content: str | None = None
    message: str | None = None


@dataclass(frozen=True)
class TaskScript:
    task_id: str
    steps: tuple[Step, ...]


def parse_script(raw: Any, where: str) -> tuple[Step, ...]:
    """A task's ``payload.script``: a list of steps; ValueError naming ``where`` and the step."""
    if not isinstance(raw, list) or not raw:
        raise ValueError(f"{where}: payload.script must be a non-empty list of steps")
    steps = []
    need = {"run": ("cmd",), "view": ("path",), "replace": ("path", "old", "new"), "write": ("path", "content"),
            "finish": ("message",)}
    for i, s in enumerate(raw):
        if not isinstance(s, dict) or s.get("op") not in OPS:
            raise ValueError(f"{where}: payload.script[{i}].op must be one of {', '.join(OPS)}, got "
                             f"{(s.get('op') if isinstance(s, dict) else s)!r}")
        for k in need[s["op"]]:
            if not isinstance(s.get(k), str):
                raise ValueError(f"{where}: payload.script[{i}].{k} must be a string ({s['op']} step)")  # noqa: TRY004
        unknown = set(s) - {"op", *need[s["op"]]}
        if unknown:
            raise ValueError(f"{where}: payload.script[{i}]: unknown field(s) {sorted(unknown)}; "
                             f"a {s['op']} step has {', '.join(need[s['op']])}")
        steps.append(Step(**s))
    if steps[-1].op != "finish":
        raise ValueError(f"{where}: payload.script must end with a finish step")
    return tuple(steps)


def load_scripts(path: str | Path) -> dict[str, TaskScript]:
    """task id -> script, from a ``mas_task_v1`` JSONL (tasks without ``payload.script`` skipped)."""
    out = {}
    for t in load_tasks(path):
        raw = t.payload.get("script")
        if raw is None:
            continue
        tid = t.task_id or t.workflow_id
        out[tid] = TaskScript(tid, parse_script(raw, f"{path}:{t.line}"))
    if not out:
        raise ValueError(f"{path}: no task has a payload.script (the scripted model has nothing to say)")
    return out


# -- rendering a step for a frontend's tools -------------------------------------------------------
def frontend_of(tool_names: set[str]) -> str | None:
    """Which frontend's tools these are: codex, opencode, openhands (None: none of them)."""
    if "exec_command" in tool_names or "shell" in tool_names:
        return "codex"
    if {"terminal", "file_editor"} <= tool_names:
        return "openhands"
    if {"bash", "edit"} <= tool_names:
        return "opencode"
    return None


def _abs(cwd: str | None, path: str) -> str:
    return path if path.startswith("/") or not cwd else f"{cwd.rstrip('/')}/{path}"


def _patch(path: str, old: str | None, new: str, add: bool) -> str:
    if add:
        body = "".join(f"+{line}\n" for line in new.splitlines())
        return f"*** Begin Patch\n*** Add File: {path}\n{body}*** End Patch"
    minus = "".join(f"-{line}\n" for line in (old or "").splitlines())
    plus = "".join(f"+{line}\n" for line in new.splitlines())
    return f"*** Begin Patch\n*** Update File: {path}\n@@\n{minus}{plus}*** End Patch"


def tool_call(frontend: str, step: Step, cwd: str | None) -> tuple[str, dict[str, Any]] | None:
    """(tool name, arguments) for ``step`` with ``frontend``'s tools; None for a text answer."""
    if frontend == "codex":
        if step.op == "run":
            return "exec_command", {"cmd": step.cmd}
        if step.op == "view":
            return "exec_command", {"cmd": f"cat {step.path}"}
        if step.op in ("replace", "write"):
            patch = _patch(step.path or "", step.old, step.new if step.op == "replace" else step.content or "",
                           add=step.op == "write")
            return "exec_command", {"cmd": f"apply_patch <<'PATCH'\n{patch}\nPATCH"}
        return None
    if frontend == "opencode":
        if step.op == "run":
            return "bash", {"command": step.cmd, "description": f"Run {step.cmd}"[:80]}
        if step.op == "view":
            return "read", {"filePath": _abs(cwd, step.path or "")}
        if step.op == "replace":
            return "edit", {"filePath": _abs(cwd, step.path or ""), "oldString": step.old, "newString": step.new}
        if step.op == "write":
            return "write", {"filePath": _abs(cwd, step.path or ""), "content": step.content}
        return None
    if frontend == "openhands":
        if step.op == "run":
            return "terminal", {"command": step.cmd}
        if step.op == "view":
            return "file_editor", {"command": "view", "path": _abs(cwd, step.path or "")}
        if step.op == "replace":
            return "file_editor", {"command": "str_replace", "path": _abs(cwd, step.path or ""),
                                   "old_str": step.old, "new_str": step.new}
        if step.op == "write":
            return "file_editor", {"command": "create", "path": _abs(cwd, step.path or ""),
                                   "file_text": step.content}
        return "finish", {"message": step.message}
    raise ValueError(f"unknown frontend {frontend!r}")


def render_turn(frontend: str, step: Step, cwd: str | None) -> str:
    """The assistant turn's text as the model emits it (hermes tool-call format, or plain text)."""
    call = tool_call(frontend, step, cwd)
    if call is None:
        return step.message or "Done."
    name, args = call
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}, ensure_ascii=False) + "\n</tool_call>"


@dataclass(frozen=True)
class PromptView:
    """What the scripted model reads from a prompt."""

    task: str | None
    frontend: str | None
    tools_offered: bool
    step: int
    cwd: str | None


def read_prompt(text: str) -> PromptView:
    """The task, frontend, step and working directory a rendered prompt shows."""
    m = _TASK_RE.search(text)
    tools_offered = _TOOLS_HEAD in text
    names: set[str] = set()
    if tools_offered:
        head = text[text.index(_TOOLS_HEAD):]
        head = head[:head.find("</tools>")]
        names = set(_TOOL_NAME_RE.findall(head))
    cwd = None
    for r in _CWD_RES:
        c = r.search(text)
        if c:
            cwd = c.group(1).strip()
            break
    return PromptView(task=m.group(1) if m else None, frontend=frontend_of(names), tools_offered=tools_offered,
                      step=text.count("<|im_start|>tool\n"), cwd=cwd)


def next_turn(view: PromptView, scripts: dict[str, TaskScript]) -> str | None:
    """The scripted assistant turn for this prompt; None: not scripted (the model answers)."""
    script = scripts.get(view.task or "")
    if script is None:
        return None
    if not view.tools_offered:
        return f"Task {script.task_id}"  # a side call (title, summary) of a scripted session
    if view.frontend is None:
        return None
    step = script.steps[min(view.step, len(script.steps) - 1)]
    return render_turn(view.frontend, step, view.cwd)


# -- the vLLM seam ----------------------------------------------------------------------------------
def _processor_base() -> type:
    from vllm.v1.sample.logits_processor import LogitsProcessor

    return LogitsProcessor


class ScriptedLogitsProcessor(_processor_base()):  # type: ignore[misc]
    """Forces each scripted request's next token (the script's, then end of turn)."""

    def __init__(self, vllm_config: Any, device: Any, is_pin_memory: bool) -> None:
        cfg = (vllm_config.additional_config or {}).get(CONFIG_KEY) or {}
        self.scripts: dict[str, TaskScript] = load_scripts(cfg["tasks"]) if cfg.get("tasks") else {}
        self.tokenizer = None
        self.eos: int | None = None
        if self.scripts:
            from transformers import AutoTokenizer

            mc = vllm_config.model_config
            self.tokenizer = AutoTokenizer.from_pretrained(mc.tokenizer)
            self.eos = self.tokenizer.eos_token_id
            logger.info("scripted model: %d task scripts from %s", len(self.scripts), cfg["tasks"])
        #: batch index -> (the forced token ids, the request's live output token list)
        self.forced: dict[int, tuple[list[int], list[int]]] = {}

    def is_argmax_invariant(self) -> bool:
        return False

    def _new(self, params: Any, prompt_ids: list[int] | None, output_ids: list[int]):
        if not self.scripts or not prompt_ids:
            return None
        text = self.tokenizer.decode(prompt_ids, skip_special_tokens=False)
        turn = next_turn(read_prompt(text), self.scripts)
        if turn is None:
            return None
        return [*self.tokenizer.encode(turn, add_special_tokens=False), self.eos], output_ids

    def update_state(self, batch_update: Any) -> None:
        from vllm.v1.sample.logits_processor.builtin import process_dict_updates

        process_dict_updates(self.forced, batch_update, self._new)

    def apply(self, logits: Any) -> Any:
        if not self.forced:
            return logits
        for i, (ids, out) in self.forced.items():
            n = len(out)
            tok = ids[n] if n < len(ids) else self.eos
            logits[i] = float("-inf")
            logits[i, tok] = 0.0
        return logits
