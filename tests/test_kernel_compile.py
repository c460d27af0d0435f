"""Every Triton kernel variant compiles for an H100 (sm_90) on a machine without a GPU: the other kernel
tests run Triton's CPU interpreter, which accepts code that the compiler rejects."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def test_every_kernel_compiles_for_sm90():
    script = Path(__file__).with_name("kernel_compile_check.py")
    done = subprocess.run([sys.executable, str(script)], env={**os.environ, "TRITON_INTERPRET": "0"},
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert done.stdout.count("compiled ") == 124  # every variant the script names, none skipped


def test_every_kernel_waits_for_the_one_before_and_is_launched_so():
    """Each Triton kernel's programs first wait for the kernel before (``wait_for_inputs``) and each launch asks for
    the dependent launch (``launch_pdl``, kernels/launch.py): a kernel launched early that read its inputs before
    waiting would read them unfinished, and one launched without it waits as before (no overlap)."""
    import ast

    kernels, launches = [], []
    for path in sorted((Path(__file__).parents[1] / "tokenselect" / "kernels").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name.endswith("_kernel"):
                body = [s for s in node.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
                first = body[0]
                kernels.append(node.name)
                assert (isinstance(first, ast.Expr) and isinstance(first.value, ast.Call)
                        and getattr(first.value.func, "id", None) == "wait_for_inputs"), f"{path.name}: {node.name}"
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript)
                    and getattr(node.func.value, "id", "").endswith("_kernel")):
                launches.append(node.func.value.id)
                assert any(k.arg == "launch_pdl" for k in node.keywords), f"{path.name}: {node.func.value.id}"
    assert len(kernels) == 27 and len(launches) == 29  # every kernel and launch site was seen
