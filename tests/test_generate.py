"""The Python API and sampling, on one rank (fast): what a vLLM user expects of `LLM.generate`."""

from __future__ import annotations

import multiprocessing

import pytest
from transformers import LlamaConfig

from kvshard import LLM, SamplingParams


def tiny_llama():
    return LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=1, head_dim=16, max_position_embeddings=128,
                         initializer_range=0.2, eos_token_id=5, architectures=["LlamaForCausalLM"])


@pytest.fixture(scope="module")
def llm(checkpoints):
    with LLM(str(checkpoints("generate-llama", tiny_llama())), block_size=4, seed=1) as engine:
        yield engine


PROMPT = [10, 20, 30, 40]


def tokens(llm, params, prompt=PROMPT):
    return llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]


def test_same_seed_same_tokens_whatever_else_runs(llm):
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=16, ignore_eos=True)
    alone = tokens(llm, params).token_ids
    batch = llm.generate([PROMPT, [1, 2, 3], PROMPT], [params, SamplingParams(temperature=1.0, max_tokens=16), params],
                         use_tqdm=False)
    assert batch[0].outputs[0].token_ids == alone == batch[2].outputs[0].token_ids
    other = tokens(llm, SamplingParams(temperature=1.0, seed=8, max_tokens=16, ignore_eos=True)).token_ids
    assert other != alone


def test_top_k_one_and_tiny_top_p_are_greedy(llm):
    greedy = tokens(llm, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)).token_ids
    assert tokens(llm, SamplingParams(temperature=1.5, top_k=1, seed=3, max_tokens=12, ignore_eos=True)).token_ids == greedy
    assert tokens(llm, SamplingParams(temperature=1.5, top_p=1e-6, seed=3, max_tokens=12, ignore_eos=True)).token_ids == greedy
    # below float32's range: still the most likely token, not an empty distribution
    assert tokens(llm, SamplingParams(temperature=1, top_p=1e-300, seed=3, max_tokens=12, ignore_eos=True)).token_ids == greedy


def test_a_request_whose_sampling_fails_ends_alone_with_an_error(llm, monkeypatch):
    from kvshard.engine import sampler

    failing_seed = 666
    real_draw = sampler._draw

    def draw(probs, generator):  # the fault: sampling raises for one request's rows only
        if generator.initial_seed() == failing_seed:
            raise RuntimeError("probability tensor contains either `inf`, `nan` or element < 0")
        return real_draw(probs, generator)

    greedy = tokens(llm, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)).token_ids
    seeded = SamplingParams(temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
    expected = tokens(llm, seeded).token_ids
    monkeypatch.setattr(sampler, "_draw", draw)
    failing, fine, fine_seeded = llm.generate(
        [PROMPT, PROMPT, PROMPT],
        [SamplingParams(temperature=1.0, seed=failing_seed, n=2, max_tokens=12, ignore_eos=True),
         SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), seeded],
        use_tqdm=False)
    assert failing.finished and "probability tensor" in failing.error
    assert [c.finish_reason for c in failing.outputs] == ["error", "error"]
    assert fine.error is None and fine.outputs[0].token_ids == greedy
    assert fine_seeded.error is None and fine_seeded.outputs[0].token_ids == expected
    assert llm.engine.pool.num_used == 0 and not llm.engine.requests
    monkeypatch.undo()
    assert tokens(llm, SamplingParams(temperature=1.0, seed=failing_seed, max_tokens=4)).finish_reason == "length"


def test_stop_token_ids_end_the_output_with_reason_stop(llm):
    greedy = tokens(llm, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)).token_ids
    stop_at = greedy[5]
    out = tokens(llm, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=[stop_at]))
    assert out.token_ids == greedy[: greedy.index(stop_at) + 1]
    assert out.finish_reason == "stop"


