"""Issue 11 defects 8, 9 and 10 (bool options): every bad workload, trace or option given to the
``mars`` CLI is one line naming the file, line and field (or the option), exit 2, no traceback, and
nothing is materialised or launched first."""

from __future__ import annotations

import dataclasses
import json
import math
import time

import pytest
from vllm_mars.cli import main

GOOD_TURNS = [{"output_tokens": 4, "tool": "bash", "tool_s": 0.1}, {"append_tokens": 3, "output_tokens": 2}]


def _line(**over) -> str:
    wf = {"schema": "mars_workload_v1", "workflow_id": "w0", "prompt_tokens": 40, "turns": GOOD_TURNS}
    wf.update(over)
    return json.dumps(wf)


def _cli(capsys, *argv: str) -> tuple[int, str]:
    rc = main(list(argv))
    err = capsys.readouterr().err.strip()
    return rc, err


def _one_line_error(rc: int, err: str, *needles: str) -> None:
    assert rc == 2, err
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    for n in needles:
        assert n in err, (n, err)


@pytest.mark.parametrize(("turn0", "needle"), [
    ({"output_tokens": 4, "tool_s": math.inf}, "turns[0].tool_s"),
    ({"output_tokens": 4, "tool_s": 1e9}, "turns[0].tool_s"),
    ({"output_tokens": 4, "tool_s": math.nan}, "turns[0].tool_s"),
    ({"output_tokens": 1e11}, "turns[0].output_tokens"),
])
def test_absurd_tool_times_and_token_counts_are_field_errors(tmp_path, capsys, turn0, needle):
    p = tmp_path / "w.jsonl"
    p.write_text(_line() + "\n" + _line(workflow_id="w1", turns=[turn0, GOOD_TURNS[1]]) + "\n")
    rc, err = _cli(capsys, "workload-stats", str(p))
    _one_line_error(rc, err, f"{p}:2: {needle}")


def test_prompt_tokens_1e11_fails_before_materialisation(tmp_path, capsys):
    p = tmp_path / "w.jsonl"
    p.write_text(_line(prompt_tokens=1e11) + "\n")
    t = time.monotonic()
    rc, err = _cli(capsys, "replay", "--workload", str(p), "--no-calibrate", "--no-progress", "--out",
                   str(tmp_path / "run"))
    _one_line_error(rc, err, f"{p}:1: prompt_tokens")
    # Within the schema's bound but beyond the engine's context: refused before any id is drawn.
    p.write_text(_line(prompt_tokens=16_000_000) + "\n")
    rc, err = _cli(capsys, "replay", "--workload", str(p), "--no-calibrate", "--no-progress", "--out",
                   str(tmp_path / "run"))
    _one_line_error(rc, err, str(p), "max_model_len")
    assert time.monotonic() - t < 10


def test_deep_nesting_and_invalid_utf8_name_file_and_line(tmp_path, capsys):
    p = tmp_path / "w.jsonl"
    p.write_text(_line() + "\n" + "[" * 100_000 + "\n")
    _one_line_error(*_cli(capsys, "workload-stats", str(p)), f"{p}:2:", "nested too deeply")
    child: dict = {"workflow_id": "leaf", "turns": [{"output_tokens": 1}], "prompt_tokens": 1}
    for i in range(40):
        child = {"workflow_id": f"c{i}", "prompt_tokens": 1, "turns": [{"output_tokens": 1}],
                 "children": [{"after_turn": 0, "workflow": child}]}
    p.write_text(_line(children=[{"after_turn": 0, "workflow": child}]) + "\n")
    _one_line_error(*_cli(capsys, "workload-stats", str(p)), f"{p}:1: children")
    p.write_bytes(_line().encode() + b"\n" + b'{"schema": "mars_workload_v1", "workflow_id": "\xff\xfe"}\n')
    _one_line_error(*_cli(capsys, "workload-stats", str(p)), f"{p}:2:", "invalid UTF-8")


@pytest.mark.parametrize(("request0", "needle"), [
    ({"t": None, "in": 100, "out": 5}, "requests[0].t: must be a number, got null"),
    ({"in": 100, "out": 5}, "requests[0].t: missing"),
    ({"t": 0, "in": "abc", "out": 5}, "requests[0].in: must be a finite number"),
    ({"t": 0, "in": 100}, "requests[0].out: missing"),
    ({"t": 0, "in": 100, "out": 5, "api_time": "slow"}, "requests[0].api_time"),
    ({"t": 0, "type": "subagent", "requests": [{"t": 1, "in": None, "out": 2}]}, "requests[0].requests[0].in"),
    ("not an object", "requests[0]: must be an object"),
])
def test_weka_traces_with_null_missing_or_non_numeric_fields(tmp_path, capsys, request0, needle):
    src = tmp_path / "trace_1.json"
    src.write_text(json.dumps({"id": "x", "requests": [request0, {"t": 5, "in": 200, "out": 5}]}))
    rc, err = _cli(capsys, "convert", "weka", str(src), "-o", str(tmp_path / "out.jsonl"))
    _one_line_error(rc, err, str(src), needle)


def test_weka_trace_with_invalid_utf8(tmp_path, capsys):
    src = tmp_path / "trace_1.json"
    src.write_bytes(b'{"id": "\xc3\x28", "requests": []}')
    _one_line_error(*_cli(capsys, "convert", "weka", str(src), "-o", str(tmp_path / "o.jsonl")), str(src),
                    "invalid UTF-8")


