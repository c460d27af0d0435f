"""Tensor parallelism across the GPUs of one host (or of several, under torchrun): one process per rank.

Every rank holds a shard of the model and runs its own copy of the engine in lockstep (``engine.LLM``): rank 0
takes the requests, and once per step broadcasts what changed since the last one (requests added or aborted,
``set_attention``, ...: ``Lockstep``) to the other ranks, which apply it in the same order; the scheduler is
deterministic, so every rank then schedules the same batch, allocates the same slots in its own pool and runs its
shard of the model. Rank 0 samples and broadcasts the tokens, so the ranks never diverge.

The model (``shard_tensor``, ``parallelize``): q, k, v and gate, up are split along their outputs (by heads:
rank r holds query heads [r * H/N, (r+1) * H/N) and kv heads [r * K/N, (r+1) * K/N)), o_proj and down_proj along
their inputs, each followed by an all-reduce (their biases on rank 0 alone), and the embedding and the head by
vocabulary (the embedding's rows outside a rank's part read as zeros, then an all-reduce; the head's logits
all-gathered). The config a rank's model sees has H/N heads, K/N kv heads and intermediate/N, so the KV pool, the
attention and the policies run unchanged on the rank's heads.

Policies reduce over heads where they choose tokens (TokenSelect's head vote and its Selection Cache's cosine,
ReAttention's votes, QUEST's best head, InfLLM's block scores): ``HeadReduce`` makes that reduction span every rank
(``tp_selection="global"``, the default: the choice equals one GPU's), or leaves it to each rank's own heads
(``"local"``).

Processes: ``LLM(..., tensor_parallel_size=N)`` in a process that torchrun did not start spawns ranks 1..N-1 itself
(``spawn``, a free port of 127.0.0.1); under torchrun (``WORLD_SIZE`` = N in the environment) every process joins
the group torchrun set up, and ranks other than 0 serve rank 0 inside ``LLM(...)`` and exit when it closes. The
tensors go through NCCL on CUDA and gloo on a CPU; the per-step messages through a gloo group either way.
"""

from __future__ import annotations

import atexit
import dataclasses
import datetime
import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

log = logging.getLogger("tokenselect.parallel")
SELECTIONS = ("global", "local")  # ``HeadReduce``'s modes (EngineSettings.tp_selection)
STARTUP_TIMEOUT = datetime.timedelta(minutes=10)  # the tensor group's collectives (loading a model included)
IDLE_TIMEOUT = datetime.timedelta(days=365)  # the message group: ranks wait there while a server idles
JOIN_SECONDS = 30  # a rank's process gets this long to exit after the stop message


# ---- the model's shards ---------------------------------------------------------------------------

def check_shape(cfg, world: int) -> None:
    """ValueError where the model cannot be split ``world`` ways (an int > 1, as ``EngineSettings`` checks)."""
    for what, n in (("attention heads", cfg.n_heads), ("kv heads", cfg.n_kv_heads),
                    ("intermediate size", cfg.intermediate_size)):
        if n % world:
            raise ValueError(f"tensor_parallel_size {world} does not divide the model's {n} {what}")


