"""`kvshard serve [MODEL]`: the OpenAI-compatible server.

Run alone, it starts every rank on this machine (rank 0 serves HTTP, ranks
1..N-1 are child processes). Run by `torchrun` (or any launcher that sets RANK,
WORLD_SIZE, MASTER_ADDR and MASTER_PORT), each process is one rank on any node:
rank 0 serves HTTP, the others run the model loop. Flags are checked and the
port is bound before any rank starts, so a mistake costs one line and exit 2.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import signal
import socket
import sys
from collections.abc import Callable

from kvshard import envs
from kvshard.config import ConfigError, EngineConfig
from kvshard.engine.arg_utils import EngineArgs
from kvshard.errors import SERVER_STOPPING


def add_serve_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "serve", help="OpenAI-compatible HTTP server (also under torchrun, one process per rank)",
        description="Serve a model over an OpenAI-compatible HTTP API: /v1/models, /v1/completions, "
                    "/v1/chat/completions, /v1/responses, /tokenize, /detokenize, /health, /metrics.",
    )
    EngineArgs.add_cli_args(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000; 0 picks a free one)")
    parser.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer KEY' on every route but /health (and /metrics with "
                             "--public-metrics) (default: $KVSHARD_API_KEY, else $VLLM_API_KEY)")
    parser.add_argument("--public-metrics", action="store_true",
                        help="serve /metrics without the API key (for a Prometheus scraper)")
    parser.add_argument("--served-model-name", nargs="+", default=None,
                        help="model name(s) clients use (default: the MODEL argument)")
    parser.add_argument("--stream-interval", type=int, default=1,
                        help="tokens a streamed choice gathers before its next event, after the first token, "
                             "which goes at once (vLLM's flag): 1 sends every token as it comes; more sends fewer, "
                             "longer events, which take less of the host's time per token (default: 1)")
    add_door_args(parser)
    add_chat_args(parser)
    add_frontend_args(parser)
    parser.set_defaults(func=run_serve)


UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def add_frontend_args(parser: argparse.ArgumentParser) -> None:
    """vLLM's server flags that command lines written for it carry (docs/serving.md, the flags table)."""
    group = parser.add_argument_group("server (vLLM's flags)")
    group.add_argument("--uvicorn-log-level", default="info", choices=UVICORN_LOG_LEVELS,
                       help="uvicorn's log level (its access log is at info) (default: %(default)s)")
    group.add_argument("--disable-log-requests", action="store_true",
                       help="accepted: kvshard logs no request's prompt or parameters")
    group.add_argument("--enable-log-requests", action="store_true",
                       help="not taken: kvshard logs no request's prompt or parameters (uvicorn logs each route "
                            "called, /metrics counts them)")
    group.add_argument("--disable-frontend-multiprocessing", action="store_true",
                       help="accepted: kvshard's HTTP server runs in rank 0's process")
    group.add_argument("--response-role", default="assistant",
                       help="the role of chat replies: assistant only (default: %(default)s)")
    group.add_argument("--reasoning-parser", default=None,
                       help="not taken: kvshard has no reasoning parsers (a model's reasoning stays in the content)")


def check_frontend_args(args: argparse.Namespace) -> list[str]:
    """vLLM's server flags: a ConfigError for those asking for what kvshard does not do; notes for the rest."""
    if args.enable_log_requests:
        raise ConfigError("--enable-log-requests is not taken: kvshard logs no request's prompt or parameters "
                          "(uvicorn logs each route called; /metrics counts requests and tokens); leave it out")
    if args.response_role != "assistant":
        raise ConfigError(f"--response-role {args.response_role!r} is not taken: kvshard's chat replies are the "
                          "assistant's; leave --response-role out (or assistant)")
    if args.reasoning_parser is not None:
        raise ConfigError(f"--reasoning-parser {args.reasoning_parser} is not taken: kvshard has no reasoning "
                          "parsers, a model's reasoning stays in the reply's content; leave it out")
    notes = []
    if args.disable_log_requests:
        notes.append("--disable-log-requests: kvshard logs no request's prompt or parameters")
    if args.disable_frontend_multiprocessing:
        notes.append("--disable-frontend-multiprocessing: kvshard's HTTP server runs in rank 0's process")
    return notes


