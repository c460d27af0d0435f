"""Which tokens run in the next forward pass, and who holds which KV slots.

Every running sequence that is generating contributes one token; prompts are prefilled in chunks
that share a per-step token budget. Chunk boundaries of a prompt are always multiples of the chunk
size (a prefill that starts after a reused prefix first runs up to the next multiple), so a sequence
is processed the same way whatever else is running and whatever it reused; with ``tail_chunk`` the
prompt's last tokens are one more chunk of their own (the boundary before them is the only other one), and a
policy may end a chunk early at a point of its own settings (``AttentionPolicy.prefill_cut``: where TokenSelect's
query groups change mode).

With a prefix cache (``prefix_cache.py``) a sequence starts after the longest cached prefix of its prompt
(looked up when it is admitted, and again before each prefill chunk while it has computed nothing of its
own, so that ten questions queued behind one document reuse it once the first has computed it), and hands
its prompt's computed chunks to the cache as they complete (and, where the policy allows, its generated tokens
when it finishes). A sequence's slot table then begins with ``n_shared`` slots the cache owns (locked while it
runs), followed by slots of its own.

A policy with per-sequence state built from the prompt's queries (InfLLM, ``prefix_state``) snapshots it at a
chunk boundary its prompt's prefill passes when a later prompt is likely to stop there: the last two boundaries
of what it caches (the same document with another question ends its match at one of them unless the question
runs past a chunk), and the boundary its own match wanted but found no snapshot at (the point where its prompt
leaves a cached one: the next prompt that shares as much finds one there). A snapshot costs a copy of the local
scores of the window (``policies/infllm.py``), so not every boundary gets one.

A request is admitted only when its own slots (prompt + max_tokens, less the reused prefix) fit in the pool
next to what the running sequences may still take and the cached tokens they lock: unlocked cached tokens
are evicted on demand, so a running sequence never finds the pool full, and a request is never held back
for room that eviction could free.
"""

from __future__ import annotations

import logging
from collections import deque

from .kv_cache import KVCache
from .prefix_cache import PrefixCache
from .sequence import Sequence

log = logging.getLogger("tokenselect.scheduler")


