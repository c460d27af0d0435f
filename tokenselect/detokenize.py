"""Incremental detokenization: a generation's text, kept up to date one token at a time.

Decoding the whole output at every token would make a long generation quadratic (at 4K generated tokens
a full decode takes longer than a small model's step). ``IncrementalText`` decodes only the tokens since
the text last grew by whole characters, together with the tokens that grew it then: a tokenizer that treats
a list's first token specially (a dropped leading space) treats it the same in both decodes whose
difference is the new text. Special tokens (which the decode skips) are left out of that window, so a space
after them is not lost to a first-token rule, and a run of them costs nothing. The result is the whole list's
decode for tokenizers whose decoding is local (byte-level BPE, SentencePiece: the decoders of causal LMs); a
WordPiece tokenizer's clean-up of spaces around punctuation that spans the window's start is the known
exception (vLLM's detokenizer shares it).
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"  # what a tokenizer decodes a partial UTF-8 character to


class IncrementalText:
    """The text of a growing list of token ids, as ``tokenizer.decode(ids, skip_special_tokens=True)`` gives it,
    found by decoding only the list's tail at each ``update``.

    text: the text so far; it ends in U+FFFD while the last tokens hold part of a character, which a later
        token may complete (then that tail is replaced).
    stable: the length of the prefix of ``text`` that no later token can change.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.special = set(tokenizer.all_special_ids)  # decoded to nothing: left out of the window
        self.text = ""
        self.stable = 0
        self._seen = 0  # ids taken in so far
        self._context: list[int] = []  # the tokens that completed text[:stable] (decoded again for context)
        self._pending: list[int] = []  # the tokens after them

    def update(self, ids: list[int]) -> str:
        """ids: every token so far, the previous call's followed by new ones. Returns the text now."""
        self._pending += [i for i in ids[self._seen:] if i not in self.special]
        self._seen = len(ids)
        before = self.tokenizer.decode(self._context, skip_special_tokens=True)
        new = self.tokenizer.decode(self._context + self._pending, skip_special_tokens=True)[len(before):]
        self.text = self.text[:self.stable] + new
        if new and not self.text.endswith(REPLACEMENT):
            self.stable, self._context, self._pending = len(self.text), self._pending, []
        return self.text
