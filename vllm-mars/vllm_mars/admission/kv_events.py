"""vLLM's KV cache events as a telemetry source: which blocks each replica holds.

A vLLM server started with ``--kv-events-config '{"enable_kv_cache_events": true, "publisher":
"zmq", "endpoint": "tcp://*:5557"}'`` publishes, per data-parallel rank (rank r on port 5557 + r),
ZMQ multipart messages ``(topic, seq, payload)``: ``seq`` an 8-byte big-endian counter, ``payload``
a msgpack :class:`vllm.distributed.kv_events.KVEventBatch` of ``BlockStored`` / ``BlockRemoved`` /
``AllBlocksCleared`` events. :class:`KVEventSubscriber` follows those streams (vLLM's own classes
decode them) and keeps one :class:`BlockIndex` per rank; the index hangs on that replica's reader
(``reader.cache``) so :class:`~vllm_mars.admission.placement.Placement` can score a new root by
the prompt blocks a replica already holds. Budget (free blocks) still comes from /metrics: events
carry cache content, not the pool's size or the blocks of running requests.

Matching a prompt: vLLM's block hashes depend on its hash function and seed, which a client
cannot reproduce. Each ``BlockStored`` also carries the blocks' token ids and parent hash, so the
index keys every block by its own chain over token ids (a block's key = hash of its parent's key
and its tokens) and a prompt's token ids are looked up with the same chain. Blocks stored with
extra keys (LoRA, multimodal, cache salt) or under an unknown parent are held but not matchable.

Missed messages (a gap in ``seq``) are counted; a ``seq`` that goes back (the server restarted)
clears the index. An index whose stream is silent is still trusted for what it last saw; a
server that is down is not placed on anyway (its /metrics reading goes stale).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

logger = logging.getLogger(__name__)

_ROOT = 0x6D617273  # chain key of the empty prefix


def _chain(parent: int, tokens: Sequence[int]) -> int:
    return hash((parent, tuple(tokens)))


class BlockIndex:
    """The KV blocks one replica (a server, or one data-parallel rank) holds, from its events."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._key_of: dict[Any, int | None] = {}  # vLLM block hash -> our token-chain key (None: not matchable)
        self._keys: dict[int, int] = {}  # token-chain key -> how many held blocks have it
        self.block_size: int | None = None
        self.batches = 0
        self.stored = 0
        self.removed = 0
        self.cleared = 0
        self.gaps = 0
        self.last_seq: int | None = None
        self.last_ts: float | None = None

    def __len__(self) -> int:
        return len(self._key_of)

    def apply(self, batch: Any, seq: int | None = None) -> None:
        """Apply one decoded ``KVEventBatch`` (``seq``: its stream sequence number)."""
        from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

        with self._lock:
            if seq is not None:
                if self.last_seq is not None and seq <= self.last_seq:
                    logger.info("KV event stream restarted (seq %d after %d): index cleared", seq, self.last_seq)
                    self._clear()
                elif self.last_seq is not None and seq > self.last_seq + 1:
                    self.gaps += 1
                self.last_seq = seq
            self.batches += 1
            self.last_ts = batch.ts
            for ev in batch.events:
                if isinstance(ev, BlockStored):
                    if ev.medium not in (None, "GPU"):
                        continue  # an offload tier, not this replica's KV pool
                    self._store(ev)
                elif isinstance(ev, BlockRemoved):
                    if ev.medium not in (None, "GPU"):
                        continue
                    for h in ev.block_hashes:
                        self._drop(h)
                elif isinstance(ev, AllBlocksCleared):
                    self._clear()
                    self.cleared += 1

    def _store(self, ev: Any) -> None:
        bs = ev.block_size
        self.block_size = bs
        parent = _ROOT if ev.parent_block_hash is None else self._key_of.get(ev.parent_block_hash)
        toks = ev.token_ids
        extra = ev.extra_keys
        for i, h in enumerate(ev.block_hashes):
            key = None
            chunk = toks[i * bs:(i + 1) * bs]
            if parent is not None and len(chunk) == bs and not (extra and i < len(extra) and extra[i]):
                key = _chain(parent, chunk)
            if h in self._key_of:
                self._drop(h)
            self._key_of[h] = key
            if key is not None:
                self._keys[key] = self._keys.get(key, 0) + 1
            parent = key
            self.stored += 1

    def _drop(self, h: Any) -> None:
        if h not in self._key_of:
            return
        key = self._key_of.pop(h)
        self.removed += 1
        if key is not None:
            n = self._keys[key] - 1
            if n:
                self._keys[key] = n
            else:
                del self._keys[key]

    def _clear(self) -> None:
        self._key_of.clear()
        self._keys.clear()

    def prefix_blocks(self, tokens: Sequence[int]) -> int:
        """How many leading full blocks of ``tokens`` this replica holds (0 before any event)."""
        bs = self.block_size
        if not bs:
            return 0
        n, key = 0, _ROOT
        with self._lock:
            for i in range(len(tokens) // bs):
                key = _chain(key, tokens[i * bs:(i + 1) * bs])
                if key not in self._keys:
                    break
                n += 1
        return n


def rank_endpoint(endpoint: str, rank: int) -> str:
    """The endpoint rank ``rank`` publishes on (vLLM offsets the port by the rank)."""
    from vllm.distributed.kv_events import ZmqEventPublisher

    out = ZmqEventPublisher.offset_endpoint_port(endpoint, rank)
    assert out is not None
    return out


class KVEventSubscriber:
    """Follows one server's KV event streams (one per data-parallel rank) on a background thread.

    ``endpoint``: where the server publishes, as a subscriber reaches it (``tcp://HOST:PORT``, the
    port of rank 0). ``indexes[r]`` is rank r's :class:`BlockIndex`. ``close()`` stops the thread.
    """

    def __init__(self, endpoint: str, ranks: int = 1, topic: str = "") -> None:
        if not endpoint.startswith(("tcp://", "ipc://", "inproc://")):
            raise ValueError(f"KV events endpoint must be tcp://HOST:PORT (or ipc://, inproc://), got {endpoint!r}")
        if "*" in endpoint:
            raise ValueError(f"KV events endpoint {endpoint!r}: give the server's address, not a bind wildcard")
        if ranks < 1:
            raise ValueError(f"ranks must be >= 1, got {ranks}")
        self.endpoint = endpoint
        self.topic = topic.encode()
        self.indexes = [BlockIndex() for _ in range(ranks)]
        self.decode_errors = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()

    def start(self) -> KVEventSubscriber:
        self._thread = threading.Thread(target=self._run, name=f"mars-kv-events-{self.endpoint}", daemon=True)
        self._thread.start()
        self._ready.wait(5.0)
        return self

    def _run(self) -> None:
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        decoder = msgspec.msgpack.Decoder(KVEventBatch)
        ctx = zmq.Context.instance()
        socks = []
        poller = zmq.Poller()
        try:
            for r in range(len(self.indexes)):
                s = ctx.socket(zmq.SUB)
                s.setsockopt(zmq.LINGER, 0)
                s.connect(rank_endpoint(self.endpoint, r))
                s.setsockopt(zmq.SUBSCRIBE, self.topic)
                poller.register(s, zmq.POLLIN)
                socks.append(s)
            self._ready.set()
            while not self._stop.is_set():
                for s, _ in poller.poll(100):
                    r = socks.index(s)
                    while True:
                        try:
                            frames = s.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._on_message(r, frames, decoder)
        except Exception:  # never take the sidecar down; placement falls back to budget only
            logger.exception("KV event subscriber for %s stopped", self.endpoint)
        finally:
            self._ready.set()
            for s in socks:
                s.close(0)

    def _on_message(self, rank: int, frames: list[bytes], decoder: Any) -> None:
        import msgspec

        if len(frames) != 3:
            self.decode_errors += 1
            return
        _, seq, payload = frames
        try:
            batch = decoder.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError):  # a foreign or newer publisher
            self.decode_errors += 1
            if self.decode_errors == 1:
                logger.warning("undecodable KV event batch from %s (counted, logged once)", self.endpoint)
            return
        self.indexes[rank].apply(batch, int.from_bytes(seq, "big", signed=True))  # each rank has its own port

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2.0)
