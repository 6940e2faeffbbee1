"""Diagnostics for a GPU host, printed as they are measured and kept in `diag.json` in `--out-dir`:

- a: warm disk promotions through fresh disk tiers (reader processes) and transfer engines, the first against the
  best of the four after it, for several counts of readers and sizes of pinned staging (random blocks of SmolLM2's
  and Llama-3-8B's shape), and the last one's fill parts by staging chunk (when each began and ended);
- b: a document's disk hit after a restart (a fresh engine on the store another closed; no CPU tier) and two more
  in the same engine with its device cache dropped, under `auto` and `always_load`: each request's receipt and the
  timeline of the engine steps that served it (the scheduler's time, the runner's launch time, the step's wall time);
- c: a decode stream with a CPU-tier hit admitted beside it (as gpu_report's gap section): the stream's gaps and
  the timeline of the steps around the hit (with the next step's admission work done while each computes);
- d: CPU-tier hits alone under `auto` and `always_load`: each one's receipt and its steps' timeline, and the
  step cost the load policy priced them with;
- e: would loading a CPU-tier hit layer by layer pay (random blocks of both shapes, 7000 tokens): the copy of a
  document's pinned rows in groups of layers (a copy per block and group, or one strided 2-D copy per group), a
  question's compute (modelled as device sleeps) after the whole load against layer by layer beside it, and whether
  a captured CUDA graph's waits on external events honour events recorded after capture.

    python benchmarks/gpu.py diag --parts a,b,c,d,e --models smollm2 --out-dir DIR

Without CUDA it runs on the CPU on small shapes (`--models tiny` for a two-layer random model): every path, none of
the cost.
"""
from __future__ import annotations

import gc
import shutil
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[3]

import numpy as np  # noqa: E402
import torch  # noqa: E402
from benchmarks.lib import options  # noqa: E402
from benchmarks.lib import results as results_file  # noqa: E402

OUT = Path("gpu_diag")  # where diag.json goes: `--out-dir`
results: dict = {}


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def save():
    report = ["# GPU diagnostics", "", "The figures of each part run so far are in diag.json: "
              + ", ".join(results) + "."]
    results_file.write(OUT, {"benchmark": "diag", **results}, report)


# ---------------------------------------------------------------- A: disk promotion, first vs later
STAGING_CASES = [(4, 4, 64), (8, 8, 64), (8, 8, 256), (16, 16, 256), (4, 4, 256)]  # (readers, fill threads, MB)

def part_a(work: Path):
    from benchmarks.suites.gpu.report import promotion_layouts
    from benchmarks.suites.tiers.promotion import random_blocks
    from kvstrata.tiers.disk import DiskTier
    from kvstrata.tiers.transfer import TransferEngine

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = []
    for name, layout in promotion_layouts().items():
        num_tokens = 8192 if dev.type == "cuda" else 512
        n = num_tokens // layout.block_size
        nbytes = n * layout.block_nbytes
        hashes, tokens, _, srcs = random_blocks(n, layout)
        path = str(work / f"a-{name}")
        cap = 2 * nbytes + (64 << 20)
        d = DiskTier(layout, path, cap, check_integrity=False)
        d.put(hashes, tokens, srcs)
        d.flush()
        d.close()
        del srcs
        for readers, threads, staging in STAGING_CASES:
            kv = layout.allocate(n, device=dev, shared=(dev.type == "cpu"))
            te = TransferEngine(kv, staging_bytes=staging << 20, fill_threads=threads, shared_staging=True)
            disk = DiskTier(layout, path, cap, check_integrity=False, read_processes=readers)
            disk.share(kv, *te.shared_host_buffers())
            times, parts = [], []

            def fill(start, views):  # each part a fill thread reads, timed
                began = time.perf_counter()
                served = disk.get(hashes[start:start + len(views)], tokens[start:start + len(views)], views)
                parts.append((start, began, time.perf_counter()))
                return served

            for rep in range(5):
                parts.clear()
                t0 = time.perf_counter()
                job = te.load(list(range(n)), fill)
                job.wait()
                times.append(time.perf_counter() - t0)
                assert all(job.served)
            chunk = getattr(te._loads, "chunk", n)  # blocks a half of the staging holds (CUDA)
            disk.close()
            te.close()
            row = {"block": name, "readers": readers, "threads": threads, "staging_mb": staging,
                   "first_gbps": nbytes / times[0] / 1e9, "best_gbps": nbytes / min(times[1:]) / 1e9,
                   "all_ms": [round(t * 1e3, 1) for t in times],
                   "last_by_chunk": fill_timeline(parts, t0, chunk)}
            log(f"A {row}")
            rows.append(row)
            del kv, te, disk
            gc.collect()
        shutil.rmtree(path, ignore_errors=True)
    results["a"] = rows
    save()


