"""`kvstrata route` in front of two replicas: questions on a document go where the document is cached,
and a replica that goes away costs no request.

The replicas are real HTTP servers (the app `kvstrata serve` runs, on loopback ports) around two
engines in this process that share the session's loaded model, each publishing its KV events over
ZMQ; the router is the one `kvstrata route` runs, built by `load_router` from the same config.
"""
from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
import uvicorn

from kvstrata.engine.async_engine import AsyncEngine
from kvstrata.engine.config import ReplicaConfig, load_config
from kvstrata.engine.hashing import BlockNaming
from kvstrata.engine.llm_engine import LLMEngine
from kvstrata.engine.prompts import render_document
from kvstrata.serving.app import build_app
from kvstrata.serving.events import KVEventPublisher
from kvstrata.serving.metrics import ServingMetrics
from kvstrata.serving import router as router_module
from kvstrata.serving.router import (EventFeed, HealthChecks, Replica as RoutedReplica, ReplicaSet, _pass_through,
                                     learn_naming, load_router, prompt_token_ids, replica_line, set_health)
from kvstrata.tiers.block_events import BlockRemoved, BlockStored
from kvstrata.serving.sockets import bind_socket
from kvstrata.serving.tokenizer_pool import TokenizerPool
from server_process import metric_value
from test_kv_events import free_ports

MODEL = "smollm2-135m-instruct"
ENGINE = {"model": {"dtype": "float32", "device": "cpu"},
          "cache": {"tiers": {"device": {"size": 96}, "cpu": {"size": 96}}}}


class HTTPServer:
    """An ASGI app served by uvicorn on a thread, on a given loopback port; stop and start again at will."""

    def __init__(self, app, port: int):
        self.app, self.port = app, port
        self.url = f"http://127.0.0.1:{port}"
        self.start()

    def start(self) -> None:
        sock = bind_socket("127.0.0.1", self.port)
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning", access_log=False, lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "the HTTP server did not start"
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


class Replica:
    """What `kvstrata serve` runs, with KV events, around an engine on the shared loaded model."""

    def __init__(self, loaded):
        http_port, events_port, replay_port = free_ports(3)
        self.config = load_config({**ENGINE, "events": {"endpoint": f"tcp://127.0.0.1:{events_port}",
                                                        "replay_endpoint": f"tcp://127.0.0.1:{replay_port}"}})
        self.publisher = KVEventPublisher(self.config.events)
        engine = LLMEngine(self.config, loaded=loaded, block_events=self.publisher)
        self.tokenizers = TokenizerPool(engine.tokenizer, 1)
        self.async_engine = AsyncEngine(engine)
        metrics = ServingMetrics(lambda: self.async_engine.snapshot, events=self.publisher)
        app = build_app(self.async_engine, MODEL, metrics=metrics,
                        tokenizers=self.tokenizers, max_request_body=1 << 20)
        self.http = HTTPServer(app, http_port)

    @property
    def url(self) -> str:
        return self.http.url

    def close(self) -> None:
        self.http.stop()
        self.tokenizers.close()
        self.async_engine.shutdown()
        self.publisher.close()


@pytest.fixture(scope="module")
def cluster(embedded_model_fp32):
    replicas = [Replica(embedded_model_fp32) for _ in range(2)]
    (router_port,) = free_ports(1)
    config = load_config({**ENGINE, "router": {
        "port": router_port, "health_interval": "1s",
        "replicas": [{"url": r.url, "events": r.config.events.endpoint, "replay": r.config.events.replay_endpoint}
                     for r in replicas]}})
    router = load_router(config)
    front = HTTPServer(router.app, router_port)
    yield replicas, front.url, router
    front.stop()
    router.close()
    for replica in replicas:
        replica.close()


def alike(replicas: ReplicaSet, block_hashes: list[bytes]) -> dict:
    """A prompt's block hashes for each replica, all of them naming blocks alike."""
    return dict.fromkeys(replicas.replicas, block_hashes)


def test_a_batch_of_prompts_is_placed_by_its_first_prompt():
    from serving_fakes import ByteTokenizer

    tokenizer = ByteTokenizer()
    batch = {"prompt": [[1, 2, 3], [1, 2, 4]]}
    assert prompt_token_ids(tokenizer, "/v1/completions", batch) == [1, 2, 3]
    assert prompt_token_ids(tokenizer, "/v1/completions", {"prompt": ["ab", "cd"]}) == [97, 98]
    assert prompt_token_ids(tokenizer, "/v1/completions", {"prompt": [None, "x"]}) is None


def test_the_router_prefers_the_replica_holding_the_prefix_else_the_least_loaded():
    a, b = (RoutedReplica(ReplicaConfig(url=f"http://127.0.0.1:{port}"), None) for port in (1, 2))
    replicas = ReplicaSet([a, b])
    doc = [bytes([i]) for i in range(8)]
    a.index.apply(BlockStored(doc[:1], None, [], 16, "device"))   # the chat template's block, say
    b.index.apply(BlockStored(doc[:6], None, [], 16, "cpu"))
    assert replicas.choose(alike(replicas, doc), set()) == (b, 6)
    b.index.apply(BlockRemoved(doc[2:], "cpu"))  # 2 of 8: not enough to decide; the less loaded wins
    a.in_flight = 1
    assert replicas.choose(alike(replicas, doc), set()) == (b, 2)
    a.in_flight, b.in_flight = 0, 3
    assert replicas.choose(alike(replicas, doc), set()) == (a, 1)
    b.in_flight = 0
    assert {replicas.choose(alike(replicas, doc[6:]), set())[0] for _ in range(2)} == {a, b}  # nobody holds it: in turn
    b.healthy = False
    assert replicas.choose(alike(replicas, doc), set())[0] is a and replicas.choose(alike(replicas, doc), {a})[0] is b
    assert replicas.choose(alike(replicas, doc), {a, b}) == (None, 0)


