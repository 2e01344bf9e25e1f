"""Speculative decoding behind one interface: every method implements `Proposer` (and, with a model,
`DraftModule`); the engine step knows no method; each request's rows in a step are laid out once
(`StepRows`) and the MTP module's rows are derived from that layout."""

from __future__ import annotations

import ast
import inspect
import textwrap

import pytest
import torch

from kvshard import LLM, SamplingParams
from kvshard.engine.llm_engine import LLMEngine
from kvshard.engine.scheduler import ScheduledBatch
from kvshard.engine.sequence import Sequence
from kvshard.engine.step_plan import StepPlan, StepRows
from kvshard.spec_decode.draft_model import DraftModelModule, DraftModelProposer
from kvshard.spec_decode.mtp import MtpProposer, MtpModule, MtpTargetRows
from kvshard.spec_decode.ngram import NgramProposer
from kvshard.spec_decode.proposer import DraftModule, NoProposer, Proposer
from conftest import assert_same_generation, tiny_llama_config

PROPOSERS = [NoProposer, NgramProposer, DraftModelProposer, MtpProposer]
MODULES = [DraftModelModule, MtpModule]


def protocol_methods(protocol) -> dict[str, inspect.Signature]:
    return {name: inspect.signature(member) for name, member in vars(protocol).items()
            if callable(member) and not name.startswith("_")}


@pytest.mark.parametrize("cls, protocol", [(c, Proposer) for c in PROPOSERS] + [(c, DraftModule) for c in MODULES])
def test_every_method_implements_the_interface_with_its_signatures(cls, protocol):
    wanted = protocol_methods(protocol)
    assert wanted, "the protocol declares methods"
    for name, signature in wanted.items():
        assert callable(getattr(cls, name, None)), f"{cls.__name__} lacks {name}"
        assert list(inspect.signature(getattr(cls, name)).parameters) == list(signature.parameters), \
            f"{cls.__name__}.{name} takes other parameters than {protocol.__name__}.{name}"
    assert isinstance(NgramProposer(1, 3), Proposer) and isinstance(NoProposer(), Proposer)


def _engine_methods_reached_from_step() -> dict[str, ast.FunctionDef]:
    """LLMEngine.step and every LLMEngine method it calls through self, transitively."""
    reached: dict[str, ast.FunctionDef] = {}
    todo = ["step"]
    while todo:
        name = todo.pop()
        if name in reached or not inspect.isfunction(getattr(LLMEngine, name, None)):
            continue
        tree = ast.parse(textwrap.dedent(inspect.getsource(getattr(LLMEngine, name))))
        reached[name] = tree.body[0]
        todo += [node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)
                 and isinstance(node.value, ast.Name) and node.value.id == "self"]
    return reached


def test_the_engine_step_has_no_method_specific_branch():
    """No name of a method, no `speculative.method`, no isinstance and no -1 placeholder in the step or
    anything of the engine it calls: a new proposer needs no edit of the engine."""
    methods = _engine_methods_reached_from_step()
    assert {"step", "_ask_for_drafts", "_process_samples"} <= set(methods)
    for name, function in methods.items():
        for node in ast.walk(function):
            words = []
            if isinstance(node, ast.Name):
                words.append(node.id)
            elif isinstance(node, ast.Attribute):
                words.append(node.attr)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                words.append(node.value)
            for word in words:
                assert not any(m in word.lower() for m in ("ngram", "draft_model", "mtp")), f"{name}: {word!r}"
                assert word != "method", f"{name}: {word!r}"
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "isinstance":
                assert ast.unparse(node.args[1]) == "Exception", f"{name}: {ast.unparse(node)}"
            assert not (isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub)
                        and isinstance(node.operand, ast.Constant) and node.operand.value == 1), f"{name}: -1"
    source = inspect.getsource(inspect.getmodule(LLMEngine))
    for module in ("spec_decode.ngram", "spec_decode.draft_model", "spec_decode.mtp"):
        assert module not in source, f"the engine imports {module}"


def _seq(prompt: list[int], output: list[int], computed: int, prompt_logprobs: int | None = None) -> Sequence:
    seq = Sequence("r", 0, prompt, SamplingParams(max_tokens=20, prompt_logprobs=prompt_logprobs), None)
    seq.output_token_ids = list(output)
    seq.num_computed_tokens = computed
    return seq


