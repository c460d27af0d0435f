"""Greedy decode steps queued one ahead of the host (``overlap_decode``): the same tokens, slots and stops as one step
at a time, and the step after a sequence's end computed and dropped."""

from __future__ import annotations

import pytest
import torch

from tokenselect import LLM, SamplingParams


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(2, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def greedy(max_tokens: int, **more) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, **more)


def passes(llm: LLM, batches: list | None = None) -> list[bool]:
    """Filled as the engine runs: for each forward pass, whether its input tokens were still on the device (a step
    queued on the step before it, whose tokens the host had not read); ``batches``, if given, gets each pass's
    sequences and whether each decodes."""
    seen, real = [], llm.runner.logits

    def logits(chunks, ids, *rest):
        seen.append(isinstance(ids, torch.Tensor))
        if batches is not None:
            batches.append(tuple((ch.seq.id, ch.decode) for ch in chunks))
        return real(chunks, ids, *rest)

    llm.runner.logits = logits
    return seen


@pytest.mark.parametrize("attention,cuda_graphs", [("full", False), ("tokenselect", False), ("tokenselect", True),
                                                   ("reattention", True)])
def test_overlapped_decode_gives_the_tokens_of_one_step_at_a_time(tiny_llama, attention, cuda_graphs):
    """Prompts past TokenSelect's selection threshold (84 tokens for this window-256 model) and before it, decoded
    together while the longer ones still prefill: the same tokens and the same passes with and without overlap.
    With it, a pass decoding the same sequences as the decode pass before it takes its input from the device;
    without it, none does. (cuda_graphs on a CPU runs the whole-step graphs' code eagerly.)"""
    prompts = [prompt(n, n) for n in (5, 130, 200)]
    outputs, chained, batches = {}, {}, {}
    for overlap in (True, False):
        llm = LLM(tiny_llama, attention, chunk_size=32, cuda_graphs=cuda_graphs, overlap_decode=overlap)
        batches[overlap] = []
        chained[overlap] = passes(llm, batches[overlap])
        outputs[overlap] = [o.token_ids for o in llm.generate(prompts, greedy(12))]
        assert llm.scheduler.available == llm.cache.n_slots
    assert outputs[True] == outputs[False] and all(len(t) == 12 for t in outputs[True])
    assert batches[True] == batches[False]  # no pass more: each ends by max_tokens
    order = batches[False]
    follows = [i > 0 and order[i] == order[i - 1] and all(decode for _, decode in order[i]) for i in range(len(order))]
    assert chained[True] == follows and not any(chained[False])
    assert sum(follows) >= 8  # the three decode together at the end (the 5-token prompt's tokens also end first)


@pytest.mark.parametrize("max_tokens,expected", [(1, []), (2, [False]), (3, [False, True]),
                                                 (6, [False, True, True, True, True])])
def test_no_pass_is_queued_past_max_tokens(tiny_llama, max_tokens, expected):
    """The decode passes of one request: a pass is queued ahead only if the sequence will still want a token after
    the one being computed, so a request ending by max_tokens costs no extra pass."""
    llm = LLM(tiny_llama, chunk_size=32)
    seen = passes(llm)
    out = llm.generate([prompt(20, 1)], greedy(max_tokens))[0]
    assert len(out.token_ids) == max_tokens and out.finish_reason == "length"
    assert seen == [False] + expected  # the prefill's pass, then the decode passes


@pytest.mark.parametrize("prefix_cache", [False, True])
def test_the_pass_after_an_end_of_sequence_token_is_dropped_and_its_slot_returned(tiny_llama, prefix_cache):
    """A sequence ending on EOS: its next step was already queued. Its token is dropped (the output ends at EOS as
    without overlap), and every slot comes back: the pool is whole again (with the prefix cache, free or cached)."""
    llm = LLM(tiny_llama, chunk_size=32, prefix_cache=prefix_cache)
    p = prompt(30, 4)
    free = llm.generate([p], greedy(20))[0].token_ids
    end = next(i for i in range(4, 20) if free[i] not in free[:i])  # its first occurrence
    llm.eos_ids = {free[end]}
    seen = passes(llm)
    ended = llm.generate([p], SamplingParams(max_tokens=20, temperature=0))[0]
    assert ended.finish_reason == "stop" and ended.token_ids == free[:end + 1]
    decode = seen[-(end + 1):]
    # tokens 2 .. end + 1 took `end` passes; one more was queued before the EOS token was read, and dropped
    assert decode == [False] + [True] * end
    assert llm.scheduler.available == llm.cache.n_slots
    if not prefix_cache:
        assert llm.cache.num_free == llm.cache.n_slots
    # nothing of the ended request stays queued: the next request's prompt runs at the next step
    nxt = llm.add_request(prompt(10, 5), greedy(3))
    assert llm.step() == [nxt] and len(nxt.output_ids) == 1


