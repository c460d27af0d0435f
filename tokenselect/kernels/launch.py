"""Programmatic dependent launch: on Hopper and later GPUs each of our kernels is launched while the kernel before
it in the stream is still running, so that the time between two kernels (the launch, the programs' set-up) overlaps
the earlier kernel's tail. A decode step runs about 700 kernels, with about 0.4 ms between them of an 8 x 32K step
(``benchmarks/results/supporting/batch_decode_profile_8x32k_h200.md``).

Each kernel's programs begin with ``wait_for_inputs()``: they wait there until the kernel before has finished and
its writes are visible, so nothing a kernel reads or overwrites is touched early, and only then let the next kernel
launch. Waiting before anything else keeps the order transitive: a kernel that passed its wait knows that every
earlier kernel has finished. A kernel launched without the attribute (an older GPU; PyTorch's and cuBLAS's kernels)
starts after its predecessor as usual, and the wait in a kernel launched without it returns at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .dot import INTERPRETED


@triton.jit
def wait_for_inputs():
    """Wait for the kernel before to finish, then let the next one launch (nothing before sm_90, whose kernels
    cannot be launched so, and nothing in the CPU interpreter, which runs one kernel at a time and has no inline
    assembly). The compiling device's capability decides, as it does the rest of the kernel's code."""
    if not INTERPRETED and tl.target_info.cuda_capability_geq(9, 0):
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


def dependent(x: torch.Tensor) -> bool:
    """Whether a kernel over ``x`` is launched dependent on the one before (``launch_pdl``): on NVIDIA GPUs of
    compute capability 9.0 and later (not on ROCm, whose devices PyTorch also calls "cuda")."""
    return x.is_cuda and torch.version.hip is None and torch.cuda.get_device_capability(x.device)[0] >= 9
