"""`kvstrata`, the command line (docs/design.md, "CLI").

    kvstrata serve  [MODEL] [--config F] [--set key=value ...] [vLLM's flags: --max-model-len N --dtype D
                    --kv-cache-dtype D --block-size N --served-model-name NAME --host H --port P --api-key KEY ...]
    kvstrata route  --config F [--host H] [--port P] [--replica URL[,EVENTS] ...]
    kvstrata ask    --config F --doc FILE [--question Q ...] [QUESTION ...] [--max-tokens N]
    kvstrata bench  ttft --config F [benchmark options ...]
    kvstrata bench  concurrency --config F [benchmark options ...]
    kvstrata config check FILE [--set key=value ...]
    kvstrata plan   --config F --trace T [--sweep key=v1,v2 ...] [--plot P] [--replicas N --route R] [--json]
    kvstrata cache  stats|clear --config F [--tier disk|remote]
    kvstrata cache  documents add FILE [--prompt] [--cache-salt S] [--no-pin] | list | unpin ID  [--url U | --config F]

Every command takes `--set dotted.key=value` (repeatable) on top of its config file. A bad config
or argument value is one line on stderr and exit code 2, never a traceback; Ctrl-C exits 130.
Heavy modules (torch, transformers, the engine) are imported inside the commands that need them,
so `kvstrata config check` and `kvstrata --version` stay fast.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import runpy
import sys
from pathlib import Path
from typing import Any, Sequence
from urllib.parse import quote

from kvstrata import __version__, planner
from kvstrata.arguments import positive_int
from kvstrata.tiers.remote_url import masked_url

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2          # bad config or arguments (argparse uses 2 too)
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report it
PERSISTENT_TIERS = ("disk", "remote")
LOG_LEVEL_VARIABLE = "KVSTRATA_LOG_LEVEL"
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"  # the tiers `kvstrata cache` reaches: the others live in a process


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "passes_extra_args", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.extra = extra
    try:
        configure_logging(args.log_level or os.environ.get(LOG_LEVEL_VARIABLE, "").strip() or "info")
        return args.run(args)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except ValueError as exc:  # ConfigError is a ValueError
        _print_error(exc)
        return EXIT_USAGE
    except (OSError, ModuleNotFoundError) as exc:
        _print_error(exc)
        return EXIT_FAILURE


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvstrata", description="An LLM inference engine with a tiered prefix KV cache.")
    parser.add_argument("--version", action="version", version=f"kvstrata {__version__}")
    parser.add_argument("--log-level", metavar="LEVEL", default=None,
                        help=f"{', '.join(LOG_LEVELS)} (default: ${LOG_LEVEL_VARIABLE}, else info)")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = commands.add_parser("serve", help="serve the OpenAI-compatible HTTP API",
                                description="Flags beat --set, which beats the environment, which beats --config.")
    serve.add_argument("model_positional", nargs="?", metavar="MODEL",
                       help="the embedded model's name, a local model directory or a GGUF file "
                            "(as model.name; vLLM's MODEL)")
    _add_config_arguments(serve)
    _add_engine_arguments(serve)
    serve.set_defaults(run=_serve)

    route = commands.add_parser("route", help="route OpenAI API requests to the replica holding their prefix")
    _add_config_arguments(route)
    route.add_argument("--host", help="address to listen on (overrides router.host)")
    route.add_argument("--port", type=int, help="port to listen on (overrides router.port)")
    route.add_argument("--replica", action="append", default=[], metavar="URL[,EVENTS]",
                       help="a replica's base URL and, after a comma, its KV events endpoint, e.g. "
                            "http://127.0.0.1:8001,tcp://127.0.0.1:5557 (repeatable; replaces router.replicas)")
    route.set_defaults(run=_route)

    ask = commands.add_parser("ask", help="answer questions about a long document")
    _add_config_arguments(ask)
    ask.add_argument("--doc", required=True, help="the document (a text file)")
    ask.add_argument("--question", action="append", default=[], help="a question (repeatable)")
    ask.add_argument("questions", nargs="*", metavar="QUESTION", help="more questions")
    ask.add_argument("--max-tokens", type=positive_int, default=256, help="longest answer in tokens (default 256)")
    ask.add_argument("--choice", action="append", default=[],
                     help="an answer to score (repeatable): each question becomes a multiple choice, its choices "
                          "ranked by their log-likelihood given the document and the question")
    ask.set_defaults(run=_ask)

    bench = commands.add_parser("bench", help="run a benchmark")
    benchmarks = bench.add_subparsers(dest="benchmark", required=True, metavar="BENCHMARK")
    ttft = benchmarks.add_parser("ttft", help="time to first token under memory pressure (benchmarks/ttft.py "
                                              "pressure); options after --config go to the benchmark")
    _add_config_arguments(ttft)
    ttft.set_defaults(run=_bench_ttft, passes_extra_args=True)
    concurrency = benchmarks.add_parser(
        "concurrency", help="TTFT of cached questions and new documents at once, fcfs against uncached_first "
                            "(benchmarks/ttft.py concurrency); options after --config go to the benchmark")
    _add_config_arguments(concurrency)
    concurrency.set_defaults(run=_bench_concurrency, passes_extra_args=True)
    scoring = benchmarks.add_parser(
        "scoring", help="scoring answers on long documents, every prompt computed (as vLLM) against the cache of "
                        "prompt log-probabilities (benchmarks/scoring.py); options after --config go to the benchmark")
    _add_config_arguments(scoring)
    scoring.set_defaults(run=_bench_scoring, passes_extra_args=True)

    config = commands.add_parser("config", help="work with config files")
    config_commands = config.add_subparsers(dest="config_command", required=True, metavar="ACTION")
    check = config_commands.add_parser("check", help="validate a config file and print the resolved config")
    check.add_argument("file", metavar="FILE")
    _add_override_argument(check)
    check.set_defaults(run=_config_check)

    plan = commands.add_parser("plan", help="size the tiers from a trace of real traffic (kvstrata/planner.py)")
    _add_config_arguments(plan)
    planner.add_arguments(plan)
    plan.set_defaults(run=planner.run)

    cache = commands.add_parser("cache", help="inspect or empty the lower tiers that outlive a process (disk, remote)")
    cache_commands = cache.add_subparsers(dest="cache_command", required=True, metavar="ACTION")
    for name, run, help_text in (("stats", _cache_stats, "print what the disk and remote tiers hold"),
                                 ("clear", _cache_clear, "drop every block from the disk and remote tiers")):
        action = cache_commands.add_parser(name, help=help_text)
        _add_config_arguments(action)
        action.add_argument("--tier", choices=PERSISTENT_TIERS, action="append",
                            help="only this tier (repeatable; default: every one the config has)")
        action.set_defaults(run=run)
    _add_documents_parser(cache_commands)
    return parser


def _add_documents_parser(cache_commands) -> None:
    """`kvstrata cache documents`: pinned documents of a running server, through its HTTP API (pins live
    in the server's tiers; `cache.preload` is the way to cache documents when an engine starts)."""
    documents = cache_commands.add_parser("documents", help="cache, list or unpin documents of a running server")
    actions = documents.add_subparsers(dest="documents_command", required=True, metavar="ACTION")
    add = actions.add_parser("add", help="compute and store a text file's blocks (pinned unless --no-pin)")
    add.add_argument("document_file", metavar="FILE")
    add.add_argument("--prompt", action="store_true",
                     help="send the text as a plain prompt (default: as `kvstrata ask` renders a document)")
    add.add_argument("--cache-salt", help="the tenant's cache_salt (questions must carry the same)")
    add.add_argument("--no-pin", dest="pin", action="store_false", help="cache without pinning")
    listing = actions.add_parser("list", help="the documents cached and where their blocks are")
    unpin = actions.add_parser("unpin", help="unpin and forget a document (its blocks become evictable)")
    unpin.add_argument("document_id", metavar="ID")
    for action, run in ((add, _documents_add), (listing, _documents_list), (unpin, _documents_unpin)):
        action.add_argument("--url", help="the server (default: http://server.host:server.port of --config)")
        action.add_argument("--api-key", help="the server's API key (default: server.api_key or $KVSTRATA_API_KEY)")
        _add_config_arguments(action)
        action.set_defaults(run=run)


def _add_config_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE",
                        help="YAML config (default: built-in defaults, the embedded model with a 1GiB device tier)")
    _add_override_argument(parser)


