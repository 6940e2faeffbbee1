"""The embedded model's converted copy (engine/converted_model.py): a start that finds it loads the same tokenizer and
the same bits as converting the GGUF again, in float32 and bfloat16; a copy missing, half written, damaged or
unwritable is a miss (the GGUF is converted as before, one warning), never a wrong model."""
from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch

from kvstrata.engine import converted_model
from kvstrata.engine.converted_model import MANIFEST, first_line, load_or_convert

CHAT = [{"role": "system", "content": "Answer from the document."},
        {"role": "user", "content": "What does `yield from` delegate to?"}]


def saved_text(value: str, folder) -> None:
    (folder / "value.txt").write_text(value)


def loaded_text(folder) -> str:
    return (folder / "value.txt").read_text()


class Converter:
    """A stand-in conversion that counts its calls."""

    def __init__(self, value: str = "converted"):
        self.value, self.calls = value, 0

    def __call__(self) -> str:
        self.calls += 1
        return self.value


def test_a_copy_is_used_once_written_whole(tmp_path):
    convert = Converter()
    folder = tmp_path / "copy"
    assert load_or_convert(folder, loaded_text, convert, saved_text) == "converted"
    assert load_or_convert(folder, loaded_text, convert, saved_text) == "converted"
    assert convert.calls == 1
    manifest = json.loads((folder / MANIFEST).read_text())
    assert set(manifest["files"]) == {"value.txt"}
    assert folder.stat().st_mode & 0o777 == 0o700  # the user's alone


def test_read_back_returns_the_copy_once_written_and_the_conversion_where_none_could_be(tmp_path):
    def read_back(folder) -> str:
        return f"copy: {loaded_text(folder)}"

    assert load_or_convert(tmp_path / "copy", read_back, Converter(), saved_text, read_back=True) == "copy: converted"
    (tmp_path / "a-file").write_text("")
    assert load_or_convert(tmp_path / "a-file" / "copy", read_back, Converter(), saved_text,
                           read_back=True) == "converted"


@pytest.mark.parametrize("damage", ["flip a byte", "no manifest", "a file missing", "manifest not json"])
def test_a_damaged_or_half_written_copy_is_converted_again_and_replaced(tmp_path, damage, caplog):
    convert = Converter()
    folder = tmp_path / "copy"
    load_or_convert(folder, loaded_text, convert, saved_text)
    if damage == "flip a byte":
        (folder / "value.txt").write_text("converteD")
    elif damage == "no manifest":
        (folder / MANIFEST).unlink()
    elif damage == "a file missing":
        (folder / "value.txt").unlink()
    else:
        (folder / MANIFEST).write_text("{")
    with caplog.at_level(logging.WARNING, logger="kvstrata"):
        assert load_or_convert(folder, loaded_text, convert, saved_text) == "converted"
    assert convert.calls == 2
    assert load_or_convert(folder, loaded_text, convert, saved_text) == "converted"  # whole again: not converted
    assert convert.calls == 2


def test_a_copy_that_fails_to_load_is_converted_again(tmp_path, caplog):
    convert = Converter()
    folder = tmp_path / "copy"
    load_or_convert(folder, loaded_text, convert, saved_text)

    def broken(_folder):
        raise RuntimeError("unexpected key in the state dict\nmore")
    with caplog.at_level(logging.WARNING, logger="kvstrata"):
        assert load_or_convert(folder, broken, convert, saved_text) == "converted"
    assert convert.calls == 2
    assert "did not load (unexpected key in the state dict)" in caplog.text


def test_an_unwritable_cache_leaves_the_copy_out_with_one_warning(tmp_path, caplog):
    (tmp_path / "a-file").write_text("")
    convert = Converter()
    with caplog.at_level(logging.WARNING, logger="kvstrata"):
        assert load_or_convert(tmp_path / "a-file" / "copy", loaded_text, convert, saved_text) == "converted"
    assert convert.calls == 1
    assert [r.getMessage().split(" (")[0] for r in caplog.records] == [
        f"kvstrata: could not keep a converted copy of the model in {tmp_path / 'a-file' / 'copy'}"]


def test_a_failed_save_leaves_no_temporary_folder(tmp_path, caplog):
    def failing_save(_value, folder):
        (folder / "part").write_text("half")
        raise OSError("No space left on device")
    with caplog.at_level(logging.WARNING, logger="kvstrata"):
        assert load_or_convert(tmp_path / "copy", loaded_text, Converter(), failing_save) == "converted"
    assert list(tmp_path.iterdir()) == []
    assert "No space left on device" in caplog.text