def test_a_prefix_nobody_holds_in_memory_goes_to_the_replica_holding_it_on_disk():
    """A document a replica wrote down to its disk (or held there before a restart) goes back to it rather than to
    a replica that would load it from the shared remote tier or compute it; but memory comes first: a disk that
    holds every document its replica ever served must not bind them all to it, or a replica back from a restart
    would get none."""
    a, b, c = (RoutedReplica(ReplicaConfig(url=f"http://127.0.0.1:{port}"), None) for port in (1, 2, 3))
    replicas = ReplicaSet([a, b, c])
    doc = [bytes([i]) for i in range(8)]
    b.index.apply(BlockStored(doc, None, [], 16, "disk"))
    b.in_flight = 2  # the least loaded would win if the disk did not count
    assert replicas.choose(alike(replicas, doc), set()) == (b, 8)
    a.index.apply(BlockStored(doc[:6], None, [], 16, "disk"))
    a.in_flight = 0
    assert replicas.choose(alike(replicas, doc), set()) == (b, 8)  # the most of it on a disk
    a.index.apply(BlockStored(doc[6:], None, [], 16, "disk"))
    assert replicas.choose(alike(replicas, doc), set()) == (a, 8)  # as much of it on both disks: the less loaded
    c.in_flight = 3
    c.index.apply(BlockStored(doc[:5], None, [], 16, "device"))
    assert replicas.choose(alike(replicas, doc), set()) == (c, 5)  # enough of it in memory: memory first, disks decide nothing
    b.index.apply(BlockStored(doc[:5], None, [], 16, "cpu"))
    assert replicas.choose(alike(replicas, doc), set()) == (b, 8)  # as much in memory: the longer prefix with the disk's part


def test_a_replica_holding_the_prefix_gives_requests_up_once_it_is_max_load_gap_ahead_of_the_least_loaded():
    """A hot document must not queue every question behind one replica while the others idle."""
    a, b, c = (RoutedReplica(ReplicaConfig(url=f"http://127.0.0.1:{port}"), None) for port in (1, 2, 3))
    replicas = ReplicaSet([a, b, c], max_load_gap=4)
    doc = [bytes([i]) for i in range(8)]
    a.index.apply(BlockStored(doc, None, [], 16, "device"))
    b.index.apply(BlockStored(doc[:5], None, [], 16, "cpu"))
    a.in_flight, b.in_flight, c.in_flight = 3, 0, 0
    assert replicas.choose(alike(replicas, doc), set()) == (a, 8)  # 3 ahead: the prefix still decides
    a.in_flight = 4
    assert replicas.choose(alike(replicas, doc), set()) == (b, 5)  # 4 ahead: the next holder of enough of it
    b.in_flight = 4
    assert replicas.choose(alike(replicas, doc), set()) == (c, 0)  # both holders 4 ahead of c: by load
    c.in_flight = 1
    assert replicas.choose(alike(replicas, doc), set()) == (a, 8)  # c caught up: back to the longest prefix


def test_round_robin_and_random_placement_ignore_the_caches_and_skip_replicas_that_are_out():
    a, b, c = (RoutedReplica(ReplicaConfig(url=f"http://127.0.0.1:{port}"), None) for port in (1, 2, 3))
    doc = [bytes([i]) for i in range(8)]
    a.index.apply(BlockStored(doc, None, [], 16, "device"))
    in_turn = ReplicaSet([a, b, c], policy="round_robin")
    assert [in_turn.choose(alike(in_turn, doc), set())[0] for _ in range(6)] == [a, b, c, a, b, c]
    b.healthy = False
    assert [in_turn.choose(alike(in_turn, doc), set())[0] for _ in range(4)] == [a, c, a, c]
    assert in_turn.choose(alike(in_turn, doc), {a, c})[0] is b  # only the one that is out is left untried
    b.healthy = True
    at_random = ReplicaSet([a, b, c], policy="random")
    chosen = [at_random.choose(alike(at_random, doc), set())[0] for _ in range(300)]
    assert all(60 <= chosen.count(r) <= 140 for r in (a, b, c)), [chosen.count(r) for r in (a, b, c)]
    assert at_random.choose(alike(at_random, doc), {a, b}) == (c, 0)


def test_a_replica_that_never_answers_its_health_check_does_not_delay_taking_out_one_that_died(monkeypatch):
    monkeypatch.setattr(router_module, "HEALTH_TIMEOUT_S", 60.0)  # the hung replica's check outlasts the test
    hung = socket.create_server(("127.0.0.1", 0))  # the kernel accepts its connections; nobody answers them
    (dead_port,) = free_ports(1)  # nothing listens there
    stuck, dead = (RoutedReplica(ReplicaConfig(url=f"http://127.0.0.1:{port}"), None)
                   for port in (hung.getsockname()[1], dead_port))
    checks = HealthChecks(ReplicaSet([stuck, dead]), interval=0.05, model=MODEL)
    try:
        deadline = time.monotonic() + 10
        while dead.healthy:
            assert time.monotonic() < deadline, "the dead replica was not taken out while the other hung"
            time.sleep(0.01)
        assert stuck.healthy  # its check is still waiting for an answer
    finally:
        hung.close()  # the waiting check's connection is reset, so its thread ends at once
        checks.close()


