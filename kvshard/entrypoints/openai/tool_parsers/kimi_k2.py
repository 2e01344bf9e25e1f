"""Kimi K2's tool calls (special tokens of its vocabulary); a call's id, `functions.NAME:INDEX`, is the one the
answer gives back:

    <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>
    {"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>

with any content before the section.
"""

from __future__ import annotations

from kvshard.entrypoints.openai.tool_parsers.abstract import (Parsed, ParsedCall, ToolParser, scan_marked_calls,
                                                              section_parse, skip_ws)

SECTION_BEGIN = "<|tool_calls_section_begin|>"
CALL_BEGIN, ARGUMENT_BEGIN, CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"


class KimiK2ToolParser(ToolParser):
    name = "kimi_k2"

    def parse(self, text: str, final: bool) -> Parsed:
        section = text.find(SECTION_BEGIN)
        calls = scan_marked_calls(text, section, CALL_BEGIN, _header, call_end=(CALL_END,))
        return section_parse(text, section, SECTION_BEGIN, calls, final)


def _header(text: str, at: int) -> tuple[ParsedCall, int] | None:
    """`functions.NAME:INDEX` (the call's id) up to the argument marker, after which the arguments begin."""
    argument_begin = text.find(ARGUMENT_BEGIN, at)
    if argument_begin < 0:
        return None
    call_id = text[at + len(CALL_BEGIN):argument_begin].strip()
    name = call_id.split(":")[0].split(".", 1)[-1]
    return ParsedCall(name, "", id=call_id), skip_ws(text, argument_begin + len(ARGUMENT_BEGIN))
