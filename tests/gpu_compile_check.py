"""Compile every Triton kernel for an NVIDIA sm_90 GPU, without a GPU: Triton's front end, its MLIR passes and
ptxas all run on the CPU. This catches what the interpreter lets through (loop-carried types, dot shapes, early
returns, constexpr misuse). Run in a fresh process with TRITON_INTERPRET unset:

    python tests/gpu_compile_check.py
"""
from __future__ import annotations

import inspect
import os

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kvstrata.kernels import batch_invariant, block_copy, kv_store, layer_ops, prefix_prefill
from kvstrata.kernels.triton_compat import triton_kernel

TARGET = GPUTarget("cuda", 90, 32)


def compile_for_gpu(kernel, pointer_types: dict[str, str], constexprs: dict[str, object], scalar_type="i32") -> None:
    """Compile `kernel` with the given pointer element types; other lower-case parameters are `scalar_type`."""
    signature = {}
    for name in inspect.signature(kernel.fn).parameters:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in pointer_types:
            signature[name] = "*" + pointer_types[name]
        else:
            signature[name] = "fp32" if name in ("qk_scale", "eps") else scalar_type
    triton.compile(ASTSource(fn=triton_kernel(kernel), signature=signature, constexprs=constexprs), target=TARGET)


def main() -> None:
    assert os.environ.get("TRITON_INTERPRET", "0") in ("", "0"), "unset TRITON_INTERPRET to compile for a GPU"
    metadata = {"block_tables_ptr": "i32", "query_start_loc_ptr": "i32", "seq_lens_ptr": "i32"}
    variants = [  # (dtype, cache dtype, GQA group, BLOCK_M, TILE_N, head dim, block size): SmolLM2 prefill,
        ("bf16", "bf16", tl.bfloat16, 3, 64, 64, 64, 16),  # Llama decode, fp8 and int8 caches (kv_cache_dtype)
        ("fp32", "fp32", tl.float32, 4, 16, 32, 128, 8),
        ("bf16", "fp8e4nv", tl.bfloat16, 3, 64, 64, 64, 16),
        ("bf16", "i8", tl.bfloat16, 3, 64, 64, 64, 16),
        ("fp32", "i8", tl.float32, 4, 16, 32, 128, 8),
    ]
    for dtype, cache_dtype, dot_dtype, group, block_m, tile_n, head_dim, block_size in variants:
        tensors = {"query_ptr": dtype, "cache_ptr": cache_dtype, "out_ptr": dtype, **metadata}
        # (split, batch-invariant): the single pass, split-KV, and the batch-invariant mode's aligned fixed splits
        for split, invariant in ((False, False), (True, False), (True, True)):
            scratch = {"partial_out_ptr": "fp32", "partial_lse_ptr": "fp32"} if split else {
                "partial_out_ptr": dtype, "partial_lse_ptr": dtype}
            compile_for_gpu(prefix_prefill._prefix_prefill_kernel, {**tensors, **scratch}, {
                "BLOCK_SIZE": block_size, "GROUP": group, "BLOCK_Q": block_m // group, "BLOCK_M": block_m,
                "TILE_N": tile_n, "HEAD_DIM": head_dim, "DOT_DTYPE": dot_dtype,
                "DOT_PRECISION": "ieee" if dot_dtype == tl.float32 else "tf32", "SPLIT": split,
                "FIXED_TILES_PER_SPLIT": prefix_prefill.INVARIANT_KEYS_PER_SPLIT // tile_n if invariant else 0,
                "ALIGNED": invariant, "SCALED": cache_dtype == "i8"})
    for dtype in ("bf16", "fp32"):
        compile_for_gpu(prefix_prefill._merge_splits_kernel, {
            "out_ptr": dtype, "partial_out_ptr": "fp32", "partial_lse_ptr": "fp32"}, {"CHUNK": 1024})
    for dtype, dot_dtype, has_bias in (("bf16", tl.bfloat16, False), ("fp32", tl.float32, True)):
        compile_for_gpu(batch_invariant._linear_kernel, {
            "x_ptr": dtype, "weight_ptr": dtype, "bias_ptr": dtype, "out_ptr": dtype}, {
            "HAS_BIAS": has_bias, "BLOCK_M": batch_invariant.LINEAR_BLOCK_M, "BLOCK_N": batch_invariant.LINEAR_BLOCK_N,
            "BLOCK_K": batch_invariant.LINEAR_BLOCK_K, "DOT_DTYPE": dot_dtype,
            "DOT_PRECISION": "ieee" if dot_dtype == tl.float32 else "tf32"})
    compile_for_gpu(batch_invariant._mean_last_dim_kernel, {"x_ptr": "fp32", "out_ptr": "fp32"},
                    {"BLOCK": batch_invariant.MEAN_BLOCK})
    for dtype, cache_dtype, bound in (("bf16", "bf16", 0.0), ("bf16", "fp8e4nv", 448.0), ("fp32", "fp8e5", 57344.0),
                                      ("bf16", "i8", 0.0), ("fp32", "i8", 0.0)):
        compile_for_gpu(kv_store._store_kv_kernel, {"key_ptr": dtype, "value_ptr": dtype, "cache_ptr": cache_dtype,
                                                    "slot_ptr": "i64"},
                        {"HEADS": 4, "HEAD_DIM": 64, "BOUND": bound, "SCALED": cache_dtype == "i8"})
    for gather in (True, False):
        compile_for_gpu(block_copy._copy_blocks_kernel, {"src_ptr": "bf16", "dst_ptr": "bf16",
                                                         "src_index_ptr": "i64", "dst_index_ptr": "i64"},
                        {"GATHER": gather, "CHUNK": 4096}, scalar_type="i64")
    for dtype in ("bf16", "fp16", "fp32"):  # the decoder's fused layer parts: SmolLM2's widths, Llama-3-8B's heads
        for has_residual in (True, False):
            compile_for_gpu(layer_ops._rms_norm_kernel, {"x_ptr": dtype, "residual_ptr": dtype, "weight_ptr": dtype,
                                                          "out_ptr": dtype, "summed_ptr": dtype},
                            {"HAS_RESIDUAL": has_residual, "BLOCK": 1024})
        compile_for_gpu(layer_ops._rotary_kernel, {"x_ptr": dtype, "cos_ptr": dtype, "sin_ptr": dtype, "out_ptr": dtype},
                        {"HALF": 64, "HEADS": 64, "HALF_BLOCK": 64})
        compile_for_gpu(layer_ops._silu_and_mul_kernel, {"x_ptr": dtype, "out_ptr": dtype}, {"BLOCK": 1024})
    print("all kernels compiled for", TARGET)


if __name__ == "__main__":
    main()
