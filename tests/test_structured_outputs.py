"""Structured outputs (kvshard/structured): the xgrammar backend on SmolLM2's tokenizer, then the engine.

Backend: for a JSON schema, a regex, a choice and EBNF / Lark grammars, every token of a valid output is
allowed when it comes, tokens that break the constraint are masked (padded vocabulary ids always), the
model's EOS alone ends a complete output and terminates the matcher; drafts accepted and rolled back leave
the masks of never having accepted them. Engine (the tiny random `kvshard-demo-gqa`, byte-level tokenizer):
outputs obey every constraint, and are the same with and without n-gram speculation and prefix caching,
and at tp=1 and tp=2 dcp=2; bad or too-large constraints are refused before the engine loop; a request whose
grammar compiles, or fails to, holds up nobody else.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from conftest import environment
from kvshard.sampling_params import SamplingParams, StructuredOutputsParams as SO
from kvshard.structured import manager as manager_module
from kvshard.structured.manager import StructuredOutputManager, apply_masks
from kvshard.structured.xgrammar_backend import MAX_WHITESPACE

SMOLLM2 = "smollm2-135m-instruct"
PADDED_VOCAB = 49152 + 64  # SmolLM2's 49152 tokens, padded as a model's LM head may be


@pytest.fixture(scope="module")
def smollm2_tokenizer(conversion_cache):
    """SmolLM2-135M-Instruct's tokenizer, as kvshard's conversion of its .gguf saved it (transformers' own reading
    of the file; conftest.py's `conversion_cache`, where the session's SmolLM2 server or tests/test_gguf.py may
    have converted it already); fetched once, skipped offline."""
    from transformers import AutoTokenizer

    from kvshard.config import resolve_model_path
    from kvshard.errors import ConfigError
    from kvshard.models.fetch import fetch_gguf_model

    try:
        gguf = fetch_gguf_model(SMOLLM2)
    except ConfigError as error:
        pytest.skip(f"SmolLM2 not fetchable here: {error}")
    with environment({"KVSHARD_CACHE_DIR": str(conversion_cache)}):
        return AutoTokenizer.from_pretrained(resolve_model_path(gguf))


@pytest.fixture(scope="module")
def manager(smollm2_tokenizer):
    made = StructuredOutputManager(smollm2_tokenizer, PADDED_VOCAB, [smollm2_tokenizer.eos_token_id])
    yield made
    made.shutdown()


def grammar_for(manager, constraint: SO):
    return manager.new_grammar(manager.check(constraint))


def allowed(grammar) -> set[int]:
    """The token ids the grammar's mask leaves finite."""
    logits = torch.zeros(1, PADDED_VOCAB)
    apply_masks(logits, [SimpleNamespace(grammar=grammar)])
    return set(torch.isfinite(logits[0]).nonzero().flatten().tolist())


def walk(grammar, tokenizer, text: str) -> list[set[int]]:
    """Accept `text` token by token, each allowed when it comes; the masks seen before each token."""
    masks = []
    for token in tokenizer.encode(text, add_special_tokens=False):
        masks.append(allowed(grammar))
        assert token in masks[-1], f"{tokenizer.decode([token])!r} of {text!r} is masked"
        assert grammar.accept_token(token)
    return masks


def ends(grammar, tokenizer) -> None:
    """A complete output: the EOS alone is allowed, and accepting it terminates the matcher."""
    assert allowed(grammar) == {tokenizer.eos_token_id}
    assert not grammar.is_terminated()
    assert grammar.accept_token(tokenizer.eos_token_id)
    assert grammar.is_terminated()


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"enum": ["red", "blue"]}}},
          "required": ["name", "age"]}
VALID_JSON = '{"name": "Ann", "age": 31, "tags": ["red", "blue"]}'


def test_json_schema_allows_a_valid_object_and_masks_the_rest(manager, smollm2_tokenizer):
    tok = smollm2_tokenizer
    grammar = grammar_for(manager, SO(json=SCHEMA))
    masks = walk(grammar, tok, VALID_JSON)
    first = masks[0]
    assert first and all(tok.decode([t]).lstrip().startswith("{") for t in first)  # whitespace may lead
    for bad in ("[", "hello", '"', "1"):
        assert ids(tok, bad)[0] not in first
    for mask in masks:  # never a padded id, never the EOS before the object is complete
        assert max(mask) < len(tok) and tok.eos_token_id not in mask
    ends(grammar, tok)
    # a value of the wrong type, and a property the schema does not name, are masked
    grammar = grammar_for(manager, SO(json=SCHEMA))
    walk(grammar, tok, '{"name": ')
    assert ids(tok, "3")[0] not in allowed(grammar) and ids(tok, '"')[0] in allowed(grammar)
    grammar = grammar_for(manager, SO(json=SCHEMA))
    walk(grammar, tok, '{"')
    assert ids(tok, "name")[0] in allowed(grammar) and ids(tok, "zzz")[0] not in allowed(grammar)


