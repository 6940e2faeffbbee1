"""`kvstrata route`: one OpenAI-compatible address in front of several `kvstrata serve` replicas,
sending each request to the replica that already holds the longest prefix of its prompt.

How a request is placed:

1. The router follows every replica's KV events (serving/events.py) into one `BlockIndex` per
   replica: which block hashes each holds in each tier.
2. It renders and tokenizes the prompt as the replicas do (engine/prompts.py, the same tokenizer
   and chat template) and hashes it as each replica names its blocks (`cache_salt` too). Each replica's
   `/health` answer gives its `BlockNaming` (the namespace its model, dtype, modes and hash make, the
   block size and the algorithm), so the router never guesses how a replica resolved its `auto`
   settings. A replica serving another model than the router's (its prompts would be other tokens), or
   not yet answering, is matched by nothing: it gets requests by load, and the first is said in one line.
3. Among the healthy replicas, the one holding the most leading blocks in its device or CPU tier
   (`MEMORY_MEDIA`) wins; where none holds enough of it there, the one holding the most in its own
   tiers, disk included (`LOCAL_MEDIA`): read from its disk, a prefix costs less than any other
   replica would pay to load it from the shared remote tier, and far less than computing it (the
   cluster benchmark reports the TTFT of each source). A replica restarted on its disk store names
   what the store holds in its first events (tiers/disk.py), so its documents come back to it once
   nobody holds them in memory. The winner must hold at least `MIN_HELD_SHARE` of the prompt's
   blocks: every replica that has answered anything holds the chat template's first block, and that
   alone must not draw every new document to one replica. Ties, and prompts nobody holds enough
   of, go to the replica with the fewest requests in flight (then in turn). Affinity is bounded:
   when the holder has `router.max_load_gap` or more requests in flight beyond the least loaded
   candidate, the request goes by load instead, so a hot document does not queue every question
   behind one replica while others idle (SGLang's router guards its cache-aware policy the same
   way). `router.policy: round_robin` or `random` places requests without looking at the caches:
   a plain load balancer, and the baselines prefix placement is measured against.
4. The request is forwarded as it came (body, API key) and the answer passed back as it comes,
   streams included, with an `x-kvstrata-replica` header naming the replica. A replica that cannot
   be reached, or answers 502/503/504, is tried no more for this request: the next best one is.

Documents (`/v1/cache/documents`): caching one is placed as a request is (its questions then follow it
to the replica that holds it); the list is every replica's, each document naming its `replica`; unpinning
goes to every replica (a document's id is the same on all). `POST /reset_prefix_cache` resets every
replica's device cache, or with `?reset_external=true` every tier of each (409 naming the replicas still
busy, 503 one with a tier it could not clear; the others are reset).

`GET /metrics` (Prometheus, serving/router_metrics.py) counts the requests each replica got and what placed them,
the share of their prompts it held, the failovers, cut streams and refusals, and shows each replica's state.

A health check (`GET /health` every `router.health_interval`) takes a replica out when it fails and
puts it back when it answers again; then the router rebuilds that replica's index from its replay
buffer, since a replica that restarted holds other blocks (and numbers its events from 0 again).
A replica that took the health check's connection but did not answer in time (a hung process) is not tried
at all while it is out: a request would wait its whole timeout there. One that refused the connection may
still be tried when no healthy replica is left (the check may lag its recovery, and the try fails at once).
Bodies the router cannot read are forwarded all the same, by load: the replica answers the error. A body
over `server.max_request_body` is refused with 413 before it is read, as a replica would refuse it.
A stream's first event is read before anything is sent to the client, so a replica that dies before it
(in the prompt's prefill) is replaced as one that cannot be reached is. One that dies later, in the
middle of a streamed answer, cannot be (what was sent cannot be taken back): the stream ends with an
error event saying so, then `data: [DONE]`, never a half event. A replica that stops answering (its health
checks time out, one after another, for HUNG_ABANDON_S) is given up on by the requests waiting there too: one
that has sent the client nothing yet goes to another replica, a stream under way ends with the error event,
instead of each waiting out `router.request_timeout`.
"""
from __future__ import annotations

import asyncio
import itertools
import json
import logging
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator
from urllib.parse import quote

