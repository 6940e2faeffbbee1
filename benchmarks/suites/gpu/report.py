"""The GPU report: what the tiers cost and buy on one GPU, in one command anyone with a GPU can run, with
every GPU goal of docs/design.md (and of the GPU hit-path issue) met or not.

    make gpu-report                                     # = python benchmarks/gpu.py report
    python benchmarks/gpu.py report --sections bandwidth,ttft --models smollm2
    python benchmarks/gpu.py report --smoke --out /tmp/gpu-smoke.md   # every section on the CPU, tiny shapes
    python benchmarks/gpu.py report --sections ttft --models llama-3-8b --merge benchmarks/results/gpu.json

A report too long for one sitting is made in several: `--merge` an earlier run's gpu.json (same GPU), and
the sections, models and dtypes this run does not measure are kept from it. `--time-limit SECONDS` starts no
part (a section, or a model in a dtype) after that long; the report is written after every part, so a run
stopped midway keeps what it measured.

Sections, in the order they run (all by default, `--sections` picks some):

- tests: `pytest -m cuda` in a child process (the compiled kernels, the transfer engine's CUDA path, an
  engine on the GPU), counted from its JUnit XML.
- bandwidth: pinned host-to-device and device-to-host copies of 1 GiB, the limit; then promotion from a
  pinned CPU tier and from a warm disk tier through the engine's transfer path (benchmarks/suites/tiers/promotion.py's
  `measure`: the CPU tier's pinned rows lent and copied straight to the device, the disk tier read into
  pinned staging, on a side stream) as a share of the host-to-device figure, for SmolLM2's block and a
  Llama-3-8B-shaped one (32 layers, 8 KV heads, head_dim 128), random bytes.
- kernels: the Triton prefix-prefill against SDPA on the same problem laid out contiguously, and split-KV
  against the same kernel in one pass (benchmarks/kernels.py paging's tables).
- step: a model step with few tokens (a decode, a 16-token question, 32 decodes) and a 512-token chunk over a
  7k-token context, through kvstrata's decoder and through transformers' modules on the same paged cache
  (benchmarks/suites/kernels/decoder_step.py), per model in bf16: what the host's share of a step costs each; and the decodes
  and the question replayed as CUDA graphs.
- ttft: single-request TTFT of long-document QA, a document of ~4k and ~7k tokens (`--doc-tokens`) plus a
  question from benchmarks/data, for SmolLM2 and a Llama-3-8B-shaped model with random weights
  (`load_format: dummy`), in bf16, fp32 and bf16 with fp8 or int8 K/V (`--dtypes`): a miss, a device hit, a CPU-tier
  hit (the device's cached blocks dropped) and a disk hit after a restart (a fresh engine, device and CPU tiers empty, on the disk
  store the first engine closed; the same process, so the page cache is warm), each hit on a question the
  document has not been asked yet, and a cold 64-token prompt. Median of `--repeats` passes after one
  warm-up pass; each pass has its own `cache_salt`, so nothing carries over, and background write-downs
  finish before each request (one request alone on the GPU).
- gap: a greedy decode stream's inter-token gaps while a CPU-tier hit on the longest document is admitted
  (loaded asynchronously, then its question prefilled beside the stream): the median gap and the longest
  gap from the hit's arrival to its first token, per model in bf16; the second of two runs.

The figures go to benchmarks/results/gpu.md (and gpu.json beside it). Without CUDA the script refuses to
write any (exit 2); `--smoke` runs every section on the CPU with tiny shapes (a 2-layer random model for
both models, short documents, small copies, the kernels under Triton's interpreter) into the file given
with `--out`, so that CI exercises the code. No smoke figure is a GPU figure.
"""
from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[3]

import torch  # noqa: E402

from benchmarks.suites.host.engine import add_during_next_step  # noqa: E402
from benchmarks.lib import options  # noqa: E402
from benchmarks.lib.child_runs import junit_counts, run_until  # noqa: E402
from benchmarks.lib import results  # noqa: E402

SECTIONS = ("tests", "bandwidth", "kernels", "step", "ttft", "gap")
DEFAULT_OUT = REPO_ROOT / "benchmarks" / "results" / "gpu.md"
GPU_CONFIG = REPO_ROOT / "configs" / "gpu.yaml"
DOCUMENT = "pydoc_data.topics:types"  # 8.9k tokens, cut to each prompt length
KINDS = ("miss", "device", "cpu", "disk")  # how a pass serves its four questions, in order
SHORT_PROMPT_TOKENS = 64
GAP_DTYPE = "bfloat16"
WHOLE_SECTIONS = ("tests", "bandwidth", "kernels", "step")  # measured at once (the others per model and dtype)
STATUS_WORDS = {"PASS": "met", "MISS": "not met", "N/A": "not measured"}


@dataclass(frozen=True)
class ModelCase:
    key: str          # what the goals call it
    label: str
    name: str         # model.name
    load_format: str  # model.load_format


MODELS = {"smollm2": ModelCase("smollm2", "SmolLM2-135M", "smollm2-135m-instruct", "auto"),
          "llama-3-8b": ModelCase("llama-3-8b", "Llama-3-8B shape, random weights", "llama-3-8b", "dummy")}


@dataclass(frozen=True)
class Plan:
    """What one run measures: the report's shapes on CUDA, tiny ones on the CPU (`--smoke`)."""

    smoke: bool
    device: str
    sections: tuple[str, ...]
    models: tuple[ModelCase, ...]
    dtypes: tuple[str, ...]
    doc_tokens: tuple[int, ...]
    repeats: int
    reference_bytes: int     # of the pinned copies the promotions are measured against
    promotion_tokens: int
    stream_tokens: int       # the decode stream's length in the gap section
    stream_lead: int         # its tokens before the hit arrives
    test_paths: tuple[str, ...]  # where `pytest -m cuda` looks
    tests_timeout_s: float       # the tests section's limit (the compiled-kernel check stops ahead of it)
    block_size: int = 16         # tokens per KV block in the engines' configs (cache.block_size)


def make_plan(args) -> Plan:
    models = tuple(MODELS[key] for key in args.models)
    if args.smoke:  # a 2-layer random model stands in for both: every code path, none of the cost
        models = tuple(ModelCase(m.key, f"tiny-llama standing in for {m.label}", "tiny-llama", "dummy")
                       for m in models)
        # ... and one test file stands in for the suite: without CUDA every cuda test is skipped anyway
        return Plan(True, "cpu", tuple(args.sections), models, tuple(args.dtypes), (64,), 1,
                    16 << 20, 64, 8, 2, ("tests/test_transfer.py",), args.tests_timeout, args.block_size)
    return Plan(False, "cuda", tuple(args.sections), models, tuple(args.dtypes), tuple(args.doc_tokens),
                args.repeats, 1 << 30, 8192, 64, 16, ("tests",), args.tests_timeout, args.block_size)