def test_whitespace_runs_are_bounded(manager, smollm2_tokenizer):
    tok = smollm2_tokenizer
    space = ids(tok, " ")
    assert len(space) == 1
    grammar = grammar_for(manager, SO(json=SCHEMA))
    walk(grammar, tok, "{")
    for _ in range(MAX_WHITESPACE):
        assert space[0] in allowed(grammar)
        assert grammar.accept_token(space[0])
    assert space[0] not in allowed(grammar)
    assert ids(tok, '"')[0] in allowed(grammar)
    compact = grammar_for(manager, SO(json=SCHEMA, disable_any_whitespace=True))
    walk(compact, tok, "{")
    assert space[0] not in allowed(compact)
    walk(compact, tok, VALID_JSON[1:])
    ends(compact, tok)


def test_bounded_strings_hold_no_raw_control_characters(manager, smollm2_tokenizer):
    """A string with maxLength (as pydantic's max_length writes it) takes no raw tab, newline or U+0000-U+001F,
    which would not parse as JSON (xgrammar 0.2.8 lets them through there); as an unbounded string."""
    tok = smollm2_tokenizer
    controls = {t for t in range(len(tok)) if any(ord(c) < 0x20 for c in tok.decode([t]))}
    assert len(controls) > 20  # the tokenizer has such tokens (its byte tokens, "\t", "\n\n", ...)
    for bound in ({"maxLength": 8}, {"minLength": 1, "maxLength": 8}, {}):
        schema = {"type": "object", "properties": {"s": {"type": "string", **bound}}, "required": ["s"],
                  "additionalProperties": False}
        grammar = grammar_for(manager, SO(json=schema))
        walk(grammar, tok, '{"s": "a')
        inside = allowed(grammar)
        assert ids(tok, "b")[0] in inside
        assert not inside & controls, (bound, [tok.decode([t]) for t in inside & controls])
        walk(grammar, tok, 'b"}')
        ends(grammar, tok)


def test_json_object_allows_any_object_only(manager, smollm2_tokenizer):
    tok = smollm2_tokenizer
    grammar = grammar_for(manager, SO(json_object=True))
    assert ids(tok, "[")[0] not in allowed(grammar)
    walk(grammar, tok, '{"anything": [1, 2.5, null, {"deep": true}]}')
    ends(grammar, tok)


def test_regex(manager, smollm2_tokenizer):
    tok = smollm2_tokenizer
    grammar = grammar_for(manager, SO(regex=r"\d{3}-[a-z]{2}"))
    first = allowed(grammar)
    assert ids(tok, "1")[0] in first and ids(tok, "a")[0] not in first and ids(tok, "-")[0] not in first
    walk(grammar, tok, "123-")
    assert ids(tok, "4")[0] not in allowed(grammar)
    walk(grammar, tok, "ab")
    ends(grammar, tok)


def test_choice(manager, smollm2_tokenizer):
    tok = smollm2_tokenizer
    choices = ["yes", "no", 'maybe "so"']
    first = allowed(grammar_for(manager, SO(choice=choices)))
    assert first and all(any(c.startswith(tok.decode([t])) for c in choices) for t in first)
    assert ids(tok, "hello")[0] not in first and ids(tok, "y")[0] in first
    for choice in choices:
        grammar = grammar_for(manager, SO(choice=choices))
        walk(grammar, tok, choice)
        ends(grammar, tok)
    grammar = grammar_for(manager, SO(choice=choices))
    walk(grammar, tok, "no")
    ends(grammar, tok)  # "no" is complete: nothing may follow it but the EOS


@pytest.mark.parametrize("grammar_text", ['root ::= "(" [0-9]+ ")"', 'start: "(" /[0-9]+/ ")"'],
                         ids=["ebnf", "lark"])
def test_grammar(manager, smollm2_tokenizer, grammar_text):
    tok = smollm2_tokenizer
    grammar = grammar_for(manager, SO(grammar=grammar_text))
    assert ids(tok, ")")[0] not in allowed(grammar) and ids(tok, "1")[0] not in allowed(grammar)
    walk(grammar, tok, "(4")
    assert ids(tok, "a")[0] not in allowed(grammar)
    assert tok.eos_token_id not in allowed(grammar)
    walk(grammar, tok, "2)")
    ends(grammar, tok)


