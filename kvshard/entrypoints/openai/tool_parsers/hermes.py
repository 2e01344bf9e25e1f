"""Hermes format (Qwen2.5/3, Hermes 2 Pro, and what SmolLM2's larger siblings are trained on): each call a JSON
object between tags,

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

with any content before the first call. A call whose JSON the model left open ends at its `</tool_call>`.
"""

from __future__ import annotations

from kvshard.entrypoints.openai.tool_parsers.abstract import (Parsed, ToolParser, after_marker, content_before,
                                                              no_call_is_content, scan_call_objects)

START, END = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"

    def parse(self, text: str, final: bool) -> Parsed:
        first = text.find(START)
        next_call = after_marker(START)
        calls = scan_call_objects(text, next_call(text, 0), next_call, call_end=(END,))
        return no_call_is_content(text, calls, final,
                                  content_before(text, first if first >= 0 else None, (START,), final))
