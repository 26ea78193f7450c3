"""A real TCP server that misbehaves on purpose: the upstream faults a real vLLM server cannot be
made to produce on demand (close before the response head, a truncated body, a status outside the
HTTP table). ``GET /metrics`` answers a well-formed vLLM page so the sidecar sees it as up; a
``POST`` behaves as its ``X-Fault`` header says: ``close`` (read the request, close without a
byte), ``truncate`` (a 200 JSON head with Content-Length 100, 10 body bytes, close), ``status999``
(a complete answer with status 999), ``finish`` (a chat completion that calls the ``finish`` tool), ``hang`` (no answer until
the caller hangs up),
anything else a valid chat completion.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Self

METRICS = (
    "# TYPE vllm:kv_cache_usage_perc gauge\n"
    'vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.1\n'
    "# TYPE vllm:cache_config_info gauge\n"
    'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="1001"} 1.0\n'
    'vllm:prefix_cache_queries_total{engine="0",model_name="tiny"} 0.0\n'
    'vllm:prefix_cache_hits_total{engine="0",model_name="tiny"} 0.0\n'
)
MODELS = '{"object": "list", "data": [{"id": "tiny", "object": "model"}]}'
#: an answer that calls the ``finish`` tool (how an OpenHands conversation ends), as vLLM writes it
FINISH_BODY = (b'{"id":"f","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant",'
               b'"content":null,"tool_calls":[{"id":"c1","type":"function","function":{"name":"finish",'
               b'"arguments":"{\\"message\\": \\"done\\"}"}}]},"finish_reason":"tool_calls"}],'
               b'"usage":{"prompt_tokens":3,"completion_tokens":5,"total_tokens":8}}')
OK_BODY = (b'{"id":"x","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant",'
           b'"content":"hi"},"finish_reason":"stop"}],"usage":{"prompt_tokens":3,"completion_tokens":1,'
           b'"total_tokens":4}}')


class LoopServer:
    """A TCP server on its own thread and event loop, as a context manager. A subclass defines
    ``_handle`` (adding each writer to ``_writers`` while it serves); leaving the context closes the
    port and aborts every open connection, like a killed process."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._server: asyncio.base_events.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        raise NotImplementedError

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", self.port))
        self._ready.set()
        self._loop.run_forever()

    def __enter__(self) -> Self:
        self._thread.start()
        self._ready.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        async def stop() -> None:
            assert self._server is not None
            self._server.close()
            for w in list(self._writers):
                w.transport.abort()

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)


class FaultyBackend(LoopServer):
    """Runs on its own thread and event loop; ``posts`` counts POST requests received."""

    def __init__(self, port: int) -> None:
        super().__init__(port)
        self.posts = 0
        #: each POST's headers (lower-case names), in arrival order
        self.post_headers: list[dict[str, str]] = []
        #: the /metrics page served (a test may replace it)
        self.metrics = METRICS

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, path = lines[0].split(" ")[:2]
                hdrs = {k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:] if x)}
                n = int(hdrs.get("content-length", "0"))
                if n:
                    await reader.readexactly(n)
                if method == "GET" and path in ("/metrics", "/v1/models"):
                    body = (self.metrics if path == "/metrics" else MODELS).encode()
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: "
                                 + str(len(body)).encode() + b"\r\n\r\n" + body)
                    await writer.drain()
                    continue
                self.posts += 1
                self.post_headers.append(hdrs)
                fault = hdrs.get("x-fault", "")
                if fault == "close":
                    break
                if fault == "hang":  # never answers; ends when the caller hangs up
                    await reader.read()
                    break
                if fault == "truncate":
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n"
                                 + OK_BODY[:10])
                    await writer.drain()
                    break
                status = b"999 Strange" if fault == "status999" else b"200 OK"
                body = FINISH_BODY if fault == "finish" else OK_BODY
                writer.write(b"HTTP/1.1 " + status + b"\r\ncontent-type: application/json\r\ncontent-length: "
                             + str(len(body)).encode() + b"\r\n\r\n" + body)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self._writers.discard(writer)
            writer.close()