def test_abort_while_a_step_is_queued_keeps_the_other_sequence_and_every_slot(tiny_llama, batch_invariant_matmuls):
    """Two requests decode together, one step queued ahead; one is aborted between steps. It gets no token after
    the abort (the queued step's token for it is dropped), the other goes on with the tokens it gets alone."""
    llm = LLM(tiny_llama, chunk_size=32, prefix_cache=False)
    a, b = prompt(40, 5), prompt(60, 6)
    alone = LLM(tiny_llama, chunk_size=32).generate([b], greedy(10))[0].token_ids
    seq_a, seq_b = llm.add_request(a, greedy(10)), llm.add_request(b, greedy(10))
    while len(seq_a.output_ids) < 4:
        llm.step()
    kept = list(seq_a.output_ids)
    llm.abort(seq_a)
    while not seq_b.finished:
        llm.step()
    assert seq_a.output_ids == kept and seq_a.finish_reason == "abort"
    assert seq_b.output_ids == alone
    assert llm.cache.num_free == llm.cache.n_slots


def test_a_request_arriving_mid_decode_gets_what_it_gets_one_step_at_a_time(tiny_llama):
    """A second request arrives while the first decodes ahead of the host: the queue stops (its prompt must be
    prefilled), and both get the tokens of the same calls made without overlap."""
    results = {}
    for overlap in (True, False):
        llm = LLM(tiny_llama, chunk_size=32, overlap_decode=overlap)
        first = llm.add_request(prompt(50, 7), greedy(16))
        for _ in range(5):
            llm.step()
        second = llm.add_request(prompt(70, 8), greedy(8))
        while not (first.finished and second.finished):
            llm.step()
        results[overlap] = (first.output_ids, second.output_ids)
        assert llm.scheduler.available == llm.cache.n_slots
    assert results[True] == results[False]


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=8, temperature=0.8, seed=3, ignore_eos=True),
                                    greedy(8, logprobs=2)])
def test_seeded_and_logprob_requests_wait_for_the_host(tiny_llama, params):
    """A seeded request draws from its own host generator (so that its tokens repeat), and logprobs are read on the
    host: those steps never run ahead."""
    llm = LLM(tiny_llama, chunk_size=32)
    seen = passes(llm)
    out = llm.generate([prompt(20, 2)], params)[0]
    assert len(out.token_ids) == 8 and not any(seen)


def test_unseeded_sampled_requests_run_ahead_with_tokens_drawn_on_the_device(tiny_llama):
    """Sampled without a seed, a request's steps run ahead like greedy ones. top_k 1 leaves one token to draw: the
    greedy tokens, through the device sampler; at temperature 1 the draws differ from greedy but stay in range."""
    llm = LLM(tiny_llama, chunk_size=32)
    want = llm.generate([prompt(20, 3)], greedy(10))[0].token_ids
    seen = passes(llm)
    top1 = llm.generate([prompt(20, 3)], SamplingParams(max_tokens=10, temperature=1.0, top_k=1, ignore_eos=True))[0]
    assert top1.token_ids == want and sum(seen) == 8  # 9 decode passes, the first from host tokens
    torch.manual_seed(0)
    free = llm.generate([prompt(20, 3)], SamplingParams(max_tokens=10, temperature=1.0, ignore_eos=True))[0]
    assert free.token_ids != want and all(0 <= t < llm.config.vocab_size for t in free.token_ids)


def frequencies(logits: torch.Tensor, params, draws: int = 20000) -> torch.Tensor:
    """How often ``sample_on_device`` picks each token of one row of logits, over ``draws`` rows drawn at once."""
    from tokenselect.sampling import sample_on_device

    torch.manual_seed(1)
    picks, failed = sample_on_device(logits.expand(draws, -1).contiguous(), [params] * draws)
    assert not failed.any()
    return torch.bincount(picks, minlength=logits.numel()).double() / draws


LOGITS = torch.tensor([2.0, 1.2, 0.9, 0.1, -0.5, -3.0])


@pytest.mark.parametrize("temperature,top_k,top_p,support", [(0.7, 0, 1.0, 6), (1.3, 3, 1.0, 3), (1.0, 0, 0.7, 2),
                                                              (1.0, 4, 0.9, 3)])
def test_the_device_sampler_draws_from_the_host_samplers_distribution(temperature, top_k, top_p, support):
    """Temperature, then top-k, then top-p, as ``sampling.sample`` applies them: the draws' frequencies match the
    distribution written out here from those definitions (within 5 standard deviations of 20,000 draws), and no
    token outside the kept ones is ever drawn. (softmax(LOGITS) puts 0.52, 0.23, 0.17, ... on the first tokens: top_p
    0.7 keeps two, 0.9 three.)"""
    probs = torch.softmax(LOGITS.double() / temperature, dim=0)
    if top_k:
        probs[top_k:] = 0
    kept = (probs / probs.sum()).cumsum(0) - probs / probs.sum() < top_p
    probs = torch.where(kept, probs, 0)
    probs /= probs.sum()
    assert int((probs > 0).sum()) == support
    got = frequencies(LOGITS, SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p))
    assert torch.all(got[probs == 0] == 0)
    assert torch.all((got - probs).abs() <= 5 * (probs * (1 - probs) / 20000).sqrt() + 1e-9)


