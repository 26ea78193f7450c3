"""The key that closes the vLLM server behind ``mars serve`` to everyone but its sidecar.

``mars serve`` starts vLLM on 127.0.0.1 with a key it generates per start (or ``--backend-api-key``),
passed in the environment (never on a command line that ``ps`` shows): vLLM's own ``--api-key``
check (``VLLM_API_KEY``) guards its ``/v1`` routes, and :class:`BackendGuard`, loaded with vLLM's
``--middleware``, guards every other route that can run the model (SageMaker's ``/invocations``,
``/inference``, ``/pooling``, ...). Only ``GET`` on ``/health``, ``/ping``, ``/version`` and
``/metrics`` stay open (the sidecar's telemetry and readiness checks; they run nothing). A client
that finds the engine port therefore cannot bypass admission or forge ``vllm_xargs``.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from typing import Any

#: environment variable that carries the key into the vLLM server process
KEY_ENV = "MARS_BACKEND_KEY"
#: the routes left open, GET only
OPEN_PATHS = frozenset({"/health", "/ping", "/version", "/metrics"})
MIDDLEWARE = "vllm_mars.admission.backend_guard.BackendGuard"


class BackendGuard:
    """ASGI middleware: ``Authorization: Bearer <$MARS_BACKEND_KEY>`` on every route but the open
    ones (401 otherwise). Fails closed: without the key in the environment the server does not start."""

    def __init__(self, app: Any) -> None:
        key = os.environ.get(KEY_ENV)
        if not key:
            raise RuntimeError(f"BackendGuard: ${KEY_ENV} is not set; refusing to serve unguarded")
        self.app = app
        self._digest = hashlib.sha256(key.encode()).digest()

    def _allowed(self, scope: dict) -> bool:
        if scope.get("method") == "GET" and scope.get("path") in OPEN_PATHS:
            return True
        for k, v in scope.get("headers", ()):
            if k == b"authorization" and v[:7].lower() == b"bearer ":
                return hmac.compare_digest(hashlib.sha256(v[7:].strip()).digest(), self._digest)
        return False

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] in ("http", "websocket") and not self._allowed(scope):
            if scope["type"] == "websocket":
                await send({"type": "websocket.close", "code": 1008})
                return
            body = b'{"error": "Unauthorized: this vLLM server serves only its mars sidecar"}'
            await send({"type": "http.response.start", "status": 401,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})
            return
        await self.app(scope, receive, send)
