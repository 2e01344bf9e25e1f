"""The model step compiled with torch.compile (kvshard/compilation.py) gives the eager step's tokens.

A GQA layout (tp=2, dcp=2: the TP all-reduces and the DCP rhythm are opaque custom ops inside the graph)
and an MLA one with MoE layers (attention and the routed experts opaque) run compiled against transformers
and against the eager step on the same weights; one graph serves every token count (the GQA engine, kept open
and stepped further: no recompilation after the start-up warm-up); `--enforce-eager` and `-O 0` run eagerly. The rest of the suite runs eagerly
(tests/conftest.py sets KVSHARD_COMPILATION_LEVEL=0); these engines name their level.
"""

from __future__ import annotations

import argparse
import os
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvshard import LLM, SamplingParams
from kvshard.compilation import COMPILED, EAGER, describe_compilation, inductor_cache_dir, parse_compilation_level
from kvshard.engine.arg_utils import EngineArgs
from kvshard.errors import ConfigError

from conftest import Run, assert_same_generation, engine_after_run, tiny_llama_config
from test_mla import CONFIGS as MLA_CONFIGS

NEW_TOKENS = 16
PROMPTS = [
    [3, 1, 4],  # shorter than a virtual block
    [(7 * i) % 97 + 1 for i in range(40)],  # longer, prefilled in chunks that attend to cached context
    [(5 * i) % 89 + 2 for i in range(17)],
]
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=3)
SHARDED = dict(tensor_parallel_size=2, decode_context_parallel_size=2, block_size=4, max_num_seqs=4,
               max_num_batched_tokens=16, kv_cache_memory="1MiB")
MLA_NAME = "v3-moe"  # MoE layers (experts picked on the host), Q LoRA, YaRN: test_mla.py's V3


def _compile_state(llm: LLM) -> tuple[int | None, float | None]:
    """Rank 0's graphs compiled and start-up compile seconds (None, None: eager)."""
    runner = llm.engine.runner
    return (runner.compiled.num_compiles, runner.compile_seconds) if runner.compiled is not None else (None, None)


@pytest.fixture(scope="module")
def gqa(checkpoints) -> Path:
    return checkpoints("llama", tiny_llama_config())  # test_dcp_exactness.py's checkpoint


@pytest.fixture(scope="module")
def mla(checkpoints) -> Path:
    config, seed = MLA_CONFIGS[MLA_NAME]
    return checkpoints(f"mla-{MLA_NAME}", config, seed, off_neutral=True)  # test_mla.py's checkpoint


@dataclass
class Engines:
    """A model's compiled engine, still open after its run, and its `--enforce-eager` twin's run."""
    llm: LLM  # compiled
    compiled: Run  # of PROMPTS
    startup: tuple  # rank 0's compile state once started, before the first request
    eager: Run  # of PROMPTS, the same weights and level with --enforce-eager


@pytest.fixture(scope="module")
def engines(gqa, mla, engine_run):
    """Factory: engines(model) -> Engines, the compiled engine started once for the module and kept open, so that
    the graph count test steps the GQA one further rather than compile another. Rank 0 runs in this process
    (its default process group): one engine at a time, so asking for another model closes the open one, and the
    eager twin runs before its compiled engine starts."""
    directories = {"gqa": gqa, "mla": mla}
    made: dict[str, Engines] = {}
    with ExitStack() as open_engine:
        def get(model: str) -> Engines:
            if model not in made:
                open_engine.close()
                made.clear()
                # --enforce-eager wins over the level: the same weights, eagerly
                eager = engine_run(directories[model], PROMPTS, GREEDY, probe=_compile_state,
                                   compilation_config=COMPILED, enforce_eager=True, **SHARDED)
                startup = []
                llm, run = open_engine.enter_context(engine_after_run(
                    LLM, str(directories[model]), PROMPTS, GREEDY, {}, _compile_state,
                    dict(compilation_config=COMPILED, **SHARDED),
                    before=lambda llm: startup.append(_compile_state(llm))))
                made[model] = Engines(llm, run, startup[0], eager)
            return made[model]

        yield get


def _hf_generation(hf_reference, directory: Path):
    tokens, steps = hf_reference(directory, PROMPTS, NEW_TOKENS, logprobs=True)
    return tokens, [[{i: float(row[i]) for i in range(row.shape[0])} for row in rows] for rows in steps]


