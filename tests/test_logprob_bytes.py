"""Logprobs' raw token bytes (chat's `bytes`) and completions' `text_offset`.

A multi-byte character split across byte-level or byte-fallback tokens: each token reports its own bytes, so the
content tokens' bytes joined are the content's UTF-8, and each token's text_offset is its character offset in
the returned text. Checked on the demo model's byte-level tokenizer, on two SentencePiece-style tokenizers with
byte fallback built here (no download), on the serving methods directly (streamed in chunks too), and end to end
through the OpenAI routes of an in-process server.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
from tokenizers.decoders import DecodeStream
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from kvshard.entrypoints.openai.serving_engine import ServingBase
from kvshard.entrypoints.openai.token_bytes import TextCursor, TokenBytes, token_bytes
from kvshard.models.demo import ensure_demo_model

DEMO = "kvshard-demo"
TEXTS = ["é中", "hi 😀!", "The capital of France é中😀 Paris", "a\u0301 naïve ∑ 𝄞"]


def demo_tokenizer():
    return AutoTokenizer.from_pretrained(ensure_demo_model(DEMO))


def sentencepiece_tokenizer(metaspace: bool) -> PreTrainedTokenizerFast:
    """Llama-2 style (normalizer prepends "▁"; decoder Replace, ByteFallback, Fuse, Strip) or Mistral/Metaspace
    style: a BPE over "▁" pieces with the 256 "<0xXX>" byte pieces for what it does not know."""
    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    words = ["▁", "t", "h", "e", "c", "a", "i", "▁t", "th", "▁th", "▁the", "▁c", "▁ca", "▁cat", "é", "▁é", "▁h",
             "▁hi"]
    merges = [("▁", "t"), ("t", "h"), ("▁t", "h"), ("▁th", "e"), ("▁", "c"), ("▁c", "a"), ("▁ca", "t"),
              ("▁", "é"), ("▁", "h"), ("▁h", "i")]
    model = models.BPE(vocab={p: i for i, p in enumerate(pieces + words)}, merges=merges, byte_fallback=True,
                       unk_token="<unk>", fuse_unk=True)
    tokenizer = Tokenizer(model)
    if metaspace:
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
        tokenizer.decoder = decoders.Sequence([decoders.Metaspace(replacement="▁", prepend_scheme="first",
                                                                  split=False),
                                               decoders.ByteFallback(), decoders.Fuse()])
    else:
        tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                               decoders.Strip(" ", 1, 0)])
    tokenizer.add_special_tokens(["<unk>", "<s>", "</s>"])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


TOKENIZERS = {"demo byte-level": demo_tokenizer, "sentencepiece": lambda: sentencepiece_tokenizer(False),
              "sentencepiece metaspace": lambda: sentencepiece_tokenizer(True)}


@pytest.fixture(scope="module", params=list(TOKENIZERS))
def tokenizer(request):
    return TOKENIZERS[request.param]()


def engine_text(tokenizer, token_ids: list[int]) -> str:
    """The output text as the engine builds it (engine/output_processor.py: DecodeStream, specials skipped)."""
    stream, text = DecodeStream(skip_special_tokens=True), ""
    for token_id in token_ids:
        text += stream.step(tokenizer.backend_tokenizer, token_id) or ""
    return text


def server(tokenizer) -> ServingBase:
    serving = ServingBase.__new__(ServingBase)
    serving.tokenizer, serving.vocab_size = tokenizer, len(tokenizer)
    return serving


def fake_logprobs(token_ids: list[int], alternative: int) -> list[dict[int, float]]:
    return [{t: -0.25, alternative: -2.0} if t != alternative else {t: -0.25} for t in token_ids]


def output_ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]


def test_the_tables_kind_and_raw_bytes(tokenizer):
    vocab = token_bytes(tokenizer, len(tokenizer))
    assert vocab._table is not None, "xgrammar gave no bytes for this tokenizer"
    assert token_bytes(tokenizer, len(tokenizer)) is vocab  # built once per tokenizer
    eos = tokenizer.eos_token_id
    assert vocab.raw(eos) == tokenizer.eos_token.encode() and eos in vocab.special
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        joined = b"".join(vocab.raw(t) for t in ids)
        assert joined.decode() in (text, " " + text)  # SentencePiece: "▁" before the first word
    if isinstance(tokenizer.backend_tokenizer.model, models.BPE) and tokenizer.backend_tokenizer.model.byte_fallback:
        assert vocab.strips_leading_space
        assert vocab.raw(tokenizer.convert_tokens_to_ids("<0xE9>")) == b"\xe9"
        assert vocab.raw(tokenizer.convert_tokens_to_ids("▁the")) == b" the"
    else:
        assert not vocab.strips_leading_space
        assert [vocab.raw(t) for t in tokenizer.encode("é", add_special_tokens=False)] == [b"\xc3", b"\xa9"]


@pytest.mark.parametrize("text", TEXTS)
def test_chat_bytes_join_to_the_content(tokenizer, text):
    ids = output_ids(tokenizer, text)
    content = engine_text(tokenizer, ids)
    assert content == text
    logprobs = server(tokenizer)._chat_logprobs(ids, fake_logprobs(ids, tokenizer.eos_token_id), top=2)["content"]
    assert len(logprobs) == len(ids)
    *tokens, eos = logprobs
    assert b"".join(bytes(t["bytes"]) for t in tokens) == content.encode()
    assert (eos["token"], bytes(eos["bytes"])) == (tokenizer.eos_token, tokenizer.eos_token.encode())
    for token in tokens:
        assert token["token"] == bytes(token["bytes"]).decode("utf-8", "replace")
        assert token["top_logprobs"][0]["bytes"] == token["bytes"]  # the chosen one is the most likely here
        assert bytes(token["top_logprobs"][1]["bytes"]) == tokenizer.eos_token.encode()
    if any(ord(c) > 0x7FF for c in text):  # a 3- or 4-byte character: split in every tokenizer here
        assert any(t["token"] == "\ufffd" and len(t["bytes"]) == 1 and t["bytes"][0] >= 0x80 for t in tokens)


@pytest.mark.parametrize("text", TEXTS)
def test_text_offset_lines_up_with_the_text(tokenizer, text):
    ids = output_ids(tokenizer, text)
    content = engine_text(tokenizer, ids)
    logprobs = server(tokenizer)._completion_logprobs(ids, fake_logprobs(ids, tokenizer.eos_token_id))
    offsets = logprobs["text_offset"]
    assert offsets == sorted(offsets) and offsets[0] == 0 and offsets[-1] == len(content)  # EOS: at the end
    vocab = token_bytes(tokenizer)
    cursor, done = TextCursor(vocab), b""
    for token_id, offset, token in zip(ids, offsets, logprobs["tokens"]):
        # the characters completed by the bytes before it: a token inside a character gets that character's
        assert offset == len(done.decode("utf-8", "ignore"))
        data = cursor.advance(token_id)[1]
        if token_id not in vocab.special:
            done += data
        if "\ufffd" not in token and token_id not in vocab.special:
            assert content[offset:].startswith(token)  # a whole token's text is where its offset says
    assert done.decode() == content


def test_the_reported_example():
    """The issue: "é中" in 5 byte-level tokens, then <|end|>."""
    tokenizer = demo_tokenizer()
    ids = output_ids(tokenizer, "é中")
    assert len(ids) == 6
    serving = server(tokenizer)
    chat = serving._chat_logprobs(ids, fake_logprobs(ids, ids[0]), top=0)["content"]
    assert [t["bytes"] for t in chat] == [[0xC3], [0xA9], [0xE4], [0xB8], [0xAD], list(b"<|end|>")]
    assert [t["token"] for t in chat] == ["\ufffd"] * 5 + ["<|end|>"]
    assert all(t["top_logprobs"] == [] for t in chat)
    completion = serving._completion_logprobs(ids, fake_logprobs(ids, ids[0]))
    assert completion["text_offset"] == [0, 0, 1, 1, 1, 2]


@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_streamed_chunks_go_on_from_the_text_before(tokenizer, chunk):
    ids = output_ids(tokenizer, TEXTS[2])
    logprobs = fake_logprobs(ids, tokenizer.eos_token_id)
    serving = server(tokenizer)
    whole = serving._completion_logprobs(ids, logprobs)
    whole_chat = serving._chat_logprobs(ids, logprobs, top=1)
    cursors, chat_cursors, offsets, tokens, content = {}, {}, [], [], []
    for start in range(0, len(ids), chunk):
        part = serving._completion_logprobs(ids[start:start + chunk], logprobs[start:start + chunk], cursors, 3)
        offsets += part["text_offset"]
        tokens += part["tokens"]
        content += serving._chat_logprobs(ids[start:start + chunk], logprobs[start:start + chunk], 1, chat_cursors,
                                          3)["content"]
    assert (offsets, tokens) == (whole["text_offset"], whole["tokens"])
    assert content == whole_chat["content"]


def test_a_sentencepiece_outputs_first_space_is_not_in_its_text():
    tokenizer = sentencepiece_tokenizer(False)
    ids = output_ids(tokenizer, "the cat")
    assert tokenizer.convert_ids_to_tokens(ids[:2]) == ["▁the", "▁cat"]
    chat = server(tokenizer)._chat_logprobs(ids, fake_logprobs(ids, ids[1]), top=2)["content"]
    assert [t["token"] for t in chat] == ["the", " cat", "</s>"]
    assert [t["token"] for t in chat[0]["top_logprobs"]] == ["the", "cat"]  # either would start the text
    assert [t["token"] for t in chat[1]["top_logprobs"]] == [" cat"]
    assert server(tokenizer)._completion_logprobs(ids, fake_logprobs(ids, ids[1]))["text_offset"] == [0, 3, 7]


def test_a_tokenizer_xgrammar_cannot_read_falls_back_to_each_tokens_text():
    """A WordPiece vocabulary (neither byte encoding): each token's bytes are its text's, as before."""
    vocab = {"[UNK]": 0, "[SEP]": 1, "hello": 2, "##s": 3, "world": 4}
    inner = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    inner.pre_tokenizer = pre_tokenizers.Whitespace()
    inner.decoder = decoders.WordPiece()
    inner.add_special_tokens(["[UNK]", "[SEP]"])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=inner, unk_token="[UNK]", eos_token="[SEP]")
    table = TokenBytes(tokenizer, len(tokenizer))
    assert table._table is None
    assert [table.raw(t) for t in (2, 3, 1)] == [b"hello", tokenizer.decode([3]).encode(), b"[SEP]"]


def test_the_grammar_backend_and_the_byte_table_build_one_tokenizer_info(monkeypatch):
    """xgrammar decodes the vocabulary once per tokenizer and stop tokens (a second or so for a large one), for
    the logprobs' bytes and the structured outputs' masks alike."""
    import xgrammar

    from kvshard.structured.xgrammar_backend import XgrammarBackend

    built = []
    real = xgrammar.TokenizerInfo.from_huggingface

    def counting(*args, **kwargs):
        built.append(kwargs.get("stop_token_ids"))
        return real(*args, **kwargs)

    monkeypatch.setattr(xgrammar.TokenizerInfo, "from_huggingface", counting)
    tokenizer = demo_tokenizer()  # a fresh one: nothing cached for it
    table = TokenBytes(tokenizer, len(tokenizer), [1])
    backend = XgrammarBackend(tokenizer, len(tokenizer), [1])
    assert built == [[1]], built
    assert table.raw(tokenizer.convert_tokens_to_ids("Ġthe")) == b" the" and backend.compiler is not None


def test_a_model_without_tokenizer_reads_token_ids():
    serving = ServingBase.__new__(ServingBase)
    serving.tokenizer, serving.vocab_size = None, 100
    completion = serving._completion_logprobs([7, 42], [{7: -1.0}, {42: -2.0}])
    assert (completion["tokens"], completion["text_offset"]) == (["7", "42"], [0, 1])
    assert [t["bytes"] for t in serving._chat_logprobs([7], [{7: -1.0}], 0)["content"]] == [[55]]


# --- end to end: the OpenAI routes of a server in this process -------------------------------------------------

@pytest.fixture(scope="module")
def client() -> Iterator:
    from fastapi.testclient import TestClient

    from kvshard.engine.arg_utils import EngineArgs
    from kvshard.engine.llm_engine import LLMEngine
    from kvshard.entrypoints.openai_server import OpenAIServer

    engine = LLMEngine(EngineArgs.from_kwargs(DEMO, max_model_len=256, kv_cache_memory="16MiB")
                       .create_engine_config())
    with TestClient(OpenAIServer(engine, [DEMO]).app) as test_client:
        yield test_client


def test_the_routes_give_raw_bytes_and_aligned_offsets(client):
    import json

    body = {"model": DEMO, "max_tokens": 16, "temperature": 0, "guided_regex": "é中😀"}
    chat = client.post("/v1/chat/completions", json={**body, "messages": [{"role": "user", "content": "hi"}],
                                                    "logprobs": True, "top_logprobs": 2})
    assert chat.status_code == 200, chat.text
    choice = chat.json()["choices"][0]
    assert choice["message"]["content"] == "é中😀"
    tokens = [t for t in choice["logprobs"]["content"] if t["token"] != "<|end|>"]
    assert len(tokens) == 9  # one token a byte
    assert b"".join(bytes(t["bytes"]) for t in tokens) == "é中😀".encode()
    for token in tokens:  # the alternatives (the model's, before the grammar's mask): bytes of their own too
        assert len(token["top_logprobs"]) == 2
        assert all(alt["token"] == bytes(alt["bytes"]).decode("utf-8", "replace") for alt in token["top_logprobs"])

    completion = client.post("/v1/completions", json={**body, "prompt": "The capital of", "logprobs": 1})
    assert completion.status_code == 200, completion.text
    choice = completion.json()["choices"][0]
    assert choice["text"] == "é中😀"
    assert choice["logprobs"]["text_offset"][:9] == [0, 0, 1, 1, 1, 2, 2, 2, 2]

    def streamed(route: str, **fields) -> list[dict]:
        with client.stream("POST", route, json={**body, **fields, "stream": True}) as response:
            events = [json.loads(line[6:]) for line in response.iter_lines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
        return [e["choices"][0] for e in events if e["choices"]]

    chunks = streamed("/v1/chat/completions", messages=[{"role": "user", "content": "hi"}], logprobs=True)
    streamed_tokens = [t for c in chunks if c["logprobs"] for t in c["logprobs"]["content"]]
    assert "".join(c["delta"].get("content", "") for c in chunks) == "é中😀"
    assert [t["bytes"] for t in streamed_tokens[:-1]] == [t["bytes"] for t in tokens]

    chunks = streamed("/v1/completions", prompt="The capital of", logprobs=1)
    assert "".join(c["text"] for c in chunks) == "é中😀"
    offsets = [o for c in chunks if c["logprobs"] for o in c["logprobs"]["text_offset"]]
    assert offsets == choice["logprobs"]["text_offset"]
