"""Recording CUDA graphs: the one way the engine, its whole-step graphs and the dense baseline record one.

``record(fn, pool)`` runs ``fn`` once on a side stream (lazy initialisation, cuBLAS workspaces, Triton
compiles happen outside the capture; its result is the eager reference a caller may check the replay
against), then captures it into a graph whose replay reruns the same kernels on the same buffers.

``GraphPool`` is the memory pool graphs of one owner share (graphs that replay one after another can share
their intermediates). A pool in which a recorded graph has been dropped is not captured into again: PyTorch
2.11's caching allocator failed capturing into the pool of dropped graphs with "use_count > 0 INTERNAL ASSERT
FAILED at CUDACachingAllocator.cpp" (under ``bench e2e --profile-steps``; and recording whole-step graphs of
a new length at 32K/64K, where the old length's graphs were dropped), so a new pool is taken instead.
"""

from __future__ import annotations

import weakref
from typing import Callable

import torch


def warm_up(fn: Callable):
    """fn() on a side stream, the current stream waiting for it: what a capture needs to have run once."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        out = fn()
    torch.cuda.current_stream().wait_stream(stream)
    return out


class GraphPool:
    """A graph memory pool, renewed once a graph recorded into it has died."""

    def __init__(self):
        self.handle = torch.cuda.graph_pool_handle()
        self._graphs: weakref.WeakSet = weakref.WeakSet()  # the graphs recorded into ``handle``, while alive
        self._recorded = 0

    def take(self, graph: torch.cuda.CUDAGraph):
        """The pool handle to capture ``graph`` into."""
        if len(self._graphs) < self._recorded:
            self.handle = torch.cuda.graph_pool_handle()
            self._graphs, self._recorded = weakref.WeakSet(), 0
        self._graphs.add(graph)
        self._recorded += 1
        return self.handle


def capture(fn: Callable, pool: GraphPool | None) -> tuple[torch.cuda.CUDAGraph, object]:
    """(graph, fn's output tensors as the capture left them: what each replay rewrites). thread_local: another
    thread's CUDA calls (the server's /health reading counters) neither fail nor spoil the capture."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=None if pool is None else pool.take(graph), capture_error_mode="thread_local"):
        out = fn()
    return graph, out