import httpx
import uvicorn
import zmq
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvstrata import __version__
from kvstrata.engine.config import Config, ReplicaConfig
from kvstrata.engine.hashing import BlockNaming
from kvstrata.engine.prompts import render_chat, render_document, tokenize_text
from kvstrata.serving.errors import install_error_handlers
from kvstrata.serving.events import BlockIndex, KVEventSubscriber, ReceivedBatch
from kvstrata.serving.middleware import BodySizeLimit
from kvstrata.serving.router_metrics import RouterMetrics, RoutingCounts
from kvstrata.serving.schemas import ChatCompletionRequest, DocumentRequest, message_dicts
from kvstrata.serving.sockets import bind_socket, listen
from kvstrata.serving.tokenizer_pool import TokenizerPool

logger = logging.getLogger("kvstrata")

MEMORY_MEDIA = ("device", "cpu")
LOCAL_MEDIA = MEMORY_MEDIA + ("disk",)  # a replica's own tiers; the remote one every replica shares
MIN_HELD_SHARE = 0.5  # of a prompt's cacheable blocks, for a replica's prefix to decide where the prompt goes
RETRY_STATUSES = frozenset({502, 503, 504})
HEALTH_TIMEOUT_S = 2.0
# How long a replica's health checks must have gone unanswered before the requests waiting on it give up: long
# enough that a replica merely slow to answer one check (a long step holding its event loop) keeps its requests.
HUNG_ABANDON_S = 10.0
HUNG_POLL_S = 0.25  # how often a waiting request looks at its replica's health
EVENT_POLL_MS = 100
FORWARDED_HEADERS = ("authorization", "content-type", "accept")
# The replicas' routes the router serves: the prompts of the first two are placed by their cached
# prefix, the rest go by load.
DOCUMENTS_PATH = "/v1/cache/documents"
# Sent to one replica, chosen by the prompt's cached prefix (a document: where it is cached already, else the
# least loaded; its questions follow it there).
FORWARDED_ROUTES = (("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
                    ("POST", "/tokenize"), ("POST", "/detokenize"), ("POST", DOCUMENTS_PATH))
SSE_SEPARATOR = b"\n\n"  # between server-sent events, as the replicas write them
SSE_DONE = b"data: [DONE]\n\n"
PLACEMENT = {"prefix": "by the prefixes they hold", "round_robin": "in turn (router.policy: round_robin)",
             "random": "at random (router.policy: random)"}


@dataclass(eq=False)
class Replica:
    config: ReplicaConfig
    subscriber: KVEventSubscriber | None
    index: BlockIndex = field(default_factory=BlockIndex)
    healthy: bool = True        # until a health check says otherwise (a request that fails says so too)
    hung: bool = False          # out because it did not answer in time (it took the connection): not tried at all
    hung_since: float | None = None  # monotonic time of the first of the health checks it has not answered since
    in_flight: int = 0          # requests forwarded and not yet answered in full
    needs_resync: bool = True   # the index is to be rebuilt from the replica's replay buffer
    naming: BlockNaming | None = None  # how it names blocks, from its last /health answer; None: matched by nothing
    naming_problem: str | None = None  # why it has none, once it has answered (another model, say)
    counts: RoutingCounts = field(default_factory=RoutingCounts)  # what the router did with its requests (/metrics)

    @property
    def url(self) -> str:
        return self.config.url

    def hung_for(self) -> float:
        """Seconds since its health checks stopped being answered (0 while they are)."""
        return 0.0 if self.hung_since is None else time.monotonic() - self.hung_since


class ReplicaHung(Exception):
    """The replica a request waits on has not answered its health checks for HUNG_ABANDON_S."""


async def _unless_hung(replica: Replica, awaitable):
    """What `awaitable` gives, unless `replica` stays hung for HUNG_ABANDON_S first: then ReplicaHung, and the
    wait is cancelled (as it is if the caller is)."""
    task = asyncio.ensure_future(awaitable)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=HUNG_POLL_S)
            if done:
                return task.result()
            if replica.hung_for() >= HUNG_ABANDON_S:
                raise ReplicaHung(replica.url)
    finally:
        if not task.done():
            task.cancel()


