"""Per-request sampling settings, named as in vLLM."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# Integers travel as int64 (torch tensors, generator seeds): anything wider is refused at the door.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_LOGPROBS = 20  # OpenAI's limit on alternatives per token
MAX_STOP_STRINGS = 64  # every stop string is searched for at every step
MAX_STOP_LENGTH = 1024  # characters; a stream holds back the longest stop string minus one
MAX_BAD_WORDS = 256  # every bad word is matched against the tail of every sampled row
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for a logit bias: [-100, 100]
MAX_PENALTY = 2.0  # presence and frequency penalties: [-2, 2], as OpenAI and vLLM
MAX_CONSTRAINT_CHARS = 1 << 20  # a schema, regex or grammar longer than this is refused before it is compiled


@dataclass
class StructuredOutputsParams:
    """One output constraint, as vLLM's `structured_outputs` (exactly one field set). `json` is a JSON schema
    (a dict, or its text); `json_object` any JSON object; `regex` a regular expression; `choice` a list of
    strings, one of which is the whole output; `grammar` an EBNF (GBNF) grammar. The grammar backend
    (kvshard/structured/) compiles it off the engine thread; the sampler masks each row to what it allows."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        self.validate()

    def kind(self) -> str:
        """The one field that is set: "json", "regex", "choice", "grammar" or "json_object"."""
        return next(k for k in ("json", "regex", "choice", "grammar", "json_object") if getattr(self, k))

    def validate(self) -> None:
        import json as _json
        given = [k for k in ("json", "regex", "choice", "grammar", "json_object")
                 if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError("structured_outputs takes exactly one of json, regex, choice, grammar, json_object, "
                             f"got {given or 'none'}")
        kind = given[0]
        if kind == "json":
            if isinstance(self.json, str):
                try:
                    loaded = _json.loads(self.json)
                except ValueError as exc:
                    raise ValueError(f"structured_outputs.json is not valid JSON: {exc}") from None
            else:
                loaded = self.json
            if not isinstance(loaded, (dict, bool)):
                raise ValueError("structured_outputs.json must be a JSON schema (an object), "
                                 f"got {type(loaded).__name__}")
            if len(_json.dumps(loaded)) > MAX_CONSTRAINT_CHARS:
                raise ValueError(f"structured_outputs.json is longer than {MAX_CONSTRAINT_CHARS} characters")
        elif kind == "choice":
            if not (isinstance(self.choice, list) and self.choice
                    and all(isinstance(c, str) and c for c in self.choice)):
                raise ValueError("structured_outputs.choice must be a non-empty list of non-empty strings")
            if sum(map(len, self.choice)) > MAX_CONSTRAINT_CHARS:
                raise ValueError(f"structured_outputs.choice is longer than {MAX_CONSTRAINT_CHARS} characters")
        elif kind in ("regex", "grammar"):
            value = getattr(self, kind)
            if not (isinstance(value, str) and value.strip()):
                raise ValueError(f"structured_outputs.{kind} must be a non-empty string")
            if len(value) > MAX_CONSTRAINT_CHARS:
                raise ValueError(f"structured_outputs.{kind} is longer than {MAX_CONSTRAINT_CHARS} characters")
        elif self.json_object is not True:
            raise ValueError("structured_outputs.json_object must be true when given")

    def key(self) -> tuple:
        """What the compiled-grammar cache is keyed by."""
        import json as _json
        kind = self.kind()
        value = getattr(self, kind)
        if kind == "json" and not isinstance(value, str):
            value = _json.dumps(value, sort_keys=True)
        elif kind == "choice":
            value = tuple(value)
        return (kind, value, self.disable_any_whitespace)


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: no limit
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to max_model_len
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False  # the stop string (or a stop token's text) ends the text, as vLLM's
    logprobs: int | None = None  # top-k log-probabilities to return per generated token
    # disaggregated prefill/decode (kvshard/disagg): do_remote_decode on a producer, do_remote_prefill on a consumer
    kv_transfer_params: dict | None = None
    prompt_logprobs: int | None = None  # top-k log-probabilities to return per prompt token after the first
    # Logits processors, applied on rank 0 to each sampled row (kvshard/engine/sampler.py), as vLLM does:
    min_p: float = 0.0  # drop tokens whose probability is below min_p times the top one's (after temperature)
    repetition_penalty: float = 1.0  # tokens of the prompt or output: logit / p if positive, else * p
    presence_penalty: float = 0.0  # logit -= presence_penalty for each token the output holds
    frequency_penalty: float = 0.0  # logit -= frequency_penalty * times the output holds the token
    min_tokens: int = 0  # EOS, stop_token_ids and stop strings cannot end the output before this many tokens
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100]
    bad_words: list[str] | None = None  # words never generated (tokenized with and without a leading space)
    structured_outputs: StructuredOutputsParams | None = None  # guided decoding: the output obeys this constraint
    # vLLM's detokenizer settings, at the only values kvshard has (its text skips special tokens, with no spaces
    # added between them, and is always made): others are refused, as the server refuses them
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    detokenize: bool = True

    # Filled by `prepare` from the engine's tokenizer and model. Never taken from the caller: a copy made with
    # SamplingParams(**vars(params)) starts unprepared (its words may differ) and is prepared again.
    _bad_words_token_ids: list[list[int]] | None = field(default=None, repr=False, compare=False)
    _eos_token_ids: frozenset[int] = field(default=frozenset(), repr=False, compare=False)
    _prepared_for: object = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, (list, tuple, type(None))):
            raise ValueError(f"stop must be a string or a list of non-empty strings, got {self.stop!r}")
        self.stop = list(self.stop or [])
        if not isinstance(self.stop_token_ids, (list, tuple, type(None))):
            raise ValueError(f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}")
        self.stop_token_ids = list(self.stop_token_ids or [])
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        self._bad_words_token_ids, self._eos_token_ids, self._prepared_for = None, frozenset(), None
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        """Raise ValueError naming the field first (the server answers 400 with this text, `param` = that word)."""
        def check(ok: bool, message: str) -> None:
            if not ok:
                raise ValueError(message)

        check(_is_int(self.n, 1), f"n must be an integer >= 1, got {self.n!r}")
        check(_is_finite(self.temperature) and self.temperature >= 0,
              f"temperature must be a finite number >= 0, got {self.temperature!r}")
        check(_is_finite(self.top_p) and 0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p!r}")
        check(_is_int(self.top_k, -1), f"top_k must be -1 (off) or an integer >= 0, got {self.top_k!r}")
        check(self.seed is None or _is_int(self.seed, INT64_MIN),
              f"seed must be an integer in [{INT64_MIN}, {INT64_MAX}], got {self.seed!r}")
        check(self.max_tokens is None or _is_int(self.max_tokens, 1),
              f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        check(all(isinstance(s, str) and s for s in self.stop), "stop must be a list of non-empty strings")
        check(len(self.stop) <= MAX_STOP_STRINGS,
              f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        check(all(len(s) <= MAX_STOP_LENGTH for s in self.stop),
              f"stop strings must be at most {MAX_STOP_LENGTH} characters long")
        check(all(_is_int(t, 0) for t in self.stop_token_ids),
              f"stop_token_ids must be integers in [0, {INT64_MAX}]")
        for name in ("include_stop_str_in_output", "ignore_eos"):
            check(isinstance(getattr(self, name), bool), f"{name} must be true or false, got {getattr(self, name)!r}")
        for name in ("skip_special_tokens", "spaces_between_special_tokens", "detokenize"):
            check(getattr(self, name) is True, f"{name} is not supported by kvshard; leave it at True or out")
        check(self.kv_transfer_params is None or self.n == 1, "n must be 1 when kv_transfer_params is given")
        check(self.logprobs is None or (_is_int(self.logprobs, 0) and self.logprobs <= MAX_LOGPROBS),
              f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        check(self.prompt_logprobs is None or (_is_int(self.prompt_logprobs, 0) and self.prompt_logprobs <= MAX_LOGPROBS),
              f"prompt_logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs!r}")
        check(_is_finite(self.min_p) and 0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p!r}")
        check(_is_finite(self.repetition_penalty) and self.repetition_penalty > 0,
              f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            check(_is_finite(value) and -MAX_PENALTY <= value <= MAX_PENALTY,
                  f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value!r}")
        check(_is_int(self.min_tokens, 0), f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        # (a producer's one-token prefill, which `kvshard proxy` sends with the client's other fields, is exempt:
        # its consumer checks the client's max_tokens)
        remote_decode = (isinstance(self.kv_transfer_params, dict)
                         and bool(self.kv_transfer_params.get("do_remote_decode")))
        check(self.max_tokens is None or self.min_tokens <= self.max_tokens or remote_decode,
              f"min_tokens must be at most max_tokens ({self.max_tokens}), got {self.min_tokens}")
        check(self.logit_bias is None or isinstance(self.logit_bias, dict),
              f"logit_bias must be a dict of token id -> bias, got {type(self.logit_bias).__name__}")
        for token, bias in (self.logit_bias or {}).items():
            check(_is_int(token, 0), f"logit_bias keys must be token ids (integers >= 0), got {token!r}")
            check(_is_finite(bias) and -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS,
                  f"logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {bias!r} "
                  f"for token {token}")
        check(self.bad_words is None or (isinstance(self.bad_words, list)
                                         and all(isinstance(w, str) and w.strip() for w in self.bad_words)),
              "bad_words must be a list of strings that are not blank")
        check(len(self.bad_words or []) <= MAX_BAD_WORDS,
              f"bad_words takes at most {MAX_BAD_WORDS} words, got {len(self.bad_words or [])}")
        check(all(len(w) <= MAX_STOP_LENGTH for w in self.bad_words or []),
              f"bad_words must be at most {MAX_STOP_LENGTH} characters long")
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        check(self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
              "structured_outputs must be a StructuredOutputsParams")

    @property
    def uses_logits_processors(self) -> bool:
        """Whether the sampler must change this request's logits before it chooses (greedy or not)."""
        return bool(self.repetition_penalty != 1.0 or self.presence_penalty or self.frequency_penalty
                    or self.min_tokens or self.logit_bias or self.bad_words or self.structured_outputs)

    def prepare(self, tokenizer, eos_token_ids, vocab_size: int) -> None:
        """Resolve what needs the model: the tokens of `bad_words` (as vLLM: each word with and without a
        leading space, the latter only where the space makes a new first token of the same length), the EOS
        tokens `min_tokens` holds back, and `logit_bias` ids checked against the vocabulary. ValueError
        names the field."""
        key = (id(tokenizer), vocab_size, tuple(self.bad_words or ()), max(self.logit_bias or (), default=-1),
               max(self.stop_token_ids, default=-1))
        if self._prepared_for == key:
            return
        for token in self.logit_bias or {}:
            if token >= vocab_size:
                raise ValueError(f"logit_bias keys must be token ids in [0, {vocab_size}), got {token}")
        if any(token >= vocab_size for token in self.stop_token_ids):  # as the server refuses them
            raise ValueError(f"stop_token_ids must be token ids in [0, {vocab_size}), got "
                             f"{max(self.stop_token_ids)}")
        self._eos_token_ids = frozenset(eos_token_ids)
        eos_held = 0 if self.ignore_eos else len(self._eos_token_ids)
        if self.min_tokens and len(self.stop_token_ids) + eos_held >= vocab_size:  # cheap first: enough of them
            held = set(self.stop_token_ids) | (set() if self.ignore_eos else self._eos_token_ids)
            if all(token in held for token in range(vocab_size)):
                raise ValueError("min_tokens: stop_token_ids (with EOS) cover every token of the vocabulary, so "
                                 "no token could be generated before min_tokens")
        self._bad_words_token_ids = None
        if self.bad_words:
            if tokenizer is None:
                raise ValueError("bad_words needs the model's tokenizer, and this model has none")
            words: list[list[int]] = []
            for word in self.bad_words:
                plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
                spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
                if plain:
                    words.append(plain)
                if spaced and (not plain or (spaced[0] != plain[0] and len(spaced) == len(plain))):
                    words.append(spaced)
            if any(not 0 <= t < vocab_size for ids in words for t in ids):
                raise ValueError(f"bad_words tokenize to token ids outside the vocabulary [0, {vocab_size})")
            self._bad_words_token_ids = words
        self._prepared_for = key


def _is_int(value, minimum: int) -> bool:
    """An int (not a bool) in [minimum, INT64_MAX]."""
    return isinstance(value, int) and not isinstance(value, bool) and minimum <= value <= INT64_MAX


def _is_finite(value) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int too large for a float
        return False
