"""`kvshard serve` as a child process of a benchmark: started on a free port, always stopped.

The server runs in its own process group (session), so stopping it reaches its
rank processes too, and a Ctrl-C at the terminal reaches only the benchmark,
which then stops the server in `__exit__`: SIGINT (a clean shutdown), then
SIGKILL to the whole group if it is not gone within `stop_timeout` seconds.
`ServerProcess.launch` starts the process; the test suite replaces it to fork its
servers from a process that imported torch once (tests/server_harness.py).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

import httpx


class ServerStartError(RuntimeError):
    """The server exited or did not become healthy; the message ends with its last log lines."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, model: str, flags: list[str], log_path: str | Path, startup_timeout: float = 300.0,
                 stop_timeout: float = 30.0) -> None:
        self.model = model
        self.flags = flags
        self.log_path = Path(log_path)
        self.startup_timeout = startup_timeout
        self.stop_timeout = stop_timeout
        self.port = 0
        self.process: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def cli_args(self) -> list[str]:
        """`kvshard ARGS`: serve the model on this port."""
        return ["serve", self.model, *self.flags, "--host", "127.0.0.1", "--port", str(self.port)]

    @property
    def command(self) -> list[str]:
        return [sys.executable, "-m", "kvshard.entrypoints.cli", *self.cli_args]

    def launch(self, log: IO) -> subprocess.Popen:
        """`command` in a session of its own, its output in `log`. What `start` starts: a replacement returns an
        object with Popen's pid, poll, wait and send_signal."""
        return subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)

    def start(self) -> None:
        """Start the server and wait for /health; a port taken in between is retried on another."""
        for attempt in range(3):
            self.port = free_port()
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.log_path, "w") as log:
                self.process = self.launch(log)
            try:
                self._wait_healthy()
                return
            except BaseException as error:  # Ctrl-C included: never leave it running
                self.stop()
                port_taken = isinstance(error, ServerStartError) and "cannot listen" in self.log_tail()
                if attempt == 2 or not port_taken:
                    raise

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        with httpx.Client(timeout=2.0) as client:
            while time.monotonic() < deadline:
                code = self.process.poll()
                if code is not None:
                    raise ServerStartError(f"`kvshard serve` exited with code {code} before it was healthy:\n"
                                           f"{self.log_tail()}")
                try:
                    if client.get(f"{self.base_url}/health").status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(0.05)
        raise ServerStartError(f"`kvshard serve` was not healthy after {self.startup_timeout:.0f} s:\n"
                               f"{self.log_tail()}")

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self) -> None:
        """SIGINT, then SIGKILL to the process group; safe to call twice."""
        process, self.process = self.process, None
        if process is None:
            return
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(self.stop_timeout)
            except subprocess.TimeoutExpired:
                pass
        try:  # the group: the server, and any rank it left behind
            os.killpg(process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        process.wait()
        _wait_group_gone(process.pid, timeout=10.0)

    def __enter__(self) -> "ServerProcess":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _wait_group_gone(pgid: int, timeout: float) -> None:
    """Until no process of the group is left (killed ranks are reaped by init, a moment later)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return
        time.sleep(0.05)