class ReplicaSet:
    """The replicas, their indexes and their load; `choose` is the routing policy: `prefix` (placement by
    the cached prefix, bounded by load), or `round_robin` and `random`, which ignore the caches."""

    def __init__(self, replicas: list[Replica], max_load_gap: int = 16, policy: str = "prefix"):
        self.replicas = replicas
        self.max_load_gap = max_load_gap
        self.policy = policy
        self.lock = threading.Lock()  # the event thread writes the indexes while requests read them
        self._turn = itertools.count()
        self._random = random.Random()
        self._next = 0  # round robin's next replica

    def choose(self, block_hashes: dict[Replica, list[bytes]], tried: set[Replica]) -> tuple[Replica | None, int]:
        """The replica for a request whose prompt has `block_hashes[replica]` as each replica names its blocks
        (none for a replica missing there), and how many of them it holds in `LOCAL_MEDIA`. Untried healthy
        replicas first; when none is left, untried unhealthy ones that refused a connection (a health check may
        lag a recovery, and such a try fails at once), never a hung one (it takes the connection and answers
        nothing: the request would wait its whole timeout). None when no replica is left to try."""
        untried = [r for r in self.replicas if r not in tried]
        candidates = [r for r in untried if r.healthy] or [r for r in untried if not r.hung]
        if not candidates:
            return None, 0
        hashes = {r: block_hashes.get(r, []) for r in candidates}
        enough = {r: MIN_HELD_SHARE * len(hashes[r]) for r in candidates}
        with self.lock:
            held = {r: r.index.prefix_length(hashes[r], LOCAL_MEDIA) for r in candidates}
            # the memory part of a prefix too short to decide decides nothing: looked up only for the others
            in_memory = {r: r.index.prefix_length(hashes[r], MEMORY_MEDIA) if held[r] >= enough[r] else 0
                         for r in candidates} if self.policy == "prefix" else {}
        if self.policy == "random":
            best = self._random.choice(candidates)
            return best, held[best]
        if self.policy == "round_robin":  # the next candidate after the last one chosen: one out skips no other's turn
            n = len(self.replicas)
            best = min(candidates, key=lambda r: (self.replicas.index(r) - self._next) % n)
            self._next = (self.replicas.index(best) + 1) % n
            return best, held[best]
        least_loaded = min(r.in_flight for r in candidates)

        def worth(length: int, replica: Replica) -> int:
            """A held prefix long enough to decide, held by a replica not too far ahead of the least loaded."""
            return length if length >= enough[replica] and replica.in_flight - least_loaded < self.max_load_gap else 0

        turn = next(self._turn)
        order = {r: (i - turn) % len(self.replicas) for i, r in enumerate(self.replicas)}
        # Memory first: where some replica holds enough of the prompt in memory, the disks decide nothing (its
        # holder keeps it; a disk that held every document a replica ever served would otherwise bind them to it
        # for good, and a replica back from a restart would get none); where none does, its own disk draws it.
        best = max(candidates, key=lambda r: (worth(in_memory[r], r), worth(held[r], r), -r.in_flight, -order[r]))
        return best, held[best]

    def placed_by(self, replica: Replica, held: int, block_hashes: dict[Replica, list[bytes]]) -> str:
        """What placed a request `choose` sent to `replica` holding `held` of its blocks: "prefix" when that was
        enough to decide, else "load" (or the blind policy's name)."""
        if self.policy != "prefix":
            return self.policy
        num_blocks = len(block_hashes.get(replica, ()))
        return "prefix" if num_blocks and held >= MIN_HELD_SHARE * num_blocks else "load"

    def apply(self, replica: Replica, batches: list[ReceivedBatch], reset: bool = False) -> None:
        with self.lock:
            if reset:
                replica.index.clear()
            for batch in batches:
                for event in batch.events:
                    replica.index.apply(event)


class EventFeed:
    """A thread that keeps each replica's index current from its KV events."""

    def __init__(self, replicas: ReplicaSet):
        self.replicas = replicas
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvstrata-router-events", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        subscribed = [r for r in self.replicas.replicas if r.subscriber is not None]
        if not subscribed:  # no replica publishes events: a poll of no sockets returns at once, so it would spin
            self._stopping.wait()
            return
        poller = zmq.Poller()
        for replica in subscribed:
            poller.register(replica.subscriber.socket, zmq.POLLIN)
        while not self._stopping.is_set():
            for replica in subscribed:
                if replica.needs_resync and replica.healthy:
                    replica.needs_resync = False
                    self.replicas.apply(replica, replica.subscriber.resync(), reset=True)
            ready = dict(poller.poll(EVENT_POLL_MS))
            for replica in subscribed:
                if replica.subscriber.socket in ready:
                    self.replicas.apply(replica, replica.subscriber.poll(0))

    def close(self) -> None:
        self._stopping.set()
        self._thread.join(5)
        if not self._thread.is_alive():
            for replica in self.replicas.replicas:
                if replica.subscriber is not None:
                    replica.subscriber.close()


