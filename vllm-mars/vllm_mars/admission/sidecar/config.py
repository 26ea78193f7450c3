"""The sidecar's configuration: :class:`SidecarConfig` (``mars sidecar`` flags map 1:1 onto its
fields; the flags themselves are parsed in :mod:`vllm_mars.commands.admission`), checked once at
start by the one options validator (ranges) and against the file system (paths)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from vllm_mars.admission.placement import check_placement
from vllm_mars.options import check_value

#: (lowest, highest) of each numeric option; None: unbounded on that side. Checked by one function.
RANGES: dict[str, tuple[float | None, float | None]] = {
    "port": (1, 65535),
    "max_body_bytes": (1, None),
    "idle_timeout_s": (0.001, None),
    "failed_idle_timeout_s": (0.0, None),
    "telemetry_interval_s": (0.01, 60.0),
    "telemetry_timeout_s": (0.01, None),
    "telemetry_stale_s": (0.01, None),
    "retry_after_s": (0, 86_400),
    "connect_timeout_s": (0.001, None),
    "read_timeout_s": (0.001, None),
    "backend_wait_s": (0.0, None),
    "kv_target": (0.1, 0.999),
    "max_queued_calls": (1, None),
    "max_queued_bytes": (1, None),
    "spill_bytes": (0, None),
    "header_timeout_s": (0.01, None),
    "body_timeout_s": (0.01, None),
    "max_header_bytes": (1024, None),
    "max_connections": (1, None),
    "body_deadline_s": (0.01, None),
    "keep_alive_s": (0.1, 3600.0),
    "default_max_tokens": (1, None),
}


@dataclass(frozen=True)
class SidecarConfig:
    """Everything the sidecar reads at start (``mars sidecar`` flags map 1:1 onto these)."""

    #: Base URLs of the vLLM OpenAI servers, e.g. ``http://127.0.0.1:8000``.
    backends: tuple[str, ...]
    #: Admission controller: a registered name (``mars``, ``concur``, ``none``).
    controller: str = "mars"
    #: The controller's config fields (see ``MarsAdmissionConfig`` / ``ConcurConfig``).
    controller_options: Mapping[str, Any] = field(default_factory=dict)
    #: Listen address; 127.0.0.1 by default (not exposed to the network unless asked).
    host: str = "127.0.0.1"
    #: Listen port.
    port: int = 8100
    #: If set, clients must send ``Authorization: Bearer <api_key>`` (except on /health).
    api_key: str | None = None
    #: More accepted keys; with two or more keys in all, workflows are scoped to the key that sent them.
    api_keys: tuple[str, ...] = ()
    #: If set, sent upstream as ``Authorization: Bearer <backend_api_key>``; else the client's header passes.
    backend_api_key: str | None = None
    #: Largest accepted request body; larger -> 413.
    max_body_bytes: int = 16 << 20
    #: A workflow with no call for this long ends (seconds).
    idle_timeout_s: float = 600.0
    #: A workflow whose last call failed ends after this long without a call (seconds).
    failed_idle_timeout_s: float = 5.0
    #: Seconds between /metrics polls of each backend.
    telemetry_interval_s: float = 0.2
    #: Timeout of one /metrics poll (s).
    telemetry_timeout_s: float = 2.0
    #: A backend whose last good reading is older than this counts as stale (s).
    telemetry_stale_s: float = 2.0
    #: ``Retry-After`` seconds sent with 503.
    retry_after_s: int = 2
    #: Upstream connect timeout (s).
    connect_timeout_s: float = 5.0
    #: Upstream read timeout between chunks (s); None: no limit (long prefills).
    read_timeout_s: float | None = None
    #: Append admission events as JSON lines here (None: keep no log).
    events_path: str | None = None
    #: How long an admitted call waits for a live backend when its own cannot be connected to (s).
    backend_wait_s: float = 300.0
    #: Guard-margin target used to rank backends for new roots (None: the controller's ``kv_target``, else 0.9).
    kv_target: float | None = None
    #: Calls allowed to wait for admission at once; more -> 503 + Retry-After.
    max_queued_calls: int = 1024
    #: Body bytes allowed to wait for admission at once; more -> 503 + Retry-After.
    max_queued_bytes: int = 1 << 30
    #: A waiting call's body larger than this is kept in a file, not in memory.
    spill_bytes: int = 64 << 10
    #: Directory for spilled bodies (None: the system temp directory).
    spill_dir: str | None = None
    #: A request head must arrive within this many seconds (else 408, connection closed).
    header_timeout_s: float = 10.0
    #: Largest request head (bytes; else 431, connection closed).
    max_header_bytes: int = 64 << 10
    #: Longest wait between two chunks of a request body (s; else 408), and the longest a client may
    #: take no bytes of a streamed answer while its socket is full (s; else the call ends, connection reset).
    body_timeout_s: float = 30.0
    #: Client connections held at once; at the cap an idle keep-alive connection, else the slowest
    #: request still sending its head or body, makes room; otherwise 503 and closed.
    max_connections: int = 1000
    #: A whole request body must arrive within this many seconds of its head (s; else 408).
    body_deadline_s: float = 60.0
    #: Seconds an idle keep-alive client connection is kept open.
    keep_alive_s: float = 5.0
    #: The output limit a call that sends none gets (chat/completions ``max_tokens``, Responses
    #: ``max_output_tokens``); calls that send a limit keep theirs. None: the server's (context left).
    default_max_tokens: int | None = None
    #: Where a new root goes: ``mars`` (most KV budget + cached prefix), ``round-robin``,
    #: ``session-hash``, ``least-loaded`` (:mod:`~vllm_mars.admission.placement`).
    placement: str = "mars"
    #: KV event streams to follow, one per backend in order (``tcp://HOST:PORT`` of the server's
    #: ``--kv-events-config`` publisher, rank 0); empty: /metrics only.
    kv_events: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.backends:
            raise ValueError("SidecarConfig.backends: give at least one backend URL (--backend)")
        for b in self.backends:
            if not b.startswith(("http://", "https://")):
                raise ValueError(f"SidecarConfig.backends: {b!r} must start with http:// or https://")
        if len(set(self.backends)) != len(self.backends):
            raise ValueError(f"SidecarConfig.backends: duplicate URL in {list(self.backends)}")
        check_placement(self.placement, "SidecarConfig.placement")
        if self.kv_events and len(self.kv_events) != len(self.backends):
            raise ValueError(f"SidecarConfig.kv_events: give one endpoint per backend ({len(self.backends)}), "
                             f"got {len(self.kv_events)}")
        for ep in self.kv_events:
            if not ep.startswith(("tcp://", "ipc://")) or "*" in ep:
                raise ValueError(f"SidecarConfig.kv_events: {ep!r} must be tcp://HOST:PORT or ipc://PATH "
                                 "(the server's address, not a bind wildcard)")
        given = ([] if self.api_key is None else [self.api_key]) + list(self.api_keys)
        for k in given:  # an empty key must not mean "no authentication"
            if not k or any(c.isspace() or not c.isprintable() for c in k):
                raise ValueError("SidecarConfig.api_key: an API key must be non-empty, printable and without "
                                 "spaces")
        b = self.backend_api_key
        if b is not None and (not b or any(c.isspace() or not c.isprintable() for c in b)):
            raise ValueError("SidecarConfig.backend_api_key: must be non-empty, printable and without spaces")
        check_ranges(self, RANGES)
        check_paths(self.spill_dir, self.events_path)

    @property
    def keys(self) -> tuple[str, ...]:
        """Every accepted API key (empty: no authentication)."""
        return ((self.api_key,) if self.api_key else ()) + tuple(self.api_keys)



def check_ranges(obj: Any, ranges: Mapping[str, tuple[float | None, float | None]]) -> None:
    """Range-check the named numeric fields of a config dataclass with the one options validator
    (:func:`vllm_mars.options.check_value`: type, finite, range); ValueError naming the field."""
    types = {f.name: f.type for f in fields(obj)}
    for name, (lo, hi) in ranges.items():
        check_value(f"{type(obj).__name__}.{name}", types[name], getattr(obj, name), minimum=lo, maximum=hi)


def check_paths(spill_dir: str | None, events_path: str | None) -> None:
    """The file options, checked at start (not at the first call that needs them)."""
    if spill_dir is not None:
        if not os.path.isdir(spill_dir):
            raise ValueError(f"SidecarConfig.spill_dir: {spill_dir!r} is not a directory")
        if not os.access(spill_dir, os.W_OK | os.X_OK):
            raise ValueError(f"SidecarConfig.spill_dir: {spill_dir!r} is not writable")
    if events_path is not None:
        if os.path.isdir(events_path):
            raise ValueError(f"SidecarConfig.events_path: {events_path!r} is a directory")
        parent = os.path.dirname(os.path.abspath(events_path))
        if not (os.access(events_path, os.W_OK) if os.path.exists(events_path)
                else os.path.isdir(parent) and os.access(parent, os.W_OK | os.X_OK)):
            raise ValueError(f"SidecarConfig.events_path: cannot write {events_path!r}")


def config_dict(cfg: SidecarConfig) -> dict:
    return asdict(cfg)
