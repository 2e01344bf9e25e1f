"""What users bring from vLLM: `--generation-config` (the model's sampling defaults), the default context length
under RoPE scaling, and `vllm serve`'s command-line flags (and `LLM(...)`'s keywords): taken and acted on, taken
with a start-up note where they change nothing kvshard does, or refused in one line saying what kvshard offers.

Start-up errors run `kvshard.entrypoints.cli.main` in process with the step that starts the ranks replaced
(`serve._serve`), so that nothing here starts a server for them; the routes run on a small in-process engine.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from conftest import assert_same_generation, hf_greedy_with_logprobs, refused, tiny_llama_config
from kvshard import LLM, SamplingParams
from kvshard.config import ConfigError
from kvshard.config.generation import AUTO_LENGTH, load_generation_defaults, parse_length
from kvshard.engine.arg_utils import EngineArgs
from kvshard.entrypoints import serve
from kvshard.entrypoints.cli import main

DEMO = "kvshard-demo-gqa"
SMALL = ["--max-model-len", "512", "--kv-cache-memory", "16MiB", "--port", "0"]
# what a model creator's generation_config.json recommends (every field kvshard takes from it)
RECOMMENDED = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1,
               "max_new_tokens": 5}
DEFAULTS = {**{k: v for k, v in RECOMMENDED.items() if k != "max_new_tokens"}, "max_tokens": 5}


@pytest.fixture(scope="module")
def demo_dir():
    from kvshard.models.demo import ensure_demo_model

    return ensure_demo_model(DEMO)


def with_generation_config(directory: Path, demo_dir: Path, **fields) -> Path:
    """A copy of the demo model whose generation_config.json also holds `fields`."""
    model = Path(shutil.copytree(demo_dir, directory))
    generation = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**generation, **fields}))
    return model


@pytest.fixture(scope="module")
def recommending_model(tmp_path_factory, demo_dir) -> Path:
    return with_generation_config(tmp_path_factory.mktemp("gen") / "model", demo_dir, **RECOMMENDED)


@pytest.fixture
def served(monkeypatch):
    """`kvshard serve ARGV` up to the ranks' start: the config and flags it would serve with."""
    seen = {}

    def record(config, master, listener, names, api_key, kv_transfer_config, args):
        listener.close()
        seen.update(config=config, names=names, api_key=api_key, args=args)
        return 0

    monkeypatch.setattr(serve, "_serve", record)

    def run(argv: list[str]) -> dict:
        seen.clear()
        assert main(["serve", *argv]) == 0
        return dict(seen)

    return run


# --- 1. --generation-config -------------------------------------------------------------------------------------

def test_the_models_generation_config_sets_the_defaults_and_the_report_says_which(recommending_model, tmp_path):
    config = EngineArgs(str(recommending_model), kv_cache_memory="16MiB", max_model_len=256).create_engine_config()
    assert config.generation.values == DEFAULTS
    line = next(line for line in config.layout_report().splitlines() if line.startswith("sampling defaults:"))
    assert "temperature=0.6" in line and "max_tokens=5" in line and "generation_config.json" in line
    assert "--generation-config vllm" in line
    # vllm: kvshard's own defaults, whatever the file says
    own = EngineArgs(str(recommending_model), kv_cache_memory="16MiB", max_model_len=256,
                     generation_config="vllm").create_engine_config()
    assert own.generation.values == {}
    assert "sampling defaults: kvshard's own (--generation-config vllm)" in own.layout_report()
    # a folder: its generation_config.json instead of the model's
    folder = tmp_path / "elsewhere"
    folder.mkdir()
    (folder / "generation_config.json").write_text(json.dumps({"temperature": 0.3, "top_k": 0}))
    other = EngineArgs(str(recommending_model), kv_cache_memory="16MiB", max_model_len=256,
                       generation_config=str(folder)).create_engine_config()
    assert other.generation.values == {"temperature": 0.3, "top_k": 0}
    # --override-generation-config over the file, as vLLM's
    assert load_generation_defaults(recommending_model, "auto", '{"temperature": 0.0}').values == \
        {**DEFAULTS, "temperature": 0.0}
    # a model without recommendations keeps kvshard's defaults and says so
    plain = EngineArgs(DEMO, kv_cache_memory="16MiB", max_model_len=256).create_engine_config()
    assert plain.generation.values == {}
    assert "sampling defaults: kvshard's own (the model's generation_config.json sets none)" in plain.layout_report()


