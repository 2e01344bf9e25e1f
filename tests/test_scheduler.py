"""Scheduler and block accounting, in plain Python: no model, no processes."""

from __future__ import annotations

from kvshard.config import SchedulerConfig
from kvshard.engine.scheduler import Scheduler
from kvshard.engine.sequence import Sequence, SequenceStatus
from kvshard.kv.block_pool import BlockPool
from kvshard.kv.layout import DCPLayout
from kvshard.sampling_params import SamplingParams


def make_scheduler(num_blocks: int, block_size: int = 4, dcp: int = 1, max_num_seqs: int = 8, budget: int = 64):
    layout = DCPLayout(block_size, dcp, 1)
    return Scheduler(SchedulerConfig(max_num_seqs, budget, 4096), BlockPool(num_blocks), layout)


def make_seq(prompt_len: int, max_tokens: int) -> Sequence:
    return Sequence("r", 0, list(range(prompt_len)), SamplingParams(max_tokens=max_tokens), None)


def run_to_completion(scheduler: Scheduler, seqs: list[Sequence], max_steps: int = 10_000) -> list[list[int]]:
    """Drive the scheduler as the engine does, 'sampling' token = current length."""
    for seq in seqs:
        scheduler.add(seq)
    steps = 0
    while scheduler.has_unfinished():
        batch = scheduler.schedule()
        assert batch is not None, "nothing schedulable while requests wait: deadlock"
        assert batch.num_tokens <= scheduler.config.max_num_batched_tokens
        assert len(batch.seqs) <= scheduler.config.max_num_seqs
        scheduler.mark_computed(batch)
        for seq, do_sample in zip(batch.seqs, batch.sample):
            if do_sample:
                seq.output_token_ids.append(seq.num_tokens)
                if len(seq.output_token_ids) == seq.params.max_tokens:
                    scheduler.finish(seq, "length")
        steps += 1
        assert steps < max_steps
    return [s.output_token_ids for s in seqs]


def test_blocks_are_virtual_blocks_of_block_size_times_dcp():
    scheduler = make_scheduler(num_blocks=10, block_size=4, dcp=4)
    seq = make_seq(prompt_len=17, max_tokens=1)
    scheduler.add(seq)
    scheduler.schedule()
    assert len(seq.block_table) == 2  # 17 tokens / 16 per virtual block
    assert scheduler.pool.num_used == 2


def test_dcp_group_admits_n_times_the_tokens():
    def admitted(dcp: int) -> int:
        scheduler = make_scheduler(num_blocks=20, block_size=4, dcp=dcp, max_num_seqs=64, budget=4096)
        for _ in range(64):
            scheduler.add(make_seq(prompt_len=16, max_tokens=4))
        scheduler.schedule()
        return len(scheduler.running)

    # 16-token prompts on 20 blocks of 4 tokens per rank, keeping room for every admitted request
    # to grow by 4 tokens: k requests fit while 20 - k * 16 / (4 dcp) >= k / dcp
    assert admitted(1) == 4
    assert admitted(2) == 8
    assert admitted(4) == 16


def test_admission_keeps_room_for_the_running_requests_to_grow():
    scheduler = make_scheduler(num_blocks=9, block_size=4, max_num_seqs=64, budget=4096)
    for _ in range(4):
        scheduler.add(make_seq(prompt_len=8, max_tokens=20))
    scheduler.schedule()
    # 2 blocks each: the 2nd leaves 5 free >= 2 (room for 2 to grow a block), the 3rd 3 >= 3, the 4th 1 < 4
    assert len(scheduler.running) == 3
    assert scheduler.pool.num_free == 3  # one block of growth for each of the three


