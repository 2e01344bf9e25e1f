"""The outputs of tool_choice "required" and a named tool, which a structured-output constraint built from the
tools' JSON schemas writes (serving_chat.tool_constraint): for a named tool its arguments object alone, for
"required" a JSON array of calls, `[{"name": ..., "parameters": {...}}, ...]`, whatever the model's own format.
"""

from __future__ import annotations

from kvshard.entrypoints.openai.tool_parsers.abstract import (Parsed, ParsedCall, ToolParser, scan_call_object,
                                                              skip_ws, value_end)


class NamedToolParser(ToolParser):
    """The whole output is the arguments of the one named function."""

    name = "named"

    def __init__(self, function: str) -> None:
        self.function = function

    def parse(self, text: str, final: bool) -> Parsed:
        i = skip_ws(text, 0)
        end = value_end(text, i) if i < len(text) else None
        return Parsed("", [ParsedCall(self.function, text[i:end] if end is not None else text[i:],
                                      complete=end is not None)])


class RequiredToolParser(ToolParser):
    """A JSON array of call objects."""

    name = "required"

    def parse(self, text: str, final: bool) -> Parsed:
        i = skip_ws(text, 0)
        calls: list[ParsedCall] = []
        if i >= len(text) or text[i] != "[":
            return Parsed(text if final else "", calls)
        i = skip_ws(text, i + 1)
        while i < len(text) and text[i] == "{":
            call, end = scan_call_object(text, i)
            if call is None:
                break
            calls.append(call)
            if end is None:
                break
            i = skip_ws(text, end)
            if i < len(text) and text[i] == ",":
                i = skip_ws(text, i + 1)
        if final and not any(call.name for call in calls):
            return Parsed(text)
        return Parsed("", calls)
