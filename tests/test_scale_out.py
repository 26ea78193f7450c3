"""Beyond one server (issue 33): per-rank placement and vLLM KV events as a telemetry source.

The CPU build of vLLM cannot run data parallel, so the multi-rank /metrics page is canned here in
vLLM 0.32's format (every per-engine series labelled ``engine="<rank>"``, one
``vllm:cache_config_info`` row per engine) and served by a real TCP server; the rank header is
checked on what that server receives and on a real vLLM server (which accepts rank 0). The KV
event tests run against a real vLLM CPU server started with ``--kv-events-config`` (zmq).
"""

from __future__ import annotations

import math
import time

import httpx
import pytest
from conftest import ServerProcess, free_port
from faulty_backend import FaultyBackend
from vllm_mars.admission.kv_events import BlockIndex, KVEventSubscriber
from vllm_mars.admission.placement import Backend, Placement
from vllm_mars.admission.sidecar import SidecarConfig, SidecarThread
from vllm_mars.admission.telemetry import (
    HttpTelemetry,
    TelemetryState,
    metric_engines,
    parse_prometheus,
    telemetry_from_metrics,
)


def two_rank_page(usage0: float, usage1: float) -> str:
    """A /metrics page of one server with two data-parallel engines (vLLM 0.32's labels)."""
    rows = ["# TYPE vllm:kv_cache_usage_perc gauge"]
    for e, u in (("0", usage0), ("1", usage1)):
        rows.append(f'vllm:kv_cache_usage_perc{{engine="{e}",model_name="tiny"}} {u}')
    rows.append("# TYPE vllm:cache_config_info gauge")
    for e in ("0", "1"):
        rows.append(f'vllm:cache_config_info{{block_size="16",engine="{e}",num_gpu_blocks="1001"}} 1.0')
    for e, (run, wait) in (("0", (3, 1)), ("1", (5, 0))):
        rows.append(f'vllm:num_requests_running{{engine="{e}",model_name="tiny"}} {run}')
        rows.append(f'vllm:num_requests_waiting{{engine="{e}",model_name="tiny"}} {wait}')
        rows.append(f'vllm:prefix_cache_queries_total{{engine="{e}",model_name="tiny"}} 0.0')
        rows.append(f'vllm:prefix_cache_hits_total{{engine="{e}",model_name="tiny"}} 0.0')
    return "\n".join(rows) + "\n"


def test_per_rank_parse_of_a_two_engine_page():
    m = parse_prometheus(two_rank_page(0.1, 0.6))
    assert metric_engines(m) == ["0", "1"]
    whole, _ = telemetry_from_metrics(m, 0.0)
    r0, _ = telemetry_from_metrics(m, 0.0, engine="0")
    r1, _ = telemetry_from_metrics(m, 0.0, engine="1")
    assert (r0.total_blocks, r1.total_blocks, whole.total_blocks) == (1000, 1000, 2000)
    assert (r0.free_blocks, r1.free_blocks) == (900, 400)
    assert (r0.running, r0.waiting, r1.running, r1.waiting) == (3, 1, 5, 0)
    assert whole.free_blocks == 1300 and whole.running == 8
    with pytest.raises(ValueError, match='engine="7"'):
        telemetry_from_metrics(m, 0.0, engine="7")


