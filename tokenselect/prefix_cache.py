"""The prefix cache: KV slots of prompts already computed, indexed by their token ids, for later requests
that start with the same tokens (many questions over one document, a chat's turns).

A radix tree over token ids (the KV pool's page is one token, so matches are token-exact, as in SGLang's
radix cache): an edge holds a run of tokens and the pool slots of their keys and values. A request looks up
the longest cached prefix of its prompt, takes those slots as its own first entries and starts its prefill
after them. Nodes a running sequence uses are locked (a count per node, held along the path to the root);
unlocked nodes are evicted least recently used first, a leaf's tokens from its end, when the pool needs room.

What may be reused depends on how the keys and values were computed (``reuse_rule``, from the policy's
``prefix_reuse``):

- the tree has one root per *namespace*: the attention policy and all its settings. Past layer 0 a token's
  K and V depend on what the layers below attended, so KV computed under one policy (or k, n_local, ...)
  is not the KV another would compute. The pool's dtype, offload and RoPE are fixed for an engine.
- the *grain*: a match is cut to a multiple of it. A selective policy chooses per prefill chunk with the
  chunk's mean query (and StreamingLLM's window, and dynamic NTK's frequencies, follow the chunk's end), so
  the KV of a prompt is the same only if the chunks start at the same tokens: grain = the prefill chunk
  (TokenSelect's query groups where they divide it, ``prefix_grain``: each group chooses alone).
  Full attention computes each query row alone: grain 1. So only whole chunks are shared: a sequence gives the
  cache nothing past cached tokens that end inside a chunk (another prompt's chunk: its KV is not this one's),
  nor its ``tail_chunk`` (chunked unlike a longer prompt there; ``Scheduler._cacheable``).
- *state*: InfLLM's memory (block representatives chosen by the attention the prompt's *queries* gave inside the
  local window) is not in the keys and values. Its policy (``prefix_state``) snapshots a sequence's memory at
  chosen chunk boundaries of its prompt (``Scheduler.computed``); the node that ends there keeps it (``Node.state``)
  and a match for such a policy ends only at a node with a snapshot of the sequence's policy instance, which the
  sequence's memory then starts from. A snapshot goes with its node's tokens when they are evicted, and the
  least recently used go first when they hold more than ``max_state_bytes``.
- *generated tokens*: a finished sequence's prompt and answer are cached where a decode step's KV is what a
  prefill of the same tokens computes (the policy's ``generated_reuse``: full attention at grain 1), so that a
  chat's next turn reuses the previous answer too.

Invariant the scheduler keeps with ``locked_tokens``: the slots running sequences may still need, plus the
locked tokens, fit in the pool, so that eviction of unlocked nodes can always make room for them.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import Hashable

import torch

from .kv_cache import KVCache
from .policies import POLICIES

STATE_SHARE = 16  # policy snapshots may hold at most this share (1/16) of the KV pool's bytes by default

@dataclass(frozen=True)
class Reuse:
    """How one sequence may share prompt KV: namespace (policy and settings), grain (a match's multiple)."""

    namespace: Hashable
    grain: int
    stateful: bool = False  # the policy's per-sequence state goes with the prefix (``Node.state``)
    generated: bool = False  # generated tokens are cached too


def reuse_rule(attention: str, settings: dict, rope_kind: str, chunk: int) -> Reuse | None:
    """The ``Reuse`` of a sequence run by policy ``attention`` with ``settings`` (the engine's and the
    request's own), or None where its prompt's KV may not be shared (the policy's ``prefix_reuse``)."""
    policy = POLICIES[attention]
    if policy.prefix_reuse is None:
        return None
    if rope_kind == "dynamic":  # dynamic NTK's frequencies: each chunk's end
        grain = chunk
    else:
        grain = 1 if policy.prefix_reuse == "token" else policy.prefix_grain(settings, chunk)
    return Reuse((attention, repr(sorted(settings.items()))), grain, policy.prefix_state,
                 policy.generated_reuse and grain == 1)


@dataclass(eq=False)
class Node:
    """An edge of the tree and the node below it. key: token ids; slots: [len(key)] int64, their pool slots.
    locks: running sequences whose prefix runs through this node; used: when it was last matched (a clock)."""

    key: list[int]
    slots: torch.Tensor
    parent: Node | None = None
    children: dict[int, Node] = field(default_factory=dict)  # by the child's first token
    locks: int = 0
    used: int = 0
    depth: int = 0  # tokens from the root to the end of this node
    state: object = None  # the policy's snapshot at this node's end (``prefix_state`` policies), or None


def common_length(a: list[int], b: list[int]) -> int:
    """Length of the common prefix of two token lists (the whole-run comparison is one C loop)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    return next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)


class PrefixCache:
    """The tree of cached prompt prefixes over the slots of ``cache``. Counters: ``cached_tokens`` (tokens
    held), ``locked_tokens`` (held for running sequences), ``hit_tokens`` (prompt tokens served from here
    instead of computed), ``evicted_tokens``, ``state_bytes`` (what the policies' snapshots hold, at most
    ``max_state_bytes``: a sixteenth of the KV pool's bytes)."""

    def __init__(self, cache: KVCache):
        self.cache = cache
        self._roots: dict[Hashable, Node] = {}
        self._clock = itertools.count(1)
        self.cached_tokens = self.locked_tokens = self.hit_tokens = self.evicted_tokens = 0
        pool = 2 * cache.k.numel() * cache.k.element_size()
        self.max_state_bytes = pool // STATE_SHARE
        self.state_bytes = 0
        self._states: dict[Node, int] = {}  # the nodes with a snapshot -> its bytes

    @property
    def evictable_tokens(self) -> int:
        return self.cached_tokens - self.locked_tokens

    def root(self, namespace: Hashable) -> Node:
        if namespace not in self._roots:
            self._roots[namespace] = Node([], self.cache.k.new_empty(0, dtype=torch.int64))
        return self._roots[namespace]

    # ---- lookup -------------------------------------------------------------------------------

    def match(self, start: Node, tokens: list[int], limit: int, grain: int, state_of=None) -> Node:
        """The deepest node below ``start`` (a root, or a node the caller holds) along ``tokens`` (the whole
        prompt: token i is at depth i), at most ``limit`` deep and at a multiple of ``grain`` (or ``start``'s
        own depth); a node is split so that one ends exactly there. With ``state_of`` (a policy instance): the
        deepest such node whose snapshot that instance made (or ``start``)."""
        node, depth = start, start.depth
        stated = start
        while depth < limit:  # how far the cached tokens go
            child = node.children.get(tokens[depth])
            if child is None:
                break
            n = common_length(child.key, tokens[depth:depth + len(child.key)])
            depth += n
            if n < len(child.key):
                break
            node = child
            if child.depth <= limit and child.depth % grain == 0 and getattr(child.state, "owner", None) is state_of:
                stated = child
        if state_of is not None:
            return stated
        target = max(min(depth, limit) // grain * grain, start.depth)
        node = start
        while node.depth < target:
            child = node.children[tokens[node.depth]]
            if child.depth > target:
                child = self._split(child, target - node.depth)
            node = child
        return node

    def slots(self, node: Node, above: Node | None = None) -> torch.Tensor:
        """The slots of the tokens from ``above`` (an ancestor; default the root) down to ``node``, [n] int64."""
        parts = []
        while node is not above and node.parent is not None:
            parts.append(node.slots)
            node = node.parent
        if not parts:
            return self.cache.k.new_empty(0, dtype=torch.int64)
        return torch.cat(parts[::-1]) if len(parts) > 1 else parts[0]

    def unlocked_tokens(self, node: Node) -> int:
        """Tokens on the path to ``node`` that no sequence holds: what locking it adds to ``locked_tokens``."""
        n = 0
        while node.parent is not None and node.locks == 0:
            n, node = n + len(node.key), node.parent
        return n

    # ---- holding ------------------------------------------------------------------------------

    def lock(self, node: Node) -> None:
        """A running sequence uses the path to ``node``: none of it is evicted until ``unlock``."""
        now = next(self._clock)
        while node.parent is not None:
            if node.locks == 0:
                self.locked_tokens += len(node.key)
            node.locks += 1
            node.used = now
            node = node.parent

    def unlock(self, node: Node) -> None:
        now = next(self._clock)
        while node.parent is not None:
            node.locks -= 1
            if node.locks == 0:
                self.locked_tokens -= len(node.key)
            node.used = now
            node = node.parent

    def insert(self, start: Node, tokens: list[int], slots: torch.Tensor, n: int) -> tuple[Node, int]:
        """Add tokens[:n] with their slots ``slots: [n]`` below ``start`` (a node on their path). Returns (the
        node at depth n, m): tokens start.depth..m-1 were already cached under other slots (the caller's are
        duplicates), tokens m..n-1 now hold the caller's slots, which the tree owns from here on."""
        node = self.match(start, tokens, n, 1)
        m = node.depth
        if m < n:
            leaf = Node(tokens[m:n], slots[m:n].clone(), node, depth=n, used=next(self._clock))
            node.children[tokens[m]] = leaf
            self.cached_tokens += n - m
            node = leaf
        return node, m

    def set_state(self, node: Node, state) -> None:
        """Keep ``state`` (a policy snapshot at ``node``'s end, replacing any) with the node; the least recently used
        other snapshots are dropped while they hold more than ``max_state_bytes`` together."""
        self.drop_state(node)
        nbytes = state.nbytes
        if nbytes > self.max_state_bytes:
            state.release()  # larger than the whole budget: not kept
            return
        for other in sorted(self._states, key=lambda n: n.used):
            if self.state_bytes + nbytes <= self.max_state_bytes:
                break
            self.drop_state(other)
        node.state, self._states[node] = state, nbytes
        self.state_bytes += nbytes

    def drop_state(self, node: Node) -> None:
        if node.state is not None:
            node.state.release()
            node.state = None
            self.state_bytes -= self._states.pop(node)

    def drop_states(self, owner) -> None:
        """Drop the snapshots of policy instance ``owner`` (one the engine no longer uses)."""
        for node in [n for n in self._states if n.state.owner is owner]:
            self.drop_state(node)

    def _split(self, child: Node, n: int) -> Node:
        """Cut ``child`` after its first ``n`` tokens; returns the new upper part (its locks are the child's)."""
        top = Node(child.key[:n], child.slots[:n], child.parent, {child.key[n]: child}, child.locks, child.used,
                   child.depth - len(child.key) + n)
        child.parent.children[child.key[0]] = top
        child.key, child.slots, child.parent = child.key[n:], child.slots[n:], top
        return top

    # ---- eviction -----------------------------------------------------------------------------

    def evict(self, n: int) -> int:
        """Free at least ``n`` slots (fewer only if fewer are evictable) from unlocked nodes, least recently used
        leaves first, each from its end (a leaf's last tokens are the ones fewest prompts share). Returns the
        number freed; they go back to the KV pool."""
        heap = [(node.used, id(node), node) for node in self._leaves() if node.locks == 0]
        heapq.heapify(heap)
        freed = []
        count = 0
        while count < n and heap:
            _, _, node = heapq.heappop(heap)
            take = min(n - count, len(node.key))
            freed.append(node.slots[len(node.key) - take:])
            count += take
            self.drop_state(node)  # its end goes
            if take < len(node.key):
                node.key, node.slots = node.key[:-take], node.slots[:-take]
                node.depth -= take
                continue
            parent = node.parent
            del parent.children[node.key[0]]
            if parent.parent is not None and not parent.children and parent.locks == 0:
                heapq.heappush(heap, (parent.used, id(parent), parent))
        if freed:
            self.cache.free(torch.cat(freed))
            self.cached_tokens -= count
            self.evicted_tokens += count
        self._roots = {namespace: root for namespace, root in self._roots.items() if root.children}
        return count

    def _leaves(self):
        stack = list(self._roots.values())
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            elif node.parent is not None:
                yield node

    def clear(self) -> int:
        """Evict every unlocked token; returns how many."""
        return self.evict(self.evictable_tokens)

    def stats(self) -> dict:
        return {"prefix_cache_tokens": self.cached_tokens, "prefix_cache_hit_tokens": self.hit_tokens,
                "prefix_cache_evicted_tokens": self.evicted_tokens, "prefix_cache_state_bytes": self.state_bytes}
