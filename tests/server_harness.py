"""A real `kvshard serve` process for the server tests (no tests here).

The server runs in a process of its own, with the arguments a user gives `kvshard serve`, on a port the
OS picks (`--port 0`, read back from the URL line it prints), and is reached over HTTP only: by the
official `openai` client, httpx, and the Prometheus text. It is forked, as its ranks are, from the
suite's forkserver, which imported torch once (tests/rank_start.py), rather than started as a fresh
interpreter that imports torch anew, per server and per rank: `ForkedServer` runs `kvshard.entrypoints.cli`'s
`main` there, in the environment and working directory a subprocess would get, its output in the log.
Another subcommand forks the same way (`Server(args, log, subcommand="proxy")`: `kvshard proxy ARGS`), and so
does a `command` that runs a module (`python -m torch.distributed.run ...`: torchrun's launcher, whose workers
it starts as subprocesses still). `fork_bench_server` starts the `kvshard bench` servers (kvshard/bench/server.py's
`ServerProcess.launch`) the same way.
"""

from __future__ import annotations

import atexit
import contextlib
import io
import json
import multiprocessing
import os
import re
import runpy
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import rank_start
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parent.parent
MODEL = "kvshard-demo-gqa"  # Llama architecture, 1 KV head: tp=2, dcp=2 is a valid layout
API_KEY = "test-key"
# tp=2, dcp=2 on the demo model, sized for a shared 2-core machine
SERVE_ARGS = [MODEL, "--tensor-parallel-size", "2", "--decode-context-parallel-size", "2",
              "--max-model-len", "512", "--kv-cache-memory", "64MiB"]


CLI = "kvshard.entrypoints.cli"


def cli_command(*args: str) -> list[str]:
    """`kvshard ARGS` as a subprocess runs it."""
    return [sys.executable, "-m", CLI, *args]


def serve_command(*args: str) -> list[str]:
    return cli_command("serve", *args)


class Server:
    """`kvshard serve ARGS --port PORT` in a subprocess, up and healthy once constructed; port 0, the default,
    lets the OS pick one. `subcommand`: another `kvshard` subcommand that serves HTTP and prints its URL as
    serve does (`proxy`); `api_key` is then only what this client sends (the proxy passes it on)."""

    def __init__(self, args: list[str], log_path: Path, api_key: str | None = None, command: list[str] | None = None,
                 startup_timeout: float = 180, env: dict[str, str] | None = None, port: int = 0,
                 subcommand: str = "serve") -> None:
        self.api_key = api_key
        self.log_path = log_path
        self._terminated = False
        extra = ["--api-key", api_key] if api_key and subcommand == "serve" else []
        self._log = open(log_path, "wb")
        environ = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.process = start_command(command or cli_command(subcommand, *args, *extra, "--port", str(port)),
                                     log_path, environ, self._log)
        self.url = self._wait_for_url(startup_timeout)
        self.http = httpx.Client(base_url=self.url, timeout=60,
                                 headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
        self._wait_healthy(startup_timeout)

    def _wait_for_url(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            match = re.search(r"serving .* at (http://\S+)/v1 ", self.log)
            if match:
                return match.group(1)
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with {self.process.returncode}:\n{self.log}")
            time.sleep(0.05)
        raise TimeoutError(f"server printed no URL within {timeout}s:\n{self.log}")

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if self.http.get("/health").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with {self.process.returncode}:\n{self.log}")
            time.sleep(0.05)
        raise TimeoutError(f"server not healthy within {timeout}s:\n{self.log}")

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def client(self, **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=self.api_key or "none", max_retries=0, **kwargs)

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=self.api_key or "none", max_retries=0)

    def metrics(self) -> dict[tuple[str, tuple], float]:
        """{(sample name, sorted labels without model_name): value}"""
        text = self.http.get("/metrics").text
        values = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "model_name"))
                values[(sample.name, labels)] = sample.value
        return values

    def metric(self, name: str, **labels: str) -> float:
        return self.metrics()[(name, tuple(sorted(labels.items())))]

    def wait_for_metric(self, name: str, predicate, timeout: float = 10, **labels: str) -> float:
        deadline = time.monotonic() + timeout
        while True:
            value = self.metric(name, **labels)
            if predicate(value) or time.monotonic() > deadline:
                return value
            time.sleep(0.05)

    def rank_pids(self) -> list[int]:
        """Child processes that run ranks > 0 (multiprocessing 'spawn' children, not its resource tracker);
        of a forked server, the live ranks it started (children of the forkserver)."""
        if isinstance(self.process, ForkedServer):
            return self.process.rank_pids()
        pids = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
                cmdline = (stat.parent / "cmdline").read_bytes()
            except (OSError, ValueError, IndexError):
                continue
            if ppid == self.process.pid and b"spawn_main" in cmdline:
                pids.append(int(stat.parent.name))
        return pids

    def terminate(self) -> None:
        """Ask the server to shut down (once: a second signal could cut its clean shutdown short)."""
        if self.process.poll() is None and not self._terminated:
            self.process.send_signal(signal.SIGTERM)
            self._terminated = True

    def stop(self, timeout: float = 30) -> int:
        self.terminate()
        if self.process.poll() is None:
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.http.close()
        self._log.close()
        return self.process.returncode


