"""A model's identity (folded into every hash namespace) follows the content of the files that decide
its KV blocks, and costs a restart nothing: digests are cached by path, size and modification time."""
from __future__ import annotations

import json
import os

import pytest

from kvstrata.engine import model_identity
from kvstrata.engine.model_identity import digest_cache_path, directory_identity, file_identity, identity_files


@pytest.fixture(autouse=True)
def private_digest_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSTRATA_CACHE_DIR", str(tmp_path / "cache"))


def model_dir(path, weights: bytes = b"\1" * 64):
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    (path / "model.safetensors").write_bytes(weights)
    (path / "tokenizer.json").write_text('{"vocab": 1}')
    (path / "tokenizer_config.json").write_text("{}")
    (path / "chat_template.jinja").write_text("{{ messages }}")
    (path / "README.md").write_text("a model")
    return path


def rewrite_keeping_size_and_mtime(path, content: bytes) -> None:
    """A rewrite that even keeps the modification time (a restored backup, a copy with -p)."""
    stat = path.stat()
    assert len(content) == stat.st_size
    path.write_bytes(content)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def test_identity_changes_with_weight_content_of_the_same_size(tmp_path):
    directory = model_dir(tmp_path / "m")
    before = directory_identity("m", directory)
    (directory / "model.safetensors").write_bytes(b"\2" * 64)  # same name, same size, other weights
    assert directory_identity("m", directory) != before


@pytest.mark.parametrize("name", ["config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"])
def test_identity_changes_with_the_config_tokenizer_and_chat_template(tmp_path, name):
    directory = model_dir(tmp_path / "m")
    before = directory_identity("m", directory)
    (directory / name).write_text((directory / name).read_text() + " ")
    assert directory_identity("m", directory) != before


def test_identity_ignores_files_that_change_no_block(tmp_path):
    directory = model_dir(tmp_path / "m")
    before = directory_identity("m", directory)
    (directory / "README.md").write_text("rewritten")
    (directory / "generation_config.json").write_text("{}")
    assert directory_identity("m", directory) == before
    assert [p.name for p in identity_files(directory)] == ["chat_template.jinja", "config.json", "model.safetensors",
                                                          "tokenizer.json", "tokenizer_config.json"]


def test_a_restart_reads_digests_from_the_cache_instead_of_the_weights(tmp_path, monkeypatch):
    directory = model_dir(tmp_path / "m")
    first = directory_identity("m", directory)
    assert digest_cache_path().is_file()

    def no_reading(path):
        raise AssertionError(f"{path} was read again")

    monkeypatch.setattr(model_identity, "digest_file", no_reading)
    assert directory_identity("m", directory) == first


def test_a_rewrite_that_keeps_size_and_mtime_is_still_digested_again(tmp_path):
    directory = model_dir(tmp_path / "m")
    first = directory_identity("m", directory)
    rewrite_keeping_size_and_mtime(directory / "model.safetensors", b"\3" * 64)  # its status-change time moves
    assert directory_identity("m", directory) != first


@pytest.mark.parametrize("damage", ["not json", json.dumps({"version": 0, "files": {}}), json.dumps([1, 2])])
def test_a_damaged_digest_cache_means_digesting_again(tmp_path, damage):
    directory = model_dir(tmp_path / "m")
    first = directory_identity("m", directory)
    digest_cache_path().write_text(damage)
    assert directory_identity("m", directory) == first
    assert json.loads(digest_cache_path().read_text())["version"] == 1  # and the cache is whole again


def test_an_unwritable_cache_directory_only_costs_the_digest(tmp_path, monkeypatch):
    (tmp_path / "a-file").write_text("x")
    monkeypatch.setenv("KVSTRATA_CACHE_DIR", str(tmp_path / "a-file" / "cache"))
    directory = model_dir(tmp_path / "m")
    assert directory_identity("m", directory) == directory_identity("m", directory)


def test_file_identity_names_the_file_content(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF" + b"\0" * 60)
    first = file_identity("model", path)
    assert first.startswith("model@xxh3_128:")
    path.write_bytes(b"GGUF" + b"\1" * 60)
    assert file_identity("model", path) != first
