"""Building, starting and stopping the :mod:`vllm_mars.serve_ray` application: the replica deployment
routed by :class:`~vllm_mars.serve_ray.router.MarsRouter`, and the gate over its handle."""

from __future__ import annotations

import os
import signal
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from vllm_mars.admission.sidecar import SidecarConfig
from vllm_mars.serve_ray.gate import RayGate
from vllm_mars.serve_ray.replica import (
    _SETS,
    DEPLOYMENT,
    RAY_BACKEND_LABEL,
    STATS_PERIOD_S,
    VLLMReplicaImpl,
    replica_set,
)


def deployment(num_replicas: int, engine_argv: Sequence[str], *, env: Mapping[str, str] | None = None,
               num_cpus: float = 1.0, num_gpus: float = 0.0, startup_timeout_s: float = 600.0, log_dir: str | None = None,
               max_ongoing_requests: int = 256, set_key: str = DEPLOYMENT, engine_host: str | None = None) -> Any:
    """The Serve application of ``num_replicas`` vLLM replicas routed by :class:`MarsRouter`;
    ``engine_host``: the address each replica's vLLM server binds (None: its node's address)."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    router_cfg = RequestRouterConfig(request_router_class="vllm_mars.serve_ray.router.MarsRouter",
                                     request_router_kwargs={"set_key": set_key},
                                     request_routing_stats_period_s=STATS_PERIOD_S,
                                     request_routing_stats_timeout_s=10.0)
    dep = serve.deployment(VLLMReplicaImpl, name=DEPLOYMENT, num_replicas=num_replicas,
                           ray_actor_options={"num_cpus": num_cpus, "num_gpus": num_gpus},
                           max_ongoing_requests=max_ongoing_requests,
                           health_check_period_s=2.0, health_check_timeout_s=30.0,
                           graceful_shutdown_timeout_s=5.0,
                           request_router_config=router_cfg)
    return dep.bind(list(engine_argv), dict(env or {}), startup_timeout_s, log_dir, engine_host)


def start(num_replicas: int, engine_argv: Sequence[str], *, address: str | None = None,
          num_cpus: float | None = None, replica_cpus: float = 1.0, replica_gpus: float = 0.0, env: Mapping[str, str] | None = None,
          startup_timeout_s: float = 600.0, log_dir: str | None = None, app_name: str = "mars") -> Any:
    """Connect to (``address``) or start a local Ray cluster, deploy the replicas, return the handle."""
    import ray
    from ray import serve

    if not ray.is_initialized():
        kw: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False}
        if address:
            kw["address"] = address
        elif num_cpus is not None:
            kw["num_cpus"] = num_cpus
        ray.init(**kw)
    serve.start(proxy_location="Disabled")  # the gate is the ingress: no Serve HTTP proxy (no port taken)
    # one machine: the engines listen on loopback; a cluster: on their node's address (the gate dials them)
    app = deployment(num_replicas, engine_argv, env=env, num_cpus=replica_cpus, num_gpus=replica_gpus,
                     startup_timeout_s=startup_timeout_s,
                     log_dir=log_dir, engine_host=None if address else "127.0.0.1")
    return serve.run(app, name=app_name, route_prefix=None, blocking=False)


def gate_for(handle: Any, config: SidecarConfig, controller: Any = None) -> RayGate:
    """The admission gate over a replica deployment's handle (``config.backends`` is ignored)."""
    config = replace(config, backends=(RAY_BACKEND_LABEL,))
    return RayGate(config, handle, replica_set(DEPLOYMENT), controller)


def stop(app_name: str = "mars", *, wait: bool = True, log_dir: str | None = None) -> None:
    """Delete the application (replicas stop their vLLM servers) and leave Ray. ``wait=False``: do
    not wait for replicas (one still starting holds a graceful delete until it is up); leave Ray at
    once and kill the engine process groups recorded in ``log_dir`` (a local cluster)."""
    import ray
    from ray import serve

    try:
        if wait:
            serve.delete(app_name)
            serve.shutdown()
    finally:
        _SETS.clear()
        ray.shutdown()
        if log_dir:
            import glob

            for path in glob.glob(os.path.join(log_dir, "replica-*.pgid")):
                try:
                    os.killpg(int(open(path).read()), signal.SIGKILL)  # noqa: SIM115
                except (ProcessLookupError, ValueError, OSError):
                    pass
