"""Bad and unusual input to the Python API (`LLM.generate`, `chat`, the documents): refused up front in one line
naming the argument, nothing queued; vLLM's spellings (dict prompts, `use_tqdm`, `lora_request=None`,
`get_tokenizer()`) taken as vLLM takes them; a closed LLM refuses every call that needs its engine."""
from __future__ import annotations

import re

import pytest

from kvstrata import LLM, SamplingParams
from kvstrata.engine.documents import UnknownDocumentError

pytestmark = pytest.mark.slow

PROMPT = "The three primary colours of light are"
DOCUMENT = "The quick brown fox jumps over the lazy dog. " * 5  # more than one full block
GREEDY = SamplingParams(max_tokens=3, temperature=0.0)
CHAT = [{"role": "user", "content": "Name a primary colour."}]


def config(path) -> dict:
    return {"model": {"dtype": "float32", "device": "cpu", "max_model_len": 256},
            "cache": {"tiers": {"device": {"size": 64}, "disk": {"path": str(path), "size": "64MiB"}}}}


@pytest.fixture(scope="module")
def llm(embedded_model_fp32, tmp_path_factory):
    with LLM(config(tmp_path_factory.mktemp("kv")), loaded_model=embedded_model_fp32) as llm:
        yield llm


def refused(llm: LLM, error: type[Exception], message: str, call) -> None:
    """`call` raises `error`, one line matching `message`, and leaves nothing queued or cached behind."""
    documents = llm.list_documents()
    with pytest.raises(error, match=message) as info:
        call()
    assert "\n" not in str(info.value)
    assert llm.engine.requests == {} and not llm.engine.has_unfinished_requests()
    assert llm.list_documents() == documents


@pytest.mark.parametrize("sampling_params, message", [
    ([None], r"^sampling_params\[0\] must be a SamplingParams, got None$"),
    ([GREEDY, "x"], r"^sampling_params\[1\] must be a SamplingParams, got 'x'$"),
    ({"max_tokens": 3}, r"^sampling_params must be a SamplingParams or a list of them, one per prompt, got \{"),
    ("x", r"^sampling_params must be a SamplingParams or a list of them, one per prompt, got 'x'$"),
    (5, r"^sampling_params must be a SamplingParams or a list of them, one per prompt, got 5$"),
])
def test_sampling_params_that_are_not_sampling_params_are_refused_naming_the_argument(llm, sampling_params, message):
    prompts = [PROMPT, PROMPT] if isinstance(sampling_params, list) else [PROMPT]
    refused(llm, TypeError, message, lambda: llm.generate(prompts, sampling_params))
    refused(llm, TypeError, message, lambda: llm.chat([CHAT] * len(prompts), sampling_params))


@pytest.mark.parametrize("salt", [object(), 5, {}, b"x", [], True])
def test_a_cache_salt_that_is_not_a_string_is_refused_before_anything_is_queued(llm, salt):
    message = r"^cache_salt must be a string or None, got "
    refused(llm, TypeError, message, lambda: llm.generate([DOCUMENT], GREEDY, cache_salt=salt))
    refused(llm, TypeError, message, lambda: llm.chat(CHAT, GREEDY, cache_salt=salt))
    refused(llm, TypeError, message, lambda: llm.cache_document(prompt=DOCUMENT, cache_salt=salt))


def test_a_cache_salt_that_is_not_valid_unicode_is_refused_naming_it(llm):
    refused(llm, ValueError, r"^cache_salt is not valid Unicode text",
            lambda: llm.generate([DOCUMENT], GREEDY, cache_salt="tenant-\ud800"))


@pytest.mark.parametrize("pin", ["no", 0, None])
def test_pin_that_is_not_true_or_false_pins_nothing_and_is_refused(llm, pin):
    refused(llm, TypeError, rf"^pin must be True or False, got {re.escape(repr(pin))}$",
            lambda: llm.cache_document(prompt=DOCUMENT, pin=pin))


def test_chat_with_no_conversation_is_refused_as_generate_with_no_prompt_is(llm):
    refused(llm, ValueError, r"^prompts must be .* or a non-empty list of them$", lambda: llm.generate([], GREEDY))
    refused(llm, ValueError, r"^messages must be a conversation .* or a non-empty list of them, got \[\]$",
            lambda: llm.chat([], GREEDY))


