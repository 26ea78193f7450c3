"""mars on Ray Serve: N vLLM replicas behind the MARS admission gate and a MARS request router.

Modules: :mod:`.replica` (the replica deployment and the replica set), :mod:`.gate` (the gate),
:mod:`.router` (the router; imports ``ray``), :mod:`.deploy` (building, starting and stopping the
application). The names below are importable from this package.

Three parts, each reusing the one-machine code rather than copying it:

* :class:`VLLMReplica` (a Serve deployment, ``--replicas N``): each replica starts vLLM's OpenAI
  server (``python -m vllm.entrypoints.openai.api_server`` with MarsScheduler, the arguments
  ``mars serve`` uses) as a child process on its node and answers calls by passing them to it.
  ``record_routing_stats`` reports the engine's KV reading (its /metrics, parsed by
  :func:`~vllm_mars.admission.telemetry.telemetry_from_metrics`) to Ray Serve's controller, which
  hands it to every router. Why a child process and not the engine in the actor: the OpenAI layer
  (chat templates, tool parsers, /tokenize, /metrics, the backend key) is what the gate already
  speaks, and vLLM-CPU runs its engine core in a process of its own either way.
* :class:`~vllm_mars.serve_ray.router.MarsRouter` (Ray Serve's public ``RequestRouter``): feeds a
  :class:`ReplicaSet` (one :class:`ReplicaBackend` per live replica, with its routing stats as its
  :class:`~vllm_mars.admission.base.Telemetry`) shared with the gate in the same process, and routes
  calls made through the Serve handle with the one :class:`~vllm_mars.admission.placement.Placement`:
  a call pinned to a replica (``mars_replica``) goes there, any other where ``Placement.score``
  ranks best (budget above the guard margin, minus promises, plus cached prefix).
* :class:`RayGate`: the admission sidecar (:class:`~vllm_mars.admission.sidecar.Sidecar`: routes,
  identity, admission controller, root lifecycle, /metrics) whose backends are the replicas of the
  :class:`ReplicaSet`. Admission is per replica, by the fleet logic the multi-backend sidecar and
  the cluster sim use (:class:`~vllm_mars.admission.replicas.ReplicaAdmission`): a root is placed
  when it arrives, with that same :class:`Placement`, and waits at its replica's own controller,
  which reads only that replica. The gate pins the root's calls to the replica and sends them with the sidecar's own pooled HTTP client straight to
  the replica's vLLM server (its address comes in the routing stats). Why not through the Serve
  handle: one handle call costs the caller 2.2 ms of CPU, 3.7x the gate's whole call over HTTP
  (0.6 ms; ``benchmark/perf/ingress_throughput.py``, RESULTS.md "Ingress throughput"). A replica
  that dies with a call in flight, before the client saw any of the answer (its engine refuses
  connections: the answer can never come), is marked down, and the root is placed on a live
  replica and the call resent there: the root keeps running, queues at the new replica's controller
  ahead of new roots (its slot moves with it) and rebuilds its KV there. After a
  streamed answer began, the call ends with an SSE ``error`` event and the root ends, as in the
  sidecar.

The gate runs in the ``mars serve --ray`` process (a Ray driver; Serve's HTTP proxy is off): clients
speak OpenAI HTTP to it as to the sidecar. Nothing here is imported by ``mars --help`` or the
sidecar; ``ray`` is imported only when a Ray path runs (``pip install 'vllm-mars[ray]'``).
"""

from vllm_mars.serve_ray.deploy import deployment, gate_for, start, stop
from vllm_mars.serve_ray.gate import RayForwarder, RayGate, _answers_http
from vllm_mars.serve_ray.replica import (
    DEPLOYMENT,
    RAY_BACKEND_LABEL,
    STATS_PERIOD_S,
    ReplicaBackend,
    ReplicaSet,
    ReplicaTelemetry,
    VLLMReplicaImpl,
    replica_set,
)

__all__ = ["DEPLOYMENT", "RAY_BACKEND_LABEL", "STATS_PERIOD_S", "RayForwarder", "RayGate", "ReplicaBackend",
           "ReplicaSet", "ReplicaTelemetry", "VLLMReplicaImpl", "_answers_http", "deployment", "gate_for",
           "replica_set", "start", "stop"]
