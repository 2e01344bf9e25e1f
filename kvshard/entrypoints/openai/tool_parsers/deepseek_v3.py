"""DeepSeek-V3's tool calls (special tokens of its vocabulary), each call's arguments a fenced JSON block:

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

with any content before the section.
"""

from __future__ import annotations

from kvshard.entrypoints.openai.tool_parsers.abstract import Parsed, ParsedCall, ToolParser, content_before, value_end

SECTION_BEGIN = "<｜tool▁calls▁begin｜>"
CALL_BEGIN, SEP, CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"


class DeepSeekV3ToolParser(ToolParser):
    name = "deepseek_v3"

    def parse(self, text: str, final: bool) -> Parsed:
        section = text.find(SECTION_BEGIN)
        calls: list[ParsedCall] = []
        at = text.find(CALL_BEGIN, section) if section >= 0 else -1
        while at >= 0:
            sep = text.find(SEP, at)
            if sep < 0:
                break
            name_start = sep + len(SEP)
            newline = text.find("\n", name_start)
            if newline < 0:
                break
            call = ParsedCall(text[name_start:newline].strip(), "")
            calls.append(call)
            brace = text.find("{", newline)
            if brace < 0:
                break
            end = value_end(text, brace)
            call.arguments = text[brace:end] if end is not None else text[brace:]
            if end is None:
                break
            call.complete = True
            at = text.find(CALL_BEGIN, end)
        if final and not calls:
            return Parsed(text)
        return Parsed(content_before(text, section if section >= 0 else None, (SECTION_BEGIN,), final), calls)
