"""The attention policy interface and the list assembly every selective policy shares.

A policy answers one question: for this step's queries of this layer, which cache slots are attended,
and at which RoPE positions? It answers it once, in ``attend``, with tensor operations on the device
whose shapes depend only on what the host fixes for a step (``SeqStep``): the same code runs eagerly
(``attention.BatchAttention``, on a CPU too) and is recorded as it is into a CUDA graph
(``cuda_graphs.py``). Host work that depends on a sequence's length (giving it a row of device state,
closing InfLLM's blocks) happens before the step, in ``prepare``.

Selective policies attend ``[n_init sink tokens | chosen middle tokens, in original order |
n_local most recent tokens | the step's own tokens]``. They differ only in how they choose from the
middle (``SelectivePolicy.choose``); the list and its positions are assembled here once.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..kernels import Kernels
from ..kv_cache import KVCache
from ..parallel import NO_REDUCE, HeadReduce
from ..settings import NoSettings, setting
from ..transfer import to_device

ALL, SELECT = "all", "select"  # the modes of a selective policy's step (``SelectivePolicy.mode``)


@dataclass
class SeqStep:
    """One sequence in one step, as its policy sees it: device tensors whose shapes stay fixed for a
    graph's life, and host values that fix which computation runs.

    table: [C] slots of the sequence's tokens 0..C-1: the ``length`` cached ones, then the step's own (w
        of them); entries after those are not the sequence's and are never attended (they hold some valid
        slot, so reading them is harmless).
    length: int64 [] on the device, the tokens in the cache before this step.
    row: int64 [] on the device, the sequence's row in the policy's per-sequence state (``prepare``).
    decode: True for a decode step (one query after the prompt), False for a prefill chunk.
    mode: the policy's name for what this step does (``AttentionPolicy.mode``), decided on the host.
    buffers: device tensors of this sequence that the step writes (``AttentionPolicy.step_buffers``).

    One SeqStep serves every layer of a step, so what depends on the step alone is computed once
    (``once``), not in each of the layers: in a graph each computation is a node per layer.
    """

    table: torch.Tensor
    length: torch.Tensor
    row: torch.Tensor
    decode: bool
    mode: str = ALL
    buffers: tuple[torch.Tensor, ...] = ()
    _derived: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def once(self, key: str, make: Callable[[], torch.Tensor]) -> torch.Tensor:
        """``make()``, computed by the first layer that asks for ``key`` and kept for the step's other layers."""
        if key not in self._derived:
            self._derived[key] = make()
        return self._derived[key]


@dataclass
class Attended:
    """What a step's w queries attend, as device tensors.

    slots: [n] cache slots, the step's own tokens among the live ones (a decode step's one token may stand
        anywhere among them: it sees every live entry; a chunk's are the last live ones, seen causally).
    key_pos: [n] their RoPE positions; q_pos: [w] the queries'.
    n_valid: None (all n are attended) or int64 []: only ``slots[:n_valid]`` are.
    """

    slots: torch.Tensor
    key_pos: torch.Tensor
    q_pos: torch.Tensor
    n_valid: torch.Tensor | None


@dataclass(frozen=True)
class PolicyStats:
    """A policy's counters (TokenSelect's Selection Cache decisions), summed over policies with ``+``."""

    selection_cache_hits: int = 0
    selection_cache_misses: int = 0

    def __add__(self, other: "PolicyStats") -> "PolicyStats":
        return PolicyStats(*(a + b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other))))

    def __sub__(self, other: "PolicyStats") -> "PolicyStats":
        return PolicyStats(*(a - b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other))))

    @property
    def selection_cache_hit_rate(self) -> float:
        """Hits over decisions; 0 before any decision."""
        looked_up = self.selection_cache_hits + self.selection_cache_misses
        return self.selection_cache_hits / looked_up if looked_up else 0.0

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "selection_cache_hit_rate": self.selection_cache_hit_rate}


