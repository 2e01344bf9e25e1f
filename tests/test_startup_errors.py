"""`kvshard serve` refusing what it cannot serve: a bad config.json value, a vocabulary that does not match
the embedding, a tokenizer that does not load, an empty model name, a taken rendezvous port. Each is one
line naming the file or flag and exit status 2, before any rank starts.

In process: `kvshard.entrypoints.cli.main` as the command line calls it, with the step that would start
the ranks (`serve._serve`) replaced by one that fails the test, so that nothing here starts a server.
"""

from __future__ import annotations

import json
import shutil
import socket
from pathlib import Path

import pytest

from conftest import refused
from kvshard.entrypoints.cli import main

MODEL = "kvshard-demo-gqa"
SMALL = ["--max-model-len", "512", "--kv-cache-memory", "16MiB", "--port", "0"]


@pytest.fixture(scope="module")
def demo_dir():
    from kvshard.models.demo import ensure_demo_model

    return ensure_demo_model(MODEL)


def copy_with(tmp_path: Path, demo_dir: Path, **config_changes) -> Path:
    model = Path(shutil.copytree(demo_dir, tmp_path / "model"))
    config = json.loads((model / "config.json").read_text())
    config.update(config_changes)
    (model / "config.json").write_text(json.dumps(config))
    return model


@pytest.mark.parametrize("field, value", [("num_hidden_layers", "four"), ("hidden_size", -64),
                                          ("num_attention_heads", 2.5), ("intermediate_size", True),
                                          ("rms_norm_eps", "tiny"), ("rope_theta", -1)])
def test_a_bad_config_value_names_the_file_and_the_field(no_ranks, capsys, tmp_path, demo_dir, field, value):
    model = copy_with(tmp_path, demo_dir, **{field: value})
    line = refused(capsys, [str(model), *SMALL], str(model / "config.json"))
    assert field in line


def test_a_vocabulary_smaller_than_the_embedding_is_refused(no_ranks, capsys, tmp_path, demo_dir):
    rows = json.loads((demo_dir / "config.json").read_text())["vocab_size"]
    model = copy_with(tmp_path, demo_dir, vocab_size=rows - 12)
    line = refused(capsys, [str(model), *SMALL], str(model / "config.json"))
    assert f"vocab_size={rows - 12} is smaller than the {rows} rows" in line


