"""The YAML config: shipped configs, defaults, sizes, overrides, and one-line errors naming the key."""
from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
import torch

from kvstrata.engine.config import machine, probes
from kvstrata.engine.model_spec import EMBEDDED_MODEL
from kvstrata.engine.config import ENV_OVERRIDES, ConfigError, load_config
from kvstrata.engine.sizes import Size
from kvstrata.tiers import storage
from kvstrata.tiers.names import TIER_NAMES

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
SMOLLM2_BF16_BLOCK_NBYTES = 368_640  # 30 layers x 2 x 16 tokens x 3 KV heads x 64 dims x 2 bytes
GiB = 1024**3


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch, tmp_path):
    """No override variable leaks in from the caller, and relative disk paths land in a temp dir."""
    for variable, _, _ in ENV_OVERRIDES:
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.chdir(tmp_path)


def enabled_tiers(config) -> tuple[str, ...]:
    tiers = config.cache.tiers
    return tuple(name for name in TIER_NAMES if getattr(tiers, name) is not None)


def write_model_dir(path: Path, **fields) -> Path:
    """A model directory holding only a config.json (all that config validation reads)."""
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
              "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000,
              "max_position_embeddings": 4096, **fields}
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    return path


def config_error(source, overrides=None) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_config(source, overrides)
    message = str(info.value)
    assert "\n" not in message, message
    return info.value


# ----------------------------------------------------------------------------------- shipped configs


@pytest.mark.parametrize("name", ["default.yaml", "pressure.yaml"])
def test_shipped_config_loads_on_a_laptop(name, tmp_path):
    config = load_config(CONFIGS / name)
    assert config.model.name == EMBEDDED_MODEL
    assert enabled_tiers(config) == ("device", "cpu", "disk")
    assert config.cache.tiers.disk.path.parent == tmp_path  # ./kvstore... resolved against the current directory


def test_gpu_config_loads_on_a_gpu_server(monkeypatch):
    monkeypatch.setattr(machine, "available_ram_bytes", lambda: 256 * GiB)
    monkeypatch.setattr(machine, "gpu_memory_bytes", lambda index, explicit=False: 80 * GiB)
    monkeypatch.setattr(storage, "room_bytes", lambda path: 1024 * GiB)
    config = load_config(CONFIGS / "gpu.yaml")
    assert config.cache.tiers.device.size == Size(nbytes=8 * GiB)
    assert config.cache.tiers.cpu.size == Size(nbytes=32 * GiB) and config.cache.tiers.cpu.pinned
    assert config.cache.tiers.disk.size == Size(nbytes=128 * GiB)


def test_gpu_config_is_refused_where_its_cpu_tier_does_not_fit(monkeypatch):
    monkeypatch.setattr(machine, "available_ram_bytes", lambda: 16 * GiB)
    monkeypatch.setattr(machine, "gpu_memory_bytes", lambda index, explicit=False: 80 * GiB)
    assert config_error(CONFIGS / "gpu.yaml").key == "cache.tiers.cpu.size"


def test_pressure_config_spills_a_few_2k_token_documents_to_cpu_and_disk():
    tiers = load_config(CONFIGS / "pressure.yaml").cache.tiers
    blocks_per_document = 2048 // 16
    device_blocks = tiers.device.size.to_blocks(SMOLLM2_BF16_BLOCK_NBYTES)
    cpu_blocks = tiers.cpu.size.to_blocks(SMOLLM2_BF16_BLOCK_NBYTES)
    disk_blocks = tiers.disk.size.to_blocks(SMOLLM2_BF16_BLOCK_NBYTES)
    assert blocks_per_document <= device_blocks < 2 * blocks_per_document
    assert 4 * blocks_per_document <= cpu_blocks < 8 * blocks_per_document
    assert disk_blocks >= 32 * blocks_per_document
    assert tiers.disk.path.name == "kvstore-pressure"


def test_replicas_config_shares_a_remote_tier_and_keeps_no_disk_tier():
    config = load_config(CONFIGS / "replicas.yaml")
    assert enabled_tiers(config) == ("device", "cpu", "remote")
    remote = config.cache.tiers.remote
    assert (remote.url, remote.cluster, remote.key_prefix, remote.timeout, remote.ttl) == \
        ("redis://127.0.0.1:6379/0", False, "kvstrata", 0.05, 0.0)


def test_default_config_is_laptop_sized_and_its_device_tier_holds_a_full_context():
    from kvstrata.tiers.base import BlockLayout

    config = load_config(CONFIGS / "default.yaml")
    assert config.cache.tiers.device.size == Size.parse("512MiB")
    # the embedded model (30 layers, 3 KV heads, d64, 8192-token context) in float32, `auto` on a CPU
    layout = BlockLayout(30, config.cache.block_size, 3, 64, torch.float32)
    device_tokens = config.cache.tiers.device.size.to_blocks(layout.block_nbytes) * config.cache.block_size
    assert device_tokens >= 8192 and device_tokens >= 4 * 2048
    assert config.cache.tiers.cpu.size == Size.parse("1GiB")
    assert config.cache.tiers.disk.size == Size.parse("4GiB")
    assert (config.scheduler.max_num_batched_tokens, config.scheduler.max_num_seqs) == (2048, 16)


# ------------------------------------------------------------------------------------------ defaults


def test_no_config_gives_the_embedded_model_and_a_1gib_device_tier_only():
    config = load_config()
    assert config.model.name == "smollm2-135m-instruct"
    assert (config.model.dtype, config.model.device, config.model.attention_backend) == ("auto", "auto", "auto")
    assert (config.model.load_format, config.model.threads) == ("auto", "auto")
    assert config.model.max_model_len is None
    assert config.cache.enable_prefix_caching and config.cache.block_size == 16
    assert (config.cache.hash, config.cache.offload) == ("xxh3_128", "write_through")
    assert config.cache.tiers.device.size == Size(nbytes=GiB)
    assert enabled_tiers(config) == ("device",)
    assert (config.scheduler.max_num_batched_tokens, config.scheduler.max_num_seqs) == (2048, 32)
    assert (config.server.host, config.server.port, config.server.model_alias) == ("127.0.0.1", 8000, None)


