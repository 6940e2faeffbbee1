"""The `kvstrata` command line: config check, cache stats/clear, and one-line errors with exit code 2."""
from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import yaml

from kvstrata import cli
from kvstrata.engine.config import ENV_OVERRIDES, load_config
from test_config import write_model_dir

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def kvstrata(*args: str, cwd: Path, wrapper: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if key not in {v for v, _, _ in ENV_OVERRIDES}}
    return subprocess.run([*wrapper, sys.executable, "-m", "kvstrata.cli", *args], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=120)


def assert_one_line_error(result: subprocess.CompletedProcess, fragment: str) -> None:
    assert result.returncode == 2, result
    assert "Traceback" not in result.stderr
    assert result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith("kvstrata: error: ")
    assert fragment in result.stderr
    assert result.stdout == ""


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch, tmp_path):
    for variable, _, _ in ENV_OVERRIDES:
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.chdir(tmp_path)


def write_yaml(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data))
    return path


# ------------------------------------------------------------------------------------------ config check


def test_config_check_prints_the_resolved_config(tmp_path):
    result = kvstrata("config", "check", str(CONFIGS / "default.yaml"), "--set", "server.port=9001", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    printed = yaml.safe_load(result.stdout)
    assert printed["server"]["port"] == 9001
    assert printed["cache"]["tiers"]["disk"]["path"] == str(tmp_path / "kvstore")
    assert load_config(printed) == load_config(CONFIGS / "default.yaml", ["server.port=9001"])


def test_config_check_masks_the_api_key_and_never_echoes_a_bad_one(tmp_path):
    path = write_yaml(tmp_path / "server.yaml", {"server": {"api_key": "sk-do-not-print", "max_request_body": "1MiB"}})
    result = kvstrata("config", "check", str(path), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "sk-do-not-print" not in result.stdout
    printed = yaml.safe_load(result.stdout)["server"]
    assert printed["api_key"] == "********" and printed["max_request_body"] == "1MiB"
    bad = write_yaml(tmp_path / "bad.yaml", {"server": {"api_key": 987654321}})
    result = kvstrata("config", "check", str(bad), cwd=tmp_path)
    assert_one_line_error(result, "server.api_key: expected a non-empty string")
    assert "987654321" not in result.stderr


def test_config_check_masks_the_remote_tier_password(tmp_path):
    url = "rediss://app:s3cret-do-not-print@127.0.0.1:6380/0"
    path = write_yaml(tmp_path / "remote.yaml", {"cache": {"tiers": {"remote": {"url": url}}}})
    result = kvstrata("config", "check", str(path), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert yaml.safe_load(result.stdout)["cache"]["tiers"]["remote"]["url"] == "rediss://app:********@127.0.0.1:6380/0"
    bad = write_yaml(tmp_path / "bad.yaml", {"cache": {"tiers": {"remote": {"url": url.replace("rediss", "https")}}}})
    result = kvstrata("config", "check", str(bad), cwd=tmp_path)
    assert_one_line_error(result, "cache.tiers.remote.url:")
    assert "s3cret-do-not-print" not in result.stdout + result.stderr


def test_config_check_of_a_bad_key_is_one_line_and_exit_2(tmp_path):
    path = write_yaml(tmp_path / "bad.yaml", {"cache": {"tiers": {"dsk": {"size": "1GiB"}}}})
    assert_one_line_error(kvstrata("config", "check", str(path), cwd=tmp_path), "cache.tiers.dsk: unknown key")


def test_config_check_of_malformed_yaml_is_one_line_and_exit_2(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("model: {name: [\n")
    assert_one_line_error(kvstrata("config", "check", str(path), cwd=tmp_path), "malformed YAML at line")


def test_config_check_of_a_missing_file_is_one_line_and_exit_2(tmp_path):
    assert_one_line_error(kvstrata("config", "check", "nope.yaml", cwd=tmp_path), "nope.yaml: no such file")


def test_config_check_of_a_bad_override_is_one_line_and_exit_2(tmp_path):
    result = kvstrata("config", "check", str(CONFIGS / "default.yaml"), "--set", "cache.hash=md5", cwd=tmp_path)
    assert_one_line_error(result, "cache.hash: unknown value 'md5'")


@pytest.mark.parametrize("cpu_flags", [{"avx2"}, {"avx2", "avx512f", "amx_tile", "amx_bf16"}],
                         ids=["without-amx", "with-amx"])
def test_config_check_needs_neither_torch_nor_transformers(tmp_path, cpu_flags):
    # Sizes in blocks need the block's dtype, so `dtype: auto` asks whether the CPU has AMX: on either CPU
    # the answer must come without torch (the probe's flags are patched, so this runs the same everywhere).
    probe = ("import sys, contextlib, io\n"
             "from kvstrata.engine.config import probes\n"
             f"probes._cpuinfo_flags = lambda: set({sorted(cpu_flags)!r})\n"
             "probes._kernel_grants_amx = lambda: True\n"
             "from kvstrata.cli import main\n"
             "with contextlib.redirect_stdout(io.StringIO()):\n"
             f"    assert main(['config', 'check', {str(CONFIGS / 'pressure.yaml')!r}]) == 0\n"
             "heavy = sorted(m for m in ('torch', 'transformers', 'triton') if m in sys.modules)\n"
             "assert not heavy, heavy\n")
    env = {k: v for k, v in os.environ.items() if k != "KVSTRATA_CPU_AMX"}
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=tmp_path, timeout=120,
                            env=env)
    assert result.returncode == 0, result.stderr


REFUSED_BEFORE_SERVING = [
    pytest.param({"cache": {"tiers": {"device": {"size": 100_000_000}}}}, "cache.tiers.device.size", id="device-blocks"),
    pytest.param({"cache": {"tiers": {"cpu": {"size": 100_000_000}}}}, "cache.tiers.cpu.size", id="cpu-blocks"),
    pytest.param({"model": {"device": "cuda:3"}}, "model.device: cuda:3: no such CUDA device", id="missing-gpu"),
    pytest.param({"model": {"max_model_len": 10**9}}, "model.max_model_len", id="max-model-len"),
    pytest.param({"server": {"host": "not a host"}}, "server.host", id="host"),
    pytest.param(None, "the file is empty", id="empty-file"),
]


@pytest.mark.parametrize("data, fragment", REFUSED_BEFORE_SERVING)
def test_config_check_refuses_what_serve_could_not_run(tmp_path, data, fragment):
    path = tmp_path / "c.yaml"
    path.write_text("" if data is None else yaml.safe_dump(data))
    assert_one_line_error(kvstrata("config", "check", str(path), cwd=tmp_path), fragment)


@pytest.mark.parametrize("data, fragment", [case for case in REFUSED_BEFORE_SERVING if case.id in
                                            ("device-blocks", "cpu-blocks", "missing-gpu")])
def test_serve_refuses_tiers_and_devices_the_machine_lacks_in_one_line(tmp_path, data, fragment):
    path = write_yaml(tmp_path / "c.yaml", data)
    assert_one_line_error(kvstrata("serve", "--config", str(path), cwd=tmp_path), fragment)


def test_version_is_printed(tmp_path):
    result = kvstrata("--version", cwd=tmp_path)
    assert result.returncode == 0 and result.stdout.startswith("kvstrata ")


# ------------------------------------------------------------------------------------------ other commands


def test_ask_without_the_document_is_one_line_and_exit_2(tmp_path):
    assert_one_line_error(kvstrata("ask", "--doc", "missing.txt", "what?", cwd=tmp_path), "--doc: no such file")


def test_ask_on_a_directory_says_it_is_a_directory(tmp_path, capsys):
    (tmp_path / "docs").mkdir()
    assert cli.main(["ask", "--doc", "docs", "what?"]) == 2
    assert capsys.readouterr().err == "kvstrata: error: --doc: 'docs' is a directory, not a text file\n"


@pytest.mark.parametrize("value, says", [("abc", "invalid positive integer value: 'abc'"),
                                         ("0", "must be a positive integer, got 0")])
def test_a_count_that_is_no_positive_integer_is_refused_in_words(tmp_path, capsys, value, says):
    (tmp_path / "doc.txt").write_text("a document")
    with pytest.raises(SystemExit) as exited:
        cli.main(["ask", "--doc", "doc.txt", "what?", "--max-tokens", value])
    assert exited.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == f"kvstrata ask: error: argument --max-tokens: {says}"


def test_ask_without_a_question_is_one_line_and_exit_2(tmp_path):
    (tmp_path / "doc.txt").write_text("a document")
    assert_one_line_error(kvstrata("ask", "--doc", "doc.txt", cwd=tmp_path), "at least one question")


def test_serve_with_a_bad_config_fails_before_loading_anything(tmp_path):
    path = write_yaml(tmp_path / "bad.yaml", {"scheduler": {"max_num_seqs": 0}})
    assert_one_line_error(kvstrata("serve", "--config", str(path), cwd=tmp_path), "scheduler.max_num_seqs")


def test_bench_with_a_bad_config_fails_before_running(tmp_path):
    result = kvstrata("bench", "ttft", "--config", str(CONFIGS / "pressure.yaml"), "--set", "model.dtype=fp8",
                      cwd=tmp_path)
    assert_one_line_error(result, "model.dtype")


@pytest.mark.parametrize("benchmark, module", [("ttft", "pressure"), ("concurrency", "concurrency")])
def test_bench_runs_the_suites_subcommand_with_the_config_and_options(monkeypatch, benchmark, module):
    ran = []
    # the suite (benchmarks/ttft.py) imports its subcommand's module when it runs: this one records its options
    monkeypatch.setitem(sys.modules, f"benchmarks.suites.ttft.{module}", types.SimpleNamespace(main=ran.append))
    config, argv = str(CONFIGS / "pressure.yaml"), list(sys.argv)
    assert cli.main(["bench", benchmark, "--config", config, "--set", "model.threads=1", "--docs", "2"]) == 0
    assert ran == [["--config", config, "--set", "model.threads=1", "--docs", "2"]]
    assert sys.argv == argv  # the caller's command line again, after the suite saw `ttft.py SUBCOMMAND ...`


@pytest.mark.parametrize("benchmark, option, value", [("ttft", "--docs", "-1"), ("ttft", "--cold-pairs", "-1"),
                                                       ("concurrency", "--streams", "0"), ("scoring", "--docs", "0")])
def test_bench_refuses_a_count_below_its_least_before_running(capsys, benchmark, option, value):
    least = "non-negative" if option == "--cold-pairs" else "positive"
    assert cli.main(["bench", benchmark, "--config", str(CONFIGS / "pressure.yaml"), option, value]) == 2
    assert f"argument {option}: must be a {least} integer, got {value}" in capsys.readouterr().err


def test_bench_outside_a_source_tree_says_where_to_run_it(monkeypatch, tmp_path, capsys):
    # installed from a wheel, the package has no benchmarks/ beside it; nor has the current directory
    monkeypatch.setattr(cli, "__file__", str(tmp_path / "site-packages" / "kvstrata" / "cli.py"))
    monkeypatch.chdir(tmp_path)
    assert cli.main(["bench", "ttft", "--config", str(CONFIGS / "pressure.yaml")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "run `kvstrata bench` in a clone of kvstrata" in err


def test_serve_hands_the_config_with_host_and_port_flags_to_the_server(monkeypatch):
    served = []
    monkeypatch.setitem(sys.modules, "kvstrata.serving.server", types.SimpleNamespace(serve=served.append))
    assert cli.main(["serve", "--config", str(CONFIGS / "default.yaml"), "--port", "9100", "--host", "0.0.0.0",
                     "--api-key", "from-the-flag", "--set", "scheduler.max_num_seqs=4"]) == 0
    (config,) = served
    assert (config.server.host, config.server.port, config.scheduler.max_num_seqs) == ("0.0.0.0", 9100, 4)
    assert config.server.api_key == "from-the-flag"


def test_serve_takes_the_api_key_from_the_environment_and_the_flag_wins(monkeypatch):
    served = []
    monkeypatch.setitem(sys.modules, "kvstrata.serving.server", types.SimpleNamespace(serve=served.append))
    monkeypatch.setenv("KVSTRATA_API_KEY", "from-the-environment")
    assert cli.main(["serve"]) == 0
    assert cli.main(["serve", "--api-key", "from-the-flag"]) == 0
    assert [config.server.api_key for config in served] == ["from-the-environment", "from-the-flag"]


def serve_config(*argv: str):
    """The config `kvstrata serve ARGV` would serve, built without loading a model."""
    return cli.serve_config(cli.build_parser().parse_args(["serve", *argv]))


def test_serve_takes_a_model_directory_and_vllm_flags_onto_their_config_keys(tmp_path):
    model_dir = write_model_dir(tmp_path / "my-llama")
    config = serve_config(str(model_dir), "--max-model-len", "1024", "--dtype", "bf16", "--kv-cache-dtype", "fp8",
                          "--block-size", "32", "--served-model-name", "my-llama", "--host", "0.0.0.0",
                          "--port", "9001", "--api-key", "123", "--max-num-seqs", "4",
                          "--no-enable-prefix-caching")
    assert config.model.name == str(model_dir) and config.model.max_model_len == 1024
    assert (config.model.dtype, config.cache.kv_cache_dtype, config.cache.block_size) == ("bfloat16", "fp8", 32)
    assert (config.server.model_alias, config.server.host, config.server.port) == ("my-llama", "0.0.0.0", 9001)
    assert config.server.api_key == "123"  # a key of digits stays a string
    assert config.scheduler.max_num_seqs == 4 and config.cache.enable_prefix_caching is False
    assert serve_config("--model", str(model_dir)).model.name == str(model_dir)


def test_serve_flags_beat_set_which_beats_the_config_file(tmp_path):
    path = write_yaml(tmp_path / "c.yaml", {"model": {"max_model_len": 512}, "cache": {"block_size": 8},
                                            "scheduler": {"max_num_seqs": 3}})
    config = serve_config("--config", str(path), "--set", "model.max_model_len=1024", "--set", "cache.block_size=64",
                          "--block-size", "32")
    assert (config.model.max_model_len, config.cache.block_size) == (1024, 32)
    assert config.scheduler.max_num_seqs == 3  # what no flag or --set names comes from the file
    assert serve_config("--config", str(path)).cache.block_size == 8


def test_serve_without_flags_keeps_the_config_file_and_defaults(tmp_path):
    assert serve_config() == load_config()
    assert serve_config("--config", str(CONFIGS / "default.yaml")) == load_config(CONFIGS / "default.yaml")


@pytest.mark.parametrize("argv, fragment", [
    (["--max-model-len", "lots"], "--max-model-len: expected an integer, got 'lots'"),
    (["--max-model-len", "999999"], "--max-model-len (model.max_model_len): 999999 is more than the model's limit"),
    (["--block-size", "12"], "--block-size (cache.block_size): unknown value 12"),
    (["--dtype", "fp9"], "--dtype (model.dtype): unknown value 'fp9'"),
    (["--kv-cache-dtype", "fp4"], "--kv-cache-dtype (cache.kv_cache_dtype): unknown value 'fp4'"),
    (["--port", "70000"], "--port (server.port): must be at most 65535"),
    (["no-such-model-dir"], "MODEL (model.name): 'no-such-model-dir' is neither"),
    (["a", "--model", "b"], "MODEL 'a' and --model 'b' disagree"),
])
def test_serve_with_a_bad_flag_value_is_one_line_naming_the_flag_and_exit_2(tmp_path, argv, fragment):
    assert_one_line_error(kvstrata("serve", *argv, cwd=tmp_path), fragment)


def test_ask_hands_document_and_all_questions_to_qa(monkeypatch, tmp_path):
    calls = []
    fake_qa = types.SimpleNamespace(ask=lambda *args: calls.append(args), score_choices=None)
    monkeypatch.setitem(sys.modules, "kvstrata.engine.qa", fake_qa)
    (tmp_path / "doc.txt").write_text("a document")
    assert cli.main(["ask", "--doc", "doc.txt", "--question", "first?", "second?", "--max-tokens", "7"]) == 0
    (config, doc_path, questions, max_tokens), = calls
    assert (Path(doc_path), questions, max_tokens) == (Path("doc.txt"), ["first?", "second?"], 7)
    assert config == load_config()


def test_ask_with_choices_scores_them_instead_and_wants_at_least_two(monkeypatch, tmp_path, capsys):
    calls = []
    fake_qa = types.SimpleNamespace(ask=None, score_choices=lambda *args: calls.append(args))
    monkeypatch.setitem(sys.modules, "kvstrata.engine.qa", fake_qa)
    (tmp_path / "doc.txt").write_text("a document")
    assert cli.main(["ask", "--doc", "doc.txt", "When?", "--choice", "In 1921.", "--choice", "In 1987."]) == 0
    (_, _, questions, choices), = calls
    assert (questions, choices) == (["When?"], ["In 1921.", "In 1987."])
    assert cli.main(["ask", "--doc", "doc.txt", "When?", "--choice", "In 1921."]) == 2
    assert capsys.readouterr().err.strip() == "kvstrata: error: --choice: give at least two choices to rank"


def test_ctrl_c_exits_130_quietly(monkeypatch, capsys):
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_config_check", interrupted)
    assert cli.main(["config", "check", "whatever.yaml"]) == 130
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("url, says", [
    ("http://u:RouteSecret@127.0.0.1:1/x", "got 'http://u:********@127.0.0.1:1/x'"),
    ("http://127.0.0.1:99999", "got 'http://127.0.0.1:99999'"),
    ("http://127.0.0.1:0,tcp://127.0.0.1:5557", "got 'http://127.0.0.1:0'"),
])
def test_route_refuses_a_replica_url_it_cannot_call_and_never_shows_its_password(capsys, url, says):
    assert cli.main(["route", "--replica", url]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvstrata: error: --replica: expected http://host:port") and err.count("\n") == 1
    assert says in err and "RouteSecret" not in err


def test_unknown_arguments_are_refused(tmp_path):
    result = kvstrata("config", "check", str(CONFIGS / "default.yaml"), "--frobnicate", cwd=tmp_path)
    assert result.returncode == 2 and "unrecognized arguments: --frobnicate" in result.stderr


# ------------------------------------------------------------------------------------------ cache stats/clear


def make_store(path: Path, num_blocks: int) -> None:
    import torch

    from kvstrata.tiers.base import BlockLayout, as_bytes
    from kvstrata.tiers.disk import DiskTier

    layout = BlockLayout(num_layers=2, block_size=4, num_kv_heads=1, head_dim=8, dtype=torch.float32)
    tier = DiskTier(layout, str(path), capacity_bytes=4 * 1024**2)
    blocks = layout.allocate(num_blocks)
    tier.put([bytes([i]) * 16 for i in range(num_blocks)], [[i, i, i, i] for i in range(num_blocks)],
             [as_bytes(blocks[i]) for i in range(num_blocks)])
    tier.close()


def test_cache_stats_and_clear_on_a_disk_store(tmp_path, capsys):
    # In-process: the disk tier imports torch, which a subprocess would pay for on every call.
    store = tmp_path / "store"
    make_store(store, num_blocks=3)
    config = str(write_yaml(tmp_path / "c.yaml", {"cache": {"tiers": {"disk": {"path": str(store), "size": "4MiB"}}}}))

    assert cli.main(["cache", "stats", "--config", config]) == 0
    report = yaml.safe_load(capsys.readouterr().out)["disk"]
    assert report["path"] == str(store) and report["entries"] == 3 and report["used_bytes"] > 0

    assert cli.main(["cache", "clear", "--config", config]) == 0
    assert capsys.readouterr().out.strip() == f"cleared 3 blocks from {store}"

    assert cli.main(["cache", "stats", "--config", config]) == 0
    after = yaml.safe_load(capsys.readouterr().out)["disk"]
    assert after["entries"] == 0 and after["used_bytes"] == 0


def test_cache_stats_on_a_disk_path_that_is_a_file_is_the_config_checks_error(tmp_path):
    (tmp_path / "afile").write_text("not a store")
    sets = ("--set", "cache.tiers.disk.path=./afile", "--set", "cache.tiers.disk.size=1GiB")
    said = f"cache.tiers.disk.path: '{tmp_path / 'afile'}' exists and is not a directory"
    assert_one_line_error(kvstrata("config", "check", str(CONFIGS / "default.yaml"), *sets, cwd=tmp_path), said)
    assert_one_line_error(kvstrata("cache", "stats", *sets, cwd=tmp_path), said)


def test_cache_stats_before_anything_was_written_says_so(tmp_path):
    config = write_yaml(tmp_path / "c.yaml", {"cache": {"tiers": {"disk": {"path": "fresh", "size": "4MiB"}}}})
    result = kvstrata("cache", "stats", "--config", str(config), cwd=tmp_path)
    assert result.returncode == 0 and "no store at" in result.stdout


def test_cache_commands_with_the_disk_tier_off_say_so(tmp_path):
    for action in ("stats", "clear"):
        result = kvstrata("cache", action, "--set", "cache.tiers.cpu.size=1MiB", cwd=tmp_path)
        assert result.returncode == 0 and "disk tier: off" in result.stdout


def disk_config(tmp_path: Path, store: Path) -> str:
    return str(write_yaml(tmp_path / "c.yaml", {"cache": {"tiers": {"disk": {"path": str(store), "size": "4MiB"}}}}))


def test_cache_stats_on_a_truncated_store_is_one_line_and_cache_clear_repairs_it(tmp_path):
    store = tmp_path / "store"
    make_store(store, num_blocks=20)
    os.truncate(store / "data.mdb", 3 * 4096)  # cuts pages LMDB uses: reading them would be SIGBUS
    config = disk_config(tmp_path, store)
    stats = kvstrata("cache", "stats", "--config", config, cwd=tmp_path)
    assert_one_line_error(stats, "data.mdb is truncated")
    assert "`kvstrata cache clear` removes it" in stats.stderr
    cleared = kvstrata("cache", "clear", "--config", config, cwd=tmp_path)
    assert cleared.returncode == 0 and "removed its files" in cleared.stdout, cleared
    after = kvstrata("cache", "stats", "--config", config, cwd=tmp_path)
    assert after.returncode == 0 and "no store at" in after.stdout


def test_cache_stats_on_an_empty_data_file_says_so_in_one_line(tmp_path):
    store = tmp_path / "store"
    store.mkdir()
    (store / "data.mdb").write_bytes(b"")
    result = kvstrata("cache", "stats", "--config", disk_config(tmp_path, store), cwd=tmp_path)
    assert_one_line_error(result, "data.mdb is empty (0 bytes)")


def test_cache_stats_works_on_a_read_only_store(tmp_path):
    store = tmp_path / "store"
    make_store(store, num_blocks=3)
    config = disk_config(tmp_path, store)
    # Root ignores file modes unless it gives up the capabilities that let it.
    wrapper = ("setpriv", "--bounding-set", "-dac_override,-dac_read_search") if os.geteuid() == 0 else ()
    for path in (store / "data.mdb", store / "lock.mdb", store):
        path.chmod(0o500 if path.is_dir() else 0o400)
    try:
        result = kvstrata("cache", "stats", "--config", config, cwd=tmp_path, wrapper=wrapper)
        assert result.returncode == 0, result.stderr
        assert yaml.safe_load(result.stdout)["disk"]["entries"] == 3
        cleared = kvstrata("cache", "clear", "--config", config, cwd=tmp_path, wrapper=wrapper)
        assert_one_line_error(cleared, "cache.tiers.disk.path: cannot write to")
    finally:
        store.chmod(0o700)


def remote_config(tmp_path: Path, url: str, cluster: bool = False) -> str:
    return str(write_yaml(tmp_path / "remote.yaml", {"cache": {"tiers": {
        "remote": {"url": url, "cluster": cluster, "key_prefix": "team-a"}}}}))


def put_remote_blocks(url: str, cluster: bool, num_blocks: int) -> None:
    import torch

    from kvstrata.tiers.base import BlockLayout, as_bytes
    from kvstrata.tiers.remote import RemoteTier

    layout = BlockLayout(num_layers=2, block_size=4, num_kv_heads=1, head_dim=8, dtype=torch.float32)
    tier = RemoteTier(layout, url, cluster=cluster, key_prefix="team-a", timeout=2.0)
    blocks = layout.allocate(num_blocks)
    tier.put([bytes([i]) * 16 for i in range(num_blocks)], [[i, i, i, i] for i in range(num_blocks)],
             [as_bytes(blocks[i]) for i in range(num_blocks)])
    tier.flush()
    tier.close()


@pytest.mark.parametrize("cluster", [False, True], ids=["server", "cluster"])
def test_cache_stats_and_clear_reach_the_remote_tier_and_only_its_key_prefix(tmp_path, capsys, cluster):
    import redis
    from valkey_server import valkey_nodes

    with valkey_nodes(cluster) as nodes:
        url = nodes[0].url
        put_remote_blocks(url, cluster, num_blocks=5)
        other = redis.RedisCluster.from_url(url) if cluster else nodes[0].client()
        other.set("team-b:x", b"another tenant's key")  # not under the config's prefix
        config = remote_config(tmp_path, url, cluster)

        assert cli.main(["cache", "stats", "--config", config]) == 0
        report = yaml.safe_load(capsys.readouterr().out.split("\n", 1)[1])["remote"]  # after "disk tier: off"
        assert report["reachable"] and report["blocks"] == 5 and report["used_bytes"] > 5 * 2 * 2 * 4 * 8 * 4
        assert report["key_prefix"] == "team-a" and report["cluster"] == cluster

        assert cli.main(["cache", "clear", "--tier", "remote", "--config", config]) == 0
        assert capsys.readouterr().out.strip() == f"cleared 5 blocks from {url} (key prefix team-a)"
        assert cli.main(["cache", "stats", "--tier", "remote", "--config", config]) == 0
        assert yaml.safe_load(capsys.readouterr().out)["remote"]["blocks"] == 0
        assert other.get("team-b:x") == b"another tenant's key"
        other.close()


def test_cache_commands_on_an_unreachable_remote_tier(tmp_path, capsys):
    from valkey_server import free_port

    config = remote_config(tmp_path, f"redis://:hunter2@127.0.0.1:{free_port()}/0")
    assert cli.main(["cache", "stats", "--tier", "remote", "--config", config]) == 1  # reported, and failed
    out, err = capsys.readouterr()
    report = yaml.safe_load(out)["remote"]
    assert report["reachable"] is False and "hunter2" not in str(report)
    assert err.startswith("kvstrata: error: remote tier redis://:********@") and err.count("\n") == 1
    assert "hunter2" not in err
    result = kvstrata("cache", "clear", "--tier", "remote", "--config", config, cwd=tmp_path)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1
    assert "remote tier redis://" in result.stderr and "hunter2" not in result.stderr + result.stdout


# ------------------------------------------------------------------------------------------ cache documents


@pytest.fixture
def document_server():
    """A stand-in for a running server's document API: answers every DELETE with `{}` and records its path."""
    import http.server
    import threading

    paths = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_DELETE(self):
            paths.append(self.path)
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", paths
    server.shutdown()
    thread.join()


def test_documents_unpin_sends_any_id_as_one_path_segment(document_server, capsys):
    url, paths = document_server
    for document_id in ("a?b#c", "../../v1/models"):
        assert cli.main(["cache", "documents", "unpin", document_id, "--url", url]) == 0
        assert capsys.readouterr().out == f"unpinned {document_id}\n"
    assert paths == ["/v1/cache/documents/a%3Fb%23c", "/v1/cache/documents/..%2F..%2Fv1%2Fmodels"]


def test_documents_unpin_of_an_empty_id_is_one_line_and_asks_nothing(document_server, capsys):
    url, paths = document_server
    assert cli.main(["cache", "documents", "unpin", "", "--url", url]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvstrata: error: unpin: the document id is empty") and err.count("\n") == 1
    assert paths == []


@pytest.mark.parametrize("url", ["http://user:Pw5ecret@127.0.0.1:9", "http://user:Pw5ecret@127.0.0.1:x",
                                 "ftp://user:Pw5ecret@127.0.0.1:9"])
def test_documents_commands_refuse_a_url_they_cannot_call_and_never_show_its_password(capsys, url):
    assert cli.main(["cache", "documents", "list", "--url", url]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvstrata: error: --url: expected http://host:port") and err.count("\n") == 1
    assert "user:********@127.0.0.1" in err and "Pw5ecret" not in err


# ------------------------------------------------------------------------------------------ logging


def test_log_lines_carry_time_level_and_logger_at_the_level_asked(tmp_path, monkeypatch, capsys):
    import logging
    import re

    monkeypatch.setenv("KVSTRATA_LOG_LEVEL", "warning")
    assert cli.main(["config", "check", str(CONFIGS / "default.yaml")]) == 0
    logging.getLogger("kvstrata.tiers.disk").info("not shown at warning")
    logging.getLogger("kvstrata.tiers.disk").warning("a disk warning")
    assert cli.main(["--log-level", "debug", "config", "check", str(CONFIGS / "default.yaml")]) == 0  # the flag wins
    logging.getLogger("kvstrata.engine").info("an engine line")
    err = capsys.readouterr().err
    assert "not shown" not in err
    assert re.search(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ WARNING kvstrata\.tiers\.disk: a disk warning$", err, re.M)
    assert re.search(r" INFO kvstrata\.engine: an engine line$", err, re.M)
    assert err.count("a disk warning") == 1  # one handler, however often main runs


def test_an_unknown_log_level_is_one_line_and_exit_2(capsys):
    assert cli.main(["--log-level", "loud", "config", "check", str(CONFIGS / "default.yaml")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "kvstrata: error: --log-level: unknown level 'loud' (expected debug, info, warning, error, critical)"
