"""The OpenAI API's request bodies as pydantic models, and the errors answered in OpenAI's shape.

Every field a client sends is checked here or in the serving modules before anything reaches the engine;
a bad one is a 400 whose `param` names it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import Annotated, Any, ClassVar, Literal

from fastapi.responses import JSONResponse
from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, PrivateAttr, ValidationError, field_validator,
                      model_validator)

from kvshard.errors import SERVER_STOPPING
from kvshard.sampling_params import MAX_LOGPROBS, SamplingParams, StructuredOutputsParams

logger = logging.getLogger("kvshard.server")

# Used when the tokenizer brings no chat template of its own.
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
MAX_N = 128  # OpenAI's limit on choices per request
# Tokens a stream may run ahead of what its client has read before it is aborted. Beyond this the
# client has stopped reading (kernel buffers are already full), and its KV blocks serve better elsewhere.
DEFAULT_MAX_STREAM_BACKLOG = 1024
# The door (docs/serving.md, "Limits and security"): what one request may bring, and how slowly.
DEFAULT_MAX_REQUEST_BODY_BYTES = 8 * 2**20
DEFAULT_REQUEST_READ_TIMEOUT = 30.0  # seconds for a request's headers, and again for its body
DEFAULT_MAX_CHOICES_PER_REQUEST = 256  # prompts x n
DEFAULT_TIMEOUT_KEEP_ALIVE = 5  # uvicorn's and vLLM's default


class APIError(Exception):
    """An error answered to the client in OpenAI's shape."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def _engine_dead(reason: str) -> APIError:
    """A 503 for a request the engine cannot serve: it died (the reason says why), or the server is stopping."""
    if reason == SERVER_STOPPING:
        return APIError(503, reason, code="server_shutting_down", type="server_error")
    return APIError(503, f"the engine is dead: {reason}", code="engine_dead", type="server_error")


def _request_failed(reason: str, invalid_request: bool = False) -> APIError:
    """This request alone failed behind the door; the engine serves on. `invalid_request`: because of its own
    settings, which its client can fix (a 400)."""
    if invalid_request:
        return APIError(400, f"the request failed: {reason}", code="request_failed")
    return APIError(500, f"the request failed: {reason}", code="request_failed", type="server_error")


# --- protocol ---------------------------------------------------------------------------

def _check_prompt(value: Any) -> Any:
    """str | list[str] | list[int] | list[list[int]], with one message for every other shape."""
    def is_ids(v: Any) -> bool:
        return isinstance(v, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in v)

    if isinstance(value, str) or is_ids(value):
        return value
    if isinstance(value, list) and value and (all(isinstance(p, str) for p in value) or all(is_ids(p) for p in value)):
        return value
    raise ValueError("prompt must be a string, a list of strings, a list of token ids or a list of token-id lists")


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False)
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, every chunk carries the usage so far


class _RequestBody(BaseModel):
    """A route's request body. A top-level field the route does not define is ignored, as vLLM ignores it, and
    named in one warning per request (`_parse`), so that a misspelt field (`max_token`) shows in the server's log;
    the fields of nested objects (messages, tools) are ignored without one. The unknown fields' values are
    dropped once validation is over: only their names are kept, in `_unknown_fields`."""

    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)  # no NaN, Infinity
    ROUTE: ClassVar[str] = ""  # what the warning names
    _unknown_fields: tuple[str, ...] = PrivateAttr(default=())

    @model_validator(mode="after")
    def _set_aside_unknown_fields(self) -> _RequestBody:
        extra = self.__pydantic_extra__
        if extra:
            self._unknown_fields = tuple(sorted(extra))
            self.__pydantic_fields_set__.difference_update(extra)
            self.__pydantic_extra__ = {}
        return self


