"""Policy registry, engine config parsing and workflow tags: pure Python, no vllm import."""

from __future__ import annotations

import sys

import pytest
from vllm_mars.config import parse_engine_config
from vllm_mars.policies import available_policies, get_policy_class, make_policy
from vllm_mars.workflow import workflow_from_extra_args


def test_policy_modules_do_not_import_vllm_or_torch():
    assert "vllm_mars.policies" in sys.modules
    import subprocess

    code = ("import sys, vllm_mars.policies, vllm_mars.config, vllm_mars.workflow, vllm_mars.admission.base; "
            "bad = [m for m in ('vllm', 'torch') if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stdout + r.stderr


def test_fcfs_is_registered_and_unknown_names_list_the_valid_ones():
    assert "fcfs" in available_policies()
    assert available_policies() == sorted(available_policies())
    assert get_policy_class("fcfs").name == "fcfs"
    with pytest.raises(ValueError, match="unknown policy 'lifo'; available policies: .*fcfs"):
        get_policy_class("lifo")
    with pytest.raises(ValueError, match=r"unknown config key\(s\) \['x'\] for policy 'fcfs'"):
        make_policy("fcfs", {"x": 1})


def test_engine_config_reads_additional_config_then_env_then_default():
    assert parse_engine_config(None, environ={}).policy == "fcfs"
    assert parse_engine_config({}, environ={"MARS_POLICY": "fcfs"}).policy == "fcfs"
    assert parse_engine_config({"mars": {"policy": "fcfs"}}, environ={"MARS_POLICY": "nope"}).policy == "fcfs"
    with pytest.raises(ValueError, match="unknown policy 'nope'"):
        parse_engine_config({}, environ={"MARS_POLICY": "nope"})
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['polcy'\].*valid keys: .*policy"):
        parse_engine_config({"mars": {"polcy": "fcfs"}}, environ={})
    with pytest.raises(ValueError, match="must be a JSON object"):
        parse_engine_config({"mars": "fcfs"}, environ={})


def test_engine_config_carries_a_validated_cost_model():
    cfg = parse_engine_config({"mars": {"policy": "mars", "cost_model": {"prefill_s_per_token": 1e-5,
                                                                          "source": "profile x"}}}, environ={})
    assert cfg.cost_model.prefill_s_per_token == 1e-5 and cfg.cost_model.calibrated
    assert "cost_model" not in cfg.policy_options
    with pytest.raises(ValueError, match=r'\["cost_model"\].*prefill_s_per_tokn'):
        parse_engine_config({"mars": {"cost_model": {"prefill_s_per_tokn": 1}}}, environ={})
    with pytest.raises(ValueError, match=r"decode_s.*finite number >= 0"):
        parse_engine_config({"mars": {"cost_model": {"decode_s": -1}}}, environ={})
    with pytest.raises(ValueError, match="online_cost"):
        parse_engine_config({"mars": {"online_cost": "yes"}}, environ={})


def test_workflow_tags_parse_and_default():
    wf = workflow_from_extra_args({"mars_workflow": "s1", "mars_root": "r", "mars_parent": "p",
                                   "mars_turn": 2, "mars_last_step": "false", "mars_tool": "bash",
                                   "mars_prefill_tokens": 1200, "other": 1}, "req")
    assert (wf.workflow, wf.root, wf.parent, wf.turn, wf.last_step, wf.tool, wf.prefill_tokens) == (
        "s1", "r", "p", 2, False, "bash", 1200)
    assert wf.is_child and wf.tagged
    plain = workflow_from_extra_args(None, "req-9")
    assert (plain.workflow, plain.root, plain.last_step, plain.tagged) == ("req-9", "req-9", True, False)
    assert workflow_from_extra_args({"mars_workflow": "w"}, "x").root == "w"
    assert workflow_from_extra_args({"mars_workflow": "w"}, "x").last_step is False


@pytest.mark.parametrize("bad,field", [({"mars_turn": -1}, "mars_turn"), ({"mars_turn": 1.5}, "mars_turn"),
                                       ({"mars_last_step": "maybe"}, "mars_last_step"),
                                       ({"mars_workflow": ""}, "mars_workflow"),
                                       ({"mars_prefill_tokens": "lots"}, "mars_prefill_tokens")])
def test_malformed_tags_name_the_key(bad, field):
    with pytest.raises(ValueError, match=field):
        workflow_from_extra_args(bad, "r")
