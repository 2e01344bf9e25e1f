"""A decode step's layers as one flat program of the kernel extension's calls (kvshard/models/decode_program.py)
against the layers' modules, its oracle: the same states bit for bit at every decode step, the same tokens and
log-probabilities over whole generations, for the Llama family's variants (QKV biases, an output bias with MLP
biases, Qwen3's per-head norms) in bfloat16 and float32; the steps it leaves to the modules; where it is off."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from transformers import Qwen2Config, Qwen3Config

from kvshard import LLM, SamplingParams
from kvshard.attention import paged
from kvshard.engine.arg_utils import EngineArgs
from kvshard.models import decode_program
from kvshard.models.decode_program import DecodeProgram, program_unavailable
from tests.conftest import random_hf_model, tiny_llama_config

NO_COMPILER = shutil.which(os.environ.get("CXX", "c++")) is None
pytestmark = pytest.mark.skipif(NO_COMPILER, reason="no C++ compiler found to build kvshard's kernel extension")

MODELS = {  # name -> (config, dtype); hidden 64 and MLP 128: every product takes the AMX tiles where the CPU has them
    "llama-bf16": (tiny_llama_config(), "bfloat16"),
    "llama-f32": (tiny_llama_config(), "float32"),
    "qwen2-bias-bf16": (tiny_llama_config(Qwen2Config, architectures=["Qwen2ForCausalLM"]), "bfloat16"),
    "llama-all-biases-bf16": (tiny_llama_config(attention_bias=True, mlp_bias=True), "bfloat16"),
    "qwen3-qk-norm-bf16": (tiny_llama_config(Qwen3Config, architectures=["Qwen3ForCausalLM"]), "bfloat16"),
}
PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6], [7, 7], list(range(20, 57))]
# where the program runs on this machine (an extension built with AVX-512 for its fused operators, the paged kernel)
WHY_NOT_HERE = None if NO_COMPILER else program_unavailable(
    EngineArgs(model="kvshard-demo-gqa").create_engine_config(), "cpu")
needs_program = pytest.mark.skipif(WHY_NOT_HERE is not None, reason=f"no decode program here: {WHY_NOT_HERE}")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """name -> a checkpoint of MODELS[name] with random weights, its norms and biases off their neutral init (zero
    biases would hide one left out)."""
    made = {}

    def make(name: str):
        if name not in made:
            model = random_hf_model(MODELS[name][0], seed=0, off_neutral=True)
            with torch.no_grad():
                for param_name, param in model.named_parameters():
                    if param_name.endswith(".bias"):
                        param.uniform_(-0.5, 0.5)
            made[name] = tmp_path_factory.mktemp(name)
            model.save_pretrained(made[name])
        return made[name]

    return make


def _started(checkpoint, name: str, monkeypatch, program: bool) -> LLM:
    monkeypatch.setenv("KVSHARD_DECODE_PROGRAM", "1" if program else "0")
    return LLM(str(checkpoint(name)), dtype=MODELS[name][1], block_size=4, seed=0, max_num_seqs=8)


@needs_program
@pytest.mark.parametrize("name,native", [(name, True) for name in MODELS] + [
    (name, False) for name in ("llama-bf16", "qwen2-bias-bf16", "llama-all-biases-bf16", "qwen3-qk-norm-bf16")])
def test_every_decode_step_gives_the_modules_bits(checkpoint, monkeypatch, name, native):
    """At each step the program runs, the modules run the same step too: the states must be equal bit for bit
    (the modules write the same keys and values to the same slots again). Where the CPU has AMX tiles a bfloat16
    model's layers run in one call of the extension (`decode_layers`); float32 ones, and bfloat16 ones with that
    call taken away, run the same calls from Python."""
    with _started(checkpoint, name, monkeypatch, program=True) as llm:
        runner = llm.engine.runner
        program = runner.step_model
        assert isinstance(program, DecodeProgram)
        assert (program.native is not None) == (MODELS[name][1] == "bfloat16" and paged.amx_ready())
        if not native:
            program.native = None
        compared, left = [], []
        real_run = program.run

        def both(input_ids, positions, meta, caches):
            states = real_run(input_ids, positions, meta, caches)
            compared.append(torch.equal(states, program.fallback(input_ids, positions)))
            return states

        real_fallback = program.fallback
        program.run = both
        program.fallback = lambda ids, positions: left.append(ids.shape[0]) or real_fallback(ids, positions)
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        llm.generate(PROMPTS, params, use_tqdm=False)
    assert compared and all(compared), f"{compared.count(False)} of {len(compared)} steps differ"
    assert left  # the prompts' prefill steps ran in the modules


@needs_program
@pytest.mark.parametrize("name", ["llama-bf16", "qwen3-qk-norm-bf16"])
def test_a_generation_is_the_same_with_the_program_and_without(checkpoint, monkeypatch, name):
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=3)
    runs = []
    for program in (True, False):
        with _started(checkpoint, name, monkeypatch, program) as llm:
            assert isinstance(llm.engine.runner.step_model, DecodeProgram) == program
            calls = []
            if program:
                real = llm.engine.runner.step_model.run
                llm.engine.runner.step_model.run = lambda *args: calls.append(1) or real(*args)
            outputs = llm.generate(PROMPTS, params, use_tqdm=False)
            runs.append([(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs])
            assert bool(calls) == program
    assert runs[0] == runs[1]


@needs_program
def test_steps_it_leaves_to_the_modules(checkpoint, monkeypatch):
    """A step with a prefill chunk, more rows than the AMX products take, or in the batch-invariant mode runs in the
    layers' modules."""
    from kvshard.layers.batch_invariant import batch_invariant_mode

    with _started(checkpoint, "llama-bf16", monkeypatch, program=True) as llm:
        program = llm.engine.runner.step_model

        from kvshard.attention.backends import PagedBackend

        class Meta:
            backend = object.__new__(PagedBackend)
            writes_every_token, has_prefill, uses_context, context_rows = True, False, True, 4

        meta = Meta()
        assert program.takes(meta, 4)
        assert not program.takes(meta, 3)  # a row past the context rows: a chunk's own rows
        meta.has_prefill = True
        assert not program.takes(meta, 4)
        meta.has_prefill, meta.context_rows = False, program.max_rows + 1
        assert not program.takes(meta, program.max_rows + 1)
        meta.context_rows = 4
        with batch_invariant_mode():
            assert not program.takes(meta, 4)
        meta.writes_every_token = False  # DCP: only some rows' keys are this rank's
        assert not program.takes(meta, 4)


