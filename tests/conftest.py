"""Shared fixtures: tiny Hugging Face checkpoints made here (random weights, fixed seed)."""

from __future__ import annotations

import glob
import os
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

# Built-in demo models go to a per-session cache, never to the user's home.
os.environ.setdefault("KVSHARD_CACHE_DIR", str(Path(__file__).parent.parent / ".pytest_cache" / "kvshard"))
# The suite runs many engines at once on a few cores: a machine shared with other work, where OpenMP threads
# should sleep rather than spin while they wait (engine/process_setup.py; before anything loads torch).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# `auto` would replicate every tiny model's queries (config.AUTO_REPLICATE_MAX_BYTES): keep it on the head-split
# path, the DCP rhythm with its Q all-gather; tests ask for the replicated layout by name.
os.environ.setdefault("KVSHARD_AUTO_REPLICATE_MAX_BYTES", "0")
# Engines run the model step eagerly (also the default) unless a test names its level (tests/test_compiled_step.py):
# compiling costs each engine's start seconds to a minute on two cores (kvshard/compilation.py).
os.environ.setdefault("KVSHARD_COMPILATION_LEVEL", "0")
# A rank's heartbeat thread can miss the 3 s default on a 2-core machine that other work loads far past its
# cores (seen in real-model steps): the suite's engines and servers get 30 s; tests/test_executor.py names the
# defaults where it checks them.
os.environ.setdefault("KVSHARD_HEARTBEAT_TIMEOUT", "30")

# Without a GPU, the Triton kernels run under Triton's interpreter (tests/test_triton_attention.py); it is
# chosen when triton is first imported, so before anything imports it.
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session", autouse=True)
def ranks_start_with_torch_loaded():
    """Engines' ranks 1..N-1 fork from a process that imported torch once, instead of each importing it
    (tests/rank_start.py); servers, started as `kvshard serve` processes, keep kvshard's 'spawn'."""
    import rank_start

    rank_start.use_forkserver()


@pytest.fixture(scope="session", autouse=True)
def no_shared_memory_left_behind():
    """Every shared-memory segment the ranks create is unlinked once mapped, also when a run fails.

    Under `make test` another worker of the suite may be starting an engine when this one ends: its segments
    live until its ranks have mapped them (a second or two), so a segment counts as left behind only where it
    is still there 30 s later; one that leaked never goes."""
    before = set(glob.glob("/dev/shm/kvshard-*"))
    yield
    left = set(glob.glob("/dev/shm/kvshard-*")) - before
    deadline = time.monotonic() + 30
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left &= set(glob.glob("/dev/shm/kvshard-*"))
    assert not left, f"shared-memory segments left behind: {sorted(left)}"