@pytest.mark.parametrize("field, value", [("temperature", -0.5), ("top_p", 0), ("top_k", 2.5), ("min_p", 3),
                                          ("repetition_penalty", "high"), ("max_new_tokens", 0)])
def test_a_bad_generation_config_value_fails_at_startup_naming_the_file_and_the_field(
        no_ranks, capsys, tmp_path, demo_dir, field, value):
    model = with_generation_config(tmp_path / "model", demo_dir, **{field: value})
    line = refused(capsys, [str(model), *SMALL], f"{model / 'generation_config.json'}: {field}={value!r}")
    assert "--generation-config vllm" in line
    # the same from Python
    with pytest.raises(ConfigError, match=field):
        EngineArgs(str(model), kv_cache_memory="16MiB").create_engine_config()


def test_bad_generation_config_flags_are_refused_in_one_line(no_ranks, capsys, tmp_path):
    refused(capsys, [DEMO, *SMALL, "--generation-config", str(tmp_path / "missing")], "is not a folder")
    refused(capsys, [DEMO, *SMALL, "--generation-config", str(tmp_path)], "holds no generation_config.json")
    refused(capsys, [DEMO, *SMALL, "--override-generation-config", '{"temperature": -1}'],
            "--override-generation-config: temperature=-1")
    refused(capsys, [DEMO, *SMALL, "--override-generation-config", '{"beams": 4}'], "beams is not a sampling default")


@pytest.fixture(scope="module")
def recommending_llm(recommending_model):
    with LLM(str(recommending_model), kv_cache_memory="16MiB", max_model_len=256) as llm:
        yield llm


def test_llm_applies_the_defaults_when_given_no_sampling_params(recommending_llm):
    defaults = recommending_llm.get_default_sampling_params()
    assert {k: getattr(defaults, k) for k in DEFAULTS} == DEFAULTS
    [output] = recommending_llm.generate(["The cat sat"], use_tqdm=False)
    assert len(output.outputs[0].token_ids) <= 5  # max_new_tokens, not kvshard's 16
    seen = []
    original = recommending_llm.engine.add_request
    recommending_llm.engine.add_request = lambda rid, prompt, params, *rest: (seen.append(params),
                                                                             original(rid, prompt, params, *rest))
    try:
        recommending_llm.chat([{"role": "user", "content": "Hi"}], use_tqdm=False)
        recommending_llm.generate(["The cat sat"], SamplingParams(max_tokens=7, ignore_eos=True), use_tqdm=False)
    finally:
        del recommending_llm.engine.add_request
    assert {k: getattr(seen[0], k) for k in DEFAULTS} == DEFAULTS  # chat without params: the model's defaults
    assert (seen[1].temperature, seen[1].top_k, seen[1].max_tokens) == (1.0, -1, 7)  # given params are used as given


@pytest.fixture(scope="module")
def client(recommending_model):
    from kvshard.engine.llm_engine import LLMEngine
    from kvshard.entrypoints.openai_server import OpenAIServer

    engine = LLMEngine(EngineArgs(str(recommending_model), kv_cache_memory="16MiB",
                                  max_model_len=256).create_engine_config())
    seen: list[SamplingParams] = []
    original = engine.add_request

    def add_request(request_id, prompt, params, *rest):
        seen.append(params)
        return original(request_id, prompt, params, *rest)

    engine.add_request = add_request
    with TestClient(OpenAIServer(engine, ["m"]).app) as test_client:
        test_client.seen = seen
        yield test_client


def sent(client, route: str, **fields) -> tuple[SamplingParams, dict]:
    """The SamplingParams the route handed the engine for a request of `fields`, and the response."""
    client.seen.clear()
    if route == "chat":
        body = {"model": "m", "messages": [{"role": "user", "content": "The cat"}], **fields}
        response = client.post("/v1/chat/completions", json=body)
    elif route == "completions":
        response = client.post("/v1/completions", json={"model": "m", "prompt": "The cat", **fields})
    else:
        response = client.post("/v1/responses", json={"model": "m", "input": "The cat", "store": False, **fields})
    assert response.status_code == 200, response.text
    [params] = client.seen
    return params, response.json()


def sampling(params: SamplingParams) -> dict:
    return {k: getattr(params, k) for k in DEFAULTS}