def test_drafts_accepted_then_rolled_back_leave_the_masks_of_never_accepting_them(manager, smollm2_tokenizer):
    tok = smollm2_tokenizer
    tokens = ids(tok, VALID_JSON)
    for start in range(0, len(tokens) - 3, 2):
        drafts = tokens[start : start + 3]
        moved = grammar_for(manager, SO(json=SCHEMA))
        walk(moved, tok, tok.decode(tokens[:start]))
        before = allowed(moved)
        # the rows of a verification step: the mask after each prefix of the drafts
        rows = [SimpleNamespace(grammar=moved)] * (len(drafts) + 1)
        logits = torch.zeros(len(rows), PADDED_VOCAB)
        apply_masks(logits, rows, [drafts[:j] for j in range(len(rows))])
        for j in range(len(rows)):
            fresh = grammar_for(manager, SO(json=SCHEMA))
            for token in tokens[:start] + drafts[:j]:
                assert fresh.accept_token(token)
            assert set(torch.isfinite(logits[j]).nonzero().flatten().tolist()) == allowed(fresh), (start, j)
        assert allowed(moved) == before  # the fills rolled the drafts back
        for token in drafts:
            assert moved.accept_token(token)
        moved.rollback(len(drafts))
        assert allowed(moved) == before
        assert moved.validate_tokens(drafts) == len(drafts) and allowed(moved) == before
    # a draft the grammar refuses: the valid prefix counts, the rows after it are left alone
    grammar = grammar_for(manager, SO(json=SCHEMA))
    bad = ids(tok, '{"x')
    assert grammar.validate_tokens(bad) == 1
    logits = torch.zeros(3, PADDED_VOCAB)
    apply_masks(logits, [SimpleNamespace(grammar=grammar)] * 3, [[], bad[:1], bad[:2]])
    assert not torch.isfinite(logits[1]).all() and torch.isfinite(logits[2]).all()
    assert allowed(grammar) == set(torch.isfinite(logits[0]).nonzero().flatten().tolist())


def test_verification_rows_are_masked_after_the_drafts_before_them(manager, smollm2_tokenizer):
    """Drafts from a model that ignores the constraint (a draft model's): the raw logits favour every draft,
    one of which breaks the grammar; verification keeps the drafts before it, and the token it gets in its
    place is one the grammar allows there, greedy or sampled."""
    from kvshard.engine.sampler import verify_drafts

    tok = smollm2_tokenizer
    drafts = ids(tok, '{"name": 7')  # the 7 breaks the schema: a string must come
    broken = drafts.index(ids(tok, "7")[-1])
    for temperature in (0.0, 1.0):
        for seed in range(3):
            grammar = grammar_for(manager, SO(json=SCHEMA))
            seq = SimpleNamespace(params=SamplingParams(temperature=temperature, structured_outputs=SO(json=SCHEMA)),
                                  grammar=grammar, output_token_ids=[], prompt_token_ids=[1, 2, 3],
                                  generator=torch.Generator().manual_seed(seed))
            logits = torch.randn(len(drafts) + 1, PADDED_VOCAB, generator=torch.Generator().manual_seed(seed))
            logits[range(len(drafts)), drafts] += 30.0  # every draft is the raw argmax of its row
            [tokens] = verify_drafts(logits, [seq], [drafts], torch.Generator().manual_seed(0))
            assert tokens[:broken] == drafts[:broken] and len(tokens) == broken + 1, tokens
            for token in drafts[:broken]:
                assert grammar.accept_token(token)
            assert tokens[-1] in allowed(grammar) and tokens[-1] != drafts[broken]


def test_masks_compose_with_the_other_logits_processors(manager, smollm2_tokenizer):
    """A logit_bias of +100 and penalties do not bring back a token the grammar forbids, greedy or sampled."""
    from kvshard.engine.sampler import sample

    tok = smollm2_tokenizer
    forbidden = ids(tok, "hello")[0]
    for temperature in (0.0, 1.0):
        params = SamplingParams(temperature=temperature, logit_bias={forbidden: 100.0}, repetition_penalty=1.3,
                                structured_outputs=SO(regex="(yes|no)"))
        grammar = grammar_for(manager, params.structured_outputs)
        seq = SimpleNamespace(params=params, grammar=grammar, output_token_ids=[], prompt_token_ids=[forbidden],
                              generator=torch.Generator().manual_seed(1))
        [token] = sample(torch.zeros(1, PADDED_VOCAB), [seq], torch.Generator().manual_seed(0))
        assert token in allowed(grammar) and token != forbidden


