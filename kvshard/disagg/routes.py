"""The control routes of a producer or consumer: who it is, and (producer) a consumer's fetch."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import JSONResponse

from kvshard.disagg.connector import KVConnector, PullRefused
from kvshard.entrypoints.openai_server import APIError, OpenAIServer


def attach_kv_transfer(server: OpenAIServer, connector: KVConnector) -> None:
    """Add `GET /kv_transfer/info` and `POST /kv_transfer/pull` to the server, and let the connector
    wake its engine loop."""
    connector.wake = server.engine.wake

    async def info() -> JSONResponse:
        return JSONResponse(connector.info())

    async def pull(request: Request) -> JSONResponse:
        try:
            return JSONResponse(connector.serve_pull(await request.json()))
        except PullRefused as error:
            raise APIError(error.status, str(error), code="kv_transfer_refused") from None
        except (KeyError, TypeError, ValueError) as error:
            raise APIError(400, f"malformed pull request: {error!r}") from None

    server.app.get("/kv_transfer/info")(info)
    server.app.post("/kv_transfer/pull")(pull)