# vLLM's removed guided-decoding fields, each an alias of a structured_outputs kind
GUIDED_ALIASES = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                  "guided_grammar": "grammar"}
# the fields of a generation request that ask for an output constraint (at most one may); the tools' constraint
# ("required", a named tool) comes from tool_choice
OUTPUT_CONSTRAINT_FIELDS = ("structured_outputs", *GUIDED_ALIASES, "response_format")


class _GenerationRequest(_RequestBody):
    """Fields both endpoints take. Unknown fields are ignored, as vLLM does, with a warning naming them."""

    model: str
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # vLLM's extension, as the two below
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False  # vLLM's extension
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None  # token ids as strings, as OpenAI's
    min_p: float = 0.0  # vLLM's extensions, as top_k
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    bad_words: list[str] | None = None
    kv_transfer_params: dict[str, Any] | None = None  # disaggregated prefill/decode, set by `kvshard proxy`
    # OpenAI's end-user identifiers: labels for the provider's own monitoring, which change nothing here (vLLM
    # takes `user` the same way)
    user: str | None = None
    safety_identifier: str | None = None
    # vLLM fields kvshard does not implement: declared so that a value other than their no-op one is
    # refused (check_supported) rather than silently ignored
    use_beam_search: Any = None
    length_penalty: Any = None
    early_stopping: Any = None
    prompt_logprobs: Any = None
    skip_special_tokens: Any = None
    spaces_between_special_tokens: Any = None
    truncate_prompt_tokens: Any = None
    allowed_token_ids: Any = None
    # guided decoding (docs/serving.md, "Structured outputs"): at most one of these
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None  # vLLM's removed fields, accepted as aliases
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    response_format: dict[str, Any] | None = None
    logits_processors: Any = None
    return_tokens_as_token_ids: Any = None

    # field -> the values that change nothing (None: absent)
    _NO_OP_VALUES: ClassVar[dict[str, tuple]] = {
        "use_beam_search": (None, False), "length_penalty": (None, 1, 1.0), "early_stopping": (None, False),
        "prompt_logprobs": (None,),
        "skip_special_tokens": (None, True), "spaces_between_special_tokens": (None, True),
        "truncate_prompt_tokens": (None,), "allowed_token_ids": (None,),
        "logits_processors": (None,), "return_tokens_as_token_ids": (None, False),
    }

    _PYTHON_API_ONLY: ClassVar[frozenset[str]] = frozenset({"prompt_logprobs"})

    def check_supported(self) -> None:
        for name, no_op in self._NO_OP_VALUES.items():
            value = getattr(self, name)
            # (a bool is an int in Python: True must not pass for 1)
            if not any(value is v or (type(value) is type(v) and value == v) for v in no_op):
                default = "leave it out" if no_op == (None,) else f"leave it at {no_op[-1]!r} or out"
                where = " over HTTP (the Python API's SamplingParams has it)" if name in self._PYTHON_API_ONLY else ""
                raise APIError(400, f"{name} is not supported by kvshard{where}; {default}", name)
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed when stream is true", "stream_options")
        if self.n > MAX_N:
            raise APIError(400, f"n must be at most {MAX_N}, got {self.n}", "n")

    def _logit_bias(self) -> dict[int, float] | None:
        """OpenAI's string keys -> token ids."""
        if self.logit_bias is None:
            return None
        bias = {}
        for key, value in self.logit_bias.items():
            if not (key.isascii() and key.isdigit()) or len(key) > 19:
                raise APIError(400, f"logit_bias keys must be token ids written as decimal strings, got {key!r}",
                               "logit_bias")
            bias[int(key)] = value
        return bias

    def constraint(self) -> tuple[StructuredOutputsParams | None, str | None]:
        """The output constraint the request asks for, and the field that asked (for a 400 naming it)."""
        found: list[tuple[StructuredOutputsParams | None, str]] = []
        if self.structured_outputs is not None:
            unknown = sorted(set(self.structured_outputs) - STRUCTURED_OUTPUTS_KEYS)
            if unknown:
                raise APIError(400, f"structured_outputs.{unknown[0]} is not supported by kvshard; it takes one of "
                                    "json, regex, choice, grammar, json_object (and disable_any_whitespace)",
                               "structured_outputs")
            if self.structured_outputs.keys() <= {"disable_any_whitespace"}:  # an option only
                if not isinstance(self.structured_outputs.get("disable_any_whitespace", False), bool):
                    raise APIError(400, "structured_outputs.disable_any_whitespace must be true or false",
                                   "structured_outputs.disable_any_whitespace")
            else:
                found.append((_constraint("structured_outputs", **self.structured_outputs), "structured_outputs"))
        for alias, kind in GUIDED_ALIASES.items():
            if getattr(self, alias) is not None:
                found.append((_constraint(alias, **{kind: getattr(self, alias)}), alias))
        if self.response_format is not None:
            constraint = response_format_constraint(self.response_format, "response_format")
            if constraint is not None:
                found.append((constraint, "response_format.json_schema.schema" if constraint.json is not None
                              else "response_format"))
        if len(found) > 1:
            raise APIError(400, f"{found[1][1]}: give at most one output constraint, got {found[0][1]} and "
                                f"{found[1][1]}", found[1][1])
        return (self.with_whitespace_option(found[0][0]), found[0][1]) if found else (None, None)

    def with_whitespace_option(self, constraint: StructuredOutputsParams | None) -> StructuredOutputsParams | None:
        """`structured_outputs: {"disable_any_whitespace": true}` alone is an option of the constraint another
        field asks for (response_format, the tools), as vLLM takes it."""
        option = self.structured_outputs
        if constraint is None or not option or option.keys() != {"disable_any_whitespace"}:
            return constraint
        return dataclasses.replace(constraint, disable_any_whitespace=option["disable_any_whitespace"])

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        structured_outputs: StructuredOutputsParams | None = None,
                        defaults: dict[str, Any] | None = None) -> SamplingParams:
        """`defaults`: the server's sampling defaults (--generation-config), each where the request leaves its
        field out; their max_tokens also caps the request's own (vLLM's server-wide limit from max_new_tokens)."""
        defaults = defaults or {}
        logit_bias = self._logit_bias()
        cap = defaults.get("max_tokens")
        if cap is not None:
            max_tokens = cap if max_tokens is None else min(max_tokens, cap)

        def field(name: str) -> Any:
            return getattr(self, name) if name in self.model_fields_set or name not in defaults else defaults[name]
        try:
            return SamplingParams(
                n=self.n, temperature=field("temperature"), top_p=field("top_p"), top_k=field("top_k"), seed=self.seed,
                max_tokens=max_tokens, stop=self.stop, stop_token_ids=self.stop_token_ids or [],
                ignore_eos=self.ignore_eos, include_stop_str_in_output=self.include_stop_str_in_output,
                logprobs=logprobs, kv_transfer_params=self.kv_transfer_params,
                min_p=field("min_p"), repetition_penalty=field("repetition_penalty"),
                presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                min_tokens=self.min_tokens, logit_bias=logit_bias, bad_words=self.bad_words,
                structured_outputs=structured_outputs,
            )
        except ValueError as error:
            message = str(error)
            raise APIError(400, message, message.split()[0]) from None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and self.stream_options.continuous_usage_stats


