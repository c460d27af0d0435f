"""The engine: ``LLM(model_path, attention=...)`` and ``generate``.

One step = schedule a batch (decode tokens + prefill chunks), allocate their KV slots, run the
model once over the flat batch, then sample a token for every sequence that reached the end of
what it knows. ``add_request`` / ``step`` / ``abort`` are the pieces a server drives.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import itertools
import logging
import os
import time
from collections import OrderedDict
from pathlib import Path
from typing import NamedTuple

import torch
from tqdm.auto import tqdm

from . import parallel
from .attention import Chunk, RopeFrequencies
from .config import ModelConfig
from .data import default_model_path
from .errors import ContextTooLong, TokenSelectError
from .kernels import chunk_attention_backend, get_kernels, kernels_for
from .kv_cache import KEPT_INDEX_BYTES, KVCache, host_memory_available
from .models.fp8 import check_fp8_products, use_fp8_weights
from .models.loader import Checkpoint, chat_token_ids, random_model, resolve_device, resolve_dtype
from .models.registry import resolve_model
from .policies import POLICIES, AttentionPolicy, default_chunk, fitted_settings, make_policy
from .prefix_cache import PrefixCache, reuse_rule
from .runner import ModelRunner
from .sampling import NAN_LOGITS, SamplingParams, on_device, sample_on_device, sample_rows, token_logprobs
from .scheduler import Scheduler
from .sequence import RequestOutput, Sequence
from .settings import EngineSettings, scaled
from .transfer import to_device

CPU_POOL_BYTES = 8 << 30  # the KV pool on CPU, when not set
GPU_MEMORY_FRACTION = 0.85  # of the free memory after the weights, for the pool
HOST_MEMORY_FRACTION = 0.8  # of the available host memory, for an offloaded V pool
KV_DTYPES = {"fp8": torch.float8_e4m3fn, "bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# Policy instances of per-request settings that no live request uses, kept for the next request that asks for
# the same settings; older idle ones are dropped, so a stream of distinct settings cannot grow memory for good.
MAX_IDLE_POLICIES = 4
# ``warm_up``'s second prompt is this many tokens shorter than its first, and its third ends in a chunk of this many
# tokens: a prompt that ends inside a chunk passes lengths that are not multiples of 16, and Triton compiles a variant
# of a kernel for those (13 kernels, 4.4 s inside a first 131,064-token prefill on an H200,
# benchmarks/results/supporting/first_prefill_compiles_ragged_h200.md); a last chunk of a few tokens runs the sparse
# attention's small-chunk tile (1.3 s of compiles, benchmarks/results/supporting/warm_up_first_requests_h200.md).
# Odd, so that a length times an even head count is not a multiple of 16 either.
WARMUP_RAGGED = 7
WARMUP_DECODE_STEPS = 16  # ``warm_up``'s first prompt's decode steps, by default
log = logging.getLogger("tokenselect.engine")


def selection_keys_dtype(setting: str, attention: str, kv_dtype: torch.dtype, device: torch.device,
                         kv_offload: str) -> torch.dtype:
    """The dtype of the keys that selection scores (``KVCache.k_select``); the KV pool's own ``kv_dtype`` means no
    copy. setting (``select_dtype``): "kv", the pool's keys; "fp8", an fp8 copy; "auto", the copy where it was
    measured to lose nothing and to pay: the engine starts with a policy that declares it
    (``AttentionPolicy.fp8_selection_keys``), on a GPU, over a 16-bit pool whose values stay on the GPU (value
    offload and an fp8 pool are chosen to save memory, which the copy would spend)."""
    if setting == "fp8" or (auto_fp8_keys(setting, attention) and device.type == "cuda" and kv_dtype.itemsize == 2
                            and kv_offload == "none"):
        return torch.float8_e4m3fn
    return kv_dtype


def pool_dtype(setting: str, model_dtype: torch.dtype) -> torch.dtype:
    """The KV pool's dtype for the ``kv_dtype`` setting: "auto" is the model's own."""
    return model_dtype if setting == "auto" else KV_DTYPES[setting]


def token_bytes(cfg: ModelConfig, kv_dtype: torch.dtype, select_dtype: torch.dtype) -> tuple[int, int]:
    """(bytes of one token's K, or V, in the pool; bytes of its selection keys' copy, 0 without one) over every
    layer."""
    per_pool = cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * kv_dtype.itemsize
    return per_pool, 0 if select_dtype == kv_dtype else per_pool // kv_dtype.itemsize * select_dtype.itemsize


def auto_fp8_keys(setting: str | None, attention: str) -> bool:
    """Whether an engine started with ``attention`` may make an fp8 copy of the keys that one started with another
    policy would not (``select_dtype`` auto or unset, and a policy that declares the copy): a harness that runs
    several policies gives such a policy an engine of its own, so that it measures what a user starting with it
    gets. An unknown name is False (``make_policy`` refuses it)."""
    return setting in (None, "auto") and attention in POLICIES and POLICIES[attention].fp8_selection_keys


def kv_label(dtype: torch.dtype, offload: str, select_dtype: torch.dtype | None = None) -> str:
    """How a KV cache is stored: 'bf16', 'fp8', 'fp8, V on host', 'bf16, fp8 selection keys' (the names of
    ``--kv-dtype``)."""
    names = {kv_dtype: name for name, kv_dtype in KV_DTYPES.items()}
    copy = f", {names[select_dtype]} selection keys" if select_dtype not in (None, dtype) else ""
    return names[dtype] + (", V on host" if offload == "values" else "") + copy


def split_settings(settings: dict) -> tuple[EngineSettings, dict]:
    """The keyword settings of an engine -> (its ``EngineSettings``, checked; the rest: the policy's)."""
    engine = {f.name for f in dataclasses.fields(EngineSettings)}
    return (EngineSettings(**{key: value for key, value in settings.items() if key in engine}),
            {key: value for key, value in settings.items() if key not in engine})


def token_ids(chunks: list[Chunk]) -> list[int]:
    """The token ids a step's chunks run, flat (host list)."""
    return [t for ch in chunks for t in ch.seq.token_slice(ch.past, ch.length)]


class Launched(NamedTuple):
    """A decode step queued on the device whose tokens the host has not read yet (``overlap_decode``).
    seqs: its sequences, in its rows' order; tokens: [B] int64 on the device, each row's next token (drawn there,
    ``sampling.sample_on_device``), which the next step reads as its input; host: [2, B], the tokens and whether
    each failed (NaN logits), in (pinned) host memory once ``done`` has happened (a CUDA event; None on a CPU, where
    the copy is done when it returns)."""

    seqs: list[Sequence]
    tokens: torch.Tensor
    host: torch.Tensor
    done: torch.cuda.Event | None


class LLM:
    """A model from a local Hugging Face checkpoint folder, a GGUF file, or a model name that
    ``tokenselect fetch`` has cached (``models/registry.py``), served with an attention policy.

    attention: full | tokenselect | reattention (and the baselines). Policy settings
    (k, n_init, n_local, theta, selector, ...) go as keyword arguments; unset ones take the paper's
    defaults fitted to the model's window. ``model=None`` loads the model that ships with the package; a
    ``Checkpoint`` already open is used as it is (a GGUF's metadata is not read a second time).
    """

    def __init__(self, model: str | Path | Checkpoint | None = None, attention: str = "full", *,
                 dtype: str = "auto", device: str | None = None, **settings):
        """settings: kernels, chunk_size, kv_cache_tokens, kv_dtype, kv_offload ("none" | "values": the
        V pool in pinned host memory, K on the GPU), select_dtype ("auto" | "fp8" | "kv": an fp8 copy of
        the keys that TokenSelect and ReAttention score, ``KVCache``, or the pool's keys; ``selection_keys_dtype``),
        max_model_len, max_num_seqs, rope_scaling, cuda_graphs (run steps through CUDA graphs,
        ``runner.ModelRunner``: decode steps and a long prompt's full prefill chunks as one graph each where the
        policy is graph-ready, other steps' layers as graphs around attention; default on CUDA; on a CPU the same
        code runs eagerly), prefix_cache (default True: keep the KV of computed prompts and start a request that
        shares a prefix with one after it, ``prefix_cache.py``) (engine) and the policy's own settings;
        tensor_parallel_size N > 1 splits the model across N processes (``parallel.py``: this one is rank 0),
        tp_selection how their policies vote over heads."""
        checkpoint = model if isinstance(model, Checkpoint) else Checkpoint(
            resolve_model(model if model is not None else default_model_path()))
        self.path = checkpoint.path
        self.device = resolve_device(device)
        self.config = checkpoint.config
        self.tp = self._parallel(attention, settings, (type(self), (str(self.path), attention),
                                                       dict(dtype=dtype, device=device, **settings)))
        with self._stop_ranks_on_failure():
            self.tokenizer = checkpoint.tokenizer()
            self.dtype = resolve_dtype(dtype, self.device, self.config.dtype)
            self.model = checkpoint.load(self.dtype, self.device, self.tp, fp8_weights=self._fp8_weights(settings))
            self._start(attention, dtype=dtype, device=device, **settings)

    @classmethod
    def random(cls, config: dict, attention: str = "full", *, dtype: str = "auto", device: str | None = None,
               seed: int = 0, **settings) -> "LLM":
        """An engine over random weights for a HF-style config dict, with no tokenizer (prompts are
        token ids). Speed does not depend on weight values: this is what the benchmarks run."""
        llm = cls.__new__(cls)
        llm.path, llm.tokenizer = None, None
        llm.device = resolve_device(device)
        llm.config = ModelConfig.from_dict(config)
        llm.tp = llm._parallel(attention, settings, (cls.random, (config, attention),
                                                     dict(dtype=dtype, device=device, seed=seed, **settings)))
        with llm._stop_ranks_on_failure():
            llm.dtype = resolve_dtype(dtype, llm.device)
            llm.model = random_model(llm.config, llm.dtype, llm.device, seed, llm.tp)
            if llm._fp8_weights(settings):
                use_fp8_weights(llm.model)
                if llm.device.type == "cuda":
                    torch.cuda.empty_cache()  # the 16-bit weights' blocks, before the KV pool is sized by the free memory
            llm._start(attention, dtype=dtype, device=device, **settings)
        return llm

    def _fp8_weights(self, settings: dict) -> bool:
        """Whether the settings ask for fp8 weights (``weight_dtype``); if so, checked first that this device can
        multiply them (before a model is loaded)."""
        fp8 = split_settings(settings)[0].weight_dtype == "fp8"
        if fp8:
            check_fp8_products(self.device)
        return fp8

    def _parallel(self, attention: str, settings: dict, build: tuple) -> "parallel.TensorParallel | None":
        """With ``tensor_parallel_size`` N > 1, this process's place among N ranks (``parallel.start``: rank 0
        starts the others, each of which builds its engine with ``build``), its device the rank's; None for 1.
        The settings are checked first, so that a mistake raises here rather than in every rank."""
        checked, policy_settings = split_settings(settings)
        world = checked.tensor_parallel_size
        if world == 1:
            return None
        fitted_settings(attention, policy_settings, self.config.window)
        parallel.check_shape(self.config, world)
        tp = parallel.start(world, self.device.type, build)
        self.device = tp.device
        return tp

    @contextlib.contextmanager
    def _stop_ranks_on_failure(self):
        """Around the rest of starting: if it fails, rank 0 stops the ranks it started (theirs fail alike, or wait
        for it). A rank other than 0 ends with SystemExit once rank 0 closes: that is no failure."""
        try:
            yield
        except BaseException as error:
            if self.tp is not None and not isinstance(error, SystemExit):
                self.tp.abandon()
            raise

    def _start(self, attention: str, **settings) -> None:
        """settings: the engine's (``EngineSettings``, which checks them) and the policy's."""
        s, policy_settings = split_settings(settings)
        self.settings = s
        cfg = self.model.config  # a tensor-parallel rank's: its share of the heads (``parallel.local_config``)
        self.window = self.config.window
        rope = cfg.rope
        if s.rope_scaling:
            kind, _, factor = s.rope_scaling.partition(":")
            rope = rope.with_scaling(kind, float(factor or 2))
        self.rope = RopeFrequencies(rope, self.device)
        kernels = kernels_for(s.kernels, self.device)
        if kernels == "triton" and self.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("triton kernels on the CPU run only in Triton's interpreter: set TRITON_INTERPRET=1 "
                             "before starting (slow; meant for tests), or use kernels='torch'")
        self.chunk_attention = chunk_attention_backend(s.chunk_attention, kernels, self.device, self.dtype)
        self.kernels = get_kernels(kernels, self.chunk_attention)
        group = fitted_settings(attention, policy_settings, self.window).get("prefill_group", 0)
        self.chunk_size = s.chunk_size or default_chunk(self.window, group)
        if s.tail_chunk > self.chunk_size:
            raise ValueError(f"tail_chunk ({s.tail_chunk}) must not exceed the prefill chunk ({self.chunk_size})")
        self.kv_dtype = pool_dtype(s.kv_dtype, self.dtype)
        self.select_dtype = selection_keys_dtype(s.select_dtype, attention, self.kv_dtype, self.device, s.kv_offload)
        n_slots = s.kv_cache_tokens or self._default_pool_tokens(s.kv_offload, cfg)
        if self.tp is not None:  # every rank schedules alike, so every rank's pool has the smallest one's slots
            n_slots = self.tp.min(n_slots)
        # the policies' reduction over heads across the ranks (``parallel.HeadReduce``), None in one process
        self.heads = self.tp.reduce(s.tp_selection) if self.tp is not None else None
        self.cache = KVCache(cfg.n_layers, n_slots, cfg.n_kv_heads, cfg.head_dim, self.kv_dtype, self.device,
                             s.kv_offload, self.select_dtype)
        self.max_model_len = min(s.max_model_len or n_slots, n_slots)
        self._launched: Launched | None = None  # a decode step running ahead of the host (``overlap_decode``)
        self.set_attention(attention, **policy_settings)
        self.scheduler = Scheduler(self.cache, self.chunk_size, s.max_num_seqs,
                                   PrefixCache(self.cache) if s.prefix_cache else None, s.tail_chunk)
        self._seq_ids = itertools.count()  # Sequence ids, unique among this engine's
        cuda_graphs = self.device.type == "cuda" if s.cuda_graphs is None else s.cuda_graphs
        self.runner = ModelRunner(self.model, self.cache, self.kernels, self.rope, self.device, self.chunk_size,
                                  cuda_graphs)
        eos = set(cfg.eos_token_ids)
        if not eos and self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos = {self.tokenizer.eos_token_id}
        self.eos_ids = eos
        # tensor parallel: rank 0's changes since its last step, which the other ranks replay (``_sync``), and a
        # rank's live sequences by id
        self._events: list[tuple] = []
        self._live: dict[int, Sequence] = {}
        if self.tp is not None and self.tp.rank == 0:
            atexit.register(self.close)
        elif self.tp is not None:  # the other ranks follow rank 0's steps until it closes, then their process ends
            try:
                self.serve_rank()
            finally:
                self._leave()
            raise SystemExit(0)

    def set_attention(self, attention: str, **policy_settings) -> None:
        """Switch the attention policy (e.g. to compare methods on one loaded model). Only between
        requests: running sequences would lose their policy state. The KV pool stays as it was built, with the
        selection keys of the policy the engine started with (``selection_keys_dtype``)."""
        if getattr(self, "scheduler", None) is not None and self.scheduler.has_work():
            raise RuntimeError("set_attention while requests are running")
        self._drain()
        self.attention, self.policy_settings = attention, policy_settings
        # every setting as the policy runs with it (defaults fitted to the window), for results files
        self.policy_config = {"attention": attention, "window": self.window,
                              **fitted_settings(attention, policy_settings, self.window),
                              "fitted_to_window": scaled(POLICIES[attention].Settings, policy_settings, self.window)}
        if getattr(self, "runner", None) is not None:
            self.runner.clear()
            for policy in self._policies.values():
                self._forget(policy)
        self._record("set_attention", attention, policy_settings)
        self.policy = make_policy(attention, self.cache, self.kernels, self.window, self.chunk_size, policy_settings,
                                  self.heads)
        # one instance per distinct per-request settings, least recently used first; () is the engine's own
        self._policies: OrderedDict[tuple, AttentionPolicy] = OrderedDict({(): self.policy})
        self._policy_users: dict[tuple, set[int]] = {}  # settings -> ids of the live sequences using them

    def policy_for(self, overrides: dict | None) -> tuple[tuple, AttentionPolicy]:
        """(key, policy instance) for a request's own settings (e.g. ``{"k": 1024}``) on top of the
        engine's; built on first use, shared by the requests that ask for the same, dropped some time
        after no live request uses it (``MAX_IDLE_POLICIES``). ValueError for a setting the policy does
        not take."""
        key = tuple(sorted((overrides or {}).items()))
        if key not in self._policies:
            settings = {**self.policy_settings, **dict(key)}
            self._policies[key] = make_policy(self.attention, self.cache, self.kernels, self.window,
                                              self.chunk_size, settings, self.heads)
        self._policies.move_to_end(key)
        return key, self._policies[key]

    def _drop_idle_policies(self) -> None:
        """Forget the least recently used per-request policy instances that no live sequence uses, beyond
        ``MAX_IDLE_POLICIES`` (their counters leave ``stats`` with them)."""
        idle = [key for key in self._policies if key and not self._policy_users.get(key)]
        for key in idle[:max(0, len(idle) - MAX_IDLE_POLICIES)]:
            self._forget(self._policies.pop(key))
            self._policy_users.pop(key, None)

    def _forget(self, policy: AttentionPolicy) -> None:
        """A policy instance goes: the prefix cache drops the snapshots of its state (no other instance reads them)."""
        if self.scheduler.prefix is not None:
            self.scheduler.prefix.drop_states(policy)

    def _default_pool_tokens(self, kv_offload: str, cfg: ModelConfig | None = None) -> int:
        """Pool slots that fit: on a GPU, K and V (and the selection keys' copy) in its free memory, or with
        value offload K (and the copy) alone there and V in the available host memory; on the CPU, all of them
        in CPU_POOL_BYTES. cfg: the model's as this process holds it (a tensor-parallel rank's heads; default
        ``config``)."""
        per_pool, copy = token_bytes(cfg or self.config, self.kv_dtype, self.select_dtype)
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            if kv_offload == "values":
                # (the kept rows, a fixed KEPT_ROWS a layer, come out of the memory the pool leaves free)
                on_device = per_pool + copy + (cfg or self.config).n_layers * KEPT_INDEX_BYTES
                return min(int(free * GPU_MEMORY_FRACTION) // on_device,
                           int(host_memory_available() * HOST_MEMORY_FRACTION) // per_pool)
            return int(free * GPU_MEMORY_FRACTION) // (2 * per_pool + copy)
        return min(131072, CPU_POOL_BYTES // (2 * per_pool + copy))

    # ---- requests -----------------------------------------------------------------------------

    def chat_prompt(self, messages: list[dict]) -> list[int]:
        """``messages`` (``[{"role", "content"}, ...]``) in the checkpoint's chat template -> token ids
        (``chat_token_ids``)."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise TokenSelectError(f"{self.path} has no chat template")
        return chat_token_ids(self.tokenizer, messages)

    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer: pass token ids")
            return self.tokenizer(prompt)["input_ids"]
        return list(prompt)

    def check_request(self, ids: list[int], max_tokens: int, max_model_len: int | None = None) -> None:
        """Raise ValueError for an empty prompt or a token id outside the vocabulary, ContextTooLong if
        prompt + max_tokens exceeds ``max_model_len`` (default: the engine's). Reads only settings fixed
        at start, so any thread may call it (the server does, before a request reaches the engine)."""
        limit = min(max_model_len or self.max_model_len, self.max_model_len)
        if not ids:
            raise ValueError("empty prompt")
        need = len(ids) + max_tokens
        if need > limit:
            raise ContextTooLong(
                f"prompt of {len(ids)} tokens + max_tokens {max_tokens} = {need} exceeds the context "
                f"limit of {limit} tokens (raise kv_cache_tokens / --kv-cache-tokens)")
        vocab = self.config.vocab_size
        bad = next((t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"token id {bad!r} is outside the vocabulary [0, {vocab})")

    def add_request(self, prompt: str | list[int], params: SamplingParams,
                    policy_settings: dict | None = None) -> Sequence:
        """Queue a request (text or token ids), optionally with its own policy settings (k, n_local,
        theta, ...: see ``policy_for``). Raises ContextTooLong if it can never fit, ValueError for an
        empty prompt or a token id outside the vocabulary."""
        ids = self.encode(prompt)
        self.check_request(ids, params.max_tokens)
        key, policy = self.policy_for(policy_settings)
        seq = Sequence(next(self._seq_ids), ids, params, self.device, policy, self.tokenizer)
        seq.policy_key = key
        if self.scheduler.prefix is not None:
            seq.reuse = reuse_rule(self.attention, {**self.policy_settings, **dict(key)}, self.rope.spec.kind,
                                   self.chunk_size)
        self._policy_users.setdefault(key, set()).add(seq.id)
        self.scheduler.add(seq)
        self._record("add", seq)
        return seq

    def abort(self, seq: Sequence) -> None:
        """Stop a request and free its KV slots (a client went away)."""
        if not seq.finished:
            seq.finish_reason = "abort"
        self._release(seq)
        self._record("abort", seq.id)
        if self._launched is not None and all(s.finished for s in self._launched.seqs):
            self._drain()

    def _release(self, seq: Sequence) -> None:
        self.scheduler.finish(seq)
        seq.policy.release(seq.id)
        self._policy_users.get(seq.policy_key, set()).discard(seq.id)
        self._drop_idle_policies()

    def _fail(self, seq: Sequence, error: BaseException) -> None:
        """End a sequence whose step raised: finish_reason "error", ``seq.error`` the exception."""
        log.error("sequence %d failed its step; ending it alone", seq.id, exc_info=error)
        seq.error, seq.finish_reason = error, "error"
        self._release(seq)

    # ---- one engine step ----------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[Sequence]:
        """Run one forward pass. Returns the sequences that got a new token (finished ones included).

        If the batch's pass raises, its sequences run again one at a time, so that only a sequence whose
        own pass raises ends (finish_reason "error", ``seq.error`` the exception; returned too) and the
        others advance as usual. A failed pass returns every KV slot it took.

        With tensor parallelism, rank 0 first sends the other ranks what changed since its last step (``_sync``);
        every rank then runs the same step on its shard."""
        if self.tp is not None and self.tp.rank == 0:
            with self.tp.lock:
                self._sync()
                return self._step()
        return self._step()

    def _step(self) -> list[Sequence]:
        """With ``overlap_decode``, a decode batch runs one step ahead of the host: this call queues the step
        after the one queued before (its input tokens are that one's, still on the device), and only then
        reads that one's tokens; a step that cannot follow on the device (another batch, a sequence ending, a
        request waiting) waits for the host as before."""
        launched = self._launched
        if launched is None:
            batch = self.scheduler.schedule()
            if not batch:
                return []
            if self._overlaps(batch):
                try:
                    launched = self._launch(batch, None)
                except Exception as error:  # the plain step below runs it again, and ends only what fails alone
                    log.warning("a decode step failed to launch (%s); running it again one step at a time", error)
            if launched is None:
                return self._run(batch)
        self._launched = None
        batch = self.scheduler.schedule()
        if self._follows(launched, batch):
            try:
                self._launched = self._launch(batch, launched.tokens)
            except Exception as error:  # the next call runs this batch one step at a time
                log.warning("a decode step failed to launch (%s)", error)
        return self._land(launched)

    def _run(self, batch: list[tuple[Sequence, int]]) -> list[Sequence]:
        """One step of ``batch`` that the host waits for. If the batch's pass raises, its sequences run again one at
        a time (``step``)."""
        try:
            return self._forward(batch)
        except Exception as error:
            if len(batch) == 1:
                self._fail(batch[0][0], error)
                return [batch[0][0]]
            log.warning("a step of %d sequences failed (%s); running them one at a time", len(batch), error)
        stepped = []
        for seq, n in batch:
            try:
                stepped += self._forward([(seq, n)])
            except Exception as error:
                self._fail(seq, error)
                stepped.append(seq)
        return stepped

    def _forward(self, batch: list[tuple[Sequence, int]]) -> list[Sequence]:
        """One forward pass over ``batch`` [(sequence, tokens to run)], then sampling. If the pass
        raises, the slots it took go back to the pool and no sequence has changed."""
        new_slots = []
        now = time.perf_counter()
        try:
            for seq, _ in batch:
                if seq.started_at is None:
                    seq.started_at = now
            chunks = self._place(batch, new_slots)
            step_slots = torch.cat(new_slots)
            # Rows that need logits: every row of a sequence recording them, else the last row of a
            # sequence that reached the end of its known tokens (it samples next).
            wanted = [list(range(ch.start, ch.start + ch.length)) if ch.seq.logits is not None
                      else [ch.start + ch.length - 1] if ch.past + ch.length == ch.seq.n_tokens else []
                      for ch in chunks]
            logit_rows = to_device(sum(wanted, []), self.device)
            logits = self.runner.logits(chunks, token_ids(chunks), step_slots, logit_rows).split(
                [len(w) for w in wanted])
        except BaseException:
            for slots in new_slots:  # the sequences' n_cached did not move: these slots are nobody's
                self.cache.free(slots)
            raise
        tokens = self._sample(chunks, logits)
        stepped = []
        for ch, row_logits in zip(chunks, logits):
            seq = ch.seq
            seq.n_cached += ch.length
            if not ch.decode:
                self.scheduler.computed(seq)  # the prompt's computed chunks into the prefix cache
            if seq.logits is not None:
                seq.logits.append(row_logits)
            if seq.n_cached == seq.n_tokens:
                try:  # e.g. NaN logits make the sampler raise: that ends this sequence only
                    token = tokens[seq.id]
                    if isinstance(token, BaseException):
                        raise token
                    self._append(seq, token)
                except Exception as error:
                    self._fail(seq, error)
                stepped.append(seq)
        return stepped

    def _place(self, batch: list[tuple[Sequence, int]], new_slots: list[torch.Tensor]) -> list[Chunk]:
        """Take KV slots for each sequence's tokens of ``batch`` [(sequence, tokens to run)] (evicting unused cached
        prefixes if the pool is short) and write them into its slot table -> the step's chunks over the flat batch.
        Each sequence's slots are appended to ``new_slots`` as they are taken, so that the caller gives back what
        was taken if the step fails, in this call (the pool full) or after it."""
        chunks, row = [], 0
        for seq, n in batch:
            new_slots.append(self.scheduler.allocate(n))
            seq.slots[seq.n_cached:seq.n_cached + n] = new_slots[-1]
            chunks.append(Chunk(seq, row, n, seq.n_cached))
            row += n
        return chunks

    def _overlaps(self, batch: list[tuple[Sequence, int]]) -> bool:
        """Whether ``batch`` may run ahead of the host: every sequence decoding its last generated token
        (``_ahead``)."""
        return self._ahead([seq for seq, _ in batch]) and all(
            n == 1 and seq.output_ids and seq.n_cached == seq.n_tokens - 1 for seq, n in batch)

    def _follows(self, launched: Launched, batch: list[tuple[Sequence, int]]) -> bool:
        """Whether ``batch`` (scheduled before ``launched`` is read) is the next step of exactly the launched
        sequences, each of which will still want a token after the launched one's."""
        return len(batch) == len(launched.seqs) and self._ahead(launched.seqs) and all(
            seq is launched_seq and n == 1 and not seq.finished and len(seq.output_ids) + 2 <= seq.params.max_tokens
            for (seq, n), launched_seq in zip(batch, launched.seqs))

    def _ahead(self, seqs: list[Sequence]) -> bool:
        """Whether steps of ``seqs`` may run ahead of the host: ``overlap_decode`` on, one process, every sequence's
        tokens drawn on the device (greedy, or sampled without a seed: ``sampling.on_device``) and recording neither
        logprobs nor logits (those are read on the host)."""
        return self.settings.overlap_decode and self.tp is None and all(
            on_device(seq.params) and seq.logprobs is None and seq.logits is None for seq in seqs)

    def _launch(self, batch: list[tuple[Sequence, int]], tokens: torch.Tensor | None) -> Launched:
        """Queue a decode step of ``batch`` (one token each) and the drawing of its tokens, without waiting for the
        device. tokens: [B] the input tokens on the device (those of the step launched before), or None: each
        sequence's last token. Each sequence's cached count moves past its input token; if queueing raises, the
        slots it took go back to the pool and no sequence has changed."""
        seqs, new_slots = [seq for seq, _ in batch], []
        try:
            chunks = self._place(batch, new_slots)
            ids = tokens if tokens is not None else token_ids(chunks)
            logits = self.runner.logits(chunks, ids, torch.cat(new_slots), self.cache.arange(len(seqs)))
            picks, failed = sample_on_device(logits, [seq.params for seq in seqs])
            both = torch.stack([picks, failed.long()])
        except BaseException:
            for slots in new_slots:  # the sequences' n_cached did not move: these slots are nobody's
                self.cache.free(slots)
            raise
        cuda = both.is_cuda
        host = torch.empty(both.shape, dtype=both.dtype, pin_memory=cuda).copy_(both, non_blocking=cuda)
        done = None
        if cuda:
            done = torch.cuda.Event()
            done.record()
        for seq in seqs:
            seq.n_cached += 1
        return Launched(seqs, picks, host, done)

    def _land(self, launched: Launched) -> list[Sequence]:
        """Wait for a launched step's tokens and append them to its sequences still running (one that ended since,
        by its token landed before or by an abort, drops its token). If every sequence of the step launched after
        it has ended, that step is waited for and forgotten too, so that no work of finished requests stays queued.
        Returns the sequences that got a token."""
        if launched.done is not None:
            launched.done.synchronize()
        stepped = []
        for seq, token, failed in zip(launched.seqs, *launched.host.tolist()):
            if seq.finished:
                continue
            try:
                if failed:
                    raise RuntimeError(NAN_LOGITS)
                self._append(seq, token)
            except Exception as error:
                self._fail(seq, error)
            stepped.append(seq)
        if self._launched is not None and all(seq.finished for seq in self._launched.seqs):
            self._drain()
        return stepped

    def _drain(self) -> None:
        """Wait for the launched step, if any, and drop its tokens (its sequences have ended, or are ending)."""
        launched, self._launched = self._launched, None
        if launched is not None and launched.done is not None:
            launched.done.synchronize()

    def _sample(self, chunks: list[Chunk], logits: list[torch.Tensor]) -> dict[int, int | Exception]:
        """The next token of every sequence of the step that reached the end of what it knows, by sequence id (an
        exception where its sampling raised), with its logprobs recorded. With tensor parallelism rank 0 samples
        and sends the tokens, so that every rank appends the same."""
        tokens: dict[int, int | Exception] = {}
        if self.tp is None or self.tp.rank == 0:
            ending = [(ch.seq, row_logits[-1]) for ch, row_logits in zip(chunks, logits)
                      if ch.past + ch.length == ch.seq.n_tokens]
            picks = sample_rows([row for _, row in ending], [seq.params for seq, _ in ending],
                                [seq.generator for seq, _ in ending])
            for (seq, row), token in zip(ending, picks):
                tokens[seq.id] = token
                if seq.logprobs is not None and not isinstance(token, BaseException):
                    try:
                        seq.logprobs.append(token_logprobs(row, token, seq.params.logprobs))
                    except Exception as error:
                        tokens[seq.id] = error
        if self.tp is None:
            return tokens
        sent = self.tp.broadcast({i: t if isinstance(t, int) else None for i, t in tokens.items()}
                                 if self.tp.rank == 0 else None)
        return tokens if self.tp.rank == 0 else {
            i: RuntimeError("rank 0 could not sample this token") if t is None else t for i, t in sent.items()}

    def _append(self, seq: Sequence, token: int) -> None:
        seq.output_ids.append(token)
        seq.last_token_at = time.perf_counter()  # after sampling, which waited for the step's logits
        if seq.first_token_at is None:
            seq.first_token_at = seq.last_token_at
        p = seq.params
        detok = seq.detokenizer
        hits = []
        if detok is not None:
            searched = detok.stable  # every stop string was looked for in the text up to here
            detok.update(seq.output_ids)
            # so an occurrence not yet seen ends past ``searched``
            hits = [i for i in (detok.text.find(s, max(searched - len(s) + 1, 0)) for s in p.stop) if i >= 0]
        if hits:
            detok.text = detok.text[:min(hits)]
            seq.finish_reason = "stop"
        elif token in self.eos_ids and not p.ignore_eos:
            seq.finish_reason = "stop"
        elif len(seq.output_ids) >= p.max_tokens:
            seq.finish_reason = "length"
        if seq.finished:
            self._release(seq)

    # ---- batch API ----------------------------------------------------------------------------

    def generate(self, prompts: str | list[str] | list[list[int]], params: SamplingParams | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Generate for each prompt (text, or token ids). Returns one output per prompt, in order."""
        params = params or SamplingParams()
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        seqs = [self.add_request(p, params) for p in prompts]
        total = sum(len(s.prompt_ids) for s in seqs)
        bar = tqdm(total=total, unit="tok", desc="prefill", disable=not use_tqdm or total <= 4 * self.chunk_size)
        try:
            while not all(s.finished for s in seqs):
                before = sum(min(s.n_cached, len(s.prompt_ids)) for s in seqs)
                self.step()
                bar.update(sum(min(s.n_cached, len(s.prompt_ids)) for s in seqs) - before)
        except BaseException:
            for s in seqs:
                self.abort(s)
            raise
        finally:
            bar.close()
        for s in seqs:
            if s.error is not None:
                raise RuntimeError(f"request {s.id} failed") from s.error
        return [s.output() for s in seqs]

    def warm_up(self, prompt: list[int], decode_steps: int = WARMUP_DECODE_STEPS) -> None:
        """Serve untimed requests, so that the kernel compiles (Triton compiles a kernel once for each variant of its
        arguments) and CUDA graph captures they meet happen now, not inside the requests that follow: ``prompt``
        with ``decode_steps`` decode steps; then, with one decode step each, the prompt without its first
        WARMUP_RAGGED tokens (ending inside a chunk), and without its first 2 * WARMUP_RAGGED cut to end in a chunk
        of WARMUP_RAGGED tokens. The later prompts start unlike the first, so that a prefix cache reuses none of
        their chunks. Prompts they left in the prefix cache are dropped."""
        ignore = dict(temperature=0, ignore_eos=True)
        self.generate([prompt], SamplingParams(max_tokens=decode_steps + 1, **ignore))
        ragged, few = prompt[WARMUP_RAGGED:], prompt[2 * WARMUP_RAGGED:]
        few = few[:(len(few) - WARMUP_RAGGED) // self.chunk_size * self.chunk_size + WARMUP_RAGGED]
        for later in (ragged, few):
            if later:  # (none of a prompt too short to cut)
                self.generate([later], SamplingParams(max_tokens=2, **ignore))
        if self.scheduler.prefix is not None:
            self.set_prefix_cache(True)  # an empty one

    def default_warm_up_tokens(self) -> int:
        """The length of the warm-up prompt a server serves by default on a GPU (``warm_up``; ``tokenselect serve
        --warm-up-tokens``): two prefill chunks past the default policy's selection threshold (two chunks for one
        that never selects), so that its selecting prefill chunks and decode steps compile and record their
        graphs; at most what one request may hold. On an H200 a first 120K-token request after such a warm-up
        compiled nothing, and took what the same request takes once everything is compiled
        (``benchmarks/results/supporting/warm_up_merge_h200.md``)."""
        tokens = (self.policy.selection_threshold or 0) + 2 * self.chunk_size
        return max(0, min(tokens, self.max_model_len - WARMUP_DECODE_STEPS - 1))

    def prompt_logits(self, prompt: str | list[int]) -> torch.Tensor:
        """Logits ``[T, vocab]`` (fp32) at every prompt position, from the same chunked prefill and
        attention policy that ``generate`` uses."""
        seq = self.add_request(prompt, SamplingParams(max_tokens=1, temperature=0))
        seq.logits = []
        seq.reuse = None  # a reused prefix would have no logits: every row is computed (and none cached)
        while not seq.finished:
            self.step()
        if seq.error is not None:
            raise RuntimeError("the prompt's pass failed") from seq.error
        return torch.cat(seq.logits)

    def summary(self) -> str:
        """One line on what this engine holds, said when a server starts: the model and its window, the attention,
        and the KV pool (tokens, how they are stored, bytes on this process's device and host)."""
        store = kv_label(self.kv_dtype, self.cache.offload, self.select_dtype)
        gb = sum(pool.nbytes for pool in self.cache.pools) / 1e9
        return (f"{self.path} (window {self.window:,} tokens), attention {self.attention}, KV pool of "
                f"{self.cache.n_slots:,} tokens ({store}; {gb:.2f} GB)")

    def stats(self) -> dict:
        """Policy counters (e.g. the Selection Cache's hits and misses, summed over the per-request
        settings' instances still kept), pool occupancy, and with the prefix cache its tokens held now
        (``prefix_cache_tokens``), reused instead of computed (``prefix_cache_hit_tokens``) and evicted
        (``prefix_cache_evicted_tokens``) so far."""
        # a copy of the instances: the server reads stats beside the engine thread
        counted = [s for s in (policy.stats() for policy in list(self._policies.values())) if s is not None]
        total = sum(counted[1:], counted[0]).as_dict() if counted else {}
        prefix = self.scheduler.prefix
        return {"attention": self.attention, "kv_slots_free": self.cache.num_free, "kv_slots": self.cache.n_slots,
                **(prefix.stats() if prefix is not None else {}), **total}

    def set_prefix_cache(self, enabled: bool) -> None:
        """Turn prefix reuse on or off (e.g. to time the same requests both ways on one loaded model). Only
        between requests; turning it off frees every cached prompt's slots."""
        if self.scheduler.has_work():
            raise RuntimeError("set_prefix_cache while requests are running")
        self._drain()
        self._record("set_prefix_cache", enabled)
        if self.scheduler.prefix is not None:
            self.scheduler.prefix.clear()
        self.scheduler.prefix = PrefixCache(self.cache) if enabled else None

    # ---- tensor parallel: rank 0 leads, the other ranks replay ----------------------------------

    def _record(self, kind: str, *args) -> None:
        """Rank 0: note a change that the other ranks must make too, before their next step (``_sync``)."""
        if getattr(self, "tp", None) is not None and self.tp.rank == 0 and hasattr(self, "_events"):
            self._events.append((kind, *args))

    def _sync(self, stop: bool = False) -> None:
        """Rank 0: send the other ranks the changes since the last step (and, with ``stop``, that no step follows).
        A request goes as what a rank needs to run it alike: its id, prompt, sampling, settings, how it reuses
        cached prompts and whether it records logits."""
        def sent(event: tuple) -> tuple:
            if event[0] != "add":
                return event
            seq = event[1]
            return "add", dict(id=seq.id, ids=seq.prompt_ids, params=seq.params, policy=dict(seq.policy_key),
                               reuse=seq.reuse, logits=seq.logits is not None)

        events, self._events = [sent(event) for event in self._events], []
        self.tp.broadcast(events + [("stop",)] if stop else events)

    @torch.inference_mode()
    def serve_rank(self) -> None:
        """A rank other than 0: replay rank 0's changes and run its steps on this rank's shard until it stops."""
        while True:
            for kind, *args in self.tp.broadcast():
                if kind == "stop":
                    return
                self._replay(kind, *args)
            for seq in self._step():
                if seq.finished:
                    self._live.pop(seq.id, None)

    def _replay(self, kind: str, *args) -> None:
        if kind == "add":
            a = args[0]
            key, policy = self.policy_for(a["policy"])
            seq = Sequence(a["id"], a["ids"], a["params"], self.device, policy, self.tokenizer)
            seq.policy_key, seq.reuse, seq.logits = key, a["reuse"], [] if a["logits"] else None
            self._policy_users.setdefault(key, set()).add(seq.id)
            self.scheduler.add(seq)
            self._live[seq.id] = seq
        elif kind == "abort":
            seq = self._live.pop(args[0], None)
            if seq is not None:
                self.abort(seq)
        elif kind == "set_attention":
            self.set_attention(args[0], **args[1])
        elif kind == "set_prefix_cache":
            self.set_prefix_cache(args[0])
        else:
            raise ValueError(f"unknown tensor-parallel event {kind!r}")

    def close(self) -> None:
        """Stop the other tensor-parallel ranks and leave the group (rank 0; at exit without a call). Nothing to do
        in a single process. The engine takes no request after it."""
        tp = getattr(self, "tp", None)
        if tp is None or tp.closed or tp.rank != 0:
            return
        if tp.lock.acquire(timeout=parallel.JOIN_SECONDS):  # a step still running on another thread: let it end
            try:
                self._sync(stop=True)
            except Exception:
                log.exception("could not tell the other ranks to stop")
            finally:
                tp.lock.release()
        self._leave()

    def _leave(self) -> None:
        """Every rank, once no step follows: drop the CUDA graphs, which hold the NCCL communicator that the group's
        teardown destroys (it waits for them), then leave the group."""
        if hasattr(self, "runner"):
            self.runner.release()
        self.tp.close()