def add_chat_args(parser: argparse.ArgumentParser) -> None:
    """Tool calling and the chat template (vLLM's flags)."""
    from kvshard.entrypoints.openai.tool_parsers import TOOL_PARSERS

    group = parser.add_argument_group("tools and chat")
    group.add_argument("--enable-auto-tool-choice", action="store_true",
                       help='let the model call tools on its own (tool_choice "auto", the default when a request '
                            "gives tools); needs --tool-call-parser")
    group.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                       help="the format the model writes its tool calls in, read for tool_choice \"auto\"")
    group.add_argument("--chat-template", default=None,
                       help="a Jinja chat template (a file, or the template itself) for every chat request, instead "
                            "of the tokenizer's own")


def chat_template_arg(value: str | None) -> str | None:
    """--chat-template: a file's text, or the template given inline."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as file:
            return file.read()
    if "{{" in value or "{%" in value:
        return value
    raise ConfigError(f"--chat-template {value!r}: no such file, and not a Jinja template")


def check_chat_args(args: argparse.Namespace) -> None:
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ConfigError("--enable-auto-tool-choice needs --tool-call-parser NAME")
    args.chat_template = chat_template_arg(args.chat_template)


def add_door_args(parser: argparse.ArgumentParser, serve: bool = True) -> None:
    """What one request may bring, and how slowly (also `kvshard proxy`'s)."""
    from kvshard.entrypoints.openai.protocol import (DEFAULT_MAX_CHOICES_PER_REQUEST, DEFAULT_MAX_REQUEST_BODY_BYTES,
                                                     DEFAULT_REQUEST_READ_TIMEOUT, DEFAULT_TIMEOUT_KEEP_ALIVE)

    group = parser.add_argument_group("limits")
    group.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_REQUEST_BODY_BYTES,
                       help="larger request bodies are refused with 413 (default: %(default)s)")
    group.add_argument("--request-read-timeout", type=float, default=DEFAULT_REQUEST_READ_TIMEOUT,
                       help="seconds a client may take to send a request's headers (then its connection is "
                            "closed), and again its body (then 408) (default: %(default)s)")
    group.add_argument("--timeout-keep-alive", type=int, default=DEFAULT_TIMEOUT_KEEP_ALIVE,
                       help="seconds an idle keep-alive connection stays open (default: %(default)s)")
    group.add_argument("--h11-max-incomplete-event-size", type=int, default=None,
                       help="bytes of a request line and headers at most (default: uvicorn's, 16 KiB)")
    if serve:
        group.add_argument("--max-choices-per-request", type=int, default=DEFAULT_MAX_CHOICES_PER_REQUEST,
                           help="prompts x n of one request at most; more is a 400 (default: %(default)s)")


def check_door_args(args: argparse.Namespace) -> None:
    for flag in ("max_request_body_bytes", "timeout_keep_alive", "h11_max_incomplete_event_size",
                 "max_choices_per_request", "stream_interval"):
        value = getattr(args, flag, None)
        if value is not None and value < 1:
            raise ConfigError(f"--{flag.replace('_', '-')} must be at least 1, got {value}")
    if not args.request_read_timeout > 0:
        raise ConfigError(f"--request-read-timeout must be a positive number of seconds, "
                          f"got {args.request_read_timeout}")


def uvicorn_config(app, args: argparse.Namespace, **kwargs):
    """uvicorn's settings for `app` under the door flags: h11 with deadlines for each request's headers
    and for the rest of a refused body."""
    import uvicorn

    from kvshard.entrypoints.openai.door import timed_h11_protocol

    return uvicorn.Config(app, http=timed_h11_protocol(args.request_read_timeout),
                          timeout_keep_alive=args.timeout_keep_alive,
                          h11_max_incomplete_event_size=args.h11_max_incomplete_event_size, **kwargs)


