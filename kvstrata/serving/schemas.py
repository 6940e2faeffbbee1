"""OpenAI's request and response shapes, as this server speaks them.

Requests say exactly what they ask. A field the server implements is validated. A field it does not
implement is accepted only at the value that asks for nothing (null, or its no-op default, as the
official `openai` client and benchmark clients such as guidellm send them); any other value is a
400 naming the field, never silently ignored. A field the server has never heard of is a 400 too.
Every string must be valid Unicode (JSON can carry a lone surrogate, which no tokenizer encodes).
"""
from __future__ import annotations

from typing import Annotated, Any, Generic, Literal, TypeVar

from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_serializer,
                      model_validator)
from typing_extensions import TypedDict  # pydantic reads typing's only from Python 3.12

from kvstrata.engine.prompts import unicode_problem
from kvstrata.engine.structured_outputs import StructuredOutputsParams


def _valid_unicode(text: str) -> str:
    problem = unicode_problem(text)
    if problem is not None:
        raise ValueError(f"not valid Unicode text: {problem}")
    return text


def _not_a_bool(value: Any) -> Any:
    # JSON's true is no number: pydantic would take it as 1 (`max_tokens: true` asking for one token)
    if isinstance(value, bool):
        raise ValueError(f"expected a number, got {str(value).lower()}")
    return value


Text = Annotated[str, AfterValidator(_valid_unicode)]
Int = Annotated[int, BeforeValidator(_not_a_bool)]
Number = Annotated[float, BeforeValidator(_not_a_bool)]
Item = TypeVar("Item")


def _no_op_only(*no_op_values: Any):
    """The type of a field this server does not implement: null or one of `no_op_values` only."""

    def check(value: Any) -> Any:
        if value is None or any(type(value) is type(v) and value == v for v in no_op_values):
            return value
        accepted = " or ".join(repr(v) for v in no_op_values)
        raise ValueError(f"not supported by this server (it accepts only null{' or ' if accepted else ''}{accepted})")

    return Annotated[Any, AfterValidator(check)]


# ---------------------------------------------------------------------------------------------
# Requests


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Request):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None  # vLLM's: usage on every chunk, not only a last one


class JsonSchemaFormat(_Request):
    """OpenAI's `response_format.json_schema`: the schema the answer's JSON must follow."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: Text | None = None
    description: Text | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None  # the schema is always followed strictly here


class ResponseFormat(_Request):
    """OpenAI's `response_format`: plain text, any JSON object, or JSON following a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given_for_json_schema(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema: give it with type 'json_schema' (and only then)")
        return self

    def structured_outputs(self) -> StructuredOutputsParams | None:
        """The engine's form of it; None for text."""
        if self.type == "text":
            return None
        if self.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        return StructuredOutputsParams(json=self.json_schema.schema_)


class SamplingRequest(_Request):
    model: Text | None = None
    max_tokens: Int | None = None
    # None (some clients send null for "unset"): OpenAI's defaults, temperature 1 and top_p 1; top_k off.
    temperature: Number | None = None
    top_p: Number | None = None
    top_k: Int | None = None
    seed: Int | None = None
    stop: Any = None  # a string or a list of them; validated below
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: Int | None = None  # choices per prompt, each sampled by its own request (sharing the prompt's blocks)
    cache_salt: Text | None = None  # isolates this request's cache entries from requests without the same salt
    ignore_eos: bool | None = False
    user: Text | None = None  # the caller's name for its end user: nothing for the server to do
    presence_penalty: Number | None = None
    frequency_penalty: Number | None = None
    repetition_penalty: Number | None = None  # vLLM's
    logit_bias: dict[int, Number] | None = None  # OpenAI's: token ids (as JSON keys, strings) to a bias
    min_p: Number | None = None
    min_tokens: Int | None = None
    stop_token_ids: list[Int] | None = None
    # vLLM's: each prompt token's log-probability, rank and `prompt_logprobs` likeliest alternatives
    # (whole responses only, as vLLM)
    prompt_logprobs: Int | None = None
    include_stop_str_in_output: bool | None = None  # vLLM's: the stop string stays at the answer's end
    skip_special_tokens: bool | None = None  # vLLM's (default true): special tokens' text left out
    spaces_between_special_tokens: _no_op_only(True) = None  # vLLM's; for slow tokenizers only
    response_format: ResponseFormat | None = None  # OpenAI's (chat); vLLM takes it for completions too

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, stop: Any) -> str | list[str] | None:
        if stop is None:
            return None
        if isinstance(stop, str) or (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
            for text in [stop] if isinstance(stop, str) else stop:
                _valid_unicode(text)
            return stop
        raise ValueError("expected a string or a list of strings")

    @property
    def choices_per_prompt(self) -> int:
        return 1 if self.n is None else self.n  # its range is SamplingParams' to check

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and bool(self.stream_options.continuous_usage_stats)


class CompletionRequest(SamplingRequest):
    # Text or token ids, or a batch of them: validated into a list of prompts, each text or token ids.
    prompt: Any
    logprobs: Int | None = None  # how many alternatives to report with each token's log-probability
    best_of: _no_op_only(1) = None
    echo: bool | None = None  # the prompt's text (and, with logprobs, its tokens' log-probabilities) first
    suffix: _no_op_only("") = None

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, prompt: Any) -> list[str | list[int]]:
        batch = prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) else [prompt]
        return [_one_prompt(p, f"item {k} of the batch: " if len(batch) > 1 else "") for k, p in enumerate(batch)]