def test_when_no_replica_is_healthy_one_that_refused_is_tried_and_a_hung_one_never():
    """A replica that refused its health check's connection fails a try at once (and may have come back since); a
    hung one takes the connection and answers nothing, so a request sent there would wait its whole timeout."""
    refused, hung = (RoutedReplica(ReplicaConfig(url=f"http://127.0.0.1:{port}"), None) for port in (1, 2))
    replicas = ReplicaSet([refused, hung])
    set_health(refused, False)
    set_health(hung, False, hung=True)
    assert replicas.choose(alike(replicas, []), set())[0] is refused
    assert replicas.choose(alike(replicas, []), {refused}) == (None, 0)
    set_health(hung, True)
    assert not hung.hung and replicas.choose(alike(replicas, []), {refused})[0] is hung


def test_a_health_check_that_times_out_marks_its_replica_hung_and_one_refused_not(monkeypatch):
    monkeypatch.setattr(router_module, "HEALTH_TIMEOUT_S", 0.3)
    silent = socket.create_server(("127.0.0.1", 0))  # the kernel accepts its connections; nobody answers them
    (dead_port,) = free_ports(1)
    stuck, dead = (RoutedReplica(ReplicaConfig(url=f"http://127.0.0.1:{port}"), None)
                   for port in (silent.getsockname()[1], dead_port))
    checks = HealthChecks(ReplicaSet([stuck, dead]), interval=0.05, model=MODEL)
    try:
        deadline = time.monotonic() + 10
        while stuck.healthy or dead.healthy:
            assert time.monotonic() < deadline, "a replica that does not answer was not taken out"
            time.sleep(0.01)
        assert stuck.hung and not dead.hung
    finally:
        silent.close()
        checks.close()


def test_the_routing_policy_is_checked_when_the_config_is_read():
    with pytest.raises(ValueError, match="router.policy"):
        load_config({**ENGINE, "router": {"policy": "least_cost", "replicas": [{"url": "http://127.0.0.1:9"}]}})


@pytest.mark.parametrize("replicas, says", [
    (["http://127.0.0.1:8001", "http://127.0.0.1:8001/"],
     "router.replicas.1.url: 'http://127.0.0.1:8001' is listed twice (replicas 0 and 1)"),
    (["http://127.0.0.1:8001,tcp://127.0.0.1:5557", "http://127.0.0.1:8002,tcp://127.0.0.1:5557"],
     "router.replicas.1.events: 'tcp://127.0.0.1:5557' is listed twice (replicas 0 and 1)"),
])
def test_route_refuses_a_replica_listed_twice_before_it_listens(capsys, replicas, says):
    from kvstrata.cli import main

    assert main(["route", "--port", "0", *(arg for spec in replicas for arg in ("--replica", spec))]) == 2
    assert capsys.readouterr().err == f"kvstrata: error: {says}\n"


def test_route_refuses_a_configured_replica_port_no_server_can_listen_on(tmp_path, capsys):
    from kvstrata.cli import main

    config = tmp_path / "router.yaml"
    config.write_text(json.dumps({**ENGINE, "router": {"port": 0, "replicas": [{"url": "http://127.0.0.1:99999"}]}}))
    assert main(["route", "--config", str(config)]) == 2
    assert capsys.readouterr().err == ("kvstrata: error: router.replicas.0.url: expected http://host:port (port 1 to "
                                       "65535, no user or password), got 'http://127.0.0.1:99999'\n")


class CutStream(httpx.AsyncByteStream):
    """A replica's streamed answer that arrives in `chunks` and then, with `cut`, breaks off as a
    replica that dies mid-answer does."""

    def __init__(self, chunks: list[bytes], cut: bool):
        self.chunks, self.cut = chunks, cut

    async def __aiter__(self):
        for chunk in self.chunks:
            yield chunk
        if self.cut:
            raise httpx.RemoteProtocolError("peer closed connection without sending complete message body")


def passed_through(chunks: list[bytes], cut: bool, content_type: str = "text/event-stream") -> tuple[bytes, RoutedReplica]:
    replica = RoutedReplica(ReplicaConfig(url="http://127.0.0.1:1"), None, in_flight=1)
    upstream = httpx.Response(200, headers={"content-type": content_type}, stream=CutStream(chunks, cut))

    async def collect() -> bytes:
        return b"".join([chunk async for chunk in _pass_through(upstream, replica)])
    return asyncio.run(collect()), replica


def test_a_stream_whose_replica_dies_mid_answer_ends_with_an_error_event_not_half_an_event():
    first = b'data: {"choices": [{"delta": {"content": "A"}}]}\n\n'
    body, replica = passed_through([first[:10], first[10:] + b'data: {"choices": [{"del'], cut=True)
    events = body.decode().split("\n\n")
    assert events[0] == first.decode().strip() and events[-1] == ""
    error = json.loads(events[1][len("data: "):])["error"]
    assert error["type"] == "service_unavailable" and "incomplete" in error["message"]
    assert events[2] == "data: [DONE]" and len(events) == 4
    assert not replica.healthy and replica.in_flight == 0