STARTED = time.perf_counter()


def log(message: str) -> None:
    print(f"[{time.perf_counter() - STARTED:7.1f} s] {message}", flush=True)


# ---------------------------------------------------------------------------------------------- device

def package_version(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def driver_version() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout.split()
    except (OSError, subprocess.SubprocessError):
        out = []
    return out[0] if out else "unknown (no nvidia-smi)"


def describe_device(plan: Plan) -> dict:
    from benchmarks.lib.machine import machine_line

    info = {"host": machine_line(), "torch": torch.__version__, "triton": package_version("triton"),
            "transformers": package_version("transformers"), "python": platform.python_version()}
    if plan.device == "cuda":
        props = torch.cuda.get_device_properties(0)
        info.update(name=props.name, capability=f"{props.major}.{props.minor}", sms=props.multi_processor_count,
                    memory_gib=props.total_memory / (1 << 30), driver=driver_version(), cuda=torch.version.cuda)
    else:
        info.update(name="CPU (smoke run: tiny shapes, Triton interpreted; no figure here is a GPU figure)")
    return info


# ---------------------------------------------------------------------------------------------- tests

def run_cuda_tests(plan: Plan) -> dict:
    """`pytest -m cuda` in a child process; its JUnit XML says what passed. A test module that cannot be
    imported (a serving dependency missing on a GPU machine) is one error, and the CUDA tests elsewhere
    still run. Where pytest stops before any test, its last words (often on stderr) say why, and the
    section fails."""
    with tempfile.TemporaryDirectory(prefix="kvstrata-gpu-tests-") as tmp:
        junit = Path(tmp) / "cuda.xml"
        command = [sys.executable, "-m", "pytest", "-m", "cuda", "-v", "-p", "no:cacheprovider",
                   "--continue-on-collection-errors", f"--junitxml={junit}", *plan.test_paths]
        started = time.perf_counter()
        # no plugins from other packages: the CUDA tests need none, and one that fails to import (its own
        # dependency missing on a GPU machine set up by hand) stops pytest before any test runs. The compiled-
        # kernel check (tests/test_kernels_cuda.py) runs every case in one child before its tests report: it is
        # told when to stop, so that a section cut short still says which cases passed.
        env = {**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
               CUDA_CHECK_DEADLINE_ENV: str(time.time() + max(plan.tests_timeout_s - TESTS_AFTER_CHECK_S, 1.0))}
        run = run_until(command, env, time.time() + plan.tests_timeout_s, on_line=show_outcome, cwd=REPO_ROOT)
        returncode, lines = run.returncode, [line for line in run.lines if line.strip()]
        result = junit_counts(junit) if junit.exists() else {"passed": 0, "failed": 0, "errors": 0, "skipped": 0,
                                                             "not_passed": [], "why": {}}
    last_line = (lines or [""])[-1]
    if not any(result[key] for key in ("passed", "failed", "errors", "skipped")):
        raise RuntimeError(f"pytest ran no test (exit status {returncode}): {last_line}")
    result.update(seconds=time.perf_counter() - started, returncode=returncode, last_line=last_line)
    return result


CUDA_CHECK_DEADLINE_ENV = "KVSTRATA_CUDA_CHECK_DEADLINE"  # read by tests/test_kernels_cuda.py
TESTS_AFTER_CHECK_S = 60.0  # of the tests section, left to the CUDA tests after the compiled-kernel check
TEST_OUTCOMES = (" PASSED", " FAILED", " ERROR", " SKIPPED", " XFAIL", " XPASS")


def show_outcome(line: str) -> None:
    """Log a pytest line that gives a test's outcome."""
    if any(outcome in line for outcome in TEST_OUTCOMES) and "::" in line:
        log(f"tests: {line.strip()}")


# ---------------------------------------------------------------------------------------------- bandwidth

def promotion_layouts() -> dict:
    from kvstrata.tiers.base import BlockLayout

    from benchmarks.suites.tiers.promotion import LAYOUT

    return {"SmolLM2-135M": LAYOUT,
            "Llama-3-8B": BlockLayout(num_layers=32, block_size=16, num_kv_heads=8, head_dim=128,
                                      dtype=torch.bfloat16)}


def more_readers(plan: Plan) -> tuple[int, ...]:
    """Disk reader counts to measure beside the engine's (one per fill thread, one per core up to 16): a quarter and
    half of it, and twice it where the host has the cores, each with its own staging (as many fill threads), so that
    a run shows whether the default suits the host (one in a smoke run)."""
    from kvstrata.tiers.transfer import default_fill_threads
    if plan.smoke:
        return (1,)
    engine_count = default_fill_threads(on_gpu=True)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    counts = (engine_count // 4, engine_count // 2, 2 * engine_count)
    return tuple(n for n in counts if 1 <= n <= cores and n != engine_count)


def measure_bandwidth(plan: Plan) -> dict:
    """The pinned copy limit both ways, then promotion per block layout through the transfer engine."""
    from benchmarks.lib.machine import reference_bandwidth
    from benchmarks.suites.tiers.promotion import measure

    device = torch.device(plan.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    limits = {}
    for direction in ("h2d", "d2h"):
        gbps, what = reference_bandwidth(device, 5, sync, direction, plan.reference_bytes)
        limits[direction] = {"gbps": gbps / 1e9, "what": what}
        log(f"bandwidth: {what}: {gbps / 1e9:.2f} GB/s")
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvstrata-gpu-stores-") as store_dir:
        for name, layout in promotion_layouts().items():
            row = measure(plan.promotion_tokens, device, store_dir, 5, sync, layout, more_readers(plan))
            rows.append({"block": name, "block_nbytes": layout.block_nbytes, **row})
            log(f"bandwidth: {name} blocks: CPU tier {row['cpu_gbps']:.2f} GB/s, warm disk {row['disk_gbps']:.2f} GB/s")
    return {"limits": limits, "rows": rows}


# ---------------------------------------------------------------------------------------------- kernels

def measure_kernels(plan: Plan) -> dict:
    """benchmarks/kernels.py paging's tables: on CUDA its own cases; in a smoke run one tiny case of each, interpreted."""
    from benchmarks.suites.kernels import paging as kernels

    device = torch.device(plan.device)
    if plan.smoke:
        paging_cases, dtypes = [kernels.Case(kernels.SMOLLM2, 1, 32, 16)], [torch.float32]
        split_cases, split_dtypes, timer, repeats = [kernels.Case(kernels.SMOLLM2, 1, 64, 1)], dtypes, kernels.time_cpu, 1
    else:
        paging_cases, dtypes = kernels.CUDA_CASES, kernels.CUDA_DTYPES
        split_cases, split_dtypes, timer, repeats = kernels.QUESTION_CASES, [torch.bfloat16], kernels.time_cuda, 5
    log("kernels: prefix-prefill against SDPA")
    paging = kernels.paging_table(paging_cases, dtypes, kernels.prefix_prefill, timer, repeats, device)
    log("kernels: split-KV against one pass")
    split = kernels.split_kv_table(split_cases, split_dtypes, timer, repeats, device)
    return {"paging": paging, "split_kv": split}


# ---------------------------------------------------------------------------------------------- step

def measure_steps(plan: Plan) -> list[dict]:
    """benchmarks/suites/kernels/decoder_step.py's cases per model in bf16: over a 7k-token context on CUDA, a short one in a
    smoke run."""
    from kvstrata.engine.model_loader import load_model, resolve_model

    from benchmarks.suites.kernels import decoder_step

    rows = []
    for model in plan.models:
        loaded = load_model(resolve_model(model.name, model.load_format), getattr(torch, GAP_DTYPE), plan.device)
        try:
            for row in decoder_step.measure_model(loaded, 32 if plan.smoke else 7000, 1 if plan.smoke else 5):
                rows.append({"model": model.key, "label": model.label, "dtype": GAP_DTYPE, **row})
                log(f"step {model.label} {row['case']}: transformers {fmt_ms(row['transformers_s'])}, "
                    f"decoder {fmt_ms(row['decoder_s'])}")
        finally:
            del loaded
            release_memory(plan)
    return rows


def release_memory(plan: Plan) -> None:
    """Free what a model (or an engine on it) held once its last reference is dropped: their parts refer to
    each other, so only a collection frees them, and then the GPU's cached blocks go back."""
    gc.collect()
    if plan.device == "cuda":
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------- engines

def engine_config(plan: Plan, model: ModelCase, dtype: str, prompt_tokens: int, disk_path: Path,
                  load_policy: str = "auto"):
    """configs/gpu.yaml with the model, and tiers sized for one document and a decode stream: the device
    holds them three times over (so that nothing a hit needs is evicted to make room), the CPU and disk
    tiers twice."""
    from kvstrata import load_config

    from benchmarks.lib.ttft_workload import blocks_for

    blocks = blocks_for(prompt_tokens + plan.stream_tokens, plan.block_size)
    model_dtype, _, kv_cache_dtype = dtype.partition("/")  # "bfloat16/fp8": fp8 K/V beside bf16 weights
    overrides = {
        "model.name": model.name, "model.load_format": model.load_format, "model.dtype": model_dtype,
        "cache.kv_cache_dtype": kv_cache_dtype or "auto",
        "model.device": plan.device, "cache.block_size": plan.block_size, "cache.offload": "write_through",
        "cache.tiers.device.size": 3 * blocks, "cache.tiers.cpu.size": 2 * blocks,
        "cache.tiers.disk.path": str(disk_path), "cache.tiers.disk.size": 2 * blocks,
        "cache.load_policy": load_policy}
    if plan.device == "cpu":  # a smoke run: graphs need CUDA (the config's choice stands on a GPU)
        overrides["model.cuda_graphs"] = False
    return load_config(GPU_CONFIG, overrides)


def settle(engine) -> None:
    """Let background write-downs and queued GPU work finish: the next request runs alone."""
    engine.hierarchy.wait_for_write_downs()
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)


def drop_device_cache(engine) -> None:
    """Leave the cached blocks in the lower tiers only, so that the next hit is served from below."""
    settle(engine)
    if not engine.hierarchy.clear_device_cache():
        raise RuntimeError("the device cache could not be cleared: a block is still in use")


def document_prompts(tokenizer, doc_tokens: int, count: int) -> list[list[int]]:
    """`count` chat prompts on DOCUMENT cut to `doc_tokens` tokens, each with a question not asked before
    (the development set's questions, then the same rephrased)."""
    from benchmarks.lib.harness import render_chat
    from benchmarks.lib.ttft_workload import DEFAULT_DATA
    from benchmarks.lib.ttft_workload import cut_document, load_document, load_questions, qa_content, rephrased

    questions = load_questions(DEFAULT_DATA)[DOCUMENT]
    document = cut_document(load_document(DOCUMENT), doc_tokens,
                            lambda text: tokenizer(text, add_special_tokens=False)["input_ids"], tokenizer.decode)
    return [render_chat(tokenizer, qa_content(document, rephrased(questions[i % len(questions)],
                                                                   i // len(questions))))
            for i in range(count)]


def with_engine(config, loaded, work):
    """`work(engine)` on a fresh engine on the loaded model; then the engine is closed (everything cached
    goes down to the disk tier) and freed, so that passes do not pile up device and pinned memory."""
    from kvstrata.engine.llm_engine import LLMEngine

    engine = LLMEngine(config, loaded=loaded)
    try:
        return work(engine)
    finally:
        engine.close()
        del engine
        gc.collect()  # the engine's parts refer to each other: only a collection frees its KV cache


def ttft_pass(plan: Plan, model: ModelCase, dtype: str, loaded, prompts: list[list[int]], disk_path: Path,
              salt: str) -> dict:
    """One pass: a cold short prompt, then the document asked four times: a miss, a device hit, a CPU-tier
    hit, and a disk hit in a fresh engine on the store the first one closed. Each kind's `ask` record."""
    from benchmarks.lib.harness import ask

    def miss_device_cpu(engine) -> dict:
        records = {"short": ask(engine, prompts[0][:SHORT_PROMPT_TOKENS], cache_salt=f"{salt}-short")}
        settle(engine)
        records["miss"] = ask(engine, prompts[0], cache_salt=salt)
        settle(engine)
        records["device"] = ask(engine, prompts[1], cache_salt=salt)
        drop_device_cache(engine)
        records["cpu"] = ask(engine, prompts[2], cache_salt=salt)
        return records

    config = engine_config(plan, model, dtype, max(map(len, prompts)), disk_path)
    records = with_engine(config, loaded, miss_device_cpu)
    # the restart: empty device and CPU tiers, the disk tier reopened
    records["disk"] = with_engine(config, loaded, lambda engine: ask(engine, prompts[3], cache_salt=salt))
    shutil.rmtree(disk_path, ignore_errors=True)
    return records


def found_tier(record: dict) -> str:
    """The tier that held most of a request's prefix at lookup, whether the load policy (`auto` in
    configs/gpu.yaml) loaded those blocks or recomputed some of them while the rest loaded: a CPU-tier hit
    that recomputes its first blocks beside the load is still a CPU-tier hit, timed as users get it."""
    from benchmarks.lib.ttft_stats import hit_tier

    found = {t: n + record["recomputed_tokens_by_tier"].get(t, 0) for t, n in record["cached_tokens_by_tier"].items()}
    return hit_tier(found, record["prompt_tokens"])


def measure_ttft_row(plan: Plan, model: ModelCase, dtype: str, loaded, doc_tokens: int, work_dir: Path) -> dict:
    prompts = document_prompts(loaded.tokenizer, doc_tokens, len(KINDS))
    passes = []
    for index in range(-1, plan.repeats):  # pass -1 warms up (kernel compilation, allocator) and is dropped
        records = ttft_pass(plan, model, dtype, loaded, prompts, work_dir / f"disk-{index + 1}",
                            salt=f"gpu-report-{index + 1}-{time.time_ns()}")
        if index >= 0:
            passes.append(records)
    median_s = {kind: statistics.median(p[kind]["ttft_s"] for p in passes) for kind in ("short", *KINDS)}
    unexpected = [f"pass {i}: the {kind} request was served as {found_tier(p[kind])} "
                  f"({p[kind]['cached_tokens_by_tier']})"
                  for i, p in enumerate(passes) for kind in KINDS if found_tier(p[kind]) != kind]
    recomputed = [f"pass {i}: the {kind} request recomputed {n} of the tokens it found "
                  f"({p[kind]['recomputed_tokens_by_tier']})"
                  for i, p in enumerate(passes) for kind in KINDS
                  if (n := sum(p[kind]["recomputed_tokens_by_tier"].values()))]
    return {"model": model.key, "label": model.label, "dtype": dtype, "doc_tokens": doc_tokens,
            "prompt_tokens": len(prompts[0]), "median_s": median_s, "unexpected": unexpected,
            "recomputed": recomputed, "phases_ms": {kind: median_phases([p[kind] for p in passes]) for kind in ("short", *KINDS)},
            "ttft_s": {kind: [p[kind]["ttft_s"] for p in passes] for kind in ("short", *KINDS)}}


def median_phases(records: list[dict]) -> dict[str, float]:
    """Where a request's TTFT went (its cache receipt, engine/receipt.py), median over passes, in ms: queue,
    lookup, load (all tiers) and prefill."""
    def phases(receipt: dict) -> dict[str, float]:
        return {"queue": receipt["queue_ms"], "lookup": receipt["lookup_ms"],
                "load": sum(receipt["load_ms_by_tier"].values()), "prefill": receipt["prefill_ms"]}

    per_pass = [phases(r["receipt"]) for r in records]
    return {phase: statistics.median(p[phase] for p in per_pass) for phase in per_pass[0]}


def gap_run(plan: Plan, model: ModelCase, dtype: str, loaded, prompts: list[list[int]], disk_path: Path,
            salt: str) -> dict:
    """A decode stream runs; after `stream_lead` tokens a question on a document the CPU tier holds arrives."""
    from kvstrata.engine.sampling import SamplingParams

    from benchmarks.lib.harness import ask

    def stream_with_a_hit(engine):
        ask(engine, prompts[0], cache_salt=salt)  # the document, computed once and written through
        drop_device_cache(engine)
        stream = engine.add_request("stream", prompts[1][:SHORT_PROMPT_TOKENS],
                                    SamplingParams(max_tokens=plan.stream_tokens, temperature=0.0, ignore_eos=True),
                                    cache_salt=f"{salt}-stream")
        token_times, arrived = [], []

        def arrive() -> None:  # while a step computes, as the server adds a request arriving then
            arrived.append(engine.add_request("hit", prompts[1], SamplingParams(max_tokens=1, temperature=0.0),
                                              cache_salt=salt, arrival_time=time.perf_counter()))
        while engine.has_unfinished_requests():
            got = engine.step()
            if stream in got:
                token_times.append(time.perf_counter())
            if len(token_times) == plan.stream_lead and stream in got:
                add_during_next_step(engine, arrive)
        return token_times, arrived[0], arrived[0].arrival_time

    # always_load: the section is about a promotion beside the stream, which `auto` may skip where
    # recomputing the document is faster (a tiny model on a CPU)
    config = engine_config(plan, model, dtype, max(map(len, prompts)), disk_path, load_policy="always_load")
    token_times, hit, hit_arrival = with_engine(config, loaded, stream_with_a_hit)
    shutil.rmtree(disk_path, ignore_errors=True)
    gaps = [(start, end) for start, end in zip(token_times, token_times[1:])]
    hit_first = hit.first_token_time if hit.first_token_time is not None else float("inf")
    # the gaps that overlap the hit's stay: from its arrival to its first token (the step that prefilled it)
    during = [end - start for start, end in gaps if end > hit_arrival and start < hit_first]
    median_gap = statistics.median(end - start for start, end in gaps)
    return {"model": model.key, "label": model.label, "dtype": dtype, "prompt_tokens": len(prompts[1]),
            "stream_tokens": len(token_times), "median_gap_s": median_gap,
            "max_gap_during_s": max(during) if during else None, "gaps_during": len(during),
            "max_gap_s": max(end - start for start, end in gaps), "hit_ttft_s": hit.ttft_s,
            "hit_cached_tokens_by_tier": dict(hit.cached_tokens_by_tier or {})}


def measure_model(plan: Plan, model: ModelCase, dtype: str, work_dir: Path, result: dict) -> None:
    """The TTFT rows and the gap run of one model in one dtype (loaded once), appended to `result` as they
    are measured, so that a later failure loses none of them."""
    from benchmarks.lib.harness import load

    run_gap = "gap" in plan.sections and (dtype == GAP_DTYPE or GAP_DTYPE not in plan.dtypes)
    if "ttft" not in plan.sections and not run_gap:
        return
    loaded, load_s = load(engine_config(plan, model, dtype, max(plan.doc_tokens), work_dir / "probe"))
    log(f"{model.label} {dtype}: loaded in {load_s:.1f} s")
    try:
        if "ttft" in plan.sections:
            for doc_tokens in plan.doc_tokens:
                row = measure_ttft_row(plan, model, dtype, loaded, doc_tokens, work_dir)
                result["ttft"].append(row)
                log(f"ttft {model.label} {dtype} {row['prompt_tokens']} tok: " + ", ".join(
                    f"{kind} {fmt_ms(row['median_s'][kind])}" for kind in ("short", *KINDS)))
        if run_gap:
            prompts = document_prompts(loaded.tokenizer, max(plan.doc_tokens), 2)
            gap_run(plan, model, dtype, loaded, prompts, work_dir / "gap-warmup", f"gap-warmup-{time.time_ns()}")
            gap = gap_run(plan, model, dtype, loaded, prompts, work_dir / "gap", f"gap-{time.time_ns()}")
            result["gap"].append(gap)
            log(f"gap {model.label} {dtype}: median {fmt_ms(gap['median_gap_s'])}, longest while the hit was "
                f"admitted {fmt_ms(gap['max_gap_during_s'])}")
    finally:
        del loaded
        release_memory(plan)


# ---------------------------------------------------------------------------------------------- goals

def row_of(result: dict, model: str, dtype: str = "bfloat16") -> dict | None:
    """The TTFT row of `model` in `dtype` on the longest document."""
    rows = [r for r in result.get("ttft") or [] if r["model"] == model and r["dtype"] == dtype]
    return max(rows, key=lambda r: r["doc_tokens"]) if rows else None


def goals(result: dict) -> list:
    """docs/design.md's GPU figures and the GPU hit-path issue's, each as a measured ratio against its target."""
    from benchmarks.lib.ttft_stats import Goal, ratio

    out = []
    bandwidth = result.get("bandwidth") or {}
    h2d = (bandwidth.get("limits") or {}).get("h2d", {}).get("gbps")
    for row in bandwidth.get("rows") or [{"block": "Llama-3-8B"}]:
        out += [Goal(f"promotion CPU tier -> device, {row['block']} block", ratio(row.get("cpu_gbps"), h2d), 0.80,
                     ">=", "CPU-tier promotion GB/s", "pinned host-to-device GB/s"),
                Goal(f"promotion warm disk -> device, {row['block']} block", ratio(row.get("disk_gbps"), h2d), 0.50,
                     ">=", "warm-disk promotion GB/s", "pinned host-to-device GB/s")]
    smol, llama = row_of(result, "smollm2"), row_of(result, "llama-3-8b")
    m, where = (smol["median_s"], f"SmolLM2 bf16, {smol['prompt_tokens']} tokens") if smol else ({}, "SmolLM2 bf16, ~7k tokens")
    out += [Goal(f"{where}: device hit vs a cold 64-token prompt", ratio(m.get("device"), m.get("short")), 1.5, "<=",
                 "device-hit TTFT", "cold 64-token TTFT"),
            Goal(f"{where}: CPU-tier hit vs device hit", ratio(m.get("cpu"), m.get("device")), 1.3, "<=",
                 "CPU-hit TTFT", "device-hit TTFT"),
            Goal(f"{where}: warm disk hit vs device hit", ratio(m.get("disk"), m.get("device")), 2.0, "<=",
                 "disk-hit TTFT", "device-hit TTFT"),
            Goal(f"{where}: miss vs CPU-tier hit", ratio(m.get("miss"), m.get("cpu")), 5.0, ">=",
                 "miss TTFT", "CPU-hit TTFT")]
    m, where = ((llama["median_s"], f"Llama-3-8B shape bf16, {llama['prompt_tokens']} tokens") if llama
                else ({}, "Llama-3-8B shape bf16, ~7k tokens"))
    out.append(Goal(f"{where}: miss vs CPU-tier hit", ratio(m.get("miss"), m.get("cpu")), 10.0, ">=",
                    "miss TTFT", "CPU-hit TTFT"))
    slowest = [r["median_s"][kind] / r["median_s"]["miss"] for r in result.get("ttft") or [] for kind in KINDS[1:]]
    out.append(Goal("never slower than recomputing: the slowest hit vs the miss, worst row",
                    max(slowest) if slowest else None, 1.0, "<=", "hit TTFT", "miss TTFT"))
    for gap in result.get("gap") or [{"label": "any model"}]:
        out.append(Goal(f"{gap['label']} {gap.get('dtype', 'bfloat16')}: decode gap while a CPU-tier hit is admitted",
                        ratio(gap.get("max_gap_during_s"), gap.get("median_gap_s")), 1.5, "<=",
                        "longest inter-token gap during admission", "median gap"))
    return out


# ---------------------------------------------------------------------------------------------- report

def fmt_ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1e3:.1f} ms"


def fmt_x(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}x"


def markdown(result: dict) -> str:
    plan, info = result["plan"], result["device"]
    lines = ["# kvstrata on a GPU", ""]
    if plan["smoke"]:
        lines += ["**Smoke run on the CPU with tiny shapes: it checks that the report runs; no figure below is a "
                  "GPU figure.**", ""]
    lines += [f"Command: `{result['command']}` ({result['duration_s']:.0f} s, {result['started_at']}); "
              f"commit {result['source']['commit']}"
              + (f", engine sources modified: {', '.join(result['source']['engine_sources_modified'])}"
                 if result["source"]["engine_sources_modified"] else "") + ".", ""]
    for run in result.get("merged_runs") or []:
        lines += [f"Merged with the figures of `{run['command']}` ({run['duration_s']:.0f} s, {run['started_at']}); "
                  f"commit {run['commit']}.", ""]
    lines += ["## Device", "", "| | |", "|---|---|", f"| device | {info['name']} |"]
    if "sms" in info:
        lines += [f"| compute capability, SMs, memory | {info['capability']}, {info['sms']} SMs, "
                  f"{info['memory_gib']:.1f} GiB |", f"| driver / CUDA (torch's) | {info['driver']} / {info['cuda']} |"]
    lines += [f"| torch / triton / transformers | {info['torch']} / {info['triton']} / {info['transformers']} |",
              f"| host | {info['host']} |", ""]
    lines += goals_section(result)
    lines += section(result, "tests", "CUDA tests (`pytest -m cuda`)", tests_lines)
    lines += section(result, "bandwidth", "Copy bandwidth and promotion", bandwidth_lines)
    lines += section(result, "kernels", "Prefix-prefill kernel", kernels_lines)
    lines += section(result, "step", "A model step: kvstrata's decoder against transformers' modules", step_lines)
    lines += section(result, "ttft", "Single-request TTFT (long-document QA)", ttft_lines)
    lines += section(result, "gap", "A decode stream while a CPU-tier hit is admitted", gap_lines)
    for_time = result.get("not_run_for_time") or []
    skipped = [s for s in SECTIONS if s not in plan["sections"] and {"section": s} not in for_time]
    if skipped:
        lines += [f"Not run (`--sections`): {', '.join(skipped)}.", ""]
    if for_time:
        lines += ["Not run, the time limit (`--time-limit`) reached: " + ", ".join(
            r.get("section") or f"{r['model']} {r['dtype']}" for r in for_time) + ".", ""]
    return "\n".join(lines)


def goals_section(result: dict) -> list[str]:
    lines = ["## Goals", "", "| goal | measured | target | |", "|---|---:|---:|---|"]
    for goal in result["goals"]:
        value = "n/a" if goal["value"] is None else f"{goal['value']:.2f}"
        lines.append(f"| {goal['name']} ({goal['numerator']} / {goal['denominator']}) | {value} | "
                     f"{goal['direction']} {goal['target']:.2f} | {STATUS_WORDS[goal['status']]} |")
    return lines + [""]


def section(result: dict, name: str, heading: str, body) -> list[str]:
    """A section that ran: its heading, its failure if it had one, then `body(its data, result)` if it
    measured anything. Nothing for a section that did not run."""
    if name not in result["plan"]["sections"]:
        return []
    lines = [f"## {heading}", ""]
    if result.get("errors", {}).get(name):
        lines += [f"Failed: `{result['errors'][name]}` (the traceback went to stderr).", ""]
    data = result.get(name)
    return lines + (body(data, result) if data else [])


def tests_lines(t: dict, result: dict) -> list[str]:
    return [f"{t['passed']} passed, {t['failed']} failed, {t['errors']} errors, {t['skipped']} skipped in "
            f"{t['seconds']:.0f} s (pytest exit status {t['returncode']}: {t['last_line']}).",
            *(f"- did not pass: `{name}`" + (f": {t['why'][name]}" if t.get("why", {}).get(name) else "")
              for name in t["not_passed"]), ""]


def bandwidth_lines(b: dict, result: dict) -> list[str]:
    h2d, d2h = b["limits"]["h2d"], b["limits"]["d2h"]
    lines = [f"Limit, measured in this run (best of 5): {h2d['what']} **{h2d['gbps']:.2f} GB/s**; "
             f"{d2h['what']} **{d2h['gbps']:.2f} GB/s**.", "",
             "Promotion through the transfer engine, on a side stream (the CPU tier's pinned rows copied straight "
             "to the device, a copy per run of neighbours; the disk tier read by its reader processes, one per fill "
             "thread, into shared pinned staging, a copy per chunk), timed from submission until it has landed, "
             f"best of 5 after a warm-up; random bytes, bf16 blocks of 16 tokens; "
             f"{b['rows'][0].get('fill_threads', '?')} fill threads. In parentheses: the same with one fill thread "
             "(the disk tier read in the engine's process), measured in turn. Disk in-process: the disk tier's reads "
             "on the fill threads in the engine's process (before reader processes).", "",
             "| block | bytes per block | tokens | MB | CPU tier -> device GB/s | % of H2D | warm disk -> device "
             "GB/s | % of H2D | disk in-process GB/s | % of H2D | disk write-down GB/s |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in b["rows"]:
        cells = [_with_one_thread(r, key, lambda v: f"{v:.2f}") for key in ("cpu_gbps", "disk_gbps")]
        shares = [_with_one_thread(r, key, lambda v: f"{100 * v / h2d['gbps']:.0f}%") for key in ("cpu_gbps", "disk_gbps")]
        in_process = r.get("disk_gbps_in_process")
        in_process_cells = (f"{in_process:.2f} | {100 * in_process / h2d['gbps']:.0f}%" if in_process is not None
                            else "n/a | n/a")
        lines.append(f"| {r['block']} | {r['block_nbytes']:,} | {r['tokens']} | {r['bytes'] / 1e6:.0f} | "
                     f"{cells[0]} | {shares[0]} | {cells[1]} | {shares[1]} | {in_process_cells} | "
                     f"{r['disk_write_gbps']:.2f} |")
    by_readers = [f"{r['block']}, {n} reader{'s' if n != '1' else ''}: {gbps:.2f} GB/s "
                  f"({100 * gbps / h2d['gbps']:.0f}% of H2D)"
                  for r in b["rows"] for n, gbps in r.get("disk_gbps_by_readers", {}).items()]
    if by_readers:
        lines += ["", "Warm disk -> device with other counts of reader processes than the engine's (each with as "
                      "many fill threads): " + "; ".join(by_readers) + "."]
    return lines + [""]


def _with_one_thread(row: dict, key: str, shown) -> str:
    """`row[key]` as `shown` writes it, followed by the one-fill-thread figure in parentheses when measured."""
    one = row.get(f"{key}_one_thread")
    return shown(row[key]) + (f" ({shown(one)})" if one is not None else "")


def kernels_lines(k: dict, result: dict) -> list[str]:
    return ["Paged prefix-prefill (Triton) against SDPA on the same problem laid out contiguously "
            "(benchmarks/kernels.py paging; `ours / SDPA` = 1.0: paging costs nothing):", "", *k["paging"], "",
            "Split-KV on a question over a cached document: the kernel with its choice of splits, the same "
            "kernel forced to one pass (the kernel before split-KV), and SDPA:", "", *k["split_kv"], ""]


def step_lines(rows: list[dict], result: dict) -> list[str]:
    from benchmarks.suites.kernels import decoder_step

    lines = ["One step through kvstrata's decoder (engine/decoder.py: fused norms, rotary and activation, packed "
             "products) and through transformers' modules on the same weights, paged cache and inputs "
             "(benchmarks/suites/kernels/decoder_step.py), in turn; `triton.testing.do_bench` medians, which include the time "
             "the GPU waits for the host's launches. Speed-up: transformers' time / the decoder's. CUDA graphs: "
             "the steps a recorded size holds (decodes and questions) replayed as graphs (engine/cuda_graphs.py, "
             "`model.cuda_graphs`).", "",
             "| model | dtype | case | context | new tokens | transformers' modules | kvstrata decoder | speed-up | "
             "decoder, CUDA graphs | logits vs the decoder's |", "|---|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        graphs = "–" if r.get("graphs_s") is None else fmt_ms(r["graphs_s"])
        lines.append(f"| {r['label']} | {r['dtype']} | {r['case']} | {r['context']} | "
                     f"{r['num_seqs'] * r['new_tokens']} | {fmt_ms(r['transformers_s'])} | {fmt_ms(r['decoder_s'])} | "
                     f"{fmt_x(r['speedup'])} | {graphs} | {decoder_step.agreement_text(r)} |")
    return lines + ["", decoder_step.AGREEMENT_NOTE, ""]


def ttft_lines(rows: list[dict], result: dict) -> list[str]:
    lines = [f"Document `{DOCUMENT}` cut to each length, plus a question (benchmarks/data); configs/gpu.yaml "
             f"with {result['plan'].get('block_size', 16)}-token blocks and tiers sized for one document; "
             f"median of {result['plan']['repeats']} passes after a warm-up. "
             "Miss: nothing cached. Device hit: the document cached on the device. CPU-tier hit: the device's "
             "cached blocks dropped, the document written through to the CPU tier. Disk hit: a fresh engine "
             "(empty device and CPU tiers) on the disk store the first one closed, page cache warm. Every hit "
             "computes its own question. Cold 64-token prompt: the first 64 tokens, nothing cached.", "",
             "| model | dtype | prompt tokens | miss | device hit | CPU-tier hit | disk hit after restart | "
             "cold 64-token prompt | miss / CPU hit | CPU / device | disk / device | device / cold 64 |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        m = r["median_s"]
        lines.append(f"| {r['label']} | {r['dtype']} | {r['prompt_tokens']} | {fmt_ms(m['miss'])} | "
                     f"{fmt_ms(m['device'])} | {fmt_ms(m['cpu'])} | {fmt_ms(m['disk'])} | {fmt_ms(m['short'])} | "
                     f"{fmt_x(m['miss'] / m['cpu'])} | {fmt_x(m['cpu'] / m['device'])} | "
                     f"{fmt_x(m['disk'] / m['device'])} | {fmt_x(m['device'] / m['short'])} |")
    def listed(key: str) -> list[str]:
        return [f"- {r['label']} {r['dtype']} {r['prompt_tokens']} tokens, {u}" for r in rows for u in r.get(key, [])]

    unexpected, recomputed = listed("unexpected"), listed("recomputed")
    lines += ["", *(["Requests not served by the tier their column names:", *unexpected] if unexpected
                    else ["Every request was served by the tier its column names (the tier that held most of "
                          "its prefix at lookup: the engine's `cached_tokens_by_tier` and "
                          "`recomputed_tokens_by_tier`)."])]
    if recomputed:
        lines += ["", "Hits whose load policy (`auto`) recomputed part of the prefix beside the load, as it "
                  "judged faster from the measured speeds:", *recomputed]
    return lines + [""] + phase_lines(rows)


def phase_lines(rows: list[dict]) -> list[str]:
    """Where each request's time went, on the longest document of each model and dtype (rows from before the
    report recorded receipts have none)."""
    longest = {}
    for r in rows:
        if r.get("phases_ms") and r["doc_tokens"] >= longest.get((r["model"], r["dtype"]), {"doc_tokens": 0})["doc_tokens"]:
            longest[(r["model"], r["dtype"])] = r
    if not longest:
        return []
    lines = ["Where the time to first token went, on the longest document: the requests' cache receipts "
             "(engine/receipt.py), medians over the passes. Lookup: hashing and the tier walk; load: from the "
             "load's submission until the request is admitted; prefill: the steps that computed its question.", "",
             "| model | dtype | request | queue | lookup | load | prefill |", "|---|---|---|---:|---:|---:|---:|"]
    for r in longest.values():
        for kind in [k for k in ("short", *KINDS) if k in r["phases_ms"]]:  # (rows from before have no "short")
            ph = r["phases_ms"][kind]
            request = f"cold {SHORT_PROMPT_TOKENS}-token prompt" if kind == "short" else kind
            lines.append(f"| {r['label']} | {r['dtype']} | {request} | {ph['queue']:.1f} ms | {ph['lookup']:.1f} ms | "
                         f"{ph['load']:.1f} ms | {ph['prefill']:.1f} ms |")
    return lines + [""]


def gap_lines(gaps: list[dict], result: dict) -> list[str]:
    lines = ["One greedy decode stream (a 64-token prompt); after its first tokens a question on the longest "
             "document arrives, the document in the CPU tier only (`cache.load_policy: always_load`, so that it "
             "is promoted). The longest gap is taken over the gaps that "
             "overlap the hit's stay, from its arrival to its first token (its promotion and the step that "
             "prefills its question beside the stream).", "",
             "| model | dtype | hit prompt tokens | stream tokens | median gap | longest gap during admission | "
             "longest / median | longest gap overall | hit TTFT | hit served from |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for g in gaps:
        ratio = None if g["max_gap_during_s"] is None else g["max_gap_during_s"] / g["median_gap_s"]
        served = ", ".join(f"{tier} {n}" for tier, n in g["hit_cached_tokens_by_tier"].items() if n) or "nothing"
        lines.append(f"| {g['label']} | {g['dtype']} | {g['prompt_tokens']} | {g['stream_tokens']} | "
                     f"{fmt_ms(g['median_gap_s'])} | {fmt_ms(g['max_gap_during_s'])} | {fmt_x(ratio)} | "
                     f"{fmt_ms(g['max_gap_s'])} | {fmt_ms(g['hit_ttft_s'])} | {served} |")
    return lines + [""]


# ---------------------------------------------------------------------------------------------- main

REPORT_DTYPES = ("bfloat16", "float32", "float16", "bfloat16/fp8", "float16/fp8", "bfloat16/fp8_e5m2", "bfloat16/int8")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = options.parser(__doc__)
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma separated, of {', '.join(SECTIONS)}")
    p.add_argument("--models", default=",".join(MODELS), help=f"comma separated, of {', '.join(MODELS)}")
    p.add_argument("--dtypes", default="bfloat16,float32,bfloat16/fp8,bfloat16/int8",
                   help=f"comma separated, of {', '.join(REPORT_DTYPES)} (MODEL/KV: the K/V kept in cache.kv_cache_dtype KV)")
    p.add_argument("--doc-tokens", default="3750,7050", help="document lengths in tokens, comma separated")
    options.repeats(p, 3, help="measured passes per TTFT row (after one warm-up)")
    options.out(p, default=None, help=f"the report (default {DEFAULT_OUT.relative_to(REPO_ROOT)}); "
                                               "a JSON of every figure goes beside it")
    p.add_argument("--merge", default=None, metavar="GPU_JSON",
                   help="an earlier run's JSON on the same GPU: what this run does not measure is kept from it")
    p.add_argument("--time-limit", type=float, default=None, metavar="SECONDS",
                   help="start no part (a section, or a model in a dtype) after this many seconds: where a GPU is "
                        "lent for a while; the report is written after every part anyway")
    p.add_argument("--tests-timeout", type=float, default=1800.0, metavar="SECONDS",
                   help="the tests section's limit; the compiled-kernel check stops a minute before it, so the "
                        "cases it reached are reported (on one H100 the section did not finish in 237 s)")
    p.add_argument("--block-size", type=int, default=16, choices=(8, 16, 32, 64),
                   help="tokens per KV block in every engine the run makes (cache.block_size): a hit's host work "
                        "is per block, so larger blocks make a long document's hit cheaper to admit")
    p.add_argument("--smoke", action="store_true",
                   help="every section on the CPU with tiny shapes (needs --out): checks the report runs")
    args = p.parse_args(argv)
    for name, known in (("sections", SECTIONS), ("models", tuple(MODELS)),
                        ("dtypes", REPORT_DTYPES)):
        values = [v.strip() for v in getattr(args, name).split(",") if v.strip()]
        unknown = [v for v in values if v not in known]
        if unknown or not values:
            p.error(f"--{name}: unknown or empty {', '.join(unknown)} (known: {', '.join(known)})")
        setattr(args, name, values)
    try:
        args.doc_tokens = [int(v) for v in args.doc_tokens.split(",") if v.strip()]
    except ValueError:
        p.error("--doc-tokens: comma-separated whole numbers")
    if args.time_limit is not None and args.time_limit < 0:
        p.error("--time-limit must be zero or more seconds")
    if args.tests_timeout <= 0:
        p.error("--tests-timeout must be a positive number of seconds")
    if not args.doc_tokens or min(args.doc_tokens) < 64 or args.repeats < 1:
        p.error("--doc-tokens must be at least 64 each and --repeats at least 1")
    if args.smoke and (args.out is None or Path(args.out).resolve() == DEFAULT_OUT):
        p.error(f"--smoke needs --out FILE elsewhere than {DEFAULT_OUT.relative_to(REPO_ROOT)} "
                "(its CPU figures are no GPU report)")
    return args


def run_sections(plan: Plan, result: dict, checkpoint=lambda: None, time_left=lambda: True) -> None:
    """Each section in turn (the TTFT and gap ones per model and dtype); one that fails is reported as
    failed and the others still run. After each, `checkpoint()` (the report written so far). A part not
    started while `time_left()` is False is listed in `result["not_run_for_time"]` and, for `--merge`,
    counts as not measured."""
    steps = {"tests": lambda: run_cuda_tests(plan), "bandwidth": lambda: measure_bandwidth(plan),
             "kernels": lambda: measure_kernels(plan), "step": lambda: measure_steps(plan)}
    for section in WHOLE_SECTIONS:
        if section not in plan.sections:
            continue
        if not time_left():
            result.setdefault("not_run_for_time", []).append({"section": section})
            result["plan"]["sections"].remove(section)
            continue
        log(f"{section} ...")
        result[section] = guarded(result, section, steps[section])
        checkpoint()
    if "ttft" in plan.sections or "gap" in plan.sections:
        result["ttft"], result["gap"] = [], []
        section = "ttft" if "ttft" in plan.sections else "gap"
        with tempfile.TemporaryDirectory(prefix="kvstrata-gpu-report-") as tmp:
            for model in plan.models:
                for dtype in plan.dtypes:
                    if not time_left():
                        result.setdefault("not_run_for_time", []).append({"model": model.key, "dtype": dtype})
                        continue
                    guarded(result, section, lambda: measure_model(plan, model, dtype, Path(tmp) / model.key, result),
                            what=f"{model.label} {dtype}")
                    checkpoint()


def read_earlier_run(path: Path, result: dict) -> dict:
    """An earlier run's JSON, checked to come from the same kind of run on the same device (ValueError)."""
    try:
        earlier = json.loads(path.read_text())
        name, smoke = earlier["device"]["name"], earlier["plan"]["smoke"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path} is not a GPU report's JSON ({type(exc).__name__})") from None
    if (name, smoke) != (result["device"]["name"], result["plan"]["smoke"]):
        raise ValueError(f"{path} was measured on {name!r}, this run is on {result['device']['name']!r}: "
                         "figures from two devices do not make one report")
    block_size = earlier["plan"].get("block_size", 16)
    if block_size != result["plan"]["block_size"]:
        raise ValueError(f"{path} was measured with {block_size}-token blocks, this run uses "
                         f"{result['plan']['block_size']}: their TTFTs do not make one table")
    return earlier


def merge_earlier_run(earlier: dict, result: dict) -> None:
    """Keep what `earlier` measured and this run did not: the sections it ran and this one did not (with
    their failures), and the TTFT and gap rows of the models and dtypes not measured again. The plan
    becomes the union of both; the earlier runs are listed in `merged_runs`."""
    plan, before = result["plan"], earlier["plan"]
    errors = result.setdefault("errors", {})
    for name in WHOLE_SECTIONS:
        if name in before["sections"] and name not in plan["sections"]:
            result[name] = earlier.get(name)
            if (earlier.get("errors") or {}).get(name):
                errors[name] = earlier["errors"][name]
    not_run = {(r.get("model"), r.get("dtype")) for r in result.get("not_run_for_time") or []}
    for name in ("ttft", "gap"):
        remeasured = ({(m, d) for m in plan["models"] for d in plan["dtypes"]} - not_run if name in plan["sections"]
                      else set())
        kept = [r for r in earlier.get(name) or [] if (r["model"], r["dtype"]) not in remeasured]
        result[name] = kept + (result.get(name) or [])
        if name in before["sections"] and name not in plan["sections"] and (earlier.get("errors") or {}).get(name):
            errors[name] = earlier["errors"][name]
    if not errors:
        result.pop("errors")
    plan["sections"] = [s for s in SECTIONS if s in plan["sections"] or s in before["sections"]]
    for key in ("models", "dtypes"):
        plan[key] = before[key] + [v for v in plan[key] if v not in before[key]]
    plan["doc_tokens"] = sorted(set(plan["doc_tokens"]) | set(before["doc_tokens"]))
    runs = earlier.get("merged_runs") or []
    result["merged_runs"] = runs + [{key: earlier[key] for key in ("command", "started_at", "duration_s")}
                                    | {"commit": earlier["source"]["commit"]}]


def guarded(result: dict, section: str, step, what: str = ""):
    """`step()`, or None when it raises: the failure goes into the report under `section` (and its
    traceback to stderr), and the other sections still run."""
    try:
        return step()
    except Exception as exc:
        traceback.print_exc()
        message = f"{what}{': ' if what else ''}{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"
        errors = result.setdefault("errors", {})
        errors[section] = "; ".join(filter(None, [errors.get(section), message]))
        log(f"{section} failed: {message}")
        return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        print("gpu_report: no CUDA device here, so no GPU figures; run it on a machine with one "
              "(or `--smoke --out FILE` to check it runs on the CPU)", file=sys.stderr)
        return 2
    # Set before the kernels load: in a smoke run they run on CPU tensors, which only the interpreter takes;
    # on a GPU the report times compiled kernels, whatever the caller's environment says.
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"
    elif os.environ.pop("TRITON_INTERPRET", "0") not in ("", "0"):
        log("TRITON_INTERPRET was set: ignored, the report runs the compiled kernels")
    from benchmarks.lib.machine import source_state

    plan = make_plan(args)
    out = Path(args.out) if args.out else DEFAULT_OUT
    result = {"command": "python benchmarks/gpu.py report" + "".join(f" {shlex.quote(a)}" for a in argv),
              "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "source": source_state(),
              "plan": {"smoke": plan.smoke, "sections": list(plan.sections), "models": [m.key for m in plan.models],
                       "dtypes": list(plan.dtypes), "doc_tokens": list(plan.doc_tokens), "repeats": plan.repeats,
                       "block_size": plan.block_size},
              "device": describe_device(plan)}
    earlier = None
    if args.merge:
        try:
            earlier = read_earlier_run(Path(args.merge), result)
        except ValueError as exc:
            print(f"gpu_report: --merge: {exc}", file=sys.stderr)
            return 2
    log(f"device: {result['device']['name']}; sections: {', '.join(plan.sections)}")
    started = time.perf_counter()

    def write_report() -> str:
        """The report of what is measured so far (a run stopped later keeps it); returns its text."""
        report_of = copy.deepcopy(result)
        report_of["duration_s"] = time.perf_counter() - started
        if earlier is not None:
            merge_earlier_run(earlier, report_of)
        report_of["goals"] = [g.as_dict() for g in goals(report_of)]
        report = markdown(report_of)
        results.write(out.parent, report_of, report, out.stem)
        return report

    time_left = (lambda: True) if args.time_limit is None else \
        (lambda: time.perf_counter() - started < args.time_limit)
    run_sections(plan, result, checkpoint=write_report, time_left=time_left)
    print(write_report())
    log(f"wrote {out} and {out.with_suffix('.json').name}")
    tests = result.get("tests") or {}
    return 1 if result.get("errors") or tests.get("failed") or tests.get("errors") else 0
