"""The OpenAI-compatible HTTP API: the FastAPI app and its routes.

    POST /v1/completions        prompt (text or token ids) -> text; `stream: true` for server-sent events
    POST /v1/chat/completions   messages -> reply, through the model's chat template; streams the same way
    GET  /v1/models             the one model served
    POST /tokenize              vLLM's: a prompt's (or chat's) token ids, their count and the context length
    POST /detokenize            vLLM's: token ids to text
    GET  /health                200 while the engine runs and the server is not draining, with the
                                engine's block naming (what a router hashes prompts by)
    GET  /metrics               Prometheus text: prefix-cache hits per tier, TTFT, tier usage, moves
    POST /v1/cache/documents    messages or prompt -> its blocks computed and stored (pinned unless `pin: false`)
    GET  /v1/cache/documents    the documents cached, with the blocks each tier holds
    DELETE /v1/cache/documents/{id}   unpin and forget a document (its blocks become evictable again)
    POST /reset_prefix_cache    vLLM's: forget the blocks cached on the device (the lower tiers keep theirs)

Responses carry OpenAI's `usage` (with `prompt_tokens_details.cached_tokens`) and a `kvstrata`
object, the request's cache receipt: `cached_tokens_by_tier` (device, cpu, disk, remote), `ttft_ms` and its
measured parts (`queue_ms`, `lookup_ms`, `load_ms_by_tier`, `prefill_ms`), and `prefill_saved_ms_estimate`
(engine/receipt.py). Every error is OpenAI's shape (`errors.py`).

The routes never touch the engine: requests go through `AsyncEngine`, metrics come from the
snapshots its thread publishes, prompts are tokenized on the tokenizer threads. A client that hangs
up has its request aborted, streaming or not. This module imports no torch (the engine's heavy
modules are imported inside `build_app`), so that `kvstrata serve` reports a port in use before it
spends time loading a model.
"""
from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import asdict
from functools import partial
from typing import TYPE_CHECKING, Any, AsyncIterator, Awaitable, Callable, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import Response

from kvstrata import __version__
from kvstrata.engine.prompts import render_chat, render_document, tokenize_text
from kvstrata.serving.errors import APIError, install_error_handlers, service_unavailable
from kvstrata.serving.metrics import ServingMetrics
from kvstrata.serving.middleware import AccessLog, APIKeyCheck, BodySizeLimit, DrainState, RequestGate
from kvstrata.serving.responses import (SSEResponse, StreamSettings, chat_events, chat_logprobs, choice_receipt,
                                        completion_events, json_response, last_outputs, output_completion_logprobs,
                                        prompt_logprobs_by_token, response_receipt, token_texts, usage)
from kvstrata.serving.schemas import (AssistantMessage, ChatChoice, ChatCompletionRequest, ChatCompletionResponse,
                                      ChatLogprobs, CompletionChoice, CompletionRequest, CompletionResponse,
                                      DetokenizeRequest, DetokenizeResponse, DocumentDeleted, DocumentList,
                                      DocumentObject, DocumentRequest, ModelCard, ModelList, PrefixCacheReset,
                                      SamplingRequest, TokenizeRequest, TokenizeResponse, message_dicts)
from kvstrata.serving.tokenizer_pool import TokenizerPool

if TYPE_CHECKING:
    from kvstrata.engine.async_engine import AsyncEngine
    from kvstrata.engine.llm import RequestOutput

T = TypeVar("T")

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's and vLLM's default for /v1/completions
MAX_CHOICES_PER_REQUEST = 2048  # prompts x n: each choice is an engine request of its own

# The request fields on how a chat is rendered, whose names start the rendering's error messages
_RENDERING_FIELDS = ("add_generation_prompt", "continue_final_message", "chat_template_kwargs")

# The SamplingParams fields whose names start their error messages ("max_tokens must be ..."),
# which are the request fields of the same name unless a route says otherwise.
_SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
                    "min_tokens", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias",
                    "logprobs", "n", "structured_outputs")
# ... and those with another name in every request
_REQUEST_NAMES = {"structured_outputs": "response_format"}


