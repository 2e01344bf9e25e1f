"""Recorded request traces in the Mooncake format, replayed as token-id requests.

A trace is a JSON-lines file, one request per line:

    {"timestamp": 277, "input_length": 32140, "output_length": 92, "hash_ids": [198, 199, ...]}

`timestamp` is the arrival time in milliseconds from the trace's start,
`input_length` and `output_length` the prompt and generated tokens, and
`hash_ids` one id per 512-token block of the prompt. Requests that share a
leading run of ids share those prompt tokens; that is how a trace records
multi-turn reuse. `timestamp` and `hash_ids` may be missing or null (0 and no
ids: the format's writers put null for a value they do not know); unknown
fields are ignored; blank lines, CRLF line ends and a byte-order mark are read;
a line that is not such an object fails with its line number. This
is the format vLLM's, SGLang's and AIPerf's benchmark clients replay
(`mooncake_trace`).

Replay (`TraceSpec.build`):

- every hash id becomes a fixed block of token ids, drawn from the model's
  vocabulary with a generator seeded by the id and the workload seed, so two
  requests that share `k` ids share exactly `k` blocks of leading tokens and a
  prefix cache sees the trace's reuse; a prompt is its blocks, cut to its input
  length (a prompt longer than its blocks is padded with tokens of its own); a
  block's tokens are drawn only as far as the prompts that use it reach, so a
  large scale (blocks of 512 x scale tokens) costs no more than the prompts sent;
- `context_scale` scales the input lengths and the block size alike
  (`512 x scale`, at least 1 token), so a scaled trace keeps its reuse
  structure; `output_scale` scales the output lengths (an `output_length` of
  0, a prefill-only request, is sent with 1 output token: the OpenAI API's
  `max_tokens` must be positive);
- a prompt that does not fit `max_model_len` with its output is cut, and the
  replay counts how many were; a request (prompt + output, after the cut) longer
  than `MAX_REQUEST_TOKENS` is refused before any token is drawn;
- `skip` and `num_requests` choose a window of the file's requests, in file
  order; the window's requests (sessions) are then sent in the order of their
  timestamps, which a file need not be sorted by, from the earliest;
- `conversations=K` replays K multi-turn conversations instead: taking the
  window's requests in timestamp order (file order where they tie), a request
  continues the conversation whose latest turn it extends (it starts with
  that turn's ids, or with all of them but the last, partial block, which the
  next turn's new text changes) and is longer than it. The first K
  conversations of at least two turns, in the order their first turns arrive
  after `skip`, are sent as sessions: each turn once the previous answer is
  back.

The request digest (`kvshard.bench.serve.request_list_digest`) and the file's
SHA-256 in the result show that two runs sent identical requests.

Standard library only, like workloads.py, so a peer engine's virtual
environment can import it.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path

from kvshard.bench.workloads import MAX_REQUEST_TOKENS, BenchRequest, _fraction, _scaled, check_scale

TRACE_BLOCK_TOKENS = 512  # tokens per hash id in the Mooncake format
TIMINGS = ("timestamps", "closed")
MAX_FIELD = 2**63 - 1  # the largest number a field may hold (an int64's)


class TraceError(ValueError):
    """A trace file that cannot be read; the message names the file and line."""


@dataclass(frozen=True)
class TraceRecord:
    line: int  # 1-based line of the file
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def _field(obj: dict, name: str, where: str, *, required: bool = True, minimum: int = 0):
    value = obj.get(name)
    if value is None:  # null is how the format's writers say "unknown": the same as a field left out
        if required:
            raise TraceError(f"{where}: missing field {name!r}" + (" (null)" if name in obj else ""))
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (
            isinstance(value, float) and not math.isfinite(value)):
        raise TraceError(f"{where}: {name!r} must be a number, got {value!r}")
    if isinstance(value, int) and abs(value) > MAX_FIELD:  # nor could float() take it: say so, not OverflowError
        raise TraceError(f"{where}: {name!r} is out of range ({len(str(abs(value)))} digits; at most {MAX_FIELD:,})")
    if name != "timestamp" and value != int(value):
        raise TraceError(f"{where}: {name!r} must be an integer, got {value!r}")
    if value < minimum:
        raise TraceError(f"{where}: {name!r} must be at least {minimum}, got {value!r}")
    return value


def _not_a_request(where: str, text: str, why: str) -> TraceError:
    """A line that holds no request object; a whole file as one JSON array is a common mistake, so say the format."""
    hint = " (a trace is JSON lines: one request object per line, not a JSON array)" if text.lstrip()[:1] == "[" else ""
    return TraceError(f"{where}: {why}{hint}")


def parse_trace_line(text: str, line: int, path: str | Path = "trace") -> TraceRecord | None:
    """Line `line` (1-based) of a trace; None for a blank line."""
    where = f"{path}:{line}"
    if not text.strip():
        return None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as error:
        raise _not_a_request(where, text, f"not JSON ({error.msg} at column {error.colno})") from None
    except ValueError as error:  # e.g. an integer past Python's digit limit for conversion
        raise _not_a_request(where, text, f"not a readable JSON value ({error})") from None
    except RecursionError:
        raise _not_a_request(where, text, "not JSON (nested too deeply)") from None
    if not isinstance(obj, dict):
        raise _not_a_request(where, text, f"expected a JSON object, got {type(obj).__name__}")
    timestamp = _field(obj, "timestamp", where, required=False)
    input_length = _field(obj, "input_length", where, minimum=1)
    output_length = _field(obj, "output_length", where, minimum=0)
    hash_ids = obj.get("hash_ids")
    if hash_ids is None:  # missing or null: a prompt of this request's own tokens
        hash_ids = []
    if not isinstance(hash_ids, list) or any(isinstance(h, bool) or not isinstance(h, int) for h in hash_ids):
        raise TraceError(f"{where}: 'hash_ids' must be a list of integers")
    return TraceRecord(line, float(timestamp or 0.0), int(input_length), int(output_length), tuple(hash_ids))


def read_trace(path: str | Path) -> list[TraceRecord]:
    """Every request of a Mooncake-format file, in file order."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as error:
        raise TraceError(f"cannot read the trace {path}: {error.strerror or error}") from None
    if data[:2] == b"\x1f\x8b":
        raise TraceError(f"{path}: a gzip-compressed file: decompress it first (gunzip)")
    try:
        # utf-8-sig: a byte-order mark (some editors write one) is not part of the first request
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        line = data.count(b"\n", 0, error.start) + 1
        raise TraceError(f"{path}:{line}: not UTF-8 text (byte {error.start:,} of the file); a trace is UTF-8 JSON "
                         "lines, and a compressed one must be decompressed first") from None
    # lines end at line feeds only (CRLF and CR are turned into LF first): str.splitlines would also split at U+2028,
    # U+2029 and U+0085, which JSON allows unescaped inside a string, e.g. of an unknown field
    lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    records = [r for number, line in enumerate(lines, 1) if (r := parse_trace_line(line, number, path))]
    if not records:
        raise TraceError(f"{path}: no requests in the trace")
    return records