def test_a_whole_stream_passes_through_unchanged_even_if_the_connection_breaks_after_its_end():
    whole = b'data: {"choices": []}\n\ndata: [DONE]\n\n'
    assert passed_through([whole[:7], whole[7:]], cut=False)[0] == whole
    assert passed_through([whole], cut=True)[0] == whole  # every event arrived: nothing to add
    assert passed_through([b'{"id": 1', b"}"], cut=False, content_type="application/json")[0] == b'{"id": 1}'


def document(name: str) -> str:
    from pydoc_data.topics import topics
    return topics[name][:700]


def ask(base_url: str, doc: str, question: str, **extra) -> httpx.Response:
    body = {"model": MODEL, "max_tokens": 1, "temperature": 0.0,
            "messages": [{"role": "user", "content": f"{doc}\n\nAnswer briefly. {question}"}], **extra}
    response = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=300)
    assert response.status_code == 200, response.text
    return response


def is_document_hit(response: httpx.Response) -> bool:
    """The document came from the replica's device or CPU tier (not just the chat template's first block)."""
    body = response.json()
    by_tier = body["kvstrata"]["cached_tokens_by_tier"]
    return by_tier["device"] + by_tier["cpu"] >= body["usage"]["prompt_tokens"] // 2


def repeated_hit_rate(send, docs: list[str]) -> float:
    """Three questions on each document, interleaved; the share of the repeated ones that were hits."""
    hits = []
    for q, question in enumerate(("What is this about?", "Name one keyword.", "Give an example.")):
        for d, doc in enumerate(docs):
            response = send(q * len(docs) + d, doc, question)
            if q > 0:
                hits.append(is_document_hit(response))
    return sum(hits) / len(hits)


@pytest.mark.slow
def test_repeated_documents_go_to_the_replica_that_holds_them(cluster):
    replicas, router_url, _ = cluster
    round_robin = repeated_hit_rate(lambda i, doc, q: ask(replicas[i % 2].url, doc, q),
                                    [document(name) for name in ("try", "import", "execmodel")])
    routed = repeated_hit_rate(lambda i, doc, q: ask(router_url, doc, q),
                               [document(name) for name in ("for", "while", "with")])
    print(f"repeated-document hits: round robin {round_robin:.0%}, routed {routed:.0%}")
    assert round_robin <= 0.6, round_robin
    assert routed >= 0.9, routed


def sample(metrics_text: str, name: str, **labels: str) -> float:
    """One sample of the router's /metrics (whose labels come sorted by name), 0 when it has none yet."""
    try:
        return metric_value(metrics_text, name, ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())))
    except AssertionError:
        return 0.0


@pytest.mark.slow
def test_the_routers_metrics_count_where_requests_went_what_placed_them_and_how_much_was_held(cluster):
    replicas, router_url, router = cluster
    doc = document("class")
    body = json.dumps({"messages": [{"role": "user", "content": f"{doc}\n\nAnswer briefly. Why?"}]}).encode()
    before = httpx.get(f"{router_url}/metrics", timeout=30).text
    holder = ask(router_url, doc, "Why?").headers["x-kvstrata-replica"]
    held_by = next(r for r in router.replicas.replicas if r.url == holder)
    deadline = time.monotonic() + 30
    while True:  # its KV events reach the router a moment after the answer
        hashes = asyncio.run(router.prompt_hashes("/v1/chat/completions", body))
        if held_by.index.prefix_length(hashes[held_by], ("device", "cpu")) == len(hashes[held_by]):
            break
        assert time.monotonic() < deadline, "the router never learned what the replica holds"
        time.sleep(0.05)
    for _ in range(2):
        assert ask(router_url, doc, "Why?").headers["x-kvstrata-replica"] == holder
    after = httpx.get(f"{router_url}/metrics", timeout=30).text

    def grew(name: str, **labels: str) -> float:
        return sample(after, name, **labels) - sample(before, name, **labels)
    blocks = len(hashes[held_by])
    assert grew("kvstrata_router_requests_total", replica=holder, placement="load") == 1  # nobody held it yet
    assert grew("kvstrata_router_requests_total", replica=holder, placement="prefix") == 2
    assert grew("kvstrata_router_prompt_blocks_total", replica=holder) == 3 * blocks
    # the repeats held all of it; the first, placed by load, at most the chat template's first block
    assert grew("kvstrata_router_prompt_blocks_held_total", replica=holder) - 2 * blocks in (0, 1)
    assert grew("kvstrata_router_placement_seconds_count") == 3
    assert sample(after, "kvstrata_router_refused_total") == 0
    for replica in replicas:
        assert sample(after, "kvstrata_router_replica_healthy", replica=replica.url) == 1
        assert sample(after, "kvstrata_router_replica_matched", replica=replica.url) == 1
    assert sample(after, "kvstrata_router_replica_blocks", replica=holder, tier="device") >= blocks


@pytest.mark.slow
def test_a_replica_counts_its_published_and_dropped_event_batches_in_metrics(cluster):
    replicas, _, _ = cluster
    text = httpx.get(f"{replicas[0].url}/metrics", timeout=30).text
    assert metric_value(text, "kvstrata_kv_events_published_batches_total") > 0
    assert metric_value(text, "kvstrata_kv_events_dropped_total") == 0