@pytest.mark.parametrize("constraint, field", [
    (dict(regex="(a"), "structured_outputs.regex"),
    (dict(json={"type": "nope"}), "structured_outputs.json"),
    (dict(grammar='root ::= foo'), "structured_outputs.grammar"),
    (dict(grammar='start: "a" undefined_rule'), "structured_outputs.grammar"),
])
def test_a_constraint_that_does_not_compile_is_a_value_error_naming_the_field(manager, constraint, field):
    with pytest.raises(ValueError, match=re.escape(field) + " could not be compiled: .+") as raised:
        manager.check(SO(**constraint))
    assert "/" not in str(raised.value).split(":", 1)[1][:30]  # xgrammar's source location is cut


def test_compiles_are_cached_and_too_large_grammars_refused(manager, monkeypatch):
    constraint = SO(regex="[a-z]{1,40}@example[.]com")
    assert manager.submit(constraint) is manager.submit(SO(regex="[a-z]{1,40}@example[.]com"))
    monkeypatch.setattr(manager_module, "MAX_COMPILED_BYTES", 1000)
    with pytest.raises(ValueError, match=r"structured_outputs\.json is too large: its compiled grammar takes"):
        manager.check(SO(json={"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(50)}}))


# --- the engine ---------------------------------------------------------------------------------------

MODEL = "kvshard-demo-gqa"
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
ENGINE = dict(max_model_len=256, block_size=4, num_kv_blocks=256, speculative_config=NGRAM)
LAYOUTS = {"tp1": {}, "tp2-dcp2": dict(tensor_parallel_size=2, decode_context_parallel_size=2)}
BOUNDED_SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                                   "ok": {"type": "boolean"},
                                                   "n": {"type": "integer", "minimum": 0, "maximum": 99}},
                  "required": ["color", "ok", "n"]}
# (constraint, how to check the text): each bounded, so that a random model completes it
CONSTRAINTS = [
    (SO(json=BOUNDED_SCHEMA, disable_any_whitespace=True),
     lambda text: set(json.loads(text)) == {"color", "ok", "n"} and json.loads(text)["color"] in ("red", "green", "blue")),
    (SO(regex=r"[a-c]{2,5}-\d{2}"), lambda text: re.fullmatch(r"[a-c]{2,5}-\d{2}", text)),
    (SO(choice=["yes", "no", "maybe so"]), lambda text: text in ("yes", "no", "maybe so")),
    (SO(grammar='root ::= "(" [0-9] [0-9]? ")" | "[" ("x" | "y")+ "]"'),
     lambda text: re.fullmatch(r"\([0-9]{1,2}\)|\[[xy]+\]", text)),
]
# prompts that hold text the n-gram drafter proposes from (and the grammar refuses in part)
PROMPTS = ['{"color": "red", "ok": true, "n": 7} {"color": "blue", "ok": false, "n": 42}',
           "abc-12 cab-34 aab-99 xyz-00", "maybe so, yes, no, maybe so", "(12) [xyxy] (3) [yy] (45)"]


@pytest.fixture(scope="module")
def engines():
    from kvshard.entrypoints.llm import LLM

    made: dict[str, LLM] = {}

    def get(layout: str) -> LLM:
        if layout not in made:
            made[layout] = LLM(MODEL, **ENGINE, **LAYOUTS[layout])
        return made[layout]

    yield get
    for llm in made.values():
        llm.close()


def run(llm, temperature: float = 0.0, speculate: bool = False,
        max_tokens: int = 40) -> list[tuple[str, str, list[int]]]:
    engine = llm.engine
    speculative, engine.speculative = engine.speculative, (engine.speculative if speculate else None)
    try:
        params = [SamplingParams(temperature=temperature, seed=11, max_tokens=max_tokens, structured_outputs=c)
                  for c, _ in CONSTRAINTS]
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    finally:
        engine.speculative = speculative
    assert all(o.error is None for o in outputs)
    return [(o.outputs[0].text, o.outputs[0].finish_reason, list(o.outputs[0].token_ids)) for o in outputs]


@pytest.fixture(scope="module")
def reference(engines):
    """tp=1, no speculation, nothing cached."""
    llm = engines("tp1")
    llm.reset_prefix_cache()
    return {"greedy": run(llm), "seeded": run(llm, temperature=1.0)}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_outputs_obey_the_constraint_and_do_not_depend_on_speculation_caching_or_layout(engines, reference,
                                                                                       layout):
    for mode in ("greedy", "seeded"):
        for (text, reason, _), (_, check) in zip(reference[mode], CONSTRAINTS):
            assert reason == "stop" and check(text), (mode, text, reason)
    llm = engines(layout)
    stats = llm.engine.stats
    llm.reset_prefix_cache()
    assert run(llm) == reference["greedy"]  # cold (on tp=1: what the reference computed again)
    hits = stats().prefix_cache_hits
    assert run(llm) == reference["greedy"]  # every prompt's blocks cached now
    assert stats().prefix_cache_hits > hits
    drafted = stats().spec_decode_num_draft_tokens
    assert run(llm, speculate=True) == reference["greedy"]
    assert stats().spec_decode_num_accepted_tokens > 0 and stats().spec_decode_num_draft_tokens > drafted
    if layout == "tp1":  # seeded sampling: the same draws with and without cached prefixes
        assert run(llm, temperature=1.0) == reference["seeded"]
    assert stats().kv_blocks_used == 0


def test_a_bad_constraint_is_refused_before_the_engine_loop(engines, monkeypatch):
    from kvshard.engine.async_engine import AsyncLLMEngine

    llm = engines("tp1")
    bad = SamplingParams(structured_outputs=SO(regex="[unclosed"))
    with pytest.raises(ValueError, match=r"structured_outputs\.regex could not be compiled"):
        llm.generate(["one", "two"], [SamplingParams(), bad], use_tqdm=False)
    assert not llm.engine.requests and not llm.engine.has_unfinished_requests()  # nothing was queued
    with pytest.raises(ValueError, match=r"structured_outputs\.regex could not be compiled"):
        llm.engine.check_structured_outputs(bad)
    engine = AsyncLLMEngine.__new__(AsyncLLMEngine)  # its check needs no loop thread
    engine.engine = llm.engine
    with pytest.raises(ValueError, match=r"structured_outputs\.json could not be compiled"):
        asyncio.run(engine.check_structured_outputs(SamplingParams(structured_outputs=SO(json={"type": 5}))))
    asyncio.run(engine.check_structured_outputs(SamplingParams(structured_outputs=SO(regex="ok"))))
    too_large = SamplingParams(structured_outputs=SO(json={"type": "object", "properties": {
        f"q{i}": {"type": "integer"} for i in range(40)}}))
    with monkeypatch.context() as patch:
        patch.setattr(manager_module, "MAX_COMPILED_BYTES", 1000)
        with pytest.raises(ValueError, match=r"structured_outputs\.json is too large"):
            llm.generate(["one"], too_large, use_tqdm=False)
    assert not llm.engine.requests

def test_a_request_waiting_for_its_grammar_holds_up_nobody(engines, monkeypatch):
    """Compiles held on purpose: the plain request finishes meanwhile; then the good grammar's request
    finishes under its constraint and the bad one fails alone with the compiler's message."""
    llm = engines("tp1")
    engine = llm.engine
    gate = threading.Event()
    compile_now = engine.structured._compile

    def held(params):
        assert gate.wait(60)
        return compile_now(params)

    monkeypatch.setattr(engine.structured, "_compile", held)
    # ignore_eos: the terminated grammar, not the EOS, ends it
    good = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, structured_outputs=SO(regex=r"held-[0-9]{3}"))
    bad = SamplingParams(temperature=0, max_tokens=30, structured_outputs=SO(regex=r"held-[0-9"))
    engine.add_request("good", "hello", good)
    engine.add_request("bad", "hello", bad)
    engine.add_request("plain", "hello", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    finished = {}
    deadline = time.monotonic() + 120
    for _ in range(200):
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
        if "plain" in finished or time.monotonic() > deadline:
            break
    assert list(finished) == ["plain"] and len(finished["plain"].outputs[0].token_ids) == 8
    assert all(seq.grammar is None and not seq.output_token_ids for rid in ("good", "bad")
               for seq in engine.requests[rid].seqs)
    gate.set()
    for _ in range(200):
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
        if len(finished) == 3 or time.monotonic() > deadline:
            break
    assert re.fullmatch(r"held-[0-9]{3}", finished["good"].outputs[0].text)
    assert finished["good"].outputs[0].finish_reason == "stop" and finished["good"].error is None
    assert finished["bad"].outputs[0].finish_reason == "error"
    assert "structured_outputs.regex could not be compiled" in finished["bad"].error
    assert engine.stats().kv_blocks_used == 0 and not engine.has_unfinished_requests()