def test_the_device_sampler_gives_each_row_its_own_settings():
    """One call, rows of several requests: greedy rows and a near-zero temperature take their argmax, top_k 1 and a
    tiny top_p leave only the largest, and a sampled row draws within its own top_k."""
    from tokenselect.sampling import GREEDY_BELOW, sample_on_device

    rows = torch.randn(6, 50, generator=torch.Generator().manual_seed(4))
    params = [SamplingParams(temperature=0), SamplingParams(temperature=GREEDY_BELOW / 2),
              SamplingParams(temperature=2.0, top_k=1), SamplingParams(temperature=2.0, top_p=1e-6),
              SamplingParams(temperature=5.0, top_k=2), SamplingParams(temperature=0)]
    for seed in range(20):
        torch.manual_seed(seed)
        picks, failed = sample_on_device(rows, params)
        assert not failed.any() and picks.dtype == torch.int64 and picks.shape == (6,)
        assert picks[[0, 1, 2, 3, 5]].tolist() == rows.argmax(dim=-1)[[0, 1, 2, 3, 5]].tolist()
        assert int(picks[4]) in rows[4].topk(2).indices.tolist()


def test_rows_of_nan_logits_fail_and_get_a_token_that_is_safe_to_feed():
    """A NaN anywhere in a row (greedy or sampled), or a sampled row with nothing left to draw (every logit -inf),
    fails: its token is 0, which a step queued on it can embed; the rows beside it draw as usual."""
    from tokenselect.sampling import sample_on_device

    rows = torch.randn(5, 40, generator=torch.Generator().manual_seed(6))
    rows[0, 7] = rows[2, 3] = float("nan")
    rows[3] = float("-inf")
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0), SamplingParams(temperature=0.9),
              SamplingParams(temperature=0.9), SamplingParams(temperature=0.9, top_k=1)]
    picks, failed = sample_on_device(rows, params)
    assert failed.tolist() == [True, False, True, True, False]
    assert picks.tolist() == [0, int(rows[1].argmax()), 0, 0, int(rows[4].argmax())]


def test_a_sequence_whose_queued_step_gives_nan_logits_ends_alone(tiny_llama, batch_invariant_matmuls):
    """Two requests decode ahead of the host; one pass gives the first NaN logits. That request ends with an error
    when the pass is read (the step queued on its token 0 is dropped); the other gets the tokens it gets alone, and
    every slot comes back."""
    a, b = prompt(30, 11), prompt(45, 12)
    alone = LLM(tiny_llama, chunk_size=32).generate([b], greedy(10))[0].token_ids
    llm = LLM(tiny_llama, chunk_size=32, prefix_cache=False)
    seen, real = [], llm.runner.logits

    def logits(chunks, ids, *rest):
        seen.append(isinstance(ids, torch.Tensor))
        out = real(chunks, ids, *rest)
        if sum(seen) == 3 and seen[-1]:  # the third pass queued ahead
            out = out.clone()
            out[0, 5] = float("nan")
        return out

    llm.runner.logits = logits
    seq_a, seq_b = llm.add_request(a, greedy(10)), llm.add_request(b, greedy(10))
    while not (seq_a.finished and seq_b.finished):
        llm.step()
    assert seq_a.finish_reason == "error" and "NaN" in str(seq_a.error) and len(seq_a.output_ids) < 10
    assert seq_b.output_ids == alone and seq_b.finish_reason == "length"
    assert llm.cache.num_free == llm.cache.n_slots


def test_a_queued_step_that_fails_to_launch_falls_back_to_host_steps(tiny_llama):
    """Queueing a step raises once (say the device ran out of memory): its slots go back, the tokens already
    computed are read, and the request goes on one step at a time, with the same tokens."""
    want = LLM(tiny_llama, chunk_size=32).generate([prompt(25, 9)], greedy(10))[0].token_ids
    llm = LLM(tiny_llama, chunk_size=32, prefix_cache=False)
    real, calls = llm.runner.logits, []

    def logits(chunks, ids, *rest):
        calls.append(isinstance(ids, torch.Tensor))
        if sum(calls) == 3 and calls[-1]:
            raise torch.OutOfMemoryError("planted")
        return real(chunks, ids, *rest)

    llm.runner.logits = logits
    out = llm.generate([prompt(25, 9)], greedy(10))[0]
    assert out.token_ids == want and out.finish_reason == "length"
    assert llm.cache.num_free == llm.cache.n_slots
    assert calls.count(True) > 3  # the queue started again after the failed launch