class CompletionRequest(_GenerationRequest):
    ROUTE: ClassVar[str] = "POST /v1/completions"
    prompt: Annotated[Any, BeforeValidator(_check_prompt)]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False  # each choice's text (and logprobs) begins with its prompt's
    best_of: int | None = None
    suffix: str | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.suffix is not None:
            raise APIError(400, "suffix is not supported by kvshard", "suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise APIError(400, "best_of other than n is not supported by kvshard", "best_of")
        if self.max_tokens == 0:
            if not self.echo:
                raise APIError(400, "max_tokens must be an integer >= 1 (0 only with echo: true, which answers the "
                                    "prompt alone), got 0", "max_tokens")
            if self.min_tokens > 0:
                raise APIError(400, f"min_tokens must be at most max_tokens (0), got {self.min_tokens}", "min_tokens")
        if self.echo and self.logprobs is not None and (self.kv_transfer_params or {}).get("do_remote_prefill"):
            raise APIError(400, "echo with logprobs cannot be combined with kv_transfer_params.do_remote_prefill: the "
                                "prompt's logprobs need its logits, which are computed where its KV is (the producer)",
                           "echo")

    @property
    def echo_only(self) -> bool:
        """`echo` with `max_tokens: 0`, as vLLM takes it: the prompt alone, nothing generated (the engine samples one
        token from the prompt's last logits, which it computes anyway; the answer leaves it out)."""
        return self.echo and self.max_tokens == 0

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        structured_outputs: StructuredOutputsParams | None = None,
                        defaults: dict[str, Any] | None = None) -> SamplingParams:
        params = super().sampling_params(1 if self.echo_only else max_tokens, logprobs, structured_outputs, defaults)
        if self.echo:
            params.prompt_logprobs = logprobs  # the prompt's tokens, with as many alternatives as the output's
        return params


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False)
    type: Literal["text"]
    text: str