class Scheduler:
    def __init__(self, cache: KVCache, chunk_size: int, max_num_seqs: int, prefix_cache: PrefixCache | None = None,
                 tail_chunk: int = 0):
        """tail_chunk: the prompt's last tail_chunk tokens run as a chunk of their own (``EngineSettings``)."""
        self.cache, self.chunk_size, self.max_num_seqs = cache, chunk_size, max_num_seqs
        self.tail_chunk = tail_chunk
        self.prefix = prefix_cache
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def committed(self) -> int:
        """Slots spoken for: every running sequence's own slots at their most (taken or still to take) and the
        cached tokens they lock."""
        own = sum(seq.reserved - seq.n_shared for seq in self.running)
        return own + (self.prefix.locked_tokens if self.prefix is not None else 0)

    @property
    def available(self) -> int:
        """Slots a new allocation can get: the free ones and the cached tokens no running sequence holds."""
        return self.cache.num_free + (self.prefix.evictable_tokens if self.prefix is not None else 0)

    def schedule(self) -> list[tuple[Sequence, int]]:
        """-> [(sequence, number of its next tokens to run)]."""
        while self.waiting and len(self.running) < self.max_num_seqs and self._admit(self.waiting[0]):
            self.running.append(self.waiting.popleft())
        batch = [(seq, 1) for seq in self.running if not seq.prefilling]
        budget = self.chunk_size
        for seq in self.running:
            if seq.prefilling:
                if seq.n_cached == seq.n_shared:  # nothing of its own yet: a longer prefix may be cached by now
                    self._reuse(seq, self._match(seq))
                left = len(seq.prompt_ids) - seq.n_cached
                n = min(self.chunk_size - seq.n_cached % self.chunk_size, left)
                if 0 < self.tail_chunk < left:  # stop short of the tail, which runs alone
                    n = min(n, left - self.tail_chunk)
                elif self.tail_chunk:  # the tail itself: one chunk, wherever it starts
                    n = min(self.chunk_size, left)
                n = seq.policy.prefill_cut(seq.n_cached, n)
                if n > budget:
                    break
                batch.append((seq, n))
                budget -= n
        return batch

    def allocate(self, n: int):
        """``n`` free slots -> [n] int64, evicting unlocked cached tokens if the free list is short."""
        short = n - self.cache.num_free
        if short > 0 and self.prefix is not None:
            self.prefix.evict(short)
        return self.cache.allocate(n)

    def computed(self, seq: Sequence) -> None:
        """After a step: give the cache the prompt tokens ``seq`` has computed (to the grain's multiple) and
        hold them as its prefix; where another sequence cached some of them meanwhile, its own duplicate slots
        go back to the pool and the cache's take their place."""
        self._cache(seq, seq.prompt_ids, min(seq.n_cached, self._cacheable(seq)))

    def _cache(self, seq: Sequence, tokens: list[int], n: int) -> None:
        """Give the cache ``tokens[:n]`` of ``seq`` (their KV computed), cut to the grain; with a ``prefix_state``
        policy, its state goes with them where the cut is the step's end and a snapshot is wanted there."""
        if self.prefix is None or seq.reuse is None or seq not in self.running:
            return
        grain = seq.reuse.grain
        n = n // grain * grain
        if n <= seq.n_shared:
            return
        start = seq.prefix_node or self.prefix.root(seq.reuse.namespace)
        if grain > 1:  # cached tokens that end inside a chunk are another prompt's chunk (or what eviction left of
            # one): past layer 0 their KV depends on that chunk's other tokens, so they are not this one's duplicates
            depth = self.prefix.match(start, tokens, n, 1).depth
            if depth % grain:
                n = depth // grain * grain
                if n <= seq.n_shared:
                    return
        node, m = self.prefix.insert(start, tokens, seq.slots[:n], n)
        if m > seq.n_shared:
            self.cache.free(seq.slots[seq.n_shared:m].clone())
            seq.slots[seq.n_shared:m] = self.prefix.slots(node)[seq.n_shared:m]
        self._hold(seq, node)
        if (seq.reuse.stateful and n == seq.n_cached and getattr(node.state, "owner", None) is not seq.policy
                and (n in seq.snapshot_at or n >= self._cacheable(seq) // grain * grain - grain)):
            try:  # after the step's pass: a failure here (out of memory) must not fail the step, only skip the snapshot
                state = seq.policy.snapshot(seq.id, seq.slots, n)
            except Exception:
                log.warning("no prefix snapshot of sequence %d at %d tokens", seq.id, n, exc_info=True)
                return
            self.prefix.set_state(node, state)

    def _cacheable(self, seq: Sequence) -> int:
        """How many prompt tokens of ``seq`` (at most) are computed as any prompt computes them: at a grain of a
        chunk, not those of a ``tail_chunk`` (a chunk of its own there, aligned elsewhere in a longer prompt)."""
        if seq.reuse is not None and seq.reuse.grain > 1 and self.tail_chunk:
            return max(len(seq.prompt_ids) - self.tail_chunk, 0)
        return len(seq.prompt_ids)

    def finish(self, seq: Sequence) -> None:
        """Release a finished or aborted sequence's slots and reservation: its computed prompt stays cached, and
        where the policy allows (``Reuse.generated``) its generated tokens too (not after an error)."""
        if seq in self.running:
            self.computed(seq)
            if seq.reuse is not None and seq.reuse.generated and seq.finish_reason != "error":
                self._cache(seq, seq.prompt_ids + seq.output_ids, seq.n_cached)
            self.running.remove(seq)
            self.cache.free(seq.slots[seq.n_shared:seq.n_cached])
            if seq.prefix_node is not None:
                self.prefix.unlock(seq.prefix_node)
                seq.prefix_node = None
        elif seq in self.waiting:
            self.waiting.remove(seq)

    # ---- prefix reuse -------------------------------------------------------------------------

    def _match(self, seq: Sequence):
        """The deepest cached node of ``seq``'s prompt (None without reuse). At most the prompt less its last
        token: that one is always computed, for the logits of the first new token (and not into a tail chunk,
        ``_cacheable``). With a ``prefix_state`` policy, the deepest with a snapshot of its policy; where the
        tokens went further, the sequence snapshots the point they reached when its prefill passes it."""
        if self.prefix is None or seq.reuse is None:
            return None
        start = seq.prefix_node or self.prefix.root(seq.reuse.namespace)
        limit = min(len(seq.prompt_ids) - 1, self._cacheable(seq))
        node = self.prefix.match(start, seq.prompt_ids, limit, seq.reuse.grain)
        if seq.reuse.stateful:
            seq.snapshot_at.add(node.depth)
            node = self.prefix.match(start, seq.prompt_ids, limit, seq.reuse.grain, seq.policy)
        return node

    def _admit(self, seq: Sequence) -> bool:
        node = self._match(seq)
        matched = node.depth if node is not None else 0
        extra = self.prefix.unlocked_tokens(node) if node is not None else 0
        if self.committed + extra + seq.reserved - matched > self.cache.n_slots:
            return False
        self._reuse(seq, node)
        return True

    def _reuse(self, seq: Sequence, node) -> None:
        """Start ``seq`` (which has computed nothing of its own) after the cached prefix ending at ``node``."""
        if node is None or node.depth <= seq.n_shared:
            return
        seq.slots[seq.n_shared:node.depth] = self.prefix.slots(node, seq.prefix_node)
        if seq.reuse.stateful:
            seq.policy.restore(seq.id, node.state)
        seq.cached_tokens += node.depth - seq.n_cached
        self.prefix.hit_tokens += node.depth - seq.n_cached
        seq.n_cached = node.depth
        self._hold(seq, node)

    def _hold(self, seq: Sequence, node) -> None:
        """``seq``'s prefix is now the path to ``node``: lock it (before unlocking the old one, its ancestor)."""
        self.prefix.lock(node)
        if seq.prefix_node is not None:
            self.prefix.unlock(seq.prefix_node)
        seq.prefix_node, seq.n_shared = node, node.depth
