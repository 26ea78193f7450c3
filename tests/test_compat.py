"""The vLLM members engine/ overrides or reads still exist with the signatures we expect."""

from __future__ import annotations

import pytest
from vllm_mars import REQUIRED_VLLM_VERSION
from vllm_mars.engine import compat


def test_installed_vllm_is_the_pinned_release():
    compat.check_vllm_version()
    assert compat.installed_vllm_version().split("+")[0] == REQUIRED_VLLM_VERSION


def test_every_member_we_rely_on_has_the_expected_signature():
    assert compat.signature_mismatches() == []


def test_scheduler_and_request_attributes_exist():
    from vllm.v1.request import Request
    from vllm_mars.engine.rig import make_request, make_scheduler

    s = make_scheduler("fcfs", num_blocks=16)
    for attr in compat.EXPECTED_SCHEDULER_ATTRS:
        assert hasattr(s, attr), attr
    r = make_request("x", prompt_len=4, max_tokens=1)
    assert isinstance(r, Request)
    for attr in compat.EXPECTED_REQUEST_ATTRS:
        assert hasattr(r, attr), attr


@pytest.mark.parametrize("installed", ["0.31.0", "0.33.1+cpu"])
def test_wrong_vllm_version_is_a_one_line_error_naming_both(installed, monkeypatch):
    monkeypatch.delenv(compat.ENV_ALLOW_MISMATCH, raising=False)
    with pytest.raises(compat.VllmVersionError) as e:
        compat.check_vllm_version(installed)
    msg = str(e.value)
    assert "\n" not in msg and installed in msg and REQUIRED_VLLM_VERSION in msg


def test_cpu_build_version_suffix_is_accepted_and_override_works(monkeypatch):
    compat.check_vllm_version(REQUIRED_VLLM_VERSION + "+cpu")
    monkeypatch.setenv(compat.ENV_ALLOW_MISMATCH, "1")
    compat.check_vllm_version("0.31.0")
