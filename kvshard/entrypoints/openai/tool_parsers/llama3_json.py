"""Llama 3.1/3.2 JSON tool calls: the whole output is the call, a JSON object with the function's name and its
`parameters` (some write `arguments`), optionally after `<|python_tag|>`; several calls are separated by `;`.

    {"name": "get_weather", "parameters": {"city": "Paris"}}

An output that does not start with `{` is content.
"""

from __future__ import annotations

from kvshard.entrypoints.openai.tool_parsers.abstract import Parsed, ToolParser, scan_call_object, skip_ws

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def parse(self, text: str, final: bool) -> Parsed:
        i = skip_ws(text, 0)
        if text.startswith(PYTHON_TAG, i):
            i = skip_ws(text, i + len(PYTHON_TAG))
        elif not final and PYTHON_TAG.startswith(text[i:]):
            return Parsed("")  # nothing yet, or the tag's first characters
        if i >= len(text) or text[i] != "{":
            if final or i < len(text):
                return Parsed(text if final else text.rstrip())
            return Parsed("")
        calls = []
        while i < len(text) and text[i] == "{":
            call, end = scan_call_object(text, i)
            if call is None:
                break
            calls.append(call)
            if end is None:
                break
            i = skip_ws(text, end)
            if i < len(text) and text[i] == ";":
                i = skip_ws(text, i + 1)
        if final and not any(call.name for call in calls):
            return Parsed(text)
        return Parsed("", calls)