@pytest.mark.slow
def test_the_router_hashes_a_prompt_as_the_replicas_do(cluster):
    replicas, _, router = cluster
    engine = replicas[0].async_engine.engine
    messages = [{"role": "user", "content": document("if")}]
    token_ids = prompt_token_ids(router.tokenizer, "/v1/chat/completions", {"messages": messages})
    assert token_ids == engine.apply_chat_template(messages)
    # named as each replica's /health said it names blocks
    body = json.dumps({"messages": messages, "cache_salt": "t"}).encode()
    hashes = asyncio.run(router.prompt_hashes("/v1/chat/completions", body))
    whole = engine.kv_manager.hasher.hash(token_ids, cache_salt="t")
    assert hashes == {r: whole[:(len(token_ids) - 1) // engine.block_size] for r in router.replicas.replicas}
    # Read as the replica reads the request: text parts, an open last message, template variables.
    text = document("if")[:300]
    parts = [{"role": "user", "content": [{"type": "text", "text": text}, {"type": "text", "text": " Why?"}]}]
    whole = [{"role": "user", "content": text + " Why?"}]
    assert prompt_token_ids(router.tokenizer, "/v1/chat/completions", {"messages": parts}) == \
        engine.apply_chat_template(whole)
    rendering = {"add_generation_prompt": False, "continue_final_message": True}
    assert prompt_token_ids(router.tokenizer, "/v1/chat/completions", {"messages": whole, **rendering}) == \
        engine.apply_chat_template(whole, **rendering)
    assert prompt_token_ids(router.tokenizer, "/v1/cache/documents", {"messages": parts}) == \
        render_document(engine.tokenizer, messages=whole).token_ids
    # What the replica will refuse is placed without reading it.
    assert prompt_token_ids(router.tokenizer, "/v1/chat/completions", {"messages": whole, "top_p": "all"}) is None


@pytest.mark.slow
def test_a_streamed_answer_passes_through_the_router(cluster):
    replicas, router_url, _ = cluster
    body = {"model": MODEL, "max_tokens": 4, "temperature": 0.0, "stream": True,
            "messages": [{"role": "user", "content": f"{document('try')}\n\nAnswer briefly. What is this about?"}]}
    with httpx.stream("POST", f"{router_url}/v1/chat/completions", json=body, timeout=300) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        assert response.headers["x-kvstrata-replica"] in [r.url for r in replicas]
        data = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    assert "".join(json.loads(d)["choices"][0]["delta"].get("content") or "" for d in data[:-1] if
                   json.loads(d)["choices"])


@pytest.mark.slow
def test_the_router_serves_every_route_of_the_replicas_api(cluster):
    replicas, router_url, _ = cluster
    models = httpx.get(f"{router_url}/v1/models", timeout=60).json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    tokenized = httpx.post(f"{router_url}/tokenize", json={"prompt": "Hello there"}, timeout=60).json()
    assert tokenized["tokens"] == replicas[0].async_engine.engine.tokenize("Hello there")
    text = httpx.post(f"{router_url}/detokenize", json={"tokens": tokenized["tokens"]}, timeout=60).json()
    assert text == {"prompt": "Hello there"}


@pytest.mark.slow
def test_a_document_cached_through_the_router_draws_its_questions_and_is_listed_and_unpinned_there(cluster, capsys):
    from kvstrata.cli import main

    replicas, router_url, _ = cluster
    doc = document("lambda")
    messages = [{"role": "user", "content": doc}]
    cached = httpx.post(f"{router_url}/v1/cache/documents", json={"messages": messages}, timeout=300)
    assert cached.status_code == 200, cached.text
    holder, document_id = cached.headers["x-kvstrata-replica"], cached.json()["id"]
    answer = httpx.post(f"{router_url}/v1/chat/completions", timeout=300, json={
        "model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": doc + " What is this about?"}]})
    assert answer.headers["x-kvstrata-replica"] == holder
    assert answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= cached.json()["num_cached_tokens"]
    listed = httpx.get(f"{router_url}/v1/cache/documents", timeout=60).json()["data"]
    assert [(d["id"], d["replica"], d["pinned"]) for d in listed] == [(document_id, holder, True)]
    capsys.readouterr()
    assert main(["cache", "documents", "list", "--url", router_url]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith(f"{document_id} ") and f"blocks on {holder}: " in printed
    other = httpx.delete(f"{router_url}/v1/cache/documents/{document_id}%3Fx", timeout=60)  # another id, not a query
    assert other.status_code == 404 and other.json()["error"]["code"] == "document_not_found"
    assert httpx.delete(f"{router_url}/v1/cache/documents/{document_id}", timeout=60).json()["deleted"]
    assert httpx.get(f"{router_url}/v1/cache/documents", timeout=60).json()["data"] == []
    gone = httpx.delete(f"{router_url}/v1/cache/documents/{document_id}", timeout=60)
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "document_not_found"


@pytest.mark.slow
def test_a_prefix_cache_reset_through_the_router_resets_every_replica(cluster):
    replicas, router_url, _ = cluster
    doc = document("global")
    holder = ask(router_url, doc, "What is this about?").headers["x-kvstrata-replica"]
    reset = httpx.post(f"{router_url}/reset_prefix_cache", timeout=60)
    assert reset.status_code == 200 and sorted(reset.json()["replicas"]) == sorted(r.url for r in replicas)
    again = ask(holder, doc, "Name one keyword.").json()["kvstrata"]["cached_tokens_by_tier"]
    assert again["device"] == 0 and again["cpu"] > 0
    everything = httpx.post(f"{router_url}/reset_prefix_cache?reset_external=true", timeout=60)
    assert everything.status_code == 200 and everything.json()["tiers"][:2] == ["device", "cpu"]
    cold = ask(holder, doc, "Name one keyword.").json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cold == 0  # the query reached the replicas: their CPU tiers forgot the document too

    busy, idle = replicas
    body = {"model": MODEL, "prompt": "Count to a hundred:", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{busy.url}/v1/completions", json=body, timeout=300) as stream:
        lines = stream.iter_lines()  # kept: dropping the iterator would close the stream, aborting the request
        next(lines)
        refused = httpx.post(f"{router_url}/reset_prefix_cache", timeout=60)
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "server_busy"
    assert busy.url in refused.json()["error"]["message"] and idle.url not in refused.json()["error"]["message"]
    deadline = time.monotonic() + 60  # the stream closed: its request is aborted, the replica idle again
    while metric_value(httpx.get(f"{busy.url}/metrics", timeout=30).text, "kvstrata_requests_running") != 0:
        assert time.monotonic() < deadline, "the closed stream's request still runs"
        time.sleep(0.1)


def wait_for_health(router_url: str, replica_url: str, healthy: bool) -> None:
    deadline = time.monotonic() + 30
    while httpx.get(f"{router_url}/health", timeout=10).json()["replicas"][replica_url]["healthy"] != healthy:
        assert time.monotonic() < deadline, f"{replica_url} never became {'healthy' if healthy else 'unhealthy'}"
        time.sleep(0.1)


@pytest.mark.slow
def test_the_router_refuses_what_a_replica_would_and_answers_its_own_errors_in_openai_shape(cluster):
    _, router_url, _ = cluster
    # over the replicas' limit: refused before the router reads (and tokenizes) it
    too_large = httpx.post(f"{router_url}/v1/completions", content=b'{"prompt": "' + b"x" * (33 << 20) + b'"}',
                           headers={"content-type": "application/json"}, timeout=60)
    assert too_large.status_code == 413 and too_large.json()["error"]["code"] == "request_too_large"
    # nested deeper than Python parses: the router places it by load, the replica says what is wrong
    deep = b'{"prompt": "x", "stop": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    answer = httpx.post(f"{router_url}/v1/completions", content=deep, headers={"content-type": "application/json"},
                        timeout=60)
    assert answer.status_code == 400 and "error" in answer.json()
    for response, status in ((httpx.get(f"{router_url}/v1/completions", timeout=60), 405),
                             (httpx.get(f"{router_url}/v1/no-such-route", timeout=60), 404)):
        assert response.status_code == status and set(response.json()["error"]) == {"message", "type", "param", "code"}


def test_a_replica_that_goes_away_costs_no_request_and_comes_back(cluster):
    replicas, router_url, _ = cluster
    docs = [document(name) for name in ("assert", "del", "pass", "return")]
    holders = {doc: ask(router_url, doc, "What is this about?").headers["x-kvstrata-replica"] for doc in docs}
    gone = replicas[1]
    assert gone.url in holders.values()
    gone.http.stop()  # connections to it are refused from now on; the router has not noticed yet
    for doc in (document("raise"), document("break")):  # new documents: one of them is tried on it first
        response = ask(router_url, doc, "Name one keyword.")
        assert response.headers["x-kvstrata-replica"] == replicas[0].url
    wait_for_health(router_url, gone.url, healthy=False)
    gone.http.start()
    wait_for_health(router_url, gone.url, healthy=True)
    back = [doc for doc, holder in holders.items() if holder == gone.url][0]
    response = ask(router_url, back, "Give an example.")
    assert response.headers["x-kvstrata-replica"] == gone.url and is_document_hit(response)


class DiesBeforeItsFirstEvent:
    """A replica killed in a stream's prefill, as the client side sees it: it takes the request, answers
    200 with the headers of an event stream, and its connection ends before the first event."""

    def __init__(self):
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.taken = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            with conn:
                request = b""
                while b"\r\n\r\n" not in request:
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    request += chunk
                if request.startswith(b"POST"):
                    self.taken += 1
                    conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                                 b"transfer-encoding: chunked\r\n\r\n")
                # GET /health gets no answer either: the connection just ends

    def close(self) -> None:
        self.listener.close()


