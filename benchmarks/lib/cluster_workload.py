"""The cluster benchmark's workload and its accounting: long-document QA (pydoc_data.topics documents, the
questions of benchmarks/data/longdoc_qa_dev.jsonl where it has some), documents drawn by a Zipf law, the answers
an uncached engine gives (float32, greedy), a streaming client for the router, and the tokens the best single
cache would have served."""
from __future__ import annotations

import asyncio
import json
import random
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

DATA = Path(__file__).resolve().parent.parent / "data" / "longdoc_qa_dev.jsonl"
MODEL = "smollm2-135m-instruct"
GENERIC_QUESTIONS = ("What is this about?", "Name one keyword.", "Give an example.")
TIERS = ("device", "cpu", "disk", "remote")


@dataclass(frozen=True)
class Prompt:
    doc: str
    question: str
    content: str

    def messages(self) -> list[dict]:
        return [{"role": "user", "content": self.content}]


def documents(num_docs: int, doc_chars: int) -> list[tuple[str, str, list[str]]]:
    """(name, text, questions) of `num_docs` documents: the QA set's first, then other long topics by name."""
    from pydoc_data.topics import topics

    asked: dict[str, list[str]] = {}
    for line in DATA.read_text().splitlines():
        row = json.loads(line)
        asked.setdefault(row["doc"].split(":", 1)[1], []).append(row["question"])
    names = list(asked) + sorted(n for n in topics if n not in asked and len(topics[n]) >= doc_chars)
    return [(n, topics[n][:doc_chars], asked.get(n, list(GENERIC_QUESTIONS))) for n in names[:num_docs]]


def prompts(docs) -> list[list[Prompt]]:
    """Per document, one prompt per question."""
    return [[Prompt(name, q, f"{text}\n\nAnswer briefly. {q}") for q in questions] for name, text, questions in docs]


def zipf_schedule(by_doc: list[list[Prompt]], num_requests: int, s: float, seed: int) -> list[Prompt]:
    """`num_requests` prompts: document k (by rank) with probability proportional to 1 / k**s, a question of it
    at random; the ranks are shuffled so that the hot documents are not the QA set's first."""
    rng = random.Random(seed)
    ranked = list(by_doc)
    rng.shuffle(ranked)
    weights = [1 / (k + 1) ** s for k in range(len(ranked))]
    return [rng.choice(rng.choices(ranked, weights)[0]) for _ in range(num_requests)]


def reference_answers(unique: list[Prompt], max_tokens: int) -> dict[Prompt, tuple[str, list[int]]]:
    """Each prompt's greedy answer from one engine with caching off (float32), and its prompt's token ids."""
    from kvstrata import LLM, SamplingParams, load_config

    config = load_config({"model": {"dtype": "float32", "device": "cpu"}, "cache": {"enable_prefix_caching": False}})
    with LLM(config) as llm:
        outs = llm.chat([p.messages() for p in unique], SamplingParams(max_tokens=max_tokens, temperature=0.0))
    return {p: (o.text, list(o.prompt_token_ids)) for p, o in zip(unique, outs)}


