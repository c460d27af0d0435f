"""The device operations of one decode step of a policy (InfLLM by default), per layer, counted on a CPU.

A whole-step CUDA graph replays every device op its step function issued while it was recorded, so the GPU time
of a graph-captured decode step follows the ops (and their shapes) the step function runs, not the host's Python.
This runs that step function on the CPU (``cuda_graphs=True`` on a CPU runs the graph's step function eagerly over
the graph's buffers: ``GraphCache``, or ``WholeGraphs`` before #29) for a tiny random bf16 model (3 layers) with
the policy selecting, and records with ``TorchDispatchMode`` every aten op of one decode step, with its shapes:

- ``model``: the layers around attention (norms, projections, MLP, by their PyTorch ops: on a GPU RMS norm and
  silu * up are one Triton kernel each), the same in every tree;
- ``kv write``: the step's keys and values into the pool (two ``index_put_`` on a CPU, one Triton scatter on a GPU);
- ``policy``: the policy's list for the layer (its ``attend``; ``graph_list`` or ``plan`` before #29), outside
  kernels;
- ``kernel``: each call of a ``Kernels`` method (paged_dot, block_scores, topk, sparse_attention, ...). With
  ``--kernels torch`` (default) a call counts as one device op, whatever its PyTorch reference does on a CPU (its
  ops are left out); with ``--kernels triton`` the Triton kernels run in Triton's CPU interpreter and every launch
  and every op of the launcher (zeroed histograms...) is counted, as a GPU runs them (slow: about a minute).

View ops (``view``, ``slice``, ``select``, ``t``, ``expand``, an ``to`` that changes nothing...: no kernel) and
allocations (``empty*``: no kernel) are counted apart; every other aten op is a device kernel (a node of the
graph). Ops that the layers share (``SeqStep.once``: the list, its positions, masks) are made by the first layer
that asks, so layer 0 holds them (once a step) and layer 1 and later show the steady per-layer cost. ``outside``
is the step's work outside the whole-step function (preparing, the logits, sampling: not in the graph).

Run it in a checkout (whichever ``tokenselect`` Python imports; point PYTHONPATH at another tree to count that
one's, e.g. ``git worktree add /tmp/before 8e96f1f``):

    python tools/op_count.py                                   # InfLLM: table per layer, this tree (selecting)
    python tools/op_count.py --ops 1                           # and layer 1's ops in order, with shapes
    python tools/op_count.py --kernels triton --ops 1          # every Triton launch too
    python tools/op_count.py --set positions=reindex           # another InfLLM setting
    python tools/op_count.py --context 300                     # inside the threshold: every token (ALL)
    python tools/op_count.py --policy tokenselect --set theta=-1   # TokenSelect's Selection Cache hit
    python tools/op_count.py --policy tokenselect --set theta=None # ... and a step that selects (no cache)
    python tools/op_count.py --policy tokenselect --batch 8        # 8 sequences decoding together
    python tools/op_count.py --json /tmp/now.json
    PYTHONPATH=/tmp/before python tools/op_count.py --json /tmp/before.json
    python tools/op_count.py --compare /tmp/before.json /tmp/now.json    # per-layer diff of two runs

It also says whether the step ran through the whole-step function at all (``whole step: no``: the engine took the
piecewise graphs and eager attention for it, the policy not graph-ready there). Results:
benchmarks/results/supporting/infllm_decode_ops.md (as ``tools/infllm_op_count.py``, InfLLM only then),
benchmarks/results/supporting/tokenselect_decode_ops.md.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import difflib
import json
import os
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# a tiny Llama-3-shaped model (tokenselect/bench/e2e.py's TINY, 3 layers) and each policy at its defaults'
# proportions, small enough for a CPU: InfLLM's k = n_local = 32 blocks, n_init one block; TokenSelect's k = 256 of
# the middle, sinks and window as its 128 + 512 of a 2048 budget
CONFIG = {"architectures": ["LlamaForCausalLM"], "vocab_size": 8192, "hidden_size": 128, "intermediate_size": 256,
          "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
          "max_position_embeddings": 1024, "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": False}
# dense_until=0: selecting from the policy's own threshold on, as past a real model's window (the tiny model's
# window, 1024, would otherwise make the counted step attend everything)
SETTINGS = {"infllm": dict(k=256, n_init=8, n_local=256, block_size=8, repr_keys=4, dense_until=0),
            "tokenselect": dict(k=256, n_init=16, n_local=64, dense_until=0)}
ALLOC = {"aten::empty", "aten::empty_strided", "aten::empty_like", "aten::new_empty", "aten::new_empty_strided",
         "aten::lift_fresh"}


def _shapes(x) -> list:
    if isinstance(x, torch.Tensor):
        return [list(x.shape)]
    if isinstance(x, (list, tuple)):
        return [s for item in x for s in _shapes(item)]
    return []


def _tensors(x) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for item in x for t in _tensors(item)]
    if isinstance(x, dict):
        return _tensors(list(x.values()))
    return []


def _is_view(func, args, kwargs, out) -> bool:
    """An op whose output aliases an input without writing it (a view: no kernel). Ops that may alias or copy
    (``to``, ``reshape``, ``flatten``, ``contiguous``) count as views only where they did alias."""
    returns = func._schema.returns
    if not returns or not all(r.alias_info is not None and not r.alias_info.is_write for r in returns):
        return False
    inputs = {t.untyped_storage().data_ptr() for t in _tensors([args, kwargs])}
    return all(t.untyped_storage().data_ptr() in inputs for t in _tensors(out))


class Recorder(TorchDispatchMode):
    """Every aten op while ``on``, tagged with the current layer and region; ops inside a kernel call are not
    recorded (the call is, once)."""

    def __init__(self):
        super().__init__()
        self.on, self.layer, self.regions, self.inside_kernel = False, None, ["model"], 0
        self.ops: list[dict] = []
        self.host_reads = 0

    def add(self, kind: str, name: str, shapes, out_shapes, region: str | None = None) -> None:
        self.ops.append({"layer": self.layer, "region": region or self.regions[-1], "kind": kind, "op": name,
                         "in": shapes, "out": out_shapes})

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.on and not self.inside_kernel:
            name = func._schema.name
            if name == "aten::_local_scalar_dense":
                self.host_reads += 1
            kind = "view" if _is_view(func, args, kwargs, out) else "alloc" if name in ALLOC else "op"
            overload = func._overloadname
            self.add(kind, name + ("" if overload in ("", "default") else "." + overload),
                     _shapes(args) + _shapes(list((kwargs or {}).values())), _shapes(out))
        return out

    @contextlib.contextmanager
    def region(self, name: str):
        self.regions.append(name)
        try:
            yield
        finally:
            self.regions.pop()


def _wrap_method(cls, name: str, make):
    original = getattr(cls, name)
    setattr(cls, name, make(original))


def instrument(rec: Recorder, llm) -> dict:
    """Patch the engine's classes so that ``rec`` knows the layer, the region and the kernel calls. Returns what
    the step function counted (``whole``: steps that ran as a whole step)."""
    import tokenselect.kernels as kernels_module
    from tokenselect.kv_cache import KVCache
    from tokenselect.models.llama import DecoderLayer

    seen = {"whole": 0}
    new_api = hasattr(llm, "runner")
    if new_api:
        from tokenselect.cuda_graphs import _WholeStep as Whole
        # a batch's lists (``attend_batch``, which may call ``attend`` for each sequence: nested, one region)
        policy_methods = ("attend", "attend_batch") if hasattr(type(llm.policy), "attend_batch") else ("attend",)
    else:  # before #29: a graph step's list (``graph_list``), an eager step's plan (``plan``)
        from tokenselect.whole_graphs import _GraphStep as Whole
        policy_methods = ("graph_list", "plan")

    def forward(original):
        def run(self, *a, **k):
            seen["whole"] += 1
            outside, rec.layer = rec.layer, "pre"
            try:
                return original(self, *a, **k)
            finally:
                rec.layer = outside
        return run
    _wrap_method(Whole, "forward", forward)

    def attention_inputs(original):
        def run(self, *a, **k):
            rec.layer = self.self_attn.layer
            return original(self, *a, **k)
        return run
    _wrap_method(DecoderLayer, "attention_inputs", attention_inputs)

    def in_region(region):
        def make(original):
            def run(*a, **k):
                with rec.region(region):
                    return original(*a, **k)
            return run
        return make
    _wrap_method(KVCache, "write", in_region("kv write"))
    for method in policy_methods:
        _wrap_method(type(llm.policy), method, in_region("policy"))

    triton = llm.kernels.name == "triton"
    for kern in kernels_module.KERNELS.values():
        for f in dataclasses.fields(kern):
            fn = getattr(kern, f.name)
            if not callable(fn):
                continue

            def call(*a, _fn=fn, _name=f.name, **k):
                if not rec.on or rec.inside_kernel or rec.regions[-1] == "kernel":
                    return _fn(*a, **k)
                rec.add("kernel", "kernel:" + _name, _shapes(list(a)) + _shapes(list(k.values())), None)
                entry = rec.ops[-1]
                # the PyTorch references' ops are not what a GPU runs: left out; the Triton launchers' own ops
                # (allocations, zeroed buffers, copies) are, and their launches
                rec.inside_kernel += not triton
                try:
                    with rec.region("kernel"):
                        out = _fn(*a, **k)
                finally:
                    rec.inside_kernel -= not triton
                entry["out"] = _shapes(out)
                return out
            object.__setattr__(kern, f.name, call)
    if triton:
        from triton.runtime.interpreter import InterpretedFunction

        def launch(original):
            def run(self, *a, grid, warmup, **k):
                if rec.on and not rec.inside_kernel and not warmup:
                    ints = [x for x in list(a) + list(k.values()) if isinstance(x, int) and not isinstance(x, bool)]
                    rec.add("launch", "triton:" + self.fn.__name__, _shapes(list(a)), None)
                    rec.ops[-1]["ints"] = ints
                rec.inside_kernel += 1  # the interpreter's own tensor work
                try:
                    return original(self, *a, grid=grid, warmup=warmup, **k)
                finally:
                    rec.inside_kernel -= 1
            return run
        _wrap_method(InterpretedFunction, "run", launch)
    return seen


def count(context: int, decode_steps: int, settings: dict, kernels: str = "torch", name: str = "infllm",
          batch: int = 1) -> dict:
    from tokenselect import LLM, SamplingParams

    llm = LLM.random(CONFIG, name, device="cpu", dtype="bfloat16", kernels=kernels, cuda_graphs=True,
                     chunk_size=256, kv_cache_tokens=batch * (context + decode_steps + 64), **settings)
    rec = Recorder()
    seen = instrument(rec, llm)
    gen = torch.Generator().manual_seed(0)
    seqs = [llm.add_request(torch.randint(2, CONFIG["vocab_size"], (context,), generator=gen).tolist(),
                            SamplingParams(max_tokens=decode_steps + 8 + 4 * batch, ignore_eos=True))
            for _ in range(batch)]  # (the first decode while the later prompts are prefilled: none may finish)
    seq = seqs[0]
    while any(s.prefilling for s in seqs):  # every prompt in before the decode steps, which then run together
        llm.step()
    for _ in range(decode_steps):  # decode steps before the one counted (the graph of this capacity exists)
        llm.step()
    rec.ops.clear()
    t = seq.n_cached
    before, stats = seen["whole"], llm.policy.stats()
    with rec:
        rec.on, rec.layer = True, "outside"
        llm.step()
        rec.on = False
    policy = llm.policy
    return {"tokenselect": sys.modules["tokenselect"].__file__, "context": t, "policy": name, "settings": settings,
            "kernels": kernels, "step_stats": {} if stats is None else dataclasses.asdict(policy.stats() - stats),  # the step's
            "mode": policy.mode(t, 1) if hasattr(policy, "mode") else None,
            "graph_ready": policy.graph_ready(t, 1), "whole_step": seen["whole"] > before,
            "layers": CONFIG["num_hidden_layers"], "batch": batch, "host_reads": rec.host_reads, "ops": rec.ops}


# ---- reports -----------------------------------------------------------------------------------------------------

def _counts(run: dict, layer) -> dict:
    c = collections.Counter()
    for op in run["ops"]:
        if op["layer"] == layer:
            c[op["region"], op["kind"]] += 1
    kernel_ops = c["kernel", "op"] + c["kernel", "launch"] if run.get("kernels") == "triton" else \
        sum(n for (_, kind), n in c.items() if kind == "kernel")
    out = {"policy": c["policy", "op"] + c["policy", "launch"], "kernel calls": sum(n for (_, kind), n in c.items() if kind == "kernel"),
           "kernel device ops": kernel_ops, "kv write": c["kv write", "op"] + c["kv write", "launch"],
           "model": c["model", "op"] + c["model", "launch"],
           "views": sum(n for (_, kind), n in c.items() if kind == "view"),
           "allocs": sum(n for (_, kind), n in c.items() if kind == "alloc")}
    out["device ops"] = out["policy"] + out["kernel device ops"] + out["kv write"]
    return out


COLUMNS = ("policy", "kernel calls", "kernel device ops", "kv write", "device ops", "model", "views", "allocs")


def summary(run: dict) -> str:
    lines = [f"tokenselect: {run['tokenselect']} (kernels: {run.get('kernels', 'torch')})",
             f"{run.get('batch', 1)} sequence(s) decoding, context {run['context']} tokens, mode {run['mode']}, "
             f"graph_ready {run['graph_ready']}, "
             f"whole step: {'yes' if run['whole_step'] else 'no'}, host reads in the step: {run['host_reads']}",
             f"{run.get('policy', 'infllm')} settings: {run['settings']}"
             + "".join(f"; the step's {key.replace('_', ' ')}: {n}" for key, n in run.get("step_stats", {}).items()
                       if n), "",
             "| layer | " + " | ".join(COLUMNS) + " |", "|---" * (len(COLUMNS) + 1) + "|"]
    for layer in ["outside", "pre"] + list(range(run["layers"])):
        c = _counts(run, layer)
        lines.append(f"| {layer} | " + " | ".join(str(c[k]) for k in COLUMNS) + " |")
    lines.append("\ndevice ops = policy (its own ops, and the launches of kernels it holds outside ``Kernels``: the "
                 "Selection Cache's check and update) + kernel device ops (a Kernels call as one op with the PyTorch references; "
                 "with Triton, its launches and its launcher's own ops) + kv write; 'outside' = the step's work "
                 "outside the whole-step function (not in a graph); 'pre' = the embedding")
    return "\n".join(lines)


def device_ops(run: dict, layer, regions=("policy", "kernel", "kv write", "model")) -> list[str]:
    """The layer's device ops in order (views and allocations left out), as 'region: op in -> out'."""
    out = []
    for op in run["ops"]:
        if op["layer"] == layer and op["kind"] in ("op", "kernel", "launch") and op["region"] in regions:
            region = "call" if op["kind"] == "kernel" else op["region"]
            ints = f" ints={op['ints']}" if "ints" in op else ""
            out.append(f"{region:8s} {op['op']} {op['in']} -> {op['out']}{ints}")
    return out


