"""Host work per step that does not grow with the context: a request's tokens read without copying them
all, each row's request without repeat_interleave, and an engine whose plans carry block-table changes
only, which its rank follows through preemptions and prefix hits (KVSHARD_CHECK_BLOCK_TABLES=1 compares
the kept tables with the whole ones every step)."""

from __future__ import annotations

import random

import torch

from conftest import environment, tiny_llama_config
from kvshard.attention.metadata import _seq_of_token
from kvshard.engine.sequence import Sequence
from kvshard.sampling_params import SamplingParams


def test_token_ids_read_like_all_token_ids():
    seq = Sequence("r", 0, [1, 2, 3, 4], SamplingParams(), None)
    seq.output_token_ids += [5, 6, 7]
    for start in range(8):
        for stop in range(start, 9):
            assert seq.token_ids(start, stop) == seq.all_token_ids[start:stop], (start, stop)
    assert seq.last_token_id == 7 and Sequence("s", 0, [9], SamplingParams(), None).last_token_id == 9


def test_each_rows_request_as_repeat_interleave_gives_it():
    rng = random.Random(0)
    for _ in range(200):
        query_lens = [rng.choice([1, 1, 1, 2, 5, 17]) for _ in range(rng.randrange(1, 9))]
        lens = torch.tensor(query_lens)
        expected = torch.repeat_interleave(torch.arange(len(query_lens)), lens)
        assert torch.equal(_seq_of_token(query_lens, torch.cumsum(lens, 0) - lens), expected), query_lens


def test_an_engine_sends_only_changes_and_its_rank_follows(checkpoints):
    from kvshard import LLM

    model = checkpoints("llama", tiny_llama_config())
    rng = random.Random(0)
    shared = [rng.randrange(128) for _ in range(40)]
    prompts = [shared[: rng.choice([16, 32, 40])] + [rng.randrange(128) for _ in range(rng.randrange(1, 20))]
               for _ in range(12)]
    plans = []
    with environment({"KVSHARD_CHECK_BLOCK_TABLES": "1"}), \
            LLM(str(model), num_kv_blocks=24, block_size=4, max_num_seqs=6, max_model_len=96) as llm:
        engine = llm.engine
        execute = engine.executor.execute
        engine.executor.execute = lambda plan: plans.append(plan) or execute(plan)
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                               use_tqdm=False)
        preemptions, hits = engine.scheduler.num_preemptions, engine.scheduler.prefix_cache_hits
    assert all(len(o.outputs[0].token_ids) == 24 for o in outputs)
    assert preemptions > 0 and hits > 0, (preemptions, hits)  # the tables were replaced and shared
    assert plans and all(p.block_tables is None and p.tables is not None for p in plans)
    assert all(p.tables.whole is not None for p in plans)  # the check ran on the rank every step
    decodes = [p for p in plans if all(n == 1 for n in p.query_lens)]
    assert decodes and all(p.tables.num_ids <= len(p.query_lens) for p in decodes), \
        "a decode step sends at most its new blocks"
    assert [p.tables.version for p in plans] == list(range(1, len(plans) + 1))