# uvicorn's graceful shutdown (SIGTERM, Ctrl-C): the seconds open requests get to finish; those still open after
# END_REQUESTS_S are ended with an error their clients read (a streamed one's last event, a 503), in the second
# left before uvicorn would cancel them and cut their connections mid-response.
GRACEFUL_SHUTDOWN_S = 5
END_REQUESTS_S = 4


def ending_http_server(config, end_requests: Callable[[], None]):
    """A uvicorn server on `config` whose graceful shutdown calls `end_requests` END_REQUESTS_S after it began,
    unless it is over by then."""
    import uvicorn

    class EndingServer(uvicorn.Server):
        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            timer = asyncio.get_running_loop().call_later(END_REQUESTS_S, end_requests)
            try:
                await super().shutdown(sockets)
            finally:
                timer.cancel()

    return EndingServer(config)


def launcher_rank() -> tuple[int, int, tuple[str, int]] | None:
    """(rank, world size, (MASTER_ADDR, MASTER_PORT)) when a launcher such as torchrun started this process."""
    names = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    if not all(os.environ.get(name) for name in names):
        return None
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), (os.environ["MASTER_ADDR"],
                                                                     int(os.environ["MASTER_PORT"]))


def run_serve(args: argparse.Namespace) -> int:
    if not 0 <= args.port < 2**16:
        raise ConfigError(f"--port {args.port} is not a TCP port: use 0..65535")
    check_door_args(args)
    check_chat_args(args)
    frontend_notes = check_frontend_args(args)
    for name in args.served_model_name or []:
        if not name.strip():
            raise ConfigError(f"--served-model-name {name!r}: a model name must not be empty")
    args.api_key = api_key_arg(args.api_key)
    if args.kv_transfer_config is not None:
        _check_kv_transfer_port(args.kv_transfer_config)  # a bad role, field or port fails before any rank starts
    config = EngineArgs.from_cli_args(args).create_engine_config()
    if frontend_notes:
        config = dataclasses.replace(config, notes=config.notes + tuple(frontend_notes))
    launched = launcher_rank()
    master = None
    if launched is not None:
        rank, world_size, master = launched
        if world_size != config.parallel.world_size:
            raise ConfigError(
                f"the launcher started {world_size} processes but --tensor-parallel-size is "
                f"{config.parallel.tensor_parallel_size}: start one process per rank"
            )
        if rank > 0:
            from kvshard.engine.workers import run_worker

            run_worker(config, rank, master)
            return 0
    listener = _bind(args.host, args.port)
    if master is not None and world_size > 1:
        _reserve_rendezvous(master)
    return _serve(config, master, listener, args.served_model_name or [args.model], args.api_key,
                  args.kv_transfer_config, args)


def api_key_arg(value: str | None) -> str | None:
    """The key the server requires: --api-key's `value`, else $KVSHARD_API_KEY, else $VLLM_API_KEY (None: no key).
    An empty one, given or set, is a ConfigError naming the flag or the variable: no request could match it."""
    if value is None:
        found = envs.api_key()
        return None if found is None else found[1]
    if not value.strip():
        raise ConfigError("--api-key is empty: no request could match it; give a key, or leave it out (and "
                          "$KVSHARD_API_KEY, $VLLM_API_KEY unset) for a server without one")
    return value


def _bind(host: str, port: int) -> socket.socket:
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        listener = socket.socket(family, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, port))
    except OSError as error:
        raise ConfigError(f"cannot listen on {host}:{port}: {error.strerror or error}; choose another --host/--port")
    return listener


def _check_kv_transfer_port(kv_transfer_config: str) -> None:
    """A producer's KV store port (`kv_port`, when it names one) is checked before any rank starts: a taken
    port is a flag error, not a traceback once the engine is up."""
    from kvshard.disagg.config import KVTransferConfig

    config = KVTransferConfig.from_json(kv_transfer_config)
    if not config.is_producer or config.kv_port == 0:
        return
    try:
        family = socket.getaddrinfo(config.kv_ip, config.kv_port, type=socket.SOCK_STREAM)[0][0]
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((config.kv_ip, config.kv_port))
    except OSError as error:
        raise ConfigError(f"--kv-transfer-config: cannot listen on kv_ip {config.kv_ip} kv_port {config.kv_port}: "
                          f"{error.strerror or error}; choose another kv_port (0 picks a free one)") from None