def file_sha256(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _prefix_keys(ids: tuple[int, ...]) -> list[int]:
    """keys[k - 1] stands for ids[:k]: a running hash, so that looking up every prefix of a request costs
    O(len(ids)), where hashing a tuple per prefix costs O(len(ids)^2) (seconds per request at 1M tokens)."""
    keys, key = [], 0
    for hash_id in ids:
        key = hash((key, hash_id))
        keys.append(key)
    return keys


def conversations(records: list[TraceRecord]) -> list[list[TraceRecord]]:
    """Group requests into conversations: a request continues the conversation whose latest turn it
    extends (that turn's ids, or all of them but the last, are a prefix of its own) and whose latest
    turn is shorter; otherwise it starts one. The longest such prefix decides."""
    # a latest turn's ids (and those less its last), by prefix key -> (the ids, conversation); the ids are kept
    # to compare, so that two prefixes of one key cannot join a conversation they do not extend
    tails: dict[int, tuple[tuple[int, ...], int]] = {}
    grouped: list[list[TraceRecord]] = []
    for record in records:
        ids, found = record.hash_ids, None
        keys = _prefix_keys(ids)
        for k in range(len(ids), 0, -1):
            tail = tails.get(keys[k - 1])
            if (tail is not None and record.input_length > grouped[tail[1]][-1].input_length
                    and tail[0] == ids[:k]):
                found = tail[1]
                break
        if found is None:
            grouped.append([record])
            found = len(grouped) - 1
        else:
            previous = _prefix_keys(grouped[found][-1].hash_ids)
            for key in previous[-2:]:
                if tails.get(key, ((), None))[1] == found:
                    del tails[key]
            grouped[found].append(record)
        if ids:
            tails[keys[-1]] = (ids, found)
        if len(ids) > 1:
            tails[keys[-2]] = (ids[:-1], found)
    return grouped


def _arrival(session: list[TraceRecord]) -> float:
    """A session's place in the replay: its first turn's timestamp. A file need not be sorted by time (nor is it
    when requests were logged as they finished), so sessions are sent in this order, from the earliest."""
    return session[0].timestamp_ms


class _Block:
    """The token ids of one hash id, drawn as far as a prompt has needed them. Each id is one draw of the block's
    generator (random.choices without weights), so the first n of a block are the same whether it was drawn
    whole or n at a time: a prompt cut to max_model_len costs its own length, not 512 x scale tokens a block."""

    def __init__(self, seed: str, vocab_size: int, size: int) -> None:
        self._rng, self._vocab, self._size = random.Random(seed), range(vocab_size), size
        self._tokens: list[int] = []

    def first(self, n: int) -> list[int]:
        """The block's first min(n, size) token ids."""
        n = min(n, self._size)
        if n > len(self._tokens):
            self._tokens.extend(self._rng.choices(self._vocab, k=n - len(self._tokens)))
        return self._tokens[:n]


@dataclass
class TraceReplay:
    """What a trace turned into: sessions of requests, their first turns' arrival times, and the record."""

    sessions: list[list[BenchRequest]]
    arrivals_s: list[float]  # per session, seconds from the first session's arrival (before time_scale)
    info: dict = field(default_factory=dict)

    @property
    def requests(self) -> list[BenchRequest]:
        return [turn for session in self.sessions for turn in session]


@dataclass(frozen=True)
class TraceSpec:
    """Everything that decides a replay; the same file, spec and seed give the same requests."""

    path: str
    vocab_size: int = 512
    seed: int = 0
    context_scale: float = 1.0
    output_scale: float | None = None  # None: the context scale
    skip: int = 0
    num_requests: int | None = None  # the window's size; None: to the end of the file
    conversations: int | None = None  # K multi-turn conversations as sessions; None: requests one by one
    max_turns: int | None = None  # conversations: at most this many turns of each
    max_model_len: int | None = None  # prompts that do not fit with their output are cut
    timing: str = "timestamps"  # timestamps | closed
    time_scale: float = 1.0  # timestamps: recorded gaps divided by this

    def __post_init__(self) -> None:
        if self.vocab_size < 2:
            raise ValueError(f"vocab size must be at least 2, got {self.vocab_size}")
        if self.context_scale <= 0 or self.effective_output_scale <= 0:
            raise ValueError("--context-scale and --output-scale must be positive")
        if self.skip < 0:
            raise ValueError(f"--trace-skip must be at least 0, got {self.skip}")
        if self.num_requests is not None and self.num_requests < 1:
            raise ValueError(f"--num-prompts must be at least 1, got {self.num_requests}")
        if self.conversations is not None and self.conversations < 1:
            raise ValueError(f"--trace-conversations must be at least 1, got {self.conversations}")
        if self.max_turns is not None and self.max_turns < 2:
            raise ValueError(f"--trace-max-turns must be at least 2, got {self.max_turns}")
        if self.timing not in TIMINGS:
            raise ValueError(f"--trace-timing {self.timing!r} is unknown: use one of {', '.join(TIMINGS)}")
        if not self.time_scale > 0 or not math.isfinite(self.time_scale):
            raise ValueError(f"--time-scale must be a positive number, got {self.time_scale}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"--max-model-len must be at least 2, got {self.max_model_len}")
        check_scale(self.context_scale, "--context-scale")
        check_scale(self.effective_output_scale, "--output-scale")

    @property
    def effective_output_scale(self) -> float:
        return self.context_scale if self.output_scale is None else self.output_scale

    @property
    def block_tokens(self) -> int:
        return _scaled(TRACE_BLOCK_TOKENS, self.context_scale)

    def build(self) -> TraceReplay:
        records = read_trace(self.path)
        window = records[self.skip:]
        if self.conversations is None:
            if self.num_requests is not None:
                window = window[: self.num_requests]
            if not window:
                raise TraceError(f"{self.path}: --trace-skip {self.skip} leaves no request "
                                 f"(the trace has {len(records):,})")
            chosen = sorted(([r] for r in window), key=_arrival)
        else:
            # turns grouped in the order they arrived (a file need not be sorted by time; ties keep file order)
            by_time = sorted(window, key=lambda r: r.timestamp_ms)
            multi = sorted((c for c in conversations(by_time) if len(c) >= 2), key=_arrival)
            if len(multi) < self.conversations:
                raise TraceError(f"{self.path}: {len(multi)} multi-turn conversations after --trace-skip "
                                 f"{self.skip}, fewer than --trace-conversations {self.conversations}")
            chosen = [c[: self.max_turns] if self.max_turns else c for c in multi[: self.conversations]]
        counts = {"cut_prompts": 0, "cut_outputs": 0}
        lengths = [[self._lengths(r, counts) for r in session] for session in chosen]
        self._check_lengths(chosen, lengths)  # every request's, before a token is drawn
        blocks: dict[int, _Block] = {}
        sessions = [[self._request(r, input_len, output_len, blocks)
                     for r, (input_len, output_len) in zip(session, session_lengths)]
                    for session, session_lengths in zip(chosen, lengths)]
        start = chosen[0][0].timestamp_ms
        arrivals = [(s[0].timestamp_ms - start) / 1000 for s in chosen]
        replay = TraceReplay(sessions, arrivals)
        replay.info = {
            "path": str(self.path), "sha256": file_sha256(self.path), "file_requests": len(records),
            "skip": self.skip, "window_requests": len(window) if self.conversations is None else None,
            "conversations": self.conversations, "max_turns": self.max_turns,
            "first_line": min(r.line for s in chosen for r in s), "last_line": max(r.line for s in chosen for r in s),
            "lines": [[r.line for r in s] for s in chosen] if self.conversations else None,
            "block_tokens": self.block_tokens, "context_scale": self.context_scale,
            "output_scale": self.effective_output_scale, "timing": self.timing, "time_scale": self.time_scale,
            "max_model_len": self.max_model_len, **counts,
            "num_requests": sum(len(s) for s in sessions), "num_sessions": len(sessions),
            "input_tokens": sum(r.input_len for s in sessions for r in s),
            "output_tokens": sum(r.output_len for s in sessions for r in s),
            "seed": self.seed, "vocab_size": self.vocab_size,
        }
        return replay

    def _lengths(self, record: TraceRecord, counts: dict[str, int]) -> tuple[int, int]:
        """The prompt and output tokens sent for `record`: scaled, then cut to fit max_model_len."""
        input_len = _scaled(record.input_length, self.context_scale)
        output_len = _scaled(record.output_length, self.effective_output_scale)
        if self.max_model_len is not None:
            if output_len >= self.max_model_len:
                output_len = self.max_model_len - 1
                counts["cut_outputs"] += 1
            if input_len + output_len > self.max_model_len:
                input_len = self.max_model_len - output_len
                counts["cut_prompts"] += 1
        return input_len, output_len

    def _check_lengths(self, chosen: list[list[TraceRecord]], lengths: list[list[tuple[int, int]]]) -> None:
        """Refuse a replay whose longest request exceeds any context window: without a max_model_len to cut to
        (bench dcp and throughput size theirs by the requests), --context-scale 1000 would draw prompts of
        billions of token ids and exhaust the client's memory before anything is sent."""
        longest, record = max(((i + o, r) for s, ls in zip(chosen, lengths) for r, (i, o) in zip(s, ls)),
                              key=lambda pair: pair[0])
        if longest > MAX_REQUEST_TOKENS:
            fix = "lower --context-scale / --output-scale" + ("" if self.max_model_len else
                                                             ", or give --max-model-len to cut the prompts")
            raise TraceError(f"{self.path}:{record.line}: at --context-scale {_fraction(self.context_scale)} "
                             f"and --output-scale {_fraction(self.effective_output_scale)} this request is "
                             f"{longest:,} tokens (prompt + output), more than any model's context window "
                             f"({MAX_REQUEST_TOKENS:,}): {fix}")

    def _request(self, record: TraceRecord, input_len: int, output_len: int,
                 blocks: dict[int, _Block]) -> BenchRequest:
        tokens: list[int] = []
        for hash_id in record.hash_ids:
            if len(tokens) >= input_len:
                break
            block = blocks.get(hash_id)
            if block is None:
                block = blocks[hash_id] = _Block(f"kvshard-trace:{self.seed}:{hash_id}", self.vocab_size,
                                                 self.block_tokens)
            tokens.extend(block.first(input_len - len(tokens)))
        if len(tokens) < input_len:  # more input than blocks: tokens of this request alone
            rng = random.Random(f"kvshard-trace-tail:{self.seed}:{record.line}")
            tokens.extend(rng.choices(range(self.vocab_size), k=input_len - len(tokens)))
        return BenchRequest(tokens, output_len)

    def describe(self) -> str:
        what = (f"{self.conversations} multi-turn conversations" + (f" (at most {self.max_turns} turns)"
                                                                      if self.max_turns else "")
                if self.conversations else
                (f"{self.num_requests} requests" if self.num_requests else "all requests"))
        timing = ("closed loop" if self.timing == "closed" else
                  "recorded arrivals" + (f" / {self.time_scale:g}" if self.time_scale != 1 else ""))
        return (f"trace {Path(self.path).name}: {what} from request {self.skip + 1}, lengths x{_fraction(self.context_scale)} "
                f"(blocks of {self.block_tokens} tokens), outputs x{_fraction(self.effective_output_scale)}, "
                f"{timing}, seed {self.seed}")