@pytest.mark.parametrize("text", ["", "\n", "# model:\n#   dtype: float32\n"])
def test_empty_file_is_refused_as_probably_the_wrong_file(tmp_path, text):
    (tmp_path / "empty.yaml").write_text(text)
    error = config_error(tmp_path / "empty.yaml")
    assert error.key is None and "the file is empty" in str(error)


def test_sections_left_empty_take_their_defaults(tmp_path):
    (tmp_path / "sparse.yaml").write_text("model:\nserver:\n  # port: 9000\ncache:\n  tiers:\n")
    assert load_config(tmp_path / "sparse.yaml") == load_config()


def test_device_tier_defaults_to_1gib_when_only_lower_tiers_are_given():
    config = load_config({"cache": {"tiers": {"cpu": {"size": "1GiB"}}}})
    assert config.cache.tiers.device.size == Size(nbytes=GiB)
    assert enabled_tiers(config) == ("device", "cpu")


@pytest.mark.parametrize("cpu", [{"size": 0}, {"size": "0"}, {"size": "0GiB"}, None])
def test_lower_tier_sized_zero_or_null_is_off(cpu, tmp_path):
    config = load_config({"cache": {"tiers": {"cpu": cpu, "disk": {"path": str(tmp_path / "x"), "size": 0}}}})
    assert config.cache.tiers.cpu is None and config.cache.tiers.disk is None
    assert enabled_tiers(config) == ("device",)
    assert not (tmp_path / "x").exists()  # an off disk tier touches nothing


@pytest.mark.parametrize("alias, dtype", [("fp32", "float32"), ("bf16", "bfloat16"), ("fp16", "float16"),
                                          ("FLOAT16", "float16"), ("float32", "float32")])
def test_dtype_aliases_are_canonicalised(alias, dtype):
    assert load_config({"model": {"dtype": alias}}).model.dtype == dtype


@pytest.mark.parametrize("kv_cache_dtype, model_dtype, resolved", [
    ("auto", "float32", "float32"), ("auto", "bf16", "bfloat16"), ("fp8", "bfloat16", "float8_e4m3fn"),
    ("fp8_e4m3", "float32", "float8_e4m3fn"), ("FP8_E5M2", "float32", "float8_e5m2"), ("bf16", "float32", "bfloat16"),
    ("int8", "bfloat16", "int8"),
])
def test_the_kv_cache_dtype_is_the_models_unless_set(kv_cache_dtype, model_dtype, resolved):
    config = load_config({"model": {"dtype": model_dtype}, "cache": {"kv_cache_dtype": kv_cache_dtype}})
    assert config.resolved_kv_cache_dtype() == resolved


@pytest.fixture
def two_gpus(monkeypatch):
    """A machine with cuda:0 and cuda:1 of 80 GiB each (as nvidia-smi or torch would report them)."""
    monkeypatch.setattr(machine, "gpu_memory_bytes",
                        lambda index, explicit=False: 80 * GiB if index < 2 else None)


@pytest.mark.parametrize("device", ["auto", "cpu", "cuda", "cuda:1", "CUDA:0"])
def test_devices_accepted(device, two_gpus):
    assert load_config({"model": {"device": device}}).model.device == device.lower()


def test_explicit_device_is_its_own_resolution(two_gpus):
    assert load_config({"model": {"device": "cpu"}}).resolved_device() == "cpu"
    assert load_config({"model": {"device": "cuda:1"}}).resolved_device() == "cuda:1"


def test_cuda_device_the_machine_lacks_is_refused(two_gpus):
    error = config_error({"model": {"device": "cuda:3"}})
    assert error.key == "model.device" and "no such CUDA device" in str(error) and "cuda:0 to cuda:1" in str(error)


def test_cuda_device_on_a_machine_without_a_gpu_is_refused_by_asking_torch(monkeypatch):
    import torch

    monkeypatch.setattr(machine.shutil, "which", lambda name: None)  # no nvidia-smi
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    error = config_error({"model": {"device": "cuda"}})
    assert error.key == "model.device" and "no CUDA device is visible" in str(error)


def test_local_model_directory_is_accepted_as_an_absolute_path(tmp_path):
    write_model_dir(tmp_path / "my-llama")
    assert load_config({"model": {"name": "my-llama"}}).model.name == str(tmp_path / "my-llama")


@pytest.mark.parametrize("architecture", ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                                          "Qwen3ForCausalLM"])
def test_supported_architectures_are_accepted(tmp_path, architecture):
    write_model_dir(tmp_path / "m", architectures=[architecture])
    assert load_config({"model": {"name": str(tmp_path / "m")}}).model.shape().architecture == architecture


def test_an_architecture_written_as_one_name_not_a_list_is_read_as_that_name(tmp_path):
    write_model_dir(tmp_path / "m", architectures="LlamaForCausalLM")
    assert load_config({"model": {"name": str(tmp_path / "m")}}).model.shape().architecture == "LlamaForCausalLM"
    write_model_dir(tmp_path / "gpt2", architectures="GPT2LMHeadModel", model_type="gpt2")
    error = config_error({"model": {"name": str(tmp_path / "gpt2")}})
    assert "architecture GPT2LMHeadModel is not supported" in str(error)


def test_unsupported_architecture_is_one_line_naming_it(tmp_path):
    write_model_dir(tmp_path / "gpt2", architectures=["GPT2LMHeadModel"], model_type="gpt2")
    error = config_error({"model": {"name": str(tmp_path / "gpt2")}})
    assert error.key == "model.name" and "architecture GPT2LMHeadModel is not supported" in str(error)
    assert "LlamaForCausalLM" in str(error)