def _one_prompt(prompt: Any, where: str) -> str | list[int]:
    if isinstance(prompt, str):
        return _valid_unicode(prompt)
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    raise ValueError(f"{where}expected a string, a list of token ids, or a batch of them")


class ChatMessage(_Request):
    role: Text  # any the chat template renders (vLLM's rule), but never empty
    content: Any  # a string, or a list of text parts; validated into one string
    name: _no_op_only() = None

    @field_validator("role")
    @classmethod
    def _a_role(cls, role: str) -> str:
        if not role.strip():
            raise ValueError("expected a role such as 'system', 'user' or 'assistant'")
        return role

    @field_validator("content")
    @classmethod
    def _text(cls, content: Any) -> str:
        if isinstance(content, str):
            return _valid_unicode(content)
        if isinstance(content, list):
            texts = []
            for i, part in enumerate(content):
                if isinstance(part, dict) and part.get("type") == "text" and set(part) - {"type", "text"}:
                    raise ValueError(f"part {i}: a text part takes 'type' and 'text' only, got "
                                     f"{', '.join(repr(k) for k in sorted(set(part) - {'type', 'text'}))} too")
                if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise ValueError(f"part {i}: only text parts ({{'type': 'text', 'text': ...}}) are supported, "
                                     f"got {kind!r}")
                texts.append(_valid_unicode(part["text"]))
            return "".join(texts)
        raise ValueError("expected a string or a list of text parts")


def message_dicts(messages: list[ChatMessage]) -> list[dict]:
    """Validated messages as the chat template takes them (each content one string)."""
    return [{"role": m.role, "content": m.content} for m in messages]


class ChatRendering(_Request):
    """vLLM's fields for how the messages are rendered: `add_generation_prompt` (default true: the
    prompt for the assistant's reply); `continue_final_message` (the last message left open for the
    model to continue); `chat_template_kwargs` (more variables for the chat template)."""

    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @property
    def rendering(self) -> dict:
        """`render_chat`'s keyword arguments."""
        return {"add_generation_prompt": self.add_generation_prompt is not False,
                "continue_final_message": bool(self.continue_final_message),
                "template_kwargs": self.chat_template_kwargs}


class ChatCompletionRequest(SamplingRequest, ChatRendering):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Int | None = None  # OpenAI's newer name for max_tokens
    logprobs: bool | None = None
    top_logprobs: Int | None = None
    echo: _no_op_only(False) = None
    tools: _no_op_only([]) = None
    tool_choice: _no_op_only("none", "auto") = None
    functions: _no_op_only([]) = None
    function_call: _no_op_only("none", "auto") = None
    parallel_tool_calls: bool | None = None  # means nothing without tools
    store: _no_op_only(False) = None
    metadata: _no_op_only({}) = None
    service_tier: _no_op_only("auto", "default") = None
    modalities: _no_op_only(["text"]) = None
    audio: _no_op_only() = None
    prediction: _no_op_only() = None
    reasoning_effort: _no_op_only() = None
    web_search_options: _no_op_only() = None


class DocumentRequest(_Request):
    """`POST /v1/cache/documents`: the start that questions will share, computed and stored now.

    `messages`: the conversation's start, whose last message the questions extend (rendered open:
    no end of turn, no generation prompt); or `prompt`: text that completions extend. `pin` keeps
    its blocks in the CPU and disk tiers until `DELETE /v1/cache/documents/{id}`.
    """

    model: Text | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    prompt: Text | None = None
    cache_salt: Text | None = None
    pin: bool = True