@pytest.mark.slow
def test_the_embedded_model_loads_from_its_copy_as_from_its_gguf(tmp_path, monkeypatch):
    """The first load converts the GGUF (in transformers' model classes here) and keeps the copy; the second reads the
    copy into kvstrata's own weight modules (engine/checkpoint.py), and gets the same weights (bits and dtypes), RoPE
    tables, config, generation config and tokenizer (its ids and chat template). In bfloat16, the dtype the GGUF's
    weights are cast to; float32 takes the same path (and `tests/test_bench_startup.py` converts and reloads it in
    float32, in processes of their own). A first start without `transformers_modules` runs what later ones run."""
    dtype = torch.bfloat16
    from transformers import modeling_gguf_pytorch_utils

    from kvstrata.engine.checkpoint import CausalLM
    from kvstrata.engine.model_loader import EMBEDDED_MODEL, load_model, resolve_model

    monkeypatch.setenv("KVSTRATA_CACHE_DIR", str(tmp_path))
    gguf_reads = []
    read = modeling_gguf_pytorch_utils.load_gguf_checkpoint
    monkeypatch.setattr(modeling_gguf_pytorch_utils, "load_gguf_checkpoint",
                        lambda *a, **k: gguf_reads.append(1) or read(*a, **k))
    import gguf
    name_tables = []
    build_table = gguf.get_tensor_name_map
    monkeypatch.setattr(gguf, "get_tensor_name_map", lambda *a: name_tables.append(a) or build_table(*a))
    source = resolve_model(EMBEDDED_MODEL)
    converted = load_model(source, dtype, "cpu", transformers_modules=True)
    assert gguf_reads and not isinstance(converted.model, CausalLM)
    assert len(name_tables) == 1  # built once, not once per module (~400) as transformers asks for it
    gguf_reads.clear()
    copied = load_model(source, dtype, "cpu")
    assert not gguf_reads  # neither the weights nor the tokenizer read the GGUF again
    assert isinstance(copied.model, CausalLM)

    assert copied.model_config == converted.model_config  # the identity (the GGUF's digest) included
    params = dict(copied.model.named_parameters())
    for name, a in converted.model.named_parameters():
        assert a.dtype == params[name].dtype == dtype and torch.equal(a, params.pop(name)), name
    assert not params
    positions = torch.arange(8192)[None]
    for a, b in zip(converted.model.get_decoder().rotary_emb(torch.ones(1, dtype=dtype), positions),
                    copied.model.get_decoder().rotary_emb(torch.ones(1, dtype=dtype), positions), strict=True):
        assert a.dtype == b.dtype == dtype and torch.equal(a, b)
    assert (copied.model.get_output_embeddings().weight.data_ptr()
            == copied.model.get_input_embeddings().weight.data_ptr())  # still tied
    assert copied.model.generation_config.eos_token_id == converted.model.generation_config.eos_token_id
    assert type(copied.tokenizer) is type(converted.tokenizer)  # reloaded with the class that saved it
    text = "def f(x):\n    return x ** 2  # square\n\u00e9t\u00e9 \U0001F600"
    assert copied.tokenizer(text)["input_ids"] == converted.tokenizer(text)["input_ids"]
    assert (copied.tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
            == converted.tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False))
    assert copied.tokenizer.decode(copied.tokenizer(text)["input_ids"]) == text
    copy = converted_model.converted_dir(converted.model_config.identity)
    assert sorted(p.name for p in copy.iterdir()) == sorted(["tokenizer", str(dtype).removeprefix("torch.")])
    shutil.rmtree(copy)  # hundreds of MB that pytest would keep with its last runs' folders


def test_a_load_errors_first_line_that_ends_in_a_colon_keeps_what_it_introduces_on_one_line():
    # as transformers words a model folder without tokenizer files
    error = ValueError("Couldn't instantiate the backend tokenizer from one of: \n(1) a `tokenizers` library "
                       "serialization file, \n(2) a slow tokenizer instance to convert or \n(3) an equivalent slow "
                       "tokenizer class to instantiate and convert. \nYou need to have sentencepiece installed.")
    line = first_line(error)
    assert "\n" not in line and line.startswith("Couldn't instantiate the backend tokenizer from one of: (1) a")
    assert len(line) < 300
    assert first_line(ValueError("no such file\nTraceback detail")) == "no such file"
    assert first_line(ValueError("")) == "ValueError"