class HealthChecks:
    """A thread per replica that asks its `/health` every `interval` seconds, and takes the block naming it answers
    (`learn_naming`). Each replica has its own, so one that takes the whole HEALTH_TIMEOUT_S to answer (a hung
    process, a lost network) delays no other's check: a replica that died beside it is still taken out within the
    interval."""

    def __init__(self, replicas: ReplicaSet, interval: float, model: str):
        self.interval = interval
        self.model = model
        self._stopping = threading.Event()
        self._checked_once = [threading.Event() for _ in replicas.replicas]
        self._threads = [threading.Thread(target=self._run, args=(replica, checked), name=f"kvstrata-router-health-{i}",
                                          daemon=True)
                         for i, (replica, checked) in enumerate(zip(replicas.replicas, self._checked_once))]
        for thread in self._threads:
            thread.start()

    def wait_first_round(self) -> None:
        """Until every replica's first check has ended (its naming learned, or it found out), at most a check's
        timeout: a router that starts with its replicas up places its first requests by their caches too."""
        deadline = time.monotonic() + HEALTH_TIMEOUT_S + 1
        for checked in self._checked_once:
            checked.wait(max(0.0, deadline - time.monotonic()))

    def _run(self, replica: Replica, checked_once: threading.Event) -> None:
        with httpx.Client(timeout=HEALTH_TIMEOUT_S) as client:
            while not self._stopping.is_set():
                hung = False
                try:
                    answer = client.get(f"{replica.url}/health")
                    ok = answer.status_code == 200
                except httpx.HTTPError as exc:
                    ok, hung = False, isinstance(exc, httpx.TimeoutException)
                if ok:  # before it is back in: a replica restarted with other settings names its blocks otherwise
                    learn_naming(replica, _json_or_none(answer), self.model)
                set_health(replica, ok, hung)
                checked_once.set()
                self._stopping.wait(self.interval)

    def close(self) -> None:
        self._stopping.set()
        deadline = time.monotonic() + HEALTH_TIMEOUT_S + self.interval
        for thread in self._threads:  # they stop side by side: a check in flight ends within its timeout
            thread.join(max(0.0, deadline - time.monotonic()))


def set_health(replica: Replica, ok: bool, hung: bool = False) -> None:
    replica.hung = not ok and hung
    if not replica.hung:
        replica.hung_since = None
    elif replica.hung_since is None:  # the check began its wait a timeout ago
        replica.hung_since = time.monotonic() - HEALTH_TIMEOUT_S
    if ok == replica.healthy:
        return
    replica.healthy = ok
    if ok:
        replica.needs_resync = True  # it may have restarted: what it holds now, its replay buffer says
    logger.warning("router: replica %s is %s", replica.url, "back" if ok else "out (unreachable or unhealthy)")


def learn_naming(replica: Replica, health: Any, model: str) -> None:
    """Take the block naming in a replica's `/health` answer. A replica serving another model than the router's
    (`model`, its identity), or whose answer names none the router can read, is matched by nothing (it gets
    requests by load), said in one line when that starts or its reason changes."""
    given = health.get("block_naming") if isinstance(health, dict) else None
    try:
        naming = BlockNaming.from_json(given)
        problem = None if naming.model == model else \
            f"it serves {naming.model}, while the router renders prompts for {model}"
    except ValueError as exc:
        problem = "its /health answer gives no block naming (a kvstrata older than the router's?)" if given is None \
            else f"its /health answer gives a block naming the router cannot read ({exc})"
    if problem is not None and problem != replica.naming_problem:
        logger.warning("router: replica %s: %s: no prompt is matched to its cache, it gets requests by load",
                       replica.url, problem)
    replica.naming, replica.naming_problem = (None, problem) if problem else (naming, None)


def _json_or_none(answer: httpx.Response) -> Any:
    try:
        return answer.json()
    except ValueError:
        return None