def test_long_prompt_is_chunked_and_decodes_keep_running():
    scheduler = make_scheduler(num_blocks=100, budget=8)
    short = make_seq(prompt_len=3, max_tokens=50)
    scheduler.add(short)
    batch = scheduler.schedule()
    scheduler.mark_computed(batch)
    short.output_token_ids.append(0)
    long = make_seq(prompt_len=40, max_tokens=1)
    scheduler.add(long)
    for _ in range(5):
        batch = scheduler.schedule()
        lens = dict(zip([s.seq_id for s in batch.seqs], batch.query_lens))
        assert lens[short.seq_id] == 1, "a decode was stalled by a long prefill"
        assert lens[long.seq_id] == 7
        scheduler.mark_computed(batch)
        short.output_token_ids.append(0)
    assert long.num_computed_tokens == 35


def test_a_batch_counts_the_prompt_tokens_it_computes_beyond_its_decodes():
    scheduler = make_scheduler(num_blocks=100, budget=8)
    short = make_seq(prompt_len=3, max_tokens=50)
    scheduler.add(short)
    batch = scheduler.schedule()
    assert batch.num_prefill_tokens == 2  # a whole prompt: its last token is the one the step samples after
    scheduler.mark_computed(batch)
    short.output_token_ids.append(0)
    assert scheduler.schedule().num_prefill_tokens == 0  # one decode
    long = make_seq(prompt_len=12, max_tokens=1)
    scheduler.add(long)
    batch = scheduler.schedule()  # the decode and a first chunk of 7, which samples nothing
    assert sorted(batch.query_lens) == [1, 7] and batch.num_prefill_tokens == 7
    scheduler.mark_computed(batch)
    short.output_token_ids.append(0)
    batch = scheduler.schedule()  # the decode and the prompt's last 5 tokens
    assert sorted(batch.query_lens) == [1, 5] and batch.num_prefill_tokens == 4


def test_drafts_verified_with_a_decode_are_no_prefill():
    scheduler = make_scheduler(num_blocks=100, budget=16)
    seq = make_seq(prompt_len=3, max_tokens=50)
    scheduler.add(seq)
    scheduler.mark_computed(scheduler.schedule())
    seq.output_token_ids.append(0)
    seq.num_spec_tokens = 3
    batch = scheduler.schedule()
    assert batch.query_lens == [4] and batch.num_drafts == [3]
    assert batch.num_prefill_tokens == 0


def test_out_of_blocks_preempts_the_newest_and_everything_finishes_with_the_same_tokens():
    def outputs(num_blocks: int) -> tuple[list[list[int]], int, int]:
        scheduler = make_scheduler(num_blocks=num_blocks, block_size=4, max_num_seqs=8, budget=32)
        seqs = [make_seq(prompt_len=5 + i, max_tokens=12) for i in range(6)]
        result = run_to_completion(scheduler, seqs)
        return result, scheduler.num_preemptions, scheduler.pool.num_free

    roomy, roomy_preemptions, roomy_free = outputs(num_blocks=100)
    tight, tight_preemptions, tight_free = outputs(num_blocks=12)
    assert roomy_preemptions == 0
    assert tight_preemptions > 0
    assert tight == roomy  # nothing lost, nothing duplicated
    assert roomy_free == 100 and tight_free == 12  # every block back


def test_max_num_seqs_caps_the_running_set():
    scheduler = make_scheduler(num_blocks=100, max_num_seqs=3, budget=64)
    for _ in range(5):
        scheduler.add(make_seq(prompt_len=2, max_tokens=3))
    scheduler.schedule()
    assert len(scheduler.running) == 3
    assert len(scheduler.waiting) == 2


def test_finish_and_abort_free_every_block():
    scheduler = make_scheduler(num_blocks=20)
    running, waiting = make_seq(10, 5), make_seq(10, 5)
    scheduler.add(running)
    scheduler.schedule()
    scheduler.add(waiting)
    assert scheduler.pool.num_used == 3
    scheduler.finish(running, "abort")
    scheduler.finish(waiting, "abort")
    assert scheduler.pool.num_used == 0
    assert running.status is waiting.status is SequenceStatus.FINISHED
    assert not scheduler.has_unfinished()