@pytest.mark.parametrize("call, error, message", [
    (lambda llm: llm.chat(None, GREEDY), ValueError, r"^messages must be a conversation .*, got None$"),
    (lambda llm: llm.chat(CHAT, GREEDY, chat_template_kwargs="x"), TypeError,
     r"^chat_template_kwargs must be a dict of variable names \(strings\) to values, or None, got 'x'$"),
    (lambda llm: llm.chat(CHAT, GREEDY, chat_template_kwargs={1: True}), TypeError, r"^chat_template_kwargs must be"),
    (lambda llm: llm.chat(CHAT, GREEDY, add_generation_prompt="yes"), TypeError,
     r"^add_generation_prompt must be True or False, got 'yes'$"),
    (lambda llm: llm.cache_document(prompt=5), TypeError, r"^prompt must be a string or None, got 5$"),
    (lambda llm: llm.unpin_document([]), TypeError, r"^document_id must be a string \(a document's id\), got list$"),
    (lambda llm: llm.unpin_document(None), TypeError, r"^document_id must be a string"),
    (lambda llm: llm.reset_prefix_cache(reset_external="yes"), TypeError, r"^reset_external must be True or False"),
    (lambda llm: llm.generate([[True, 2]], GREEDY), ValueError,
     r"^prompts\[0\] must be a string or a list of integer token ids: item 0 is True$"),
    (lambda llm: llm.generate([PROMPT, [5, False]], GREEDY), ValueError, r"^prompts\[1\] .*: item 1 is False$"),
    (lambda llm: llm.generate([PROMPT, 5], GREEDY), ValueError, r"^prompts\[1\] must be a string, .* got 5$"),
])
def test_a_bad_argument_is_one_line_naming_it(llm, call, error, message):
    refused(llm, error, message, lambda: call(llm))


def test_unpin_of_an_unknown_string_id_is_still_a_key_error(llm):
    with pytest.raises(UnknownDocumentError):
        llm.unpin_document("doc-unknown")


def test_vllm_dict_prompts_use_tqdm_lora_request_none_and_get_tokenizer_run_as_in_vllm(llm):
    (plain,) = llm.generate([PROMPT], GREEDY)
    ids = plain.prompt_token_ids
    as_text, as_ids = llm.generate([{"prompt": PROMPT}, {"prompt_token_ids": ids}], GREEDY, use_tqdm=False,
                                   lora_request=None)
    assert as_text.token_ids == as_ids.token_ids == plain.token_ids
    assert (as_text.prompt, as_ids.prompt, as_ids.prompt_token_ids) == (PROMPT, None, ids)
    (alone,) = llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=True)  # one dict prompt, not in a list
    assert alone.token_ids == plain.token_ids
    assert llm.generate(PROMPT, GREEDY, use_tqdm=lambda *a, **k: None)[0].token_ids == plain.token_ids
    (chat,) = llm.chat(CHAT, GREEDY, use_tqdm=False, lora_request=None)
    assert chat.token_ids == llm.chat(CHAT, GREEDY)[0].token_ids
    assert llm.get_tokenizer() is llm.tokenizer
    assert llm.get_tokenizer().decode(llm.get_tokenizer()(PROMPT)["input_ids"]).endswith(PROMPT)


@pytest.mark.parametrize("prompt, message", [
    ({"prompt": PROMPT, "multi_modal_data": {"image": None}}, r"^prompts\[0\]: 'multi_modal_data' is not supported"),
    ({"prompt": PROMPT, "mm_processor_kwargs": {}}, r"^prompts\[0\]: 'mm_processor_kwargs' is not supported"),
    ({}, r"^prompts\[0\] must hold 'prompt' \(text\) or 'prompt_token_ids' \(token ids\)$"),
    ({"cache_salt": "tenant-a"}, r"^prompts\[0\] must hold 'prompt' \(text\) or 'prompt_token_ids'"),
    ({"prompt": [1, 2]}, r"^prompts\[0\]\['prompt'\] must be a string, got \[1, 2\]$"),
    ({"prompt_token_ids": PROMPT}, r"^prompts\[0\]\['prompt_token_ids'\] must be a list of token ids, got '"),
    ({"prompt_token_ids": [1, None]}, r"^prompts\[0\] .*: item 1 is None$"),
])
def test_a_dict_prompt_that_is_not_vllms_text_or_tokens_prompt_is_refused_clearly(llm, prompt, message):
    refused(llm, ValueError, message, lambda: llm.generate([prompt], GREEDY))