def stop_all(servers: list[Server]) -> list[int]:
    """Stop every server, their shutdowns overlapping; their exit codes in the same order."""
    for server in servers:
        server.terminate()
    return [server.stop() for server in servers]


def start_together(starters: list[Callable[[], Server]]) -> list[Server]:
    """Call every starter at once, so that the servers' startups overlap; if one fails, the others are
    stopped and its error is raised."""
    with ThreadPoolExecutor(len(starters)) as pool:
        futures = [pool.submit(start) for start in starters]
    started = [f.result() for f in futures if f.exception() is None]
    if len(started) < len(starters):
        stop_all(started)
        raise next(f.exception() for f in futures if f.exception() is not None)
    return started


def forked_servers() -> bool:
    """Servers start from the suite's forkserver once conftest started it (tests/rank_start.py); a script
    that imports this module without it starts them as subprocesses."""
    from kvshard.engine import executor

    return executor.RANK_START_METHOD == "forkserver"


def start_command(command: list[str], log_path: Path, environ: dict[str, str], log=None):
    """`command` with its output in the log: forked from the suite's forkserver where it is `python -m MODULE ARGS`
    and conftest started the forkserver, else a subprocess (`log`: the open log file it writes to)."""
    if command[:2] == [sys.executable, "-m"] and forked_servers():
        return ForkedServer(command[3:], log_path, environ, module=command[2])
    with open(log_path, "ab") if log is None else contextlib.nullcontext(log) as out:
        return subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=environ)


def fork_bench_server(server, log) -> ForkedServer:
    """A `ServerProcess.launch` (kvshard/bench/server.py) that forks its `kvshard serve` from the suite's forkserver,
    in the environment a subprocess would get, its output in the log `start` opened."""
    return ForkedServer(server.cli_args, server.log_path, {**os.environ, "PYTHONUNBUFFERED": "1"})


class ForkedServer:
    """`kvshard ARGS` (`serve ...`, `proxy ...`), or `python -m MODULE ARGS`, forked from the suite's forkserver (torch
    already imported), with the `subprocess.Popen` methods the tests use: pid, poll, wait, send_signal, kill,
    returncode."""

    def __init__(self, args: list[str], log_path: Path, environ: dict[str, str], module: str = CLI) -> None:
        self._ranks = Path(f"{log_path}.ranks")  # each rank leaves its pid here (rank_start.RankTarget)
        self._ranks.mkdir(exist_ok=True)
        target = _ServeTarget(args, str(log_path), {**environ, rank_start.RANK_PIDS_DIR: str(self._ranks)}, module)
        self._process = multiprocessing.get_context("forkserver").Process(target=target, name=target.name)
        self._process.start()
        # not one of this process's multiprocessing children, as a subprocess is not: `active_children()` (which
        # tests check for ranks left behind) does not list it, and multiprocessing's exit hook does not wait on it
        multiprocessing.process._children.discard(self._process)
        self.pid = self._process.pid
        _running.add(self)

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        code = self._process.exitcode
        if code is not None:
            _running.discard(self)
            self._process.join()
        return code

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(["kvshard", "serve"], timeout)
        _running.discard(self)
        return self._process.exitcode

    def send_signal(self, sig: int) -> None:
        if self._process.exitcode is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def rank_pids(self) -> list[int]:
        pids = []
        for entry in self._ranks.iterdir():
            try:
                if Path(f"/proc/{entry.name}/cmdline").read_bytes():  # alive, not a zombie
                    pids.append(int(entry.name))
            except (OSError, ValueError):
                continue
        return sorted(pids)


