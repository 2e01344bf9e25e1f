"""Decode graphs (kvshard/engine/cuda_graphs.py) without a GPU: the sizes, the padding, capture once
per size and replay, driven through a stand-in for torch.cuda's graphs that records the step and, on
replay, runs it again over the same buffers into the same output tensor (what a graph does:
`RerunGraphApi`); and the
graph's own decode step on a real model (through the Triton backend on the interpreter) against the
eager step. scripts/device_check.py replays real graphs on a GPU."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvshard.engine import cuda_graphs
from kvshard.engine.cuda_graphs import DecodeGraphs, DecodeInputs, RerunGraphApi, capture_sizes, padded_size
from kvshard.engine.step_plan import StepPlan


def test_capture_sizes_double_then_step_and_end_at_max_num_seqs():
    assert capture_sizes(1) == [1]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    sizes = capture_sizes(300)
    assert sizes[-3:] == [240, 256, 300] and sizes == sorted(set(sizes))
    assert [padded_size(n, [1, 2, 4, 8]) for n in (0, 1, 3, 4, 5, 8, 9)] == [None, 1, 4, 4, 8, 8, None]


def _meta(n, write_index, tables, row_lens, block_size=16, row_seq=None):
    """`row_seq`: each row's table (a rank's persistent tables, engine/block_tables.py); row r's own by default."""
    positions = torch.arange(n) + 10
    return SimpleNamespace(positions=positions, write_index=torch.tensor(write_index, dtype=torch.long),
                           write_slots=torch.tensor([100 + i for i in write_index], dtype=torch.long),
                           block_tables=torch.tensor(tables, dtype=torch.int32),
                           row_lens=torch.tensor(row_lens, dtype=torch.int32),
                           row_seq=torch.tensor(row_seq if row_seq is not None else range(n), dtype=torch.int32))


def test_load_pads_the_rows_past_the_batch_and_the_tokens_another_rank_owns():
    inputs = DecodeInputs.allocate(4, max_blocks=3, scratch_block=9, block_size=16, device=torch.device("cpu"))
    addresses = [t.data_ptr() for t in (inputs.input_ids, inputs.write_slots, inputs.block_tables)]
    inputs.input_ids.fill_(7)  # what an earlier, larger step left behind
    inputs.row_lens.fill_(5)
    inputs.write_slots.fill_(3)
    # 3 decodes on a DCP rank that owns the new tokens of rows 0 and 2 only
    inputs.load(torch.tensor([11, 12, 13]), _meta(3, [0, 2], [[1, 2], [3, 0], [4, 5]], [3, 0, 8]), 16)
    assert inputs.input_ids.tolist() == [11, 12, 13, 0]
    assert inputs.positions.tolist() == [10, 11, 12, 0]
    assert inputs.write_slots.tolist() == [100, 144, 102, 144]  # 144: the scratch block's first slot
    assert inputs.block_tables.tolist() == [[1, 2, 9], [3, 0, 9], [4, 5, 9], [9, 9, 9]]
    assert inputs.row_lens.tolist() == [3, 0, 8, 0] and inputs.row_seq.tolist() == [0, 1, 2, 3]
    assert [t.data_ptr() for t in (inputs.input_ids, inputs.write_slots, inputs.block_tables)] == addresses
    with pytest.raises(ValueError, match="4 blocks exceeds the captured 3"):
        inputs.load(torch.tensor([1]), _meta(1, [0], [[1, 2, 3, 4]], [1]), 16)


def test_load_reads_each_rows_table_from_the_ranks_persistent_tables():
    inputs = DecodeInputs.allocate(4, max_blocks=3, scratch_block=9, block_size=16, device=torch.device("cpu"))
    # slots 0..3 of a rank's tables, wider than the graph's (their entries past each table are 0); the step's
    # two decodes are the requests of slots 2 and 0
    persistent = [[1, 2, 0, 0], [7, 7, 7, 0], [4, 5, 6, 0], [0, 0, 0, 0]]
    inputs.load(torch.tensor([11, 12]), _meta(2, [0, 1], persistent, [3, 4], row_seq=[2, 0]), 16)
    # (a table's entries past its blocks are copied as they are, 0: never read, row_lens bound the kernel)
    assert inputs.block_tables.tolist() == [[4, 5, 6], [1, 2, 0], [9, 9, 9], [9, 9, 9]]
    assert inputs.row_seq.tolist() == [0, 1, 2, 3]  # the graph's rows read their own copied tables