def test_one_server_with_two_ranks_is_two_backends_pinned_by_header():
    """Roots go to the rank with the most budget and every call of a root carries its rank."""
    with FaultyBackend(free_port()) as fb:
        fb.metrics = two_rank_page(0.2, 0.05)  # rank 1 has more room
        cfg = SidecarConfig(backends=(fb.url,), controller="none", port=free_port(), telemetry_interval_s=0.05)
        with SidecarThread(cfg) as sc:
            s = sc.app
            assert [b.name for b in s.backends] == [fb.url + "#0", fb.url + "#1"]
            assert len(s.placement.servers) == 1
            body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}

            def call(root):
                r = httpx.post(sc.url + "/v1/chat/completions", json=body, headers={"X-MARS-Workflow": root},
                               timeout=30)
                assert r.status_code == 200, r.text
                return fb.post_headers[-1].get("x-data-parallel-rank")

            assert call("A") == "1"
            fb.metrics = two_rank_page(0.2, 0.95)  # rank 1 fills up: the next root goes to rank 0
            deadline = time.monotonic() + 5
            while s.backends[1].telemetry.last.free_blocks > 100 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert call("B") == "0"
            assert [call("A") for _ in range(3)] == ["1"] * 3  # A stays on its rank
            assert s.admission is not None and s.admission.backends == s.backends  # a controller per rank
            assert s.admission.backend_of("A") is s.backends[1] and s.admission.backend_of("B") is s.backends[0]
            assert call("B") == "0"
            page = httpx.get(sc.url + "/metrics", timeout=10).text
            assert f'mars_backend_roots{{backend="{fb.url}#1"}} 1' in page
            assert f'mars_backend_roots{{backend="{fb.url}#0"}} 1' in page


def test_one_engine_server_stays_one_backend_without_rank_header():
    with FaultyBackend(free_port()) as fb:
        cfg = SidecarConfig(backends=(fb.url,), controller="none", port=free_port())
        with SidecarThread(cfg) as sc:
            assert [b.name for b in sc.app.backends] == [fb.url]
            assert sc.app.admission is None  # one backend: the controller reads it, as before
            r = httpx.post(sc.url + "/v1/chat/completions", headers={"X-MARS-Workflow": "W"}, timeout=30,
                           json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 200
            assert "x-data-parallel-rank" not in fb.post_headers[-1]


def test_rank_backend_goes_down_with_its_server():
    tel = HttpTelemetry("http://127.0.0.1:9")
    tel._ingest(two_rank_page(0.1, 0.2), tel.clock.now())
    server = Backend("http://127.0.0.1:9")
    server.telemetry = tel
    r1 = Backend(server.url, rank_of=server, rank="1")
    assert r1.refresh() and r1.telemetry.budget_blocks() == 800 - 100
    tel._fail("connection refused")
    assert not r1.refresh() and r1.telemetry.status().state is TelemetryState.FAILED
    assert r1.telemetry.budget_blocks() == -math.inf


def test_kv_events_config_validation():
    with pytest.raises(ValueError, match="one endpoint per backend"):
        SidecarConfig(backends=("http://a:1", "http://b:1"), kv_events=("tcp://a:5557",))
    with pytest.raises(ValueError, match="bind wildcard"):
        SidecarConfig(backends=("http://a:1",), kv_events=("tcp://*:5557",))
    with pytest.raises(ValueError, match="tcp://"):
        KVEventSubscriber("http://a:1")


# -- the block index on vLLM's own event classes ------------------------------------------------

def _stored(hashes, parent, tokens, bs=4, medium="GPU", **kw):
    from vllm.distributed.kv_events import BlockStored

    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=bs,
                       lora_id=None, medium=medium, lora_name=None, **kw)


def _batch(*events):
    from vllm.distributed.kv_events import KVEventBatch

    return KVEventBatch(ts=time.time(), events=list(events))


def test_block_index_follows_store_remove_clear_and_restart():
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved

    idx = BlockIndex()
    toks = list(range(12))
    idx.apply(_batch(_stored([b"h1", b"h2"], None, toks[:8])), seq=0)
    idx.apply(_batch(_stored([b"h3"], b"h2", toks[8:12])), seq=1)
    assert len(idx) == 3 and idx.prefix_blocks(toks + [99, 98]) == 3
    assert idx.prefix_blocks([0, 1, 2, 3, 7, 7, 7, 7]) == 1  # diverges in block 2
    assert idx.prefix_blocks(toks[4:]) == 0  # same tokens, different place in the prefix
    idx.apply(_batch(BlockRemoved(block_hashes=[b"h2"], medium="GPU")), seq=2)
    assert idx.prefix_blocks(toks) == 1  # a hole ends the usable prefix
    idx.apply(_batch(_stored([b"x"], b"unknown-parent", [1, 2, 3, 4])), seq=5)
    assert idx.gaps == 1 and len(idx) == 3  # held, but not matchable
    idx.apply(_batch(_stored([b"salted"], None, [5, 5, 5, 5], extra_keys=[("salt",)])), seq=6)
    assert idx.prefix_blocks([5, 5, 5, 5]) == 0
    idx.apply(_batch(_stored([b"cpu"], None, [6, 6, 6, 6], medium="CPU")), seq=7)  # an offload tier
    assert idx.prefix_blocks([6, 6, 6, 6]) == 0 and len(idx) == 4
    idx.apply(_batch(AllBlocksCleared()), seq=8)
    assert len(idx) == 0 and idx.prefix_blocks(toks) == 0
    idx.apply(_batch(_stored([b"h1"], None, toks[:4])), seq=9)
    idx.apply(_batch(_stored([b"z"], None, [9, 9, 9, 9])), seq=0)  # the server restarted
    assert len(idx) == 1 and idx.prefix_blocks(toks) == 0 and idx.prefix_blocks([9, 9, 9, 9]) == 1


