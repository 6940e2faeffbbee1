"""The OpenAI-compatible HTTP server: `kvstrata serve`.

    POST /v1/completions        prompt (text or token ids) -> text; `stream: true` for server-sent events
    POST /v1/chat/completions   messages -> reply, through the model's chat template; streams the same way
    GET  /v1/models             the one model served
    GET  /health                200 while the engine runs
    GET  /metrics               Prometheus text: prefix-cache hits per tier, TTFT, tier usage, moves

Responses carry OpenAI's `usage` (with `prompt_tokens_details.cached_tokens`) and a `kvstrata`
object: `{"cached_tokens_by_tier": {"device": n, "cpu": n, "disk": n}, "ttft_ms": t}`. Every error
is OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`: 400 for a bad request (FastAPI's
422s included), 404 for an unknown model, 503 while shutting down.

The HTTP side never touches the engine: requests go through `AsyncEngine`, metrics come from the
snapshots its thread publishes. This module imports neither torch nor the engine at import time, so
that `kvstrata serve` reports a port in use before it spends time loading a model.
"""
from __future__ import annotations

import contextlib
import errno
import json
import signal
import socket
import threading
import time
import uuid
from typing import TYPE_CHECKING, Any, AsyncIterator, Literal, Union

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, model_serializer

from kvstrata import __version__
from kvstrata.engine.config import Config
from kvstrata.tiers.storage import format_bytes

if TYPE_CHECKING:
    from kvstrata.engine.async_engine import AsyncEngine
    from kvstrata.engine.llm import RequestOutput

# How long a SIGTERM waits for open requests before cancelling them (they are then aborted).
GRACEFUL_SHUTDOWN_S = 60
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's and vLLM's default for /v1/completions


# ---------------------------------------------------------------------------------------------
# Request models


class _OpenAIModel(BaseModel):
    # Clients send fields we do not use (user, logprobs: null, presence_penalty: 0, ...): accept them.
    model_config = ConfigDict(extra="allow")


class StreamOptions(_OpenAIModel):
    include_usage: bool = False


class _SamplingRequest(_OpenAIModel):
    model: str | None = None
    max_tokens: int | None = None
    # None (some clients send null for "unset"): OpenAI's defaults, temperature 1 and top_p 1; top_k off.
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    cache_salt: str | None = None  # isolates this request's cache entries from requests without the same salt
    ignore_eos: bool = False


class CompletionRequest(_SamplingRequest):
    # Text, token ids, or a batch of exactly one of them.
    prompt: Union[str, list[int], list[str], list[list[int]]]


class TextContentPart(_OpenAIModel):
    type: Literal["text"]
    text: str


class ChatMessage(_OpenAIModel):
    role: str
    content: Union[str, list[TextContentPart]]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens


# ---------------------------------------------------------------------------------------------
# Response models


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class KvstrataInfo(BaseModel):
    cached_tokens_by_tier: dict[str, int]
    ttft_ms: float | None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: str | None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    kvstrata: KvstrataInfo | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: None = None
    finish_reason: str | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    kvstrata: KvstrataInfo


class DeltaMessage(BaseModel):
    """What a chunk adds: the role (first chunk), some content, or nothing (the last chunk)."""

    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer
    def _given_fields_only(self) -> dict:
        return {name: value for name, value in (("role", self.role), ("content", self.content)) if value is not None}


class ChatStreamChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Usage | None = None
    kvstrata: KvstrataInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "kvstrata"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class APIError(Exception):
    """An error a client caused (or must be told of), answered in OpenAI's error shape."""

    def __init__(self, status_code: int, message: str, param: str | None = None, code: str | None = None,
                 error_type: str = "invalid_request_error"):
        super().__init__(message)
        self.status_code = status_code
        self.info = ErrorInfo(message=message, type=error_type, param=param, code=code)

    def response(self) -> JSONResponse:
        return JSONResponse(ErrorResponse(error=self.info).model_dump(), status_code=self.status_code)


# The request fields whose names start SamplingParams' error messages ("max_tokens must be ...").
_SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop")