def local_config(cfg, world: int):
    """The config a rank's model is built with: its share of the heads, kv heads, MLP and vocabulary."""
    return dataclasses.replace(cfg, n_heads=cfg.n_heads // world, n_kv_heads=cfg.n_kv_heads // world,
                               intermediate_size=cfg.intermediate_size // world,
                               vocab_size=-(-cfg.vocab_size // world))


COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # split along outputs (dim 0)
ROW = ("o_proj", "down_proj")  # split along inputs (dim 1)
VOCAB = ("embed_tokens", "lm_head")  # split by vocabulary rows, the last part padded with zero rows


def shard_tensor(name: str, tensor: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s part of the checkpoint tensor ``name`` (Hugging Face names)."""
    *_, module, leaf = ["", *name.split(".")]  # ...q_proj.weight -> q_proj, weight
    if module in COLUMN:
        return tensor.chunk(world, dim=0)[rank].contiguous() if tensor.shape[0] % world == 0 else _bad(name, tensor)
    if module in ROW:
        if leaf == "bias":  # added once, after the all-reduce sums the ranks' parts
            return tensor if rank == 0 else torch.zeros_like(tensor)
        return tensor.chunk(world, dim=1)[rank].contiguous() if tensor.shape[1] % world == 0 else _bad(name, tensor)
    if module in VOCAB:
        part = -(-tensor.shape[0] // world)
        rows = tensor[rank * part:(rank + 1) * part]
        if rows.shape[0] < part:
            rows = torch.cat([rows, rows.new_zeros(part - rows.shape[0], *rows.shape[1:])])
        return rows.contiguous()
    return tensor  # norms: every rank holds them whole


def _bad(name: str, tensor: torch.Tensor):
    raise ValueError(f"{name} of shape {tuple(tensor.shape)} does not split evenly across the ranks")


class RowParallelLinear(nn.Linear):
    """A rank's columns of o_proj / down_proj: its partial product, summed over the ranks."""

    tp: "TensorParallel"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)
        dist.all_reduce(out, group=self.tp.group)
        return out


class VocabParallelEmbedding(nn.Embedding):
    """A rank's rows of the vocabulary; a token outside them reads zeros, and the ranks' rows are summed."""

    tp: "TensorParallel"

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.tp.rank * self.num_embeddings
        outside = (local < 0) | (local >= self.num_embeddings)
        out = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill_(outside[:, None], 0)
        dist.all_reduce(out, group=self.tp.group)
        return out


class VocabParallelHead(nn.Linear):
    """A rank's rows of the output head; every rank's logits gathered: [n, vocab]."""

    tp: "TensorParallel"
    vocab: int

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        part = F.linear(x, self.weight).contiguous()
        parts = [torch.empty_like(part) for _ in range(self.tp.world)]
        dist.all_gather(parts, part, group=self.tp.group)
        return torch.cat(parts, dim=-1)[..., :self.vocab]


def parallelize(model: nn.Module, tp: "TensorParallel", vocab: int) -> None:
    """Turn a model built with ``local_config``'s shapes into its rank's shard (before its weights load): the
    row-parallel projections all-reduce, the embedding and the head work by vocabulary."""
    for module in model.modules():
        for name, child in module.named_children():
            kind = (RowParallelLinear if name in ROW else VocabParallelHead if name == "lm_head"
                    else VocabParallelEmbedding if name == "embed_tokens" else None)
            if kind is not None:
                child.__class__ = kind
                child.tp = tp
                if kind is VocabParallelHead:
                    child.vocab = vocab


# ---- selection across ranks ----------------------------------------------------------------------

class HeadReduce:
    """The reduction over heads that a policy's choice makes, spanning every rank's heads (``global``) or not
    (``local``, and a single process): ``sum`` and ``max`` of a per-token (or per-block) score, in place."""

    def __init__(self, group=None, world: int = 1):
        self.group, self.world = group, world

    @property
    def spans_ranks(self) -> bool:
        return self.group is not None and self.world > 1

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        if self.spans_ranks:
            dist.all_reduce(t, group=self.group)
        return t

    def max(self, t: torch.Tensor) -> torch.Tensor:
        if self.spans_ranks:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return t


NO_REDUCE = HeadReduce()  # a single process, or rank-local selection


# ---- the process group ------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def under_torchrun(world: int) -> bool:
    """Whether torchrun (or another launcher that sets RANK and WORLD_SIZE) started this process as one of
    ``world`` ranks."""
    return "RANK" in os.environ and os.environ.get("WORLD_SIZE") == str(world)


def leads(world: int) -> bool:
    """Whether this process is rank 0 of ``world``: the one a user started (it spawns the others), or torchrun's
    rank 0 (under torchrun every rank runs the user's command)."""
    return not under_torchrun(world) or os.environ["RANK"] == "0"


class TensorParallel:
    """This process's place among the ranks: ``rank``, ``world``, ``device``, the tensor ``group`` (NCCL or gloo)
    and the message group (gloo); on an engine-spawned rank 0, its child processes."""

    def __init__(self, rank: int, world: int, device: torch.device, children=()):
        self.rank, self.world, self.device = rank, world, device
        self.group = dist.group.WORLD
        self.messages = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
        # a first collective now, eagerly: NCCL sets up its communicator here rather than inside a graph's capture
        dist.all_reduce(torch.zeros(1, device=device), group=self.group)
        self.children = list(children)
        self.closed = False
        self.lock = threading.Lock()  # a step's collectives against ``close`` from another thread
        for child in self.children:
            threading.Thread(target=self._watch, args=(child,), name="tokenselect-tp-watch", daemon=True).start()

    def reduce(self, selection: str) -> HeadReduce:
        """The policies' reduction over heads for ``tp_selection`` (``SELECTIONS``; ``EngineSettings`` checks it)."""
        return HeadReduce(self.group, self.world) if selection == "global" else NO_REDUCE

    def broadcast(self, obj=None):
        """Rank 0's ``obj`` on every rank (through the message group)."""
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.messages)
        return box[0]

    def min(self, n: int) -> int:
        """The smallest of every rank's ``n`` (e.g. the KV pool's size, which every rank must share)."""
        t = torch.tensor([n], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.messages)
        return int(t)

    def close(self) -> None:
        """Every rank, once no step follows (rank 0 after ``Lockstep``'s stop message, which the engine sends first;
        the others on receiving it): leave the group, then, on rank 0, wait for the processes it spawned. Leaving
        comes first because NCCL's communicator teardown is collective: each rank's ``destroy_process_group`` waits
        for the others' (a rank 0 that waited for its children to exit first would wait for ever)."""
        if self.closed:
            return
        self.closed = True
        leave_group(JOIN_SECONDS)
        for child in self.children:
            try:
                child.wait(JOIN_SECONDS)
            except subprocess.TimeoutExpired:
                log.warning("tensor-parallel rank process %s did not exit; terminating it", child.pid)
                child.terminate()
                try:
                    child.wait(5)
                except subprocess.TimeoutExpired:
                    child.kill()

    def abandon(self) -> None:
        """Rank 0 failed while starting: end the processes it spawned and leave the group (without them: NCCL's
        teardown may wait for ranks that are gone, so it gets a few seconds)."""
        self.closed = True
        for child in self.children:
            child.kill()
            child.wait(5)
        leave_group(5)

    def _watch(self, child: subprocess.Popen) -> None:
        """Rank 0 of spawned ranks: a rank that dies leaves the others waiting in a collective for ever, so this
        process ends too (its other ranks with it), with the reason in the log."""
        code = child.wait()
        if not self.closed:
            log.critical("tensor-parallel rank process %s exited (code %s); stopping: the other ranks cannot go on "
                         "without it", child.pid, code)
            for other in self.children:
                if other.poll() is None:
                    other.kill()
            os._exit(1)


def leave_group(seconds: float) -> None:
    """``destroy_process_group``, given ``seconds``: it waits for every other rank to leave too (NCCL), which a rank
    that died never does; then this process goes on without it, and the group's resources go with the process."""
    def destroy():
        try:
            dist.destroy_process_group()
        except Exception:  # already gone (the interpreter is exiting)
            pass

    leaving = threading.Thread(target=destroy, name="tokenselect-tp-leave", daemon=True)
    leaving.start()
    leaving.join(seconds)
    if leaving.is_alive():
        log.warning("the other tensor-parallel ranks did not leave the group within %s s; leaving without them", seconds)


def rank_device(device_type: str, local_rank: int) -> torch.device:
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device(device_type)


def _init(rank: int, world: int, device_type: str, init_method: str | None, local_rank: int) -> torch.device:
    """Join the tensor group as ``rank``, on the host's device ``local_rank``; returns that device."""
    device = rank_device(device_type, local_rank)
    kwargs = dict(backend="nccl" if device_type == "cuda" else "gloo", timeout=STARTUP_TIMEOUT)
    if init_method is None:
        dist.init_process_group(**kwargs)  # env://: torchrun's MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE
    else:
        dist.init_process_group(**kwargs, init_method=init_method, rank=rank, world_size=world)
    return device


def start(world: int, device_type: str, build: tuple) -> TensorParallel | None:
    """This process's ``TensorParallel`` for ``world`` ranks (None for 1: nothing is initialised). Under torchrun
    it joins torchrun's group; otherwise, as rank 0, it spawns ranks 1..world-1, each of which builds its engine
    with ``build`` (``worker_main``). A process already in a group (a spawned rank) reuses it."""
    if world == 1:
        return None
    if _spawned:  # a spawned rank: ``worker_main`` joined before building its engine
        rank = dist.get_rank()
        return TensorParallel(rank, world, rank_device(device_type, int(os.environ.get("LOCAL_RANK", rank))))
    if device_type == "cuda" and world > torch.cuda.device_count() and not under_torchrun(world):
        raise ValueError(f"tensor_parallel_size {world} exceeds the {torch.cuda.device_count()} GPU(s) of this host "
                         "(several hosts: start every rank with torchrun, docs/tensor_parallel.md)")
    if dist.is_initialized():
        raise RuntimeError("this process is already in a torch.distributed group (another tensor-parallel engine "
                           "still open?): one at a time per process; close the other first (LLM.close())")
    if under_torchrun(world):
        rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", 0))
        return TensorParallel(rank, world, _init(rank, world, device_type, None, local))
    if device_type == "cpu":  # the ranks share the host's cores
        torch.set_num_threads(max(1, torch.get_num_threads() // world))
    address = f"tcp://127.0.0.1:{free_port()}"
    # each rank a fresh interpreter that imports tokenselect alone (not multiprocessing's spawn, which re-runs the
    # caller's main script: a script without a ``__main__`` guard, or one read from stdin, would not start)
    package_root = str(Path(__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))}
    children = []
    for rank in range(1, world):
        child = subprocess.Popen([sys.executable, "-c", "from tokenselect.parallel import worker_entry; worker_entry()"],
                                 stdin=subprocess.PIPE, env=env)
        child.stdin.write(pickle.dumps((rank, world, device_type, address, build, os.getpid())))
        child.stdin.close()
        children.append(child)
    try:
        device = _init(0, world, device_type, address, 0)
    except BaseException:
        for child in children:
            child.kill()
        raise
    tp = TensorParallel(0, world, device, children)
    atexit.register(tp.close)
    return tp


_spawned = False  # whether this process is a rank that ``start`` spawned (``worker_main``)


def _exit_with_parent(parent: int) -> None:
    """A spawned rank whose rank 0 has gone (killed, so that its own exit could not stop it) exits too."""
    while True:
        time.sleep(1)
        if os.getppid() != parent:
            os._exit(1)


def worker_entry() -> None:
    """A spawned rank's process: its arguments come pickled on stdin (``start``)."""
    worker_main(*pickle.loads(sys.stdin.buffer.read()))


def worker_main(rank: int, world: int, device_type: str, address: str, build: tuple, parent: int) -> None:
    """A spawned rank: join the group, build the engine as rank 0 did (``build``: the engine's constructor and
    its arguments), serve rank 0's steps until it stops, exit."""
    global _spawned
    _spawned = True
    threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True).start()
    # Ctrl-C in a terminal reaches every process of the group: rank 0 stops the others itself (``LLM.close``)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if device_type == "cpu":  # the ranks share the host's cores
        torch.set_num_threads(max(1, torch.get_num_threads() // world))
    _init(rank, world, device_type, address, rank)
    make, args, kwargs = build
    make(*args, **kwargs)  # serves rank 0 until it stops, then raises SystemExit (``LLM._start``)