def test_placement_counts_cached_prefix_as_budget():
    """Equal budgets: the backend holding the prompt's blocks wins; a big enough budget gap
    still beats the cache (a cached block saves one block, no more)."""
    a, b = Backend("http://127.0.0.1:9"), Backend("http://127.0.0.1:10")
    for be, usage in ((a, 0.5), (b, 0.5)):
        be.telemetry._ingest(two_rank_page(usage, usage).replace('engine="1"', 'engine="0"'), be.telemetry.clock.now())
        be.refresh()
    toks = list(range(64))
    b.telemetry.cache = BlockIndex()
    b.telemetry.cache.apply(_batch(_stored([f"h{i}".encode() for i in range(4)], None, toks[:16])), seq=0)
    p = Placement([a, b], controller=None)
    assert p.score(b, toks) - p.score(a, toks) == 4
    assert p.place("R", toks) is b
    assert p.place("R2") is a  # no tokens: budget, then fewer roots
    a.telemetry._ingest(two_rank_page(0.3, 0.3).replace('engine="1"', 'engine="0"'), a.telemetry.clock.now())
    assert p.place("R3", toks) is a


# -- a real vLLM CPU server publishing KV events -------------------------------------------------

@pytest.fixture(scope="module")
def events_server(tiny_model, tmp_path_factory):
    zport = free_port()
    server = ServerProcess(tiny_model, tmp_path_factory.mktemp("kvev"), policy="fcfs", num_blocks=64,
                           max_model_len=512, max_num_seqs=4,
                           kv_events_config={"enable_kv_cache_events": True, "publisher": "zmq",
                                             "endpoint": f"tcp://*:{zport}", "topic": "kv"})
    try:
        server.wait_ready()
        server.kv_endpoint = f"tcp://127.0.0.1:{zport}"
        yield server
    finally:
        server.stop()


