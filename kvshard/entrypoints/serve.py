"""`kvshard serve [MODEL]`: the OpenAI-compatible server.

Run alone, it starts every rank on this machine (rank 0 serves HTTP, ranks
1..N-1 are child processes). Run by `torchrun` (or any launcher that sets RANK,
WORLD_SIZE, MASTER_ADDR and MASTER_PORT), each process is one rank on any node:
rank 0 serves HTTP, the others run the model loop. Flags are checked and the
port is bound before any rank starts, so a mistake costs one line and exit 2.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys

from kvshard.config import ConfigError, EngineConfig
from kvshard.engine.arg_utils import EngineArgs


def add_serve_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "serve", help="OpenAI-compatible HTTP server (also under torchrun, one process per rank)",
        description="Serve a model over an OpenAI-compatible HTTP API: /v1/models, /v1/completions, "
                    "/v1/chat/completions, /health, /metrics.",
    )
    EngineArgs.add_cli_args(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000; 0 picks a free one)")
    parser.add_argument("--api-key", default=os.environ.get("KVSHARD_API_KEY"),
                        help="require 'Authorization: Bearer KEY' on /v1 routes (default: $KVSHARD_API_KEY)")
    parser.add_argument("--served-model-name", nargs="+", default=None,
                        help="model name(s) clients use (default: the MODEL argument)")
    parser.set_defaults(func=run_serve)


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
    config = EngineArgs.from_cli_args(args).create_engine_config()
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
    return _serve(config, master, listener, args.served_model_name or [args.model], args.api_key,
                  args.kv_transfer_config)


def _bind(host: str, port: int) -> socket.socket:
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        listener = socket.socket(family, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, port))
    except OSError as error:
        raise ConfigError(f"cannot listen on {host}:{port}: {error.strerror or error}; choose another --host/--port")
    return listener


def _serve(config: EngineConfig, master: tuple[str, int] | None, listener: socket.socket,
           model_names: list[str], api_key: str | None, kv_transfer_config: str | None = None) -> int:
    import uvicorn

    from kvshard.engine.llm_engine import LLMEngine
    from kvshard.entrypoints.openai_server import OpenAIServer, with_connection_transport

    print(config.layout_report(), flush=True)
    engine = LLMEngine(config, master=master)
    try:
        server = OpenAIServer(engine, model_names, api_key)
        if kv_transfer_config is not None:
            from kvshard.disagg.config import KVTransferConfig
            from kvshard.disagg.connector import KVConnector
            from kvshard.disagg.routes import attach_kv_transfer
            from kvshard.disagg.secret import deployment_secret

            transfer_config = KVTransferConfig.from_json(kv_transfer_config)
            secret = deployment_secret(transfer_config.shared_secret)
            attach_kv_transfer(server, KVConnector(engine, transfer_config, secret, api_key))
        host, port = listener.getsockname()[:2]
        url_host = f"[{host}]" if ":" in host else host
        print(f"kvshard: serving {', '.join(model_names)} at http://{url_host}:{port}/v1 "
              f"(health: /health, metrics: /metrics)", flush=True)
        http_config = uvicorn.Config(with_connection_transport(server.app), log_level="info",
                                     timeout_graceful_shutdown=5)
        # uvicorn shuts down cleanly on SIGINT/SIGTERM, then raises the signal again: make that a
        # KeyboardInterrupt for both, so that the exit status below says whether the engine died.
        signal.signal(signal.SIGTERM, signal.default_int_handler)
        try:
            uvicorn.Server(http_config).run(sockets=[listener])
        except KeyboardInterrupt:
            pass
    finally:
        engine.shutdown()
    if server.engine.dead_reason is not None:
        print(f"kvshard: error: the engine died: {server.engine.dead_reason}", file=sys.stderr)
        return 1
    return 0
