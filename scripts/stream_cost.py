"""What streaming costs a server: closed-loop clients sending the same completions streamed and not.

    PYTHONPATH=$PWD .venv/bin/python scripts/stream_cost.py --url http://127.0.0.1:8000 --model kvshard-demo \
        --clients 10 --seconds 20

Each of `--clients` clients sends completions of `--prompt-len` token ids (distinct per client and request)
and `--max-tokens` ignore-eos tokens, one after another, for `--seconds`; once with `stream: true` and once
without, each answer's completion tokens counted when it is complete (the usage of a stream's last event, or
of the answer), so that a server started with `--stream-interval N` is counted alike. Events per second are
printed for the streams.
Prints the output tok/s of each and the client's own CPU seconds, which on a small machine compete with the
server's ranks.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import time

import httpx


async def _client(client: httpx.AsyncClient, args, index: int, stream: bool, stop: float, counted: list[int]):
    sent = 0
    while time.monotonic() < stop:
        body = {"model": args.model, "max_tokens": args.max_tokens, "ignore_eos": True, "temperature": 0,
                "stream": stream, "prompt": [(7 * index + j + sent) % 500 + 2 for j in range(args.prompt_len)]}
        if stream:
            body["stream_options"] = {"include_usage": True}
        sent += 1
        if stream:
            async with client.stream("POST", "/v1/completions", json=body) as response:
                response.raise_for_status()
                async for line in response.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        event = json.loads(line[6:])
                        if event["choices"]:
                            counted[1] += 1
                        elif event.get("usage"):
                            counted[0] += event["usage"]["completion_tokens"]
        else:
            response = await client.post("/v1/completions", json=body)
            response.raise_for_status()
            counted[0] += response.json()["usage"]["completion_tokens"]


async def _run(args, stream: bool) -> tuple[float, float, float]:
    counted = [0, 0]  # completion tokens, events
    cpu_before = resource.getrusage(resource.RUSAGE_SELF)
    async with httpx.AsyncClient(base_url=args.url, timeout=600) as client:
        start = time.monotonic()
        stop = start + args.seconds
        await asyncio.gather(*(_client(client, args, i, stream, stop, counted) for i in range(args.clients)))
        elapsed = time.monotonic() - start
    cpu_after = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (cpu_after.ru_utime - cpu_before.ru_utime) + (cpu_after.ru_stime - cpu_before.ru_stime)
    return counted[0] / elapsed, counted[1] / elapsed, cpu


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default="kvshard-demo")
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--prompt-len", type=int, default=150)
    parser.add_argument("--max-tokens", type=int, default=200)
    args = parser.parse_args(argv)
    for stream in (True, False):
        tok_s, events_s, cpu = asyncio.run(_run(args, stream))
        events = f", {events_s:6.1f} events/s" if stream else ""
        print(f"{'streamed' if stream else 'whole':8s}: {tok_s:7.1f} output tok/s{events}, client CPU {cpu:.1f} s "
              f"in {args.seconds:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