def compare(a: dict, b: dict) -> str:
    lines = [f"A: {a['tokenselect']} (context {a['context']})", f"B: {b['tokenselect']} (context {b['context']})"]
    for layer in ["outside"] + list(range(min(a["layers"], b["layers"]))):
        ops_a = device_ops(a, layer, ("policy", "kernel", "kv write"))
        ops_b = device_ops(b, layer, ("policy", "kernel", "kv write"))
        ca, cb = _counts(a, layer), _counts(b, layer)
        lines.append(f"\n## layer {layer}: {ca['device ops']} -> {cb['device ops']} device ops, policy "
                     f"{ca['policy']} -> {cb['policy']}, model {ca['model']} -> {cb['model']}")
        lines += [line for line in difflib.unified_diff(ops_a, ops_b, "A", "B", n=0, lineterm="")
                  if not line.startswith(("---", "+++"))]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--policy", choices=sorted(SETTINGS), default="infllm", help="the policy counted (default infllm)")
    p.add_argument("--context", type=int, default=600, help="prompt tokens before the counted decode step (InfLLM "
                   "selects past 8 + 263 + 256 = 527, TokenSelect past 16 + 256 + 64 = 336)")
    p.add_argument("--decode-steps", type=int, default=2, help="decode steps run before the counted one")
    p.add_argument("--batch", type=int, default=1, help="sequences decoding together in the counted step (each with "
                   "a prompt of --context tokens)")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="the policy's settings over the "
                   f"defaults {SETTINGS} (e.g. positions=reindex; theta=None, a number or an integer)")
    p.add_argument("--ops", nargs="*", default=[], help="print these layers' device ops in order, with shapes")
    p.add_argument("--kernels", choices=("torch", "triton"), default="torch",
                   help="torch: the PyTorch references, each call counted as one op; triton: the Triton kernels in "
                        "Triton's CPU interpreter (slow), every launch and launcher op counted, as a GPU runs them")
    p.add_argument("--json", help="write the run (every op) here")
    p.add_argument("--compare", nargs=2, metavar=("A", "B"), help="diff two --json runs per layer; runs nothing")
    args = p.parse_args(argv)
    if args.compare:
        a, b = (json.load(open(path)) for path in args.compare)
        print(summary(a), summary(b), compare(a, b), sep="\n\n")
        return 0
    settings = dict(SETTINGS[args.policy])
    for item in args.set:
        key, _, value = item.partition("=")
        settings[key] = None if value == "None" else int(value) if value.lstrip("-").isdigit() else \
            float(value) if value.lstrip("-").replace(".", "", 1).isdigit() else value
    if args.kernels == "triton":  # before tokenselect.kernels is imported (``kernels/__init__.py``)
        os.environ["TRITON_INTERPRET"] = "1"
    torch.manual_seed(0)
    run = count(args.context, args.decode_steps, settings, args.kernels, args.policy, args.batch)
    print(summary(run))
    for layer in args.ops:
        layer = layer if layer in ("pre", "outside") else int(layer)
        print(f"\n## layer {layer}: device ops in order (views and allocations left out)")
        print("\n".join(device_ops(run, layer)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(run, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
