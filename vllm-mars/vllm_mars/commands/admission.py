"""``mars sidecar``: the admission proxy in front of vLLM servers. Its flags and their
:class:`SidecarConfig` are shared with ``mars serve`` (:mod:`vllm_mars.commands.serve`)."""

from __future__ import annotations

import argparse
import json
import os
import tomllib
from pathlib import Path
from typing import Any

from vllm_mars.admission.base import available_controllers, make_controller


def _kv(items: list[str] | None, flag: str) -> dict[str, Any]:
    """``KEY=VALUE`` pairs; a VALUE that parses as JSON is taken as JSON (numbers, booleans)."""
    out: dict[str, Any] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"{flag} expects KEY=VALUE, got {item!r}")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def _load_options(path: str | None, flag: str) -> dict[str, Any]:
    if not path:
        return {}
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{flag}: no such file {path}")
    text = p.read_text()
    if p.suffix == ".toml":
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"{path}: {e}") from None
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{e.lineno}:{e.colno}: {e.msg}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON/TOML object of controller options")  # noqa: TRY004
    return data


def _add_sidecar_options(p: argparse.ArgumentParser, *, serve: bool) -> None:
    g = p.add_argument_group("admission sidecar")
    if not serve:
        g.add_argument("--backend", action="append", required=True, metavar="URL",
                       help="base URL of a vLLM OpenAI server, e.g. http://127.0.0.1:8000; repeat for "
                            "several replicas (a workflow stays on its replica; new roots go to the one "
                            "with the most KV budget)")
        g.add_argument("--kv-events", action="append", default=[], metavar="ENDPOINT",
                       help="follow this backend's vLLM KV event stream (tcp://HOST:PORT of its "
                            "--kv-events-config zmq publisher, rank 0); repeat once per --backend, in the "
                            "same order; new roots then also go where their prompt's blocks are cached")
        g.add_argument("--placement", default="mars", metavar="RULE",
                       help="where a new root goes over the --backend replicas: mars (most KV budget, plus its "
                            "cached prefix with --kv-events), round-robin, session-hash, least-loaded (fewest "
                            "requests running + waiting); a root's later calls stay on its replica (default mars)")
        g.add_argument("--host", default="127.0.0.1", help="listen address (default 127.0.0.1: local only)")
        g.add_argument("--port", type=int, default=8100, help="listen port (default 8100)")

    g.add_argument("--controller", choices=available_controllers(), default="mars",
                   help="admission controller: mars (KV/CPU-aware AIMD + footprint selection), concur "
                        "(CONCUR AIMD on utilisation/hit rate), none (admit all) (default mars)")
    g.add_argument("--controller-option", action="append", metavar="KEY=VALUE",
                   help="a controller config field, e.g. window_max=16 or kv_target=0.85; repeatable "
                        "(fields: docs/admission.md, or the error message for an unknown one)")
    g.add_argument("--controller-config", metavar="FILE",
                   help="JSON or TOML file of controller config fields (flags override it)")
    g.add_argument("--api-key", action="append", metavar="KEY",
                   help="require 'Authorization: Bearer KEY' from clients (default: $MARS_API_KEY, else none); "
                        "repeat for several clients: each key then has its own workflow ids, so no client can "
                        "finish or join another's workflows (docs/admission.md, trust model)")
    g.add_argument("--backend-api-key", default=None,
                   help="send 'Authorization: Bearer KEY' to the backends (default: pass the client's header; "
                        "mars serve: a key generated per start, which its vLLM server requires)")
    g.add_argument("--max-body-bytes", type=int, default=16 << 20,
                   help="largest request body; larger gets 413 (default 16 MiB)")
    g.add_argument("--idle-timeout", type=float, default=600.0, metavar="S",
                   help="the most a workflow waits without calls before it ends softly and frees its slot; "
                        "the timeout in force is learned from the sessions' return gaps (p95 x 2, at least "
                        "10 s) once 8 were seen (default 600)")
    g.add_argument("--failed-idle-timeout", type=float, default=5.0, metavar="S",
                   help="a workflow whose last call failed ends after S seconds without a call (default 5)")
    g.add_argument("--max-queued-calls", type=int, default=1024, metavar="N",
                   help="calls waiting for admission at once; more get 503 + Retry-After (default 1024)")
    g.add_argument("--max-queued-bytes", type=int, default=1 << 30, metavar="B",
                   help="request body bytes held at once (waiting for admission, or read and parsed: counted "
                        "before parsing, as bytes plus their parsed size); more get 503 (default 1 GiB)")
    g.add_argument("--spill-bytes", type=int, default=64 << 10, metavar="B",
                   help="a waiting call's body above B bytes waits in a file, not in memory (default 64 KiB)")
    g.add_argument("--spill-dir", default=None, metavar="DIR", help="directory for spilled bodies (default: temp)")
    g.add_argument("--header-timeout", type=float, default=10.0, metavar="S",
                   help="a request head must arrive within S seconds, else 408 and close (default 10)")
    g.add_argument("--body-timeout", type=float, default=30.0, metavar="S",
                   help="longest wait between request body chunks, else 408, and longest a client may take no bytes "
                        "of a streamed answer, else the call ends (default 30)")
    g.add_argument("--body-deadline", type=float, default=60.0, metavar="S",
                   help="a whole request body must arrive within S seconds, else 408 (default 60)")
    g.add_argument("--keep-alive", type=float, default=5.0, metavar="S",
                   help="an idle keep-alive client connection is closed after S seconds (default 5)")
    g.add_argument("--max-connections", type=int, default=1000, metavar="N",
                   help="client connections held at once; at the cap an idle keep-alive connection, else the "
                        "slowest request still being sent, makes room; else 503 and close (default 1000)")
    g.add_argument("--telemetry-interval", type=float, default=0.2, metavar="S",
                   help="seconds between /metrics polls of each backend, 0.01..60 (default 0.2)")
    g.add_argument("--telemetry-stale", type=float, default=2.0, metavar="S",
                   help="a backend whose last good reading is older than S is not live (default 2)")
    g.add_argument("--retry-after", type=int, default=2, metavar="S",
                   help="Retry-After seconds sent with 503 when no backend is up (default 2)")
    g.add_argument("--connect-timeout", type=float, default=5.0, metavar="S",
                   help="upstream connect timeout (default 5)")
    g.add_argument("--read-timeout", type=float, default=None, metavar="S",
                   help="upstream timeout between chunks (default none: long prefills are fine)")
    g.add_argument("--backend-wait", type=float, default=300.0, metavar="S",
                   help="an admitted call whose backend is unreachable waits up to S for a live one "
                        "before 503 (default 300)")
    g.add_argument("--default-max-tokens", type=int, default=None, metavar="N",
                   help="output limit for calls that send none (Codex sends none; a model that never stops "
                        "then runs to the context limit); calls that send a limit keep it (default: none)")
    g.add_argument("--events", metavar="PATH", help="append admission events (JSON lines) to PATH")


