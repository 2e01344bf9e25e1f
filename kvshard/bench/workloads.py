"""Request lists for the benchmarks: token-id prompts and output lengths, reproducible from a seed.

Prompts are random token ids, so no tokenizer is needed and every engine gets
exactly the same tokens. Request `i` depends only on the seed and on requests
`0..i-1`: the first k requests of a list of 64 are the list of k, which lets a
concurrency sweep and a peer engine replay the identical prefix.

This module uses the standard library only, so a peer engine's virtual
environment can import it without kvshard's dependencies.

The agentic workload follows the shape measured in the seed article (an
agentic coding workload on Kimi K2.6): inputs are bimodal, 53% of them at least
64K tokens (up to 1M), 47% under 64K; outputs are short, median ~400 tokens.
The article gives no more than that, so these are the distributions chosen
(at scale 1; `context_scale` multiplies input lengths, `output_scale` outputs):

- long inputs, probability 0.53: log-uniform on [65,536, 1,048,576] tokens
  (every doubling from 64K to 1M equally likely);
- short inputs, probability 0.47: log-uniform on [2,048, 65,536) tokens
  (an agent's system prompt and tool definitions alone are a few thousand);
- outputs: log-normal with median 400 tokens and sigma 0.5, clipped to
  [50, 1,600] (a quarter of requests above ~560, 1% above ~1,280).

Log-uniform inputs make the long half's median ~256K and its mean ~340K
tokens: the KV cache, not the compute, decides how many requests fit.

The sessions workload is the same traffic as an agent produces it: a session
of K turns starts from one agentic request (its context and answer drawn as
above); each later turn's prompt is the previous turn's prompt, then the
previous answer, then new input (tool output, a file read), log-uniform on
[1,024, 8,192] tokens at scale 1 (median ~2.9K; scaled as the inputs), and
asks for an answer drawn as the outputs above. A client sends the turns of a
session one after another, each once the previous answer has come back.

The previous answer inside the next prompt is the workload's own seeded tokens
of the answer's length, not the tokens the server generated: greedy decoding
may pick other tokens on another engine, dtype or layout, and the point is that
every engine and layout gets identical prompts. A prefix cache therefore finds
the previous *prompt* (whole blocks of it) but not the previous answer, which
is prefilled with the new input, as a server that did not cache generated
tokens would: the prefill of a turn is the answer (a few hundred tokens) plus
the new input (a few thousand), rather than the new input alone.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

AGENTIC_LONG_FRACTION = 0.53
AGENTIC_LONG_RANGE = (65_536, 1_048_576)  # tokens, inclusive
AGENTIC_SHORT_RANGE = (2_048, 65_536)  # tokens, upper bound exclusive
AGENTIC_OUTPUT_MEDIAN = 400
AGENTIC_OUTPUT_SIGMA = 0.5
AGENTIC_OUTPUT_RANGE = (50, 1_600)
SESSION_NEW_INPUT_RANGE = (1_024, 8_192)  # tokens added to the context per turn, log-uniform
# The longest request (prompt + output) any workload may draw: above every model's context window (the longest
# served are ~10M tokens), and a prompt that long is already ~0.5 GB of token ids in the client. A scale that
# would draw longer ones is refused before a token is drawn, not discovered when the machine runs out of memory.
MAX_REQUEST_TOKENS = 1 << 24
SIMPLE_DENOMINATOR = 10**7  # a scale of 1/1048576 still reads best as a fraction; 1/10000000000 as 1e-10

SESSIONS = "sessions"
WORKLOADS = ("random", "agentic", SESSIONS)


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int  # max_tokens, generated in full (ignore_eos)
    long_context: bool = False  # agentic, sessions: the (first) context was drawn from the long mode

    @property
    def input_len(self) -> int:
        return len(self.prompt_token_ids)


@dataclass(frozen=True)
class WorkloadSpec:
    """Everything that decides a request list; the same spec and seed give the same list."""

    kind: str = "random"  # random | agentic | sessions
    vocab_size: int = 512
    seed: int = 0
    input_len: int = 512  # random
    output_len: int = 128  # random
    range_ratio: float = 0.0  # random: lengths uniform in [len * (1 - r), len * (1 + r)]
    context_scale: float = 1.0  # agentic, sessions
    output_scale: float | None = None  # agentic, sessions; None: the context scale
    num_turns: int = 4  # sessions: requests per session

    def __post_init__(self) -> None:
        if self.kind not in WORKLOADS:
            raise ValueError(f"workload {self.kind!r} is unknown: use one of {', '.join(WORKLOADS)}")
        if self.vocab_size < 2:
            raise ValueError(f"vocab size must be at least 2, got {self.vocab_size}")
        if self.kind == "random":
            if self.input_len < 1 or self.output_len < 1:
                raise ValueError("--input-len and --output-len must be at least 1")
            if not 0 <= self.range_ratio < 1:
                raise ValueError(f"--range-ratio must be in [0, 1), got {self.range_ratio}")
        elif self.context_scale <= 0 or self.effective_output_scale <= 0:
            raise ValueError("--context-scale and --output-scale must be positive")
        if self.kind == SESSIONS and self.num_turns < 1:
            raise ValueError(f"--num-turns must be at least 1, got {self.num_turns}")
        if self.kind != "random":  # beyond this, even a 1-token length overflows the ceiling (and round() may)
            check_scale(self.context_scale, "--context-scale")
            check_scale(self.effective_output_scale, "--output-scale")
        self.check_fits(MAX_REQUEST_TOKENS, "any model's context window")

    @property
    def effective_output_scale(self) -> float:
        return self.context_scale if self.output_scale is None else self.output_scale

    def max_request_len(self) -> int:
        """The longest prompt + output this spec can draw: the server's --max-model-len must hold it."""
        if self.kind == "random":
            return _upper(self.input_len, self.range_ratio) + _upper(self.output_len, self.range_ratio)
        longest_answer = _scaled(AGENTIC_OUTPUT_RANGE[1], self.effective_output_scale)
        longest_turn = _scaled(AGENTIC_LONG_RANGE[1], self.context_scale) + longest_answer
        if self.kind == SESSIONS:  # the last turn holds every earlier answer and new input
            longest_turn += (self.num_turns - 1) * (_scaled(SESSION_NEW_INPUT_RANGE[1], self.context_scale)
                                                    + longest_answer)
        return longest_turn

    def check_fits(self, max_model_len: int, limit: str) -> None:
        """Refuse, before a token is drawn, a workload whose longest request would not fit `max_model_len`
        (`limit` says whose): the server would reject each such request, and drawing it could take the client's
        memory (a prompt of the agentic workload at --context-scale 1000 is up to a billion token ids)."""
        longest = self.max_request_len()
        if longest <= max_model_len:
            return
        if self.kind == "random":
            what, lower = (f"the random workload (--input-len {self.input_len}, --output-len {self.output_len}, "
                           f"--range-ratio {self.range_ratio:g})", "lower --input-len or --output-len")
        else:
            what = (f"the {self.kind} workload at --context-scale {_fraction(self.context_scale)} and --output-scale "
                    f"{_fraction(self.effective_output_scale)}")
            lower = "lower the scales" + (" or --num-turns" if self.kind == SESSIONS else "")
        raise ValueError(f"{what} draws requests of up to {longest:,} tokens (prompt + output), more than {limit} "
                         f"({max_model_len:,}): {lower}")

    def requests(self, num: int) -> list[BenchRequest]:
        """`num` independent requests (random, agentic)."""
        if self.kind == SESSIONS:
            raise ValueError("the sessions workload is a list of sessions: draw it with sessions()")
        rng = random.Random(self.seed)
        draw = self._draw_random if self.kind == "random" else self._draw_agentic
        return [draw(rng) for _ in range(num)]

    def sessions(self, num: int) -> list[list[BenchRequest]]:
        """`num` sessions, each a list of turns to send one after another; for random and agentic,
        `num` sessions of one request each. Session `i` depends only on the seed and sessions `0..i-1`."""
        if self.kind != SESSIONS:
            return [[request] for request in self.requests(num)]
        rng = random.Random(self.seed)
        return [self._draw_session(rng) for _ in range(num)]

    def describe(self) -> str:
        if self.kind == "random":
            spread = f" (+-{self.range_ratio:.0%})" if self.range_ratio else ""
            return f"random: {self.input_len} in / {self.output_len} out{spread}, seed {self.seed}"
        scale = self.context_scale
        long_inputs = _span(*(_scaled(x, scale) for x in AGENTIC_LONG_RANGE))
        # a short draw is at most one token under the long range's start, then scaled as every length
        short_inputs = _span(_scaled(AGENTIC_SHORT_RANGE[0], scale), _scaled(AGENTIC_SHORT_RANGE[1] - 1, scale))
        median_out = _scaled(AGENTIC_OUTPUT_MEDIAN, self.effective_output_scale)
        inputs = f"{AGENTIC_LONG_FRACTION:.0%} long inputs {long_inputs}, the rest {short_inputs} tokens"
        if self.kind == SESSIONS:
            new_inputs = _span(*(_scaled(x, scale) for x in SESSION_NEW_INPUT_RANGE))
            return (f"sessions x{_fraction(self.context_scale)}: {self.num_turns} turns each, the first context "
                    f"agentic ({inputs}), then per turn the previous answer and {new_inputs} new tokens; "
                    f"answers median {median_out:,}; seed {self.seed}")
        return f"agentic x{_fraction(self.context_scale)}: {inputs}; outputs median {median_out:,}; seed {self.seed}"

    # --- one request -------------------------------------------------------------------
    def _tokens(self, rng: random.Random, n: int) -> list[int]:
        return rng.choices(range(self.vocab_size), k=n)

    def _draw_random(self, rng: random.Random) -> BenchRequest:
        input_len = _uniform_len(rng, self.input_len, self.range_ratio)
        output_len = _uniform_len(rng, self.output_len, self.range_ratio)
        return BenchRequest(self._tokens(rng, input_len), output_len)

    def _draw_agentic(self, rng: random.Random) -> BenchRequest:
        long_context = rng.random() < AGENTIC_LONG_FRACTION
        low, high = AGENTIC_LONG_RANGE if long_context else AGENTIC_SHORT_RANGE
        tokens = _log_uniform(rng, low, high)
        if not long_context:
            tokens = min(tokens, high - 1)
        input_len = _scaled(tokens, self.context_scale)
        output_len = self._draw_output_len(rng)
        return BenchRequest(self._tokens(rng, input_len), output_len, long_context)

    def _draw_output_len(self, rng: random.Random) -> int:
        output = rng.lognormvariate(math.log(AGENTIC_OUTPUT_MEDIAN), AGENTIC_OUTPUT_SIGMA)
        output = min(max(output, AGENTIC_OUTPUT_RANGE[0]), AGENTIC_OUTPUT_RANGE[1])
        return _scaled(output, self.effective_output_scale)

    def _draw_session(self, rng: random.Random) -> list[BenchRequest]:
        turns = [self._draw_agentic(rng)]
        while len(turns) < self.num_turns:
            previous = turns[-1]
            answer = self._tokens(rng, previous.output_len)  # stands in for the answer: the same on every engine
            new_input = self._tokens(rng, _scaled(_log_uniform(rng, *SESSION_NEW_INPUT_RANGE), self.context_scale))
            turns.append(BenchRequest(previous.prompt_token_ids + answer + new_input, self._draw_output_len(rng),
                                      previous.long_context))
        return turns