def test_unreachable_http_backend_is_one_line(tmp_path, capsys):
    from conftest import free_port

    url = f"http://127.0.0.1:{free_port()}"
    rc, err = _cli(capsys, "replay", "--backend", "http", "--url", url, "--no-calibrate", "--no-progress",
                   "--out", str(tmp_path / "run"))
    _one_line_error(rc, err, url, "cannot reach")


def test_serve_checks_the_policy_before_launching_vllm(tmp_path, capsys):
    t = time.monotonic()
    rc, err = _cli(capsys, "serve", str(tmp_path / "no-model"), "--policy", "nosuch", "--engine-timeout", "5")
    _one_line_error(rc, err, "unknown policy 'nosuch'")
    rc, err = _cli(capsys, "serve", str(tmp_path / "no-model"), "--policy", "mars", "--policy-option",
                   "aging_s=NaN", "--engine-timeout", "5")
    _one_line_error(rc, err, "aging_s", "finite")
    assert time.monotonic() - t < 5


@pytest.mark.parametrize(("argv", "needle"), [
    (["--rps", "nan"], "rps"), (["--rps", "inf"], "rps"), (["--tool-timeout", "nan"], "tool_timeout_s"),
    (["--tool-timeout", "-1"], "tool_timeout_s"), (["--num-workflows", "0"], "num_workflows"),
    (["--max-num-seqs", "0"], "max_num_seqs"), (["--num-blocks", "-3"], "num_blocks"),
    (["--policy", "mars", "--policy-option", "aging_s=NaN"], "aging_s"),
    (["--policy", "mars", "--policy-option", "mlfq=1"], "mlfq must be bool"),
    (["--policy", "mars", "--admission-option", "stale_s=NaN"], "stale_s"),
    (["--policy", "mars", "--admission-option", "window_max=true"], "window_max must be int"),
    (["--policy", "nosuch"], "nosuch"),
])
def test_driver_options_are_validated_before_anything_starts(tmp_path, capsys, argv, needle):
    rc, err = _cli(capsys, "replay", *argv, "--no-calibrate", "--no-progress", "--out", str(tmp_path / "run"))
    _one_line_error(rc, err, needle)


def test_bool_options_can_be_set_and_are_type_checked():
    from vllm_mars.admission.base import config_from_dict

    @dataclasses.dataclass(frozen=True)
    class Opts:
        enabled: bool = False
        share: float = 0.5

    assert config_from_dict(Opts, {"enabled": True}).enabled is True
    with pytest.raises(ValueError, match="Opts.enabled must be bool"):
        config_from_dict(Opts, {"enabled": 1})
    with pytest.raises(ValueError, match="Opts.share must be a finite number"):
        config_from_dict(Opts, {"share": math.nan})


def test_token_id_prompts_are_estimated_by_their_length():
    """Defect 10: ``"prompt": [ints]`` was estimated as 0 tokens (admission saw an empty call)."""
    from vllm_mars.admission.identity import estimate_prompt_tokens

    assert estimate_prompt_tokens({"prompt": list(range(3, 103))}) == 100
    assert estimate_prompt_tokens({"prompt": [[5, 6, 7], [8, 9]]}) == 5
    assert estimate_prompt_tokens({"prompt": "abcd" * 10}) == 10
    assert estimate_prompt_tokens({"prompt": [True, None, "ab"]}) == 1


@pytest.mark.parametrize(("argv", "needle"), [
    (["gen-workload", "--scale", "nan"], "IlrConfig.scale must be a finite number"),
    (["gen-workload", "--num-workflows", "-3"], "num_workflows"),
    (["convert", "weka", "{d}", "--scale", "inf"], "scale"),
    (["convert", "weka", "{d}", "--max-tool-s", "nan"], "max_tool_s"),
    (["convert", "weka", "{d}", "--limit", "-1"], "--limit"),
])
def test_workload_command_options_are_validated(tmp_path, capsys, argv, needle):
    (tmp_path / "trace_1.json").write_text(json.dumps({"id": "x", "requests": [{"t": 0, "in": 100, "out": 5}]}))
    argv = [a.replace("{d}", str(tmp_path)) for a in argv]
    _one_line_error(*_cli(capsys, *argv, "-o", str(tmp_path / "o.jsonl")), needle)


@pytest.mark.parametrize(("cell", "needle"), [("inf", "expected a finite number"), ("nan", "expected a finite number"),
                                              ("1e400", "expected a finite number"), ("abc", "expected a number")])
def test_tracelab_non_finite_cells_are_field_errors(tmp_path, capsys, cell, needle):
    src = tmp_path / "t.csv"
    src.write_text("session_id,arrival_time,round_idx,prefix_len,input_len,output_len,tool_wait_after_ms\n"
                   "s1,0,0,10,20,5,100\n"
                   f"s1,1,1,10,{cell},5,0\n")
    _one_line_error(*_cli(capsys, "convert", "tracelab", str(src), "-o", str(tmp_path / "o.jsonl")),
                    f"{src}:3: input_len", needle)


def test_tracelab_invalid_utf8_and_model_output_nesting():
    from vllm_mars.workload import mas_task
    from vllm_mars.workload.schema import WorkloadError
    from vllm_mars.workload.tracelab import convert_csv

    failure = mas_task.parse_action("x " + "{" * 50_000 + '"a": 1' + "}" * 50_000)
    assert isinstance(failure, mas_task.ParseFailure)
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".csv") as f:
        f.write(b"session_id,arrival_time,round_idx,prefix_len,input_len,output_len,tool_wait_after_ms\n\xff\xfe,0\n")
        f.flush()
        with pytest.raises(WorkloadError, match="invalid UTF-8"):
            convert_csv(f.name)
