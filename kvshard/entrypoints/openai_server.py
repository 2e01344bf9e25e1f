"""The OpenAI-compatible server, kept importable under its old name: the code lives in
kvshard/entrypoints/openai/ (api_server, protocol, serving_*, tool_parsers, door)."""

from kvshard.entrypoints.openai.api_server import (OpenAIServer, _backlog_from_env, _http_error,  # noqa: F401
                                                   _internal_error, _longest_token_chars, check_compiles)
from kvshard.entrypoints.openai.door import (RequestDoor, _body_too_large, _BodyTooSlow,  # noqa: F401
                                             timed_h11_protocol)
from kvshard.entrypoints.openai.protocol import (DEFAULT_CHAT_TEMPLATE, DEFAULT_MAX_CHOICES_PER_REQUEST,  # noqa: F401
                                                 DEFAULT_MAX_REQUEST_BODY_BYTES, DEFAULT_MAX_STREAM_BACKLOG,
                                                 DEFAULT_REQUEST_READ_TIMEOUT, DEFAULT_TIMEOUT_KEEP_ALIVE, MAX_N,
                                                 APIError, ChatCompletionRequest, ChatMessage, CompletionRequest,
                                                 StreamOptions, TextPart, _check_prompt, _engine_dead,
                                                 _GenerationRequest, _parse, _request_failed)
from kvshard.entrypoints.openai.serving_engine import (TRANSPORT_EXTENSION, _cached_tokens,  # noqa: F401
                                                       _ChoiceDelta, _client_gone, _CuttableStream, _deltas,
                                                       _final_outputs, _merged, _num_tokens, _sse, _StreamBacklog,
                                                       _unless_disconnected, _usage, reset_connection,
                                                       until_disconnected, with_connection_transport)