class FreezesOnARequest:
    """A replica whose process stops (SIGSTOP, a wedged GPU) once it has taken a request: its health checks are
    answered until then, never after; the request gets the head of an event stream and its first event first
    when `after_first_event`, else nothing at all."""

    def __init__(self, after_first_event: bool = False):
        self.after_first_event = after_first_event
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.taken = 0
        self.frozen = threading.Event()
        self.connections: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.connections.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        buffer = b""
        try:
            while not self.frozen.is_set():
                while b"\r\n\r\n" not in buffer:
                    chunk = conn.recv(65536)
                    if not chunk:
                        return
                    buffer += chunk
                head, _, buffer = buffer.partition(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                while len(buffer) < length:
                    buffer += conn.recv(65536)
                buffer = buffer[length:]
                if self.frozen.is_set():
                    return
                if head.startswith(b"GET /health"):
                    conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}")
                    continue
                self.taken += 1
                self.frozen.set()
                if self.after_first_event:
                    event = b'data: {"choices": [{"index": 0, "delta": {"content": "The"}}]}\n\n'
                    conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                                 b"transfer-encoding: chunked\r\n\r\n" + b"%x\r\n" % len(event) + event + b"\r\n")
        except OSError:
            return

    def close(self) -> None:
        self.listener.close()
        for conn in self.connections:
            conn.close()


