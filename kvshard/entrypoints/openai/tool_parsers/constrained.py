"""The outputs of tool_choice "required" and a named tool, which a structured-output constraint built from the
tools' JSON schemas writes (serving_chat.tool_constraint): for a named tool its arguments object alone, for
"required" a JSON array of calls, `[{"name": ..., "parameters": {...}}, ...]`, whatever the model's own format.
"""

from __future__ import annotations

from kvshard.entrypoints.openai.tool_parsers.abstract import (Parsed, ParsedCall, ToolParser, after_separator,
                                                              scan_call_objects, skip_ws, value_end)


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
    """A JSON array of call objects, and nothing else: the constraint writes no text for the user, so an output
    cut before its first call was named (`[{"nam`) has no content either, rather than the array's beginning."""

    name = "required"

    def parse(self, text: str, final: bool) -> Parsed:
        i = skip_ws(text, 0)
        if i >= len(text) or text[i] != "[":
            return Parsed("")
        return Parsed("", scan_call_objects(text, skip_ws(text, i + 1), after_separator(",")))