class ToolCallFunction(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)
    name: str
    arguments: str


class ToolCall(BaseModel):
    """A call an earlier assistant turn made (sent back in `messages`)."""

    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool message: the call it answers

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, value: Any) -> Any:
        """A part other than text (an image, audio, a file) gets a message that says so, not the union's first
        member's "should be a valid string"."""
        if isinstance(value, list):
            for part in value:
                kind = part.get("type") if isinstance(part, dict) else None
                if isinstance(kind, str) and kind != "text":
                    raise ValueError(f"content parts of type {kind!r} are not supported: this server takes text "
                                     "parts only ({\"type\": \"text\", \"text\": ...}) or a string")
        return value

    @property
    def text(self) -> str:
        if isinstance(self.content, list):
            return "\n".join(part.text for part in self.content)
        return self.content or ""

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates take it (Hugging Face's convention: a call's arguments as an object
        where they parse as one)."""
        message: dict[str, Any] = {"role": self.role, "content": self.text}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [
                {"id": call.id, "type": "function",
                 "function": {"name": call.function.name, "arguments": _loads_or_text(call.function.arguments)}}
                for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


def check_messages(messages: list[ChatMessage]) -> None:
    """What a conversation's messages must hold together with their roles (chat, and /tokenize's messages)."""
    for index, message in enumerate(messages):
        if message.content is None and message.role != "assistant":  # only an assistant turn may be calls alone
            raise APIError(400, f"messages.{index}.content: a {message.role} message needs content (a string or a "
                                "list of text parts)", f"messages.{index}.content")
        if message.role == "tool" and message.tool_call_id is None:
            raise APIError(400, f"messages.{index}.tool_call_id: a tool message needs the id of the call it "
                                "answers", f"messages.{index}.tool_call_id")
        if message.tool_calls and message.role != "assistant":
            raise APIError(400, f"messages.{index}.tool_calls: only an assistant message carries tool calls",
                           f"messages.{index}.tool_calls")


def _loads_or_text(text: str) -> Any:
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


def _object_parameters(value: Any) -> Any:
    """A function's parameters: a JSON schema of an object, as OpenAI requires (a call's arguments are a JSON
    object); one that declares another type is refused rather than constrained to, or parsed as, a non-object."""
    if isinstance(value, dict) and "type" in value and value["type"] != "object":
        raise ValueError(f'a function\'s parameters must be a JSON schema of type "object" (a call\'s arguments are a '
                         f"JSON object), got type {json.dumps(value['type'])}")
    return value


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: Annotated[dict[str, Any] | None, BeforeValidator(_object_parameters)] = None
    strict: bool | None = None

    def schema_(self) -> dict[str, Any]:
        return self.parameters if self.parameters else {"type": "object", "properties": {}}

    def for_template(self) -> dict[str, Any]:
        tool = {"name": self.name, "parameters": self.schema_()}
        if self.description is not None:
            tool["description"] = self.description
        return {"type": "function", "function": tool}


class ChatTool(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["function"]
    function: NamedFunction


def _tool_choice_shape(named: str, own_key: str, other_key: str, other_form: str) -> Any:
    """A before-validator of tool_choice: a string or object of another shape (the other API's named form, an
    `allowed_tools` choice, a typo) gets a message that names the accepted forms, not pydantic's union's.
    `named`: this API's named-function form, whose name is under `own_key`; `other_form`: the other API's, under
    `other_key`."""
    accepted = f'"none", "auto", "required" or {named}'

    def check(value: Any) -> Any:
        if value is None or value in ("none", "auto", "required"):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"must be {accepted}, got {json.dumps(value, default=str)[:200]}")
        if value.get("type") != "function":
            raise ValueError(f"a tool_choice of type {json.dumps(value.get('type'), default=str)[:200]} is not "
                             f"supported by kvshard; give {accepted}")
        if own_key not in value:
            raise ValueError(f"name the function as {named}" + (f"; {other_form}" if other_key in value else ""))
        return value

    return check


ToolChoice = Annotated[Literal["none", "auto", "required"] | NamedToolChoice,
                       BeforeValidator(_tool_choice_shape(
                           '{"type": "function", "function": {"name": ...}}', "function", "name",
                           '{"type": "function", "name": ...} is the Responses API\'s form'))]


class ChatCompletionRequest(_GenerationRequest):
    ROUTE: ClassVar[str] = "POST /v1/chat/completions"
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # vLLM's: the last message left open, the answer continues it
    best_of: int | None = None
    tools: list[ChatTool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.best_of is not None and self.best_of != self.n:
            raise APIError(400, "best_of other than n is not supported by kvshard", "best_of")
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            raise APIError(400, f"top_logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.top_logprobs}",
                           "top_logprobs")
        check_tools(self.tools, self.tool_choice, "tools", "tool_choice")
        check_messages(self.messages)

    @property
    def named_tool(self) -> str | None:
        return self.tool_choice.function.name if isinstance(self.tool_choice, NamedToolChoice) else None

    @property
    def tool_mode(self) -> str:
        """none, auto, required or named: how this request's output may call its tools."""
        if not self.tools or self.tool_choice == "none":
            return "none"
        if self.tool_choice is None:
            return "auto"
        return "named" if self.named_tool is not None else self.tool_choice


