"""Engine outputs as OpenAI responses: whole answers, server-sent event streams, usage, logprobs.

A stream sends what each new engine output adds: the text only ever grows, so a delta is a suffix,
and the log-probabilities of the tokens generated since the last event go with it. Each choice of a
response (`n`, a batch of prompts) is an engine request of its own; their outputs are read together
(`interleaved`), and a response ends, or is aborted, with all of them. Token ids become
text on the tokenizer threads (`TokenizerPool`), never on the event loop.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, AsyncIterator, Iterable, Sequence, TypeVar

from fastapi.responses import Response, StreamingResponse

from kvstrata.serving.schemas import (ChatCompletionChunk, ChatCompletionResponse, ChatLogprobs, ChatStreamChoice,
                                      CompletionChoice, CompletionLogprobs, CompletionResponse, DeltaMessage, ErrorInfo,
                                      KvstrataInfo, PromptLogprob, PromptLogprobs, PromptTokensDetails, TokenLogprob,
                                      TopLogprob, Usage)
from kvstrata.serving.tokenizer_pool import TokenizerPool

if TYPE_CHECKING:
    from kvstrata.engine.llm import RequestOutput
    from kvstrata.engine.sampling import TokenLogprobs

T = TypeVar("T")

# JSON has no -inf: a token the model deems impossible is reported at this log-probability (as vLLM).
MIN_LOGPROB = -9999.0


def usage(outputs: Sequence[RequestOutput], choices_per_prompt: int = 1) -> Usage:
    """The usage of a response's choices, `choices_per_prompt` of each prompt in order. A prompt
    counts once (as OpenAI counts it), and its cached tokens are those every one of its choices found
    cached: with n choices of a new prompt, one computes it and the others share its blocks, so the
    prompt was computed once and is reported uncached."""
    by_prompt = [outputs[k:k + choices_per_prompt] for k in range(0, len(outputs), choices_per_prompt)]
    prompt_tokens = sum(len(choices[0].prompt_token_ids) for choices in by_prompt)
    cached_tokens = sum(min(o.cached_tokens for o in choices) for choices in by_prompt)
    completion_tokens = sum(len(o.token_ids) for o in outputs)
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                 total_tokens=prompt_tokens + completion_tokens,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens))


def kvstrata_info(output: RequestOutput) -> KvstrataInfo:
    """The receipt, to the microsecond; without one (no token generated) the tokens per tier and TTFT only."""
    if output.receipt is not None:
        return KvstrataInfo(**output.receipt.to_dict(decimals=3))
    ttft_ms = None if output.ttft_s is None else round(output.ttft_s * 1000.0, 3)
    return KvstrataInfo(cached_tokens_by_tier=dict(output.cached_tokens_by_tier), ttft_ms=ttft_ms)


def response_receipt(outputs: Sequence[RequestOutput]) -> KvstrataInfo:
    """A response's receipt: its only choice's, or that of the choice whose first token came first
    (the choices arrive together, so that is the TTFT a streaming client sees)."""
    return kvstrata_info(min(outputs, key=lambda o: math.inf if o.ttft_s is None else o.ttft_s))


def choice_receipt(output: RequestOutput, outputs: Sequence[RequestOutput]) -> KvstrataInfo | None:
    """A choice's own receipt, given only when the response has several choices."""
    return kvstrata_info(output) if len(outputs) > 1 else None


# ---------------------------------------------------------------------------------------------
# Choices: one engine request each


@dataclass
class _Ended:
    error: Exception | None = None