# The files that share the session's SmolLM2 server and conversion (`smollm2_server`, `conversion_cache`).
SMOLLM2_FILES = {"test_agentic_api.py", "test_gguf.py", "test_gguf_probe.py", "test_smollm2_server.py",
                 "test_structured_outputs.py"}


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`make test` runs the suite in two pytest-xdist workers: each file's tests go to one worker (its
    module-scoped engines and servers start once), and the files that use SmolLM2 share one, so that it is
    fetched, converted and served once. Groups of more tests are handed out first (xdist's default)."""
    from xdist.scheduler import LoadScopeScheduling

    class ByFile(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return worker_group(nodeid)

    return ByFile(config, log)


def worker_group(nodeid: str) -> str:
    """The scheduler's unit: a test's file, or "smollm2" for the files in SMOLLM2_FILES."""
    path = nodeid.split("::", 1)[0]
    return "smollm2" if Path(path).name in SMOLLM2_FILES else path


# `kvshard serve smollm2-135m-instruct` at the `make serve` layout (tp=2, dcp=2), with room and the tool parser that
# the agentic tests ask for: one server (`smollm2_server`) for every file whose tests only read its answers.
SMOLLM2_SERVE_ARGS = ["smollm2-135m-instruct", "--tensor-parallel-size", "2", "--decode-context-parallel-size", "2",
                      "--max-model-len", "2048", "--kv-cache-memory", "128MiB", "--enable-auto-tool-choice",
                      "--tool-call-parser", "hermes"]


@pytest.fixture
def fused_ops(monkeypatch):
    """The kernel extension's module with its fused CPU operators on (attention/fused_ops.py), asked afresh."""
    from kvshard.attention import fused_ops as switch

    monkeypatch.delenv("KVSHARD_FUSED_ELEMENTWISE", raising=False)
    switch.reset()
    module = switch.cpu_ops()
    assert module is not None, "the kernel extension did not build (see the warning logged)"
    yield module
    switch.reset()


@pytest.fixture(scope="session")
def conversion_cache(tmp_path_factory) -> Path:
    """A kvshard cache made for this session, where .gguf files are converted: what is tested is always the
    converter as it is now, and SmolLM2 is converted once a session, by the first of its server and
    tests/test_gguf.py (on two cores, 25-45 s of header parsing and dequantizing). The fetched files
    (models/NAME/) are the persistent test cache's, linked: fetched once."""
    from kvshard.models.fetch import GGUF_MODELS

    persistent = Path(os.environ["KVSHARD_CACHE_DIR"]) / "models"
    fresh = tmp_path_factory.mktemp("kvshard-cache")
    (fresh / "models").mkdir()
    for name in GGUF_MODELS:
        (persistent / name).mkdir(parents=True, exist_ok=True)
        (fresh / "models" / name).symlink_to(persistent / name)
    return fresh


@pytest.fixture(scope="session")
def smollm2_server(tmp_path_factory, conversion_cache):
    """The SmolLM2 server (`SMOLLM2_SERVE_ARGS`), started once per session by the first test that asks for it and
    stopped (exit code 0 checked) at the session's end; the tests skip where SmolLM2 cannot be fetched."""
    from kvshard.errors import ConfigError
    from kvshard.models.fetch import fetch_gguf_model
    from server_harness import Server

    try:
        fetch_gguf_model(SMOLLM2_SERVE_ARGS[0])  # before the server starts, so that offline is a skip, not a failure
    except ConfigError as error:
        pytest.skip(f"SmolLM2 not fetchable here: {error}")
    running = Server(SMOLLM2_SERVE_ARGS, tmp_path_factory.mktemp("smollm2-serve") / "log", startup_timeout=600,
                     env={"KVSHARD_CACHE_DIR": str(conversion_cache)})
    yield running
    assert running.stop() == 0, running.log


@contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
    """Set environment variables for the block (ranks spawned inside inherit them), then restore."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name)
            else:
                os.environ[name] = value


def tiny_llama_config(config_cls=None, **overrides):
    """A two-layer Llama-family config (GQA, 4 query heads over 1 KV head) with large random
    weights, so that greedy choices stand well apart; `config_cls` picks Qwen2 or Mistral."""
    from transformers import LlamaConfig

    base = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=1, head_dim=16, max_position_embeddings=256,
                initializer_range=0.2, tie_word_embeddings=False, architectures=["LlamaForCausalLM"])
    base.update(overrides)
    return (config_cls or LlamaConfig)(**base)


def assert_same_generation(got_tokens: list[list[int]], got_logprobs: list[list[dict[int, float]]],
                           want_tokens: list[list[int]], want_logprobs: list[list[dict[int, float]]],
                           atol: float, same_candidates: bool = True) -> None:
    """Greedy tokens equal, and every candidate's log-probability within `atol` of the wanted one.

    `same_candidates`: both sides list the same top-k tokens at every step; without it `want`
    may list more (a reference that keeps the whole vocabulary).
    """
    assert got_tokens == want_tokens
    assert len(got_logprobs) == len(want_logprobs)
    for prompt, (got_steps, want_steps) in enumerate(zip(got_logprobs, want_logprobs)):
        assert len(got_steps) == len(want_steps) == len(got_tokens[prompt])
        for step, (got_step, want_step) in enumerate(zip(got_steps, want_steps)):
            where = f"prompt {prompt}, new token {step}"
            if same_candidates:
                assert got_step.keys() == want_step.keys(), where
            for token, logprob in got_step.items():
                assert logprob == pytest.approx(want_step[token], abs=atol), f"{where}, candidate {token}"


def random_hf_model(config, seed: int = 0, off_neutral: bool = False):
    """A transformers model with random weights from `seed`. `off_neutral` moves norms and the routing
    bias off their neutral init, so that a mix-up between them (or ignoring the bias) changes the output."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if off_neutral:
        with torch.no_grad():
            for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
                if name.endswith("norm.weight"):
                    tensor.uniform_(0.5, 1.5)
                elif name.endswith("e_score_correction_bias"):
                    tensor.uniform_(-0.3, 0.3)
    model.generation_config.eos_token_id = None  # greedy references run to max_new_tokens
    return model


def save_hf_checkpoint(config, directory: Path, seed: int = 0, off_neutral: bool = False) -> Path:
    """Random weights from `seed`, written with transformers' own save_pretrained."""
    random_hf_model(config, seed, off_neutral).save_pretrained(directory)
    return directory


def hf_greedy_with_logprobs(directory: Path, prompts: list[list[int]], max_new_tokens: int):
    """transformers' greedy tokens and per-step log-probabilities [V] of each prompt; fails on a
    near-tie in the reference (a top-2 gap under 1e-2), where float rounding could flip a token."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    tokens, logprobs = [], []
    for prompt in prompts:
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False,
            pad_token_id=0, output_logits=True, return_dict_in_generate=True,
        )
        steps = [step[0].float().log_softmax(-1) for step in out.logits]  # max_new_tokens x [V]
        top2 = torch.stack(steps).topk(2, dim=-1).values
        assert (top2[:, 0] - top2[:, 1]).min() > 1e-2, "the reference has a near-tie: pick another seed"
        tokens.append(out.sequences[0, len(prompt):].tolist())
        logprobs.append(steps)
    return tokens, logprobs


def hf_greedy(directory: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Reference continuations from transformers' generate, one prompt at a time."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    outputs = []
    for prompt in prompts:
        ids = model.generate(
            torch.tensor([prompt]), max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
            do_sample=False, pad_token_id=0,
        )
        outputs.append(ids[0, len(prompt):].tolist())
    return outputs


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """Factory: checkpoints(name, config, seed=0, off_neutral=False) -> directory, made once per session
    (`save_hf_checkpoint`); a name stands for one checkpoint."""
    made: dict[str, Path] = {}

    def make(name: str, config, seed: int = 0, off_neutral: bool = False) -> Path:
        if name not in made:
            made[name] = save_hf_checkpoint(config, tmp_path_factory.mktemp(name), seed, off_neutral)
        return made[name]

    return make


def _prompts_key(prompts) -> tuple:
    return tuple(tuple(prompt) if isinstance(prompt, list) else prompt for prompt in prompts)


@pytest.fixture(scope="session")
def hf_reference():
    """Factory: transformers' greedy reference of a checkpoint, computed once per session for every file.

    hf_reference(directory, prompts, max_new_tokens) -> tokens per prompt (`hf_greedy`);
    with logprobs=True -> (tokens, per-step log-probabilities [V]) (`hf_greedy_with_logprobs`).
    """
    made: dict[tuple, object] = {}

    def get(directory, prompts, max_new_tokens: int, logprobs: bool = False):
        key = (str(directory), _prompts_key(prompts), max_new_tokens, logprobs)
        if key not in made:
            made[key] = (hf_greedy_with_logprobs if logprobs else hf_greedy)(Path(directory), prompts, max_new_tokens)
        return made[key]

    return get


class Run:
    """What one engine gave for one batch of greedy requests, run once per session (`engine_run`)."""

    def __init__(self, llm, outputs, peak_blocks: int, peak_tokens_per_rank: list[int], probed) -> None:
        engine = llm.engine
        stats = engine.stats()
        self.outputs = outputs
        self.tokens = [o.outputs[0].token_ids for o in outputs]
        self.logprobs = [o.outputs[0].logprobs for o in outputs]
        self.config = llm.config
        self.peak_blocks = peak_blocks  # KV blocks in use at the batch's peak
        self.peak_tokens_per_rank = peak_tokens_per_rank  # tokens each DCP rank held then
        self.blocks_used_after = stats.kv_blocks_used  # once every request finished
        self.kv_cache_bytes = engine.runner.kv_cache_bytes  # allocated on rank 0
        self.shared_memory = engine.executor.parallel.tp_shm is not None  # collectives through shared memory
        self.merges = set(stats.dcp_timing.merges) if stats.dcp_timing else set()  # rank 0's merge schemes
        self.probed = probed  # what the caller's `probe(llm)` returned, after the batch


@pytest.fixture(scope="session")
def engine_run():
    """Factory: engine_run(model, prompts, params, env=None, probe=None, **engine_kwargs) -> Run.

    Starts `LLM(model, **engine_kwargs)` (with `env` set while its ranks start and run), adds every prompt
    and steps until all are done, then calls `probe(llm)`; each distinct call runs once per session, so that
    tests that only read the outputs share one engine, also across files.
    """
    from kvshard import LLM

    made: dict[tuple, Run] = {}

    def run(model, prompts, params, env: dict[str, str] | None = None, probe=None, **engine_kwargs) -> Run:
        key = (str(model), _prompts_key(prompts), repr(params), tuple(sorted((env or {}).items())),
               probe and f"{probe.__module__}.{probe.__qualname__}", tuple(sorted(engine_kwargs.items())))
        if key not in made:
            made[key] = _run_engine(LLM, str(model), prompts, params, env or {}, probe, engine_kwargs)
        return made[key]

    return run


def _run_engine(LLM, model: str, prompts, params, env: dict[str, str], probe, engine_kwargs: dict) -> Run:
    with engine_after_run(LLM, model, prompts, params, env, probe, engine_kwargs) as (_, result):
        return result


@contextmanager
def engine_after_run(LLM, model: str, prompts, params, env: dict[str, str], probe, engine_kwargs: dict,
                     before=None) -> Iterator[tuple[object, Run]]:
    """(the open LLM, its Run) once the batch ran, for a test that keeps using the engine (`engine_run`'s run);
    `before(llm)` is called once the engine started, before the batch. The engine closes, and `env` is
    restored, when the block ends."""
    with environment(env), LLM(model, **engine_kwargs) as llm:
        if before is not None:
            before(llm)
        engine = llm.engine
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt, params)
        done, peak_blocks, peak_tokens = {}, 0, []
        for _ in range(100_000):  # bounded: a few hundred steps at most
            if len(done) == len(prompts):
                break
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
            stats = engine.stats()
            if stats.kv_blocks_used > peak_blocks:
                peak_blocks, peak_tokens = stats.kv_blocks_used, stats.kv_tokens_per_dcp_rank
        outputs = [done[str(i)] for i in range(len(prompts))]
        result = Run(llm, outputs, peak_blocks, peak_tokens, None)
        result.probed = probe(llm) if probe is not None else None
        yield llm, result


# --- `kvshard serve` refusing its command line before any rank starts (test_startup_errors, test_vllm_compat) ---

@pytest.fixture
def no_ranks(monkeypatch):
    """`kvshard serve` fails the test if it gets as far as starting the ranks."""
    from kvshard.entrypoints import serve

    def must_not_start(*args, **kwargs):
        raise AssertionError("the ranks were about to start")

    monkeypatch.setattr(serve, "_serve", must_not_start)


def refused(capsys, argv: list[str], named: str) -> str:
    """`kvshard serve ARGV` exits 2 with one line, "kvshard: error: ...", that names `named`; returns the line."""
    from kvshard.entrypoints.cli import main

    status = main(["serve", *argv])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert status == 2, err
    assert len(lines) == 1 and lines[0].startswith("kvshard: error:") and named in lines[0], err
    return lines[0]