@pytest.fixture
def quick_to_give_up(monkeypatch):
    """Health checks that time out after 0.3 s, and requests that give a hung replica up after 1 s of them."""
    monkeypatch.setattr(router_module, "HEALTH_TIMEOUT_S", 0.3)
    monkeypatch.setattr(router_module, "HUNG_ABANDON_S", 1.0)


def routed(replica_urls: list[str]):
    (port,) = free_ports(1)
    router = load_router(load_config({**ENGINE, "router": {
        "policy": "round_robin", "health_interval": "200ms", "request_timeout": "300s",
        "replicas": [{"url": url} for url in replica_urls]}}))
    return router, HTTPServer(router.app, port)


@pytest.mark.slow
def test_a_request_waiting_on_a_replica_that_stops_answering_is_answered_by_another(cluster, quick_to_give_up):
    replicas, _, _ = cluster
    freezing = FreezesOnARequest()
    router, front = routed([freezing.url, replicas[0].url])
    try:
        body = {"model": MODEL, "max_tokens": 4, "temperature": 0.0,
                "messages": [{"role": "user", "content": f"{document('while')}\n\nAnswer briefly. Why?"}]}
        answered = []
        for _ in range(2):  # in turn: one of the two goes to the replica that freezes
            started = time.monotonic()
            response = httpx.post(f"{front.url}/v1/chat/completions", json=body, timeout=300)
            answered.append((response.status_code, response.headers.get("x-kvstrata-replica"),
                             time.monotonic() - started))
        assert freezing.taken == 1
        assert [(status, replica) for status, replica, _ in answered] == [(200, replicas[0].url)] * 2
        assert max(seconds for _, _, seconds in answered) < 60  # not the request timeout's 300 s
        assert router.replicas.replicas[0].hung
    finally:
        front.stop()
        router.close()
        freezing.close()


def test_a_stream_whose_replica_stops_answering_mid_answer_ends_with_an_error_event(quick_to_give_up):
    freezing = FreezesOnARequest(after_first_event=True)
    router, front = routed([freezing.url])
    try:
        body = {"model": MODEL, "max_tokens": 4, "stream": True, "messages": [{"role": "user", "content": "Hi"}]}
        started = time.monotonic()
        with httpx.stream("POST", f"{front.url}/v1/chat/completions", json=body, timeout=300) as response:
            assert response.status_code == 200
            data = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
        assert time.monotonic() - started < 60
        assert json.loads(data[0])["choices"][0]["delta"]["content"] == "The"
        error = json.loads(data[1])["error"]["message"]
        assert error == f"replica {freezing.url} stopped answering mid-answer; the answer is incomplete"
        assert data[2:] == ["[DONE]"]
        assert sample(router.metrics.render().decode(), "kvstrata_router_streams_cut_total", replica=freezing.url) == 1
    finally:
        front.stop()
        router.close()
        freezing.close()


@pytest.mark.slow
def test_a_stream_whose_replica_dies_before_its_first_event_is_answered_whole_by_another(cluster):
    replicas, _, _ = cluster
    dying = DiesBeforeItsFirstEvent()
    (port,) = free_ports(1)
    router = load_router(load_config({**ENGINE, "router": {
        "policy": "round_robin", "health_interval": "60s",  # so that only the request finds out it died
        "replicas": [{"url": dying.url}, {"url": replicas[0].url}]}}))
    front = HTTPServer(router.app, port)
    try:
        deadline = time.monotonic() + 30
        while router.replicas.replicas[0].healthy:  # the first health check has found it out ...
            assert time.monotonic() < deadline
            time.sleep(0.05)
        router.replicas.replicas[0].healthy = True  # ... but it died after it: the request is the first to try it
        body = {"model": MODEL, "max_tokens": 4, "temperature": 0.0, "stream": True,
                "messages": [{"role": "user", "content": f"{document('try')}\n\nAnswer briefly. Why?"}]}
        with httpx.stream("POST", f"{front.url}/v1/chat/completions", json=body, timeout=300) as response:
            assert response.status_code == 200
            assert response.headers["x-kvstrata-replica"] == replicas[0].url
            data = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
        assert dying.taken == 1
        assert sample(router.metrics.render().decode(), "kvstrata_router_failovers_total", replica=dying.url,
                      reason="died_before_first_event") == 1
        assert data[-1] == "[DONE]" and not any("error" in json.loads(d) for d in data[:-1])
        assert "".join(c["delta"].get("content") or "" for d in data[:-1] for c in json.loads(d)["choices"])
        assert not router.replicas.replicas[0].healthy
    finally:
        front.stop()
        router.close()
        dying.close()


