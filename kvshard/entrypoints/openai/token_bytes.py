"""Each token's raw bytes, for the OpenAI logprobs that need them: chat's `bytes`, completions' `text_offset`.

A token decoded alone is not always text: byte-level BPE (GPT-2, Llama-3, SmolLM2, Qwen, the demo models) and
SentencePiece with byte fallback (Llama-2, Mistral: "<0xE9>") split a multi-byte character across tokens, and
each piece alone decodes to U+FFFD. The bytes come from xgrammar's `TokenizerInfo.decoded_vocab`, which knows
both vocabulary kinds ("Ġthe" -> b" the", "▁the" -> b" the", "<0xE9>" -> b"\\xe9"); a special token's are its
text's UTF-8. The table is built once per tokenizer, on first use (the demo tokenizer's 512 tokens: about 2 ms;
SmolLM2's 49,152: about 0.2 s). Where xgrammar cannot say (it raises, or finds neither byte encoding in a
vocabulary that is not tiktoken's, or its bytes disagree with the tokenizer's own decoding), every token's bytes
are the UTF-8 of the token decoded alone, as before.

The engine's text (engine/output_processor.py: `DecodeStream`, special tokens skipped) is the concatenation of
the tokens' bytes, less the special tokens, and less the first space of the output where the tokenizer's
decoder strips it (SentencePiece's "▁the" at the start reads "the"). `TextCursor` follows that text through
one choice's tokens: each token's bytes as they appear in the text, and its character offset there.
"""

from __future__ import annotations

import codecs
import logging
import threading
import warnings
import weakref

logger = logging.getLogger("kvshard.server")

_SAMPLE = 512  # tokens whose xgrammar bytes are checked against the tokenizer's own decoding


class TokenBytes:
    """One tokenizer's tokens as bytes (`tokenizer` None: a model without one, whose tokens read as their ids)."""

    def __init__(self, tokenizer, vocab_size: int | None = None, stop_token_ids=None) -> None:
        self.tokenizer = tokenizer
        self._backend = getattr(tokenizer, "backend_tokenizer", None)  # what the engine decodes with
        self.special: dict[int, bytes] = {}  # ids the output text skips -> their text's UTF-8
        if self._backend is not None:
            self.special = {i: t.content.encode() for i, t in self._backend.get_added_tokens_decoder().items()
                            if t.special}
        self.strips_leading_space = False  # the decoder drops the first space of a text ("▁the" -> "the")
        self._table: list[bytes] | None = None
        if tokenizer is not None:
            self._table = self._from_xgrammar(vocab_size, stop_token_ids)

    def _from_xgrammar(self, vocab_size: int | None, stop_token_ids) -> list[bytes] | None:
        try:
            import xgrammar

            from kvshard.structured.xgrammar_backend import tokenizer_info

            with warnings.catch_warnings():  # without stop tokens: "... will be automatically detected"
                warnings.simplefilter("ignore")
                info = tokenizer_info(self.tokenizer, vocab_size, stop_token_ids)
            if info.vocab_type == xgrammar.VocabType.RAW and not xgrammar.TokenizerInfo._is_tiktoken_tokenizer(
                    self.tokenizer):
                raise ValueError("neither a byte-level nor a byte-fallback vocabulary")
            table = [bytes(b) for b in info.decoded_vocab]
            self._check(table)
        except Exception as error:  # noqa: BLE001 - any failure: tokens decoded one by one, as before
            logger.warning("logprobs: no raw bytes per token for this tokenizer (%s); each token's bytes are "
                           "its text's", error)
            self.strips_leading_space = False
            return None
        return table

    def _check(self, table: list[bytes]) -> None:
        """The bytes of a sample of tokens against the tokenizer's own decoding of each alone (equal, or less
        the first space where the decoder strips it); sets `strips_leading_space`."""
        if self._backend is None:
            return
        step = max(1, len(table) // _SAMPLE)
        for token_id in range(0, len(table), step):
            data = table[token_id]
            if token_id in self.special or not data:
                continue
            try:
                text = data.decode()
            except UnicodeDecodeError:
                continue  # part of a character: its decoding alone says nothing
            alone = self._backend.decode([token_id], skip_special_tokens=False)
            if alone == text:
                continue
            if text.startswith(" ") and alone == text[1:]:
                self.strips_leading_space = True
                continue
            raise ValueError(f"token {token_id}: xgrammar's bytes {data!r} but the tokenizer decodes {alone!r}")

    def raw(self, token_id: int) -> bytes:
        """The token's own bytes (a special token's: its text's UTF-8)."""
        special = self.special.get(token_id)
        if special is not None:
            return special
        if self._table is not None and 0 <= token_id < len(self._table):
            return self._table[token_id]
        if self.tokenizer is None:
            return str(token_id).encode()
        return self.tokenizer.decode([token_id]).encode()


class TextCursor:
    """Where one choice's output text stands after the tokens passed so far (kept across a stream's chunks)."""

    def __init__(self, vocab: TokenBytes) -> None:
        self.vocab = vocab
        self.chars = 0  # complete characters of the text so far
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._started = False  # some bytes of text have come

    def copy(self) -> TextCursor:
        """A cursor of its own at the same place (the choices of one prompt go on from its echoed text)."""
        other = TextCursor(self.vocab)
        other.chars, other._started = self.chars, self._started
        other._decoder.setstate(self._decoder.getstate())
        return other

    def bytes_at(self, token_id: int) -> bytes:
        """The token's bytes as they would appear next in the text: its own, but for the output's first space
        where the decoder strips it. Changes nothing (the alternatives of a position ask too)."""
        data = self.vocab.raw(token_id)
        if (not self._started and self.vocab.strips_leading_space and token_id not in self.vocab.special
                and data.startswith(b" ")):
            return data[1:]
        return data

    def advance(self, token_id: int) -> tuple[int, bytes]:
        """The token's character offset in the text (a token that starts inside a character: that character's)
        and its bytes there; then past it. A special token adds nothing to the text."""
        offset, data = self.chars, self.bytes_at(token_id)
        if token_id not in self.vocab.special:
            self.chars += len(self._decoder.decode(data))
            self._started = self._started or bool(data)
        return offset, data


_tables: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def token_bytes(tokenizer, vocab_size: int | None = None, stop_token_ids=None) -> TokenBytes:
    """The tokenizer's `TokenBytes`, built on first use and kept as long as the tokenizer (from the `TokenizerInfo`
    the grammar backend uses too, given the engine's stop tokens)."""
    if tokenizer is None:
        return TokenBytes(None)
    with _lock:
        table = _tables.get(tokenizer)
        if table is None:
            table = _tables[tokenizer] = TokenBytes(tokenizer, vocab_size, stop_token_ids)
        return table