def prompt_token_ids(tokenizer, path: str, payload: Any) -> list[int] | None:
    """The prompt's token ids as the replica will compute them, or None when the body is not one the
    router can read (the replica will say what is wrong with it). A batch of prompts goes where its
    first would: a batch is mostly one document's questions or answers (an evaluation harness's)."""
    try:
        # Chats and documents are read with the replicas' own request schemas, so that their content
        # parts and rendering fields give the tokens the replica will compute.
        if path == "/v1/chat/completions":
            chat = ChatCompletionRequest.model_validate(payload)
            return render_chat(tokenizer, message_dicts(chat.messages), **chat.rendering)
        if path == DOCUMENTS_PATH:
            document = DocumentRequest.model_validate(payload)
            messages = None if document.messages is None else message_dicts(document.messages)
            return render_document(tokenizer, messages=messages, prompt=document.prompt).token_ids
        prompt = payload["prompt"]
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return tokenize_text(tokenizer, prompt)
        if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
            return prompt
    except (ValueError, TypeError, KeyError, RecursionError):
        pass
    return None


class Router:
    """The routing state and the HTTP face; `close()` stops its threads."""

    def __init__(self, config: Config, tokenizer, model: str):
        rc = config.router
        assert rc is not None
        self.config = config
        self.model = model  # the identity of the model whose tokenizer and chat template render prompts here
        self.tokenizer = tokenizer  # the pool's threads tokenize with copies of it
        self.tokenizers = TokenizerPool(tokenizer)
        self.replicas = ReplicaSet([
            Replica(r, KVEventSubscriber(r.events, r.replay) if r.events is not None else None) for r in rc.replicas],
            max_load_gap=rc.max_load_gap, policy=rc.policy)
        self.events = EventFeed(self.replicas)
        self.health = HealthChecks(self.replicas, rc.health_interval, model)
        self.health.wait_first_round()
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(rc.request_timeout, connect=HEALTH_TIMEOUT_S))
        self.refused = 0  # requests no replica could take (answered 503)
        self.metrics = RouterMetrics(self.replicas, lambda: self.refused)
        self.app = self._build_app()

    async def prompt_hashes(self, path: str, body: bytes) -> dict[Replica, list[bytes]]:
        """The hashes of the blocks of this prompt that each replica could serve from its cache, as it names
        them (hashed once per naming); none when the body is not a request the router can read, and none for a
        replica whose naming is unknown."""
        try:
            payload = json.loads(body)
        except (ValueError, RecursionError):  # nested deeper than Python parses: the replica says what is wrong
            return {}
        if not isinstance(payload, dict):
            return {}
        token_ids = await self.tokenizers.run(prompt_token_ids, path, payload)
        salt = payload.get("cache_salt")
        if token_ids is None or not (salt is None or isinstance(salt, str)):
            return {}
        by_naming: dict[BlockNaming, list[bytes]] = {}
        for naming in {r.naming for r in self.replicas.replicas} - {None}:
            hittable = (len(token_ids) - 1) // naming.block_size  # the last token is always computed
            by_naming[naming] = naming.hasher().hash(token_ids[:hittable * naming.block_size], cache_salt=salt)
        return {r: by_naming[r.naming] for r in self.replicas.replicas if r.naming in by_naming}

    async def forward(self, request: Request, path: str) -> Response:
        body = await request.body()
        started = time.perf_counter()
        hashes = await self.prompt_hashes(path, body) if request.method == "POST" else {}
        headers = {k: v for k, v in request.headers.items() if k.lower() in FORWARDED_HEADERS}
        tried: set[Replica] = set()
        last_error = "no replica is configured"
        while True:
            replica, held = self.replicas.choose(hashes, tried)
            if not tried:
                self.metrics.placement_seconds.observe(time.perf_counter() - started)
            if replica is None:
                self.refused += 1
                return _error(503, f"no replica could take the request ({last_error})")
            tried.add(replica)
            replica.in_flight += 1
            try:
                upstream = await _unless_hung(replica, self.client.send(
                    self.client.build_request(request.method, replica.url + path, content=body, headers=headers),
                    stream=True))
            except ReplicaHung:
                replica.in_flight -= 1
                replica.counts.failovers["hung"] += 1
                last_error = f"{replica.url}: stopped answering"
                continue
            except httpx.TransportError as exc:
                replica.in_flight -= 1
                set_health(replica, False, hung=isinstance(exc, httpx.TimeoutException))
                replica.counts.failovers["unreachable"] += 1
                last_error = f"{replica.url}: {type(exc).__name__}"
                continue
            if upstream.status_code in RETRY_STATUSES and len(tried) < len(self.replicas.replicas):
                replica.in_flight -= 1
                await upstream.aclose()
                replica.counts.failovers[f"http_{upstream.status_code}"] += 1
                last_error = f"{replica.url}: HTTP {upstream.status_code}"
                continue
            chunks, head = upstream.aiter_raw(), b""
            if _is_event_stream(upstream):
                try:
                    head = await _unless_hung(replica, _first_event(chunks))
                except (httpx.TransportError, ReplicaHung) as exc:
                    # It died or hung before its first event (in the prompt's prefill, say): nothing has reached
                    # the client, so another replica can still give the whole answer.
                    replica.in_flight -= 1
                    await upstream.aclose()
                    set_health(replica, False, hung=replica.hung)
                    why = "stopped answering" if isinstance(exc, ReplicaHung) else type(exc).__name__
                    replica.counts.failovers["hung" if isinstance(exc, ReplicaHung) else "died_before_first_event"] += 1
                    last_error = f"{replica.url}: {why} before its first event"
                    continue
            logger.debug("router: %s -> %s (%d of %d blocks held)", path, replica.url, held,
                         len(hashes.get(replica, ())))
            counts = replica.counts
            counts.placed[self.replicas.placed_by(replica, held, hashes)] += 1
            counts.prompt_blocks += len(hashes.get(replica, ()))
            counts.held_blocks += held
            passed = {k: v for k, v in upstream.headers.items() if k.lower() in ("content-type", "cache-control")}
            passed["x-kvstrata-replica"] = replica.url
            return StreamingResponse(_pass_through(upstream, replica, head, chunks), status_code=upstream.status_code,
                                     headers=passed)

    async def each_replica(self, request: Request, path: str,
                           expected: tuple[int, ...]) -> list[tuple[Replica, httpx.Response]] | Response:
        """The request sent to every healthy replica at once, and the answers of those that gave one
        (one that cannot be reached is taken out, as a health check would); or what to answer instead:
        the first answer with a status other than `expected` (a wrong API key, say), passed on as it
        came, or a 503 when no replica answered."""
        headers = {k: v for k, v in request.headers.items() if k.lower() in FORWARDED_HEADERS}
        body = await request.body()
        replicas = [r for r in self.replicas.replicas if r.healthy]

        async def send(replica: Replica) -> httpx.Response | None:
            try:
                return await self.client.request(request.method, replica.url + path, content=body, headers=headers)
            except httpx.TransportError:
                set_health(replica, False)
                return None

        sent = await asyncio.gather(*(send(r) for r in replicas))
        answers = [(r, a) for r, a in zip(replicas, sent) if a is not None]
        refused = next((_passed(a) for _, a in answers if a.status_code not in expected), None)
        return refused or answers or _error(503, "no replica could take the request (none is healthy)")

    async def list_documents(self, request: Request) -> Response:
        """Every replica's documents, each naming the replica that holds it."""
        answers = await self.each_replica(request, DOCUMENTS_PATH, expected=(200,))
        if isinstance(answers, Response):
            return answers
        try:
            data = [{**d, "replica": r.url} for r, a in answers for d in a.json()["data"]]
        except (ValueError, KeyError, TypeError):
            return _error(502, "a replica answered something that is not a list of documents")
        return JSONResponse({"object": "list", "data": data})

    async def unpin_document(self, request: Request, document_id: str) -> Response:
        """Unpin the document on every replica that has it (a document's id is the same on all of them)."""
        path = f"{DOCUMENTS_PATH}/{quote(document_id, safe='')}"  # one path segment, whatever it holds
        answers = await self.each_replica(request, path, expected=(200, 404))
        if isinstance(answers, Response):
            return answers
        deleted = [a for _, a in answers if a.status_code == 200]
        return _passed(deleted[0] if deleted else answers[0][1])

    async def reset_prefix_cache(self, request: Request) -> Response:
        """Reset every replica's cache (the device's, or with `reset_external` every tier's: the query is
        passed on); 409 naming the replicas still busy, 503 naming those with a tier that could not be
        cleared (the others are reset)."""
        path = "/reset_prefix_cache" + (f"?{request.url.query}" if request.url.query else "")
        answers = await self.each_replica(request, path, expected=(200, 409, 503))
        if isinstance(answers, Response):
            return answers
        busy = [r.url for r, a in answers if a.status_code == 409]
        if busy:
            return _passed(next(a for _, a in answers if a.status_code == 409),
                           message=f"requests are running on {', '.join(busy)}: a replica's prefix cache can be "
                                   f"reset only when it is idle (the others were reset)")
        unreached = [(r, a) for r, a in answers if a.status_code == 503]
        if unreached:  # a tier of its own could not be cleared (a remote server down): its message says which
            replica, answer = unreached[0]
            return _passed(answer, message=f"{replica.url}: {_error_message(answer)} (the other replicas were reset)")
        try:  # every tier any replica cleared, in the order they name them
            tiers = list(dict.fromkeys(t for _, a in answers for t in a.json()["tiers"]))
        except (ValueError, KeyError, TypeError):
            return _error(502, "a replica answered a reset with something that is not a list of tiers")
        return JSONResponse({"object": "prefix_cache.reset", "tiers": tiers, "replicas": [r.url for r, _ in answers]})

    def _forwarder(self, path: str):
        async def forward(request: Request) -> Response:
            return await self.forward(request, path)

        return forward

    def _build_app(self) -> FastAPI:
        app = FastAPI(title="kvstrata route", version=__version__, docs_url=None, redoc_url=None, openapi_url=None)
        install_error_handlers(app)  # 404, 405 and the rest in OpenAI's shape, as the replicas answer them
        # the replicas' limit, before the router reads (and tokenizes) a body: one they refuse is not worth placing,
        # and a client that goes away mid-body is let go here
        app.add_middleware(BodySizeLimit, max_bytes=self.config.server.max_request_body)

        for method, path in FORWARDED_ROUTES:
            app.add_api_route(path, self._forwarder(path), methods=[method])

        app.add_api_route(DOCUMENTS_PATH, self.list_documents, methods=["GET"])
        app.add_api_route(DOCUMENTS_PATH + "/{document_id}", self.unpin_document, methods=["DELETE"])
        app.add_api_route("/reset_prefix_cache", self.reset_prefix_cache, methods=["POST"])

        @app.get("/metrics")
        async def metrics() -> Response:
            return Response(self.metrics.render(), media_type=self.metrics.content_type)

        @app.get("/health")
        async def health() -> Response:
            states = {r.url: {"healthy": r.healthy, "in_flight": r.in_flight,
                              "blocks": {m: len(s) for m, s in r.index.by_medium.items()},
                              "matched": r.naming is not None, "naming_problem": r.naming_problem}
                      for r in self.replicas.replicas}
            ok = any(r.healthy for r in self.replicas.replicas)
            return JSONResponse({"status": "ok" if ok else "no healthy replica", "replicas": states},
                                status_code=200 if ok else 503)

        return app

    async def aclose(self) -> None:
        await self.client.aclose()

    def close(self) -> None:
        self.health.close()
        self.events.close()
        self.tokenizers.close()