def test_where_it_is_off(monkeypatch):
    def why(**kwargs):
        return program_unavailable(EngineArgs(**{"model": "kvshard-demo-gqa", **kwargs}).create_engine_config(), "cpu")

    if WHY_NOT_HERE is None:
        assert why() is None and why(dtype="bfloat16") is None
    assert "one rank's steps" in why(tensor_parallel_size=2)
    assert "one rank's steps" in why(tensor_parallel_size=2, decode_context_parallel_size=2)
    assert "Llama-family" in why(model="kvshard-demo-mla")
    assert "FP8 KV cache" in why(kv_cache_dtype="fp8")
    assert "float32 and bfloat16" in why(dtype="float16")
    assert "compiled" in why(compilation_config=3)
    assert "--batch-invariant" in why(batch_invariant=True)
    assert "paged attention kernel" in why(attention_backend="gather")
    assert why(enforce_eager=True) == "--enforce-eager"
    config = EngineArgs(model="kvshard-demo-gqa").create_engine_config()
    assert "CPU's" in program_unavailable(config, "cuda")
    if WHY_NOT_HERE is None:
        assert "one flat program of the kernel extension's calls" in config.layout_report()
    monkeypatch.setenv("KVSHARD_DECODE_PROGRAM", "0")
    assert why() == "KVSHARD_DECODE_PROGRAM=0"
    assert "decode steps: eager, in the layers' modules (KVSHARD_DECODE_PROGRAM=0)" in \
        decode_program.describe_decode_program(config)