def test_eos_stops_unless_ignored(llm, monkeypatch):
    greedy = tokens(llm, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)).token_ids
    eos = greedy[4]
    monkeypatch.setattr(llm.engine.config.model.hf_config, "eos_token_id", eos)
    stopped = tokens(llm, SamplingParams(temperature=0, max_tokens=12))
    assert stopped.token_ids == greedy[: greedy.index(eos) + 1]
    assert stopped.finish_reason == "stop"
    ignored = tokens(llm, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert ignored.token_ids == greedy and ignored.finish_reason == "length"


def test_max_tokens_and_n(llm):
    out = llm.generate([PROMPT], SamplingParams(n=3, temperature=1.0, seed=0, max_tokens=5, ignore_eos=True),
                       use_tqdm=False)[0]
    assert [len(c.token_ids) for c in out.outputs] == [5, 5, 5]
    assert [c.finish_reason for c in out.outputs] == ["length"] * 3
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1


def test_outputs_come_back_in_prompt_order_and_blocks_are_freed(llm):
    prompts = [[i + 1] * (3 + 5 * i) for i in range(6)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == prompts
    assert llm.engine.stats().kv_blocks_used == 0


def test_step_time_is_counted_by_kind_prefill_or_decode(llm):
    engine = llm.engine
    before = engine.stats()
    engine.add_request("kinds", [7] * 9, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    engine.step()  # the whole prompt
    after_prompt = engine.stats()
    assert after_prompt.prefill_step_seconds > before.prefill_step_seconds
    assert after_prompt.decode_step_seconds == before.decode_step_seconds
    engine.step()  # a decode
    after_decode = engine.stats()
    assert after_decode.prefill_step_seconds == after_prompt.prefill_step_seconds
    assert after_decode.decode_step_seconds > after_prompt.decode_step_seconds
    while engine.has_unfinished_requests():
        engine.step()


@pytest.mark.parametrize("prompt, params, message", [
    ([], SamplingParams(), "prompt is empty"),
    ([1000], SamplingParams(), r"token ids must be integers in \[0, 128\)"),
    ([5, -1], SamplingParams(), r"token ids must be integers in \[0, 128\)"),
    ([5, 127, 128], SamplingParams(), r"token ids must be integers in \[0, 128\)"),
    ([5, True], SamplingParams(), r"token ids must be integers in \[0, 128\)"),
    ([5, 2.0], SamplingParams(), r"token ids must be integers in \[0, 128\)"),
    ([5, "6"], SamplingParams(), r"token ids must be integers in \[0, 128\)"),
    ([1] * 120, SamplingParams(max_tokens=20), "maximum context length is 128 tokens"),
])
def test_bad_requests_fail_before_anything_runs(llm, prompt, params, message):
    with pytest.raises(ValueError, match=message):
        llm.generate([PROMPT, prompt], params, use_tqdm=False)
    assert llm.engine.has_unfinished_requests() is False


def test_prompts_in_vllms_dict_forms_and_wrong_types(llm):
    greedy = SamplingParams(temperature=0, max_tokens=3)
    plain = llm.generate([PROMPT], greedy, use_tqdm=False)[0]
    as_dict = llm.generate({"prompt_token_ids": PROMPT}, greedy, use_tqdm=False)[0]
    assert as_dict.prompt_token_ids == PROMPT and as_dict.outputs[0].token_ids == plain.outputs[0].token_ids
    for prompts, message in [(None, "prompts must be a string"), (5, "prompts must be a string"),
                             (b"abc", "prompts must be a string"), ([{"text": "x"}], "a prompt given as a dict"),
                             ([PROMPT, 3.5], "a prompt must be a string or a list of token ids")]:
        with pytest.raises(TypeError, match=message):
            llm.generate(prompts, greedy, use_tqdm=False)
    with pytest.raises(TypeError, match="sampling_params must be a SamplingParams"):
        llm.generate([PROMPT], {"max_tokens": 3}, use_tqdm=False)
    assert llm.engine.has_unfinished_requests() is False


def test_a_closed_llm_says_so(checkpoints):
    closed = LLM(str(checkpoints("generate-llama", tiny_llama())), block_size=4)
    closed.close()
    with pytest.raises(RuntimeError, match="this LLM is closed"):
        closed.generate([PROMPT], SamplingParams(max_tokens=2), use_tqdm=False)


@pytest.mark.parametrize("kwargs, message", [
    ({"temperature": -1}, "temperature must be a finite number >= 0"),
    ({"top_p": 0}, r"top_p must be in \(0, 1\]"),
    ({"max_tokens": 0}, "max_tokens must be an integer >= 1"),
    ({"n": 0}, "n must be an integer >= 1"),
    ({"top_k": -5}, "top_k must be -1"),
])
def test_invalid_sampling_params_say_what_is_wrong(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_sharded_checkpoint_loads_the_same_weights(llm, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(llm.config.model.path, dtype=torch.float32)
    model.save_pretrained(tmp_path, max_shard_size="40KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    want = tokens(llm, params)
    with LLM(str(tmp_path), block_size=4) as sharded:
        got = tokens(sharded, params)
    assert got.token_ids == want.token_ids
    assert got.logprobs == want.logprobs


def test_demo_model_generates_text_from_strings():
    with LLM("kvshard-demo-gqa", max_model_len=256) as llm:
        out = llm.generate(["Hello, world!"], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                           use_tqdm=False)[0]
        assert out.prompt == "Hello, world!"
        assert len(out.outputs[0].token_ids) == 6
        assert out.outputs[0].text == llm.get_tokenizer().decode(out.outputs[0].token_ids, skip_special_tokens=True)
    assert multiprocessing.active_children() == []


def test_text_grows_token_by_token_and_stop_strings_spanning_tokens_cut_exactly():
    with LLM("kvshard-demo-gqa", max_model_len=256) as llm:
        tokenizer = llm.get_tokenizer()
        params = SamplingParams(temperature=0.8, seed=5, n=2, max_tokens=24, ignore_eos=True)
        samples = llm.generate(["Once upon a time"], params, use_tqdm=False)[0].outputs
        for sample in samples:
            assert sample.text == tokenizer.decode(sample.token_ids, skip_special_tokens=True)
        # a stop string made of the end of one token's text and the start of the next one's
        ids = samples[0].token_ids
        pieces = [tokenizer.decode(ids[:i], skip_special_tokens=True) for i in range(len(ids) + 1)]
        boundary = next(i for i in range(4, len(ids)) if len(pieces[i]) > len(pieces[i - 1]) + 1
                        and len(pieces[i + 1]) > len(pieces[i]) + 1)
        full = pieces[-1]
        stop = full[len(pieces[boundary]) - 2 : len(pieces[boundary]) + 2]
        stopped = llm.generate(["Once upon a time"], SamplingParams(**{**vars(params), "stop": [stop]}),
                               use_tqdm=False)[0].outputs[0]
        assert stopped.finish_reason == "stop"
        assert stopped.text == full[: full.find(stop)]
        assert stopped.token_ids == ids[: boundary + 1]  # the token that completed the stop string is the last


def test_a_checkpoint_missing_part_of_a_fused_projection_is_refused(llm, tmp_path):
    from safetensors.torch import load_file, save_file

    tensors = load_file(next(llm.config.model.path.glob("*.safetensors")))
    del tensors["model.layers.1.self_attn.k_proj.weight"]  # q and v of qkv_proj are still there
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((llm.config.model.path / "config.json").read_text())
    with pytest.raises(ValueError, match=r"lacks .*model\.layers\.1\.self_attn\.qkv_proj\.weight \(k\)"):
        LLM(str(tmp_path), block_size=4)