def test_an_mlp_activation_the_decoder_does_not_run_is_one_line_naming_it(tmp_path):
    write_model_dir(tmp_path / "gelu", hidden_act="gelu")
    error = config_error({"model": {"name": str(tmp_path / "gelu")}})
    assert error.key == "model.name" and "activation 'gelu' is not supported" in str(error)


def test_model_directory_with_a_broken_config_json_is_refused(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{not json")
    error = config_error({"model": {"name": str(tmp_path / "m")}})
    assert error.key == "model.name" and "not valid JSON" in str(error)


def test_max_model_len_beyond_the_models_limit_is_refused(tmp_path):
    error = config_error({"model": {"max_model_len": 10**9}})
    assert error.key == "model.max_model_len" and "limit of 8192 tokens" in str(error)
    assert load_config({"model": {"max_model_len": 8192}}).model.max_model_len == 8192
    path = tmp_path / "c.yaml"
    path.write_text("model:\n  max_model_len: 1e9\n")  # YAML 1.1 reads this as a string
    assert config_error(path).key == "model.max_model_len"


def test_a_sliding_window_caps_the_models_limit(tmp_path):
    write_model_dir(tmp_path / "mistral", architectures=["MistralForCausalLM"], model_type="mistral",
                    sliding_window=1024)
    error = config_error({"model": {"name": str(tmp_path / "mistral"), "max_model_len": 2048}})
    assert error.key == "model.max_model_len" and "limit of 1024 tokens" in str(error)


@pytest.mark.parametrize("name", ["llama-3-8b", "tiny-llama"])
def test_random_weight_presets_are_accepted_with_load_format_dummy(name):
    model = load_config({"model": {"name": name, "load_format": "dummy"}}).model
    assert model.shape().num_layers == {"llama-3-8b": 32, "tiny-llama": 2}[name]


def test_a_preset_without_load_format_dummy_is_not_a_model():
    assert "neither the embedded model" in str(config_error({"model": {"name": "llama-3-8b"}}))


def test_dummy_needs_a_models_config():
    assert config_error({"model": {"load_format": "dummy"}}).key == "model.load_format"


def test_dummy_accepts_a_model_directorys_config(tmp_path):
    write_model_dir(tmp_path / "shape-only")  # no weights: dummy reads the config only
    config = load_config({"model": {"name": str(tmp_path / "shape-only"), "load_format": "dummy"}})
    assert config.model.shape().num_kv_heads == 2


def test_config_is_frozen():
    config = load_config()
    with pytest.raises(Exception):
        config.server.port = 1


def test_resolved_config_round_trips_through_dict_and_yaml(tmp_path):
    import yaml

    config = load_config(CONFIGS / "pressure.yaml", ["cache.tiers.cpu.size=100", "cache.tiers.disk.size=1.5GB"])
    assert load_config(config.to_dict()) == config
    assert load_config(yaml.safe_load(config.to_yaml())) == config
    assert config.to_dict()["cache"]["tiers"]["cpu"]["size"] == 100
    assert config.to_dict()["cache"]["tiers"]["disk"]["size"] == "1500MB"


# --------------------------------------------------------------------------------------------- sizes


@pytest.mark.parametrize("text, nbytes, num_blocks", [
    ("512MiB", 512 * 1024**2, None),
    ("8GiB", 8 * GiB, None),
    ("1.5GB", 1_500_000_000, None),
    ("100MB", 100_000_000, None),
    ("4KiB", 4096, None),
    ("4 KiB", 4096, None),
    ("2gib", 2 * GiB, None),
    ("1TiB", 1024 * GiB, None),
    ("300B", 300, None),
    (1024, None, 1024),
    ("1024", None, 1024),
])
def test_size_parses_bytes_and_block_counts(text, nbytes, num_blocks):
    size = Size.parse(text)
    assert (size.nbytes, size.num_blocks) == (nbytes, num_blocks)
    assert not size.is_off
    assert Size.parse(size.to_yaml_value()) == size


@pytest.mark.parametrize("text", [0, "0", "0GiB", "0 MB"])
def test_size_zero_is_off(text):
    assert Size.parse(text).is_off


@pytest.mark.parametrize("text, fragment", [
    ("12XB", "unknown unit 'XB'"),
    ("-1GiB", "bad size"),
    (-5, "negative"),
    ("1.5", "whole number"),
    (1.5, "whole number"),
    (True, "bad size"),
    ("GiB", "bad size"),
    ("", "bad size"),
    ([1], "bad size"),
    ("1 2GiB", "bad size"),
])
def test_size_rejects_malformed_values(text, fragment):
    with pytest.raises(ValueError, match=fragment):
        Size.parse(text)


def test_size_converts_to_blocks_of_a_given_byte_size():
    assert Size.parse("1GiB").to_blocks(SMOLLM2_BF16_BLOCK_NBYTES) == 2912
    assert Size.parse("64MiB").to_blocks(SMOLLM2_BF16_BLOCK_NBYTES) == 182
    assert Size.parse(500).to_blocks(SMOLLM2_BF16_BLOCK_NBYTES) == 500
    assert Size.parse("100B").to_blocks(SMOLLM2_BF16_BLOCK_NBYTES) == 0
    assert Size.parse(10).to_bytes(1000) == 10_000


# ----------------------------------------------------------------------------------- one-line errors


@pytest.mark.parametrize("source, key, fragment", [
    ({"cache": {"tiers": {"dsk": {"size": "1GiB"}}}}, "cache.tiers.dsk", "unknown key"),
    ({"modle": {}}, "modle", "unknown key"),
    ({"server": {"port": 80, "hots": "x"}}, "server.hots", "unknown key"),
    ({"cache": {"tiers": {"cpu": {"size": "4XB"}}}}, "cache.tiers.cpu.size", "unknown unit"),
    ({"cache": {"tiers": {"cpu": {"size": "lots"}}}}, "cache.tiers.cpu.size", "bad size"),
    ({"cache": {"tiers": {"cpu": {"size": -3}}}}, "cache.tiers.cpu.size", "negative"),
    ({"cache": {"tiers": {"cpu": {"pinned": True}}}}, "cache.tiers.cpu.size", "missing"),
    ({"cache": {"tiers": {"device": {"size": 0}}}}, "cache.tiers.device.size", "cannot be off"),
    ({"cache": {"tiers": {"device": None}}}, "cache.tiers.device", "cannot be off"),
    ({"scheduler": {"max_num_seqs": 0}}, "scheduler.max_num_seqs", "positive"),
    ({"scheduler": {"max_num_batched_tokens": -1}}, "scheduler.max_num_batched_tokens", "positive"),
    ({"model": {"max_model_len": 0}}, "model.max_model_len", "positive"),
    ({"server": {"port": 70000}}, "server.port", "at most 65535"),
    ({"server": {"port": "eighty"}}, "server.port", "expected an integer"),
    ({"cache": {"enable_prefix_caching": "yes"}}, "cache.enable_prefix_caching", "expected true or false"),
    ({"server": {"host": 127}}, "server.host", "expected a string"),
    ({"cache": "big"}, "cache", "expected a mapping"),
    ({"cache": {"hash": "md5"}}, "cache.hash", "unknown value 'md5'"),
    ({"cache": {"offload": "lazy"}}, "cache.offload", "unknown value 'lazy'"),
    ({"cache": {"load_policy": "sometimes"}}, "cache.load_policy", "unknown value 'sometimes'"),
    ({"cache": {"block_size": 12}}, "cache.block_size", "unknown value 12"),
    ({"model": {"dtype": "fp8"}}, "model.dtype", "unknown value 'fp8'"),
    ({"cache": {"kv_cache_dtype": "int4"}}, "cache.kv_cache_dtype", "unknown value 'int4'"),
    ({"model": {"threads": 0}}, "model.threads", "positive"),
    ({"model": {"load_format": "gguf"}}, "model.load_format", "unknown value 'gguf'"),
    ({"model": {"device": "mps"}}, "model.device", "unknown device 'mps'"),
    ({"model": {"attention_backend": "flash"}}, "model.attention_backend", "unknown value 'flash'"),
    ({"model": {"name": "no-such-model"}}, "model.name", "neither the embedded model"),
    ({"router": {"replicas": [{"url": "http://127.0.0.1:8001"}], "max_load_gap": 0}}, "router.max_load_gap",
     "at least 1"),
    ({"cache": {"tiers": {"disk": {"size": "1GiB", "read_processes": -1}}}}, "cache.tiers.disk.read_processes",
     "at least 0"),
    ({"cache": {"tiers": {"disk": {"size": "1GiB", "read_processes": "many"}}}},
     "cache.tiers.disk.read_processes", "expected an integer"),
    ({"cache": {"tiers": {"remote": {"url": "redis://127.0.0.1:6379", "read_processes": 65}}}},
     "cache.tiers.remote.read_processes", "at most 64"),
])
def test_each_config_error_is_one_line_naming_the_key(source, key, fragment):
    error = config_error(source)
    assert error.key == key
    assert str(error).startswith(f"{key}: ")
    assert fragment in str(error)


def test_several_errors_are_reported_in_one_line():
    error = config_error({"cache": {"hash": "md5", "offload": "lazy"}})
    assert error.key == "cache.hash" and "(and 1 more error)" in str(error)


def test_a_misspelt_key_is_the_error_named_not_the_key_it_left_missing(tmp_path):
    (tmp_path / "doc.txt").write_text("a handbook")
    error = config_error({"cache": {"preload": [{"fil": str(tmp_path / "doc.txt")}]}})
    assert error.key == "cache.preload.0.fil" and "unknown key" in str(error) and "(and 1 more error)" in str(error)


def test_model_directory_without_config_json_is_refused(tmp_path):
    (tmp_path / "empty-dir").mkdir()
    assert config_error({"model": {"name": str(tmp_path / "empty-dir")}}).key == "model.name"


def test_malformed_yaml_names_the_file_and_line(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("model:\n  name: smollm2-135m-instruct\n  dtype: [bf16\n")
    error = config_error(path)
    assert error.key is None
    assert str(error).startswith(f"{path}: malformed YAML at line ")


def test_duplicate_yaml_key_is_refused(tmp_path):
    path = tmp_path / "dup.yaml"
    path.write_text("server:\n  port: 1\n  port: 2\n")
    assert "duplicate key 'port'" in str(config_error(path))


def test_yaml_that_is_not_a_mapping_is_refused(tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- model\n- cache\n")
    assert "expected a mapping" in str(config_error(path))


def test_missing_file_is_named(tmp_path):
    error = config_error(tmp_path / "nope.yaml")
    assert str(error) == f"{tmp_path / 'nope.yaml'}: no such file"


def test_disk_path_under_a_file_is_unwritable(tmp_path):
    (tmp_path / "a-file").write_text("x")
    error = config_error({"cache": {"tiers": {"disk": {"path": str(tmp_path / "a-file" / "store"), "size": "1GiB"}}}})
    assert error.key == "cache.tiers.disk.path" and "cannot write" in str(error)


def test_disk_path_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "a-file").write_text("x")
    error = config_error({"cache": {"tiers": {"disk": {"path": str(tmp_path / "a-file"), "size": "1GiB"}}}})
    assert error.key == "cache.tiers.disk.path" and "not a directory" in str(error)


def test_disk_path_is_created_and_relative_paths_resolve_against_the_current_directory(tmp_path):
    config = load_config({"cache": {"tiers": {"disk": {"path": "stores/kv", "size": "1GiB"}}}})
    assert config.cache.tiers.disk.path == tmp_path / "stores" / "kv"
    assert config.cache.tiers.disk.path.is_dir()


def test_disk_path_is_created_private_to_its_owner_whatever_the_umask(tmp_path):
    previous = os.umask(0)
    try:
        config = load_config({"cache": {"tiers": {"disk": {"path": "kv", "size": "1GiB"}}}})
    finally:
        os.umask(previous)
    assert stat.S_IMODE(config.cache.tiers.disk.path.stat().st_mode) == 0o700


def test_a_config_for_reading_the_disk_store_neither_creates_nor_needs_to_write_its_path(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    for path in (tmp_path / "not-yet", blocker / "store"):
        config = load_config({"cache": {"tiers": {"disk": {"path": str(path), "size": "1GiB"}}}}, disk_read_only=True)
        assert config.cache.tiers.disk.path == path and not path.exists()


def test_an_existing_disk_directory_open_to_others_is_made_private(tmp_path):
    (tmp_path / "kv").mkdir(mode=0o755)
    (tmp_path / "kv").chmod(0o755)
    load_config({"cache": {"tiers": {"disk": {"path": "kv", "size": "1GiB"}}}})
    assert stat.S_IMODE((tmp_path / "kv").stat().st_mode) == 0o700


def test_cpu_tier_larger_than_ram_is_refused():
    error = config_error({"cache": {"tiers": {"cpu": {"size": "100PiB"}}}})
    assert error.key == "cache.tiers.cpu.size" and "RAM" in str(error)


def test_device_tier_on_cpu_larger_than_ram_is_refused():
    error = config_error({"model": {"device": "cpu"}, "cache": {"tiers": {"device": {"size": "100PiB"}}}})
    assert error.key == "cache.tiers.device.size" and "RAM" in str(error)


def test_device_tier_larger_than_the_gpu_is_refused(monkeypatch):
    monkeypatch.setattr(machine, "gpu_memory_bytes", lambda index, explicit=False: 8 * GiB)
    error = config_error({"cache": {"tiers": {"device": {"size": "16GiB"}}}})  # device: auto finds the GPU
    assert error.key == "cache.tiers.device.size" and "cuda:0" in str(error)
    assert load_config({"cache": {"tiers": {"device": {"size": "4GiB"}}}}).cache.tiers.device.size.nbytes == 4 * GiB


@pytest.mark.parametrize("tier, size", [("device", "1B"), ("device", "0.5MiB"), ("cpu", "1KiB")])
def test_a_tier_too_small_for_one_block_is_refused_by_the_check_as_by_serve(tier, size):
    error = config_error({"model": {"device": "cpu"}, "cache": {"tiers": {tier: {"size": size}}}})
    assert error.key == f"cache.tiers.{tier}.size" and "holds no block" in str(error)


def test_an_attention_backend_the_device_cannot_run_is_refused_by_the_check_as_by_serve(monkeypatch, two_gpus):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    error = config_error({"model": {"device": "cpu", "attention_backend": "triton"}})
    assert error.key == "model.attention_backend" and "needs a CUDA device" in str(error)
    error = config_error({"model": {"device": "cuda", "attention_backend": "cpu"}})
    assert error.key == "model.attention_backend" and "runs on a CPU device" in str(error)
    assert load_config({"model": {"device": "cuda", "attention_backend": "triton"}}).model.attention_backend == "triton"
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the interpreter runs Triton kernels on a CPU
    assert load_config({"model": {"device": "cpu", "attention_backend": "triton"}}).model.attention_backend == "triton"


def test_disk_tier_larger_than_free_space_is_refused(tmp_path):
    error = config_error({"cache": {"tiers": {"disk": {"path": str(tmp_path / "kv"), "size": "100PiB"}}}})
    assert error.key == "cache.tiers.disk.size" and "free space" in str(error)


SMOLLM2_FP32_BLOCK_NBYTES = 2 * SMOLLM2_BF16_BLOCK_NBYTES


@pytest.mark.parametrize("tier", ["device", "cpu", "disk"])
def test_block_counts_are_checked_like_byte_sizes_with_the_models_block_size(tier, monkeypatch, tmp_path):
    """A block count is bytes once the model's shape (read without loading it) and dtype are known:
    the same limit refuses 1000 blocks and accepts 999 whether the size says blocks or bytes."""
    limit = 999 * SMOLLM2_FP32_BLOCK_NBYTES + SMOLLM2_FP32_BLOCK_NBYTES // 2
    monkeypatch.setattr(machine, "available_ram_bytes", lambda: limit if tier != "disk" else 100 * GiB)
    monkeypatch.setattr(storage, "room_bytes", lambda path: limit)
    monkeypatch.setattr(probes, "cpu_has_amx", lambda: False)  # auto: float32
    cpu_tier_only = {"device": {"size": 1}} if tier == "cpu" else {}

    def tiers(size):
        extra = {"path": str(tmp_path / "kv")} if tier == "disk" else {}
        return {"model": {"device": "cpu"}, "cache": {"tiers": {**cpu_tier_only, tier: {"size": size, **extra}}}}

    if tier == "cpu":  # the device tier on the CPU takes its share of the RAM first
        monkeypatch.setattr(machine, "available_ram_bytes", lambda: limit + SMOLLM2_FP32_BLOCK_NBYTES)
    load_config(tiers(999))
    load_config(tiers(f"{999 * SMOLLM2_FP32_BLOCK_NBYTES}B"))
    error = config_error(tiers(1000))
    assert error.key == f"cache.tiers.{tier}.size"
    assert "1000 blocks" in str(error) and f"{SMOLLM2_FP32_BLOCK_NBYTES} bytes a block" in str(error)
    assert config_error(tiers(f"{1000 * SMOLLM2_FP32_BLOCK_NBYTES}B")).key == f"cache.tiers.{tier}.size"
    # bfloat16 blocks are half the bytes: twice as many fit; fp8 K/V of the float32 model, four times
    load_config(tiers(1998), {"model.dtype": "bfloat16"})
    load_config(tiers(3996), {"cache.kv_cache_dtype": "fp8"})
    assert config_error(tiers(4010), {"cache.kv_cache_dtype": "fp8"}).key == f"cache.tiers.{tier}.size"
    # int8 rows carry a 4-byte scale beside 64 values: 68/256 of a float32 block, 3762 of them in the room of 999.5
    load_config(tiers(3762), {"cache.kv_cache_dtype": "int8"})
    assert config_error(tiers(3770), {"cache.kv_cache_dtype": "int8"}).key == f"cache.tiers.{tier}.size"


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "bfloat16", "fp8", "int8"])
def test_config_sizes_a_block_as_the_engine_lays_it_out(kv_cache_dtype):
    """Tier sizes given in blocks are checked before torch is imported: the byte size used there is the
    size of the block the tiers will hold."""
    from kvstrata.tiers.base import BlockLayout

    config = load_config({"model": {"dtype": "float32"}, "cache": {"kv_cache_dtype": kv_cache_dtype}})
    layout = BlockLayout(30, config.cache.block_size, 3, 64, getattr(torch, config.resolved_kv_cache_dtype()))
    assert machine.TierBytes(config).block_nbytes == layout.block_nbytes


def test_a_block_count_far_beyond_the_machine_is_refused_before_serving():
    for tier in ("device", "cpu"):
        error = config_error({"cache": {"tiers": {tier: {"size": 100_000_000}}}})
        assert error.key == f"cache.tiers.{tier}.size" and "100000000 blocks" in str(error)


def test_pinned_cpu_tier_counts_what_the_allocator_rounds_it_up_to(two_gpus, monkeypatch):
    monkeypatch.setattr(machine, "available_ram_bytes", lambda: 48 * GiB)
    tiers = {"device": {"size": "1GiB"}, "cpu": {"size": "33GiB"}}
    error = config_error({"model": {"device": "cuda"}, "cache": {"tiers": tiers}})
    assert error.key == "cache.tiers.cpu.size" and "64.0 GiB once rounded up" in str(error)
    unpinned = {**tiers, "cpu": {"size": "33GiB", "pinned": False}}
    assert load_config({"model": {"device": "cuda"}, "cache": {"tiers": unpinned}}).cache.tiers.cpu.size.nbytes \
        == 33 * GiB
    assert machine.pinned_allocation_bytes(32 * GiB) == 32 * GiB
    assert machine.pinned_allocation_bytes(32 * GiB + 1) == 64 * GiB


# ---------------------------------------------------------------------------------- what auto means


def test_a_half_precision_dtype_much_slower_than_float32_on_the_cpu_is_warned_about():
    from kvstrata.engine.llm_engine import slow_dtype_warning

    assert slow_dtype_warning("bfloat16", 1.4) is None  # a CPU that computes it natively, or nearly
    warning = slow_dtype_warning("bfloat16", 61.2)
    assert "61x slower than float32" in warning and "model.dtype float32" in warning and "\n" not in warning


@pytest.mark.parametrize("amx, dtype", [(False, "float32"), (True, "bfloat16")])
def test_auto_dtype_on_a_cpu_is_float32_unless_it_has_amx(monkeypatch, amx, dtype):
    monkeypatch.setattr(probes, "cpu_has_amx", lambda: amx)
    assert load_config({"model": {"device": "cpu"}}).resolved_dtype() == dtype


@pytest.mark.parametrize("capability, dtype", [((9, 0), "bfloat16"), ((8, 0), "bfloat16"), ((7, 5), "float16")])
def test_auto_dtype_on_a_gpu_is_bfloat16_where_it_computes_it_natively(two_gpus, monkeypatch, capability, dtype):
    monkeypatch.setattr(probes, "_cuda_capability", lambda index: capability)
    assert load_config({"model": {"device": "cuda:1"}}).resolved_dtype() == dtype


def test_explicit_dtype_is_kept_whatever_the_machine(monkeypatch):
    monkeypatch.setattr(probes, "cpu_has_amx", lambda: True)
    assert load_config({"model": {"device": "cpu", "dtype": "fp32"}}).resolved_dtype() == "float32"
    monkeypatch.setattr(probes, "cpu_has_amx", lambda: False)
    assert load_config({"model": {"device": "cpu", "dtype": "bf16"}}).resolved_dtype() == "bfloat16"


def test_this_machines_cpu_check_agrees_with_torch(monkeypatch):
    import torch

    monkeypatch.delenv(probes.AMX_OVERRIDE_VARIABLE, raising=False)
    assert probes.cpu_has_amx() == torch.cpu._is_amx_tile_supported()


@pytest.mark.parametrize("flags, kernel_grants, amx", [
    ({"avx2", "fma"}, True, False),                              # an AVX2 CPU
    ({"avx512f", "avx512_bf16"}, True, False),                   # AVX-512 without tiles
    ({"avx512f", "amx_tile", "amx_bf16", "amx_int8"}, True, True),  # Sapphire Rapids and later
    ({"amx_tile", "amx_int8"}, True, False),                     # tiles without bfloat16
    ({"amx_tile", "amx_bf16"}, False, False),                    # a kernel that refuses the tile state
    (None, True, False),                                         # no /proc/cpuinfo (not Linux)
])
def test_the_amx_probe_reads_the_cpu_flags_and_the_kernel_never_torch(monkeypatch, flags, kernel_grants, amx):
    monkeypatch.delenv(probes.AMX_OVERRIDE_VARIABLE, raising=False)
    monkeypatch.setattr(probes, "_cpuinfo_flags", lambda: flags)
    monkeypatch.setattr(probes, "_kernel_grants_amx", lambda: kernel_grants)
    assert probes.cpu_has_amx() is amx
    assert load_config({"model": {"device": "cpu"}}).resolved_dtype() == ("bfloat16" if amx else "float32")


@pytest.mark.parametrize("forced, amx", [("1", True), ("0", False)])
def test_the_amx_probe_can_be_forced_either_way(monkeypatch, forced, amx):
    monkeypatch.setenv(probes.AMX_OVERRIDE_VARIABLE, forced)
    monkeypatch.setattr(probes, "_cpuinfo_flags", lambda: {"amx_tile", "amx_bf16"} if not amx else {"avx2"})
    assert probes.cpu_has_amx() is amx


@pytest.mark.parametrize("usable, physical, threads", [(1, 1, 1), (2, 2, 1), (2, 1, 1), (4, 2, 1), (4, 4, 4),
                                                       (8, 4, 4), (6, 8, 6), (64, 32, 16)])
def test_auto_threads_is_one_per_physical_core_capped_and_one_on_two_cores(monkeypatch, usable, physical, threads):
    monkeypatch.setattr(probes.os, "sched_getaffinity", lambda pid: set(range(usable)))
    monkeypatch.setattr(probes.psutil, "cpu_count", lambda logical=True: physical)
    config = load_config()
    assert config.model.threads == "auto" and config.resolved_threads() == threads
    assert load_config({"model": {"threads": 3}}).resolved_threads() == 3


@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0", "::", "::1", "localhost"])
def test_listenable_hosts_are_accepted(host):
    assert load_config({"server": {"host": host}}).server.host == host


@pytest.mark.parametrize("host, fragment", [("not a host", "neither an IP address"), ("300.1.1.1", "neither"),
                                            ("", "neither"), ("-bad-.example", "neither"),
                                            ("no-such-host.invalid", "cannot resolve")])
def test_host_that_cannot_be_listened_on_is_refused(host, fragment):
    error = config_error({"server": {"host": host}})
    assert error.key == "server.host" and fragment in str(error)


# --------------------------------------------------------------------------------- overrides and env


def test_overrides_as_dotted_strings_are_parsed_as_yaml(tmp_path):
    config = load_config(CONFIGS / "default.yaml", ["server.port=9001", "cache.tiers.cpu.pinned=false",
                                                    "cache.tiers.cpu.size=512MiB", "cache.block_size=32"])
    assert config.server.port == 9001 and config.cache.block_size == 32
    assert config.cache.tiers.cpu.size == Size.parse("512MiB") and not config.cache.tiers.cpu.pinned


def test_overrides_as_a_dict_and_null_turns_a_tier_off():
    config = load_config(CONFIGS / "default.yaml", {"cache.tiers.disk": None, "model.dtype": "fp32"})
    assert config.cache.tiers.disk is None and config.model.dtype == "float32"


@pytest.mark.parametrize("written", ["&SK-TopSecret", "*SK-TopSecret", "~", "null", "[not, a, list]", "123"])
def test_secrets_set_with_an_override_are_taken_as_written_never_read_as_yaml(written):
    # read as YAML, "&..." is an anchor (null: the server left open) and "*..." an alias whose error echoes it
    config = load_config(None, [f"server.api_key={written}"])
    assert config.server.api_key == written
    url = f"redis://app:{written.strip('[]')}@127.0.0.1:6379/0"
    assert load_config(None, [f"cache.tiers.remote.url={url}"]).cache.tiers.remote.url == url


def test_a_remote_password_given_as_a_query_parameter_is_masked_wherever_the_url_is_shown():
    config = load_config(None, [f"cache.tiers.remote.url=redis://127.0.0.1:6379/0?password={SECRET}"])
    shown = config.to_yaml() + repr(config)
    assert SECRET not in shown and "redis://127.0.0.1:6379/0?password=********" in config.to_yaml()


def test_override_of_an_unknown_key_names_it():
    assert config_error(None, ["cache.tiers.dsk.size=1GiB"]).key == "cache.tiers.dsk"


def test_override_without_equals_is_refused():
    assert "dotted.key=value" in str(config_error(None, ["server.port"]))


def test_overrides_apply_to_an_existing_config():
    base = load_config()
    assert load_config(base, {"server.port": 1234}).server.port == 1234
    assert base.server.port == 8000


def test_environment_overrides_the_file_and_explicit_overrides_win(monkeypatch):
    monkeypatch.setenv("PORT", "8001")
    assert load_config(CONFIGS / "default.yaml").server.port == 8001
    monkeypatch.setenv("KVSTRATA_PORT", "8002")
    assert load_config(CONFIGS / "default.yaml").server.port == 8002
    assert load_config(CONFIGS / "default.yaml", ["server.port=8003"]).server.port == 8003


def test_environment_sets_model_device_and_tier_sizes(monkeypatch, tmp_path):
    monkeypatch.setenv("KVSTRATA_HOST", "0.0.0.0")
    monkeypatch.setenv("KVSTRATA_DTYPE", "fp32")
    monkeypatch.setenv("KVSTRATA_DEVICE", "cpu")
    monkeypatch.setenv("KVSTRATA_DEVICE_SIZE", "128MiB")
    monkeypatch.setenv("KVSTRATA_CPU_SIZE", "0")
    monkeypatch.setenv("KVSTRATA_DISK_SIZE", "300")
    monkeypatch.setenv("KVSTRATA_DISK_PATH", str(tmp_path / "env-store"))
    config = load_config(CONFIGS / "default.yaml")
    assert (config.server.host, config.model.dtype, config.model.device) == ("0.0.0.0", "float32", "cpu")
    assert config.cache.tiers.device.size == Size.parse("128MiB")
    assert config.cache.tiers.cpu is None
    assert config.cache.tiers.disk.size == Size(num_blocks=300)
    assert config.cache.tiers.disk.path == tmp_path / "env-store"


def test_bad_environment_value_names_the_key_and_the_variable(monkeypatch):
    monkeypatch.setenv("KVSTRATA_CPU_SIZE", "huge")
    error = config_error(CONFIGS / "default.yaml")
    assert error.key == "cache.tiers.cpu.size" and "$KVSTRATA_CPU_SIZE" in str(error)


def test_environment_is_not_reapplied_to_an_existing_config(monkeypatch):
    config = load_config(None, {"server.port": 9000})
    monkeypatch.setenv("KVSTRATA_PORT", "8002")
    assert load_config(config).server.port == 9000



@pytest.mark.parametrize("scheduler, key, fragment", [
    ({"policy": "lifo"}, "scheduler.policy", "unknown value 'lifo'"),
    ({"step_target": "soon"}, "scheduler.step_target", "duration such as 50ms"),
    ({"step_target": "-5ms"}, "scheduler.step_target", "duration such as 50ms"),
    ({"step_target": 0}, "scheduler.step_target", "duration such as 50ms"),
    ({"long_prefill_share": 0}, "scheduler.long_prefill_share", "fraction in (0, 1]"),
    ({"long_prefill_share": 1.5}, "scheduler.long_prefill_share", "fraction in (0, 1]"),
    ({"watchdog_timeout": "-1s"}, "scheduler.watchdog_timeout", "duration such as 50ms"),
    ({"watchdog_timeout": "soon"}, "scheduler.watchdog_timeout", "duration such as 50ms"),
])
def test_scheduler_policy_step_target_and_share_errors_are_one_line(scheduler, key, fragment):
    with pytest.raises(ConfigError) as info:
        load_config({"scheduler": scheduler})
    assert info.value.key == key and fragment in str(info.value) and "\n" not in str(info.value)


def test_step_target_takes_milliseconds_seconds_or_a_number_and_round_trips():
    for value, seconds in (("50ms", 0.05), ("0.2s", 0.2), (0.1, 0.1), ("1", 1.0)):
        config = load_config({"scheduler": {"step_target": value, "policy": "fcfs"}})
        assert config.scheduler.step_target == pytest.approx(seconds)
        assert load_config(config.to_dict()) == config
    default = load_config().scheduler
    assert (default.policy, default.step_target, default.long_prefill_share) == ("uncached_first", 0.25, 0.25)


def test_watchdog_timeout_is_a_duration_on_by_default_and_0_turns_it_off():
    assert load_config().scheduler.watchdog_timeout == 60.0
    assert load_config({"scheduler": {"watchdog_timeout": "90s"}}).scheduler.watchdog_timeout == 90.0
    config = load_config({"scheduler": {"watchdog_timeout": 0}})
    assert config.scheduler.watchdog_timeout == 0.0 and load_config(config.to_dict()) == config


# ------------------------------------------------------------------------------------- remote tier

SECRET = "hunter2-do-not-print"


def remote(**fields) -> dict:
    return {"cache": {"tiers": {"remote": {"url": f"redis://app:{SECRET}@127.0.0.1:6379/0", **fields}}}}


def test_remote_tier_takes_tls_and_an_acl_user_and_round_trips_with_its_password_masked_when_shown():
    config = load_config(remote(url=f"rediss://app:{SECRET}@cache.internal:6380/2", timeout="20ms", ttl="24h",
                                queue_size="256MiB"))
    tier = config.cache.tiers.remote
    assert (tier.url, tier.timeout, tier.ttl) == (f"rediss://app:{SECRET}@cache.internal:6380/2", 0.02, 86400.0)
    assert tier.queue_size.nbytes == 256 << 20
    assert load_config(config.to_dict()) == config
    shown = config.to_yaml() + repr(config) + str(config)
    assert SECRET not in shown and "rediss://app:********@cache.internal:6380/2" in config.to_yaml()


@pytest.mark.parametrize("url", [f"http://app:{SECRET}@127.0.0.1:8001", "http://127.0.0.1:99999",
                                 "http://127.0.0.1:8001/v1", "ftp://127.0.0.1:8001"])
def test_a_router_replica_url_no_client_can_call_is_refused_and_its_password_never_shown(url):
    error = config_error({"router": {"replicas": [{"url": url}]}})
    assert error.key == "router.replicas.0.url" and "expected http://host:port" in str(error)
    assert SECRET not in str(error)


def test_remote_url_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("KVSTRATA_REMOTE_URL", "redis://10.0.0.5:6379/0")
    assert load_config(CONFIGS / "replicas.yaml").cache.tiers.remote.url == "redis://10.0.0.5:6379/0"


@pytest.mark.parametrize("fields, key, fragment", [
    ({"url": f"http://app:{SECRET}@host/0"}, "cache.tiers.remote.url", "expected a redis:// or rediss://"),
    ({"url": f"redis://app:{SECRET}@host/zero"}, "cache.tiers.remote.url", "database number"),
    ({"url": f"redis://app:{SECRET}@host:99999/0"}, "cache.tiers.remote.url", "cannot parse"),
    ({"url": f"redis://app:{SECRET}@host/3", "cluster": True}, "cache.tiers.remote.url", "only database 0"),
    ({"url": 12345}, "cache.tiers.remote.url", "expected a URL"),
    ({"timeout": 0}, "cache.tiers.remote.timeout", "positive duration"),
    ({"ttl": "-1s"}, "cache.tiers.remote.ttl", "expected a duration"),
    ({"key_prefix": "two words"}, "cache.tiers.remote.key_prefix", "without spaces"),
    ({"size": "1GiB"}, "cache.tiers.remote.size", "unknown key"),
    ({"queue_size": 0}, "cache.tiers.remote.queue_size", "cannot be empty"),
    ({"queue_size": "lots"}, "cache.tiers.remote.queue_size", "bad size"),
])
def test_remote_tier_errors_are_one_line_and_never_show_the_password(fields, key, fragment):
    error = config_error(remote(**fields))
    assert error.key == key and fragment in str(error), str(error)
    assert SECRET not in str(error)
