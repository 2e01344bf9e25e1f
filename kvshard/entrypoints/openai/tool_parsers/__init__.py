"""Tool-call parsers, chosen with `--enable-auto-tool-choice --tool-call-parser NAME` (vLLM's flags) for
tool_choice "auto": the model writes freely and its calls are parsed from the text in its own format."""

from __future__ import annotations

from kvshard.entrypoints.openai.tool_parsers.abstract import Parsed, ParsedCall, ToolCallStream, ToolParser
from kvshard.entrypoints.openai.tool_parsers.constrained import NamedToolParser, RequiredToolParser
from kvshard.entrypoints.openai.tool_parsers.deepseek_v3 import DeepSeekV3ToolParser
from kvshard.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from kvshard.entrypoints.openai.tool_parsers.kimi_k2 import KimiK2ToolParser
from kvshard.entrypoints.openai.tool_parsers.llama3_json import Llama3JsonToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    parser.name: parser for parser in (HermesToolParser, Llama3JsonToolParser, DeepSeekV3ToolParser, KimiK2ToolParser)
}


def get_tool_parser(name: str) -> ToolParser:
    if name not in TOOL_PARSERS:
        raise ValueError(f"--tool-call-parser {name!r} is not one of {', '.join(sorted(TOOL_PARSERS))}")
    return TOOL_PARSERS[name]()


__all__ = ["TOOL_PARSERS", "get_tool_parser", "Parsed", "ParsedCall", "ToolCallStream", "ToolParser",
           "NamedToolParser", "RequiredToolParser"]
