"""DeepSeek-V3's tool calls (special tokens of its vocabulary), each call's arguments a fenced JSON block:

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

with any content before the section.
"""

from __future__ import annotations

from kvshard.entrypoints.openai.tool_parsers.abstract import (Parsed, ParsedCall, ToolParser, scan_marked_calls,
                                                              section_parse)

SECTION_BEGIN = "<｜tool▁calls▁begin｜>"
CALL_BEGIN, SEP, CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
FENCE_END = "```"  # closes the arguments' block: where a call whose JSON was left open ends


class DeepSeekV3ToolParser(ToolParser):
    name = "deepseek_v3"

    def parse(self, text: str, final: bool) -> Parsed:
        section = text.find(SECTION_BEGIN)
        calls = scan_marked_calls(text, section, CALL_BEGIN, _header, call_end=(FENCE_END, CALL_END))
        return section_parse(text, section, SECTION_BEGIN, calls, final)


def _header(text: str, at: int) -> tuple[ParsedCall, int] | None:
    """`function<｜tool▁sep｜>NAME` and a newline; the arguments begin at the fenced block's `{`."""
    sep = text.find(SEP, at)
    newline = text.find("\n", sep + len(SEP)) if sep >= 0 else -1
    if newline < 0:
        return None
    brace = text.find("{", newline)
    return ParsedCall(text[sep + len(SEP):newline].strip(), ""), brace if brace >= 0 else len(text)
