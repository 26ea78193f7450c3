"""What the scheduler tells operators: the JSON-lines call log (``MARS_SCHED_LOG``) and the
engine-side stats (:func:`scheduler_stats`, ``MarsScheduler.mars_stats()``)."""

from __future__ import annotations

import json
import os
from typing import Any

from vllm_mars.policies import CallView
from vllm_mars.workflow import short_id

#: Path of a JSON-lines log of call arrivals and ends (off when unset): lets tests and operators see
#: what reached the scheduler inside the EngineCore process.
ENV_SCHED_LOG = "MARS_SCHED_LOG"


def _safe_str(v: Any) -> str:
    try:
        return short_id(str(v))
    except ValueError:
        return f"<{type(v).__name__}>"


class SchedLog:
    """One JSON line per call arrival and end; ids are capped (:func:`short_id`) and a value that
    cannot be written (e.g. an int beyond Python's str limit in extra_args) never fails the call."""

    def __init__(self, path: str, policy: str) -> None:
        self._file = open(path, "a", buffering=1)  # noqa: SIM115 - closed in close()
        self.policy = policy

    @classmethod
    def from_env(cls, policy: str) -> SchedLog | None:
        path = os.environ.get(ENV_SCHED_LOG)
        return cls(path, policy) if path else None

    @property
    def closed(self) -> bool:
        return self._file.closed

    def event(self, event: str, call: CallView, now: float, **fields: Any) -> None:
        wf = call.workflow
        rec = {"ts": now, "event": event, "policy": self.policy,
               "request_id": short_id(call.request_id),
               "workflow": short_id(wf.workflow), "root": short_id(wf.root), "parent": short_id(wf.parent),
               "turn": wf.turn, "last_step": wf.last_step, "tool": short_id(wf.tool), "tagged": wf.tagged,
               **fields}
        if isinstance(rec.get("extra_args"), dict):
            rec["extra_args"] = {short_id(str(k)): short_id(v) for k, v in rec["extra_args"].items()}
        try:
            line = json.dumps(rec, default=str)
        except (TypeError, ValueError):
            rec["extra_args"] = "<not serialisable>"
            line = json.dumps(rec, default=_safe_str)
        self._file.write(line + "\n")

    def close(self) -> None:
        self._file.close()


def scheduler_stats(sched: Any) -> dict[str, Any]:
    """Engine-side counters of a MarsScheduler, for telemetry readers and tests."""
    st = sched.retention.stats
    policy = sched.mars_policy
    events = sched._kv_events
    return {
        "policy": sched.mars_config.policy,
        "free_blocks": sched.free_blocks(),
        "num_blocks": sched.num_blocks,
        "block_size": sched.block_size,
        "retained_blocks": sched.retention.num_blocks,
        "retained_workflows": len(sched.retention),
        "preemptions": sched.mars_num_preemptions,
        "recomputed_tokens": sched.mars_recomputed_tokens,
        "prompt_tokens": sched.mars_prompt_tokens,
        "prefix_hit_tokens": sched.mars_prefix_hit_tokens,
        "retention": {k: v for k, v in vars(st).items() if not k.startswith("_")},
        "cost_model": policy.cost.as_dict() if policy.uses_cost else None,
        "policy_state": policy.state(),
        # None unless vLLM's KV cache events are enabled (engine_kwargs(kv_events=True)).
        "kv_blocks_removed": events.blocks_removed if events else None,
        "kv_blocks_stored": events.blocks_stored if events else None,
    }