_running: set[ForkedServer] = set()


@atexit.register
def _kill_servers_left_running() -> None:
    """A server a failed test did not stop goes with the test process."""
    for server in list(_running):
        server.kill()
        server.wait(30)


class _ServeTarget:
    """What the forked process runs: `kvshard ARGS` as `python -m kvshard.entrypoints.cli` would, or another module's
    `python -m MODULE ARGS`."""

    def __init__(self, args: list[str], log_path: str, environ: dict[str, str], module: str = CLI) -> None:
        self.args, self.log_path, self.environ, self.module = args, log_path, environ, module
        # its command line is the forkserver's: `pgrep kvshard-serve` (`kvshard-proxy`)
        self.name = f"kvshard-{args[0]}" if module == CLI else module

    def __call__(self) -> None:
        os.environ.clear()
        os.environ.update(self.environ)
        os.chdir(ROOT)
        with open(self.log_path, "ab") as log:
            for fd in (1, 2):
                os.dup2(log.fileno(), fd)
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True,
                                      errors="backslashreplace")
        rank_start.name_this_process(self.name)
        if self.module != CLI:
            sys.argv = [self.module, *self.args]
            runpy.run_module(self.module, run_name="__main__", alter_sys=True)
            return
        rank_start.ranks_from_this_forkserver()
        from kvshard.entrypoints import cli

        sys.argv = [cli.__file__, *self.args]
        sys.exit(cli.main(sys.argv[1:]))


def stream_events(client, route: str, body: dict) -> Iterator[dict]:
    """The JSON events of a streamed request through a TestClient (the `data:` lines, [DONE] left out); a stream that
    is refused, or an error event, fails the test."""
    with client.stream("POST", route, json=body) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            yield event


_TCP_STATES = {1: "ESTABLISHED", 2: "SYN_SENT", 3: "SYN_RECV", 4: "FIN_WAIT1", 5: "FIN_WAIT2", 6: "TIME_WAIT",
               7: "CLOSE", 8: "CLOSE_WAIT", 9: "LAST_ACK", 10: "LISTEN", 11: "CLOSING"}


def tcp_state(local_port: int, remote_port: int) -> str | None:
    """The kernel's state of this machine's TCP socket from local_port to remote_port (Linux), None if none."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as rows:
            for row in list(rows)[1:]:
                fields = row.split()
                local, remote = (int(address.rsplit(":", 1)[1], 16) for address in fields[1:3])
                if (local, remote) == (local_port, remote_port):
                    return _TCP_STATES[int(fields[3], 16)]
    return None


def free_local_port() -> int:
    return free_ports(1)[0]


def free_ports(count: int) -> list[int]:
    """Ports free now, all different: each socket stays bound until every port is picked (a socket closed before the
    next is bound may hand the same port out twice, and two servers then race for it)."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]


@contextlib.contextmanager
def uvicorn_on_a_thread(config) -> Iterator:
    """A uvicorn server on `config`, in this process on a thread of its own (so that a client can really hang
    up), started before the block and stopped after it: the `uvicorn.Server`."""
    import threading

    import uvicorn

    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    try:
        yield server
    finally:
        server.should_exit = True
        thread.join(30)


def scraped_metrics(http: httpx.Client) -> dict[tuple, float]:
    """/metrics through `http`: {(sample name, its labels but model_name, sorted): value}."""
    values = {}
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for sample in family.samples:
            values[(sample.name, tuple(sorted((k, v) for k, v in sample.labels.items() if k != "model_name")))] = \
                sample.value
    return values
