"""Hermes format (Qwen2.5/3, Hermes 2 Pro, and what SmolLM2's larger siblings are trained on): each call a JSON
object between tags,

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

with any content before the first call.
"""

from __future__ import annotations

from kvshard.entrypoints.openai.tool_parsers.abstract import (Parsed, ToolParser, content_before, scan_call_object,
                                                              skip_ws)

START, END = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"

    def parse(self, text: str, final: bool) -> Parsed:
        first = text.find(START)
        calls = []
        at = first
        while at >= 0:
            i = skip_ws(text, at + len(START))
            if i >= len(text) or text[i] != "{":
                break
            call, end = scan_call_object(text, i)
            if call is None:
                break
            calls.append(call)
            if end is None:
                break
            at = text.find(START, end)
        if final and not any(call.name for call in calls):
            return Parsed(text)  # no call after all: all of it is content
        return Parsed(content_before(text, first if first >= 0 else None, (START,), final), calls)
