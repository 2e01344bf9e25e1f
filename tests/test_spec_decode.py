"""Speculative decoding: n-gram, draft-model and MTP drafts verified as a (k+1)-token step through the
DCP rhythm.

Greedy tokens equal plain decoding in every layout (drafts cross DCP shard and
block boundaries, requests are preempted while they speculate, no block leaks);
the MTP module's drafts equal a reference computed from the checkpoint's tensors;
sampled tokens follow the target distribution (statistical checks, one of which
shows that the check catches a sampler without the rejection step).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from kvshard import LLM, SamplingParams
from kvshard.config import SchedulerConfig
from kvshard.engine.arg_utils import EngineArgs
from kvshard.engine.sampler import _filtered_probs, rejection_sample, verify_drafts
from kvshard.engine.scheduler import Scheduler
from kvshard.engine.sequence import Sequence
from kvshard.errors import ConfigError
from kvshard.kv.block_pool import BlockPool
from kvshard.kv.layout import DCPLayout
from kvshard.spec_decode import parse_speculative_config
from kvshard.spec_decode.ngram import NgramProposer
from conftest import assert_same_generation, environment, tiny_llama_config

BLOCK = 4
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


# --- configuration ----------------------------------------------------------------------------

def test_speculative_config_from_json_and_dict():
    config = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}')
    assert (config.method, config.num_speculative_tokens, config.prompt_lookup_max, config.prompt_lookup_min) == \
        ("ngram", 4, 3, 1)
    assert parse_speculative_config(NGRAM).num_speculative_tokens == 3
    assert parse_speculative_config(None) is None


@pytest.mark.parametrize("value, message", [
    ("{not json", "not valid JSON"),
    ({"method": "eagle", "num_speculative_tokens": 2}, "not supported"),
    ({"method": "ngram"}, "needs num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "positive integer"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "exceeds"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 2}, "unknown fields"),
])
def test_speculative_config_errors_say_what_to_change(value, message):
    with pytest.raises(ConfigError, match=message):
        parse_speculative_config(value)


def test_cli_flag_reaches_the_engine_config():
    import argparse

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args(["kvshard-demo-gqa", "--speculative-config", '{"method": "ngram", '
                              '"num_speculative_tokens": 2}'])
    config = EngineArgs.from_cli_args(args).create_engine_config()
    assert config.speculative.num_speculative_tokens == 2
    assert "speculative decoding: ngram" in config.layout_report()
    # a child process (bench, serve) gets the same setting back as a flag
    argv = EngineArgs(speculative_config=NGRAM).to_cli_args()
    assert parse_speculative_config(argv[argv.index("--speculative-config") + 1]) == parse_speculative_config(NGRAM)


# --- n-gram proposals -------------------------------------------------------------------------

def test_ngram_proposes_what_followed_the_longest_matching_suffix():
    proposer = NgramProposer(1, 3)
    # suffix [1, 2] occurred before, followed by 3, 9, 1
    assert proposer.propose([1, 2, 3, 9, 1, 2], 3) == [3, 9, 1]
    # the longest suffix wins: [2, 3] -> 4 (after [1, 2, 3] at the start), not the later [3] -> 7
    assert proposer.propose([1, 2, 3, 4, 3, 7, 2, 3], 2) == [4, 3]
    # no earlier occurrence: nothing; the draft count is capped
    assert proposer.propose([1, 2, 3, 4], 3) == []
    assert proposer.propose([5, 5, 5, 5, 5, 5], 0) == []
    # a repeating run: the occurrence followed by the most tokens, not the latest overlapping one
    assert proposer.propose([5, 5, 5, 5, 5], 3) == [5, 5]


# --- rejection sampling: the tokens follow the target distribution ------------------------------

def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of Pearson's test that `counts` [V] were drawn from `probs` [V] (categories of zero
    probability must be empty, else 0)."""
    total = counts.sum()
    if bool((counts[probs == 0] > 0).any()):
        return 0.0
    support = probs > 0
    expected = probs[support] * total
    statistic = float(((counts[support] - expected) ** 2 / expected).sum())
    dof = int(support.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(statistic / 2, dtype=torch.float64)))


TARGET = torch.tensor([[0.05, 0.40, 0.15, 0.30, 0.10, 0.00],  # after 0 drafts
                       [0.25, 0.05, 0.20, 0.10, 0.30, 0.10],  # after draft 1
                       [0.10, 0.10, 0.10, 0.50, 0.10, 0.10]])  # after drafts 1, 2 (bonus token)