class AttentionPolicy:
    """Base class. Subclasses set ``name`` and implement ``attend``; those with per-sequence state give
    sequences rows of it in ``prepare`` and drop them in ``release``."""

    name = "base"
    Settings = NoSettings  # the settings dataclass of the policy (``settings.py``)
    # how a prompt's KV computed under this policy may be reused by a later prompt with the same first tokens
    # (``prefix_cache.py``): "chunk" (matches cut to a multiple of the prefill chunk: a policy that chooses per
    # chunk), "token" (every query row computed alone) or None (never)
    prefix_reuse: str | None = "chunk"
    # True where a decode step's K and V are what a prefill chunk of the same tokens computes (full attention): a
    # finished sequence's generated tokens are cached too, for a chat's next turn. Not where a decode step attends
    # its own choice (a selecting policy's per-token selection, a window that slides per token)
    generated_reuse = False
    # True: per-sequence state built from the prompt's queries (InfLLM's memory) goes with a reused prefix: the
    # policy takes it at a chunk boundary (``snapshot``) and gives it to a sequence that starts there (``restore``)
    prefix_state = False
    # True where ``attend_batch`` chooses for a batch at once (TokenSelect's decode steps): an eager step's decode
    # tokens of such a policy then attend as one batch too (``attention.BatchAttention``)
    batch_choice = False
    # True where an fp8 copy of the keys to score is measured to lose no accuracy on the real models' tables, so
    # that ``select_dtype="auto"`` makes one on a GPU (TokenSelect: ``benchmarks/results/supporting/
    # fp8_keys_real_models_h200.md``)
    fp8_selection_keys = False

    # the reduction over heads of the policy's choice, across tensor-parallel ranks (``parallel.HeadReduce``: none in
    # a single process): where a policy sums or maxes a score over heads, it passes the result through ``heads``
    heads: HeadReduce = NO_REDUCE

    def __init__(self, cache: KVCache, kernels: Kernels):
        self.cache, self.kernels = cache, kernels

    def across_ranks(self, heads: HeadReduce) -> None:
        """Reduce the policy's votes over heads with ``heads`` (``make_policy``, for tensor-parallel ranks)."""
        self.heads = heads

    def mode(self, t: int, w: int) -> str:
        """What a step of ``w`` tokens after ``t`` cached ones does (``SeqStep.mode``), decided on the host."""
        return ALL

    @property
    def selection_threshold(self) -> int | None:
        """The fewest cached tokens from which every step selects (``mode``); None for a policy that attends every
        token. A warm-up prompt past it compiles the selection (``LLM.default_warm_up_tokens``)."""
        return None

    def prepare(self, seq_id: int, slots: torch.Tensor, t: int, capacity: int, decode: bool,
                q_shape: tuple[int, int, int], q_dtype: torch.dtype) -> int:
        """Host work before a step of the sequence; returns its row of per-sequence state (``SeqStep.row``).
        slots: the sequence's slot table (its first t + w entries filled); capacity: the step's table
        length; q_shape, q_dtype: the step's queries, [w, n_heads, head_dim]."""
        return 0

    def step_buffers(self, seq_id: int) -> tuple[torch.Tensor, ...]:
        """Device tensors of the sequence that its step about to run writes (``SeqStep.buffers``), as ``prepare``
        left them."""
        return ()

    def attend(self, layer: int, step: SeqStep, q: torch.Tensor, own: torch.Tensor) -> Attended:
        """What the queries q: [w, n_heads, head_dim] (un-rotated), cached at slots own: [w], attend."""
        raise NotImplementedError

    def prefill_cut(self, t: int, n: int) -> int:
        """How many of the next ``n`` prompt tokens after ``t`` cached ones the scheduler runs as one prefill chunk:
        fewer where the chunk's query groups (``query_groups``) would not all attend in one mode."""
        return n

    @classmethod
    def prefix_grain(cls, settings: dict, chunk: int) -> int:
        """The multiple a reused prefix is cut to (``prefix_cache.reuse_rule``) for a policy that chooses per chunk:
        where its choices are its queries' alone, a prompt's KV is the same only up to a chunk boundary."""
        return chunk

    def query_groups(self, step: SeqStep, w: int) -> tuple[int, list[SeqStep]] | None:
        """(g, the SeqSteps of a prefill chunk's groups of g queries, the last one w - g * (len - 1) long) where the
        policy chooses for each group of a chunk's w queries as a chunk of g queries would (``attention.attend_batch``
        runs the groups as a batch); None where the chunk chooses once."""
        return None

    def attend_batch(self, layer: int, steps: list[SeqStep], q: torch.Tensor, own: torch.Tensor) -> list[Attended]:
        """``attend`` for B >= 2 sequences stepping together in one mode (a whole-step graph's batch; one sequence
        goes to ``attend``), q: [B, w, n_heads, head_dim], own: [B, w]; each list of one length. Here each sequence's
        on its own; a policy may choose for the batch at once (TokenSelect's decode steps: one launch of each
        selection kernel, not one a sequence)."""
        return [self.attend(layer, step, q[b], own[b]) for b, step in enumerate(steps)]

    def release(self, seq_id: int) -> None:
        """Forget the per-sequence state of a finished sequence."""

    def snapshot(self, seq_id: int, slots: torch.Tensor, t: int):
        """(``prefix_state`` policies) The sequence's state after its first ``t`` tokens, the end of its last step:
        an object with ``release()`` and ``nbytes`` that a prefix cache node keeps."""
        raise NotImplementedError

    def restore(self, seq_id: int, state) -> None:
        """(``prefix_state`` policies) Start sequence ``seq_id`` from a ``snapshot`` of this instance."""
        raise NotImplementedError

    def stats(self) -> PolicyStats | None:
        """The policy's counters; None for a policy that keeps none."""
        return None

    def whole_table(self, step: SeqStep, w: int) -> Attended:
        """Every token at its original position: the table's first length + w entries (the cached tokens, then
        the step's own), the rest of its span not read. What depends on the step alone is computed once."""
        return self.whole_tables([step], w)[0]

    def whole_tables(self, steps: list[SeqStep], w: int) -> list[Attended]:
        """``whole_table`` of each of a batch's sequences (their tables of one length). The queries' positions and
        the live lengths are computed once a step as rows of one [B, w] and one [B] tensor, so that a batched
        kernel reads them in place (``rows``) and no layer stacks them again."""
        positions = self.cache.arange(steps[0].table.numel())
        lengths = batch_lengths(steps)
        q_pos = batch_once(steps, f"length + first {w}", lambda: lengths[:, None] + positions[:w])
        n_valid = batch_once(steps, f"length + {w}", lambda: lengths + w)
        return [Attended(step.table, positions, q_pos[b], n_valid[b]) for b, step in enumerate(steps)]

    # ---- steps captured as CUDA graphs ---------------------------------------------------------

    def graph_ready(self, t: int, w: int = 1) -> bool:
        """Whether a step of ``w`` tokens after ``t`` cached ones may be recorded as a CUDA graph that serves
        later steps too (one whose list keeps its length and whose state tensors stay put)."""
        return False

    def graph_state(self) -> tuple[torch.Tensor, ...]:
        """The device tensors a step reads and writes besides the cache: a graph is recorded for these very
        tensors, and a check run restores them."""
        return ()

    def graph_reads(self) -> tuple[torch.Tensor, ...]:
        """The device tensors a step only reads (besides the cache and the step's inputs)."""
        return ()


