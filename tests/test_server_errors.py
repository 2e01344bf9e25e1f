"""When `kvshard serve` cannot serve: bad flags stop it before any rank starts; a dead rank fails every request fast."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time

from pathlib import Path

import openai
import pytest

from server_harness import MODEL, ROOT, SERVE_ARGS, Server, serve_command


def run_serve(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(serve_command(*flags), cwd=ROOT, capture_output=True, text=True, timeout=120)


def assert_flag_error(result: subprocess.CompletedProcess, expected: str) -> None:
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("kvshard: error:")]
    assert len(errors) == 1 and expected in errors[0], result.stderr
    assert "Traceback" not in result.stderr
    assert "ranks:" not in result.stdout  # the layout report comes just before the ranks start


@pytest.mark.parametrize("flags, expected", [
    ([MODEL, "--tensor-parallel-size", "2", "--decode-context-parallel-size", "3"], "decode_context_parallel_size=3"),
    ([MODEL, "--port", "70000"], "--port 70000 is not a TCP port"),
], ids=["dcp not dividing tp", "port out of range"])
def test_bad_flags_print_one_line_and_exit_2(flags, expected):
    assert_flag_error(run_serve(*flags), expected)


def test_port_in_use_is_a_flag_error():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert_flag_error(run_serve(MODEL, "--port", str(port)), f"cannot listen on 127.0.0.1:{port}")


@pytest.fixture
def checkpoint_copy(tmp_path):
    from kvshard.models.demo import ensure_demo_model

    return Path(shutil.copytree(ensure_demo_model(MODEL), tmp_path / "model"))


def test_truncated_checkpoint_is_one_line_naming_the_file_and_exit_2(checkpoint_copy):
    weights = checkpoint_copy / "model.safetensors"
    with open(weights, "r+b") as f:
        f.truncate(weights.stat().st_size // 2)  # an interrupted download
    assert_flag_error(run_serve(str(checkpoint_copy)), f"{weights} is truncated")


@pytest.mark.parametrize("content", [b'{"architectures": ["LlamaForCausalLM"], ', b"\xff\xfe", b"[1, 2]"],
                         ids=["cut short", "not UTF-8", "not an object"])
def test_corrupt_config_is_one_line_naming_the_file_and_exit_2(checkpoint_copy, content):
    config = checkpoint_copy / "config.json"
    config.write_bytes(content)
    assert_flag_error(run_serve(str(checkpoint_copy)), str(config))


@pytest.fixture
def doomed_server(tmp_path):
    # one running request at a time, so a second one waits in the queue; requests long enough
    # (4,000 tokens, tens of seconds) to be still running when the rank is killed
    server = Server([*SERVE_ARGS, "--max-num-seqs", "1", "--max-model-len", "4096"], tmp_path / "log")
    yield server
    server.stop()


def test_killed_rank_fails_running_waiting_and_new_requests_within_10_seconds(doomed_server):
    server = doomed_server
    client = server.client(timeout=30)

    def long_stream():
        return client.completions.create(model=MODEL, prompt="Hello", max_tokens=4000, stream=True,
                                         extra_body={"ignore_eos": True})

    running = long_stream()
    next(iter(running))
    waiting = long_stream()
    assert server.wait_for_metric("kvshard:num_requests_waiting", lambda v: v == 1) == 1
    (rank1,) = server.rank_pids()

    os.kill(rank1, signal.SIGKILL)
    killed_at = time.monotonic()
    for stream in (running, waiting):
        with pytest.raises(openai.APIError, match="rank 1 exited"):
            for _ in stream:
                pass
    streams_failed_after = time.monotonic() - killed_at

    health = server.http.get("/health")
    assert health.status_code == 503 and "rank 1 exited with code -9" in health.json()["error"]["message"]
    with pytest.raises(openai.InternalServerError, match="rank 1 exited") as refused:
        client.completions.create(model=MODEL, prompt="Hello", max_tokens=4)
    assert refused.value.status_code == 503
    detected_after = time.monotonic() - killed_at
    print(f"dead rank: open streams failed after {streams_failed_after:.2f}s, "
          f"/health and new requests answered 503 after {detected_after:.2f}s")
    assert detected_after < 10

    assert server.stop() == 1
    assert "the engine died: rank 1 exited with code -9" in server.log