DRAFTS = [1, 4]
SAMPLES = 4_000


def token_distributions(sampler) -> tuple[torch.Tensor, torch.Tensor]:
    """Counts of the first emitted token, and of the second one where the first draft was kept (the
    target rows stand for p(. | any first token))."""
    first, second = torch.zeros(6), torch.zeros(6)
    for _ in range(SAMPLES):
        tokens = sampler()
        first[tokens[0]] += 1
        if len(tokens) > 1:
            second[tokens[1]] += 1
    return first, second


@pytest.mark.parametrize("proposal", ["one-hot", "draft distribution"])
def test_rejection_sampling_follows_the_target_distribution(proposal):
    generator = torch.Generator().manual_seed(1234)
    if proposal == "one-hot":  # n-gram: the same drafts every time
        def sampler() -> list[int]:
            return rejection_sample(TARGET, DRAFTS, None, generator)
    else:  # a draft model: drafts drawn from its own q, which the verification is given
        draft_probs = torch.tensor([[0.1, 0.5, 0.1, 0.1, 0.1, 0.1], [0.1, 0.1, 0.1, 0.1, 0.5, 0.1]])

        def sampler() -> list[int]:
            drafts = torch.multinomial(draft_probs, 1, generator=generator).squeeze(1).tolist()
            return rejection_sample(TARGET, drafts, draft_probs, generator)
    first, second = token_distributions(sampler)
    assert chi_square_p_value(first, TARGET[0]) > 1e-3
    assert chi_square_p_value(second, TARGET[1]) > 1e-3  # the token after an accepted draft: row 1


def test_the_check_catches_a_sampler_without_the_rejection_step():
    """Keeping every draft (no rejection) puts all the first token's mass on the draft."""
    generator = torch.Generator().manual_seed(1234)
    first, _ = token_distributions(lambda: DRAFTS + [int(torch.multinomial(TARGET[2], 1, generator=generator))])
    assert chi_square_p_value(first, TARGET[0]) < 1e-6
    # nor does rejecting without the residual (redrawing from p, which can give the draft back) pass
    def redraw_from_p() -> list[int]:
        if float(torch.rand(1, generator=generator)) < float(TARGET[0, DRAFTS[0]]):
            return [DRAFTS[0]]
        return [int(torch.multinomial(TARGET[0], 1, generator=generator))]
    first, _ = token_distributions(redraw_from_p)
    assert chi_square_p_value(first, TARGET[0]) < 1e-6


def test_verify_drafts_samples_the_filtered_distribution_and_greedy_is_exact():
    logits = torch.log(TARGET + 1e-3) * 2.0  # [3, 6]
    params = SamplingParams(temperature=0.7, top_k=4, top_p=0.95)
    wanted = _filtered_probs(logits, [params] * 3)  # what plain sampling would draw from
    seq = Sequence("r", 0, [0], params, None)
    # SAMPLES requests with the same rows in one call, as one step would verify them
    outcomes = verify_drafts(logits.repeat(SAMPLES, 1), [seq] * SAMPLES, [DRAFTS] * SAMPLES,
                             torch.Generator().manual_seed(5))
    samples = iter(outcomes)
    first, second = token_distributions(lambda: next(samples))
    assert chi_square_p_value(first, wanted[0]) > 1e-3
    assert chi_square_p_value(second, wanted[1]) > 1e-3
    # a request's own seed gives the same tokens whatever else is verified with it
    seeded = [Sequence("r", 0, [0], params, torch.Generator().manual_seed(3)) for _ in range(2)]
    alone = verify_drafts(logits, seeded[:1], [DRAFTS], torch.Generator())
    with_others = verify_drafts(logits.repeat(2, 1), [seq, seeded[1]], [DRAFTS, DRAFTS], torch.Generator())
    assert alone[0] == with_others[1]
    greedy = Sequence("r", 0, [0], SamplingParams(temperature=0), None)
    best = logits.argmax(dim=-1).tolist()  # [1, 4, 3]
    three = [logits, logits, logits[:2]]  # both drafts kept, then the bonus; the second replaced; one draft
    assert verify_drafts(torch.cat(three), [greedy] * 3, [[1, 4], [1, 0], [2]], torch.Generator()) == \
        [[1, 4, 3], [1, best[1]], [best[0]]]