@dataclass
class EagerStep:
    """One sequence in an eager step: its policy, id, slot table (the step's own filled in), t cached tokens and
    w new ones (their queries: q_shape [w, n_heads, head_dim], q_dtype)."""

    policy: AttentionPolicy
    seq_id: int
    slots: torch.Tensor
    t: int
    w: int
    decode: bool
    q_shape: tuple[int, int, int]
    q_dtype: torch.dtype


def start_steps(seqs: list[EagerStep]) -> list[SeqStep]:
    """The SeqSteps of an eager step: each policy prepares its sequence, whose table is exactly its t + w slots;
    the lengths and rows reach the device in one copy."""
    rows = [s.policy.prepare(s.seq_id, s.slots, s.t, s.t + s.w, s.decode, s.q_shape, s.q_dtype) for s in seqs]
    scalars = to_device([s.t for s in seqs] + rows, seqs[0].slots.device).view(2, len(seqs))
    return [SeqStep(s.slots[:s.t + s.w], scalars[0, i], scalars[1, i], s.decode, s.policy.mode(s.t, s.w),
                    s.policy.step_buffers(s.seq_id)) for i, s in enumerate(seqs)]


def start_step(policy: AttentionPolicy, seq_id: int, slots: torch.Tensor, t: int, w: int, decode: bool,
               q_shape: tuple[int, int, int], q_dtype: torch.dtype) -> SeqStep:
    """An eager step of one sequence (``start_steps``)."""
    return start_steps([EagerStep(policy, seq_id, slots, t, w, decode, q_shape, q_dtype)])[0]


