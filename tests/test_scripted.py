"""The scripted model's pieces without a server: the chat template renders what the frontends send,
the prompt reader finds task / frontend / step / cwd in it, each step renders to the frontend's own
tool call, vLLM's own hermes parser reads it back, and the task set's scripts solve their tasks.
Plus `mars serve`'s day-one sizes and the sidecar's default output limit."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from vllm_mars.engine.scripted import (
    SCRIPTED_CHAT_TEMPLATE,
    Step,
    load_scripts,
    next_turn,
    parse_script,
    read_prompt,
    render_turn,
)

TASKS = Path(__file__).resolve().parents[1] / "benchmark" / "tasks" / "coding.jsonl"
TOOLS = {
    "codex": ["exec_command", "write_stdin", "view_image"],
    "opencode": ["bash", "edit", "read", "write", "glob"],
    "openhands": ["terminal", "file_editor", "finish", "think"],
}


def _tools(names: list[str]) -> list[dict]:
    return [{"type": "function", "function": {"name": n, "description": f"the {n} tool",
                                              "parameters": {"type": "object", "properties": {}}}} for n in names]


@pytest.fixture(scope="module")
def tok(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


def _render(tok, messages: list[dict], tools: list[dict] | None) -> str:
    return tok.apply_chat_template(messages, tools=tools, chat_template=SCRIPTED_CHAT_TEMPLATE, tokenize=False,
                                   add_generation_prompt=True)


def test_task_set_scripts_solve_their_tasks(tmp_path):
    """Every task fails its check as shipped and passes once its script's edits are applied; each
    script has 4..15 steps and ends with finish."""
    rows = [json.loads(x) for x in TASKS.read_text().splitlines()]
    scripts = load_scripts(TASKS)
    assert len(rows) >= 10 and set(scripts) == {r["task_id"] for r in rows}
    for r in rows:
        ws = tmp_path / r["task_id"]
        ws.mkdir()
        for f in r["workspace_init"]:
            (ws / f["path"]).write_text(f["content"])
        check = r["payload"]["check"]
        assert subprocess.run(check, shell=True, cwd=ws, capture_output=True, check=False).returncode != 0
        steps = scripts[r["task_id"]].steps
        assert 4 <= len(steps) <= 15 and steps[-1].op == "finish"
        for s in steps:
            if s.op == "replace":
                src = (ws / s.path).read_text()
                assert src.count(s.old) == 1, (r["task_id"], s.old)
                (ws / s.path).write_text(src.replace(s.old, s.new))
            elif s.op == "write":
                (ws / s.path).write_text(s.content)
        assert subprocess.run(check, shell=True, cwd=ws, capture_output=True, check=False).returncode == 0, r


@pytest.mark.parametrize("frontend", ["codex", "opencode", "openhands"])
def test_prompt_to_scripted_turn_and_back_through_vllms_parser(tok, frontend):
    """A rendered conversation of task calc-add after two tool results: the reader sees the task,
    the frontend (from its tools), step 2 and the cwd; the turn is the script's step 2 (the edit of
    calc.py) in the frontend's tool, and vLLM's hermes parser returns exactly that call."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.tool_parsers.hermes_tool_parser import Hermes2ProToolParser

    scripts = load_scripts(TASKS)
    call = {"id": "c1", "type": "function", "function": {"name": "x", "arguments": '{"cmd": "ls"}'}}
    msgs = [{"role": "system", "content": "You are an agent.\n  Working directory: /w/s/workspace\n"},
            {"role": "user", "content": "[TASK] task_id=calc-add\nfix it"},
            {"role": "assistant", "content": "", "tool_calls": [call]}, {"role": "tool", "content": "out 1",
                                                                        "tool_call_id": "c1"},
            {"role": "assistant", "content": None, "tool_calls": [call]}, {"role": "tool", "content": "out 2",
                                                                          "tool_call_id": "c1"}]
    text = _render(tok, msgs, _tools(TOOLS[frontend]))
    view = read_prompt(text)
    assert (view.task, view.frontend, view.step, view.cwd, view.tools_offered) == \
        ("calc-add", frontend, 2, "/w/s/workspace", True)
    turn = next_turn(view, scripts)
    assert turn == render_turn(frontend, scripts["calc-add"].steps[2], "/w/s/workspace")
    parser = Hermes2ProToolParser(tok)
    req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}], tools=_tools(TOOLS[frontend]))
    got = parser.extract_tool_calls(turn, req)
    assert got.tools_called and len(got.tool_calls) == 1
    name, args = got.tool_calls[0].function.name, json.loads(got.tool_calls[0].function.arguments)
    patch = ("apply_patch <<'PATCH'\n*** Begin Patch\n*** Update File: calc.py\n@@\n-    return a - b\n"
             "+    return a + b\n*** End Patch\nPATCH")
    f = "/w/s/workspace/calc.py"
    expect = {"codex": ("exec_command", {"cmd": patch}),
              "opencode": ("edit", {"filePath": f, "oldString": "    return a - b", "newString": "    return a + b"}),
              "openhands": ("file_editor", {"command": "str_replace", "path": f, "old_str": "    return a - b",
                                            "new_str": "    return a + b"})}[frontend]
    assert (name, args) == expect
    # the tokenizer says the turn exactly (byte-level BPE: what the engine forces decodes back)
    assert tok.decode(tok.encode(turn, add_special_tokens=False)) == turn