def _toy_step(calls):
    def step(inputs):  # one row of "logits" per row, from everything the step reads
        calls.append(inputs.size)
        return torch.stack([inputs.input_ids.float(), inputs.positions.float(), inputs.write_slots.float(),
                            inputs.row_lens.float(), inputs.block_tables[:, 0].float()], dim=1)
    return step


def test_each_size_is_captured_once_and_a_step_replays_the_smallest_that_holds_it():
    api, calls = RerunGraphApi(), []
    graphs = DecodeGraphs(_toy_step(calls), lambda size: DecodeInputs.allocate(size, 2, 9, 16, torch.device("cpu")),
                          [1, 2, 4, 8], api)
    graphs.capture()
    assert api.captured == [8, 4, 2, 1] and api.warmed == 4  # largest first: the smaller share its pool
    meta = _meta(3, [0, 1, 2], [[1], [2], [3]], [4, 5, 6])
    out = graphs.run(3, lambda inputs: inputs.load(torch.tensor([21, 22, 23]), meta, 16))
    assert out.shape == (3, 5) and api.replayed == 1 and graphs.replays == 1
    assert out.tolist() == [[21, 10, 100, 4, 1], [22, 11, 101, 5, 2], [23, 12, 102, 6, 3]]
    # the padded row went through the graph too, as padding
    assert graphs.graphs[4][2][3].tolist() == [0, 0, 144, 0, 9]
    one = graphs.run(1, lambda inputs: inputs.load(torch.tensor([5]), _meta(1, [0], [[4]], [1]), 16))
    assert one.tolist() == [[5, 10, 100, 1, 4]] and calls.count(1) == 3  # warm-up, capture, one replay
    with pytest.raises(ValueError, match="no graph holds a batch of 9 rows"):
        graphs.run(9, lambda inputs: None)


def test_ranks_without_logits_replay_and_return_none():
    api = RerunGraphApi()
    graphs = DecodeGraphs(lambda inputs: None, lambda size: DecodeInputs.allocate(size, 1, 0, 16, torch.device("cpu")),
                          [2], api)
    graphs.capture()
    assert graphs.run(2, lambda inputs: None) is None and api.replayed == 1


def test_only_plain_decode_steps_replay():
    decode = StepPlan(token_ids=[1, 2], query_lens=[1, 1], context_lens=[4, 9], block_tables=[[0], [1]],
                      sample_rows=[0, 1])
    assert cuda_graphs.is_plain_decode(decode)
    assert not cuda_graphs.is_plain_decode(StepPlan([1, 2, 3], [1, 2], [4, 0], [[0], [1]], [0, 2]))  # a chunk
    assert not cuda_graphs.is_plain_decode(StepPlan([1, 2], [1, 1], [4, 9], [[0], [1]], [0, 1], draft=True))
    assert not cuda_graphs.is_plain_decode(StepPlan([1, 2], [1, 1], [4, 9], [[0], [1]], [1]))


def _config(path, **engine):
    from kvshard.engine.arg_utils import EngineArgs

    return EngineArgs(model=str(path), **engine).create_engine_config()