def _bad_request(exc: ValueError) -> APIError:
    message = " ".join(str(exc).split())
    first_word = message.split(" ", 1)[0]
    param = first_word if first_word in _SAMPLING_FIELDS else None
    if message.startswith(("prompt", "messages")):
        param = message.split(" ", 1)[0].split("[", 1)[0]
    return APIError(400, message, param=param)


# ---------------------------------------------------------------------------------------------
# The app


def build_app(engine: AsyncEngine, model_id: str) -> FastAPI:
    """The FastAPI app serving `engine` under the model id `model_id`."""
    from kvstrata.engine.async_engine import EngineStoppedError
    from kvstrata.engine.sampling import SamplingParams

    app = FastAPI(title="kvstrata", version=__version__)
    created = int(time.time())
    max_model_len = engine.engine.max_model_len

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_error_to_api_error(exc).response()

    @app.exception_handler(EngineStoppedError)
    async def _engine_stopped(_: Request, exc: EngineStoppedError) -> JSONResponse:
        return APIError(503, str(exc), error_type="service_unavailable").response()

    def check_model(name: str | None) -> None:
        if name is not None and name != model_id:
            raise APIError(404, f"The model `{name}` does not exist; this server serves `{model_id}`.",
                           param="model", code="model_not_found")

    def sampling_params(body: _SamplingRequest, max_tokens: int | None) -> SamplingParams:
        if body.n != 1:
            raise APIError(400, f"n must be 1 (one choice per request), got {body.n}", param="n")
        try:
            return SamplingParams(max_tokens=max_tokens, temperature=_given(body.temperature, 1.0),
                                  top_p=_given(body.top_p, 1.0), top_k=_given(body.top_k, -1), seed=body.seed,
                                  stop=body.stop, ignore_eos=body.ignore_eos)
        except ValueError as exc:
            raise _bad_request(exc) from None

    def start(token_ids: list[int], params: SamplingParams, request_id: str, body: _SamplingRequest,
              prompt: str | None) -> AsyncIterator[RequestOutput]:
        try:
            return engine.generate(token_ids, params, request_id=request_id, cache_salt=body.cache_salt,
                                   prompt=prompt, arrival_time=time.perf_counter())
        except ValueError as exc:
            raise _bad_request(exc) from None

    @app.get("/health")
    async def health() -> dict:
        if not engine.is_running:
            raise APIError(503, "the engine is not running", error_type="service_unavailable")
        return {"status": "ok"}

    @app.get("/v1/models", response_model=ModelList)
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=model_id, created=created, max_model_len=max_model_len)])

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(engine.metrics.render(), media_type=engine.metrics.content_type)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest):
        check_model(body.model)
        prompt_text, token_ids = _completion_prompt(body.prompt, engine.engine.tokenize)
        max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens
        params = sampling_params(body, max_tokens)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        outputs = start(token_ids, params, request_id, body, prompt_text)
        if body.stream:
            return _SSEResponse(_completion_events(outputs, request_id, model_id, _include_usage(body)))
        final = await _last(outputs)
        return CompletionResponse(id=request_id, created=int(time.time()), model=model_id,
                                  choices=[CompletionChoice(text=final.text, finish_reason=final.finish_reason)],
                                  usage=_usage(final), kvstrata=_kvstrata(final))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest):
        check_model(body.model)
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            token_ids = engine.engine.apply_chat_template(messages)
        except ValueError as exc:
            raise APIError(400, str(exc), param="messages") from None
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        if max_tokens is None:  # as vLLM: whatever room the context leaves
            max_tokens = max(1, max_model_len - len(token_ids))
        params = sampling_params(body, max_tokens)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        outputs = start(token_ids, params, request_id, body, None)
        if body.stream:
            return _SSEResponse(_chat_events(outputs, request_id, model_id, _include_usage(body)))
        final = await _last(outputs)
        return ChatCompletionResponse(id=request_id, created=int(time.time()), model=model_id,
                                      choices=[ChatChoice(message=AssistantMessage(content=final.text),
                                                          finish_reason=final.finish_reason)],
                                      usage=_usage(final), kvstrata=_kvstrata(final))

    return app


def _given(value, default):
    return default if value is None else value


