"""Llama 3.1/3.2 JSON tool calls: the whole output is the call, a JSON object with the function's name and its
`parameters` (some write `arguments`), optionally after `<|python_tag|>`; several calls are separated by `;`.

    {"name": "get_weather", "parameters": {"city": "Paris"}}

An output that does not start with `{` is content.
"""

from __future__ import annotations

from kvshard.entrypoints.openai.tool_parsers.abstract import (Parsed, ToolParser, after_separator,
                                                              no_call_is_content, scan_call_objects, skip_ws)

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
        return no_call_is_content(text, scan_call_objects(text, i, after_separator(";")), final)
