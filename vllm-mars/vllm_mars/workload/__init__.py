"""Workloads: schema v1 (pydantic), token-id materialization, the ILR generator and converters.

No vllm or torch import here: this package is pure Python.
"""

from vllm_mars.workload.materialize import TokenSource, TurnPlan, WorkflowPlan, load_plans, materialize_all
from vllm_mars.workload.schema import (
    SCHEMA_V1,
    Child,
    Segment,
    Turn,
    Workflow,
    WorkloadError,
    WorkloadLine,
    load_workload,
    write_workload,
)

__all__ = [
    "SCHEMA_V1", "Child", "Segment", "TokenSource", "Turn", "TurnPlan", "Workflow", "WorkflowPlan",
    "WorkloadError", "WorkloadLine", "load_plans", "load_workload", "materialize_all", "write_workload",
]