@pytest.mark.parametrize("route", ["chat", "completions", "responses"])
def test_every_route_applies_the_models_defaults_where_the_request_leaves_them_out(client, route):
    params, _ = sent(client, route)
    assert sampling(params) == DEFAULTS  # completions: min(its default 16, max_new_tokens 5), as vLLM's
    # a request's own value wins, an explicit temperature 0 too (greedy); the others keep the model's
    given = {"temperature": 0, "top_p": 1.0} if route == "responses" else \
        {"temperature": 0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0}
    params, _ = sent(client, route, **given)
    assert params.temperature == 0.0 and params.greedy and params.top_p == 1.0
    assert sampling(params) == {**DEFAULTS, **given}


@pytest.mark.parametrize("route, field", [("chat", "max_tokens"), ("chat", "max_completion_tokens"),
                                          ("completions", "max_tokens"), ("responses", "max_output_tokens")])
def test_max_new_tokens_caps_every_request_as_vllms_server_wide_limit(client, route, field):
    params, _ = sent(client, route, **{field: 3})
    assert params.max_tokens == 3
    extra = {"ignore_eos": True} if route != "responses" else {}
    params, body = sent(client, route, **{field: 50}, **extra)
    assert params.max_tokens == 5
    if route != "responses":
        assert body["usage"]["completion_tokens"] == 5


# --- 2. max_model_len under RoPE scaling ---------------------------------------------------------------------------

ROPE = {"rope_theta": 10000.0}
SCALINGS = {
    # name: (rope_parameters, max_position_embeddings, the default max_model_len, in the report)
    "none": ({"rope_type": "default", **ROPE}, 48, 48, "max_position_embeddings 48"),
    "linear": ({"rope_type": "linear", "factor": 2.0, **ROPE}, 48, 96, "max_position_embeddings 48 x linear RoPE "
                                                                        "factor 2"),
    "yarn": ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 48, **ROPE}, 48, 192,
             "original_max_position_embeddings 48 x yarn RoPE factor 4"),
    # DeepSeek-V3's way: max_position_embeddings already the extended length, over the original one
    "yarn-extended": ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, **ROPE}, 128, 128,
                      "original_max_position_embeddings 32 x yarn RoPE factor 4"),
    "dynamic": ({"rope_type": "dynamic", "factor": 2.0, **ROPE}, 48, 48, "dynamic RoPE scaling is not extended"),
    "llama3": ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16, **ROPE}, 48, 48, "max_position_embeddings 48"),
}


def scaled_model(checkpoints, name: str, seed: int = 0) -> Path:
    rope, max_pos, _, _ = SCALINGS[name]
    return checkpoints(f"rope-{name}-{seed}", tiny_llama_config(max_position_embeddings=max_pos,
                                                               rope_parameters=dict(rope)), seed)


@pytest.mark.parametrize("name", list(SCALINGS))
def test_the_default_max_model_len_follows_rope_scaling_and_the_report_says_why(checkpoints, name):
    _, _, length, why = SCALINGS[name]
    path = scaled_model(checkpoints, name)
    config = EngineArgs(str(path), kv_cache_memory="1MiB").create_engine_config()
    assert config.scheduler.max_model_len == length
    report = config.layout_report()
    assert f"max model len: {length:,} tokens (the model's, " in report and why in report
    assert EngineArgs(str(path), kv_cache_memory="1MiB", max_model_len=length).create_engine_config()
    with pytest.raises(ConfigError, match=f"max_model_len={length + 1} exceeds the model's"):
        EngineArgs(str(path), kv_cache_memory="1MiB", max_model_len=length + 1).create_engine_config()


def test_a_length_the_kv_cache_cannot_hold_is_still_refused(checkpoints):
    path = scaled_model(checkpoints, "yarn")  # 192 tokens by default; 4 blocks of 16 hold 64
    with pytest.raises(ConfigError, match="fewer than one request of max_model_len=192"):
        EngineArgs(str(path), num_kv_blocks=4).create_engine_config()
    # auto: the longest the KV cache holds
    config = EngineArgs(str(path), num_kv_blocks=4, max_model_len="auto").create_engine_config()
    assert config.scheduler.max_model_len == 64 and "auto: as many tokens as the KV cache holds" in \
        config.layout_report()


