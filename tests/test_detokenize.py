"""Incremental detokenization against a whole decode, with the shipped model's real tokenizer."""
import random

import pytest

from tokenselect import SamplingParams
from tokenselect.data import default_model_path, prose_text
from tokenselect.detokenize import REPLACEMENT, IncrementalText
from tokenselect.models import load_tokenizer


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(default_model_path())


def check_every_step(tok, ids: list[int]) -> int:
    """Feed ids one at a time; at every step the text is the whole decode and the stable prefix never
    changes afterwards. Returns how many steps ended inside a character."""
    text, partial, kept = IncrementalText(tok), 0, ""
    for n in range(1, len(ids) + 1):
        got = text.update(ids[:n])
        assert got == tok.decode(ids[:n], skip_special_tokens=True), n
        assert got.startswith(kept) and text.stable >= len(kept)
        assert not got[:text.stable].endswith(REPLACEMENT)
        kept = got[:text.stable]
        partial += got.endswith(REPLACEMENT)
    return partial


@pytest.mark.parametrize("seed", range(6))
def test_random_tokens_decode_as_a_whole(tok, seed):
    """Random ids over the whole vocabulary: byte tokens that split characters, special tokens."""
    rng = random.Random(seed)
    ids = [rng.randrange(len(tok)) for _ in range(300)]
    ids[5:5] = [tok.eos_token_id, tok.bos_token_id]
    check_every_step(tok, ids)


def test_split_characters_wait_for_their_last_byte(tok):
    """Text with multi-byte characters, some tokenized into single bytes: those steps end in U+FFFD, and the
    next token replaces it."""
    text = "Caf\u00e9 \u4e2d\u6587 na\u00efve \u2014 \U0001F600 \u0416\u0438\u0437\u043d\u044c"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert check_every_step(tok, ids) > 0  # some step did end inside a character


def test_real_prose_decodes_as_a_whole(tok):
    text = prose_text()[100_000:104_000]
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert check_every_step(tok, ids) == 0
    assert IncrementalText(tok).update(ids) == tok.decode(ids)


def test_empty_stop_strings_are_refused():
    with pytest.raises(ValueError, match="non-empty"):
        SamplingParams(stop=["ok", ""])
    with pytest.raises(ValueError, match="non-empty"):
        SamplingParams(stop="")


def test_a_space_after_special_tokens_is_kept():
    """A SentencePiece-style decoder drops the leading space of a list's first token. The window that gives the
    new text its context must not start at a skipped special token (which decodes to nothing), or the space of
    the word after it is lost. A real tokenizer, built in memory with the tokenizers library."""
    from tokenizers import AddedToken, Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "</s>": 1, "\u2581world": 2, "\u2581Hello": 3, "<0xE4>": 4, "<0xB8>": 5, "<0xAD>": 6}
    inner = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    inner.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="first")
    inner.add_special_tokens([AddedToken("</s>", special=True)])
    tok = PreTrainedTokenizerFast(tokenizer_object=inner, eos_token="</s>", unk_token="<unk>")
    assert tok.decode([3, 2, 1, 3], skip_special_tokens=True) == "Hello world Hello"
    for ids in ([3, 2, 1, 3, 2], [3, 1, 1, 2], [1, 3, 2, 1, 1, 1, 3], [3, 4, 1, 5, 1, 6, 2]):
        check_every_step(tok, ids)
    text, ids = IncrementalText(tok), [3, 2] + [1] * 3000
    for n in range(1, len(ids) + 1):  # a long run of end-of-sequence tokens (ignore_eos): the window stays short
        text.update(ids[:n])
        assert len(text._context) + len(text._pending) <= 2
    assert text.update(ids + [3]) == "Hello world Hello"
