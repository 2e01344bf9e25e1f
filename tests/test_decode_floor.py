"""`kvshard bench decode-floor` (kvshard/bench/decode_floor.py) times steps that decode the whole batch.

Chunked prefill gives the requests their first tokens steps apart; a budget of exactly the timed steps ended
the first requests while the timing still ran, so its last steps decoded an ever smaller batch (SmolLM2 at 32 x
1,024: 78 ms steps falling to 29 ms, reported as the best step). Every timed step must advance every request.
"""

from __future__ import annotations

import pytest

from kvshard.bench.decode_floor import measure_decode_floor
from kvshard.engine.arg_utils import EngineArgs

from conftest import tiny_llama_config

# one 24-token prompt per 32-token step: the four requests' prefills end steps apart
STAGGERED = dict(max_num_batched_tokens=32, max_num_seqs=4, block_size=4, kv_cache_memory="2MiB")


def test_every_timed_step_decodes_the_whole_batch(checkpoints):
    path = str(checkpoints("llama", tiny_llama_config()))
    args = EngineArgs(model=path, **STAGGERED)
    result = measure_decode_floor(args, batch_size=4, context_len=24, steps=6, warmup_steps=1, bandwidth_bytes=2**20)
    assert result["batch_size"] == 4 and result["steps"] == 6 and result["median_step_ms"] > 0
    # the timed steps attend to all four requests' prompts and more
    assert result["kv_bytes_per_step"] > 4 * 24 * args.create_engine_config().kv_bytes_per_token_per_rank


def test_a_request_that_would_finish_while_timing_is_an_error_not_a_smaller_batch(checkpoints):
    # a window of 32 tokens leaves 8 after a 24-token prompt: the first request ends while the last still decodes
    path = str(checkpoints("llama", tiny_llama_config()))
    with pytest.raises(RuntimeError, match="a request left the decode batch while timing"):
        measure_decode_floor(EngineArgs(model=path, max_model_len=32, **STAGGERED), batch_size=4, context_len=24,
                             steps=6, warmup_steps=1, bandwidth_bytes=2**20)


def test_a_kv_cache_too_small_for_the_batch_is_refused_before_anything_starts(checkpoints):
    # preempted requests leave the batch (their steps would time a smaller one): refused up front, with the size
    path = str(checkpoints("llama", tiny_llama_config()))
    small = dict(STAGGERED, kv_cache_memory="24KiB", max_model_len=64)  # 96 tokens: one request fits, four do not
    with pytest.raises(ValueError, match=r"need about [\d,]+: pass --kv-cache-memory \d+MiB or more"):
        measure_decode_floor(EngineArgs(model=path, **small), batch_size=4, context_len=24, steps=6, warmup_steps=1,
                             bandwidth_bytes=2**20)