# --- block accounting of a rollback ---------------------------------------------------------------

def test_rejected_drafts_give_their_blocks_back_and_are_never_named():
    layout = DCPLayout(BLOCK, 2, 1)  # 8 tokens per virtual block
    pool = BlockPool(8)
    scheduler = Scheduler(SchedulerConfig(4, 64, 256), pool, layout)
    seq = Sequence("r", 0, list(range(7)), SamplingParams(max_tokens=20), None)
    scheduler.add(seq)
    scheduler.mark_computed(scheduler.schedule())  # prefill of 7 tokens: 1 block
    seq.output_token_ids.append(100)  # 8 tokens, the last not computed
    seq.num_spec_tokens = 10  # 10 drafts reach positions 8..17: 3 blocks
    batch = scheduler.schedule()
    assert batch.query_lens == [11] and batch.num_drafts == [10]
    assert len(seq.block_table) == 3 and pool.num_used == 3
    scheduler.mark_computed(batch)
    assert seq.num_computed_tokens == 8  # the drafts count only once accepted
    seq.output_token_ids += [200, 201]  # one draft accepted, then the token after it
    scheduler.accept_drafts(seq, 1)
    assert seq.num_computed_tokens == 9 and seq.num_tokens == 10
    assert len(seq.block_table) == 2 and pool.num_used == 2
    assert pool.num_cached == 1  # the first block is full and computed; the second is not named
    scheduler.finish(seq, "abort")
    assert pool.num_used == 0


def decoding_with_drafts(num_blocks: int, budget: int) -> tuple[Scheduler, Sequence]:
    """A request of 8 tokens, 7 of them computed (2 blocks of 4), carrying 10 drafts."""
    scheduler = Scheduler(SchedulerConfig(4, budget, 256), BlockPool(num_blocks), DCPLayout(BLOCK, 1, 1))
    seq = Sequence("r", 0, list(range(7)), SamplingParams(max_tokens=20), None)
    scheduler.add(seq)
    scheduler.mark_computed(scheduler.schedule())
    seq.output_token_ids.append(7)
    seq.num_spec_tokens = 10
    return scheduler, seq


@pytest.mark.parametrize("num_blocks, budget, num_drafts", [
    (3, 64, 4),  # 12 slots in 3 blocks: the 8 known tokens and 4 drafts
    (8, 8, 7),  # the request's own token and 7 drafts make the budget
])
def test_drafts_take_only_the_spare_budget_and_blocks(num_blocks, budget, num_drafts):
    scheduler, seq = decoding_with_drafts(num_blocks, budget)
    batch = scheduler.schedule()
    assert batch.num_drafts == [num_drafts] and batch.query_lens == [1 + num_drafts]
    assert len(seq.block_table) == scheduler.layout.num_virtual_blocks(8 + num_drafts)


def test_a_draft_never_preempts_another_request():
    scheduler, seq = decoding_with_drafts(4, 64)  # holds 2 blocks of 4
    other = Sequence("o", 0, list(range(4)), SamplingParams(max_tokens=20), None)
    other.status, other.block_table, other.num_computed_tokens = seq.status, scheduler.pool.allocate(1), 4
    other.output_token_ids = [4]  # its 5th token needs the last free block
    scheduler.running.append(other)
    batch = scheduler.schedule()
    assert scheduler.num_preemptions == 0
    assert batch.num_drafts == [0, 0] and sorted(batch.query_lens) == [1, 1]
    assert len(other.block_table) == 2


# --- end to end: greedy tokens of plain decoding, in every layout -----------------------------------

PROMPTS = [
    [1, 2, 3, 4, 5, 6, 7, 1, 2, 3, 4, 5, 6, 7, 1, 2, 3],  # repeats: long drafts accepted
    [9, 8, 9, 8, 9, 8, 9],
    [(7 * i) % 13 + 1 for i in range(30)],  # period 13, crosses several virtual blocks
    [3, 1, 4, 1, 5],
]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
MAX_MODEL_LEN = 64
# (tp, dcp, interleave); KV blocks per rank for about 96 tokens of the ~200 the batch needs at its peak,
# so requests are preempted while they speculate
LAYOUTS = [(1, 1, 1), (2, 2, 1), (2, 2, BLOCK), (4, 4, 1)]