def _validation_error_to_api_error(exc: RequestValidationError) -> APIError:
    """FastAPI's 422 (a body that is not JSON, or not the request's shape) as OpenAI's 400."""
    errors = exc.errors()
    if not errors:
        return APIError(400, "invalid request body")
    first = errors[0]
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return APIError(400, f"the request body is not valid JSON{': ' + str(detail) if detail else ''}")
    location = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(location) or None
    message = first.get("msg", "invalid value")
    return APIError(400, f"{param}: {message}" if param else f"request body: {message}", param=param)


def _completion_prompt(prompt: Any, tokenize) -> tuple[str | None, list[int]]:
    """(text or None, token ids) of a completion prompt; a batch must hold exactly one prompt."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise APIError(400, f"prompt: one prompt per request, got a batch of {len(prompt)}", param="prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt, tokenize(prompt)
    return None, list(prompt)


def _include_usage(body: _SamplingRequest) -> bool:
    return body.stream_options is not None and body.stream_options.include_usage


async def _last(outputs: AsyncIterator[RequestOutput]) -> RequestOutput:
    final = None
    async with contextlib.aclosing(outputs):
        async for output in outputs:
            final = output
    assert final is not None and final.finished
    return final


def _usage(output: RequestOutput) -> Usage:
    prompt_tokens, completion_tokens = len(output.prompt_token_ids), len(output.token_ids)
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                 total_tokens=prompt_tokens + completion_tokens,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=output.cached_tokens))


def _kvstrata(output: RequestOutput) -> KvstrataInfo:
    ttft_ms = None if output.ttft_s is None else round(output.ttft_s * 1000.0, 3)
    return KvstrataInfo(cached_tokens_by_tier=dict(output.cached_tokens_by_tier), ttft_ms=ttft_ms)


# ---------------------------------------------------------------------------------------------
# Server-sent events


class _SSEResponse(StreamingResponse):
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
    # `usage` and `kvstrata` appear only on the chunks that carry them (the last ones).
    absent = {name for name in ("usage", "kvstrata") if getattr(chunk, name) is None}
    return f"data: {chunk.model_dump_json(exclude=absent)}\n\n"


_SSE_DONE = "data: [DONE]\n\n"


async def _completion_events(outputs: AsyncIterator[RequestOutput], request_id: str, model: str,
                             include_usage: bool) -> AsyncIterator[str]:
    created = int(time.time())

    def chunk(text: str, finish_reason: str | None, **extra) -> CompletionResponse:
        return CompletionResponse(id=request_id, created=created, model=model,
                                  choices=[CompletionChoice(text=text, finish_reason=finish_reason)], **extra)

    async with contextlib.aclosing(outputs):
        try:
            final = None
            async for final, delta in _text_deltas(outputs):
                if final.finished:
                    yield _sse(chunk(delta, final.finish_reason, kvstrata=_kvstrata(final)))
                elif delta:
                    yield _sse(chunk(delta, None))
            if include_usage:
                yield _sse(CompletionResponse(id=request_id, created=created, model=model, choices=[],
                                              usage=_usage(final), kvstrata=_kvstrata(final)))
        except Exception as exc:  # noqa: BLE001 - the status line is sent: tell the client in the stream
            yield _sse_error(exc)
    yield _SSE_DONE


async def _chat_events(outputs: AsyncIterator[RequestOutput], request_id: str, model: str,
                       include_usage: bool) -> AsyncIterator[str]:
    created = int(time.time())

    def chunk(delta: DeltaMessage, finish_reason: str | None, **extra) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=request_id, created=created, model=model,
                                   choices=[ChatStreamChoice(delta=delta, finish_reason=finish_reason)], **extra)

    async with contextlib.aclosing(outputs):
        try:
            yield _sse(chunk(DeltaMessage(role="assistant", content=""), None))
            final = None
            async for final, delta in _text_deltas(outputs):
                if delta:
                    yield _sse(chunk(DeltaMessage(content=delta), None))
                if final.finished:
                    yield _sse(chunk(DeltaMessage(), final.finish_reason, kvstrata=_kvstrata(final)))
            if include_usage:
                yield _sse(ChatCompletionChunk(id=request_id, created=created, model=model, choices=[],
                                               usage=_usage(final), kvstrata=_kvstrata(final)))
        except Exception as exc:  # noqa: BLE001 - the status line is sent: tell the client in the stream
            yield _sse_error(exc)
    yield _SSE_DONE


async def _text_deltas(outputs: AsyncIterator[RequestOutput]) -> AsyncIterator[tuple[RequestOutput, str]]:
    """(output, the text it adds). The engine's text only ever grows, so a delta is a suffix."""
    sent = 0
    async for output in outputs:
        delta, sent = output.text[sent:], len(output.text)
        yield output, delta


