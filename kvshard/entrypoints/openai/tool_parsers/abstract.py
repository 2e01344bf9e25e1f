"""What every tool-call parser shares.

A parser reads the text a model wrote so far and says what it holds: the content (text for the user) and
the calls, each with its name once that is whole and its arguments as the raw JSON text written so far.
The same function serves a finished output and a stream: `ToolCallStream` diffs one parse against the
last and hands out OpenAI's deltas (a call's id, type and name once, in its first delta; then fragments of
its arguments), so the fragments of a call always add up to the arguments a non-streamed answer gives.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar


@dataclass
class ParsedCall:
    name: str | None  # None until the name is whole
    arguments: str  # the raw JSON text of the arguments, as far as it is written
    complete: bool = False  # the call's text has ended
    id: str | None = None  # an id the format itself gives (Kimi K2's), else one is made


@dataclass
class Parsed:
    content: str  # text for the user: in a stream, only what can no longer turn out to start a call
    calls: list[ParsedCall] = field(default_factory=list)


class ToolParser:
    """One model family's tool-call format. `parse(text, final)`: what `text` holds; with `final` the
    output has ended, so nothing is held back any more."""

    name: ClassVar[str]

    def parse(self, text: str, final: bool) -> Parsed:
        raise NotImplementedError


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


# --- JSON text scanning (raw spans, so that streamed fragments equal the final text) ---------------------

_WS = " \t\r\n"


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def _string_end(text: str, i: int) -> int | None:
    """text[i] == '"': the index after the closing quote, or None if the string is not closed yet."""
    j = i + 1
    while j < len(text):
        c = text[j]
        if c == "\\":
            j += 2
            continue
        if c == '"':
            return j + 1
        j += 1
    return None


def value_end(text: str, i: int) -> int | None:
    """The index after the JSON value that starts at text[i], or None while it is not whole. Objects and
    arrays end at their closing bracket; a number or literal needs a character after it to be known ended."""
    if i >= len(text):
        return None
    c = text[i]
    if c == '"':
        return _string_end(text, i)
    if c in "{[":
        depth, j = 0, i
        while j < len(text):
            c = text[j]
            if c == '"':
                end = _string_end(text, j)
                if end is None:
                    return None
                j = end
                continue
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    j = i
    while j < len(text) and text[j] not in _WS + ",}]":
        j += 1
    return j if j < len(text) else None


def _first_marker(text: str, i: int, markers: tuple[str, ...]) -> int:
    """The index of the first of `markers` at or after text[i], or -1."""
    found = [at for at in (text.find(marker, i) for marker in markers) if at >= 0]
    return min(found) if found else -1


def unclosed_value(text: str, i: int, call_end: tuple[str, ...]) -> tuple[str, int | None]:
    """A JSON value that starts at text[i] and is not closed: its text as far as it goes, and where the call ends
    if one of `call_end` (the format's end-of-call markers) follows, else None. A call the model ended without
    closing its JSON ends at the marker (the marker and the text after it are not the value's); while no marker
    is whole, the first characters of one at the end are held back, so that a stream never sends them."""
    stop = _first_marker(text, i, call_end) if call_end else -1
    if stop >= 0:
        return text[i:stop].rstrip(), stop
    return text[i:max(i, held_back(text, call_end))] if call_end else text[i:], None


def scan_call_object(text: str, i: int, name_keys: tuple[str, ...] = ("name",),
                     argument_keys: tuple[str, ...] = ("arguments", "parameters"),
                     call_end: tuple[str, ...] = ()) -> tuple[ParsedCall | None, int | None]:
    """A call written as one JSON object at text[i] ({"name": ..., "arguments": {...}}): the call as far as it
    is written (None if nothing of it is yet) and the index after the object, or None while it is open. With
    `call_end` (the format's end-of-call markers), a marker met where the object is still open ends the call
    there: the index returned is the marker's."""
    assert text[i] == "{"
    name: str | None = None
    arguments = ""
    j = skip_ws(text, i + 1)
    while j < len(text):
        if text[j] == "}":
            return ParsedCall(name, arguments, complete=True), j + 1
        if text[j] == ",":
            j = skip_ws(text, j + 1)
            continue
        if any(text.startswith(marker, j) for marker in call_end):
            return ParsedCall(name, arguments, complete=True), j  # the object left open, the call ended
        if any(marker.startswith(text[j:]) for marker in call_end):
            break  # an end marker's first characters: the call is still open
        if text[j] != '"':
            return None, None  # not a JSON object after all
        key_end = _string_end(text, j)
        if key_end is None:
            _, stop = unclosed_value(text, j, call_end)
            if stop is not None:
                return ParsedCall(name, arguments, complete=True), stop
            break
        key = json.loads(text[j:key_end])
        j = skip_ws(text, key_end)
        if j >= len(text):
            break
        if any(text.startswith(marker, j) for marker in call_end):
            return ParsedCall(name, arguments, complete=True), j
        if any(marker.startswith(text[j:]) for marker in call_end):
            break
        if text[j] != ":":
            return None, None
        j = skip_ws(text, j + 1)
        if j >= len(text):
            break
        end = value_end(text, j)
        if end is None:
            written, stop = unclosed_value(text, j, call_end)
            if key in argument_keys:
                arguments = written
            if stop is not None:
                return ParsedCall(name, arguments, complete=True), stop
            break
        if key in argument_keys:
            arguments = text[j:end]
        if key in name_keys and text[j] == '"':
            name = json.loads(text[j:end])
        j = skip_ws(text, end)
    return ParsedCall(name, arguments), None


def scan_call_objects(text: str, i: int, next_start: Callable[[str, int], int],
                      call_end: tuple[str, ...] = ()) -> list[ParsedCall]:
    """Calls written as JSON objects one after another from text[i] (`scan_call_object`, ended early by one of
    `call_end`), as far as they are written; `next_start(text, end)`: where the call after one that ends at `end`
    begins (its `{`), or -1."""
    calls: list[ParsedCall] = []
    while 0 <= i < len(text) and text[i] == "{":
        call, end = scan_call_object(text, i, call_end=call_end)
        if call is None:
            break
        calls.append(call)
        if end is None:
            break
        i = next_start(text, end)
    return calls


def after_separator(separator: str) -> Callable[[str, int], int]:
    """`next_start` for calls separated by `separator` (and whitespace)."""
    def next_start(text: str, end: int) -> int:
        i = skip_ws(text, end)
        return skip_ws(text, i + 1) if text.startswith(separator, i) else i
    return next_start


def after_marker(marker: str) -> Callable[[str, int], int]:
    """`next_start` for calls that each follow `marker` (and whitespace)."""
    def next_start(text: str, end: int) -> int:
        at = text.find(marker, end)
        return skip_ws(text, at + len(marker)) if at >= 0 else -1
    return next_start


def scan_marked_calls(text: str, section: int, call_begin: str,
                      header: Callable[[str, int], tuple[ParsedCall, int] | None],
                      call_end: tuple[str, ...] = ()) -> list[ParsedCall]:
    """Calls each opened by `call_begin` after the section marker at `section` (-1: none), as far as they are
    written: `header(text, at)` reads the call's name (and id) from the call opened at `at` and says where its
    arguments' JSON begins, or None while that is not written yet; the arguments end with their JSON value, or
    at one of `call_end` where the model ended the call with its JSON still open."""
    calls: list[ParsedCall] = []
    at = text.find(call_begin, section) if section >= 0 else -1
    while at >= 0:
        head = header(text, at)
        if head is None:
            break
        call, i = head
        calls.append(call)
        if i >= len(text):
            break
        end = value_end(text, i)
        if end is None:
            call.arguments, stop = unclosed_value(text, i, call_end)
            if stop is None:
                break
            call.complete = True
            at = text.find(call_begin, stop)
            continue
        call.arguments = text[i:end]
        call.complete = True
        at = text.find(call_begin, end)
    return calls


def section_parse(text: str, section: int, marker: str, calls: list[ParsedCall], final: bool) -> Parsed:
    """The parse of a format whose calls follow a section `marker` at `section` (-1: none yet)."""
    if final and not calls:
        return Parsed(text)
    return Parsed(content_before(text, section if section >= 0 else None, (marker,), final), calls)


def no_call_is_content(text: str, calls: list[ParsedCall], final: bool, content: str = "") -> Parsed:
    """A parse whose calls are `calls`; once the output has ended without a named call, all of it is content."""
    if final and not any(call.name for call in calls):
        return Parsed(text)
    return Parsed(content, calls)


def held_back(text: str, markers: tuple[str, ...]) -> int:
    """Where `text` may begin a marker that is not whole yet: the length of content that is safe to send."""
    for k in range(min(len(text), max(map(len, markers)) - 1), 0, -1):
        if any(marker.startswith(text[-k:]) for marker in markers):
            return len(text) - k
    return len(text)


def content_before(text: str, start: int | None, markers: tuple[str, ...], final: bool) -> str:
    """The content of a parse: the text before the first call's marker (`start`), or all of it when no call
    began. In a stream, a possible marker's first characters and trailing whitespace are held back."""
    if start is None:
        return text if final else text[:held_back(text, markers)].rstrip()
    return text[:start].rstrip()


def arguments_json(call: ParsedCall) -> str:
    """A finished call's arguments as OpenAI gives them: a JSON text (an object). A call the output ended in
    (cut by max_tokens) keeps what was written of them, an empty text if nothing: "{}" would read as a whole
    call without arguments."""
    raw = call.arguments.strip()
    if raw.startswith('"'):  # some models write the arguments as a JSON string that holds the object
        try:
            inner = json.loads(raw)
            return inner if isinstance(inner, str) else raw
        except ValueError:
            return raw
    return raw or ("{}" if call.complete else "")


# --- the stream ---------------------------------------------------------------------------------------

class ToolCallStream:
    """Deltas of one choice's content and calls as its text grows (OpenAI's chunk shapes), from a parser.
    `max_calls` (1 with parallel_tool_calls false) drops the calls after the first ones."""

    def __init__(self, parser: ToolParser, max_calls: int | None = None) -> None:
        self.parser = parser
        self.max_calls = max_calls
        self.sent_content = ""
        self.sent: list[tuple[str, str]] = []  # per call: its id, and the arguments text sent
        self.calls: list[dict[str, Any]] = []  # the calls as a whole (for a final check)

    def feed(self, text: str, final: bool) -> tuple[str, list[dict[str, Any]]]:
        """`text`: the whole output so far. The new content and tool_call deltas since the last feed."""
        parsed = self.parser.parse(text, final)
        content = ""
        if parsed.content.startswith(self.sent_content):
            content, self.sent_content = parsed.content[len(self.sent_content):], parsed.content
        calls = parsed.calls[: self.max_calls] if self.max_calls is not None else parsed.calls
        deltas: list[dict[str, Any]] = []
        for index, call in enumerate(calls):
            if call.name is None:
                break  # a later call cannot be named before this one
            arguments = arguments_json(call) if (final or call.complete) else _streamable(call.arguments)
            if index == len(self.sent):
                call_id = call.id or new_call_id()
                self.sent.append((call_id, ""))
                self.calls.append({"id": call_id, "name": call.name})
                deltas.append({"index": index, "id": call_id, "type": "function",
                               "function": {"name": call.name, "arguments": ""}})
            call_id, sent = self.sent[index]
            fragment = arguments[len(sent):] if arguments.startswith(sent) else ""
            if fragment:
                self.sent[index] = (call_id, sent + fragment)
                if deltas and deltas[-1]["index"] == index and "id" in deltas[-1] \
                        and deltas[-1]["function"]["arguments"] == "":
                    deltas[-1]["function"]["arguments"] = fragment
                else:
                    deltas.append({"index": index, "function": {"arguments": fragment}})
        return content, deltas


def _streamable(raw: str) -> str:
    """Arguments still being written, as far as a stream may send them: without the whitespace at either end
    (the final arguments are stripped, and a fragment once sent cannot be taken back); a JSON-string form is
    decoded only once whole, so none of it."""
    raw = raw.strip()
    return "" if raw.startswith('"') else raw