def test_a_corrupt_tokenizer_names_its_file(no_ranks, capsys, tmp_path, demo_dir):
    model = copy_with(tmp_path, demo_dir)
    tokenizer = model / "tokenizer.json"
    tokenizer.write_bytes(tokenizer.read_bytes()[: tokenizer.stat().st_size // 2])  # an interrupted download
    refused(capsys, [str(model), *SMALL], str(tokenizer))


@pytest.mark.parametrize("key", ["", " "])
def test_an_empty_api_key_is_refused(no_ranks, capsys, key):
    # it would start a server that refuses every request (no Authorization header can match an empty key)
    refused(capsys, [MODEL, *SMALL, "--api-key", key], "--api-key")


def test_a_kv_cache_beyond_the_hosts_memory_is_a_config_error():
    from kvshard.errors import ConfigError
    from kvshard.kv.cache import kv_buffer

    import torch
    with pytest.raises(ConfigError, match="lower --kv-cache-memory"):
        kv_buffer(1 << 50, torch.device("cpu"))  # a PiB: never available
    assert kv_buffer(4096, torch.device("cpu")).numel() == 4096


@pytest.mark.parametrize("name", ["", "  "])
def test_an_empty_served_model_name_is_refused(no_ranks, capsys, name):
    refused(capsys, [MODEL, *SMALL, "--served-model-name", "m", name], "--served-model-name")


def test_a_taken_rendezvous_port_is_refused_before_the_ranks_meet(no_ranks, capsys, monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for name, value in {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                            "MASTER_PORT": str(port)}.items():
            monkeypatch.setenv(name, value)
        monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
        refused(capsys, [MODEL, *SMALL, "--tensor-parallel-size", "2"], f"MASTER_PORT={port}")


def test_the_rendezvous_store_listens_on_the_configured_host_only():
    """The store rank 0 hosts takes the address it is given (torch's own listener would take every interface)."""
    from kvshard.parallel import bind_rendezvous, reserve_rendezvous, take_rendezvous_listener

    with bind_rendezvous("127.0.0.1", 0) as probe:
        assert probe.getsockname()[0] == "127.0.0.1"
    reserve_rendezvous("127.0.0.1", 0)
    listener = take_rendezvous_listener("127.0.0.1", 0)
    try:
        assert listener.getsockname()[0] == "127.0.0.1"
        with pytest.raises(OSError):
            bind_rendezvous("127.0.0.1", listener.getsockname()[1])  # taken
    finally:
        listener.close()


@pytest.mark.parametrize("flag, value", [("--max-request-body-bytes", "0"), ("--request-read-timeout", "0"),
                                         ("--max-choices-per-request", "-1"), ("--timeout-keep-alive", "0"),
                                         ("--stream-interval", "0")])
def test_a_bad_limit_is_a_flag_error(no_ranks, capsys, flag, value):
    refused(capsys, [MODEL, *SMALL, flag, value], flag)


def test_a_taken_kv_port_is_refused_before_the_ranks_start(no_ranks, capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = json.dumps({"kv_role": "kv_producer", "kv_port": port})
        refused(capsys, [MODEL, *SMALL, "--kv-transfer-config", config], f"kv_port {port}")
    # a consumer has no store of its own: the port is not its to take
    with pytest.raises(AssertionError, match="about to start"):
        main(["serve", MODEL, *SMALL, "--kv-transfer-config", json.dumps({"kv_role": "kv_consumer",
                                                                           "kv_port": port})])


def test_kv_caches_that_fit_one_rank_but_not_every_rank_on_the_host_are_refused_before_the_ranks_start(monkeypatch):
    """Each rank checks its own cache as it allocates it, seeing only the memory the others have not taken yet:
    the caches of every rank started here must fit together, checked before any is started."""
    from kvshard import LLM
    from kvshard.engine import executor
    from kvshard.engine.arg_utils import EngineArgs
    from kvshard.errors import ConfigError
    from kvshard.kv import cache

    settings = dict(tensor_parallel_size=2, kv_cache_memory="4MiB", max_model_len=256)
    config = EngineArgs(model=MODEL, **settings).create_engine_config()
    per_rank = config.num_kv_blocks * config.cache.block_size * config.kv_bytes_per_slot
    monkeypatch.setattr(cache, "available_host_bytes", lambda: per_rank * 3 // 2)  # one rank's, not two
    started = []
    monkeypatch.setattr(executor, "LocalRanks", lambda *args: started.append(args))
    with pytest.raises(ConfigError, match="each of the 2 ranks on this host"):
        LLM(MODEL, **settings)
    assert not started


@pytest.mark.parametrize("flag", ["--version", "-v"])
def test_the_version_flag_prints_the_version(capsys, flag):
    """`kvshard --version`, as `vllm --version`: the package's version and exit 0 (it was a usage error)."""
    import kvshard

    with pytest.raises(SystemExit) as ended:
        main([flag])
    assert ended.value.code == 0
    assert capsys.readouterr().out.strip() == f"kvshard {kvshard.__version__}"


@pytest.mark.parametrize("tp", ["1", "2"])
def test_kv_caches_beyond_the_hosts_memory_are_refused_before_the_report(monkeypatch, capsys, tp):
    """One line, before the start-up report and before any engine or rank starts, at one rank as at several (at
    one it was refused once the engine allocated its cache, after the report)."""
    import kvshard.engine.llm_engine as llm_engine

    def must_not_start(*args, **kwargs):
        raise AssertionError("the engine was about to start")

    monkeypatch.setattr(llm_engine, "LLMEngine", must_not_start)
    status = main(["serve", MODEL, "-tp", tp, "--max-model-len", "512", "--kv-cache-memory", "100TiB",
                   "--port", "0"])
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert status == 2 and len(lines) == 1 and "lower --kv-cache-memory" in lines[0], captured.err
    assert "model:" not in captured.out, captured.out