async def interleaved(streams: Sequence[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """The items of several streams as each comes, with its stream's index. Closing this, or an error
    in any stream (raised here), closes every stream: a client that goes away aborts all its choices."""
    # Bounded: a reader slower than the engine lets each request's outputs coalesce (AsyncEngine
    # hands over only the latest), rather than queueing every snapshot here.
    queue: asyncio.Queue = asyncio.Queue(maxsize=len(streams))

    async def pump(index: int, stream: AsyncIterator[T]) -> None:
        error = None
        try:
            async with contextlib.aclosing(stream):
                async for item in stream:
                    await queue.put((index, item))
        except Exception as exc:  # noqa: BLE001 - handed to the reader, which raises it
            error = exc
        await queue.put((index, _Ended(error)))

    pumps = [asyncio.create_task(pump(i, stream)) for i, stream in enumerate(streams)]
    try:
        running = len(pumps)
        while running:
            index, item = await queue.get()
            if not isinstance(item, _Ended):
                yield index, item
            elif item.error is not None:
                raise item.error
            else:
                running -= 1
    finally:
        for task in pumps:
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)


async def last_outputs(streams: Sequence[AsyncIterator[RequestOutput]]) -> list[RequestOutput]:
    """Each stream's last output, once every request has finished, in the streams' order."""
    last: dict[int, RequestOutput] = {}
    async with contextlib.aclosing(interleaved(streams)) as outputs:
        async for index, output in outputs:
            last[index] = output
    assert len(last) == len(streams) and all(o.finished for o in last.values())
    return [last[i] for i in range(len(streams))]


# ---------------------------------------------------------------------------------------------
# Logprobs


def _decode_each(tokenizer, token_ids: Iterable[int]) -> dict[int, str]:
    return {token_id: tokenizer.decode([token_id]) for token_id in token_ids}


async def token_texts(tokenizers: TokenizerPool, entries: Sequence[TokenLogprobs], *more_ids: int) -> dict[int, str]:
    """The text of every token named in `entries` (sampled and alternatives) and of `more_ids`, each
    decoded alone."""
    token_ids = _named_ids(entries) | set(more_ids)
    return await tokenizers.run(_decode_each, sorted(token_ids)) if token_ids else {}


def _named_ids(entries: Sequence[TokenLogprobs]) -> set[int]:
    """Every token id `entries` name: their tokens and their alternatives."""
    return {e.token_id for e in entries} | {t for e in entries for t, _ in e.top}


def _logprob(value: float) -> float:
    return max(value, MIN_LOGPROB)


def completion_logprobs(entries: Sequence[TokenLogprobs], texts: dict[int, str], text_offset: int = 0,
                        unscored_first: int | None = None) -> CompletionLogprobs:
    """The legacy shape. `text_offset`: where the first token starts in the text. `unscored_first`:
    a token before `entries` that has no log-probability (a prompt's first: nothing predicts it)."""
    tokens, offsets, token_logprobs, top = [], [], [], []
    if unscored_first is not None:
        tokens.append(texts[unscored_first])
        offsets.append(text_offset)
        token_logprobs.append(None)
        top.append(None)
        text_offset += len(tokens[-1])
    for entry in entries:
        tokens.append(texts[entry.token_id])
        offsets.append(text_offset)
        text_offset += len(tokens[-1])
        token_logprobs.append(_logprob(entry.logprob))
        top.append({texts[t]: _logprob(v) for t, v in (*entry.top, (entry.token_id, entry.logprob))})
    return CompletionLogprobs(tokens=tokens, token_logprobs=token_logprobs, top_logprobs=top, text_offset=offsets)


def _with_top(entries: Sequence[TokenLogprobs], num_top: int | None) -> Sequence[TokenLogprobs]:
    """`entries` with at most `num_top` alternatives each (all of them if None)."""
    if num_top is None or all(len(e.top) <= num_top for e in entries):
        return entries
    return [replace(e, top=e.top[:num_top]) for e in entries]


async def output_completion_logprobs(tokenizers: TokenizerPool, output: RequestOutput,
                                     entries: Sequence[TokenLogprobs], text_offset: int,
                                     with_prompt: bool, num_top: int | None = None) -> CompletionLogprobs:
    """`entries` of `output`'s tokens in the legacy shape, from `text_offset` in the text; with the
    prompt's tokens before them when the prompt is echoed (from offset 0), with at most `num_top`
    alternatives each (the request's `logprobs`: its `prompt_logprobs` may have asked for more)."""
    first = None
    if with_prompt:
        prompt_entries = _with_top(output.prompt_logprobs, num_top)
        first, entries, text_offset = output.prompt_token_ids[0], [*prompt_entries, *entries], 0
    texts = await token_texts(tokenizers, entries, *([] if first is None else [first]))
    return completion_logprobs(entries, texts, text_offset, first)


async def prompt_logprobs_by_token(tokenizers: TokenizerPool, output: RequestOutput, num_top: int) -> PromptLogprobs:
    """vLLM's `prompt_logprobs` of `output`'s prompt: None for its first token, then for each next one
    the token and its `num_top` likeliest alternatives, by token id, each with its log-probability,
    rank and text (the prompt's token first; it is listed once if it is among the likeliest). Built
    on a tokenizer thread: a long prompt has hundreds of thousands of entries."""
    return await tokenizers.run(_prompt_logprobs_by_token, _with_top(output.prompt_logprobs, num_top))


def _prompt_logprobs_by_token(tokenizer, entries: Sequence[TokenLogprobs]) -> PromptLogprobs:
    texts = _decode_each(tokenizer, _named_ids(entries))
    by_position: PromptLogprobs = [None]
    for entry in entries:
        tokens = {str(entry.token_id): PromptLogprob(logprob=_logprob(entry.logprob), rank=entry.rank,
                                                     decoded_token=texts[entry.token_id])}
        for rank, (token_id, value) in enumerate(entry.top, start=1):
            if str(token_id) not in tokens:
                tokens[str(token_id)] = PromptLogprob(logprob=_logprob(value), rank=rank, decoded_token=texts[token_id])
        by_position.append(tokens)
    return by_position


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
    choices_per_prompt: int = 1  # the request's n: choice k*n + i is prompt k's i-th
    echoes: list[str] | None = None  # each prompt's text, which its choices' first chunk repeats (echo)


async def json_response(tokenizers: TokenizerPool, answer: CompletionResponse | ChatCompletionResponse) -> Response:
    """A whole (not streamed) answer as JSON, written by pydantic's compiled serializer on a pool thread.
    FastAPI's default for a returned model (`jsonable_encoder`, in Python, on the event loop) took an order of
    magnitude longer for an answer with many prompt log-probabilities, stalling every other client meanwhile;
    this is faster and off the loop."""
    body = await tokenizers.run(_json_bytes, answer)
    return Response(body, media_type="application/json")


def _json_bytes(_tokenizer, answer: CompletionResponse | ChatCompletionResponse) -> bytes:
    return answer.__pydantic_serializer__.to_json(answer)


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
    async with contextlib.aclosing(outputs):
        async for output in outputs:
            new_logprobs = None if output.logprobs is None else output.logprobs[sent_tokens:]
            yield _Delta(output, output.text[sent_chars:], sent_chars, new_logprobs)
            sent_chars, sent_tokens = len(output.text), len(output.token_ids)


def _choice_deltas(streams: Sequence[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, _Delta]]:
    """Every choice's deltas as they come, each with its choice's index."""
    return interleaved([_deltas(stream) for stream in streams])


async def completion_events(streams: Sequence[AsyncIterator[RequestOutput]],
                            settings: StreamSettings) -> AsyncIterator[str]:
    created = int(time.time())

    def chunk(choices: list[CompletionChoice], outputs: Sequence[RequestOutput], **extra) -> CompletionResponse:
        if settings.continuous_usage:
            extra.setdefault("usage", usage(outputs))
        return CompletionResponse(id=settings.request_id, created=created, model=settings.model, choices=choices,
                                  **extra)

    latest: dict[int, RequestOutput] = {}
    async with contextlib.aclosing(_choice_deltas(streams)) as deltas:
        try:
            async for index, delta in deltas:
                echo = "" if settings.echoes is None else settings.echoes[index // settings.choices_per_prompt]
                echo_now = settings.echoes is not None and index not in latest  # a choice's first chunk repeats it
                output = latest[index] = delta.output
                logprobs = None
                if settings.logprobs and (delta.logprobs or echo_now):
                    logprobs = await output_completion_logprobs(settings.tokenizers, output, delta.logprobs or [],
                                                                len(echo) + delta.text_offset, echo_now)
                text = (echo if echo_now else "") + delta.text
                choice = CompletionChoice(index=index, text=text, logprobs=logprobs, finish_reason=output.finish_reason,
                                          stop_reason=output.stop_reason)
                if output.finished:
                    yield _sse(chunk([choice], [output], kvstrata=kvstrata_info(output)))
                elif choice.text or logprobs is not None:
                    yield _sse(chunk([choice], [output]))
            if settings.include_usage:
                yield _sse(_usage_chunk(chunk, latest, settings))
        except Exception as exc:  # noqa: BLE001 - the status line is sent: tell the client in the stream
            yield _sse_error(exc)
    yield _SSE_DONE


async def chat_events(streams: Sequence[AsyncIterator[RequestOutput]], settings: StreamSettings) -> AsyncIterator[str]:
    created = int(time.time())

    def chunk(choices: list[ChatStreamChoice], outputs: Sequence[RequestOutput], **extra) -> ChatCompletionChunk:
        if settings.continuous_usage and outputs:  # the role chunks come before any output
            extra.setdefault("usage", usage(outputs))
        return ChatCompletionChunk(id=settings.request_id, created=created, model=settings.model, choices=choices,
                                   **extra)

    latest: dict[int, RequestOutput] = {}
    async with contextlib.aclosing(_choice_deltas(streams)) as deltas:
        try:
            for index in range(len(streams)):
                yield _sse(chunk([ChatStreamChoice(index=index, delta=DeltaMessage(role="assistant", content=""))],
                                 []))
            async for index, delta in deltas:
                output = latest[index] = delta.output
                logprobs = None
                if settings.logprobs and delta.logprobs:
                    logprobs = chat_logprobs(delta.logprobs, await token_texts(settings.tokenizers, delta.logprobs))
                if delta.text or logprobs is not None:
                    content = ChatStreamChoice(index=index, delta=DeltaMessage(content=delta.text), logprobs=logprobs)
                    yield _sse(chunk([content], [output]))
                if output.finished:
                    finish = ChatStreamChoice(index=index, delta=DeltaMessage(), finish_reason=output.finish_reason,
                                              stop_reason=output.stop_reason)
                    yield _sse(chunk([finish], [output], kvstrata=kvstrata_info(output)))
            if settings.include_usage:
                yield _sse(_usage_chunk(chunk, latest, settings))
        except Exception as exc:  # noqa: BLE001 - the status line is sent: tell the client in the stream
            yield _sse_error(exc)
    yield _SSE_DONE


def _usage_chunk(chunk, latest: dict[int, RequestOutput], settings: StreamSettings):
    """The last chunk: no choices, the whole response's usage and receipt."""
    finals = [latest[i] for i in sorted(latest)]
    return chunk([], finals, usage=usage(finals, settings.choices_per_prompt), kvstrata=response_receipt(finals))
