"""A stand-in engine and tokenizer for HTTP tests that need the app's behaviour, not the model's:
the real FastAPI app (middleware, schemas, routes, error shapes) over an engine that answers at once."""
from __future__ import annotations

import asyncio
from typing import AsyncIterator, Callable

import httpx

from kvstrata.engine.hashing import BlockNaming
from kvstrata.engine.llm import RequestOutput
from kvstrata.engine.sampling import SamplingParams, TokenLogprobs
from kvstrata.serving.app import build_app
from kvstrata.serving.metrics import ServingMetrics
from kvstrata.serving.middleware import DrainState
from kvstrata.serving.tokenizer_pool import TokenizerPool

MODEL = "fake-model"
VOCAB = 256
BLOCK_NAMING = BlockNaming(f"{MODEL}@xxh3_128:0", b"fake-namespace", 16, "xxh3_128")


class ByteTokenizer:
    """One token per UTF-8 byte; the chat template is `role: content` lines."""

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        return {"input_ids": list(text.encode("utf-8"))}

    def apply_chat_template(self, messages, add_generation_prompt: bool, tokenize: bool,
                            continue_final_message: bool = False, **template_kwargs) -> list[int]:
        """`template_kwargs`: `system` (a line first) is the one variable this template knows."""
        text = template_kwargs.get("system", "") + "".join(f"{m['role']}: {m['content']}\n" for m in messages)
        if continue_final_message:
            text = text[:-1]  # the last message stays open
        return list((text + ("assistant: " if add_generation_prompt else "")).encode("utf-8"))

    def decode(self, token_ids) -> str:
        return bytes(token_ids).decode("utf-8", errors="replace")

    def __len__(self) -> int:
        return VOCAB


def _most_likely(token_ids: list[int], logprob: float, num_top: int | None) -> list[TokenLogprobs] | None:
    """Entries for `token_ids`, each the most likely at `logprob`, its `num_top` alternatives the
    next token ids at logprob - 1, - 2, ..."""
    if num_top is None:
        return None
    return [TokenLogprobs(t, logprob, tuple(((t + i) % VOCAB, logprob - i) for i in range(num_top)), 1)
            for t in token_ids]


class FakeAsyncEngine:
    """What the app uses of an AsyncEngine. Every request answers `reply(token_ids, params)` (by
    default `REPLY`) one token per output; the sampled token is the most likely one, with
    log-probability -0.5, the next ones -1.5, -2.5, ...; each prompt token is likewise the most likely
    at its position, at -1, the next ones -2, -3, ... A request is received (queued) when its outputs
    are first read, as the real engine queues it."""

    REPLY = "hi!"

    def __init__(self, max_model_len: int = 512, reply: Callable[[list[int], SamplingParams], str] | None = None):
        self.engine = type("LLMEngineLimits", (), {"max_model_len": max_model_len, "block_naming": BLOCK_NAMING})()
        self.is_running = True
        self.snapshot = None
        self.reply = reply or (lambda token_ids, params: self.REPLY)
        self.received: list[tuple[list[int], SamplingParams]] = []
        self.request_ids: list[str] = []

    async def prepare(self, params: SamplingParams) -> None:
        pass

    def generate(self, token_ids, params: SamplingParams, *, request_id, cache_salt, prompt,
                 arrival_time) -> AsyncIterator[RequestOutput]:
        if not token_ids:
            raise ValueError("prompt is empty")
        return self._outputs(request_id, list(token_ids), params)

    async def _outputs(self, request_id: str, token_ids: list[int], params: SamplingParams):
        self.received.append((token_ids, params))
        self.request_ids.append(request_id)
        reply = list(self.reply(token_ids, params).encode())[:params.max_tokens]
        # a stop token ends the reply, its text left out (as the engine does)
        stop_token = next((t for t in reply if t in params.stop_token_ids), None)
        if stop_token is not None:
            reply = reply[:reply.index(stop_token) + 1]
        for n in range(1, len(reply) + 1):
            await asyncio.sleep(0)
            finished = n == len(reply)
            stopped = finished and stop_token is not None
            logprobs = _most_likely(reply[:n], -0.5, params.logprobs)
            prompt_logprobs = _most_likely(token_ids[1:], -1.0, params.prompt_logprobs)
            yield RequestOutput(request_id=request_id, prompt=None, prompt_token_ids=token_ids,
                                prompt_logprobs=prompt_logprobs,
                                text=bytes(reply[:n - stopped]).decode(), token_ids=reply[:n], cached_tokens=0,
                                cached_tokens_by_tier={"device": 0, "cpu": 0, "disk": 0, "remote": 0}, ttft_s=0.001,
                                finish_reason=("length" if n == params.max_tokens and not stopped else "stop")
                                if finished else None,
                                finished=finished, logprobs=logprobs, stop_reason=stop_token if stopped else None)


def fake_app(engine: FakeAsyncEngine | None = None, *, api_key: str | None = None, max_request_body: int = 1 << 20,
             drain: DrainState | None = None, access_log: bool = False):
    engine = engine or FakeAsyncEngine()
    return build_app(engine, MODEL, metrics=ServingMetrics(lambda: None), tokenizers=TokenizerPool(ByteTokenizer(), 2),
                     api_key=api_key, max_request_body=max_request_body, drain=drain, access_log=access_log)


def client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")
