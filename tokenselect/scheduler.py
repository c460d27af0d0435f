"""Which tokens run in the next forward pass.

Every running sequence that is generating contributes one token; prompts are prefilled in chunks
that share a per-step token budget. Chunk boundaries of a prompt are always multiples of the chunk
size, so a sequence is processed the same way whatever else is running. A request is admitted only
when its whole reservation (prompt + max_tokens) fits in the KV pool next to those running, so a
running sequence never finds the pool full.
"""

from __future__ import annotations

from collections import deque

from .kv_cache import KVCache
from .sequence import Sequence


class Scheduler:
    def __init__(self, cache: KVCache, chunk_size: int, max_num_seqs: int):
        self.cache, self.chunk_size, self.max_num_seqs = cache, chunk_size, max_num_seqs
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.reserved = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[tuple[Sequence, int]]:
        """-> [(sequence, number of its next tokens to run)]."""
        while (self.waiting and len(self.running) < self.max_num_seqs
               and self.reserved + self.waiting[0].reserved <= self.cache.n_slots):
            seq = self.waiting.popleft()
            self.reserved += seq.reserved
            self.running.append(seq)
        batch = [(seq, 1) for seq in self.running if not seq.prefilling]
        budget = self.chunk_size
        for seq in self.running:
            if seq.prefilling:
                n = min(self.chunk_size, len(seq.prompt_ids) - seq.n_cached)
                if n > budget:
                    break
                batch.append((seq, n))
                budget -= n
        return batch

    def finish(self, seq: Sequence) -> None:
        """Release a finished or aborted sequence's slots and reservation."""
        if seq in self.running:
            self.running.remove(seq)
            self.reserved -= seq.reserved
            self.cache.free(seq.slots[:seq.n_cached])
        elif seq in self.waiting:
            self.waiting.remove(seq)
