"""Engine outputs as OpenAI responses: whole answers, server-sent event streams, usage, logprobs.

A stream sends what each new engine output adds: the text only ever grows, so a delta is a suffix,
and the log-probabilities of the tokens generated since the last event go with it. Token ids become
text on the tokenizer threads (`TokenizerPool`), never on the event loop.
"""
from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, AsyncIterator, Sequence

from fastapi.responses import StreamingResponse

from kvstrata.serving.schemas import (ChatCompletionChunk, ChatLogprobs, ChatStreamChoice, CompletionChoice,
                                      CompletionLogprobs, CompletionResponse, DeltaMessage, ErrorInfo,
                                      KvstrataInfo, PromptTokensDetails, TokenLogprob, TopLogprob, Usage)
from kvstrata.serving.tokenizer_pool import TokenizerPool

if TYPE_CHECKING:
    from kvstrata.engine.llm import RequestOutput
    from kvstrata.engine.sampling import TokenLogprobs

# JSON has no -inf: a token the model deems impossible is reported at this log-probability (as vLLM).
MIN_LOGPROB = -9999.0


def usage(output: RequestOutput) -> Usage:
    prompt_tokens, completion_tokens = len(output.prompt_token_ids), len(output.token_ids)
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                 total_tokens=prompt_tokens + completion_tokens,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=output.cached_tokens))


def kvstrata_info(output: RequestOutput) -> KvstrataInfo:
    """The receipt, to the microsecond; without one (no token generated) the tokens per tier and TTFT only."""
    if output.receipt is not None:
        return KvstrataInfo(**output.receipt.to_dict(decimals=3))
    ttft_ms = None if output.ttft_s is None else round(output.ttft_s * 1000.0, 3)
    return KvstrataInfo(cached_tokens_by_tier=dict(output.cached_tokens_by_tier), ttft_ms=ttft_ms)


# ---------------------------------------------------------------------------------------------
# Logprobs


def _decode_each(tokenizer, token_ids: Sequence[int]) -> dict[int, str]:
    return {token_id: tokenizer.decode([token_id]) for token_id in token_ids}


async def token_texts(tokenizers: TokenizerPool, entries: Sequence[TokenLogprobs]) -> dict[int, str]:
    """The text of every token named in `entries` (sampled and alternatives), each decoded alone."""
    token_ids = {e.token_id for e in entries} | {t for e in entries for t, _ in e.top}
    return await tokenizers.run(_decode_each, sorted(token_ids)) if token_ids else {}


def _logprob(value: float) -> float:
    return max(value, MIN_LOGPROB)


def completion_logprobs(entries: Sequence[TokenLogprobs], texts: dict[int, str],
                        text_offset: int = 0) -> CompletionLogprobs:
    """The legacy shape. `text_offset`: where the first of `entries` starts in the generated text."""
    tokens, offsets = [], []
    for entry in entries:
        tokens.append(texts[entry.token_id])
        offsets.append(text_offset)
        text_offset += len(tokens[-1])
    top = [{texts[t]: _logprob(v) for t, v in (*e.top, (e.token_id, e.logprob))} for e in entries]
    return CompletionLogprobs(tokens=tokens, token_logprobs=[_logprob(e.logprob) for e in entries],
                              top_logprobs=top, text_offset=offsets)


def chat_logprobs(entries: Sequence[TokenLogprobs], texts: dict[int, str]) -> ChatLogprobs:
    def top_logprob(token_id: int, value: float) -> TopLogprob:
        text = texts[token_id]
        return TopLogprob(token=text, logprob=_logprob(value), bytes=list(text.encode("utf-8")))

    return ChatLogprobs(content=[TokenLogprob(**top_logprob(e.token_id, e.logprob).model_dump(),
                                              top_logprobs=[top_logprob(t, v) for t, v in e.top])
                                 for e in entries])


# ---------------------------------------------------------------------------------------------
# Streams


@dataclass
class StreamSettings:
    """What a streaming request asked for beyond the text."""

    request_id: str
    model: str
    include_usage: bool          # a last chunk, with no choices, carries usage
    continuous_usage: bool       # every chunk carries the usage so far
    logprobs: bool               # each chunk carries the log-probabilities of its tokens
    tokenizers: TokenizerPool


class SSEResponse(StreamingResponse):
    """A `text/event-stream` response that always closes its event generator: a client that goes
    away mid-stream has its request aborted at once, not when the generator is garbage-collected."""

    def __init__(self, events: AsyncIterator[str]):
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