def _sse_error(exc: Exception) -> str:
    status = 400 if isinstance(exc, ValueError) else 500
    error_type = "invalid_request_error" if status == 400 else "server_error"
    info = ErrorInfo(message=" ".join(str(exc).split()) or type(exc).__name__, type=error_type)
    return f"data: {json.dumps({'error': info.model_dump()})}\n\n"


# ---------------------------------------------------------------------------------------------
# serve()


class _Server(uvicorn.Server):
    """uvicorn, minus one habit: after a graceful shutdown on SIGTERM or SIGINT it re-raises the
    signal, so the process would die by it before kvstrata writes its cache down. Here the signal
    only starts the graceful shutdown; `serve` then closes the engine and returns."""

    received_signal: int | None = None

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame) -> None:
        if self.received_signal is None:
            self.received_signal = sig
        super().handle_exit(sig, frame)


def bind_socket(host: str, port: int) -> socket.socket:
    """A socket bound to (host, port), so a port in use is reported before the model loads."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as exc:
        raise ValueError(f"server.host: cannot resolve {host!r}: {exc.strerror}") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise ValueError(f"server.port: {host}:{port} is already in use (choose another with --port)") from None
        raise ValueError(f"server.host: cannot listen on {host}:{port}: {exc.strerror}") from None
    return sock


def serve(config: Config) -> None:
    """Bind, load the model, print where we listen, serve until SIGTERM/SIGINT, then finish the
    in-flight requests and write the cache down to disk. Ctrl-C raises KeyboardInterrupt at the end
    (the CLI exits 130); SIGTERM returns normally (exit 0)."""
    sock = bind_socket(config.server.host, config.server.port)
    async_engine = None
    try:
        from kvstrata.engine.async_engine import AsyncEngine
        from kvstrata.engine.llm_engine import LLMEngine

        async_engine = AsyncEngine(LLMEngine(config))
        model_id = config.server.model_alias or config.model.name
        print(_banner(config, async_engine, model_id, sock), flush=True)
        server = _Server(uvicorn.Config(build_app(async_engine, model_id), log_level="warning",
                                        access_log=False, lifespan="off",
                                        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S))
        server.run(sockets=[sock])
    finally:
        sock.close()
        if async_engine is not None:
            async_engine.shutdown()
    disk = config.cache.tiers.disk
    print(f"kvstrata: stopped{f'; cache written down to {disk.path}' if disk else ''}", flush=True)
    if server.received_signal == signal.SIGINT:
        raise KeyboardInterrupt


def _banner(config: Config, async_engine: AsyncEngine, model_id: str, sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    url_host = f"[{host}]" if ":" in host else host
    engine = async_engine.engine
    stats = async_engine.snapshot.stats if async_engine.snapshot else engine.stats()
    tiers = stats["tiers"]
    dtype = f"{stats['dtype']}{' (auto)' if config.model.dtype == 'auto' else ''}"
    lines = [f"kvstrata {__version__} serving {model_id} ({dtype} on {stats['device']}, {stats['threads']} torch "
             f"thread{'s' if stats['threads'] != 1 else ''}, attention: {stats['attention_backend']}, "
             f"context {engine.max_model_len} tokens)",
             f"  listening on http://{url_host}:{port}  (OpenAI API under /v1, Prometheus at /metrics)"]
    for name in ("device", "cpu", "disk"):
        tier = tiers.get(name)
        if tier is None:
            lines.append(f"  {name + ' tier:':<13}off")
            continue
        where = f" at {config.cache.tiers.disk.path}" if name == "disk" else ""
        lines.append(f"  {name + ' tier:':<13}{format_bytes(tier['capacity_bytes'])} "
                     f"({tier['capacity_blocks']} blocks of {config.cache.block_size} tokens){where}")
    return "\n".join(lines)