def test_each_requests_rows_are_laid_out_once_and_the_mtp_rows_follow():
    # a decode verifying 2 drafts; a prompt chunk (not its last) with prompt logprobs; a last chunk
    decoding = _seq([1, 2, 3], [4], 3)
    chunk = _seq([5, 6, 7, 8, 9, 10], [], 1, prompt_logprobs=1)
    last = _seq([11, 12, 13], [], 1)
    batch = ScheduledBatch([decoding, chunk, last], query_lens=[3, 3, 2], context_lens=[3, 1, 1],
                           sample=[True, False, True], num_drafts=[2, 0, 0])
    batch.drafts[0] = [40, 41]
    rows = StepRows.from_batch(batch)
    assert rows.token_ids == [4, 40, 41, 6, 7, 8, 12, 13]
    assert [r.start for r in rows.requests] == [0, 3, 6]
    assert [r.num_sampled for r in rows.requests] == [3, 0, 1]
    assert [r.prompt_logprobs for r in rows.requests] == [range(0), range(1, 4), range(0)]
    # the logits rank 0 gets: the decode's 3 rows, the chunk's 3 prompt rows, the last chunk's last row
    assert rows.logit_rows == [0, 1, 2, 3, 4, 5, 7]
    assert [(r.logits_start, r.sampled_start) for r in rows.requests] == [(0, 0), (3, 6), (6, 6)]
    plan = StepPlan.from_batch(batch, rows)
    assert plan.sample_rows == rows.logit_rows and plan.token_ids == rows.token_ids and plan.spec is None
    mtp = MtpProposer(executor=None, default_generator=torch.Generator())
    spec = mtp.target_step(batch, rows)
    # the token after each row where the step knows it: not after a sampled last row
    assert spec == MtpTargetRows(num_known=[2, 3, 1], next_token_ids=[40, 41, 7, 8, 9, 13], keep_rows=[0, 1, 2, 7])
    # the decode's kept rows start at its last known token (position 3), the last chunk's at position 2
    assert (mtp.kept[decoding.seq_id].row, mtp.kept[decoding.seq_id].position) == (0, 3)
    assert (mtp.kept[last.seq_id].row, mtp.kept[last.seq_id].position) == (3, 2)


class ContinuationDrafts:
    """A proposer the engine does not know: it drafts the known continuation of each prompt, so every
    draft is accepted; it records the limits the engine gave it."""

    def __init__(self, continuations: dict[tuple[int, ...], list[int]]) -> None:
        self.continuations = continuations
        self.limits: list[tuple[int, int]] = []  # (tokens the request may still take, the limit)

    def _next(self, seq: Sequence, count: int) -> list[int]:
        for prompt, output in self.continuations.items():
            if tuple(seq.prompt_token_ids) == prompt:
                done = len(seq.output_token_ids)
                return output[done : done + count]
        return []

    def wanted_drafts(self, seq: Sequence, limit: int) -> int:
        self.limits.append((seq.params.max_tokens - len(seq.output_token_ids), limit))
        return len(self._next(seq, limit))

    def draft(self, batch: ScheduledBatch) -> dict[int, torch.Tensor | None]:
        for i, (seq, count) in enumerate(zip(batch.seqs, batch.num_drafts)):
            batch.drafts[i] = self._next(seq, count)
        return {}

    def target_step(self, batch, rows) -> None:
        return None


def test_the_engine_runs_a_proposer_it_does_not_know(checkpoints):
    path = checkpoints("proposer-llama", tiny_llama_config())
    prompts = [[1, 2, 3, 4, 5], [7, 3, 9]]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    with LLM(str(path), block_size=4, num_kv_blocks=64, max_model_len=64,
             speculative_config={"method": "ngram", "num_speculative_tokens": 3}) as llm:
        plain = llm.generate(prompts, greedy, use_tqdm=False)  # n-gram drafts
        before = llm.engine.stats()
        proposer = ContinuationDrafts({tuple(p): o.outputs[0].token_ids for p, o in zip(prompts, plain)})
        llm.engine.proposer = proposer
        got = llm.generate(prompts, greedy, use_tqdm=False)
        stats = llm.engine.stats()
        assert stats.kv_blocks_used == 0
    assert_same_generation([o.outputs[0].token_ids for o in got], [o.outputs[0].logprobs for o in got],
                           [o.outputs[0].token_ids for o in plain], [o.outputs[0].logprobs for o in plain], atol=1e-4)
    # its drafts were verified, every one accepted, runs of 3 among them
    drafted = stats.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
    assert drafted > 0 and stats.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens == drafted
    assert stats.spec_decode_num_accepted_tokens_per_pos[2] > before.spec_decode_num_accepted_tokens_per_pos[2]
    # never more drafts than the request may still take, less the token after them; never above k
    assert proposer.limits and all(0 <= limit <= min(3, left - 1) for left, limit in proposer.limits)
    assert any(limit == 3 for _, limit in proposer.limits)