#: SidecarConfig field -> the flag that sets it (errors name the flag)
_FLAGS = {"max_body_bytes": "--max-body-bytes", "idle_timeout_s": "--idle-timeout",
          "failed_idle_timeout_s": "--failed-idle-timeout", "telemetry_interval_s": "--telemetry-interval",
          "telemetry_stale_s": "--telemetry-stale", "retry_after_s": "--retry-after",
          "connect_timeout_s": "--connect-timeout", "read_timeout_s": "--read-timeout",
          "backend_wait_s": "--backend-wait", "max_queued_calls": "--max-queued-calls",
          "max_queued_bytes": "--max-queued-bytes", "spill_bytes": "--spill-bytes",
          "header_timeout_s": "--header-timeout", "body_timeout_s": "--body-timeout",
          "max_connections": "--max-connections", "body_deadline_s": "--body-deadline",
          "keep_alive_s": "--keep-alive", "port": "--port", "api_key": "--api-key",
          "backend_api_key": "--backend-api-key", "spill_dir": "--spill-dir", "events_path": "--events",
          "default_max_tokens": "--default-max-tokens",
          "backends": "--backend", "kv_events": "--kv-events", "placement": "--placement"}


def _sidecar_config(args: argparse.Namespace, backends: tuple[str, ...], host: str, port: int):
    from vllm_mars.admission.sidecar import SidecarConfig

    options = {**_load_options(args.controller_config, "--controller-config"),
               **_kv(args.controller_option, "--controller-option")}
    keys = args.api_key or ([os.environ["MARS_API_KEY"]] if os.environ.get("MARS_API_KEY") else [])
    try:
        cfg = SidecarConfig(
            backends=backends, controller=args.controller, controller_options=options, host=host, port=port,
            api_key=keys[0] if keys else None, api_keys=tuple(keys[1:]), backend_api_key=args.backend_api_key,
            max_body_bytes=args.max_body_bytes, idle_timeout_s=args.idle_timeout,
            failed_idle_timeout_s=args.failed_idle_timeout, telemetry_interval_s=args.telemetry_interval,
            telemetry_stale_s=args.telemetry_stale, retry_after_s=args.retry_after,
            connect_timeout_s=args.connect_timeout, read_timeout_s=args.read_timeout,
            backend_wait_s=args.backend_wait, events_path=args.events, max_queued_calls=args.max_queued_calls,
            max_queued_bytes=args.max_queued_bytes, spill_bytes=args.spill_bytes, spill_dir=args.spill_dir,
            header_timeout_s=args.header_timeout, body_timeout_s=args.body_timeout,
            max_connections=args.max_connections, body_deadline_s=args.body_deadline, keep_alive_s=args.keep_alive,
            default_max_tokens=args.default_max_tokens, kv_events=tuple(getattr(args, "kv_events", None) or ()),
            placement=getattr(args, "placement", "mars"))
    except ValueError as e:
        msg = str(e)
        for fld, flag in _FLAGS.items():
            msg = msg.replace(f"SidecarConfig.{fld} ", f"{flag} ").replace(f"SidecarConfig.{fld}:", f"{flag}:")
        raise ValueError(msg) from None
    try:
        make_controller(cfg.controller, dict(cfg.controller_options))  # validate before binding the port
    except ValueError as e:
        raise ValueError(f"--controller {cfg.controller} / --controller-option: {e}") from None
    return cfg


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "sidecar", help="admission proxy in front of one or more vLLM OpenAI servers",
        description="Serve /v1/chat/completions, /v1/completions, /v1/responses and /v1/models in front of "
                    "vLLM. The first call of a root workflow waits until the admission controller admits it; "
                    "later turns and child sessions pass. Workflow identity comes from the frontends' own "
                    "headers (OpenHands, OpenCode, Codex, X-MARS-Workflow) and goes to vLLM in vllm_xargs. "
                    "A workflow ends with POST /mars/v1/workflows/{id}/finish, a call with mars_last_step, "
                    "or the idle timeout. Also /health and /metrics (Prometheus).")
    _add_sidecar_options(p, serve=False)
    p.set_defaults(func=_sidecar)


def _sidecar(args: argparse.Namespace) -> int:
    from vllm_mars.admission.sidecar import run_sidecar

    cfg = _sidecar_config(args, tuple(args.backend), args.host, args.port)
    run_sidecar(cfg)
    return 0
