"""`LLM(model=..., **engine_args)` as vLLM's, beside `LLM(config)`: the keywords map onto the same config keys as
`kvstrata serve`'s flags, beat the config, and a bad one is one line naming it."""
from __future__ import annotations

import pytest
import yaml

from kvstrata.engine.config import ENV_OVERRIDES, ConfigError, load_config
from kvstrata.engine.config.engine_args import ENGINE_ARGS
from kvstrata import SamplingParams
from kvstrata.llm import LLM, llm_config
from test_config import write_model_dir


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch, tmp_path):
    for variable, _, _ in ENV_OVERRIDES:
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.chdir(tmp_path)


def test_vllm_keywords_set_the_config_keys_the_serve_flags_set(tmp_path):
    model_dir = write_model_dir(tmp_path / "my-llama")
    config = llm_config(None, None, dict(model=str(model_dir), dtype="fp16", max_model_len=1024, block_size=32,
                                         kv_cache_dtype="int8", max_num_seqs=4, enable_prefix_caching=False))
    assert (config.model.name, config.model.dtype, config.model.max_model_len) == (str(model_dir), "float16", 1024)
    assert (config.cache.block_size, config.cache.kv_cache_dtype, config.scheduler.max_num_seqs) == (32, "int8", 4)
    assert config.cache.enable_prefix_caching is False
    assert llm_config(model_dir, None, {}).model.name == str(model_dir)  # the first argument is the model, as vLLM's


def test_a_config_as_the_first_argument_still_works_and_keywords_beat_it(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"model": {"max_model_len": 512}, "scheduler": {"max_num_seqs": 3}}))
    assert llm_config(str(path), None, {}) == load_config(path)
    assert llm_config(path, None, {}) == load_config(path)
    config = load_config(path)
    assert llm_config(config, None, {}) is config
    assert llm_config({"model": {"max_model_len": 512}}, None, {}).model.max_model_len == 512
    on_top = llm_config(None, config, {"max_model_len": 1024})
    assert (on_top.model.max_model_len, on_top.scheduler.max_num_seqs) == (1024, 3)
    assert llm_config(str(path), None, {"block_size": 64}).cache.block_size == 64


@pytest.mark.parametrize("kwargs, message", [
    ({"max_model_len": 99999}, "max_model_len (model.max_model_len): 99999 is more than the model's limit"),
    ({"block_size": "16"}, "block_size (cache.block_size): unknown value '16'"),
    ({"dtype": "fp9"}, "dtype (model.dtype): unknown value 'fp9'"),
    ({"tensor_parallel_size": 2}, "tensor_parallel_size: unknown argument (expected one of model, dtype"),
    ({"port": 8000}, "port: unknown argument"),  # the server's, meaningless offline
])
def test_a_bad_keyword_is_one_line_naming_it(kwargs, message):
    with pytest.raises(ConfigError) as info:
        llm_config(None, None, kwargs)
    assert str(info.value).startswith(message) and "\n" not in str(info.value)


@pytest.mark.parametrize("model", [5, ["smollm2-135m-instruct"], 2.5])
def test_a_model_that_is_neither_a_name_nor_a_path_is_one_line_naming_it(model):
    with pytest.raises(ConfigError, match=rf"^model \(model.name\): expected a string, got "):
        LLM(model=model)  # refused before anything is loaded


def test_the_config_is_given_once(tmp_path):
    with pytest.raises(ConfigError, match="give the config once"):
        llm_config({"model": {}}, {"model": {}}, {})


def test_every_engine_argument_names_a_key_the_config_has():
    defaults = load_config().to_dict()
    for arg in ENGINE_ARGS:
        section, _, rest = arg.key.partition(".")
        node = defaults[section]
        for part in rest.split("."):
            assert part in node, arg
            node = node[part]


@pytest.mark.slow
def test_llm_built_the_vllm_way_runs_the_model_with_its_keywords():
    with LLM(model="smollm2-135m-instruct", dtype="float32", device="cpu", max_model_len=256, block_size=8) as llm:
        assert (llm.config.model.max_model_len, llm.config.cache.block_size) == (256, 8)
        (out,) = llm.generate("The capital of France is", SamplingParams(max_tokens=4, temperature=0.0))
        assert 0 < len(out.token_ids) <= 4