def best_single_cache(token_ids: list[list[int]], capacity_blocks: int, block_size: int) -> int:
    """The prompt tokens one LRU cache of `capacity_blocks` blocks would have served to these prompts, taken in
    order: a block is named by the whole prefix it ends (as the chain hash names it), the last token is always
    computed, and a prompt's full blocks are cached once it is served."""
    cache: OrderedDict = OrderedDict()
    served = 0
    for ids in token_ids:
        keys = [hash(tuple(ids[:(i + 1) * block_size])) for i in range(len(ids) // block_size)]
        hit = 0
        for key in keys[:(len(ids) - 1) // block_size]:
            if key not in cache:
                break
            hit += 1
        served += hit * block_size
        for key in keys:
            cache[key] = True
            cache.move_to_end(key)
        while len(cache) > capacity_blocks:
            cache.popitem(last=False)
    return served


@dataclass
class Outcome:
    """One request as the client saw it."""
    doc: str
    question: str
    sent_s: float                       # since the phase began
    status: int = 0                     # HTTP status; 0: no answer at all
    replica: str = ""
    ttft_s: float | None = None         # to the first content, at the client
    text: str = ""
    done: bool = False                  # the stream ended with `data: [DONE]`
    error: str = ""                     # the error the router or replica gave, or what the client met
    clear: bool = False                 # the error came as an answer: an HTTP error or a stream's error event
    prompt_tokens: int = 0
    cached_by_tier: dict = field(default_factory=dict)
    verdict: str = ""                   # correct | wrong | error (clear) | lost (silent)

    def judge(self, expected: str) -> None:
        if self.clear:
            self.verdict = "error"      # an answer that says what went wrong
        elif self.status == 200 and self.done and not self.error:
            self.verdict = "correct" if self.text == expected else "wrong"
        else:
            self.verdict = "lost"       # no answer, an unfinished stream without an error, or a hang


async def send(client: httpx.AsyncClient, base_url: str, prompt: Prompt, max_tokens: int, t0: float,
               timeout_s: float) -> Outcome:
    """One streamed chat completion through the router; what came back, never an exception."""
    body = {"model": MODEL, "messages": prompt.messages(), "max_tokens": max_tokens, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}}
    out = Outcome(prompt.doc, prompt.question, time.monotonic() - t0)
    started = time.monotonic()
    try:
        async with asyncio.timeout(timeout_s):
            async with client.stream("POST", f"{base_url}/v1/chat/completions", json=body) as response:
                out.status = response.status_code
                out.replica = response.headers.get("x-kvstrata-replica", "")
                if response.status_code != 200:
                    raw = await response.aread()
                    out.error, out.clear = _message(raw), True
                    return out
                async for line in response.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[len("data: "):]
                    if data == "[DONE]":
                        out.done = True
                        continue
                    chunk = json.loads(data)
                    if "error" in chunk:
                        out.error, out.clear = str(chunk["error"].get("message", chunk["error"])), True
                        continue
                    for choice in chunk.get("choices") or []:
                        piece = (choice.get("delta") or {}).get("content")
                        if piece:
                            if out.ttft_s is None:
                                out.ttft_s = time.monotonic() - started
                            out.text += piece
                    if chunk.get("usage"):
                        out.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    if chunk.get("kvstrata"):
                        out.cached_by_tier = chunk["kvstrata"].get("cached_tokens_by_tier") or out.cached_by_tier
    except TimeoutError:
        out.error = f"no complete answer within {timeout_s:.0f} s"
    except (httpx.HTTPError, ValueError) as exc:
        out.error = f"client: {type(exc).__name__}: {exc}"[:200]
    return out


def _message(raw: bytes) -> str:
    try:
        return str(json.loads(raw)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return raw[:200].decode(errors="replace") or "(empty body)"


async def drive(base_url: str, schedule: list[Prompt], concurrency: int, max_tokens: int, time_limit_s: float,
                timeout_s: float, t0: float | None = None, min_requests: int = 0) -> list[Outcome]:
    """The schedule's requests, `concurrency` at a time, in order, until they are all answered or `time_limit_s`
    has passed and at least `min_requests` were sent (no new request starts then)."""
    t0 = time.monotonic() if t0 is None else t0
    queue = list(reversed(schedule))
    outcomes: list[Outcome] = []
    limits = httpx.Limits(max_connections=concurrency * 2, max_keepalive_connections=concurrency * 2)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=5), limits=limits) as client:
        async def worker() -> None:
            while queue and (time.monotonic() - t0 < time_limit_s or len(schedule) - len(queue) < min_requests):
                outcomes.append(await send(client, base_url, queue.pop(), max_tokens, t0, timeout_s))
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return sorted(outcomes, key=lambda o: o.sent_s)


def percentile(values: list[float], p: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(p / 100 * (len(ordered) - 1))))]


SOURCES = ("local", "remote", "disk", "computed")


def main_source(outcome: Outcome) -> str:
    """Where most of a request's prompt came from: the local tiers (device and CPU), the remote tier, the local
    disk, or computing it. A prompt found mostly in the local tiers costs its replica least; the TTFT by source
    says how much placement can gain over a policy that finds the same prompts in the remote tier instead."""
    cached = {t: int(outcome.cached_by_tier.get(t, 0)) for t in TIERS}
    shares = {"local": cached["device"] + cached["cpu"], "remote": cached["remote"], "disk": cached["disk"],
              "computed": outcome.prompt_tokens - sum(cached.values())}
    return max(SOURCES, key=lambda source: shares[source])  # ties go to the first named


def ttft_by_source(answered: list[Outcome]) -> dict:
    """Per main source (`main_source`): the requests and their TTFT p50."""
    by_source = {source: [o.ttft_s for o in answered if o.ttft_s is not None and main_source(o) == source]
                 for source in SOURCES}
    return {source: {"requests": len(ttfts), "ttft_p50_s": percentile(ttfts, 50)}
            for source, ttfts in by_source.items()}


def summary(outcomes: list[Outcome], wall_s: float) -> dict:
    """Per tier the prompt tokens served (device+cpu: local), TTFT percentiles of the answered, throughput."""
    answered = [o for o in outcomes if o.verdict in ("correct", "wrong")]
    tokens = {t: sum(int(o.cached_by_tier.get(t, 0)) for o in answered) for t in TIERS}
    prompt = sum(o.prompt_tokens for o in answered)
    ttfts = [o.ttft_s for o in answered if o.ttft_s is not None]
    verdicts = {v: sum(o.verdict == v for o in outcomes) for v in ("correct", "wrong", "error", "lost")}
    return {"requests": len(outcomes), **verdicts, "refused": sum(o.status not in (0, 200) for o in outcomes),
            "prompt_tokens": prompt, "local_tokens": tokens["device"] + tokens["cpu"], "tokens_by_tier": tokens,
            "recomputed_tokens": prompt - sum(tokens.values()),
            "ttft_p50_s": percentile(ttfts, 50), "ttft_p95_s": percentile(ttfts, 95),
            "ttft_p99_s": percentile(ttfts, 99), "ttft_by_source": ttft_by_source(answered), "wall_s": wall_s,
            "requests_per_s": len(answered) / wall_s if wall_s else None}


def outcome_rows(outcomes: list[Outcome]) -> list[dict]:
    return [asdict(o) for o in outcomes]