def test_graphs_are_used_only_where_they_can_be_captured(checkpoints):
    from transformers import DeepseekV3Config

    from conftest import tiny_llama_config
    from test_attention_backends import MLA_CONFIG

    MOE_CONFIG = {**MLA_CONFIG, "first_k_dense_replace": 1, "n_routed_experts": 4, "num_experts_per_tok": 2,
                  "n_shared_experts": 1, "moe_intermediate_size": 32, "n_group": 1, "topk_group": 1}

    path = checkpoints("graphs-llama", tiny_llama_config())
    triton = _config(path, attention_backend="triton", max_model_len=64, num_kv_blocks=16, max_num_seqs=4)
    why = cuda_graphs.graphs_unavailable
    assert why(triton, "cuda") is None
    assert why(triton, "cpu") == "CUDA graphs are for CUDA devices; this engine runs on the CPU"
    # on a CPU the line is the flat decode program's (models/decode_program.py), which calls the paged kernel
    assert ("decode steps: eager, in the layers' modules (the flat program calls the paged attention kernel)"
            in triton.layout_report())
    assert cuda_graphs.describe_decode_graphs(triton, "cuda") == \
        "decode steps: CUDA graphs for batches of 1, 2, 4 (padded up; --enforce-eager turns them off)"
    eager = _config(path, attention_backend="triton", max_model_len=64, num_kv_blocks=16, enforce_eager=True)
    assert why(eager, "cuda") == "--enforce-eager"
    assert "decode steps: eager, in the layers' modules (--enforce-eager)" in eager.layout_report()
    assert "gather attention backend" in why(_config(path, attention_backend="gather", max_model_len=64,
                                                     num_kv_blocks=16), "cuda")
    moe = _config(checkpoints("graphs-moe", DeepseekV3Config(**MOE_CONFIG)), attention_backend="triton",
                  max_model_len=64, num_kv_blocks=16)
    assert "MoE layers pick their experts on the host" in why(moe, "cuda")
    two = _config(path, attention_backend="triton", max_model_len=64, num_kv_blocks=16, tensor_parallel_size=2)
    assert why(two, "cuda", "nccl") is None and "run on gloo" in why(two, "cuda", "gloo")


def test_enforce_eager_is_a_flag_and_a_checked_setting(checkpoints):
    import argparse

    from kvshard.engine.arg_utils import EngineArgs
    from kvshard.errors import ConfigError
    from conftest import tiny_llama_config

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    assert EngineArgs.from_cli_args(parser.parse_args(["m", "--enforce-eager"])).enforce_eager is True
    assert EngineArgs.from_cli_args(parser.parse_args(["m"])).enforce_eager is False
    path = checkpoints("graphs-llama", tiny_llama_config())
    with pytest.raises(ConfigError, match="enforce_eager='yes' must be True or False"):
        _config(path, attention_backend="triton", max_model_len=64, num_kv_blocks=16, enforce_eager="yes")


@pytest.mark.skipif(not __import__("kvshard.attention.triton_paged", fromlist=["x"]).interpreted(),
                    reason="the graph's step runs the Triton kernel: on a CPU only under Triton's interpreter")
def test_the_graphs_decode_step_gives_the_eager_steps_logits(checkpoints):
    """The step a graph records (static buffers, padding to the scratch block, the kernel's split sized
    for max_model_len) on a real model, replayed by the stand-in, against the same decode run eagerly."""
    from kvshard.engine.model_runner import ModelRunner
    from kvshard.kv.cache import allocate_kv_cache
    from kvshard.parallel import single_rank_state
    from conftest import tiny_llama_config

    path = checkpoints("graphs-llama", tiny_llama_config())
    config = _config(path, attention_backend="triton", max_model_len=64, num_kv_blocks=16, max_num_seqs=4,
                     block_size=16)
    runner = ModelRunner(config, single_rank_state(), torch.device("cpu"))
    assert runner.decode_graphs is None  # never on a CPU
    runner.kv_caches = allocate_kv_cache(config.kv_cache_spec, config.num_kv_blocks + 1, 16, config.model.dtype,
                                         torch.device("cpu"))  # with the scratch block, as on CUDA
    graphed = cuda_graphs.GraphedDecode(runner, RerunGraphApi())
    assert graphed.capture() and sorted(graphed.graphs.graphs) == [1, 2, 4]
    # the second one longer than a tile of the kernel (32 tokens): a split sized too short would drop tokens
    prompts = [[3, 1, 4, 1, 5], [(7 * i) % 97 + 1 for i in range(40)], [9]]
    tables = [[0], [1, 2, 4], [3]]
    runner.execute(StepPlan([t for p in prompts for t in p], [len(p) for p in prompts], [0, 0, 0], tables,
                            [4, 44, 45]))
    decode = StepPlan([7, 8, 9], [1, 1, 1], [len(p) for p in prompts], tables, [0, 1, 2])
    replayed, logits = graphed.execute(decode)  # 3 rows on the graph of 4
    assert replayed and logits.shape == (3, 128) and graphed.graphs.replays == 1  # the vocabulary
    eager = runner.execute(decode)  # writes the same K/V to the same slots again
    torch.testing.assert_close(logits, eager, atol=1e-5, rtol=1e-5)
    assert graphed.execute(StepPlan([1, 2], [2], [0], [[5]], [1])) == (False, None)  # a prefill: eager
