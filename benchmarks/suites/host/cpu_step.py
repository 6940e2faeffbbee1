"""The CPU step's fixed cost: a device hit's TTFT (a short question after a long document already cached on the
device) and the decode time per token, through `LLM.generate`, against transformers' `generate` on the same
weights with the document's KV kept between calls (its equivalent of a hit), same dtype, same threads.

    python benchmarks/host.py cpu-step run --baseline-root ../other-checkout --out benchmarks/results/cpu_step.md
    python benchmarks/host.py cpu-step profile --dtype float32 --threads 1     # cProfile + torch.profiler of this tree
                                                                              # (a miss, a hit, a hit + decode)

`run` measures each side in its own process, in alternating rounds, so that a busy machine slows all sides alike:
this tree's kvstrata (and transformers, in the same process), and, with `--baseline-root`, the kvstrata of another
checkout (its `kvstrata` packages alone put first on PYTHONPATH: the benchmark is this tree's), and, with
`--llama-cpp`, llama-cpp-python (the `peers` extra) on the shipped GGUF file itself, same threads. Figures are
medians over every round's repeats.

What is timed:
- hit TTFT: `LLM.generate` of document + question, `max_tokens=1`, the document's blocks already on the device;
  the output's measured `ttft_s` (arrival to first token). transformers: one forward of the question over a copy
  of the document's `DynamicCache`, cropped back after, and the argmax of its last logits.
- decode ms/token: the same request with `max_tokens=1 + N` (`ignore_eos`), its wall time less its TTFT, over N.
  transformers: `generate(max_new_tokens=1 + N)` less `generate(max_new_tokens=1)`, both over the cached
  document, over N.
- llama.cpp: its `generate` over document + question after a call over the document with another question, so
  it keeps the document's KV (its longest common prefix) and evaluates only the question: TTFT is the time to its
  first token, decode the time of the next N tokens over N. It computes in the GGUF's own format (the shipped
  file's quantised weights), not in the dtype the other sides use: its answers are not expected to be equal.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.lib.harness import module_command
from benchmarks.lib.in_turn import import_root_of
from benchmarks.lib import options
from benchmarks.lib import results

REPO_ROOT = Path(__file__).resolve().parents[3]

DOC_TOPICS = ("compound", "execmodel", "import", "types", "specialnames")  # pydoc_data.topics: plain English text


def document_ids(tokenizer, num_tokens: int) -> list[int]:
    """The first `num_tokens` tokens of some of Python's own reference text (shipped with the interpreter)."""
    from pydoc_data.topics import topics

    ids: list[int] = []
    for topic in DOC_TOPICS:
        ids += tokenizer.encode(topics[topic], add_special_tokens=False)
        if len(ids) >= num_tokens:
            return ids[:num_tokens]
    raise ValueError(f"the documents hold only {len(ids)} tokens, fewer than {num_tokens}")


def question_ids(tokenizer, count: int, num_tokens: int) -> list[list[int]]:
    """`count` distinct questions of exactly `num_tokens` tokens: the development set's, each cut, or continued by
    the questions after it, at `num_tokens` (padding with spaces would not do: a run of spaces is one token)."""
    lines = (REPO_ROOT / "benchmarks" / "data" / "longdoc_qa_dev.jsonl").read_text().splitlines()
    questions = [json.loads(line)["question"] for line in lines]
    out = []
    for i in range(count):
        ids: list[int] = []
        for j in range(i, i + len(questions)):
            ids += tokenizer.encode((" Question: " if j == i else " ") + questions[j % len(questions)],
                                    add_special_tokens=False)
            if len(ids) >= num_tokens:
                break
        out.append(ids[:num_tokens])
    return out


