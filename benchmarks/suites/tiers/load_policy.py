"""Load or recompute: TTFT of a repeated document under each `cache.load_policy`, with a tier slowed down.

A document is asked about once (computed, written down), then about other questions, each after the
device tier has dropped its cached blocks, so the document comes from below the device every time.
Three scenarios, each on fresh engines sharing one loaded model:

- `fast`: the document in the CPU tier as it is (loading wins);
- `slow`: the CPU tier's reads slowed by `--slow-ms-per-block` (recomputing wins);
- `split`: the first half of the document in the CPU tier, the second half only on a disk tier slowed
  the same way (loading the first half and recomputing the second wins);
- `overlap`: the CPU tier's reads slowed by `--overlap-ms-per-block`, about what computing a block
  costs, so loading the document takes about as long as recomputing it (recomputing its first part
  while the rest loads wins).

Each scenario runs `always_load`, `always_recompute` and `auto`, one engine each, taking turns. The slowing is the tests' tier wrapper
(`tests/tier_cases.py`), not an engine setting. Reported per scenario and policy: TTFT p50 over
`--rounds` questions, the tokens loaded and recomputed, and auto's p50 against the faster of the other two
(the goal: within 10%).

    python benchmarks/tiers.py load-policy [--doc-tokens 1000] [--rounds 3] [--slow-ms-per-block 500] [--set key=value ...]

Writes `<out-dir>/load_policy.json` and `load_policy.md`.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[3]

from benchmarks.lib.machine import provenance_lines  # noqa: E402
from benchmarks.lib.harness import ask, load, render_chat, set_tiers  # noqa: E402
from benchmarks.lib.ttft_workload import DEFAULT_DATA, cut_document, load_document, load_questions  # noqa: E402
from benchmarks.lib.ttft_stats import percentile  # noqa: E402
from benchmarks.lib import options  # noqa: E402
from benchmarks.lib import results  # noqa: E402

SCENARIOS = ("fast", "slow", "split", "overlap")
POLICIES = ("always_load", "always_recompute", "auto")


def parse_args(argv=None) -> argparse.Namespace:
    p = options.parser(__doc__)
    options.config(p)
    options.overrides(p)
    p.add_argument("--doc-tokens", type=int, default=1000, help="length of the document (tokens)")
    p.add_argument("--rounds", type=int, default=3, help="questions per scenario and policy")
    p.add_argument("--slow-ms-per-block", type=float, default=500.0, help="added to each block read of a slowed tier")
    p.add_argument("--overlap-ms-per-block", type=float, default=60.0,
                   help="added to each CPU-tier block read in `overlap` (about a block's compute time)")
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    options.out_dir(p, options.RESULTS_DIR)
    return p.parse_args(argv)


@contextlib.contextmanager
def slowed(tier_class_name: str, seconds_per_block: float):
    """Engines built inside wrap that lower tier in the tests' `GatedTier`, its reads slowed."""
    from kvstrata.engine import llm_engine
    from tests.tier_cases import GatedTier

    real = getattr(llm_engine, tier_class_name)

    def build(*args, **kwargs):
        tier = GatedTier(real(*args, **kwargs))
        tier.read_s_per_block = seconds_per_block
        return tier

    setattr(llm_engine, tier_class_name, build)
    try:
        yield
    finally:
        setattr(llm_engine, tier_class_name, real)


def build_engine(scenario: str, policy: str, base, loaded, doc_blocks: int, args, work_dir: Path):
    """An engine whose tiers hold the document a few times over; in `slow` and `overlap` its CPU tier,
    in `split` its disk tier, read through the tests' slowing wrapper."""
    from kvstrata.engine.llm_engine import LLMEngine

    overrides = {"cache.load_policy": policy, "cache.offload": "write_through",
                 "cache.tiers.device.size": 2 * doc_blocks + 16, "cache.tiers.cpu": None, "cache.tiers.disk": None,
                 "cache.tiers.cpu.size": 4 * doc_blocks + 16}
    if scenario == "split":
        overrides.update({"cache.tiers.disk.path": str(work_dir / f"kv-{policy}"),
                          "cache.tiers.disk.size": 4 * doc_blocks + 16})
    slow_s, overlap_s = args.slow_ms_per_block / 1000, args.overlap_ms_per_block / 1000
    wrap = {"fast": contextlib.nullcontext, "slow": lambda: slowed("CpuTier", slow_s),
            "split": lambda: slowed("DiskTier", slow_s), "overlap": lambda: slowed("CpuTier", overlap_s)}[scenario]()
    with wrap:
        return LLMEngine(set_tiers(base, overrides), loaded=loaded)


