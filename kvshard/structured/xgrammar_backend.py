"""The default grammar backend: xgrammar (Apache-2.0; CPU matchers, token masks filled in C++).

JSON schemas compile in xgrammar's strict mode (no property or item the schema does not name); whitespace
between JSON tokens is bounded to `MAX_WHITESPACE` characters a run (`disable_any_whitespace`: none but
xgrammar's ", " and ": " separators), so that a small model cannot spend max_tokens on blanks. `json_object`
is any JSON object; `choice` an EBNF alternation of the literal strings; `grammar` EBNF (GBNF, rule `root`)
when it holds `::=`, else Lark (rule `start`); `regex` xgrammar's regular expressions (ECMAScript-like).
A JSON schema that uses a form xgrammar compiles without enforcing it (allOf of several schemas, `not`, a $ref
outside the schema, ...: kvshard/structured/json_schema.py) is refused before it is compiled.
"""

from __future__ import annotations

import json
import re
import threading
import weakref

import torch

from kvshard.sampling_params import StructuredOutputsParams
from kvshard.structured.backend import Backend, Grammar
from kvshard.structured.json_schema import check_json_schema

MAX_WHITESPACE = 20  # characters of whitespace a JSON output may hold between two of its tokens
_LOCATION = re.compile(r"^\[[0-9:]+\] [^:\s]+:\d+: ")  # "[00:26:15] cpp/regex_converter.cc:83: " before a message


def _message(error: BaseException) -> str:
    return _LOCATION.sub("", str(error).strip()).strip()


# xgrammar 0.2.8 writes a string with maxLength / minLength as characters of this class, which lets raw control
# characters (a tab, U+0000...) through: invalid JSON that a parser refuses. They are refused as in its unbounded
# strings (an escape is still not offered inside a bounded string: what is written stays valid JSON).
_BOUNDED_STRING_CHAR = r'[^\"\\\r\n]'
_JSON_STRING_CHAR = r'[^\0-\x1f\"\\]'


def json_schema_grammar(xgr, schema: str, whitespace: dict):
    """xgrammar's grammar of a JSON schema (strict mode), its bounded strings' control characters refused."""
    grammar = xgr.Grammar.from_json_schema(schema, strict_mode=True, **whitespace)
    text = str(grammar)
    if _BOUNDED_STRING_CHAR not in text:
        return grammar
    return xgr.Grammar.from_ebnf(text.replace(_BOUNDED_STRING_CHAR, _JSON_STRING_CHAR))


def _parsed(value):
    """The schema as Python values; None for text that is not JSON (xgrammar's compiler reports it)."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except ValueError:
        return None


_infos: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> {(vocab size, stop ids): info}
_infos_lock = threading.Lock()


def tokenizer_info(tokenizer, vocab_size: int | None, stop_token_ids=None):
    """xgrammar's `TokenizerInfo` of a tokenizer (its vocabulary decoded to bytes: a second or so for a large one),
    built once per tokenizer, vocabulary size and stop tokens: the backend's masks and the OpenAI server's logprob
    bytes (entrypoints/openai/token_bytes.py) share it."""
    import xgrammar

    stops = tuple(sorted(stop_token_ids or ()))
    with _infos_lock:
        known = _infos.setdefault(tokenizer, {})
        info = known.get((vocab_size, stops))
        if info is None:
            info = known[(vocab_size, stops)] = xgrammar.TokenizerInfo.from_huggingface(
                tokenizer, vocab_size=vocab_size, stop_token_ids=list(stops) or None)
        return info


class XgrammarGrammar(Grammar):
    def __init__(self, matcher) -> None:
        self.matcher = matcher

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def accept_token(self, token: int) -> bool:
        # an ended matcher (its stop token taken) takes no more: asked anyway, xgrammar warns on stderr each time
        return not self.matcher.is_terminated() and bool(self.matcher.accept_token(token))

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self.matcher.rollback(num_tokens)

    def is_terminated(self) -> bool:
        return bool(self.matcher.is_terminated())


class XgrammarBackend(Backend):
    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int]) -> None:
        super().__init__(tokenizer, vocab_size, stop_token_ids)
        import xgrammar

        self._xgr = xgrammar
        info = tokenizer_info(tokenizer, vocab_size, stop_token_ids)
        # kvshard keeps its own cache (StructuredOutputManager, by StructuredOutputsParams.key())
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=2, cache_enabled=False)

    def compile(self, params: StructuredOutputsParams):
        kind = params.kind()
        value = getattr(params, kind)
        whitespace = dict(any_whitespace=False) if params.disable_any_whitespace else dict(
            any_whitespace=True, max_whitespace_cnt=MAX_WHITESPACE)
        try:
            if kind == "json":
                schema = value if isinstance(value, str) else json.dumps(value)
                parsed = _parsed(value)
                if parsed is not None:
                    check_json_schema(parsed)  # a form xgrammar would not enforce: a ValueError naming it
                return self.compiler.compile_grammar(json_schema_grammar(self._xgr, schema, whitespace))
            if kind == "json_object":
                return self.compiler.compile_json_schema('{"type": "object"}', **whitespace)
            if kind == "regex":
                return self.compiler.compile_regex(value)
            if kind == "choice":
                return self.compiler.compile_grammar("root ::= " + " | ".join(map(json.dumps, value)))
            if "::=" in value:
                return self.compiler.compile_grammar(value)
            return self.compiler.compile_lark(value)
        except (RuntimeError, ValueError, TypeError) as error:  # xgrammar's parse and conversion errors
            raise ValueError(f"structured_outputs.{kind} could not be compiled: {_message(error)}") from None

    def compiled_size_bytes(self, compiled) -> int:
        return int(compiled.memory_size_bytes)

    def new_grammar(self, compiled) -> Grammar:
        return XgrammarGrammar(self._xgr.GrammarMatcher(compiled))

    def apply_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
        self._xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size, indices=rows)