def _sse(chunk: CompletionResponse | ChatCompletionChunk) -> str:
    # `usage` and `kvstrata` appear only on the chunks that carry them.
    absent = {name for name in ("usage", "kvstrata") if getattr(chunk, name) is None}
    return f"data: {chunk.model_dump_json(exclude=absent)}\n\n"


_SSE_DONE = "data: [DONE]\n\n"


def _sse_error(exc: Exception) -> str:
    status = 400 if isinstance(exc, ValueError) else 500
    error_type = "invalid_request_error" if status == 400 else "server_error"
    info = ErrorInfo(message=" ".join(str(exc).split()) or type(exc).__name__, type=error_type)
    return f"data: {json.dumps({'error': info.model_dump()})}\n\n"


@dataclass
class _Delta:
    output: RequestOutput
    text: str                                   # the text this output adds
    text_offset: int                            # where `text` starts in the whole generated text
    logprobs: list[TokenLogprobs] | None        # the log-probabilities of the tokens it adds, if asked


async def _deltas(outputs: AsyncIterator[RequestOutput]) -> AsyncIterator[_Delta]:
    sent_chars = sent_tokens = 0
    async for output in outputs:
        new_logprobs = None if output.logprobs is None else output.logprobs[sent_tokens:]
        yield _Delta(output, output.text[sent_chars:], sent_chars, new_logprobs)
        sent_chars, sent_tokens = len(output.text), len(output.token_ids)


async def completion_events(outputs: AsyncIterator[RequestOutput], settings: StreamSettings) -> AsyncIterator[str]:
    created = int(time.time())

    def chunk(choices: list[CompletionChoice], output: RequestOutput, **extra) -> CompletionResponse:
        if settings.continuous_usage:
            extra.setdefault("usage", usage(output))
        return CompletionResponse(id=settings.request_id, created=created, model=settings.model, choices=choices,
                                  **extra)

    async with contextlib.aclosing(outputs):
        try:
            final = None
            async for delta in _deltas(outputs):
                final = delta.output
                logprobs = None
                if settings.logprobs and delta.logprobs:
                    texts = await token_texts(settings.tokenizers, delta.logprobs)
                    logprobs = completion_logprobs(delta.logprobs, texts, delta.text_offset)
                choice = CompletionChoice(text=delta.text, logprobs=logprobs, finish_reason=final.finish_reason,
                                          stop_reason=final.stop_reason)
                if final.finished:
                    yield _sse(chunk([choice], final, kvstrata=kvstrata_info(final)))
                elif delta.text or logprobs is not None:
                    yield _sse(chunk([choice], final))
            if settings.include_usage:
                yield _sse(chunk([], final, usage=usage(final), kvstrata=kvstrata_info(final)))
        except Exception as exc:  # noqa: BLE001 - the status line is sent: tell the client in the stream
            yield _sse_error(exc)
    yield _SSE_DONE


async def chat_events(outputs: AsyncIterator[RequestOutput], settings: StreamSettings) -> AsyncIterator[str]:
    created = int(time.time())

    def chunk(choices: list[ChatStreamChoice], output: RequestOutput | None, **extra) -> ChatCompletionChunk:
        if settings.continuous_usage and output is not None:  # the role chunk comes before any output
            extra.setdefault("usage", usage(output))
        return ChatCompletionChunk(id=settings.request_id, created=created, model=settings.model, choices=choices,
                                   **extra)

    async with contextlib.aclosing(outputs):
        try:
            yield _sse(chunk([ChatStreamChoice(delta=DeltaMessage(role="assistant", content=""))], None))
            final = None
            async for delta in _deltas(outputs):
                final = delta.output
                logprobs = None
                if settings.logprobs and delta.logprobs:
                    logprobs = chat_logprobs(delta.logprobs, await token_texts(settings.tokenizers, delta.logprobs))
                if delta.text or logprobs is not None:
                    content = ChatStreamChoice(delta=DeltaMessage(content=delta.text), logprobs=logprobs)
                    yield _sse(chunk([content], final))
                if final.finished:
                    finish = ChatStreamChoice(delta=DeltaMessage(), finish_reason=final.finish_reason,
                                              stop_reason=final.stop_reason)
                    yield _sse(chunk([finish], final, kvstrata=kvstrata_info(final)))
            if settings.include_usage:
                yield _sse(chunk([], final, usage=usage(final), kvstrata=kvstrata_info(final)))
        except Exception as exc:  # noqa: BLE001 - the status line is sent: tell the client in the stream
            yield _sse_error(exc)
    yield _SSE_DONE