# GQA last: its compiled engine stays open for the graph count test
@pytest.mark.parametrize("model", ["mla", "gqa"])
def test_compiled_step_matches_transformers_and_the_eager_step(request, engines, hf_reference, model):
    directory = request.getfixturevalue(model)
    started = engines(model)
    compiled_run, eager = started.compiled, started.eager
    num_compiles, seconds = compiled_run.probed
    assert num_compiles == 1 and seconds > 0, "the compiled engine compiled one graph at start-up"
    assert eager.probed == (None, None)
    assert describe_compilation(eager.config).startswith("model step: eager (--enforce-eager)")
    assert compiled_run.blocks_used_after == eager.blocks_used_after == 0
    want_tokens, want_logprobs = _hf_generation(hf_reference, directory)
    assert_same_generation(compiled_run.tokens, compiled_run.logprobs, want_tokens, want_logprobs, atol=1e-3,
                           same_candidates=False)
    # inductor fuses the elementwise work around the products: float32 rounding apart, the same step
    assert_same_generation(compiled_run.tokens, compiled_run.logprobs, eager.tokens, eager.logprobs, atol=1e-4)


def test_one_graph_for_every_token_count_and_kept_in_the_cache_directory(engines):
    """Steps of 1 to 16 tokens (decodes of batches 1..4, prefill chunks, mixed steps) after the warm-up compile
    nothing more: the GQA engine of the test above, stepped further."""
    import torch._dynamo.utils

    started = engines("gqa")
    llm, runner = started.llm, started.llm.engine.runner
    assert started.startup[0] == 1  # at start-up, before any request
    graphs_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    seen: list[int] = []
    step_model = runner.step_model

    def counting(input_ids, positions):
        seen.append(input_ids.shape[0])
        return step_model(input_ids, positions)

    runner.step_model = counting
    try:
        for batch in (1, 3, 5):
            prompts = [[(3 * i + j) % 120 + 1 for j in range(2 + 7 * i)] for i in range(batch)]
            llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    finally:
        runner.step_model = step_model
    assert 1 in seen and 16 in seen and len(set(seen)) >= 5, sorted(set(seen))
    assert runner.compiled.num_compiles == 1, f"recompiled for token counts {sorted(set(seen))}"
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs_before
    # inductor's caches live under KVSHARD_CACHE_DIR (the suite's), so a restart reuses them
    cache = Path(inductor_cache_dir())
    assert cache.is_relative_to(Path(os.environ["KVSHARD_CACHE_DIR"]))
    assert any((cache / "fxgraph").rglob("*")), f"no compiled graph cached in {cache}"


def _config(**kwargs):
    return EngineArgs(model="kvshard-demo-gqa", kv_cache_memory="8MiB", max_model_len=256, **kwargs).create_engine_config()


def test_levels_flags_and_what_runs_eagerly():
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    for argv, level, eager in ([["-O3"], COMPILED, False], [["-O", "0"], EAGER, False],
                               [["--compilation-config", '{"level": 3}'], COMPILED, False],
                               [["-O3", "--enforce-eager"], COMPILED, True]):
        args = EngineArgs.from_cli_args(parser.parse_args(argv))
        assert parse_compilation_level(args.compilation_config) == level and args.enforce_eager is eager
    assert describe_compilation(_config(compilation_config=3), device_type="cpu").startswith("model step: compiled")
    assert describe_compilation(_config(compilation_config=0), device_type="cpu") == "model step: eager (-O 0)"
    assert describe_compilation(_config(compilation_config=3, enforce_eager=True), device_type="cpu") == \
        "model step: eager (--enforce-eager)"
    # batch-invariant mode runs its row-tiled products eagerly (its guarantee is the eager step's)
    assert describe_compilation(_config(compilation_config=3, batch_invariant=True), device_type="cpu") == \
        "model step: eager (--batch-invariant runs its row-tiled products eagerly)"
    assert describe_compilation(_config(compilation_config=3), device_type="cuda").startswith("model step: eager")
    for bad in (1, 2, "fast", '{"mode": 3}', True):
        with pytest.raises(ConfigError, match="compilation_config"):
            parse_compilation_level(bad)