def _reserve_rendezvous(master: tuple[str, int]) -> None:
    """Rank 0 hosts the ranks' rendezvous store at MASTER_ADDR:MASTER_PORT (unless torchrun's agent does): a
    taken port is a flag error now, not a traceback once the ranks meet."""
    from kvshard.parallel import reserve_rendezvous, uses_agent_store

    if uses_agent_store(master):
        return
    host, port = master
    try:
        reserve_rendezvous(host, port)
    except OSError as error:
        raise ConfigError(f"cannot host the ranks' rendezvous at MASTER_ADDR={host} MASTER_PORT={port}: "
                          f"{error.strerror or error}; choose another MASTER_PORT") from None


def _serve(config: EngineConfig, master: tuple[str, int] | None, listener: socket.socket,
           model_names: list[str], api_key: str | None, kv_transfer_config: str | None,
           args: argparse.Namespace) -> int:
    from kvshard.engine.executor import check_local_kv_memory
    from kvshard.engine.llm_engine import EngineDeadError, LLMEngine
    from kvshard.entrypoints.openai.api_server import OpenAIServer
    from kvshard.entrypoints.openai.serving_engine import with_connection_transport

    # From here on SIGTERM is what Ctrl-C is, a KeyboardInterrupt: one while the engine starts stops the ranks
    # started so far (the executor's clean-up) instead of killing this process alone and leaving them. Once it
    # serves, uvicorn shuts down cleanly on either, then raises the signal again: caught below, so that the exit
    # status says whether the engine died.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    check_local_kv_memory(config, master)  # a ConfigError: one line, before the report
    print(config.layout_report(), flush=True)
    try:
        engine = LLMEngine(config, master=master)
    except EngineDeadError as error:  # a rank died, stopped or failed to load: one line, not a traceback
        print(f"kvshard: error: the engine did not start: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("kvshard: stopped while the engine started", file=sys.stderr)
        return 130
    if engine.runner.compile_seconds is not None:  # the report's compile line, with the time it took
        from kvshard.compilation import describe_compilation

        print(describe_compilation(config, engine.runner.compile_seconds), flush=True)
    try:
        server = OpenAIServer(engine, model_names, api_key, max_request_body_bytes=args.max_request_body_bytes,
                              request_read_timeout=args.request_read_timeout,
                              max_choices_per_request=args.max_choices_per_request,
                              stream_interval=args.stream_interval,
                              public_metrics=args.public_metrics,
                              enable_auto_tool_choice=args.enable_auto_tool_choice,
                              tool_call_parser=args.tool_call_parser, chat_template=args.chat_template)
        if kv_transfer_config is not None:
            from kvshard.disagg.config import KVTransferConfig
            from kvshard.disagg.routes import attach_kv_transfer
            from kvshard.disagg.secret import deployment_secret
            from kvshard.engine.kv_connector import create_kv_connector

            transfer_config = KVTransferConfig.from_json(kv_transfer_config)
            secret = deployment_secret(transfer_config.shared_secret)
            connector = create_kv_connector(transfer_config.kv_connector, engine, transfer_config, secret, api_key)
            attach_kv_transfer(server, connector)
            engine.attach_kv_connector(connector)
        host, port = listener.getsockname()[:2]
        url_host = f"[{host}]" if ":" in host else host
        print(f"kvshard: serving {', '.join(model_names)} at http://{url_host}:{port}/v1 "
              f"(health: /health, metrics: /metrics)", flush=True)
        http_config = uvicorn_config(with_connection_transport(server.app), args,
                                     log_level=getattr(args, "uvicorn_log_level", "info"),
                                     timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)
        http_server = ending_http_server(http_config, lambda: server.engine.refuse(SERVER_STOPPING))
        try:
            http_server.run(sockets=[listener])
        except KeyboardInterrupt:
            pass
    finally:
        engine.shutdown()
    if server.engine.dead_reason is not None:
        print(f"kvshard: error: the engine died: {server.engine.dead_reason}", file=sys.stderr)
        return 1
    return 0