def check_tools(tools: list | None, tool_choice: Any, tools_param: str, choice_param: str) -> None:
    """tools: [] and a tool_choice without tools are refused (as OpenAI does), and a named tool not in tools."""
    if tools is not None and not tools:
        raise APIError(400, f"{tools_param}: give at least one tool, or leave tools out", tools_param)
    if tool_choice is not None and not tools:
        raise APIError(400, f"{choice_param} is only allowed when tools are given", choice_param)
    names = [tool.function.name if hasattr(tool, "function") else tool.name for tool in tools or []]
    duplicate = next((name for name in names if names.count(name) > 1), None)
    if duplicate is not None:
        raise APIError(400, f"{tools_param}: the tool name {duplicate!r} is given twice", tools_param)
    named = getattr(getattr(tool_choice, "function", tool_choice), "name", None)
    if named is not None and named not in names:
        raise APIError(400, f"{choice_param}: the function {named!r} is not one of the tools ({', '.join(names)})",
                       choice_param)


STRUCTURED_OUTPUTS_KEYS = {"json", "regex", "choice", "grammar", "json_object", "disable_any_whitespace"}


def _constraint(field: str, **given: Any) -> StructuredOutputsParams:
    """StructuredOutputsParams, its ValueError a 400 naming `field` (an alias says its own name)."""
    schema = given.get("json")
    if isinstance(schema, str) and schema.strip() in ("{}", ""):
        schema = {}
    if "json" in given and not schema:
        raise APIError(400, f"{field} must be a non-empty JSON schema (an object); for any JSON object use "
                            'response_format {"type": "json_object"}', field)
    try:
        return StructuredOutputsParams(**given)
    except (ValueError, TypeError) as error:
        message = str(error)
        if field != "structured_outputs":
            message = message.replace(f"structured_outputs.{next(iter(given))}", field)
            message = message.replace("structured_outputs", field)
        elif not message.startswith("structured_outputs"):
            message = f"structured_outputs: {message}"
        raise APIError(400, message, field) from None