def fill_timeline(parts: list[tuple[int, float, float]], t0: float, chunk: int) -> list[dict]:
    """A promotion's fill parts (first block, start, end), by staging chunk: when the chunk's first part began and
    its last ended (ms from the job's submission), its parts' median and slowest time (one slow reader holds its
    whole chunk up), and how many ran."""
    by_chunk: dict[int, list[tuple[float, float]]] = {}
    for start, began, ended in parts:
        by_chunk.setdefault(start // chunk, []).append(((began - t0) * 1e3, (ended - t0) * 1e3))
    rows = []
    for k in sorted(by_chunk):
        spans = by_chunk[k]
        took = sorted(b - a for a, b in spans)
        rows.append({"chunk": k, "parts": len(spans), "began_ms": round(min(a for a, _ in spans), 2),
                     "ended_ms": round(max(b for _, b in spans), 2), "median_part_ms": round(took[len(took) // 2], 2),
                     "slowest_part_ms": round(took[-1], 2)})
    return rows


# ---------------------------------------------------------------- timeline
class Timeline:
    def __init__(self, engine):
        self.engine = engine
        self.steps = []
        sched, run, step = engine.scheduler.schedule, engine.runner.execute, engine.step
        cur = {}

        def schedule():
            t = time.perf_counter()
            out = sched()
            cur["sched"] = time.perf_counter() - t
            cur["tokens"] = [(s.num_new_tokens, s.context) for s in out.scheduled]
            return out

        def execute(inp):
            t = time.perf_counter()
            r = run(inp)
            cur["exec_launch"] = time.perf_counter() - t
            return r

        prepare = getattr(engine.scheduler, "prepare_next_step", None)

        def prepare_next_step():  # the next step's admission work, while the device computes this one
            t = time.perf_counter()
            prepare()
            cur["prepare"] = time.perf_counter() - t

        def wrapped():
            cur.clear()
            t = time.perf_counter()
            r = step()
            cur["total"] = time.perf_counter() - t
            cur["t"] = t
            self.steps.append({k: (round(v * 1e3, 2) if isinstance(v, float) else v) for k, v in cur.items()})
            return r

        engine.scheduler.schedule = schedule
        engine.runner.execute = execute
        if prepare is not None:
            engine.scheduler.prepare_next_step = prepare_next_step
        engine.step = wrapped

    def dump(self, since=0):
        t0 = self.steps[since]["t"] if len(self.steps) > since else 0
        return [dict(s, t=round(s["t"] - t0, 2)) for s in self.steps[since:]]


def make_config(model_name, load_format, prompt_tokens, disk_path, policy, cpu=True):
    from kvstrata import load_config

    from benchmarks.suites.gpu.report import GPU_CONFIG
    from benchmarks.lib.ttft_workload import blocks_for

    blocks = blocks_for(prompt_tokens + 64, 16)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    ov = {"model.name": model_name, "model.load_format": load_format,
          "model.dtype": "bfloat16" if dev == "cuda" else "float32",
          "model.device": dev, "cache.block_size": 16, "cache.offload": "write_through",
          "cache.tiers.device.size": 3 * blocks, "cache.tiers.disk.path": str(disk_path),
          "cache.tiers.disk.size": 2 * blocks, "cache.load_policy": policy}
    if cpu:
        ov["cache.tiers.cpu.size"] = 2 * blocks
    else:
        ov["cache.tiers.cpu"] = None
    if dev == "cpu":
        ov["model.cuda_graphs"] = False
    return load_config(GPU_CONFIG, ov)


def close_engine(engine, disk: Path) -> None:
    """Close an engine (its cache goes down to disk) and remove its disk tier's store; the caller drops the
    engine and collects (its parts refer to each other: only a collection frees its KV cache)."""
    engine.close()
    shutil.rmtree(disk, ignore_errors=True)


def log_hits(recs: list[dict]) -> None:
    for r in recs:
        log(f"   {r.get('kind', 'hit')}: {r['ttft_ms']} ms {r['phases']} load {r['load_ms']} "
            f"recomputed {r['recomputed']}")
        for step in r["steps"]:
            log(f"      {step}")


def summarize(rec):
    r = rec["receipt"]
    return {"ttft_ms": round(rec["ttft_s"] * 1e3, 2), "cached": rec["cached_tokens_by_tier"],
            "recomputed": rec["recomputed_tokens_by_tier"],
            "phases": {k: r[k] for k in ("queue_ms", "lookup_ms", "prefill_ms")}, "load_ms": r["load_ms_by_tier"]}


def part_b(work: Path, model_name, load_format, doc_tokens):
    from kvstrata.engine.llm_engine import LLMEngine

    from benchmarks.suites.gpu.report import document_prompts, drop_device_cache, settle
    from benchmarks.lib.harness import ask, load

    cfg0 = make_config(model_name, load_format, doc_tokens + 200, work / "probe", "auto")
    loaded, _ = load(cfg0)
    prompts = document_prompts(loaded.tokenizer, doc_tokens, 8)
    out = {}
    for policy in ("auto", "always_load"):
        disk = work / f"b-{policy}"
        cfg = make_config(model_name, load_format, len(prompts[0]), disk, policy, cpu=False)
        salt = f"s-{policy}-{time.time_ns()}"
        e = LLMEngine(cfg, loaded=loaded)
        ask(e, prompts[0][:64], cache_salt=salt + "x")
        miss = ask(e, prompts[0], cache_salt=salt)
        e.close()
        del e
        gc.collect()
        e = LLMEngine(cfg, loaded=loaded)
        rc, cost = e.kv_manager.read_costs["disk"], e.kv_manager.step_cost
        probe = {"latency_ms": rc.latency_s * 1e3 if hasattr(rc, "latency_s") else None,
                 "per_block_us": rc.per_block_s * 1e6 if hasattr(rc, "per_block_s") else None,
                 "step_cost": [cost.overhead_s, cost.per_token_s, cost.per_pair_s, cost.per_read_s]}
        tl = Timeline(e)
        recs = []
        for k in range(1, 4):
            n0 = len(tl.steps)
            rec = ask(e, prompts[k], cache_salt=salt)
            recs.append({"kind": "first after restart" if k == 1 else "warm engine", **summarize(rec),
                         "steps": tl.dump(n0)})
            settle(e)
            drop_device_cache(e)
        close_engine(e, disk)
        del e, tl
        gc.collect()
        out[policy] = {"miss": summarize(miss), "probe": probe, "hits": recs}
        log(f"B {model_name} {policy}: miss {out[policy]['miss']['ttft_ms']} probe {probe}")
        log_hits(recs)
    results.setdefault("b", {})[model_name] = out
    save()
    return loaded, prompts


def part_c(work: Path, model_name, load_format, loaded, prompts):
    """gap: a decode stream with a CPU hit admitted; step timeline."""
    from kvstrata.engine.llm_engine import LLMEngine
    from kvstrata.engine.sampling import SamplingParams

    from benchmarks.suites.host.engine import add_during_next_step
    from benchmarks.suites.gpu.report import drop_device_cache
    from benchmarks.lib.harness import ask

    res = []
    for rep in range(2):
        disk = work / f"c-{rep}"
        cfg = make_config(model_name, load_format, len(prompts[0]), disk, "always_load")
        salt = f"c-{rep}-{time.time_ns()}"
        e = LLMEngine(cfg, loaded=loaded)
        ask(e, prompts[0], cache_salt=salt)
        drop_device_cache(e)
        tl = Timeline(e)
        stream_params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
        stream = e.add_request("stream", prompts[1][:64], stream_params, cache_salt=salt + "-s")
        times, hits, hit_step = [], [], None
        while e.has_unfinished_requests():
            got = e.step()
            if stream in got:
                times.append(time.perf_counter())
            if len(times) == 16 and stream in got:  # the hit arrives while the next step computes, as in a server
                hit_step = len(tl.steps)
                add_during_next_step(e, lambda: hits.append(e.add_request(
                    "hit", prompts[1], SamplingParams(max_tokens=1, temperature=0.0), cache_salt=salt)))
        steps = tl.dump(max(0, hit_step - 3))[:16]
        gaps = [round((b - a) * 1e3, 2) for a, b in zip(times, times[1:])]
        close_engine(e, disk)
        del e, tl
        gc.collect()
        hit = hits[0]
        r = {"gaps_ms": gaps, "steps": steps, "hit_ttft_ms": round(hit.ttft_s * 1e3, 2),
             "hit_receipt": hit.receipt.to_dict() if hasattr(hit, "receipt") and hit.receipt else None}
        res.append(r)
        log(f"C {model_name} rep {rep}: gaps {gaps}")
        for s in steps:
            log(f"      {s}")
    results.setdefault("c", {})[model_name] = res
    save()


def part_d(work: Path, model_name, load_format, loaded, prompts):
    """CPU-tier hits alone under `auto` and `always_load`: each request's receipt and its steps' timeline."""
    from kvstrata.engine.llm_engine import LLMEngine

    from benchmarks.suites.gpu.report import drop_device_cache, settle
    from benchmarks.lib.harness import ask

    out = {}
    for policy in ("auto", "always_load"):
        cfg = make_config(model_name, load_format, len(prompts[0]), work / f"d-{policy}", policy)
        salt = f"d-{policy}-{time.time_ns()}"
        e = LLMEngine(cfg, loaded=loaded)
        miss = ask(e, prompts[0], cache_salt=salt)
        settle(e)
        drop_device_cache(e)
        tl = Timeline(e)
        recs = []
        for k in range(1, 4):
            n0 = len(tl.steps)
            recs.append({**summarize(ask(e, prompts[k], cache_salt=salt)), "steps": tl.dump(n0)})
            settle(e)
            drop_device_cache(e)
        cost, read = e.kv_manager.step_cost, e.kv_manager.read_costs["cpu"]
        out[policy] = {"miss": summarize(miss), "hits": recs, "step_cost": {
            "overhead_ms": cost.overhead_s * 1e3, "replayed_overhead_ms": cost.replayed_overhead_s * 1e3,
            "per_token_us": cost.per_token_s * 1e6, "replay_tokens": cost.replay_tokens,
            "cpu_read_latency_ms": read.latency_s * 1e3, "cpu_read_per_block_us": read.per_block_s * 1e6}}
        close_engine(e, work / f"d-{policy}")
        del e, tl
        gc.collect()
        log(f"D {model_name} {policy}: miss {out[policy]['miss']['ttft_ms']} cost {out[policy]['step_cost']}")
        log_hits(recs)
    results.setdefault("d", {})[model_name] = out
    save()


# ---------------------------------------------------------------- E: would loading layer by layer pay?
# A CPU-tier hit now lands whole before its question computes. Loading it layer by layer would let layer l compute
# once its own layer's blocks are in (SGLang HiCache's layer-wise loading). With the block-major layout a layer is
# a slice of every block: these measure what moving such slices costs, what overlapping them with a question's
# compute would save, and whether a captured CUDA graph honours per-layer waits on events recorded after capture.
LAYER_GROUPS = (1, 2, 4, 8, 0)  # groups of layers moved apart (0: one per layer)
LAYER_COMPUTE_MS = (0.08, 0.22)  # a question's compute per layer: SmolLM2's and the 8B shape's device hits, one H200


def part_e():
    from benchmarks.suites.gpu.report import promotion_layouts

    cuda = torch.cuda.is_available()
    out = {}
    for name, layout in promotion_layouts().items():
        n = (7000 if cuda else 256) // layout.block_size
        # the CPU tier's slab rows (pinned, lent to a load) and the device blocks they go to, as bytes
        dev = "cuda" if cuda else "cpu"
        src = torch.empty((n, layout.block_nbytes), dtype=torch.uint8, pin_memory=cuda)
        src.copy_(torch.randint(0, 256, src.shape, dtype=torch.uint8, device=dev))  # (made on the device: fast)
        dst = torch.zeros_like(src, device=dev)
        layers = layout.num_layers
        copies = []
        for mode in ("per_block", "2d"):
            for groups in LAYER_GROUPS:
                row = _guarded(lambda: _best_group_copy(src, dst, layers, groups or layers, mode))
                copies.append({"mode": mode, "groups": groups or layers, **row})
                log(f"E {name} copy {copies[-1]}")
        overlap = []
        for layer_ms in LAYER_COMPUTE_MS:
            row = _guarded(lambda: _overlap_trial(src, dst, layers, layer_ms))
            overlap.append({"layer_ms": layer_ms, **row})
            log(f"E {name} overlap {overlap[-1]}")
        graph = _guarded(lambda: _graph_waits(layers, LAYER_COMPUTE_MS[0])) if cuda else None
        log(f"E {name} graph {graph}")
        out[name] = {"blocks": n, "mb": round(n * layout.block_nbytes / 1e6, 1), "copies": copies,
                     "overlap": overlap, "graph": graph}
        del src, dst
        gc.collect()
    results["e"] = out
    save()


def _guarded(measure) -> dict:
    """`measure()`, or what went wrong: one failed trial must not cost the rest of a run on a lent GPU."""
    try:
        return measure()
    except Exception as e:  # noqa: BLE001 - a diagnostic records its failures
        log(f"E failed: {e!r}")
        return {"error": repr(e)}


def _group_bounds(block_nbytes: int, layers: int, groups: int) -> list[tuple[int, int]]:
    """Each group's byte range within a block: whole layers, as even as they divide."""
    layer_nbytes = block_nbytes // layers
    cuts = [layers * k // groups * layer_nbytes for k in range(groups + 1)]
    return list(zip(cuts, cuts[1:]))


def _copy_group(src: torch.Tensor, dst: torch.Tensor, lo: int, hi: int, mode: str) -> None:
    """Bytes `lo:hi` of every block: one copy per block (`per_block`), or one strided copy for all (`2d`)."""
    if mode == "per_block":
        if dst.is_cuda:
            torch._foreach_copy_([dst[b, lo:hi] for b in range(len(dst))], [src[b, lo:hi] for b in range(len(src))],
                                 non_blocking=True)
        else:
            for b in range(len(dst)):
                np.copyto(dst[b, lo:hi].numpy(), src[b, lo:hi].numpy())
    elif dst.is_cuda:
        _memcpy_2d(dst[:, lo:hi], src[:, lo:hi])
    else:
        np.copyto(dst[:, lo:hi].numpy(), src[:, lo:hi].numpy())


def _best_group_copy(src, dst, layers: int, groups: int, mode: str, repeats: int = 5) -> dict:
    """The copy of every block in `groups` groups of layers, best of `repeats`: its total time, the time until the
    first group had landed (the earliest a question's first layer could start), the host's time issuing it."""
    bounds = _group_bounds(src.shape[1], layers, groups)
    runs = []
    for _ in range(repeats):
        dst.zero_()
        if dst.is_cuda:
            torch.cuda.synchronize()
            stream = torch.cuda.Stream()
            start, landed = torch.cuda.Event(enable_timing=True), [torch.cuda.Event(enable_timing=True) for _ in bounds]
            with torch.cuda.stream(stream):
                start.record()
                issued = time.perf_counter()
                for (lo, hi), event in zip(bounds, landed):
                    _copy_group(src, dst, lo, hi, mode)
                    event.record()
                issue_s = time.perf_counter() - issued
            stream.synchronize()
            first_ms, total_ms = start.elapsed_time(landed[0]), start.elapsed_time(landed[-1])
        else:
            started = time.perf_counter()
            first_ms = None
            for lo, hi in bounds:
                _copy_group(src, dst, lo, hi, mode)
                first_ms = first_ms or (time.perf_counter() - started) * 1e3
            total_ms = (time.perf_counter() - started) * 1e3
            issue_s = total_ms / 1e3
        runs.append({"total_ms": round(total_ms, 3), "first_group_ms": round(first_ms, 3),
                     "issue_ms": round(issue_s * 1e3, 3)})
    assert torch.equal(dst.cpu(), src), "a copy in groups of layers moved other bytes"
    best = min(runs, key=lambda r: r["total_ms"])
    return {**best, "gbps": round(src.numel() / best["total_ms"] / 1e6, 2)}


_cudart = None


def _memcpy_2d(dst: torch.Tensor, src: torch.Tensor) -> None:
    """`dst.copy_(src)` of two 2-D byte views with rows apart (pinned host to device), as one cudaMemcpy2DAsync on
    the current stream: torch's own copy of strided views goes through a pageable contiguous copy."""
    global _cudart
    if _cudart is None:
        import ctypes
        with open("/proc/self/maps") as maps:  # the CUDA runtime torch has loaded
            path = next(line.split()[-1] for line in maps if "libcudart.so" in line)
        _cudart = ctypes.CDLL(path)
        _cudart.cudaMemcpy2DAsync.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t,
                                              ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    rows, width = dst.shape
    error = _cudart.cudaMemcpy2DAsync(dst.data_ptr(), dst.stride(0), src.data_ptr(), src.stride(0), width, rows,
                                      4, torch.cuda.current_stream().cuda_stream)  # 4: cudaMemcpyDefault
    if error:
        raise RuntimeError(f"cudaMemcpy2DAsync failed with CUDA error {error}")


def _overlap_trial(src, dst, layers: int, layer_ms: float) -> dict:
    """A question computing `layers` layers of `layer_ms` each (modelled as a wait on the device, a sleep on the
    host) beside a load of every block: after the whole load has landed (today), and layer by layer, layer l
    once its own slices have (2-D copies, one a layer). Also each alone."""
    bounds = _group_bounds(src.shape[1], layers, layers)
    run = _device_trial if dst.is_cuda else _host_trial
    timed = {"compute_alone_ms": run(src, dst, bounds, layer_ms, copy=False, layered=False),
             "copy_then_compute_ms": run(src, dst, bounds, layer_ms, copy=True, layered=False),
             "layer_by_layer_ms": run(src, dst, bounds, layer_ms, copy=True, layered=True)}
    timed = {k: round(v, 3) for k, v in timed.items()}
    return {**timed, "layered_saves": round(timed["copy_then_compute_ms"] / timed["layer_by_layer_ms"], 2)}


def _sleep_cycles_per_ms() -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    return 10_000_000 / start.elapsed_time(end)


def _device_trial(src, dst, bounds, layer_ms: float, copy: bool, layered: bool, repeats: int = 5) -> float:
    cycles = int(_sleep_cycles_per_ms() * layer_ms)
    compute, load = torch.cuda.Stream(), torch.cuda.Stream()  # neither the default stream, which others may wait for
    best = float("inf")
    for _ in range(repeats):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        landed = [torch.cuda.Event() for _ in bounds]
        start.record(compute)
        if copy:
            load.wait_event(start)
            with torch.cuda.stream(load):
                if layered:
                    for (lo, hi), event in zip(bounds, landed):
                        _memcpy_2d(dst[:, lo:hi], src[:, lo:hi])
                        event.record()
                else:
                    dst.copy_(src, non_blocking=True)
                    landed[-1].record()
        with torch.cuda.stream(compute):
            for layer, event in enumerate(landed):
                if copy and (layered or layer == 0):
                    compute.wait_event(event if layered else landed[-1])
                torch.cuda._sleep(cycles)
        end.record(compute)
        end.synchronize()
        best = min(best, start.elapsed_time(end))
    return best


def _host_trial(src, dst, bounds, layer_ms: float, copy: bool, layered: bool, repeats: int = 3) -> float:
    import threading

    best = float("inf")
    for _ in range(repeats):
        landed = [threading.Event() for _ in bounds]

        def load():
            for (lo, hi), event in zip(bounds, landed):
                np.copyto(dst[:, lo:hi].numpy(), src[:, lo:hi].numpy())
                if layered:
                    event.set()
            for event in landed:
                event.set()

        started = time.perf_counter()
        loader = threading.Thread(target=load) if copy else None
        if loader is not None:
            loader.start()
        for layer, event in enumerate(landed):
            if copy:
                (event if layered else landed[-1]).wait()
            time.sleep(layer_ms / 1e3)
        best = min(best, (time.perf_counter() - started) * 1e3)
        if loader is not None:
            loader.join()
    return best


def _graph_waits(layers: int, layer_ms: float) -> dict:
    """A captured CUDA graph of `layers` sleeps, each after a wait on an external event: its replay time with
    nothing in flight, with the events recorded behind a busy side stream before the replay's launch, and after
    it. A wait honoured makes the replay last about as long as the side stream's busy time."""
    cycles_per_ms = _sleep_cycles_per_ms()
    events = [torch.cuda.Event(external=True) for _ in range(layers)]
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        for event in events:
            event.record()  # made now: a wait on an event never recorded is no wait
    side.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for event in events:
            event.wait()
            torch.cuda._sleep(int(cycles_per_ms * layer_ms))
    busy_ms = 20.0
    compute = torch.cuda.Stream()  # not the default stream, which others may wait for

    def replay(record_before: bool | None) -> float:
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if record_before is not None:
            with torch.cuda.stream(side):
                torch.cuda._sleep(int(cycles_per_ms * busy_ms))
                if record_before:
                    for event in events:
                        event.record()
        with torch.cuda.stream(compute):
            start.record()
            graph.replay()
            end.record()
        if record_before is False:
            with torch.cuda.stream(side):
                for event in events:
                    event.record()
        end.synchronize()
        return round(start.elapsed_time(end), 3)

    idle, before, after = replay(None), replay(True), replay(False)
    return {"compute_ms": round(layers * layer_ms, 3), "side_busy_ms": busy_ms, "replay_idle_ms": idle,
            "replay_events_recorded_before_ms": before, "replay_events_recorded_after_ms": after,
            "waits_honoured_recorded_before": before >= 0.9 * busy_ms,
            "waits_honoured_recorded_after": after >= 0.9 * busy_ms}


def main(argv=None):
    global OUT
    parser = options.parser(__doc__)
    parser.add_argument("--parts", default="a,b,c,d,e")
    parser.add_argument("--models", default="smollm2", help="smollm2, llama-3-8b or tiny, comma-separated")
    options.out_dir(parser, default=OUT, help="where diag.json is written (default: ./gpu_diag)")
    args = parser.parse_args(argv)
    OUT = Path(args.out_dir)
    parts, models = args.parts.split(","), args.models.split(",")
    doc = 7000 if torch.cuda.is_available() else 300
    work = Path(tempfile.mkdtemp(prefix="diag-"))
    log(f"device {torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'cpu'}")
    if "a" in parts:
        part_a(work)
    if "e" in parts:
        part_e()
    for m in models:
        name, fmt = {"smollm2": ("smollm2-135m-instruct", "auto"), "llama-3-8b": ("llama-3-8b", "dummy"),
                     "tiny": ("tiny-llama", "dummy")}[m]
        loaded = prompts = None
        if "b" in parts:
            loaded, prompts = part_b(work, name, fmt, doc)
        if "c" in parts or "d" in parts:
            if loaded is None:
                from benchmarks.suites.gpu.report import document_prompts
                from benchmarks.lib.harness import load
                loaded, _ = load(make_config(name, fmt, doc + 200, work / "probe", "auto"))
                prompts = document_prompts(loaded.tokenizer, doc, 8)
            if "c" in parts:
                part_c(work, name, fmt, loaded, prompts)
        if "d" in parts and loaded is not None:
            part_d(work, name, fmt, loaded, prompts)
        del loaded
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    shutil.rmtree(work, ignore_errors=True)
    log("done")
    return 0