def ask_from_below(engine, scenario: str, prompt: list[int], doc_blocks: int) -> dict:
    """Ask with the document only below the device (in `split`, its second half only on disk)."""
    engine.hierarchy.wait_for_write_downs()
    assert engine.hierarchy.clear_device_cache()
    if scenario == "split":
        for block_hash in engine.kv_manager.hasher.hash(prompt)[doc_blocks // 2:]:
            engine.hierarchy.cpu.discard(block_hash)
    before = engine.stats()["prefix_cache"]["recomputed_tokens"]
    record = ask(engine, prompt)
    after = engine.stats()["prefix_cache"]["recomputed_tokens"]
    record["recomputed_tokens_by_tier"] = {t: after[t] - before[t] for t in after}
    return record


def run_scenario(scenario: str, base, loaded, document: str, questions: list[str], args, work_dir: Path) -> dict:
    """One engine per policy, the policies taking turns within each round (a change in the machine's
    load falls on all of them alike)."""
    tokenizer = loaded.tokenizer
    doc_blocks = len(render_chat(tokenizer, document)) // base.cache.block_size
    engines = {p: build_engine(scenario, p, base, loaded, doc_blocks, args, work_dir)
               for p in POLICIES}
    for engine in engines.values():
        ask(engine, render_chat(tokenizer, f"{document}\n\nQuestion: what is this about?"))  # computes the document
        engine.hierarchy.persist()  # and writes it down to every lower tier
    records = {p: [] for p in POLICIES}
    for i, question in enumerate(questions[:args.rounds]):
        prompt = render_chat(tokenizer, f"{document}\n\nQuestion: {question}")
        for policy in POLICIES[i % len(POLICIES):] + POLICIES[:i % len(POLICIES)]:
            records[policy].append(ask_from_below(engines[policy], scenario, prompt, doc_blocks))
    results = {}
    for policy, engine in engines.items():
        ttfts = [r["ttft_s"] for r in records[policy]]
        results[policy] = {"ttft_s": ttfts, "p50_s": percentile(ttfts, 50), "records": records[policy],
                           "estimates": engine.stats()["load_policy"],
                           "loaded_tokens": records[policy][-1]["cached_tokens_by_tier"],
                           "recomputed_tokens": records[policy][-1]["recomputed_tokens_by_tier"]}
        engine.close()
    return results


def main(argv=None) -> int:
    args = parse_args(argv)
    from kvstrata import load_config

    base = load_config(args.config, args.overrides)
    loaded, _ = load(base)
    tokenizer = loaded.tokenizer

    def encode(text):
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    document = cut_document(load_document("pydoc_data.topics:try"), args.doc_tokens, encode, tokenizer.decode)
    questions = [q for qs in load_questions(DEFAULT_DATA).values() for q in qs]
    scenarios = {}
    with tempfile.TemporaryDirectory(prefix="kvstrata-load-policy-") as tmp:
        for scenario in [s for s in args.scenarios.split(",") if s]:
            started = time.perf_counter()
            scenarios[scenario] = run_scenario(scenario, base, loaded, document, questions, args, Path(tmp))
            print(f"{scenario}: " + ", ".join(f"{p} p50 {r['p50_s'] * 1000:.0f} ms"
                                              for p, r in scenarios[scenario].items())
                  + f" ({time.perf_counter() - started:.0f} s)", flush=True)
    result = results.record("load_policy", dtype=base.resolved_dtype(), doc_tokens=args.doc_tokens,
                            rounds=args.rounds, slow_ms_per_block=args.slow_ms_per_block,
                            overlap_ms_per_block=args.overlap_ms_per_block, load_average_1min=os.getloadavg()[0],
                            scenarios=scenarios)
    results.publish(result, markdown(result), args.out_dir, "load_policy")
    return 0


def markdown(result: dict) -> str:
    lines = ["# Load or recompute: TTFT with a slowed tier", "",
             *provenance_lines(result), "",
             f"{result['dtype']}, a {result['doc_tokens']}-token document, "
             f"{result['rounds']} questions per row, the policies taking turns within each round; slowed tiers "
             f"take {result['slow_ms_per_block']:g} ms more per block read (`overlap`: "
             f"{result.get('overlap_ms_per_block', 0):g} ms). Load average (1 min) at the end: "
             f"{result['load_average_1min']:.2f}.", "",
             "| scenario | policy | TTFT p50 | loaded tokens (cpu / disk) | recomputed tokens (cpu / disk) |",
             "|---|---|---|---|---|"]
    verdicts = []
    for scenario, policies in result["scenarios"].items():
        for policy, r in policies.items():
            lo, re_ = r["loaded_tokens"], r["recomputed_tokens"]
            lines.append(f"| {scenario} | {policy} | {r['p50_s'] * 1000:.0f} ms | {lo['cpu']} / {lo['disk']} | "
                         f"{re_['cpu']} / {re_['disk']} |")
        best = min(policies["always_load"]["p50_s"], policies["always_recompute"]["p50_s"])
        ratio = policies["auto"]["p50_s"] / best
        verdicts.append(f"- {scenario}: auto / faster of load and recompute = {ratio:.2f} "
                        f"({'within' if ratio <= 1.1 else 'NOT within'} 10%)")
    return "\n".join(lines + ["", *verdicts]) + "\n"