@pytest.mark.parametrize("name, seed", [("linear", 1), ("yarn", 0)])  # seeds without a near-tie
def test_linear_and_yarn_match_transformers_beyond_max_position_embeddings(checkpoints, name, seed):
    path = scaled_model(checkpoints, name, seed)
    prompts = [[(7 * i) % 97 + 2 for i in range(70)], [(5 * i) % 89 + 3 for i in range(60)]]  # past 48 positions
    new_tokens = 10
    want_tokens, want_steps = hf_greedy_with_logprobs(path, prompts, new_tokens)
    want_logprobs = [[dict(enumerate(step.tolist())) for step in steps] for steps in want_steps]
    with LLM(str(path), kv_cache_memory="1MiB", max_num_seqs=4, max_num_batched_tokens=32) as llm:  # default length
        assert llm.config.scheduler.max_model_len > 48 + 32
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True,
                                                    logprobs=3), use_tqdm=False)
    assert_same_generation([o.outputs[0].token_ids for o in outs], [o.outputs[0].logprobs for o in outs],
                           want_tokens, want_logprobs, atol=1e-4, same_candidates=False)


# --- 3. vLLM's flags -----------------------------------------------------------------------------------------------

def test_max_model_len_reads_vllms_suffixes():
    assert [parse_length(v) for v in ("4096", "32k", "32K", "25.6k", "1m", "1M", "auto", "-1")] == \
        [4096, 32000, 32768, 25600, 1_000_000, 2**20, AUTO_LENGTH, AUTO_LENGTH]
    with pytest.raises(ConfigError, match="did you mean 32.5k"):
        parse_length("32.5K")


def test_vllm_flags_kvshard_takes_reach_the_engine_and_the_server(served, tmp_path):
    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    seen = served([DEMO, *SMALL, "--served-model-name", "my-model", "other", "--api-key", "k", "--host", "127.0.0.1",
                   "--max-model-len", "1K", "--max-num-seqs", "8", "--max-num-batched-tokens", "512",
                   "--no-enable-prefix-caching", "--dtype", "half", "--seed", "7", "--enforce-eager",
                   "--kv-cache-dtype", "fp8", "--block-size", "32", "--chat-template", str(template),
                   "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--uvicorn-log-level", "warning",
                   "-tp", "1", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2, '
                                                      '"prompt_lookup_max": 3, "prompt_lookup_min": 1}'])
    config, args = seen["config"], seen["args"]
    assert seen["names"] == ["my-model", "other"] and seen["api_key"] == "k"
    assert config.scheduler.max_model_len == 1024 and config.scheduler.max_num_seqs == 8
    assert config.scheduler.max_num_batched_tokens == 512 and not config.cache.enable_prefix_caching
    assert str(config.model.dtype) == "torch.float16" and config.seed == 7 and config.enforce_eager
    assert config.cache.kv_cache_dtype == "fp8" and config.cache.block_size == 32
    assert config.speculative.num_speculative_tokens == 2
    assert args.chat_template.startswith("{% for m") and args.uvicorn_log_level == "warning"
    assert served([DEMO, *SMALL, "--max-model-len", "2k"])["config"].scheduler.max_model_len == 2000
    assert served([DEMO, *SMALL, "--enable-prefix-caching"])["config"].cache.enable_prefix_caching


HARMLESS = [(["--disable-frontend-multiprocessing"], "--disable-frontend-multiprocessing"),
            (["--disable-log-requests"], "--disable-log-requests"),
            (["--trust-remote-code"], "--trust-remote-code"),
            (["--swap-space", "4"], "--swap-space 4"),
            (["--download-dir", "/tmp/hub"], "--download-dir /tmp/hub"),
            (["--enable-chunked-prefill"], "--enable-chunked-prefill"),
            (["--distributed-executor-backend", "mp"], "--distributed-executor-backend mp"),
            (["--disable-log-stats"], "--disable-log-stats"),
            (["--load-format", "safetensors"], None), (["--pipeline-parallel-size", "1"], None),
            (["--data-parallel-size", "1"], None), (["--max-logprobs", "20"], None),
            (["--response-role", "assistant"], None), (["--generation-config", "auto"], None)]


@pytest.mark.parametrize("flags, note", HARMLESS, ids=[" ".join(f) for f, _ in HARMLESS])
def test_flags_that_change_nothing_are_accepted_with_a_note(served, flags, note):
    report = served([DEMO, *SMALL, *flags])["config"].layout_report()
    notes = [line for line in report.splitlines() if line.startswith("accepted, changes nothing: ")]
    if note is None:
        assert notes == []
    else:
        assert len(notes) == 1 and notes[0].removeprefix("accepted, changes nothing: ").startswith(note), notes