class TokenizeRequest(ChatRendering):
    """`POST /tokenize` (vLLM's): a prompt's token ids as a completion (`prompt`) or a chat
    (`messages`, rendered as a chat request with the same rendering fields) would compute them."""

    model: Text | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: _no_op_only(True) = None


class DetokenizeRequest(_Request):
    """`POST /detokenize` (vLLM's): token ids back to text."""

    model: Text | None = None
    tokens: list[Int]


# ---------------------------------------------------------------------------------------------
# Responses


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class KvstrataInfo(BaseModel):
    """The request's cache receipt (engine/receipt.py; docs/http.md, "Cache receipts"): measured milliseconds,
    queue + lookup + load + prefill = ttft. The parts are null only if no token was generated."""

    cached_tokens_by_tier: dict[str, int]
    ttft_ms: float | None
    recomputed_tokens_by_tier: dict[str, int] | None = None  # found in a tier, recomputed (cache.load_policy)
    queue_ms: float | None = None
    lookup_ms: float | None = None
    load_ms_by_tier: dict[str, float] | None = None
    prefill_ms: float | None = None
    prefill_saved_ms_estimate: float | None = None


# vLLM's `stop_reason` of a choice: the stop string or stop token id that ended the answer (None: the
# end of sequence or a length limit)
StopReason = str | int | None


class CompletionLogprobs(BaseModel):
    """The legacy completions shape: parallel lists, one entry per generated token."""

    tokens: list[str]
    token_logprobs: list[float | None]          # None: an echoed prompt's first token (nothing predicts it)
    top_logprobs: list[dict[str, float] | None]  # the most likely tokens and the chosen one, by text
    text_offset: list[int]                # where each token starts in the generated text


class PromptLogprob(TypedDict):
    """vLLM's entry of `prompt_logprobs`: one token's log-probability at a prompt position (a plain
    dict: a long prompt has hundreds of thousands of them)."""

    logprob: float
    rank: int            # 1: no token was likelier
    decoded_token: str


# vLLM's `prompt_logprobs`: None for the first prompt token (nothing predicts it), then for each next
# one its token and the likeliest alternatives, by token id (a JSON key, so a string)
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class _ShownWhenGiven(BaseModel):
    """A response part whose `kvstrata` and `prompt_logprobs` appear only when they are given."""

    @model_serializer(mode="wrap")
    def _given_only(self, serialize) -> dict:
        fields = serialize(self)
        for name in ("kvstrata", "prompt_logprobs"):
            if fields.get(name) is None:
                fields.pop(name, None)
        return fields


class _Choice(_ShownWhenGiven):
    """A choice of a whole response. With several choices, each carries its own receipt as `kvstrata`
    (the response's is its first token's); with one, only the response carries it."""


class CompletionChoice(_Choice):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None
    stop_reason: StopReason = None
    prompt_logprobs: PromptLogprobs | None = None
    kvstrata: KvstrataInfo | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    kvstrata: KvstrataInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]  # the token's text as UTF-8


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(_Choice):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None
    stop_reason: StopReason = None
    kvstrata: KvstrataInfo | None = None


class ChatCompletionResponse(_ShownWhenGiven):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's, of the rendered conversation
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
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: StopReason = None


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


class ObjectList(BaseModel, Generic[Item]):
    """OpenAI's shape of a listing."""

    object: Literal["list"] = "list"
    data: list[Item]


ModelList = ObjectList[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int  # so a client can tell whether the prompt fits (with room for the answer)
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class DocumentObject(BaseModel):
    id: str
    object: Literal["cache.document"] = "cache.document"
    num_tokens: int            # of the rendered document
    num_cached_tokens: int     # in its full blocks: what a question extending it finds cached
    pinned: bool
    salted: bool               # cached under a cache_salt (never shown)
    blocks_by_tier: dict[str, int]  # its blocks each tier holds now


DocumentList = ObjectList[DocumentObject]


class DocumentDeleted(BaseModel):
    id: str
    object: Literal["cache.document.deleted"] = "cache.document.deleted"
    deleted: bool = True


class PrefixCacheReset(BaseModel):
    """`POST /reset_prefix_cache`: the tiers whose cached blocks were forgotten."""

    object: Literal["prefix_cache.reset"] = "prefix_cache.reset"
    tiers: list[str] = ["device"]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