def tiny_mla_config(**overrides):
    """DeepSeek-V3 attention (MLA, one latent per token) in a dense three-layer model, declaring one MTP
    layer (an MoE layer, as V3's: its index 3 is past first_k_dense_replace)."""
    from transformers import DeepseekV3Config

    settings = dict(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=8,
        num_key_value_heads=8, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
        max_position_embeddings=256, bos_token_id=0, eos_token_id=1, initializer_range=0.3, q_lora_rank=None,
        first_k_dense_replace=3, rope_interleave=False, tie_word_embeddings=False, num_nextn_predict_layers=1,
        n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, moe_intermediate_size=32,
        n_shared_experts=1, norm_topk_prob=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, architectures=["DeepseekV3ForCausalLM"])
    return DeepseekV3Config(**{**settings, **overrides})


MODELS = {"gqa": tiny_llama_config, "mla": tiny_mla_config}
MTP_FILE = "mtp.safetensors"


def random_mtp_module(config, seed: int = 1):
    """The MTP tensors as transformers' DeepSeek-V3 modules hold them (the decoder layer is transformers'
    own, random, norms and routing bias off neutral): (decoder layer, {name: tensor} of the rest)."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer

    torch.manual_seed(seed)
    config._attn_implementation = "eager"
    layer = DeepseekV3DecoderLayer(config, config.num_hidden_layers).float()
    with torch.no_grad():
        for name, tensor in layer.state_dict().items():
            if name.endswith("norm.weight"):
                tensor.uniform_(0.5, 1.5)
            elif name.endswith("e_score_correction_bias"):
                tensor.uniform_(-0.3, 0.3)
            else:
                tensor.normal_(0, config.initializer_range)
    d = config.hidden_size
    rest = {"enorm.weight": torch.rand(d) + 0.5, "hnorm.weight": torch.rand(d) + 0.5,
            "eh_proj.weight": torch.randn(d, 2 * d) * config.initializer_range,
            "shared_head.norm.weight": torch.rand(d) + 0.5}
    return layer.eval(), rest


def add_mtp_layer(directory: Path, config) -> None:
    """Store the MTP module beside the target's weights as published V3 checkpoints do: under
    model.layers.{num_hidden_layers}., routed experts one tensor per expert and projection, the
    embedding and LM head copied from the target's."""
    from safetensors.torch import load_file, save_file

    main = load_file(directory / "model.safetensors")
    layer, rest = random_mtp_module(config)
    tensors = {**rest, "embed_tokens.weight": main["model.embed_tokens.weight"],
               "shared_head.head.weight": main["lm_head.weight"]}
    for name, tensor in layer.state_dict().items():
        if name == "mlp.experts.gate_up_proj":  # [E, 2I, D]: gate rows, then up rows
            gates, ups = tensor.chunk(2, dim=1)
            for e, (gate, up) in enumerate(zip(gates, ups)):
                tensors[f"mlp.experts.{e}.gate_proj.weight"], tensors[f"mlp.experts.{e}.up_proj.weight"] = gate, up
        elif name == "mlp.experts.down_proj":  # [E, D, I]
            tensors.update({f"mlp.experts.{e}.down_proj.weight": w for e, w in enumerate(tensor)})
        else:
            tensors[name] = tensor
    prefix = f"model.layers.{config.num_hidden_layers}."
    save_file({prefix + name: t.contiguous() for name, t in tensors.items()}, directory / MTP_FILE)


@pytest.fixture(scope="module")
def models(checkpoints) -> dict[str, str]:
    paths = {name: checkpoints(f"spec-{name}", config()) for name, config in MODELS.items()}
    if not (paths["mla"] / MTP_FILE).exists():
        add_mtp_layer(paths["mla"], tiny_mla_config())
    return {name: str(path) for name, path in paths.items()}


@pytest.fixture(scope="module")
def reference(models):
    """Plain decoding, tp=1, ample KV: tokens by model, and their log-probabilities by model."""
    outputs, logprobs = {}, {}
    for name, path in models.items():
        with LLM(path, block_size=BLOCK, num_kv_blocks=128, max_model_len=MAX_MODEL_LEN) as llm:
            generated = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
            outputs[name] = [o.outputs[0].token_ids for o in generated]
            logprobs[name] = [o.outputs[0].logprobs for o in generated]
    outputs["logprobs"] = logprobs
    return outputs