def response_format_constraint(value: dict[str, Any], param: str) -> StructuredOutputsParams | None:
    """OpenAI's response_format (or the Responses API's text.format): {"type": "text"} | {"type": "json_object"}
    | {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}; the Responses API's json_schema is
    flat ({"type": "json_schema", "name", "schema", "strict"})."""
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return _constraint(param, json_object=True)
    if kind == "json_schema":
        if "json_schema" not in value and "schema" not in value:  # neither the nested form nor the flat one
            where = f"{param}.json_schema" if param == "response_format" else f"{param}.schema"
            raise APIError(400, f"{param}: type json_schema needs its schema: {param}.json_schema = {{name, schema, "
                                f"strict}} (or name and schema beside type)", where)
        spec, where = (value.get("json_schema"), f"{param}.json_schema") if "json_schema" in value else (value, param)
        if not isinstance(spec, dict):
            raise APIError(400, f"{where} must be an object with name, schema and strict", where)
        schema = spec.get("schema")
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as error:
                raise APIError(400, f"{where}.schema is not valid JSON: {error}", f"{where}.schema") from None
        if not isinstance(schema, dict) or not schema:
            raise APIError(400, f"{where}.schema must be a non-empty JSON schema (an object)", f"{where}.schema")
        name = spec.get("name")
        if not isinstance(name, str) or not name:  # OpenAI's and vLLM's required field (its echo needs it too)
            raise APIError(400, f"{where}.name: a json_schema format needs a name (a string, e.g. \"answer\")",
                           f"{where}.name")
        return _constraint(f"{where}.schema", json=schema)
    raise APIError(400, f"{param}.type must be one of text, json_object, json_schema, got {kind!r}", f"{param}.type")


# --- /v1/responses ---------------------------------------------------------------------------

class ResponsesFunctionTool(BaseModel):
    """The Responses API's flat function tool."""

    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: Annotated[dict[str, Any] | None, BeforeValidator(_object_parameters)] = None
    strict: bool | None = None

    def as_chat_tool(self) -> ChatTool:
        return ChatTool(type="function", function=FunctionDefinition(
            name=self.name, description=self.description, parameters=self.parameters, strict=self.strict))