REFUSED = [(["--pipeline-parallel-size", "2"], "--pipeline-parallel-size 2: kvshard has no pipeline parallelism"),
           (["-dp", "2"], "--data-parallel-size 2"),
           (["--gpu-memory-utilization", "0.9"], "--kv-cache-memory"),
           (["--no-enable-chunked-prefill"], "--no-enable-chunked-prefill is not taken"),
           (["--enable-log-requests"], "--enable-log-requests is not taken"),
           (["--reasoning-parser", "deepseek_r1"], "kvshard has no reasoning parsers"),
           (["--response-role", "user"], "--response-role 'user' is not taken"),
           (["--max-logprobs", "50"], "--max-logprobs 50"),
           (["--quantization", "awq"], "--quantization 'awq' is not taken"),
           (["-q", "fp8"], "kvshard does not quantize one as it loads it"),
           (["--load-format", "dummy"], "it makes no random weights"),
           (["--load-format", "pt"], "--load-format pt: the checkpoint's weights kvshard reads are .safetensors"),
           (["--revision", "main"], "kvshard never downloads"),
           (["--tokenizer", "someone/else"], "reads the tokenizer from the model directory"),
           (["--distributed-executor-backend", "ray"], "--distributed-executor-backend 'ray' is not taken"),
           (["--distributed-executor-backend", "uni", "-tp", "2"], "uni runs one rank"),
           (["--kv-cache-dtype", "fp8_e5m2"], "kv_cache_dtype='fp8_e5m2' is not supported"),
           (["--max-model-len", "32.5K"], "did you mean 32.5k"),
           (["--max-model-len", "lots"], "max_model_len='lots' is not a number of tokens"),
           (["--max-model-len", "64k"], "max_model_len=64000 exceeds the model's max_position_embeddings=32768")]


@pytest.mark.parametrize("flags, named", REFUSED, ids=[" ".join(f) for f, _ in REFUSED])
def test_flags_asking_for_what_kvshard_does_not_do_are_refused_in_one_line(no_ranks, capsys, flags, named):
    refused(capsys, [DEMO, *SMALL, *flags], named)


def test_the_tokenizer_flag_naming_the_model_itself_is_taken(served, demo_dir):
    assert served([DEMO, *SMALL, "--tokenizer", str(demo_dir)])["config"]


def test_llm_takes_the_same_vllm_keywords():
    def config(**kwargs):
        kwargs.setdefault("max_model_len", 512)
        return EngineArgs.from_kwargs(DEMO, kv_cache_memory="16MiB", **kwargs).create_engine_config()

    with pytest.raises(ConfigError, match="--gpu-memory-utilization is not taken"):
        config(gpu_memory_utilization=0.9)
    with pytest.raises(ConfigError, match="pipeline parallelism"):
        config(pipeline_parallel_size=2)
    with pytest.raises(ConfigError, match="chunks"):
        config(enable_chunked_prefill=False)
    assert "--trust-remote-code" in config(trust_remote_code=True, enable_chunked_prefill=True).layout_report()
    assert config(max_model_len="8k").scheduler.max_model_len == 8000
    assert config(generation_config="vllm").generation.values == {}
    with pytest.raises(ConfigError, match="pipeline parallelism"):  # before any rank starts
        LLM(DEMO, pipeline_parallel_size=2)


def test_a_chat_request_without_max_tokens_near_the_context_length_gets_the_room_left(client):
    words = 40
    while True:  # a conversation 1 to 4 tokens short of max_model_len (256)
        messages = [{"role": "user", "content": " ".join(["cat"] * words)}]
        count = client.post("/tokenize", json={"model": "m", "messages": messages}).json()["count"]
        if count >= 252:
            break
        words += 1
    assert count < 256
    client.seen.clear()
    response = client.post("/v1/chat/completions", json={"model": "m", "messages": messages})
    assert response.status_code == 200, response.text  # vLLM's: the limit leaves room, it refuses nothing
    assert client.seen[0].max_tokens == 256 - count
    # a max_tokens the request gives is its own: too much for the context is refused as before
    response = client.post("/v1/chat/completions", json={"model": "m", "messages": messages, "max_tokens": 5})
    assert response.status_code == 400 and "max_tokens" in response.text