class ScriptedDrafts:
    """A drafter for the verification tests: it proposes the reference continuation with every fifth
    position (of the sequence) changed, so that whole runs are accepted, runs end at every draft
    position and the rejected slots are rolled back, whatever the model. Tokens it has no reference
    for get no drafts."""

    def __init__(self, prompts: list[list[int]], outputs: list[list[int]]) -> None:
        self.sequences = [p + o for p, o in zip(prompts, outputs)]

    def propose(self, token_ids: list[int], max_drafts: int) -> list[int]:
        n = len(token_ids)
        for full in self.sequences:
            if full[:n] == token_ids:
                return [t if (n + j) % 5 != 4 else (t + 1) % 128 for j, t in enumerate(full[n : n + max_drafts])]
        return []


def record_accepted_spans(llm: LLM) -> list[tuple[int, int]]:
    """Positions [first, last] of every verified span whose drafts were partly accepted: the request's
    last known token and the accepted drafts after it, recorded as the engine rolls back."""
    spans: list[tuple[int, int]] = []
    scheduler = llm.engine.scheduler
    accept = scheduler.accept_drafts

    def recording(seq: Sequence, num_accepted: int) -> None:
        if num_accepted:
            spans.append((seq.num_computed_tokens - 1, seq.num_computed_tokens + num_accepted - 1))
        accept(seq, num_accepted)

    scheduler.accept_drafts = recording
    return spans


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("tp, dcp, interleave", LAYOUTS + [(2, 2, 16)])  # and an interleave past the block size
def test_greedy_speculation_gives_the_tokens_of_plain_decoding(models, reference, model, tp, dcp, interleave):
    """The n-gram drafter first (random weights accept few of its drafts), then scripted drafts."""
    block = max(BLOCK, interleave)  # the interleave divides the block size
    with environment({"KVSHARD_FUSED_MERGE_MAX_BYTES": "0", "KVSHARD_DECODE_GROUP_SPREAD": "0"}), \
            LLM(models[model], tensor_parallel_size=tp, decode_context_parallel_size=dcp,
                dcp_kv_interleave_size=interleave, block_size=block, num_kv_blocks=96 // (block * dcp),
                max_model_len=MAX_MODEL_LEN, speculative_config=NGRAM) as llm:
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == reference[model]
        assert llm.engine.stats().spec_decode_num_draft_tokens > 0
        llm.engine.proposer.propose = ScriptedDrafts(PROMPTS, reference[model]).propose
        spans = record_accepted_spans(llm)
        generated = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        got = [o.outputs[0].token_ids for o in generated]
        stats = llm.engine.stats()
        # each token's log-probabilities come from the row that verified it
        assert_same_generation(got, [o.outputs[0].logprobs for o in generated], reference[model],
                               reference["logprobs"][model], atol=1e-4)
        if block == BLOCK:  # with 16-token blocks the 96 tokens admit too few requests to preempt any
            assert stats.num_preemptions > 0, "the KV budget is meant to preempt speculating requests"
        assert stats.spec_decode_num_accepted_tokens_per_pos[2] > 0, "whole runs of drafts are meant to be accepted"
        # accepted drafts crossed a physical block (with dcp > 1: a shard, for either interleave) and a
        # virtual block boundary
        assert any(first // block != last // block for first, last in spans)
        assert any(first // (block * dcp) != last // (block * dcp) for first, last in spans)
        assert stats.kv_blocks_used == 0  # no block leaked by rollbacks or preemptions
        # sampling with n-gram drafts: a seed gives the same tokens alone and next to another request
        llm.engine.proposer = NgramProposer(1, 3)
        sampled = SamplingParams(temperature=0.8, seed=11, max_tokens=16, ignore_eos=True)
        runs = llm.generate([PROMPTS[0], PROMPTS[0], PROMPTS[1]], [sampled, sampled, GREEDY], use_tqdm=False)
        alone = llm.generate([PROMPTS[0]], sampled, use_tqdm=False)
        assert runs[0].outputs[0].token_ids == runs[1].outputs[0].token_ids == alone[0].outputs[0].token_ids
        assert llm.engine.stats().kv_blocks_used == 0


def record_draft_proposals(llm: LLM) -> list[tuple[list[int], list[int]]]:
    """(the request's tokens, the drafts the draft model proposed after them), for every proposal."""
    proposals: list[tuple[list[int], list[int]]] = []
    proposer = llm.engine.proposer
    propose = proposer.propose

    def recording(seqs: list[Sequence], counts: list[int]):
        contexts = [seq.all_token_ids for seq in seqs]
        drafts, probs = propose(seqs, counts)
        proposals.extend(zip(contexts, drafts))
        return drafts, probs

    proposer.propose = recording
    return proposals


class RecordedMtp:
    """Wraps the engine's MTP proposer: records (the request's tokens, the MTP module's drafts after
    them) of every proposal; with `script` set, the scripted drafts are verified in their place (the
    module's random weights accept few of its own), so that its cache also meets accepted runs."""

    def __init__(self, llm: LLM) -> None:
        self.proposals: list[tuple[list[int], list[int]]] = []
        self.script: ScriptedDrafts | None = None
        self.propose = llm.engine.proposer.propose
        llm.engine.proposer.propose = self

    def __call__(self, batch):
        contexts = [list(seq.all_token_ids) for seq in batch.seqs]
        probs = self.propose(batch)
        for i, (tokens, drafts) in enumerate(zip(contexts, batch.drafts)):
            if drafts:
                self.proposals.append((tokens, list(drafts)))
                if self.script is not None:
                    scripted = self.script.propose(tokens, len(drafts))
                    batch.drafts[i] = scripted + drafts[len(scripted):]
        return probs


class MtpReference:
    """The MTP module's greedy drafts computed from scratch, the published way: transformers' target
    for its last decoder layer's output (before the final norm, by a hook), transformers' decoder layer
    for the module's, plain torch for the rest; each further draft from the module's own output."""

    def __init__(self, path: str, sequences: list[list[int]]) -> None:
        from transformers import AutoModelForCausalLM
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding

        self.target = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.config = tiny_mla_config()
        self.layer, self.weights = random_mtp_module(self.config)  # the tensors add_mtp_layer stored
        self.rotary = DeepseekV3RotaryEmbedding(self.config)
        self.sequences = sequences  # every request's tokens are a prefix of one of these, or their own
        self.rows: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] = {}

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.config.rms_norm_eps) * self.weights[name]

    def _input(self, token: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        """tokens [n], states [n, D] -> the decoder layer's input [n, D]: enorm(embedding) first."""
        embedding = self.target.model.embed_tokens(token)
        x = torch.cat([self._norm(embedding, "enorm.weight"), self._norm(state, "hnorm.weight")], dim=-1)
        return x @ self.weights["eh_proj.weight"].T

    def _layer(self, x: torch.Tensor) -> torch.Tensor:
        """transformers' decoder layer over rows [n, D] at positions 0..n-1, causally."""
        n = x.shape[0]
        positions = torch.arange(n)[None]
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        return self.layer(x[None], attention_mask=mask, position_ids=positions,
                          position_embeddings=self.rotary(x[None], positions))[0]  # [n, D]

    def _rows(self, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The module's input rows [m, D] for a request's m + 1 tokens and the layer's output [m, D],
        computed once for the longest sequence the tokens begin: causal rows of a prefix are its first."""
        full = next((s for s in self.sequences if s[: len(tokens)] == tokens), tokens)
        if tuple(full) not in self.rows:
            kept = []
            hook = self.target.model.layers[-1].register_forward_hook(lambda module, args, out: kept.append(out))
            self.target(torch.tensor([full]))
            hook.remove()
            # the state at each position 0..len-2, paired with the token after it
            x = self._input(torch.tensor(full[1:]), kept[0][0, :-1])  # [len - 1, D]
            self.rows[tuple(full)] = x, self._layer(x)
        x, out = self.rows[tuple(full)]
        return x[: len(tokens) - 1], out[: len(tokens) - 1]

    @torch.no_grad()
    def drafts(self, tokens: list[int], k: int) -> list[int]:
        x, out = self._rows(tokens)
        drafts: list[int] = []
        while True:
            logits = self._norm(out[-1], "shared_head.norm.weight") @ self.target.lm_head.weight.T  # [V]
            drafts.append(int(logits.argmax()))
            if len(drafts) == k:
                return drafts
            x = torch.cat([x, self._input(torch.tensor(drafts[-1:]), out[-1:])])  # the draft after its own state
            out = self._layer(x)


@pytest.fixture(scope="module")
def mtp_reference(models, reference) -> MtpReference:
    return MtpReference(models["mla"], [p + o for p, o in zip(PROMPTS, reference["mla"])])


MTP = {"method": "mtp", "num_speculative_tokens": 3}


@pytest.mark.parametrize("model, drafter", [("gqa", "draft model"), ("mla", "draft model"), ("mla", "mtp")])
@pytest.mark.parametrize("tp, dcp, interleave", LAYOUTS)
def test_greedy_model_drafts_give_the_tokens_of_plain_decoding(models, reference, mtp_reference, model, drafter,
                                                               tp, dcp, interleave):
    """A draft model (the target as its own: its drafts are mostly accepted) or the checkpoint's MTP
    module, whose cache is caught up and rolled back (after prefill, preemption, rejection) along the
    target's; a wrong draft cache would lower the acceptance or change the drafts, never the tokens, so
    the acceptance (draft model) or every proposed draft (MTP, against a reference) is checked too."""
    speculative = {"model": models[model], "num_speculative_tokens": 3} if drafter == "draft model" else MTP
    with environment({"KVSHARD_FUSED_MERGE_MAX_BYTES": "0", "KVSHARD_DECODE_GROUP_SPREAD": "0"}), \
            LLM(models[model], tensor_parallel_size=tp, decode_context_parallel_size=dcp,
                dcp_kv_interleave_size=interleave, block_size=BLOCK, num_kv_blocks=96 // (BLOCK * dcp),
                max_model_len=MAX_MODEL_LEN, speculative_config=speculative) as llm:
        spans = record_accepted_spans(llm)
        recorded = RecordedMtp(llm) if drafter == "mtp" else None
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        assert got == reference[model]
        if recorded is not None:  # again with scripted drafts verified, for accepted runs
            assert llm.engine.stats().spec_decode_num_draft_tokens > 0
            recorded.script = ScriptedDrafts(PROMPTS, reference[model])
            got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
            assert got == reference[model]
        stats = llm.engine.stats()
        assert stats.num_preemptions > 0
        if recorded is None:
            assert stats.spec_decode_num_accepted_tokens >= 0.9 * stats.spec_decode_num_draft_tokens
        else:
            assert stats.spec_decode_num_accepted_tokens_per_pos[2] > 0
        assert any(first // (BLOCK * dcp) != last // (BLOCK * dcp) for first, last in spans)
        assert stats.kv_blocks_used == 0
        if recorded is not None:  # sampled MTP drafts (rejection sampling with their distributions)
            proposals, recorded.script = list(recorded.proposals), None
            sampled = SamplingParams(temperature=0.8, seed=11, max_tokens=16, ignore_eos=True)
            runs = llm.generate([PROMPTS[0], PROMPTS[0]], sampled, use_tqdm=False)
            assert runs[0].outputs[0].token_ids == runs[1].outputs[0].token_ids
            assert llm.engine.stats().kv_blocks_used == 0
    if recorded is not None:
        assert len(proposals) > 50
        assert [drafts for _, drafts in proposals] == \
            [mtp_reference.drafts(tokens, len(drafts)) for tokens, drafts in proposals]


def test_a_different_draft_model_is_rejected_often_and_changes_nothing(models, reference, checkpoints):
    draft = checkpoints("spec-draft", tiny_llama_config(num_hidden_layers=1))  # other weights, one layer
    with LLM(models["mla"], tensor_parallel_size=2, decode_context_parallel_size=2, block_size=BLOCK,
             num_kv_blocks=12, max_model_len=MAX_MODEL_LEN,
             speculative_config={"model": str(draft), "num_speculative_tokens": 3}) as llm:
        assert "draft model" in llm.config.layout_report()
        recorded = record_draft_proposals(llm)
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        proposals = list(recorded)  # the greedy ones
        stats = llm.engine.stats()
        assert got == reference["mla"]
        assert stats.num_preemptions > 0
        assert stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens / 2
        sampled = SamplingParams(temperature=0.8, seed=11, max_tokens=16, ignore_eos=True)
        runs = llm.generate([PROMPTS[0], PROMPTS[0]], sampled, use_tqdm=False)
        assert runs[0].outputs[0].token_ids == runs[1].outputs[0].token_ids
        assert llm.engine.stats().kv_blocks_used == 0
    # the draft model's cache, caught up and rolled back across rejections and preemptions, gave the
    # drafts the draft model computes from scratch: its greedy continuation of each request's tokens
    with LLM(str(draft), block_size=BLOCK, num_kv_blocks=256, max_model_len=MAX_MODEL_LEN) as plain:
        contexts = [tokens for tokens, _ in proposals]
        params = [SamplingParams(temperature=0, max_tokens=len(d), ignore_eos=True) for _, d in proposals]
        assert [o.outputs[0].token_ids for o in plain.generate(contexts, params, use_tqdm=False)] == \
            [d for _, d in proposals]


def test_draft_model_config_errors(models):
    draft = {"model": "kvshard-demo-gqa", "num_speculative_tokens": 2}  # 512 tokens, the target 128
    with pytest.raises(ConfigError, match="share the target's tokenizer"):
        EngineArgs(models["gqa"], speculative_config=draft).create_engine_config()
    with pytest.raises(ConfigError, match='give "model"'):
        parse_speculative_config({"method": "draft_model", "num_speculative_tokens": 2})
    config = EngineArgs("kvshard-demo", speculative_config=draft).create_engine_config()
    assert config.speculative.method == "draft_model"  # inferred from "model", as vLLM does
    plain = EngineArgs("kvshard-demo").create_engine_config()
    assert config.kv_bytes_per_slot > plain.kv_bytes_per_slot  # the draft's cache shares the budget


def test_mtp_config_errors_and_cache_cost(models, tmp_path):
    with pytest.raises(ConfigError, match="needs a DeepSeek-V3"):
        EngineArgs(models["gqa"], speculative_config=MTP).create_engine_config()
    # the MLA checkpoint without its MTP file: the config still declares one layer, then none
    shutil.copytree(models["mla"], tmp_path, dirs_exist_ok=True, ignore=shutil.ignore_patterns(MTP_FILE))
    with pytest.raises(ConfigError, match=r"lacks the MTP weights under model\.layers\.3\."):
        EngineArgs(str(tmp_path), speculative_config=MTP).create_engine_config()
    hf_config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**hf_config, "num_nextn_predict_layers": 0}))
    with pytest.raises(ConfigError, match="has no MTP layers"):
        EngineArgs(str(tmp_path), speculative_config=MTP).create_engine_config()
    config = EngineArgs(models["mla"], speculative_config=MTP).create_engine_config()
    plain = EngineArgs(models["mla"]).create_engine_config()
    assert "speculative decoding: mtp" in config.layout_report()
    assert config.kv_bytes_per_slot * 3 == plain.kv_bytes_per_slot * 4  # one MLA layer on top of three
    assert plain.cache.enable_prefix_caching and not config.cache.enable_prefix_caching


def test_metrics_name_the_spec_decode_counters():
    from kvshard.engine.stats import EngineStats
    from kvshard.metrics import ServerMetrics

    config = EngineArgs("kvshard-demo-gqa", speculative_config=NGRAM).create_engine_config()
    metrics = ServerMetrics(config, "m")
    stats = EngineStats(spec_decode_num_drafts=4, spec_decode_num_draft_tokens=12,
                        spec_decode_num_accepted_tokens=6, spec_decode_num_accepted_tokens_per_pos=[3, 2, 1])
    assert stats.mean_acceptance_length == 2.5
    metrics.record_stats(stats)
    text = metrics.render().decode()
    assert 'kvshard:spec_decode_num_drafts_total{model_name="m"} 4.0' in text
    assert 'kvshard:spec_decode_num_draft_tokens_total{model_name="m"} 12.0' in text
    assert 'kvshard:spec_decode_num_accepted_tokens_total{model_name="m"} 6.0' in text
    assert 'kvshard:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="2"} 1.0' in text
    plain = ServerMetrics(EngineArgs("kvshard-demo-gqa").create_engine_config(), "m").render().decode()
    assert "spec_decode" not in plain


def test_abort_while_speculating_frees_every_block(models, reference):
    with LLM(models["gqa"], block_size=BLOCK, num_kv_blocks=64, max_model_len=MAX_MODEL_LEN,
             speculative_config=NGRAM) as llm:
        engine = llm.engine
        engine.proposer.propose = ScriptedDrafts(PROMPTS, reference["gqa"]).propose
        engine.add_request("kept", PROMPTS[0], GREEDY)
        engine.add_request("aborted", PROMPTS[2], GREEDY)
        while engine.stats().spec_decode_num_drafts < 4:
            engine.step()
        engine.abort_request("aborted")  # between two of its speculating steps
        outputs = []
        while engine.has_unfinished_requests():
            outputs += [o for o in engine.step() if o.finished]
        assert [o.request_id for o in outputs] == ["kept"]
        assert outputs[0].outputs[0].token_ids == reference["gqa"][0]
        assert engine.stats().kv_blocks_used == 0