class ResponsesNamedTool(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["function"]
    name: str


class ResponsesTextConfig(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)
    format: dict[str, Any] | None = None


class ResponsesRequest(_RequestBody):
    """The subset of OpenAI's Responses API that the OpenAI Agents SDK uses (docs/serving.md)."""

    ROUTE: ClassVar[str] = "POST /v1/responses"
    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _items_are_objects(cls, value: Any) -> Any:
        if isinstance(value, list):
            for index, item in enumerate(value):
                if not isinstance(item, dict):
                    raise ValueError(f"item {index} is a {type(item).__name__}: each input item is an object (a "
                                     "message with role and content, a function_call or a function_call_output); "
                                     "a lone text goes as input itself, a string")
        return value
    tools: list[ResponsesFunctionTool] | None = None
    tool_choice: Annotated[Literal["none", "auto", "required"] | ResponsesNamedTool | None,
                           BeforeValidator(_tool_choice_shape(
                               '{"type": "function", "name": ...}', "name", "function",
                               '{"type": "function", "function": {"name": ...}} is the chat completions form'))] = None
    parallel_tool_calls: bool | None = None
    text: ResponsesTextConfig | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    previous_response_id: str | None = None
    store: bool = True
    metadata: dict[str, Any] | None = None
    user: str | None = None  # OpenAI's end-user identifiers, as on the other routes: they change nothing here
    safety_identifier: str | None = None
    truncation: Literal["disabled", "auto"] | None = None
    seed: int | None = None  # vLLM's extension
    structured_outputs: dict[str, Any] | None = None  # vLLM's: here only {"disable_any_whitespace": bool}
    background: bool | None = None
    # OpenAI's fields kvshard does not implement: declared so that a value that asks for something is refused
    # (check_supported) rather than silently ignored
    conversation: Any = None
    prompt: Any = None
    include: Any = None
    top_logprobs: Any = None
    reasoning: Any = None

    def check_supported(self) -> None:
        if self.background:
            raise APIError(400, "background is not supported by kvshard; leave it out", "background")
        for name, what in (("conversation", "conversations are not kept: send the items, or previous_response_id"),
                           ("prompt", "stored prompts are not kept: send instructions and input")):
            if getattr(self, name) is not None:
                raise APIError(400, f"{name} is not supported by kvshard ({what}); leave it out", name)
        if self.include is not None and not isinstance(self.include, list):
            raise APIError(400, "include must be a list of strings", "include")
        if "message.output_text.logprobs" in (self.include or []) or self.top_logprobs not in (None, 0):
            param = "top_logprobs" if self.top_logprobs not in (None, 0) else "include"
            raise APIError(400, "logprobs are not supported by kvshard's Responses API (include "
                                "message.output_text.logprobs, top_logprobs); /v1/chat/completions gives them",
                           param)
        if isinstance(self.reasoning, dict) and any(self.reasoning.get(key) is not None
                                                    for key in ("summary", "generate_summary")):
            raise APIError(400, "reasoning summaries are not supported by kvshard (its models write no reasoning "
                                "items); leave reasoning.summary out", "reasoning.summary")
        if self.truncation == "auto":  # accepted and ignored, the client would believe items were dropped
            raise APIError(400, 'truncation "auto" is not supported: kvshard drops no input item; leave it out (or '
                                'send "disabled") and keep the conversation within the model\'s context length',
                           "truncation")
        if self.structured_outputs is not None and not self.structured_outputs.keys() <= {"disable_any_whitespace"}:
            raise APIError(400, "structured_outputs takes only disable_any_whitespace in the Responses API; give the "
                                "output's format in text.format", "structured_outputs")
        if self.tools is not None and not self.tools:
            self.tools = None  # the Agents SDK sends [] for an agent without tools: no tools
        check_tools(self.tools, self.tool_choice, "tools", "tool_choice")


def check_continue_final_message(continue_final_message: bool, add_generation_prompt: bool) -> None:
    """vLLM's rule: the last message left open for the model to continue, or a new turn begun, not both."""
    if continue_final_message and add_generation_prompt:
        raise APIError(400, "continue_final_message continues the last message, add_generation_prompt begins a new "
                            "one: send add_generation_prompt false with it", "continue_final_message")


# --- /tokenize, /detokenize (vLLM's) ---------------------------------------------------------------

class TokenizeRequest(_RequestBody):
    """{"prompt": text} or {"messages": [...]} (rendered through the chat template first)."""

    ROUTE: ClassVar[str] = "POST /tokenize"
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[ChatTool] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(_RequestBody):
    ROUTE: ClassVar[str] = "POST /detokenize"
    model: str | None = None
    tokens: list[int]


# Bodies above this are counted before pydantic validates them: validation holds the GIL (and so the event loop)
# some 4 us an item, a second for the 250,000 empty messages that fit in a body of DEFAULT_MAX_REQUEST_BODY_BYTES.
PRESCAN_BODY_BYTES = 1 << 20


def validation_error_message(error: ValidationError, where: tuple[str | int, ...] = ()) -> tuple[str, str | None]:
    """A validation error's first fault in one line, "path.to.field: what is wrong", and the top-level field it is
    in; `where`: the path of the validated object itself (e.g. ("tools", 0))."""
    first = error.errors()[0]
    # keep field names and list indices; drop the names pydantic gives to union members
    path = [str(p) for p in (*where, *first["loc"]) if isinstance(p, int) or (p.isidentifier() and p.islower()
                                                                             and p not in _TYPE_NAMES)]
    message = first["msg"].removeprefix("Value error, ")
    return (f"{'.'.join(path)}: {message}" if path else message), (path[0] if path else None)


def _parse(model: type[BaseModel], body: bytes, max_items: dict[str, tuple[int, str]] | None = None) -> Any:
    """The body validated as `model`; a 400 naming the field otherwise. `max_items`: field -> (the most items its
    list or object can hold, what it says beyond that), checked first in a body over PRESCAN_BODY_BYTES (a plain
    `json.loads`, some 0.1 s at the body limit), so that a request of too many items is refused before they are
    validated one by one. A route's body that carries fields the route does not know is served all the same, and
    the fields are named in a warning."""
    if max_items and len(body) > PRESCAN_BODY_BYTES:
        _refuse_too_many_items(body, max_items)
    try:
        parsed = model.model_validate_json(body)
    except ValidationError as error:
        first = error.errors()[0]
        if first["type"] == "json_invalid":
            said = first["ctx"]["error"]
            if "hex escape" in said:  # the parser's words for a lone surrogate escape, which reads as a typo
                said += (" (a \\uD800-\\uDFFF escape is half of a surrogate pair and needs its other half: alone it "
                         "is no character, and cannot be UTF-8 text)")
            raise APIError(400, f"the request body is not valid JSON: {said}") from None
        message, param = validation_error_message(error)
        raise APIError(400, message, param) from None
    unknown = getattr(parsed, "_unknown_fields", ())
    if unknown:
        logger.warning("%s: %s", model.ROUTE, unknown_fields_message(unknown))
    return parsed


MAX_NAMED_FIELDS = 16  # a warning names at most this many unknown fields (then says how many more)
MAX_FIELD_NAME_CHARS = 64  # and at most this many characters of each name


def unknown_fields_message(names: tuple[str, ...]) -> str:
    """The warning about a request's unknown top-level fields (`names`, sorted): each name quoted (a name is the
    client's text, newlines included), at most MAX_NAMED_FIELDS of them."""
    shown = [repr(name if len(name) <= MAX_FIELD_NAME_CHARS else name[:MAX_FIELD_NAME_CHARS] + "...")
             for name in names[:MAX_NAMED_FIELDS]]
    more = f" and {len(names) - MAX_NAMED_FIELDS} more" if len(names) > MAX_NAMED_FIELDS else ""
    noun = "field" if len(names) == 1 else "fields"
    return (f"ignored the request's unknown {noun} {', '.join(shown)}{more} "
            "(not taken by this route: check the spelling)")


_TYPE_NAMES = {"str", "int", "float", "bool", "list", "dict", "none"}


def _refuse_too_many_items(body: bytes, max_items: dict[str, tuple[int, str]]) -> None:
    try:
        data = json.loads(body)
    except ValueError:
        return  # not JSON: pydantic says where
    if not isinstance(data, dict):
        return
    for name, (limit, beyond) in max_items.items():
        value = data.get(name)
        if isinstance(value, (list, dict)) and len(value) > limit:
            raise APIError(400, f"{name}: {len(value):,} {beyond}", name)