def _is_event_stream(upstream: httpx.Response) -> bool:
    return upstream.headers.get("content-type", "").startswith("text/event-stream")


async def _first_event(chunks: AsyncIterator[bytes]) -> bytes:
    """The stream's bytes up to and including its first whole event (all of it if it ends sooner): until
    they are read, the router has sent the client nothing and can still try another replica."""
    head = b""
    async for chunk in chunks:
        head += chunk
        if SSE_SEPARATOR in head:
            break
    return head


async def _pass_through(upstream: httpx.Response, replica: Replica, head: bytes = b"",
                        chunks: AsyncIterator[bytes] | None = None) -> AsyncIterator[bytes]:
    """The replica's answer as it comes: `head`, what was read of it already, then the rest of `chunks`
    (its raw body). A stream of server-sent events is passed on whole events at a time, so that if the
    replica goes away mid-answer the client gets no half event but an error event and the stream's end,
    as the replica itself reports an error it meets mid-stream."""
    events = _is_event_stream(upstream)
    chunks = upstream.aiter_raw() if chunks is None else chunks
    partial = b""   # the bytes of an event not yet complete
    last = b""      # the end of what was passed on (is it `data: [DONE]`?)

    async def body() -> AsyncIterator[bytes]:
        if head:
            yield head
        while True:
            try:
                chunk = await _unless_hung(replica, anext(chunks))
            except StopAsyncIteration:
                return
            yield chunk

    try:
        async for chunk in body():
            if not events:
                yield chunk
                continue
            complete, separator, partial = (partial + chunk).rpartition(SSE_SEPARATOR)
            if separator:
                last = (complete + separator)[-len(SSE_DONE):]
                yield complete + separator
        if partial:
            yield partial
    except (httpx.TransportError, ReplicaHung) as exc:
        set_health(replica, False, hung=replica.hung)  # the replica went away mid-answer: the answer ends here
        if events and last != SSE_DONE:
            replica.counts.streams_cut += 1
            yield _sse_cut_error(replica, "stopped answering" if isinstance(exc, ReplicaHung) else "went away")
    finally:
        replica.in_flight -= 1
        await upstream.aclose()