def _log_uniform(rng: random.Random, low: float, high: float) -> float:
    """Every doubling between `low` and `high` equally likely."""
    return math.exp(rng.uniform(math.log(low), math.log(high)))


def _fraction(scale: float) -> str:
    """1/1024 rather than 0.000976562; a scale that is no such simple fraction (1/3e299 would be a 300-digit one)
    in %g's notation: 0.3, 2e-300."""
    inverse = 1 / scale
    simple = scale < 1 and inverse <= SIMPLE_DENOMINATOR and math.isclose(inverse, round(inverse), rel_tol=1e-12)
    return f"1/{round(inverse)}" if simple else f"{scale:g}"


def _span(low: int, high: int) -> str:
    """A range of token counts; one count where scaling made the range a single value (never "1-0")."""
    return f"{low:,}-{high:,}" if high > low else f"{max(low, high):,}"


def check_scale(scale: float, flag: str) -> None:
    """A scale above MAX_REQUEST_TOKENS makes every length, even 1 token, longer than any request may be; refused
    here, before a length is scaled (a scale near the largest float would make it infinite)."""
    if scale > MAX_REQUEST_TOKENS:
        raise ValueError(f"{flag} {scale:g} makes even a 1-token length longer than any model's context window "
                         f"({MAX_REQUEST_TOKENS:,} tokens)")


def _scaled(tokens: float, scale: float) -> int:
    return max(1, round(tokens * scale))


def _upper(length: int, ratio: float) -> int:
    return max(1, math.floor(length * (1 + ratio)))


def _uniform_len(rng: random.Random, length: int, ratio: float) -> int:
    if ratio == 0:
        return length
    return rng.randint(max(1, math.ceil(length * (1 - ratio))), _upper(length, ratio))