def _add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """vLLM's common flags (engine/config/engine_args.py), each naming the config key it sets. Values
    are strings here, parsed and checked with the config, so a bad one is one line, not argparse's usage."""
    from kvstrata.engine.config.engine_args import ENGINE_ARGS

    for arg in ENGINE_ARGS:
        if arg.kind is bool:
            parser.add_argument(arg.flag, dest=arg.name, action=argparse.BooleanOptionalAction, default=None,
                                help=f"{arg.help} ({arg.key})")
        else:
            parser.add_argument(arg.flag, dest=arg.name, metavar=arg.name.upper(), help=f"{arg.help} ({arg.key})")


def _add_override_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override one config key, e.g. --set cache.tiers.cpu.size=2GiB (repeatable)")


def check_http_url(url: str, option: str) -> None:
    """ValueError, one line naming `option`, unless `url` is a server's base URL (the config's rule, which never
    echoes a password)."""
    from kvstrata.engine.config.fields import http_url

    try:
        http_url(url)
    except ValueError as exc:
        raise ValueError(f"{option}: {exc}") from None


def _load(args: argparse.Namespace, disk_read_only: bool = False, **extra_overrides: Any):
    from kvstrata.engine.config import load_config, parse_overrides

    overrides = parse_overrides(args.overrides)
    overrides.update({key: value for key, value in extra_overrides.items() if value is not None})
    return load_config(getattr(args, "config", None) or getattr(args, "file", None), overrides,
                       disk_read_only=disk_read_only)