def _sse_cut_error(replica: Replica, what_it_did: str = "went away") -> bytes:
    """The error event and end of a stream whose replica went away (or stopped answering) before finishing it."""
    body = _error_body(f"replica {replica.url} {what_it_did} mid-answer; the answer is incomplete")
    return f"data: {json.dumps(body)}".encode() + SSE_SEPARATOR + SSE_DONE


def _passed(answer: httpx.Response, message: str | None = None) -> Response:
    """A replica's whole answer, passed on (with its error message replaced by `message`, if given)."""
    if message is None:
        return Response(answer.content, status_code=answer.status_code,
                        media_type=answer.headers.get("content-type"))
    try:
        body = answer.json()
        body["error"]["message"] = message
    except (ValueError, KeyError, TypeError):
        return _passed(answer)
    return JSONResponse(body, status_code=answer.status_code)


def _error_message(answer: httpx.Response) -> str:
    """The message of a replica's error answer (its start, if it is not in OpenAI's shape)."""
    try:
        return str(answer.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return " ".join(answer.text[:200].split())


def _error(status: int, message: str) -> JSONResponse:
    """An error in OpenAI's shape, like the replicas'."""
    return JSONResponse(_error_body(message), status_code=status)


def _error_body(message: str) -> dict:
    return {"error": {"message": message, "type": "service_unavailable", "param": None, "code": None}}


def load_router(config: Config) -> Router:
    """The router for `config`: the replicas' model's tokenizer and identity, without its weights (nor torch)."""
    from kvstrata.engine.model_source import load_tokenizer, model_identity, resolve_model

    if config.router is None:
        raise ValueError("router.replicas: missing (list the replicas in the config's router section or with --replica)")
    if config.model.load_format == "dummy":
        raise ValueError("model.load_format: the router needs the replicas' real model (dummy weights have no "
                         "identity outside the process that drew them)")
    source = resolve_model(config.model.name, config.model.load_format)
    try:
        tokenizer = load_tokenizer(source)
    except (OSError, ValueError, KeyError, ImportError) as exc:
        raise ValueError(f"model.name: cannot load the tokenizer of {source.directory}: "
                         f"{' '.join(str(exc).split())[:200]}") from None
    return Router(config, tokenizer, model_identity(source))


def replica_line(replica: Replica) -> str:
    """A replica's line in the banner: its events and whether its prompts can be matched to its cache, as the
    router's first health checks found it."""
    events = replica.config.events or "none (routed by load)"
    if replica.naming is not None:
        cache = f"cache matched ({replica.naming.block_size}-token blocks)"
    elif replica.naming_problem is not None:
        cache = f"routed by load: {replica.naming_problem}"
    else:
        cache = "not answering yet: routed by load until it does"
    return f"  {replica.url}  events: {events}; {cache}"


def route(config: Config) -> None:
    """`kvstrata route`: bind, load the tokenizer, serve until SIGTERM/SIGINT."""
    rc = config.router
    if rc is None:
        raise ValueError("router.replicas: missing (list the replicas in the config's router section or with --replica)")
    sock = bind_socket(rc.host, rc.port, key="router")
    router = None
    try:
        router = load_router(config)
        listen(sock, key="router")
        host, port = sock.getsockname()[:2]
        lines = [f"kvstrata {__version__} routing on http://{host}:{port} (OpenAI API under /v1) to "
                 f"{len(rc.replicas)} replica{'s' if len(rc.replicas) != 1 else ''}, "
                 f"{PLACEMENT[rc.policy]}"]
        lines += [replica_line(r) for r in router.replicas.replicas]
        print("\n".join(lines), flush=True)
        server = uvicorn.Server(uvicorn.Config(router.app, log_level="warning", access_log=False, lifespan="off"))
        server.run(sockets=[sock])
    finally:
        sock.close()
        if router is not None:
            router.close()
    print("kvstrata route: stopped", flush=True)
