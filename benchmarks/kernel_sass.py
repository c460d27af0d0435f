"""Compile the scores kernel for a GPU without one, and count the instructions of its loop over key blocks.

    python benchmarks/kernel_sass.py [OUTDIR] [--variant shipped|no-stats|real-rows|plain-exp|keys-as-a|real-rows-plain-exp] [--keys fp8|bf16] [--arch 90]

Triton compiles for any NVIDIA target on a machine without a GPU (its own ptxas and cuobjdump come with it). The
kernel is specialized as a decode step's launch specializes it at run time (pointers and the strides that are
multiples of 16 marked so: without that, Triton cannot vectorize the key loads and the code is another kernel's).
Prints the loop's instruction histogram (the largest backward branch's body), the instructions a thread issues
for each key, and the registers a thread with the programs an SM they allow (the kernel is bound by the keys its
programs have in flight); writes the TTGIR, PTX and SASS to OUTDIR when given.
"""

from __future__ import annotations

import argparse
import collections
import importlib
import re
import subprocess
import tempfile
from pathlib import Path

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

# (benchmarks/: this script's folder)
from scores_epilogue_gpu import KEYS_AS_A, PLAIN_EXP, REAL_ROWS, edited_kernel

paged_dot = importlib.import_module("tokenselect.kernels.paged_dot")
VARIANTS = {"shipped": [], "no-stats": [], "real-rows": REAL_ROWS, "plain-exp": PLAIN_EXP, "keys-as-a": KEYS_AS_A,
            "real-rows-plain-exp": REAL_ROWS + PLAIN_EXP}  # each variant's edits of the shipped kernel
MULTIPLES_OF_16 = ["q_ptr", "k_ptr", "slot_ptr", "out_ptr", "m_ptr", "l_ptr", "n_valid_ptr", "N", "n_blocks",
                   "stride_slot", "stride_kvh", "stride_qb", "stride_out"]


def compile_scores(kernel, keys: str, stats: bool, arch: int, extra: dict):
    """The compiled kernel for 32 query heads, 8 kv heads, d 128, one sequence, the live length on the device."""
    signature = {"q_ptr": "*bf16", "k_ptr": "*fp8e4nv" if keys == "fp8" else "*bf16", "slot_ptr": "*i64",
                 "out_ptr": "*fp32", "m_ptr": "*fp32", "l_ptr": "*fp32", "n_valid_ptr": "*i64", "N": "i32", "G": "i32",
                 "n_kv": "i32", "n_blocks": "i32", "scale": "fp32", "stride_slot": "i32", "stride_kvh": "i32",
                 "stride_qb": "i32", "stride_slot_row": "constexpr", "stride_valid": "i32", "fold": "i32",
                 "stride_out": "i32"}
    block_n, warps, blocks, stages = paged_dot.SCORES_TILE
    constants = {"D": 128, "D_P": 128, "BLOCK_G": 16, "BLOCK_N": block_n, "BLOCKS": blocks,
                 "DOT_TY": tl.float16 if keys == "fp8" else tl.bfloat16, "IEEE": False, "STATS": stats,
                 "MASKED": True, "FOLDED": False, "stride_slot_row": 0, **extra}
    signature.update({name: "constexpr" for name in constants})
    attrs = {(kernel.arg_names.index(name),): [["tt.divisibility", 16]] for name in MULTIPLES_OF_16}
    return triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constants, attrs=attrs),
                          target=GPUTarget("cuda", arch, 32), options={"num_warps": warps, "num_stages": stages})


def cuobjdump(cubin: bytes, what: str) -> str:
    """``cuobjdump WHAT`` of a cubin (-sass, -res-usage), by the cuobjdump that comes with Triton."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        return subprocess.run([str(tool), what, str(path)], capture_output=True, text=True, check=True).stdout


def sass_of(cubin: bytes) -> str:
    """The SASS of a cubin."""
    return cuobjdump(cubin, "-sass")


def resource_usage(cubin: bytes) -> dict[str, int]:
    """A cubin's kernel's resources a thread (REG, STACK: bytes spilled, LOCAL, ...), as cuobjdump reports them."""
    return {name: int(n) for name, n in re.findall(r"(\w+):(\d+)", cuobjdump(cubin, "-res-usage").split("Function")[-1])}


def loop_histogram(sass: str) -> tuple[int, collections.Counter]:
    """(instructions, histogram of opcodes without modifiers) of the largest loop: the body between a backward
    branch and its target."""
    code = [(int(m.group(1), 16), m.group(2), m.group(3)) for m in
            re.finditer(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);", sass)]
    spans = [(int(t.group(1), 16), at) for at, op, rest in code if op.startswith("BRA")
             for t in [re.search(r"0x([0-9a-f]+)", rest)] if t and int(t.group(1), 16) < at]
    if not spans:
        return 0, collections.Counter()
    first, last = max(spans, key=lambda s: s[1] - s[0])
    body = [op.split(".")[0] for at, op, _ in code if first <= at <= last]
    return len(body), collections.Counter(body)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", nargs="?", help="folder for the TTGIR, PTX and SASS")
    parser.add_argument("--variant", choices=list(VARIANTS), default="shipped")
    parser.add_argument("--keys", choices=["fp8", "bf16"], default="fp8")
    parser.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90 for an H100 or H200")
    args = parser.parse_args()
    edits = VARIANTS[args.variant]
    kernel = edited_kernel(edits) if edits else paged_dot._scores_kernel
    extra = {"G_P": 4} if "rows" in args.variant else {}
    compiled = compile_scores(kernel, args.keys, args.variant != "no-stats", args.arch, extra)
    sass = sass_of(compiled.asm["cubin"])
    if args.out:
        workdir = Path(args.out)
        workdir.mkdir(parents=True, exist_ok=True)
        for ext in ("ttgir", "ptx"):
            (workdir / f"scores.{ext}").write_text(compiled.asm[ext])
        (workdir / "scores.sass").write_text(sass)
    n, histogram = loop_histogram(sass)
    block_n, warps = paged_dot.SCORES_TILE[0], paged_dot.SCORES_TILE[1]
    print(f"{args.variant}, {args.keys} keys, sm_{args.arch}: {n} instructions a thread a block of {block_n} keys "
          f"({n * warps * 32 / block_n:.0f} a key), shared memory {compiled.metadata.shared} B")
    print(", ".join(f"{op} {count}" for op, count in histogram.most_common()))
    regs = resource_usage(compiled.asm["cubin"])["REG"]
    by_regs, by_shared = programs_an_sm(regs, compiled.metadata.shared, warps)
    print(f"{regs} registers a thread: {by_regs} programs an SM by registers, {by_shared} by shared memory")


# an sm_90 SM: 64K registers, allocated 256 a warp at a time; 228 KB of shared memory, of which each program
# reserves 1 KB; at most 64 warps
SM_REGISTERS, REGISTER_UNIT, SM_SHARED, PROGRAM_SHARED, SM_WARPS = 65536, 256, 233472, 1024, 64


def programs_an_sm(regs: int, shared: int, warps: int) -> tuple[int, int]:
    """(programs an SM allows by its registers, by its shared memory): where registers allow fewer, a register more
    a thread costs the kernel programs in flight (the scores kernel is bound by the keys it has in flight)."""
    per_warp = -(-regs * 32 // REGISTER_UNIT) * REGISTER_UNIT
    by_regs = min(SM_REGISTERS // (per_warp * warps), SM_WARPS // warps)
    return by_regs, SM_SHARED // (shared + PROGRAM_SHARED)


if __name__ == "__main__":
    main()