def measure_kvstrata(dtype: str, threads: int, doc_tokens: int, question_tokens: int, decode_tokens: int,
                     repeats: int, with_transformers: bool) -> dict:
    """One process's figures for whatever `kvstrata` imports here (this tree or the baseline's)."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    import kvstrata
    from kvstrata import LLM, SamplingParams, load_config

    # the imported checkout's own default config: another commit's schema may not know this tree's keys
    config = load_config(Path(kvstrata.__file__).resolve().parents[1] / "configs" / "default.yaml",
                         {"model": {"dtype": dtype, "threads": threads},
                          "cache": {"tiers": {"device": {"size": "256MiB"}, "cpu": {"size": 0}, "disk": {"size": 0}}}})
    llm = LLM(config)
    tokenizer = llm.tokenizer
    doc = document_ids(tokenizer, doc_tokens)
    questions = question_ids(tokenizer, repeats + 2, question_tokens)
    one = SamplingParams(max_tokens=1, temperature=0.0)
    many = SamplingParams(max_tokens=1 + decode_tokens, temperature=0.0, ignore_eos=True)
    llm.generate([doc + questions[-1]], one)  # caches the document (and warms up)
    llm.generate([doc + questions[-2]], many)
    ttft, decode, answers = [], [], []
    for question in questions[:repeats]:
        out = llm.generate([doc + question], one)[0]
        assert out.cached_tokens_by_tier["device"] == doc_tokens, out.cached_tokens_by_tier
        assert len(question) == question_tokens, len(question)  # every question's tokens computed, no fewer
        ttft.append(out.ttft_s)
        start = time.perf_counter()
        out = llm.generate([doc + question], many)[0]
        wall = time.perf_counter() - start
        decode.append((wall - out.ttft_s) / decode_tokens)
        answers.append(out.token_ids)
    result = {"source": source_commit(Path(kvstrata.__file__).resolve().parent.parent), "dtype": dtype, "threads": threads,
              "torch_threads": _torch_threads(), "ttft_s": ttft, "decode_s_per_token": decode, "answers": answers}
    if with_transformers:
        model = _transformers_model(llm, dtype)
        llm.close()
        result["transformers"] = measure_transformers(model, doc, questions[:repeats], decode_tokens)
    else:
        llm.close()
    return result


def source_commit(root: Path) -> str:
    """The commit a side's checkout is at (its path would name this machine's directories in the results)."""
    done = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return f"commit {done.stdout.strip()}" if done.returncode == 0 and done.stdout.strip() else "unknown commit"


def _torch_threads() -> int:
    import torch
    return torch.get_num_threads()


def _transformers_model(llm, dtype: str):
    """transformers' own model over the same weights file, with its default attention (SDPA)."""
    import torch
    from transformers import AutoModelForCausalLM

    source = llm.engine.loaded.source
    files = {"gguf_file": source.gguf_file} if source.gguf_file else {}
    return AutoModelForCausalLM.from_pretrained(source.directory, dtype=getattr(torch, dtype), local_files_only=True,
                                                **files).eval()


def measure_transformers(model, doc: list[int], questions: list[list[int]], decode_tokens: int) -> dict:
    import torch
    from transformers import DynamicCache

    eos = model.generation_config.eos_token_id
    pad = eos[0] if isinstance(eos, (list, tuple)) else eos
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        model(torch.tensor([doc]), past_key_values=cache, use_cache=True)

        def generate(question: list[int], new_tokens: int) -> tuple[float, list[int]]:
            ids = torch.tensor([doc + question])
            start = time.perf_counter()
            out = model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, do_sample=False,
                                 max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=pad)
            elapsed = time.perf_counter() - start
            _crop(cache, len(doc))
            return elapsed, out[0, ids.shape[1]:].tolist()

        generate(questions[0], 1 + decode_tokens)  # warm-up
        ttft, decode, answers = [], [], []
        for question in questions:
            start = time.perf_counter()
            logits = model(torch.tensor([question]), past_key_values=cache, use_cache=True).logits
            int(logits[0, -1].argmax())
            ttft.append(time.perf_counter() - start)
            _crop(cache, len(doc))
            first, _ = generate(question, 1)
            total, answer = generate(question, 1 + decode_tokens)
            decode.append((total - first) / decode_tokens)
            answers.append(answer)
    return {"ttft_s": ttft, "decode_s_per_token": decode, "answers": answers}


def _crop(cache, length: int) -> None:
    """Cut the cache back to its first `length` positions (transformers' `crop` takes the count to remove)."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


def measure_llama_cpp(threads: int, doc_tokens: int, question_tokens: int, decode_tokens: int, repeats: int) -> dict:
    """llama-cpp-python on the embedded model's GGUF, the document's KV kept between questions (see the top)."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    from llama_cpp import Llama
    from transformers import AutoTokenizer

    from kvstrata.engine.model_loader import EMBEDDED_MODEL, resolve_model

    source = resolve_model(EMBEDDED_MODEL)
    tokenizer = AutoTokenizer.from_pretrained(source.directory, gguf_file=source.gguf_file, local_files_only=True)
    doc = document_ids(tokenizer, doc_tokens)
    questions = question_ids(tokenizer, repeats + 2, question_tokens)
    llm = Llama(model_path=str(source.directory / source.gguf_file), n_ctx=doc_tokens + question_tokens +
                decode_tokens + 64, n_batch=doc_tokens + question_tokens, n_threads=threads, n_threads_batch=threads,
                verbose=False)

    def generate(question: list[int], new_tokens: int) -> tuple[float, float, list[int]]:
        start = time.perf_counter()
        first, answer = None, []
        for token in llm.generate(doc + question, temp=0.0, top_k=1, reset=True):
            first = first if first is not None else time.perf_counter() - start
            answer.append(token)
            if len(answer) == new_tokens:
                break
        return first, time.perf_counter() - start, answer

    generate(questions[-1], 1)             # the document's KV (and a warm-up)
    generate(questions[-2], 1 + decode_tokens)
    ttft, decode, answers = [], [], []
    for question in questions[:repeats]:
        first, total, answer = generate(question, 1 + decode_tokens)
        ttft.append(first)
        decode.append((total - first) / decode_tokens)
        answers.append(answer)
    llm.close()
    return {"source": f"llama-cpp-python on {source.gguf_file}", "threads": threads, "ttft_s": ttft,
            "decode_s_per_token": decode, "answers": answers}


