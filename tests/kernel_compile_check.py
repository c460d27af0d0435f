"""Compile every Triton kernel variant the engine launches for an H100 (sm_90), without a GPU.

Run by tests/test_kernel_compile.py in a process of its own with TRITON_INTERPRET=0: the CPU interpreter
that the other kernel tests use accepts code that the compiler rejects, and CI has no GPU. Triton's
wheel carries ptxas, so this goes down to a cubin. Prints one line per kernel; exits non-zero on the first
failure.
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

assert os.environ.get("TRITON_INTERPRET") == "0", "run with TRITON_INTERPRET=0"

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
import triton.language.target_info as target_info  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
from kernel_sass import resource_usage  # noqa: E402  (benchmarks/: a cubin's registers and spills)

H100 = GPUTarget("cuda", 90, 32)


def compiling_device():
    """The H100, as the device a kernel is compiled for (what ``target_info`` asks the driver for on a GPU)."""
    return H100


compiling_device.__triton_builtin__ = True  # callable from the compiler, as the function it stands in for
target_info.current_target = compiling_device
mods = {m: importlib.import_module(f"tokenselect.kernels.{m}") for m in
        ("paged_dot", "paged_argmax", "head_vote", "sparse_attention", "rms_norm", "silu_mul", "selection_check",
         "selection_update", "topk", "window_mass", "row_copy", "block_scores", "page_bounds", "query_mean",
         "cudnn_attention", "fp8_quant", "fp8_product")}


def compile_one(module: str, kernel: str, signature: dict, constexprs: dict, aligned: tuple = (), **options):
    """Compile one variant; ``aligned`` names the arguments specialized as multiples of 16 (a launch's pointers and
    strides, as Triton specializes them at run time). Checks that its programs wait for the kernel before
    (``kernels.launch.wait_for_inputs``: each is launched before that one has finished). Returns the compiled
    kernel."""
    fn = getattr(mods[module], kernel)
    signature = {**signature, **{name: "constexpr" for name in constexprs}}
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in aligned}
    compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs), target=H100,
                              options=options)
    assert "griddepcontrol.wait" in compiled.asm["ptx"], f"{kernel} does not wait_for_inputs() (kernels/launch.py)"
    print(f"compiled {kernel} {constexprs}", flush=True)
    return compiled


def main() -> None:
    i32, f32, i64p = "i32", "fp32", "*i64"
    for kv, dot, ieee in (("bf16", tl.bfloat16, False), ("fp8e4nv", tl.float16, False), ("fp32", tl.float32, True)):
        q = "fp32" if ieee else "bf16"
        # (a prefill chunk's groups of queries folded into one tile over their shared slot list: FOLDED, up to
        # MAX_GROUP_ROWS query rows), at the tile scores_with_stats launches for those rows
        for stats, masked, folded, rows in ((True, True, False, 16), (True, False, False, 16), (False, False, False, 16),
                                            (True, True, True, 16), (True, True, True, 32), (True, True, True, 64)):
            block_n, warps, blocks, stages = mods["paged_dot"].scores_tile(rows, ieee)
            compiled = compile_one("paged_dot", "_scores_kernel", {
                "q_ptr": f"*{q}", "k_ptr": f"*{kv}", "slot_ptr": i64p, "out_ptr": "*fp32", "m_ptr": "*fp32",
                "l_ptr": "*fp32", "n_valid_ptr": i64p, "N": i32, "G": i32, "n_kv": i32, "n_blocks": i32, "scale": f32,
                "stride_slot": i32, "stride_kvh": i32, "stride_qb": i32, "stride_slot_row": i32, "stride_valid": i32,
                "fold": i32, "stride_out": i32},
                {"D": 128, "D_P": 128, "BLOCK_G": rows, "BLOCK_N": block_n, "BLOCKS": blocks, "DOT_TY": dot,
                 "IEEE": ieee, "STATS": stats, "MASKED": masked, "FOLDED": folded},
                aligned=("q_ptr", "k_ptr", "slot_ptr", "out_ptr", "m_ptr", "l_ptr", "n_valid_ptr", "stride_slot",
                         "stride_kvh", "stride_qb"),
                num_warps=warps, num_stages=stages)
            if not ieee:  # on one warp, 64 folded rows spilled 336 bytes a thread
                spilled = resource_usage(compiled.asm["cubin"])["STACK"]
                assert spilled == 0, f"the scores kernel spills {spilled} bytes a thread at {rows} rows over {kv} keys"
        argmax = mods["paged_argmax"]
        for tile in ((argmax.FP32_ARGMAX_TILE,) if ieee else (argmax.ARGMAX_TILE, argmax.FEW_ROWS_ARGMAX_TILE)):
            block_r, block_n, warps, stages = tile
            compile_one("paged_argmax", "_argmax_kernel", {
                "q_ptr": f"*{q}", "k_ptr": f"*{kv}", "slot_ptr": i64p, "best_ptr": "*fp32", "where_ptr": i64p,
                "n_valid_ptr": i64p, "N": i32, "per_kv": i32, "keys_per_split": i32, "stride_slot": i32,
                "stride_kvh": i32},
                {"D": 128, "D_P": 128, "BLOCK_R": block_r, "BLOCK_N": block_n, "DOT_TY": dot, "IEEE": ieee,
                 "MASKED": True}, num_warps=warps, num_stages=stages)
        for live in (False, True):  # the whole list, or its first *n_valid_ptr entries
            attention = mods["sparse_attention"]
            for rotated, split, tile in ((False, True, attention.FP32_DECODE_TILE if ieee else attention.DECODE_TILE),
                                         (True, False, attention.FP32_CHUNK_TILE if ieee else attention.CHUNK_TILE)):
                block_r, block_n, warps, stages = tile
                compile_one("sparse_attention", "_sparse_attention_kernel", {
                    "q_ptr": f"*{q}", "k_ptr": f"*{q if rotated else kv}", "v_ptr": f"*{kv}", "slot_ptr": i64p,
                    "kpos_ptr": i64p, "qpos_ptr": i64p, "inv_freq_ptr": "*fp32",
                    "out_ptr": f"*{'fp32' if split else q}", "m_ptr": "*fp32", "l_ptr": "*fp32", "n_valid_ptr": i64p,
                    "C": i32, "N": i32, "G": i32, "H": i32, "keys_per_split": i32, "rope_scale": f32, "qk_scale": f32,
                    "k_stride_row": i32, "k_stride_kvh": i32, "v_stride_slot": i32, "v_stride_kvh": i32,
                    "row_blocks": i32, "slot_stride_b": i32, "kpos_stride_b": i32, "inv_stride_b": i32,
                    "k_stride_b": i32, "q_stride_tok": i32, "qpos_stride_b": i32},
                    {"HALF": 64, "HALF_P": 64, "D_P": 128, "BLOCK_R": block_r, "BLOCK_N": block_n, "DOT_TY": dot,
                     "IEEE": ieee, "ROTATED": rotated, "SPLIT": split, "LIVE": live}, num_warps=warps,
                    num_stages=stages)
            # the Triton path's keys (a graph's live prefix or the whole list); without one, cuDNN's path: the keys
            # with the values gathered, and the queries (their own rows)
            cudnn_path = ((False, True), (True, False)) if not live and not ieee else ()
            for direct, gather_v in ((False, False),) + cudnn_path:
                compile_one("sparse_attention", "_rotate_keys_kernel", {
                    "k_ptr": f"*{q if direct else kv}", "slot_ptr": i64p, "kpos_ptr": i64p, "inv_freq_ptr": "*fp32",
                    "out_ptr": f"*{q}", "n_valid_ptr": i64p, "N": i32, "n_kv": i32, "rope_scale": f32,
                    "k_stride_slot": i32, "k_stride_kvh": i32, "slot_stride_b": i32, "kpos_stride_b": i32,
                    "inv_stride_b": i32, "k_stride_b": i32, "v_ptr": f"*{kv}", "v_out_ptr": f"*{q}",
                    "v_stride_slot": i32, "v_stride_kvh": i32},
                    {"HALF": 64, "HALF_P": 64, "LIVE": live, "DIRECT": direct, "GATHER_V": gather_v,
                     "BLOCK_N": mods["sparse_attention"].QUERY_ROTATE_BLOCK if direct
                     else mods["sparse_attention"].ROTATE_BLOCK})
        block_r, block_n, warps, stages = mods["window_mass"].FP32_TILE if ieee else mods["window_mass"].TILE
        compile_one("window_mass", "_window_mass_kernel", {
            "q_ptr": f"*{q}", "k_ptr": f"*{kv}", "slot_ptr": i64p, "out_ptr": "*fp32", "C": i32, "N": i32, "W": i32,
            "n_local": i32, "G": i32, "H": i32, "qk_scale": f32, "k_stride_slot": i32, "k_stride_kvh": i32},
            {"D": 128, "D_P": 128, "G_P": 4, "BLOCK_R": block_r, "BLOCK_N": block_n, "DOT_TY": dot, "IEEE": ieee},
            num_warps=warps, num_stages=stages)
    for out in ("*bf16", "*fp16"):  # cuDNN's two parts of a chunk merged into the engine's rows
        compile_one("cudnn_attention", "_merge_kernel", {
            "a_ptr": out, "la_ptr": "*fp32", "b_ptr": out, "lb_ptr": "*fp32", "out_ptr": out, "C": i32, "H": i32,
            "D": i32, **{f"{x}_s{i}": i32 for x in ("a", "b", "la", "lb", "o") for i in range(3)}},
            {"BLOCK_C": 32, "D_P": 128})
    compile_one("sparse_attention", "_merge_kernel", {
        "acc_ptr": "*fp32", "m_ptr": "*fp32", "l_ptr": "*fp32", "out_ptr": "*bf16", "rows": i32, "splits": i32},
        {"D": 128, "D_P": 128, **dict(zip(("BLOCK_S", "BLOCK_ROWS"), mods["sparse_attention"].merge_tile(128)))})
    block_scores = mods["block_scores"]
    for masked in (True, False):  # InfLLM's fp32 representatives, a graph's live prefix or all of them
        compile_one("block_scores", "_block_scores_kernel", {
            "rows_ptr": "*fp32", "index_ptr": i64p, "query_ptr": "*fp32", "out_ptr": "*fp32", "n_valid_ptr": i64p,
            "n": i32, "K": i32, "stride_row": i32},
            {"BLOCK_B": block_scores.BLOCK_B, "BLOCK_K": block_scores.BLOCK_K, "MASKED": masked})
    for q in ("*fp32", "*bf16"):  # QUEST hands its fp32 selection query; the kernel reads any float dtype
        for has_n_valid in (False, True):  # QUEST passes its live pages; without them every page is scored
            compile_one("page_bounds", "_page_scores_kernel", {
                "q_ptr": q, "lo_ptr": "*fp32", "hi_ptr": "*fp32", "row_ptr": i64p, "tail_lo_ptr": "*fp32",
                "tail_hi_ptr": "*fp32", "tail_at_ptr": i64p, "n_valid_ptr": i64p, "out_ptr": "*fp32", "P": i32,
                "n_kv": i32, "group": i32, "d": i32, "stride_row": "i64", "stride_page": i32, "stride_kvh": i32},
                {"HAS_N_VALID": has_n_valid, "BLOCK_P": mods["page_bounds"].BLOCK_P, "D_P": 128})
    for masked in (True, False):
        compile_one("head_vote", "_head_totals_kernel", {
            "m_ptr": "*fp32", "l_ptr": "*fp32", "m_out_ptr": "*fp32", "inv_l_out_ptr": "*fp32", "n_valid_ptr": i64p,
            "n_blocks": i32, "block_n": i32, "n_heads": i32, "stride_valid": i32}, {"BLOCK": 1024, "MASKED": masked})
        compile_one("head_vote", "_vote_kernel", {
            "s_ptr": "*fp32", "m_ptr": "*fp32", "inv_l_ptr": "*fp32", "out_ptr": "*fp32", "n_valid_ptr": i64p,
            "H": i32, "N": i32, "stride_valid": i32, "stride_s": i32}, {"BLOCK_H": 32, "BLOCK_N": 128, "MASKED": masked})
    for dt in ("bf16", "fp32"):
        for add in (False, True):
            compile_one("rms_norm", "_rms_norm_kernel", {
                "x_ptr": f"*{dt}", "add_ptr": f"*{dt}", "sum_ptr": f"*{dt}", "w_ptr": f"*{dt}", "out_ptr": f"*{dt}",
                "dim": i32, "eps": f32}, {"BLOCK": 4096, "ADD": add}, num_warps=8)
        compile_one("silu_mul", "_silu_mul_kernel", {"x_ptr": f"*{dt}", "out_ptr": f"*{dt}", "width": i32,
                                                     "row_stride": i32}, {"BLOCK": 1024})
    fp8 = mods["fp8_product"]
    for dt in ("bf16", "fp16", "fp32"):  # an fp8 projection's input, in the model's dtype
        compile_one("fp8_quant", "_quantize_rows_kernel", {"x_ptr": f"*{dt}", "q_ptr": "*fp8e4nv",
                                                          "scale_ptr": "*fp32", "K": i32},
                    {"BLOCK": mods["fp8_quant"].BLOCK}, num_warps=8)
        for block_m, (block_n, block_k, warps, stages) in fp8.TILES.items():
            for bias, partial in ((False, False), (True, False), (False, True)) if block_m == 16 else ((False, False),):
                compile_one("fp8_product", "_fp8_weight_product_kernel", {
                    "x_ptr": f"*{dt}", "w_ptr": "*fp8e4nv", "scale_ptr": "*fp32", "bias_ptr": f"*{dt}",
                    "out_ptr": "*fp32" if partial else f"*{dt}", "M": i32, "N": i32, "K": i32, "K_PART": i32},
                    {"HAS_BIAS": bias, "PARTIAL": partial, "BLOCK_M": block_m, "BLOCK_N": block_n,
                     "BLOCK_K": block_k, "IEEE": dt == "fp32"}, aligned=("x_ptr", "w_ptr", "out_ptr", "K", "K_PART"),
                    num_warps=warps, num_stages=stages)
        for bias in (False, True):
            compile_one("fp8_product", "_sum_parts_kernel", {
                "parts_ptr": "*fp32", "scale_ptr": "*fp32", "bias_ptr": f"*{dt}", "out_ptr": f"*{dt}", "MN": i32,
                "N": i32}, {"PARTS": 4, "HAS_BIAS": bias, "BLOCK": fp8.SUM_BLOCK}, aligned=("parts_ptr", "out_ptr"))
    qm = mods["query_mean"]
    for dt, out in (("bf16", "bf16"), ("bf16", "fp32"), ("fp32", "fp32")):
        compile_one("query_mean", "_query_mean_kernel", {
            "q_ptr": f"*{dt}", "out_ptr": f"*{out}", "C": i32, "WIDTH": i32, "inv_c": f32, "stride_b": i32,
            "stride_tok": i32}, {"BLOCK_ROWS": qm.BLOCK_ROWS, "BLOCK_COLS": qm.BLOCK_COLS},
            aligned=("q_ptr", "out_ptr", "WIDTH", "stride_b", "stride_tok"))  # (4,096 columns: vector loads)
    topk = {"scores_ptr": "*fp32", "state_ptr": "*i32", "n_valid_ptr": i64p}
    for masked in (True, False):
        for p in range(4):
            compile_one("topk", "_histogram_kernel", {**topk, "N": i32, "k": i32, "stride_s": i32, "stride_valid": i32},
                        {"PASS": p, "BLOCK": 2048, "MASKED": masked})
        compile_one("topk", "_count_kernel", {**topk, "counts_ptr": "*i32", "N": i32, "k": i32, "n_blocks": i32,
                                              "stride_s": i32, "stride_valid": i32},
                    {"BLOCK": 2048, "MASKED": masked})
        for gather in (True, False):
            compile_one("topk", "_write_kernel", {**topk, "counts_ptr": "*i32", "values_ptr": i64p, "out_ptr": i64p,
                                                  "N": i32, "k": i32, "n_blocks": i32, "stride_s": i32,
                                                  "stride_valid": i32, "stride_values": i32, "stride_out": i32},
                        {"BLOCK": 2048, "BLOCK_C": 1024, "MASKED": masked, "GATHER": gather})
    for q in ("*bf16", "*fp32"):  # a decode graph's own query, an eager step's fp32 mean
        for candidates, word in ((True, i64p), (False, "*u8")):  # without: the miss flag's pointer stands in
            compile_one("selection_check", "_selection_check_kernel", {
                "q_ptr": q, "unit_ptr": "*fp32", "valid_ptr": "*u8", "row_ptr": i64p, "counts_ptr": i64p,
                "miss_ptr": "*u8", "live_ptr": word, "cand_ptr": word, "layer": i32, "n_layers": i32, "n": i32,
                "theta": f32, "stride_q": i32, "stride_row": i32, "stride_live": i32, "stride_cand": i32},
                {"EPS": 1e-8, "BLOCK": 1024, "CANDIDATES": candidates})
        compile_one("selection_update", "_selection_update_kernel", {
            "q_ptr": q, "unit_ptr": "*fp32", "sel_ptr": i64p, "valid_ptr": "*u8", "row_ptr": i64p, "new_ptr": i64p,
            "miss_ptr": "*u8", "out_ptr": i64p, "layer": i32, "n_layers": i32, "n": i32, "width": i32,
            "stride_q": i32, "stride_row": i32, "stride_new": i32, "stride_out": i32},
            {"EPS": 1e-8, "BLOCK": 1024})
    for word in ("*i64", "*i32"):  # the slot table's entries; other values a row
        compile_one("row_copy", "_gather_into_kernel", {"src_ptr": word, "index_ptr": i64p, "out_ptr": word, "n": i32,
                                                        "src_stride": i32, "src_row": i32, "index_row": i32,
                                                        "out_row": i32, "out_stride": i32},
                    {"BLOCK": mods["row_copy"].GATHER_BLOCK})
    for word in ("*i32", "*u8"):
        compile_one("row_copy", "_gather_kernel", {"src_ptr": word, "dst_ptr": word, "index_ptr": i64p, "n": i32,
                                                   "words": i32}, {"BLOCK_R": 16, "BLOCK_W": 256})
        compile_one("row_copy", "_stage_kernel", {"pool_ptr": word, "kept_ptr": word, "kept_slot_ptr": i64p,
                                                  "row_of_ptr": "*i32", "index_ptr": i64p, "out_ptr": word,
                                                  "counts_ptr": i64p, "n": i32, "words": i32},
                    {"BLOCK_R": 16, "BLOCK_W": 256})
        compile_one("row_copy", "_keep_kernel", {"out_ptr": word, "index_ptr": i64p, "kept_ptr": word,
                                                 "kept_slot_ptr": i64p, "row_of_ptr": "*i32", "m": i32, "words": i32},
                    {"BLOCK_R": 16, "BLOCK_W": 256})
    pair = {"src": "*i32", "dst": "*i32", "stride": i32, "words": i32}  # K and V as words, the fp8 copy as bytes
    pairs = {f"{name}{i}": ("*u8" if i == 2 and name in ("src", "dst") else t) for i in range(3) for name, t in pair.items()}
    for n_pairs, forget in ((1, False), (2, False), (3, False), (2, True), (3, True)):  # with value offload: FORGET
        compile_one("row_copy", "_scatter_kernel", {"index_ptr": i64p, "n": i32, **pairs, "forget_ptr": "*i32"},
                    {"PAIRS": n_pairs, "FORGET": forget, "BLOCK_R": 16, "BLOCK_W": 256})

if __name__ == "__main__":
    main()
    sys.exit(0)