@pytest.mark.slow
def test_the_router_names_a_prompts_blocks_as_each_replica_resolved_its_settings(embedded_model_fp32):
    """The router resolves none of a replica's `auto` settings itself (the batch-invariant mode, the attention
    backend it names, the block size): each replica's /health answer says how it names blocks, so the router's
    hashes are each replica's own, even where two replicas name blocks otherwise."""
    urls = [{"url": "http://127.0.0.1:9"}, {"url": "http://127.0.0.1:10"}]  # nothing answers there: fed by hand
    router = load_router(load_config({"router": {"replicas": urls}}))  # no dtype, mode or cache settings at all
    first, second = router.replicas.replicas
    messages = [{"role": "user", "content": document("if")}]
    body = json.dumps({"messages": messages, "cache_salt": "t"}).encode()
    settings = [{"model": {}, "cache": {}},  # batch_invariant: auto, as this CPU resolves it
                {"model": {"batch_invariant": True, "attention_backend": "torch"}, "cache": {}},
                {"model": {"batch_invariant": False}, "cache": {"block_size": 32}}]
    namings, named = [], []
    try:
        for setting in settings:
            config = load_config({"model": {**ENGINE["model"], **setting["model"]},
                                  "cache": {**ENGINE["cache"], **setting["cache"]}})
            engine = LLMEngine(config, embedded_model_fp32)
            try:
                learn_naming(first, {"status": "ok", "block_naming": engine.block_naming.to_json()}, router.model)
                hashes = asyncio.run(router.prompt_hashes("/v1/chat/completions", body))
                token_ids = engine.apply_chat_template(messages)
                hittable = (len(token_ids) - 1) // config.cache.block_size  # the last token is always computed
                assert hashes[first] == engine.kv_manager.hasher.hash(token_ids, cache_salt="t")[:hittable]
                assert second not in hashes  # it never answered: matched by nothing
                namings.append(engine.block_naming)
                named.append(hashes[first])
            finally:
                engine.close()
        assert len(set(namings)) == len(set(map(tuple, named))) == len(settings)  # each names other blocks
        learn_naming(second, {"status": "ok", "block_naming": namings[0].to_json()}, router.model)
        hashes = asyncio.run(router.prompt_hashes("/v1/chat/completions", body))
        assert hashes == {first: named[-1], second: named[0]}  # one prompt, each replica's names
    finally:
        router.close()


def test_a_replica_serving_another_model_or_naming_no_blocks_gets_requests_by_load_said_once(caplog):
    ours = BlockNaming("smollm2@xxh3_128:01", b"namespace", 16, "xxh3_128")
    replica = RoutedReplica(ReplicaConfig(url="http://127.0.0.1:1"), None)
    learn_naming(replica, {"status": "ok", "block_naming": ours.to_json()}, ours.model)
    assert replica.naming == ours and replica.naming_problem is None
    other_model = {"block_naming": {**ours.to_json(), "model": "llama@xxh3_128:02"}}
    answers = [other_model, other_model, other_model, {"status": "ok"}, "ok",
               {"block_naming": {**ours.to_json(), "namespace": "not hex"}},
               {"block_naming": {**ours.to_json(), "block_size": 0}},
               {"block_naming": {**ours.to_json(), "hash": "md5"}}]
    with caplog.at_level("WARNING", logger="kvstrata"):
        for answer in answers:
            learn_naming(replica, answer, ours.model)
            assert replica.naming is None
    said = [r.getMessage() for r in caplog.records]
    assert said[0] == ("router: replica http://127.0.0.1:1: it serves llama@xxh3_128:02, while the router renders "
                       "prompts for smollm2@xxh3_128:01: no prompt is matched to its cache, it gets requests by load")
    assert len(said) == len(answers) - 3  # the same reason again is not said again
    assert "gives no block naming" in said[1]
    assert all("gives a block naming the router cannot read" in line for line in said[2:])
    learn_naming(replica, {"block_naming": ours.to_json()}, ours.model)  # a replica restarted with the right model
    assert replica.naming == ours and replica.naming_problem is None


def test_the_routers_banner_says_for_each_replica_whether_its_cache_is_matched():
    ours = BlockNaming("smollm2@xxh3_128:01", b"namespace", 16, "xxh3_128")
    matched, other, silent = (RoutedReplica(ReplicaConfig(url=f"http://127.0.0.1:{port}", events=events), None)
                              for port, events in ((1, "tcp://127.0.0.1:5557"), (2, None), (3, None)))
    learn_naming(matched, {"block_naming": ours.to_json()}, ours.model)
    learn_naming(other, {"block_naming": {**ours.to_json(), "model": "llama@xxh3_128:02"}}, ours.model)
    assert replica_line(matched) == "  http://127.0.0.1:1  events: tcp://127.0.0.1:5557; cache matched (16-token blocks)"
    assert replica_line(other) == ("  http://127.0.0.1:2  events: none (routed by load); routed by load: it serves "
                                   "llama@xxh3_128:02, while the router renders prompts for smollm2@xxh3_128:01")
    assert replica_line(silent) == ("  http://127.0.0.1:3  events: none (routed by load); not answering yet: routed by "
                                    "load until it does")


def test_the_router_starts_without_importing_torch(embedded_model_fp32):
    """A router needs a model's tokenizer and identity, never its weights: it starts in a process without torch
    (whose import is seconds and hundreds of MB), once the tokenizer's copy is converted (as the fixture has)."""
    script = ("import sys\n"
              "from kvstrata.engine.config import load_config\n"
              "from kvstrata.serving.router import load_router\n"
              "router = load_router(load_config({'router': {'replicas': [{'url': 'http://127.0.0.1:9'}]}}))\n"
              "router.close()\n"
              "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_an_event_feed_with_no_replica_publishing_events_waits_without_spinning():
    """Replicas listed without `events`: the feed's thread has no socket to poll, and a poll of none returns at
    once; it must wait for close, not take a core (it once did, slowing whatever ran beside the router)."""
    replicas = ReplicaSet([RoutedReplica(ReplicaConfig(url="http://127.0.0.1:9"), None)])
    feed = EventFeed(replicas)
    try:
        start = time.process_time()
        time.sleep(0.5)
        assert time.process_time() - start < 0.2, "the event thread spins"
        assert feed._thread.is_alive()
    finally:
        feed.close()
    assert not feed._thread.is_alive()