def run_side(args, root: Path, with_transformers: bool, llama_cpp: bool = False) -> dict:
    """One side's figures, measured in a fresh process with `root` first on PYTHONPATH."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]).rstrip(":"))
    cmd = [*module_command(__file__, "side"), "--dtype", args.dtype_now, "--threads",
           str(args.threads_now), "--doc-tokens", str(args.doc_tokens), "--question-tokens", str(args.question_tokens),
           "--decode-tokens", str(args.decode_tokens), "--repeats", str(args.repeats)]
    if with_transformers:
        cmd.append("--transformers")
    if llama_cpp:
        cmd.append("--llama-cpp")
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=str(REPO_ROOT))
    if done.returncode:
        raise SystemExit(f"side {root} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def cpu_flags_line() -> str:
    """The CPU's vector and matrix flags (avx*, amx*), as the engine's probe reads them."""
    from kvstrata.kernels.cpu_features import cpuinfo_flags

    flags = cpuinfo_flags()
    return "unknown" if flags is None else " ".join(sorted(f for f in flags if f.startswith(("avx", "amx"))))


def median_ms(values: list[float]) -> float:
    return 1e3 * statistics.median(values)


def command_run(args) -> None:
    with tempfile.TemporaryDirectory() as work_dir:
        sides = [("this tree", REPO_ROOT, True, False)]
        if args.baseline_root:  # its kvstrata alone: its own benchmarks would measure otherwise than this tree's
            root = import_root_of(Path(args.baseline_root).resolve(), Path(work_dir) / "root")
            sides.insert(0, (f"baseline ({args.baseline_label})", root, False, False))
        measure_sides(args, sides)


def measure_sides(args, sides: list[tuple[str, Path, bool, bool]]) -> None:
    if args.llama_cpp:
        from benchmarks.lib.peers import LLAMA_CPP_MISSING, llama_cpp_available

        if not llama_cpp_available():
            raise SystemExit(LLAMA_CPP_MISSING)
        sides.append(("llama.cpp (GGUF as shipped)", REPO_ROOT, False, True))
    rows = []
    raw = []
    for dtype in args.dtype:
        for threads in args.threads:
            args.dtype_now, args.threads_now = dtype, threads
            merged: dict[str, dict] = {}
            for round_index in range(args.rounds):
                order = sides if round_index % 2 == 0 else sides[::-1]
                for name, root, with_hf, llama_cpp in order:
                    result = run_side(args, root, with_hf, llama_cpp)
                    raw.append({"side": name, "round": round_index, **result})
                    print(f"{dtype} {threads}t {name} round {round_index}: ttft {median_ms(result['ttft_s']):.1f} ms, "
                          f"decode {median_ms(result['decode_s_per_token']):.1f} ms/token", flush=True)
                    for label, figures in [(name, result)] + ([("transformers generate", result["transformers"])]
                                                               if "transformers" in result else []):
                        into = merged.setdefault(label, {"ttft_s": [], "decode_s_per_token": [], "answers": []})
                        for key in into:
                            into[key] += figures[key]
            rows.append((dtype, threads, merged))
            write_report(args, rows, raw)  # after each setting: a long run stopped early keeps what it measured


def write_report(args, rows, raw) -> None:
    sys.path.insert(0, str(REPO_ROOT))
    from benchmarks.lib.machine import cpu_name

    lines = [f"# CPU step: device-hit TTFT and decode time per token", "",
             f"Command: `python benchmarks/host.py cpu-step {' '.join(args.argv)}`", "",
             f"CPU: {cpu_name()}, {os.cpu_count()} cores; flags: `{cpu_flags_line()}`", "",
             f"A {args.doc_tokens}-token document cached on the device, {args.question_tokens}-token questions, "
             f"{args.decode_tokens} decoded tokens; medians of {args.repeats} repeats x {args.rounds} rounds "
             "(sides in alternating processes).", "",
             "| dtype | threads | side | hit TTFT ms | decode ms/token | TTFT vs baseline | decode vs baseline |",
             "|---|---|---|---|---|---|---|"]
    for dtype, threads, merged in rows:
        base = next((v for k, v in merged.items() if k.startswith("baseline")), None)
        for side, figures in merged.items():
            ttft, decode = median_ms(figures["ttft_s"]), median_ms(figures["decode_s_per_token"])
            ratio = ("", "") if base is None or figures is base else (
                _lower_or_higher(median_ms(base["ttft_s"]), ttft),
                _lower_or_higher(median_ms(base["decode_s_per_token"]), decode))
            lines.append(f"| {dtype} | {threads} | {side} | {ttft:.1f} | {decode:.1f} | {ratio[0]} | {ratio[1]} |")
    sides = {k for _, _, merged in rows for k in merged}
    lines += ["", "Greedy answers equal between sides: " + "; ".join(
        f"{dtype} {threads}t: " + ", ".join(f"{a} = {b}: {merged[a]['answers'] == merged[b]['answers']}"
                                           for a, b in _pairs(sorted(merged)))
        for dtype, threads, merged in rows)]
    del sides
    out = Path(args.out)
    results.publish({"benchmark": "cpu_step", "sides": raw}, lines, out.parent, out.stem)


def _lower_or_higher(baseline: float, value: float) -> str:
    """`value` against `baseline` as a user reads it: "1.50x lower" (faster), or "1.33x higher" (slower)."""
    return f"{baseline / value:.2f}x lower" if value <= baseline else f"{value / baseline:.2f}x higher"


def _pairs(names: list[str]) -> list[tuple[str, str]]:
    return [(names[i], names[j]) for i in range(len(names)) for j in range(i + 1, len(names))]


def command_side(args) -> None:
    if args.llama_cpp:
        print(json.dumps(measure_llama_cpp(args.threads[0], args.doc_tokens, args.question_tokens,
                                           args.decode_tokens, args.repeats)))
        return
    result = measure_kvstrata(args.dtype[0], args.threads[0], args.doc_tokens, args.question_tokens,
                              args.decode_tokens, args.repeats, args.transformers)
    print(json.dumps(result))


def command_profile(args) -> None:
    """Where a miss (the whole document computed), a hit's step and a decode step spend their time, in this tree:
    cProfile (Python) and torch.profiler (operators), printed."""
    import cProfile
    import pstats

    import torch

    import kvstrata
    from kvstrata import LLM, SamplingParams, load_config

    # the imported checkout's own default config: another commit's schema may not know this tree's keys
    config = load_config(Path(kvstrata.__file__).resolve().parents[1] / "configs" / "default.yaml",
                         {"model": {"dtype": args.dtype[0], "threads": args.threads[0],
                                    "batch_invariant": {"true": True, "false": False}.get(args.batch_invariant, "auto")},
                          "cache": {"tiers": {"device": {"size": "256MiB"}, "cpu": {"size": 0}, "disk": {"size": 0}}}})
    llm = LLM(config)
    doc = document_ids(llm.tokenizer, args.doc_tokens)
    questions = question_ids(llm.tokenizer, 3, args.question_tokens)
    llm.generate([doc + questions[2]], SamplingParams(max_tokens=1, temperature=0.0))
    # a miss: the whole document computed (a salt no request used, so nothing of it is cached; each run its own)
    salts = iter(range(4))
    for name, question, tokens, salted in (("miss", questions[0], 1, True), ("hit", questions[0], 1, False),
                                           ("hit + decode", questions[1], 1 + args.decode_tokens, False)):
        params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
        profiler = cProfile.Profile()
        profiler.enable()
        llm.generate([doc + question], params, cache_salt=f"profile-{next(salts)}" if salted else None)
        profiler.disable()
        print(f"== cProfile: {name}")
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            llm.generate([doc + question], params, cache_salt=f"profile-{next(salts)}" if salted else None)
        print(f"== torch.profiler: {name}")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
    llm.close()


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = options.parser(__doc__)
    parser.add_argument("command", choices=("run", "side", "profile"))
    options.dtype(parser, ["float32"], many=True)
    options.threads(parser, [1], many=True)
    parser.add_argument("--doc-tokens", type=int, default=2048)
    parser.add_argument("--question-tokens", type=int, default=10)
    parser.add_argument("--decode-tokens", type=int, default=16)
    options.repeats(parser, 5)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--transformers", action="store_true", help="side: also measure transformers' generate")
    parser.add_argument("--llama-cpp", action="store_true",
                        help="run: also measure llama-cpp-python on the shipped GGUF (pip install 'kvstrata[peers]'); "
                             "side: measure it alone")
    parser.add_argument("--baseline-root", help="run: a checkout of the commit to compare with")
    parser.add_argument("--baseline-label", default="baseline")
    parser.add_argument("--batch-invariant", choices=("auto", "true", "false"), default="auto",
                        help="profile: model.batch_invariant")
    options.out(parser, default=str(REPO_ROOT / "benchmarks" / "results" / "cpu_step.md"))
    args = parser.parse_args(argv)
    args.argv = argv
    {"run": command_run, "side": command_side, "profile": command_profile}[args.command](args)

