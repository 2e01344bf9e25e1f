"""A stand-in HTTP server for tests of what talks to kvshard servers (no tests here)."""

from __future__ import annotations

import socket
import threading
import time

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse


class Backend:
    """A stand-in server on a free port: answers every POST under `prefix` with `answer(body)` and keeps
    the bodies."""

    def __init__(self, answer, prefix: str = "/v1", info: dict | None = None) -> None:
        self.bodies: list[dict] = []
        self.paths: list[str] = []  # of every request, GET or POST, in order
        self.headers: list[dict] = []
        app = FastAPI()

        if info is not None:  # a stand-in producer or consumer: GET /kv_transfer/info
            @app.get("/kv_transfer/info")
            async def kv_info(request: Request):
                self.paths.append(request.url.path)
                self.headers.append(dict(request.headers))
                return JSONResponse(info)

        @app.post(prefix + "/{path:path}")
        async def generate(request: Request):
            body = await request.json()
            self.bodies.append(body)
            self.paths.append(request.url.path)
            self.headers.append(dict(request.headers))
            status, payload = answer(body)
            return JSONResponse(payload, status_code=status)

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, port=self.port, log_level="warning"))
        threading.Thread(target=self.server.run, daemon=True).start()
        while not self.server.started:
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