def build_app(engine: AsyncEngine, model_id: str, *, metrics: ServingMetrics, tokenizers: TokenizerPool,
              api_key: str | None = None, max_request_body: int, drain: DrainState | None = None,
              access_log: bool = False) -> FastAPI:
    """The app serving `engine` under the model id `model_id`. `drain`: shared with the server,
    which sets `draining` on SIGTERM. `access_log`: a line per request (`server.access_log`)."""
    from kvstrata.engine.async_engine import EngineStoppedError
    from kvstrata.engine.documents import PinLimitError, UnknownDocumentError
    from kvstrata.engine.request import RequestFailedError
    from kvstrata.engine.sampling import SamplingParams

    drain = drain or DrainState()
    app = FastAPI(title="kvstrata", version=__version__, docs_url=None, redoc_url=None, openapi_url=None)
    install_error_handlers(app)
    # Outermost last: the key is checked first, then the gate, then the body's size.
    app.add_middleware(BodySizeLimit, max_bytes=max_request_body)
    app.add_middleware(RequestGate, state=drain)
    app.add_middleware(APIKeyCheck, api_key=api_key)
    if access_log:  # outermost: a refused request (401, 413, 503) is logged too
        app.add_middleware(AccessLog)
    created = int(time.time())
    max_model_len = engine.engine.max_model_len
    # a router names a prompt's blocks by it, to find them in this replica's KV events
    block_naming = engine.engine.block_naming.to_json()

    @app.exception_handler(EngineStoppedError)
    async def _engine_stopped(_: Request, exc: EngineStoppedError) -> Response:
        return service_unavailable(str(exc)).response()

    @app.exception_handler(RequestFailedError)
    async def _request_failed(_: Request, exc: RequestFailedError) -> Response:
        # the engine logged the traceback once and serves the other requests: this client hears one line
        return APIError(500, str(exc), error_type="server_error").response()

    def check_model(name: str | None) -> None:
        if name is not None and name != model_id:
            raise APIError(404, f"The model `{name}` does not exist; this server serves `{model_id}`.",
                           param="model", code="model_not_found")

    def sampling_params(body: SamplingRequest, max_tokens: int | None, logprobs: int | None,
                        field_names: dict[str, str], prompt_logprobs: int | None = None) -> SamplingParams:
        if body.stream and body.prompt_logprobs is not None:  # as vLLM: its streams carry none
            raise APIError(400, "prompt_logprobs: not available with stream: true; ask for a whole response",
                           param="prompt_logprobs")
        if body.stream_options is not None and not body.stream:  # as vLLM and OpenAI: it would ask for nothing
            raise APIError(400, "stream_options: only with stream: true", param="stream_options")
        try:
            return SamplingParams(max_tokens=max_tokens, temperature=_given(body.temperature, 1.0),
                                  top_p=_given(body.top_p, 1.0), top_k=_given(body.top_k, -1),
                                  min_p=_given(body.min_p, 0.0), seed=body.seed, stop=body.stop,
                                  stop_token_ids=_given(body.stop_token_ids, []), ignore_eos=bool(body.ignore_eos),
                                  min_tokens=_given(body.min_tokens, 0),
                                  presence_penalty=_given(body.presence_penalty, 0.0),
                                  frequency_penalty=_given(body.frequency_penalty, 0.0),
                                  repetition_penalty=_given(body.repetition_penalty, 1.0),
                                  logit_bias=_given(body.logit_bias, {}), logprobs=logprobs,
                                  prompt_logprobs=prompt_logprobs, n=body.choices_per_prompt,
                                  include_stop_str_in_output=bool(body.include_stop_str_in_output),
                                  skip_special_tokens=_given(body.skip_special_tokens, True),
                                  structured_outputs=body.response_format and body.response_format.structured_outputs())
        except ValueError as exc:
            raise _bad_request(exc, field_names) from None

    async def tokenize(render, what, param: str) -> list[int]:
        try:
            return await tokenizers.run(render, what)
        except ValueError as exc:
            raise _bad_request(exc, {}, default_param=param) from None

    async def messages_or_prompt(body: TokenizeRequest | DocumentRequest, render_messages, render_prompt, what: str):
        """The body's `messages` or `prompt` (exactly one of them) rendered on a tokenizer thread."""
        if (body.messages is None) == (body.prompt is None):
            raise APIError(400, f"give {what} as `messages` or as `prompt` (one of them)", param="messages")
        if body.messages is not None:
            return await tokenize(render_messages, message_dicts(body.messages), "messages")
        return await tokenize(render_prompt, body.prompt, "prompt")

    async def start(prompts: list[tuple[str | None, list[int]]], params: SamplingParams, request_id: str,
                    body: SamplingRequest) -> list[AsyncIterator[RequestOutput]]:
        """One engine request per choice: `n` for each prompt, choice k*n + i being prompt k's i-th.
        All are validated before any is queued (a request is queued when its outputs are first read).
        Choice i samples with `params.for_choice(i)` (with a seed, seed + i)."""
        n = params.n
        if len(prompts) * n > MAX_CHOICES_PER_REQUEST:
            raise APIError(400, f"n: {len(prompts)} prompts with n={n} ask for {len(prompts) * n} choices; at most "
                                f"{MAX_CHOICES_PER_REQUEST} in one request", param="n")
        several = len(prompts) * n > 1
        arrival = time.perf_counter()
        try:
            await engine.prepare(params)  # a structured request's grammar, compiled off the event loop
            return [engine.generate(token_ids, params.for_choice(i), cache_salt=body.cache_salt, prompt=text,
                                    request_id=f"{request_id}-{k * n + i}" if several else request_id,
                                    arrival_time=arrival)
                    for k, (text, token_ids) in enumerate(prompts) for i in range(n)]
        except ValueError as exc:
            raise _bad_request(exc, {}) from None

    def stream_settings(body: SamplingRequest, request_id: str, logprobs: bool) -> StreamSettings:
        return StreamSettings(request_id, model_id, body.include_usage, body.continuous_usage, logprobs, tokenizers,
                              body.choices_per_prompt)

    async def respond(request: Request, body: SamplingRequest, streams: list[AsyncIterator[RequestOutput]],
                      events: Callable[[], AsyncIterator[str]],
                      whole: Callable[[list[RequestOutput]], Awaitable[Any]]):
        """Stream the choices' events, or wait for every choice's last output (aborting them all if
        the client hangs up first) and answer with the whole response built from them."""
        if body.stream:
            return SSEResponse(events())
        finals = await _unless_disconnected(request, last_outputs(streams))
        if finals is None:
            return Response(status_code=499)  # nobody is listening: the requests were aborted
        return await json_response(tokenizers, await whole(finals))

    async def chat_choice_logprobs(final: RequestOutput) -> ChatLogprobs | None:
        """The output's logprobs in the chat shape, or None when the request asked for none."""
        if final.logprobs is None:
            return None
        return chat_logprobs(final.logprobs, await token_texts(tokenizers, final.logprobs))

    @app.get("/health")
    async def health() -> dict:
        if drain.draining:
            raise service_unavailable("the server is shutting down")
        if not engine.is_running:
            raise service_unavailable("the engine is not running")
        return {"status": "ok", "block_naming": block_naming}

    @app.get("/v1/models", response_model=ModelList)
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=model_id, created=created, max_model_len=max_model_len)])

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=metrics.content_type)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_model(body.model)
        prompts = await asyncio.gather(*(completion_prompt(p) for p in body.prompt))
        max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens
        params = sampling_params(body, max_tokens, body.logprobs, {}, _prompt_alternatives(body))
        request_id = f"cmpl-{uuid.uuid4().hex}"
        streams = await start(prompts, params, request_id, body)
        settings = stream_settings(body, request_id, body.logprobs is not None)
        n = body.choices_per_prompt
        if body.echo:
            settings.echoes = [text if text is not None
                               else await tokenize(partial(decode_known_ids, field="prompt"), token_ids, "prompt")
                               for text, token_ids in prompts]

        async def whole(finals: list[RequestOutput]) -> CompletionResponse:
            choices, prompt_logprobs = [], {}
            for i, final in enumerate(finals):
                echo = settings.echoes[i // n] if settings.echoes is not None else ""
                logprobs = None
                if final.logprobs is not None:
                    logprobs = await output_completion_logprobs(tokenizers, final, final.logprobs, len(echo),
                                                                settings.echoes is not None, body.logprobs)
                if body.prompt_logprobs is not None and i // n not in prompt_logprobs:  # once per prompt
                    prompt_logprobs[i // n] = await prompt_logprobs_by_token(tokenizers, final, body.prompt_logprobs)
                choices.append(CompletionChoice(index=i, text=echo + final.text, logprobs=logprobs,
                                                finish_reason=final.finish_reason, stop_reason=final.stop_reason,
                                                prompt_logprobs=prompt_logprobs.get(i // n),
                                                kvstrata=choice_receipt(final, finals)))
            return CompletionResponse(id=request_id, created=int(time.time()), model=model_id, choices=choices,
                                      usage=usage(finals, n), kvstrata=response_receipt(finals))

        return await respond(request, body, streams, lambda: completion_events(streams, settings), whole)

    async def completion_prompt(prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, await tokenize(tokenize_text, prompt, "prompt")
        return None, prompt

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_model(body.model)
        if body.top_logprobs and not body.logprobs:
            raise APIError(400, "top_logprobs: needs logprobs: true", param="top_logprobs")
        token_ids = await tokenize(partial(render_chat, **body.rendering), message_dicts(body.messages), "messages")
        max_tokens, max_tokens_field = body.max_tokens, "max_tokens"
        if body.max_completion_tokens is not None:
            if max_tokens not in (None, body.max_completion_tokens):  # two limits: which one was meant is unsaid
                raise APIError(400, "max_completion_tokens: differs from max_tokens (its older name); give one",
                               param="max_completion_tokens")
            max_tokens, max_tokens_field = body.max_completion_tokens, "max_completion_tokens"
        if max_tokens is None:  # as vLLM: whatever room the context leaves
            max_tokens = max(1, max_model_len - len(token_ids))
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        params = sampling_params(body, max_tokens, logprobs,
                                 {"max_tokens": max_tokens_field, "logprobs": "top_logprobs"}, body.prompt_logprobs)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        streams = await start([(None, token_ids)], params, request_id, body)
        settings = stream_settings(body, request_id, logprobs is not None)

        async def whole(finals: list[RequestOutput]) -> ChatCompletionResponse:
            choices = [ChatChoice(index=i, message=AssistantMessage(content=final.text),
                                  logprobs=await chat_choice_logprobs(final),
                                  finish_reason=final.finish_reason, stop_reason=final.stop_reason,
                                  kvstrata=choice_receipt(final, finals))
                       for i, final in enumerate(finals)]
            prompt_logprobs = None
            if body.prompt_logprobs is not None:
                prompt_logprobs = await prompt_logprobs_by_token(tokenizers, finals[0], body.prompt_logprobs)
            return ChatCompletionResponse(id=request_id, created=int(time.time()), model=model_id, choices=choices,
                                          usage=usage(finals, body.choices_per_prompt),
                                          prompt_logprobs=prompt_logprobs, kvstrata=response_receipt(finals))

        return await respond(request, body, streams, lambda: chat_events(streams, settings), whole)

    @app.post("/tokenize", response_model=TokenizeResponse)
    async def tokenize_prompt(body: TokenizeRequest) -> TokenizeResponse:
        check_model(body.model)
        token_ids = await messages_or_prompt(body, partial(render_chat, **body.rendering), tokenize_text, "the prompt")
        return TokenizeResponse(count=len(token_ids), max_model_len=max_model_len, tokens=token_ids)

    @app.post("/detokenize", response_model=DetokenizeResponse)
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        check_model(body.model)
        return DetokenizeResponse(prompt=await tokenize(decode_known_ids, body.tokens, "tokens"))

    @app.post("/v1/cache/documents", response_model=DocumentObject)
    async def cache_document(body: DocumentRequest) -> DocumentObject:
        check_model(body.model)
        document = await messages_or_prompt(body, lambda tok, m: render_document(tok, messages=m),
                                            lambda tok, p: render_document(tok, prompt=p), "the document")
        try:
            return DocumentObject(**asdict(await engine.cache_document(document, body.cache_salt, body.pin)))
        except PinLimitError as exc:
            raise APIError(409, str(exc), param="pin", code="pin_limit_exceeded") from None
        except ValueError as exc:
            message = str(exc)
            raise APIError(400, message, param="pin" if message.startswith("pin:") else
                           "messages" if body.messages is not None else "prompt") from None

    @app.get("/v1/cache/documents", response_model=DocumentList)
    async def list_documents() -> DocumentList:
        documents = await engine.call(lambda e: e.documents.list())
        return DocumentList(data=[DocumentObject(**asdict(d)) for d in documents])

    @app.delete("/v1/cache/documents/{document_id}", response_model=DocumentDeleted)
    async def unpin_document(document_id: str) -> DocumentDeleted:
        try:
            await engine.call(lambda e: e.documents.unpin(document_id))
        except UnknownDocumentError as exc:
            raise APIError(404, str(exc), param="document_id", code="document_not_found") from None
        return DocumentDeleted(id=document_id)

    @app.post("/reset_prefix_cache", response_model=PrefixCacheReset)
    async def reset_prefix_cache(reset_external: bool = False) -> PrefixCacheReset:
        # Only while nothing holds a device block: a running request's prefix cannot be forgotten.
        reset = await engine.call(lambda e: e.reset_prefix_cache(reset_external))
        if reset.busy:
            raise APIError(409, "requests are running: the prefix cache can be reset only when the server is idle",
                           code="server_busy")
        if reset.not_cleared:
            raise APIError(503, f"the {' and '.join(reset.not_cleared)} tier could not be cleared (unreachable; it "
                           f"keeps its blocks); the {', '.join(reset.tiers)} tiers were", code="tier_unavailable")
        return PrefixCacheReset(tiers=reset.tiers)

    return app


def decode_known_ids(tokenizer, token_ids: list[int], field: str = "tokens") -> str:
    """The text of `token_ids`; a ValueError names the first id the tokenizer does not know (and the
    request's `field` that holds them)."""
    vocab_size = len(tokenizer)
    unknown = next((t for t in token_ids if not 0 <= t < vocab_size), None)
    if unknown is not None:
        raise ValueError(f"{field}: token id {unknown} is outside the vocabulary (0 to {vocab_size - 1})")
    return tokenizer.decode(token_ids)


def _prompt_alternatives(body: CompletionRequest) -> int | None:
    """How many alternatives the engine reports for each prompt token: the most that `prompt_logprobs`
    and an echo with `logprobs` ask for (or a negative number asked, for SamplingParams to refuse)."""
    asked = [k for k in (body.prompt_logprobs, body.logprobs if body.echo else None) if k is not None]
    if not asked:
        return None
    return min(asked) if min(asked) < 0 else max(asked)


def _given(value, default):
    return default if value is None else value


def _bad_request(exc: ValueError, field_names: dict[str, str], default_param: str | None = None) -> APIError:
    """A ValueError of the engine's (SamplingParams, request validation, rendering a prompt) as a 400
    naming the request field it is about: its message starts with the field's name (else
    `default_param`, the field the failing work read)."""
    message = " ".join(str(exc).split())
    name = message.split(" ", 1)[0].rstrip(":")
    param = default_param
    if name in _SAMPLING_FIELDS:
        param = field_names.get(name, _REQUEST_NAMES.get(name, name))
        message = param + message[len(name):]  # the request's name for it, e.g. top_logprobs
    elif name in _RENDERING_FIELDS:
        param = name
    elif name.startswith(("prompt", "messages")):
        param = name.split("[", 1)[0]
    return APIError(400, message, param=param)


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """The result of `work`, or None if the client hangs up first: `work` is then cancelled, which
    closes its outputs and so aborts its request (as a stream's is when its client goes away)."""
    work_task = asyncio.ensure_future(work)
    watch_task = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait((work_task, watch_task), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch_task.cancel()
        if not work_task.done():
            work_task.cancel()
            await asyncio.gather(work_task, return_exceptions=True)
    return None if work_task.cancelled() else work_task.result()


async def _disconnect(request: Request) -> Any:
    """Returns when the client disconnects (the body has been read: nothing else can arrive)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
