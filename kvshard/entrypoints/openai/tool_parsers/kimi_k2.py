"""Kimi K2's tool calls (special tokens of its vocabulary); a call's id, `functions.NAME:INDEX`, is the one the
answer gives back:

    <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>
    {"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>

with any content before the section.
"""

from __future__ import annotations

from kvshard.entrypoints.openai.tool_parsers.abstract import (Parsed, ParsedCall, ToolParser, content_before, skip_ws,
                                                              value_end)

SECTION_BEGIN = "<|tool_calls_section_begin|>"
CALL_BEGIN, ARGUMENT_BEGIN = "<|tool_call_begin|>", "<|tool_call_argument_begin|>"


class KimiK2ToolParser(ToolParser):
    name = "kimi_k2"

    def parse(self, text: str, final: bool) -> Parsed:
        section = text.find(SECTION_BEGIN)
        calls: list[ParsedCall] = []
        at = text.find(CALL_BEGIN, section) if section >= 0 else -1
        while at >= 0:
            argument_begin = text.find(ARGUMENT_BEGIN, at)
            if argument_begin < 0:
                break
            call_id = text[at + len(CALL_BEGIN):argument_begin].strip()
            name = call_id.split(":")[0].split(".", 1)[-1]  # functions.NAME:INDEX
            call = ParsedCall(name, "", id=call_id)
            calls.append(call)
            i = skip_ws(text, argument_begin + len(ARGUMENT_BEGIN))
            if i >= len(text):
                break
            end = value_end(text, i)
            call.arguments = text[i:end] if end is not None else text[i:]
            if end is None:
                break
            call.complete = True
            at = text.find(CALL_BEGIN, end)
        if final and not calls:
            return Parsed(text)
        return Parsed(content_before(text, section if section >= 0 else None, (SECTION_BEGIN,), final), calls)