def test_final_steps_side_calls_and_unscripted_prompts(tok):
    scripts = load_scripts(TASKS)
    last = len(scripts["calc-add"].steps) - 1
    base = [{"role": "user", "content": "[TASK] task_id=calc-add\nfix it"}]
    done = base + [m for k in range(last) for m in (
        {"role": "assistant", "content": "", "tool_calls": [{"id": f"c{k}", "type": "function",
                                                             "function": {"name": "bash", "arguments": "{}"}}]},
        {"role": "tool", "content": f"r{k}", "tool_call_id": f"c{k}"})]
    # Codex / OpenCode finish with a text answer (no tool call); OpenHands with its finish tool
    assert next_turn(read_prompt(_render(tok, done, _tools(TOOLS["opencode"]))), scripts) == \
        scripts["calc-add"].steps[-1].message
    oh = next_turn(read_prompt(_render(tok, done, _tools(TOOLS["openhands"]))), scripts)
    assert '"name": "finish"' in oh
    # a side call of a scripted session (no tools: OpenCode's title) gets a short text
    assert next_turn(read_prompt(_render(tok, base, None)), scripts) == "Task calc-add"
    # prompts of no task, or tools of no known frontend: the model answers
    assert next_turn(read_prompt(_render(tok, [{"role": "user", "content": "hi"}], _tools(["bash", "edit"]))),
                     scripts) is None
    assert next_turn(read_prompt(_render(tok, base, _tools(["mystery"]))), scripts) is None


def test_bad_scripts_name_file_line_and_field(tmp_path):
    with pytest.raises(ValueError, match=r"f.jsonl:3: payload.script\[1\].op must be one of run, view"):
        parse_script([{"op": "run", "cmd": "ls"}, {"op": "jump"}], "f.jsonl:3")
    with pytest.raises(ValueError, match=r"payload.script\[0\].path must be a string \(view step\)"):
        parse_script([{"op": "view"}], "f")
    with pytest.raises(ValueError, match="must end with a finish step"):
        parse_script([{"op": "run", "cmd": "ls"}], "f")
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['cmd'\]"):
        parse_script([{"op": "finish", "message": "ok", "cmd": "x"}], "f")
    p = tmp_path / "t.jsonl"
    p.write_text(json.dumps({"schema": "mas_task_v1", "task_id": "a", "payload": {"text": "x"}}) + "\n")
    with pytest.raises(ValueError, match="no task has a payload.script"):
        load_scripts(p)
    assert Step("run", cmd="ls") == parse_script([{"op": "run", "cmd": "ls"}, {"op": "finish", "message": "m"}],
                                                 "f")[0]


# -- day-one defaults ------------------------------------------------------------------------------
def test_serve_sizes_cpu_fits_the_frontends_first_prompts_and_gpu_is_vllms(tiny_model):
    from vllm_mars.engine import local

    cpu = local.serve_sizes(tiny_model, True)
    assert cpu["max_model_len"] == 32768  # Codex's first prompt (~11.5k tokens with the tiny tokenizer) fits
    assert local.serve_sizes(tiny_model, True, num_blocks=101)["max_model_len"] == 100 * 32  # what KV holds
    assert local.serve_sizes(tiny_model, True, max_model_len=4096)["max_model_len"] == 4096  # the user's
    gpu = local.serve_sizes(tiny_model, False)
    assert gpu == {"max_model_len": None, "max_num_seqs": None, "max_num_batched_tokens": None}
    args = local.server_args(tiny_model, cpu=False, **gpu)
    assert "--max-model-len" not in args and "--max-num-seqs" not in args  # vLLM's own sizing
    args = local.server_args(tiny_model, cpu=True, scripted=str(TASKS), **cpu)
    i = args.index("--logits-processors")
    assert args[i + 1] == "vllm_mars.engine.scripted:ScriptedLogitsProcessor"
    assert json.loads(args[args.index("--additional-config") + 1])["mars_scripted"]["tasks"] == str(TASKS)


def test_default_max_tokens_only_where_none_is_sent_and_the_400_names_the_flag():
    from vllm_mars.admission.sidecar import SidecarConfig, set_default_max_tokens
    from vllm_mars.admission.sidecar.proxy import _context_hint

    b: dict = {}
    set_default_max_tokens(b, "/v1/responses", 64)
    assert b == {"max_output_tokens": 64}
    b = {"max_output_tokens": 1024}
    set_default_max_tokens(b, "/v1/responses", 64)
    assert b == {"max_output_tokens": 1024}
    b = {"max_completion_tokens": 9}
    set_default_max_tokens(b, "/v1/chat/completions", 64)
    assert b == {"max_completion_tokens": 9}
    b = {}
    set_default_max_tokens(b, "/v1/chat/completions", 64)
    assert b == {"max_tokens": 64}
    with pytest.raises(ValueError, match="default_max_tokens"):
        SidecarConfig(backends=("http://x",), default_max_tokens=0)
    msg = {"error": {"message": "This model's maximum context length is 4096 tokens. However, your prompt "
                                "contains 11500 input tokens", "code": 400}}
    out = json.loads(_context_hint(json.dumps(msg).encode()))
    assert "--max-model-len" in out["error"]["message"] and out["error"]["code"] == 400
    assert _context_hint(b"not json") == b"not json"