# ---------------------------------------------------------------------------------------------
# Commands


def _serve(args: argparse.Namespace) -> int:
    config = serve_config(args)
    from kvstrata.serving.server import serve

    serve(config)
    return EXIT_OK


def serve_config(args: argparse.Namespace):
    """`kvstrata serve`'s config: --config, then the environment, then --set, then vLLM's flags (MODEL
    among them): the more specific spelling wins, and a flag is as specific as it gets."""
    from kvstrata.engine.config import ConfigError
    from kvstrata.engine.config.engine_args import BY_NAME, blame_engine_arg, engine_arg_overrides, parse_arg_text

    if args.model_positional is not None and args.model is not None and args.model_positional != args.model:
        raise ValueError(f"MODEL {args.model_positional!r} and --model {args.model!r} disagree; give one")
    given = {name: getattr(args, name) for name in BY_NAME}
    given["model"] = args.model_positional or args.model
    given = {name: parse_arg_text(BY_NAME[name], value) if isinstance(value, str) else value
             for name, value in given.items()}
    try:
        return _load(args, **engine_arg_overrides(given, lambda arg: arg.flag))
    except ConfigError as exc:
        raise blame_engine_arg(exc, given, lambda arg: "MODEL" if arg.name == "model" else arg.flag) from None


def _route(args: argparse.Namespace) -> int:
    replicas = [dict(zip(("url", "events"), spec.split(",", 1))) for spec in args.replica] or None
    for replica in replicas or ():
        check_http_url(replica["url"], "--replica")  # before the config, whose message would show a password
    config = _load(args, **{"router.host": args.host, "router.port": args.port, "router.replicas": replicas})
    from kvstrata.serving.router import route

    route(config)
    return EXIT_OK


def _ask(args: argparse.Namespace) -> int:
    """Answers are printed by `qa.ask` itself (it streams them as they are generated)."""
    doc_path = Path(args.doc)
    if doc_path.is_dir():
        raise ValueError(f"--doc: {args.doc!r} is a directory, not a text file")
    if not doc_path.is_file():
        raise ValueError(f"--doc: no such file {args.doc!r}")
    questions = [*args.question, *args.questions]
    if not questions:
        raise ValueError("ask: give at least one question (as an argument or with --question)")
    if len(args.choice) == 1:
        raise ValueError("--choice: give at least two choices to rank")
    config = _load(args)
    from kvstrata.engine.qa import ask, score_choices

    if args.choice:
        score_choices(config, doc_path, questions, args.choice)
    else:
        ask(config, doc_path, questions, args.max_tokens)
    return EXIT_OK


def _bench_ttft(args: argparse.Namespace) -> int:
    """`benchmarks/ttft.py pressure`, with --config, --set and any further options."""
    return _run_benchmark("ttft", ["pressure"], args)


def _bench_concurrency(args: argparse.Namespace) -> int:
    """`benchmarks/ttft.py concurrency`, with --config, --set and any further options."""
    return _run_benchmark("ttft", ["concurrency"], args)


def _bench_scoring(args: argparse.Namespace) -> int:
    """`benchmarks/scoring.py`, with --config, --set and any further options."""
    return _run_benchmark("scoring", [], args)


def _run_benchmark(suite: str, subcommand: list[str], args: argparse.Namespace) -> int:
    _load(args)  # a bad config fails here, in one line, before the benchmark loads a model
    script = _find_benchmark(suite)
    script_args = ["--config", args.config] if args.config else []
    for override in args.overrides:
        script_args += ["--set", override]
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = [str(script), *subcommand, *script_args, *args.extra]
    sys.path.insert(0, str(script.parent.parent))  # so the script can import the `benchmarks` package
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as exc:  # a suite ends with sys.exit(its status)
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
    return EXIT_OK