def test_a_dict_prompts_own_cache_salt_keeps_its_blocks_apart_as_the_calls_cache_salt_does(llm):
    """vLLM's TextPrompt and TokensPrompt carry a `cache_salt` each: one call may serve several tenants."""
    (plain,) = llm.generate([DOCUMENT], GREEDY)
    ids = plain.prompt_token_ids
    cached = llm.generate([{"prompt": DOCUMENT}, {"prompt": DOCUMENT, "cache_salt": "tenant-a"},
                           {"prompt_token_ids": ids, "prompt": DOCUMENT, "cache_salt": "tenant-b"}], GREEDY)
    assert [o.cached_tokens for o in cached] == [48, 0, 0]  # the unsalted blocks serve the unsalted prompt only
    assert cached[2].prompt == DOCUMENT and all(o.token_ids == plain.token_ids for o in cached)
    again = llm.generate([{"prompt_token_ids": ids, "cache_salt": "tenant-a"}, DOCUMENT], GREEDY)
    assert [o.cached_tokens for o in again] == [48, 48]  # each its own blocks
    tenant_b = llm.generate([DOCUMENT, {"prompt": DOCUMENT, "cache_salt": "tenant-b"}], GREEDY, cache_salt="tenant-b")
    assert [o.cached_tokens for o in tenant_b] == [48, 48]  # the call's salt salts the plain prompt
    assert llm.generate([{"prompt": PROMPT, "multi_modal_data": None, "mm_processor_kwargs": None}], GREEDY)
    refused(llm, TypeError, r"^prompts\[0\]\['cache_salt'\] must be a string or None, got 7$",
            lambda: llm.generate([{"prompt": PROMPT, "cache_salt": 7}], GREEDY))
    refused(llm, ValueError, r"^prompts\[1\]\['cache_salt'\] differs from the call's cache_salt: give one$",
            lambda: llm.generate([PROMPT, {"prompt": PROMPT, "cache_salt": "tenant-a"}], GREEDY, cache_salt="x"))


def test_what_vllm_takes_and_kvstrata_does_not_is_refused_clearly(llm):
    refused(llm, ValueError, r"^lora_request: kvstrata does not support LoRA adapters \(give None\)$",
            lambda: llm.generate(PROMPT, GREEDY, lora_request=object()))
    refused(llm, ValueError, r"^lora_request: kvstrata does not support LoRA",
            lambda: llm.chat(CHAT, GREEDY, lora_request=object()))
    refused(llm, TypeError, r"^use_tqdm must be True, False or a callable \(vLLM's progress bar\), got 'no'$",
            lambda: llm.generate(PROMPT, GREEDY, use_tqdm="no"))


def test_a_closed_llm_refuses_every_call_that_needs_its_engine_and_still_reports_its_stats(embedded_model_fp32,
                                                                                          tmp_path):
    llm = LLM(config(tmp_path / "kv"), loaded_model=embedded_model_fp32)
    llm.generate([DOCUMENT], GREEDY)
    llm.close()
    calls = [lambda: llm.generate(["Hi"], GREEDY), lambda: llm.generate([DOCUMENT], GREEDY),
             lambda: llm.chat(CHAT, GREEDY), lambda: llm.cache_document(prompt=DOCUMENT + "x"),
             lambda: llm.list_documents(), lambda: llm.unpin_document("doc-x"), lambda: llm.reset_prefix_cache()]
    for call in calls:
        with pytest.raises(RuntimeError, match=r"^this LLM is closed: create a new one$"):
            call()
    llm.close()  # twice: nothing to do
    assert llm.stats()["tiers"]["disk"]["used_blocks"] > 0  # the figures as of the close
    assert llm.get_tokenizer()("Hi")["input_ids"]