class SelectivePolicy(AttentionPolicy):
    """Sinks + chosen middle tokens + local window, re-indexed to contiguous positions.

    n_init: sink tokens at the start; n_local: most recent tokens; budget: at most this many
    middle tokens are chosen. positions: "reindex" (RoPE by index within the attended list, so
    positions never exceed n_init + budget + n_local + chunk) or "original" (cache positions).
    dense_until: every token is attended while a step ends at or before this position (``mode``);
    None or 0: from the policy's own threshold on (the papers).
    """

    POSITIONS = ("reindex", "original")  # the schemes ``attend`` knows; subclasses may add their own

    def __init__(self, cache: KVCache, kernels: Kernels, n_init: int, n_local: int, budget: int,
                 positions: str = "reindex", dense_until: int | None = 0):
        super().__init__(cache, kernels)
        if positions not in self.POSITIONS:
            raise ValueError(f"positions must be one of {', '.join(self.POSITIONS)}, not {positions!r}")
        if min(n_init, n_local, budget) < 0:
            raise ValueError("n_init, n_local and the selection budget must be >= 0")
        self.n_init, self.n_local, self.budget, self.positions = n_init, n_local, budget, positions
        self.dense_until = dense_until or 0

    def mode(self, t: int, w: int) -> str:
        """SELECT, or ALL (every token at its own position, as full attention) while the list would hold them
        all anyway, and while the step's last position stays below ``dense_until`` (a model is not made worse
        at lengths its window already handles)."""
        if t <= self.n_init + self.budget + self.n_local or t + w <= self.dense_until:
            return ALL
        return SELECT

    @property
    def selection_threshold(self) -> int:
        """Past the list's capacity and at ``dense_until`` (a step of w >= 1 tokens then ends past it)."""
        return max(self.n_init + self.budget + self.n_local + 1, self.dense_until)

    def graph_ready(self, t: int, w: int = 1) -> bool:
        """Once it selects (the list's length no longer moves), and while it attends every token: that list is
        full attention's (the table's fixed span, its live length on the device), graph-ready as full attention
        is, so that a model inside its window decodes at full attention's speed."""
        return self.mode(t, w) == SELECT or self.cache.offload != "values"

    def middle(self, step: SeqStep) -> tuple[torch.Tensor, torch.Tensor]:
        """The selection candidates: (slots [M], the table's fixed span between the sinks and the last n_local
        entries; live: int64 [], how many of them are the middle of the cached tokens)."""
        middle = step.table[self.n_init:step.table.numel() - self.n_local]
        live = step.once(f"length - {self.n_init + self.n_local}", lambda: step.length - (self.n_init + self.n_local))
        return middle, live

    def choose(self, layer: int, step: SeqStep, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Choose from the middle (``middle``). q: [w, n_heads, head_dim]. Returns (indices into the middle [B],
        ascending, B <= budget; None, or int64 []: only the first that many of them are chosen)."""
        raise NotImplementedError

    def attend(self, layer: int, step: SeqStep, q: torch.Tensor, own: torch.Tensor) -> Attended:
        if step.mode == ALL:
            return self.whole_table(step, own.numel())
        chosen, count = self.choose(layer, step, q)
        return self.assemble(step, chosen, count, own)

    def choose_batch(self, layer: int, steps: list[SeqStep], q: torch.Tensor) -> torch.Tensor | None:
        """``choose`` for a batch of sequences at once (q: [B, w, n_heads, head_dim]): indices into each middle,
        [B, budget], ascending, every one chosen; None where the policy chooses each sequence's on its own."""
        return None

    def attend_batch(self, layer: int, steps: list[SeqStep], q: torch.Tensor, own: torch.Tensor) -> list[Attended]:
        """With ``choose_batch``: the batch's choices in one launch of each kernel, gathered into the rows of one
        [B, n] list a step (one more launch a layer) whose frames are built once a step, at re-indexed positions;
        else each sequence's ``attend``."""
        chosen = self.choose_batch(layer, steps, q) if steps[0].mode == SELECT and self.positions == "reindex" else None
        if chosen is None:
            return super().attend_batch(layer, steps, q, own)
        n_init, b, w = self.n_init, chosen.shape[1], own.shape[1]
        frames = batch_once(steps, f"{n_init} sinks + {b} chosen + last {self.n_local} + own", lambda: torch.stack([
            self.frame(step, b, own[i]) for i, step in enumerate(steps)]))
        middles = rows([self.middle(step)[0] for step in steps])
        self.kernels.gather_into(middles, chosen, frames[:, n_init:n_init + b])
        key_pos = self.cache.arange(frames.shape[1])
        return [Attended(frame, key_pos, key_pos[-w:], None) for frame in frames]

    def frame(self, step: SeqStep, b: int, own: torch.Tensor) -> torch.Tensor:
        """A list's entries around its ``b`` chosen: [sinks | b zeros | the last n_local tokens | own]."""
        return torch.cat([step.table[:self.n_init], step.table.new_zeros(b),
                          step.table.index_select(0, self.local_window(step)), own])

    def local_window(self, step: SeqStep) -> torch.Tensor:
        """The positions of the last n_local cached tokens, [n_local] (once a step)."""
        return step.once(f"last {self.n_local} tokens", lambda: step.length - self.n_local +
                         self.cache.arange(self.n_local))

    def assemble(self, step: SeqStep, chosen: torch.Tensor, count: torch.Tensor | None, own: torch.Tensor) -> Attended:
        """The list ``[sinks | middle[chosen[:count]] | local window | own]``. The frame around the chosen (sinks,
        window, own) is gathered once a step; every layer writes its choice into its middle (the layers run in
        order, so a layer's list holds its choice until the next layer's ``attend``). A partial choice (``count``)
        is closed up, so that the live entries come first."""
        n_init, n_local, b, w = self.n_init, self.n_local, chosen.numel(), own.numel()
        n = n_init + b + n_local + w
        window = self.local_window(step)
        frame = step.once(f"{n_init} sinks + {b} chosen + last {n_local} + own", lambda: self.frame(step, b, own))
        middle, _ = self.middle(step)
        self.kernels.gather_into(middle, chosen, frame[n_init:n_init + b])
        if self.positions == "original":
            arange = self.cache.arange
            key_pos = torch.cat([arange(n_init), chosen + n_init, window, step.length + arange(w)])
        else:
            key_pos = self.cache.arange(n)
        if count is None:
            return Attended(frame, key_pos, key_pos[n - w:], None)
        index = self.cache.arange(n)  # entry j of the closed-up list: j, or past the b - count unchosen
        gap = b - count
        source = torch.where(index < n_init + count, index, (index + gap).clamp(max=n - 1))
        n_valid = n - gap
        if self.positions == "original":  # the entries' own positions move with them; re-indexed ones stay 0, 1, ...
            key_pos = key_pos.index_select(0, source)
        q_pos = key_pos.index_select(0, n_valid - w + self.cache.arange(w))
        return Attended(frame.index_select(0, source), key_pos, q_pos, n_valid)


# ---- the settings the selective policies share (each policy's Settings dataclass declares its own defaults) ----

def n_init_setting(default: int):
    return setting(default, "sink tokens kept at the start", unit="tokens", low=0, scales=True)


def n_local_setting(default: int, low: int = 0):
    return setting(default, "most recent tokens always attended", unit="tokens", low=low, scales=True,
                   per_request=True)


def dense_until_setting():
    return setting(None, "attend every token (as full attention) while the context is at most this many tokens; 0: "
                         "the paper's rule (select as soon as the context outgrows sinks + budget + window)",
                   unit="tokens", low=0, kind=int, none="the model's window, so the model is unchanged at lengths it "
                                                       "handles")


def positions_setting(default: str = "reindex", choices: tuple = SelectivePolicy.POSITIONS):
    return setting(default, "RoPE positions: by index within the attended list (reindex), the tokens' own "
                            "(original), or InfLLM's fixed: the memory at distance n_local from the chunk",
                   choices=choices)


def rows(tensors: list[torch.Tensor]) -> torch.Tensor:
    """B tensors of one shape [n] as a [B, n] operand of a batched kernel, copying nothing where it can: the
    tensors' common storage at stride 0 where all are the same view (an arange every sequence shares), at their
    spacing where they are evenly spaced rows of one tensor (the rows of a graph's slot table), else a stack."""
    first = tensors[0]
    alike = all(t.shape == first.shape and t.stride() == first.stride() and t.dtype == first.dtype
                and t.untyped_storage().data_ptr() == first.untyped_storage().data_ptr() for t in tensors)
    if alike and first.dim() == 1 and first.stride(0) == 1:
        offsets = [(t.data_ptr() - first.data_ptr()) // first.element_size() for t in tensors]  # in elements
        spacing = offsets[1] if len(tensors) > 1 else 0
        if spacing >= 0 and offsets == [b * spacing for b in range(len(tensors))]:
            return first.as_strided((len(tensors), first.numel()), (spacing, 1))
    return torch.stack(tensors)


def batch_once(steps: list[SeqStep], key: str, make: Callable[[], torch.Tensor]) -> torch.Tensor:
    """``SeqStep.once`` for what a batch of sequences stepping together computes once a step (kept by the first)."""
    return steps[0].once(f"batch of {len(steps)}: {key}", make)


def batch_lengths(steps: list[SeqStep]) -> torch.Tensor:
    """The batch's cached lengths as one int64 [B] operand, once a step (a view of a whole step's inputs)."""
    return batch_once(steps, "lengths", lambda: rows([step.length.view(1) for step in steps]).view(-1))