def _find_benchmark(suite: str) -> Path:
    # The suites live in the source tree, beside the packages, not in an installed wheel: try the tree this
    # module was imported from, then the current directory.
    for root in (Path(__file__).resolve().parent.parent, Path.cwd()):
        script = root / "benchmarks" / f"{suite}.py"
        if script.is_file():
            return script
    raise ValueError(f"bench: the benchmarks live in the source tree, not in the installed package: run "
                     f"`kvstrata bench` in a clone of kvstrata (benchmarks/{suite}.py not found)")


def _config_check(args: argparse.Namespace) -> int:
    config = _load(args)
    sys.stdout.write(config.to_yaml())
    return EXIT_OK


def _cache_stats(args: argparse.Namespace) -> int:
    import yaml

    config = _load(args, disk_read_only=True)
    tiers = args.tier or PERSISTENT_TIERS
    report = {}
    if "disk" in tiers:
        disk = _disk_store(config, if_off="it keeps nothing between runs", if_missing="nothing has been written")
        if disk is not None:
            report["disk"] = _disk_stats(disk)
    if "remote" in tiers:
        remote = _remote_tier(config, say_if_off=bool(args.tier))
        if remote is not None:
            report["remote"] = _remote_stats(remote)
    if report:
        sys.stdout.write(yaml.safe_dump(report, sort_keys=False))
    if report.get("remote", {}).get("reachable") is False:
        # reported above with the rest; the exit status tells a script that the figures are missing
        _print_error(report["remote"]["error"])
        return EXIT_FAILURE
    return EXIT_OK


def _disk_stats(disk) -> dict:
    from kvstrata.tiers.lmdb_store import StoreDamaged, read_store_stats

    try:
        stats = read_store_stats(str(disk.path))
    except StoreDamaged as exc:
        raise ValueError(f"{exc}; `kvstrata cache clear` removes it") from None
    return {"path": str(disk.path), "configured_size": disk.size.to_yaml_value(), **_plain(stats)}


def _remote_stats(remote) -> dict:
    """The blocks under the tier's key prefix; an unreachable server is reported, not raised."""
    from kvstrata.tiers.remote import prefix_usage

    report = {"url": masked_url(remote.url), "cluster": remote.cluster, "key_prefix": remote.key_prefix}
    try:
        usage = prefix_usage(remote.url, cluster=remote.cluster, key_prefix=remote.key_prefix)
    except ValueError as exc:
        return {**report, "reachable": False, "error": str(exc)}
    return {**report, "reachable": True, "blocks": usage.blocks, "used_bytes": usage.bytes}


def _cache_clear(args: argparse.Namespace) -> int:
    config = _load(args)
    tiers = args.tier or PERSISTENT_TIERS
    if "disk" in tiers:
        _clear_disk(config)
    if "remote" in tiers:
        _clear_remote(config, say_if_off=bool(args.tier))
    return EXIT_OK


def _clear_disk(config) -> None:
    disk = _disk_store(config, if_off="nothing to clear", if_missing="nothing to clear")
    if disk is None:
        return
    from kvstrata.tiers.lmdb_store import clear_store

    cleared = clear_store(str(disk.path))
    if cleared.damage is not None:
        print(f"{cleared.damage}; removed its files")
    else:
        print(f"cleared {cleared.blocks} blocks from {disk.path}")


def _clear_remote(config, say_if_off: bool) -> None:
    """Only the keys under the tier's prefix go: every replica sharing the server loses them."""
    remote = _remote_tier(config, say_if_off)
    if remote is None:
        return
    from kvstrata.tiers.remote import clear_prefix

    removed = clear_prefix(remote.url, cluster=remote.cluster, key_prefix=remote.key_prefix)
    print(f"cleared {removed} blocks from {masked_url(remote.url)} (key prefix {remote.key_prefix})")


def _documents_add(args: argparse.Namespace) -> int:
    from kvstrata.engine.prompts import document_prefix_messages

    text = _read_text(args.document_file)
    body: dict[str, Any] = {"prompt": text} if args.prompt else {"messages": document_prefix_messages(text)}
    body.update(cache_salt=args.cache_salt, pin=args.pin)
    print(_describe_document(_server_call(args, "POST", "/v1/cache/documents", body)))
    return EXIT_OK