def _tokens(server, prompt):
    r = httpx.post(server.url + "/tokenize", json={"model": "tiny", "prompt": prompt}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def _wait(pred, timeout=20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.05)
    return pred()


def _until_events(server, idx, timeout=90.0):
    """A SUB socket sees only what is published after it has connected (ZMQ's slow joiner, slow on
    a loaded box): send distinct short prompts until this index has seen a batch."""
    deadline = time.monotonic() + timeout
    i = 0
    while idx.batches == 0 and time.monotonic() < deadline:
        i += 1
        r = httpx.post(server.url + "/v1/completions", timeout=120,
                       json={"model": "tiny", "prompt": f"sync {i} " * 30, "max_tokens": 1})
        assert r.status_code == 200, r.text
        _wait(lambda: idx.batches > 0, 1.0)
    assert idx.batches > 0, "no KV event batch arrived"


def test_real_server_events_fill_the_index(events_server):
    sub = KVEventSubscriber(events_server.kv_endpoint).start()
    try:
        idx = sub.indexes[0]
        _until_events(events_server, idx)
        prompt = "the quick brown fox jumps over the lazy dog " * 12
        toks = _tokens(events_server, prompt)
        r = httpx.post(events_server.url + "/v1/completions", timeout=120,
                       json={"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200, r.text
        assert _wait(lambda: idx.prefix_blocks(toks) > 0), (len(idx), idx.batches, sub.decode_errors)
        assert idx.block_size and idx.prefix_blocks(toks) == len(toks) // idx.block_size
        assert idx.prefix_blocks(_tokens(events_server, "completely different words " * 12)) == 0
        assert sub.decode_errors == 0
    finally:
        sub.close()


def test_sidecar_kv_events_flag_reports_cached_blocks(events_server):
    cfg = SidecarConfig(backends=(events_server.url,), controller="none", port=free_port(),
                        kv_events=(events_server.kv_endpoint,), telemetry_interval_s=0.1)
    with SidecarThread(cfg) as sc:
        b = sc.app.backends[0]
        assert b.telemetry.cache is not None
        _until_events(events_server, b.telemetry.cache)
        before = b.telemetry.cache.stored
        r = httpx.post(sc.url + "/v1/completions", headers={"X-MARS-Workflow": "kv-1"}, timeout=120,
                       json={"model": "tiny", "prompt": "a sidecar that follows events " * 10, "max_tokens": 2})
        assert r.status_code == 200, r.text
        assert _wait(lambda: b.telemetry.cache.stored > before)
        page = httpx.get(sc.url + "/metrics", timeout=10).text
        line = next(x for x in page.splitlines() if x.startswith("mars_backend_cached_blocks"))
        assert int(line.split()[-1]) > 0


def test_real_server_accepts_the_rank_header(events_server):
    """A rank backend's calls carry ``X-data-parallel-rank``; a one-engine vLLM server serves rank 0."""
    server = Backend(events_server.url)
    server.telemetry.poll()
    r0 = Backend(server.url, rank_of=server, rank="0")
    assert r0.rank_headers == [(b"x-data-parallel-rank", b"0")]
    r = httpx.post(events_server.url + "/v1/completions", timeout=120,
                   headers={k.decode(): v.decode() for k, v in r0.rank_headers},
                   json={"model": "tiny", "prompt": "rank pinned", "max_tokens": 2})
    assert r.status_code == 200, r.text


def test_sidecar_places_a_new_root_where_its_prefix_is_cached(events_server):
    """Two backends: the real server A (events followed) and a fake F with 3 more free blocks. A
    new root whose prompt A has cached goes to A; one with a fresh prompt goes to F (budget)."""
    page = parse_prometheus(httpx.get(events_server.url + "/metrics", timeout=10).text)
    blocks = int(page["vllm:cache_config_info"][0][0]["num_gpu_blocks"])
    with FaultyBackend(free_port()) as fb:
        fb.metrics = ('vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.0\n'
                      f'vllm:cache_config_info{{block_size="32",engine="0",num_gpu_blocks="{blocks + 3}"}} 1.0\n')
        cfg = SidecarConfig(backends=(events_server.url, fb.url), controller="none", port=free_port(),
                            kv_events=(events_server.kv_endpoint, f"tcp://127.0.0.1:{free_port()}"),
                            telemetry_interval_s=0.1)
        with SidecarThread(cfg) as sc:
            a = sc.app.backends[0]
            _until_events(events_server, a.telemetry.cache)
            warm = {"model": "tiny", "max_tokens": 2, "temperature": 0,
                    "messages": [{"role": "user", "content": "cached context for placement " * 20}]}
            assert httpx.post(events_server.url + "/v1/chat/completions", json=warm, timeout=120).status_code == 200
            assert _wait(lambda: a.telemetry.cache.stored >= 4)
            assert _wait(lambda: a.up and a.telemetry.last.free_blocks >= blocks - 2)  # the warm call's blocks are free again

            def root_backend(root, body):
                r = httpx.post(sc.url + "/v1/chat/completions", json=body, headers={"X-MARS-Workflow": root},
                               timeout=120)
                assert r.status_code == 200, r.text
                return sc.app.roots[root].backend

            fresh = {**warm, "messages": [{"role": "user", "content": "nothing like it anywhere " * 20}]}
            assert root_backend("fresh", fresh) is sc.app.backends[1]  # budget alone: F
            assert root_backend("cached", warm) is a  # the cached prefix outweighs F's 3 blocks
            assert sc.app._root_tokens == {}