def _documents_list(args: argparse.Namespace) -> int:
    documents = _server_call(args, "GET", "/v1/cache/documents")["data"]
    for document in documents:
        print(_describe_document(document))
    if not documents:
        print("no documents")
    return EXIT_OK


def _documents_unpin(args: argparse.Namespace) -> int:
    if not args.document_id:
        raise ValueError("unpin: the document id is empty (ids are as `kvstrata cache documents list` prints them)")
    # one path segment, whatever it holds: an id with `?`, `#` or `/` must not reach another route
    _server_call(args, "DELETE", f"/v1/cache/documents/{quote(args.document_id, safe='')}")
    print(f"unpinned {args.document_id}")
    return EXIT_OK


def _read_text(path: str) -> str:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = getattr(exc, "strerror", None) or exc
        raise ValueError(f"FILE: cannot read {path!r} as UTF-8 text ({reason})") from None
    if not text.strip():
        raise ValueError(f"FILE: {path!r} is empty")
    return text


def _describe_document(d: dict) -> str:
    where = ", ".join(f"{tier} {n}" for tier, n in d["blocks_by_tier"].items())
    state = "pinned" if d["pinned"] else "not pinned"
    salted = ", salted" if d["salted"] else ""
    replica = f" on {d['replica']}" if d.get("replica") else ""  # listed through `kvstrata route`
    return (f"{d['id']}  {d['num_tokens']} tokens ({d['num_cached_tokens']} in full blocks), {state}{salted}; "
            f"blocks{replica}: {where}")


def _server_call(args: argparse.Namespace, method: str, path: str, body: dict | None = None) -> dict:
    """One call to the server's HTTP API. An error answer is a ValueError (its message), an unreachable
    server an OSError: one line each."""
    import json
    import urllib.error
    import urllib.request

    url, api_key = args.url, args.api_key
    if url is not None:
        check_http_url(url, "--url")
    if url is None or api_key is None:
        server = _load(args, disk_read_only=True).server
        host = "127.0.0.1" if server.host in ("0.0.0.0", "::") else server.host
        url = url or f"http://{host}:{server.port}"
        api_key = api_key or server.api_key  # $KVSTRATA_API_KEY reaches it through the config
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    data = None if body is None else json.dumps(body).encode("utf-8")
    request = urllib.request.Request(url.rstrip("/") + path, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=3600) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        try:
            message = json.loads(exc.read())["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = f"HTTP {exc.code} {exc.reason}"
        raise ValueError(message) from None
    except urllib.error.URLError as exc:
        raise OSError(f"cannot reach the server at {masked_url(url)}: {exc.reason}") from None


def _remote_tier(config, say_if_off: bool):
    """The config's remote tier, or None when it is off (saying so if the user asked for it by name)."""
    remote = config.cache.tiers.remote
    if remote is None and say_if_off:
        print("remote tier: off in this config")
    return remote


def _disk_store(config, if_off: str, if_missing: str):
    """The config's disk tier if its store exists; otherwise says why not and returns None."""
    from kvstrata.tiers.lmdb_store import store_exists

    disk = config.cache.tiers.disk
    if disk is None:
        print(f"disk tier: off in this config ({if_off})")
        return None
    if not store_exists(disk.path):
        print(f"disk tier: no store at {disk.path} yet ({if_missing})")
        return None
    return disk


# ---------------------------------------------------------------------------------------------
# Output helpers


def _plain(value: Any) -> Any:
    """Stats objects (dataclasses, dicts, paths) as YAML-safe plain data."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    if isinstance(value, dict):
        return {str(key): _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def configure_logging(level: str) -> None:
    """Timestamped lines with their level and logger on stderr, for kvstrata's loggers (the engine's,
    the server's, the router's); without it, Python prints warnings bare and drops INFO lines."""
    name = level.strip().lower()
    if name not in LOG_LEVELS:
        raise ValueError(f"--log-level: unknown level {level!r} (expected {', '.join(LOG_LEVELS)})")
    logger = logging.getLogger("kvstrata")
    if not any(isinstance(h, _StderrHandler) for h in logger.handlers):
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter(LOG_FORMAT))
        logger.addHandler(handler)
    logger.setLevel(name.upper())


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever `sys.stderr` is when a record comes (a caller may have replaced it since)."""

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stderr
        super().emit(record)


def _print_error(exc: BaseException) -> None:
    message = " ".join(str(exc).split()) or type(exc).__name__
    print(f"kvstrata: error: {message}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
