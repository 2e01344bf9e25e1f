"""Block tables sent as changes (kvshard/engine/block_tables.py), without processes: the tables a rank
rebuilds from the changes are the whole tables the plans used to carry (the oracle: `list(seq.block_table)`
of each request, and the metadata built from them), through the scheduler's admissions, growth, prefix
hits, preemptions and re-admissions, drafts given back, finishes and aborts; a rank out of step raises."""

from __future__ import annotations

import pickle
import random

import pytest
import torch

from kvshard.attention.backends import GatherBackend, ReferenceBackend
from kvshard.attention.metadata import AttentionMetadata
from kvshard.bench.host_step import measure
from kvshard.config import SchedulerConfig
from kvshard.engine.block_tables import BlockTable, BlockTableSender, BlockTablesOutOfSync, RankBlockTables
from kvshard.engine.scheduler import Scheduler
from kvshard.engine.sequence import Sequence, SequenceStatus
from kvshard.engine.step_plan import StepPlan
from kvshard.kv.block_pool import BlockPool
from kvshard.kv.layout import DCPLayout
from kvshard.sampling_params import SamplingParams

CPU = torch.device("cpu")


def whole_tables(seqs: list[Sequence]) -> list[list[int]]:
    """The oracle: what a plan carried before, every request's whole table (StepPlan.from_batch without changes)."""
    return [list(seq.block_table) for seq in seqs]


def assert_rank_holds(rank: RankBlockTables, slots: list[int], whole: list[list[int]]) -> None:
    for slot, table in zip(slots, whole):
        row = rank.host[slot].tolist()
        assert row[: len(table)] == table and int(rank.lens[slot]) == len(table), (slot, row, table)
        assert not any(row[len(table):]), "entries past a table are 0, as in a padded table"


def assert_same_metadata(ours: AttentionMetadata, oracle: AttentionMetadata) -> None:
    for name in ("positions", "write_index", "write_slots", "row_lens"):
        assert torch.equal(getattr(ours, name), getattr(oracle, name)), name
    assert (ours.context_rows, ours.uses_context, ours.has_prefill, ours.writes_every_token) == \
        (oracle.context_rows, oracle.uses_context, oracle.has_prefill, oracle.writes_every_token)
    for r, (row, oracle_row, n) in enumerate(zip(ours.row_seq.tolist(), oracle.row_seq.tolist(),
                                                 ours.row_lens.tolist())):
        blocks = -(-n // 4)  # block_size 4 below
        assert ours.block_tables[row, :blocks].tolist() == oracle.block_tables[oracle_row, :blocks].tolist(), r
    assert len(ours.groups) == len(oracle.groups)
    for group, oracle_group in zip(ours.groups, oracle.groups):
        assert (group.start, group.end, group.query_len, group.rows_in_cache) == \
            (oracle_group.start, oracle_group.end, oracle_group.query_len, oracle_group.rows_in_cache)
        for name in ("context_blocks", "context_bias"):
            got, expected = getattr(group, name), getattr(oracle_group, name)
            assert (got is None and expected is None) or torch.equal(got, expected), name


def _prompt(rng: random.Random, shared: list[int]) -> list[int]:
    own = [rng.randrange(100, 1000) for _ in range(rng.randrange(1, 40))]
    return (shared[: rng.choice([0, 8, 16, 24])] if rng.random() < 0.6 else []) + own


def drive(seed: int, steps: int = 160, check_metadata: bool = True) -> dict[str, int]:
    """The real scheduler over a small pool (preemptions), with prefix caching (hits), drafts (given back
    when rejected), finishes and aborts; every plan's changes go through pickle to a rank whose tables
    are compared with the whole tables each step. Returns how often each event happened."""
    rng = random.Random(seed)
    layout = DCPLayout(4, 2, 1)  # 8 tokens per virtual block
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=48, max_model_len=200),
                          BlockPool(24), layout, enable_prefix_caching=True)
    sender = BlockTableSender()
    rank = RankBlockTables(CPU, num_slots=1, num_blocks=1)  # grows as the requests come
    shared = [rng.randrange(100, 1000) for _ in range(24)]
    events = dict(admitted=0, truncated=0, finished=0, aborted=0, updates=0, freed=0)
    seqs: list[Sequence] = []
    for step in range(steps):
        if rng.random() < 0.3 and len(seqs) < 60:
            seq = Sequence(f"r{len(seqs)}", 0, _prompt(rng, shared), SamplingParams(max_tokens=rng.randrange(1, 90)),
                           None)
            scheduler.add(seq)
            seqs.append(seq)
            events["admitted"] += 1
        if rng.random() < 0.03 and scheduler.running:  # an abort between two steps
            scheduler.finish(rng.choice(scheduler.running), "abort")
            events["aborted"] += 1
        for seq in scheduler.running:  # as LLMEngine._ask_for_drafts
            if seq.num_uncomputed_tokens == 1:
                seq.num_spec_tokens = rng.randrange(0, 4)
        batch = scheduler.schedule()
        if batch is None:
            continue
        changes = sender.changes(batch.seqs)
        plan = pickle.loads(pickle.dumps(StepPlan.from_batch(batch, tables=changes)))  # as the broadcast does
        assert plan.block_tables is None
        rank.apply(plan.tables)
        whole = whole_tables(batch.seqs)
        assert_rank_holds(rank, plan.tables.slots, whole)
        assert max(plan.tables.slots) < 6, "a slot per running request at most (max_num_seqs): left ones are reused"
        events["updates"] += len(changes.updates)
        events["freed"] += len(changes.freed)
        if check_metadata:
            for backend in (ReferenceBackend(), GatherBackend()):
                ours = AttentionMetadata.build(plan.context_lens, plan.query_lens, rank.table, layout, 1, CPU,
                                               backend=backend, table_rows=plan.tables.slots)
                oracle = AttentionMetadata.build(plan.context_lens, plan.query_lens, whole, layout, 1, CPU,
                                                 backend=backend)
                assert_same_metadata(ours, oracle)
        scheduler.mark_computed(batch)
        for seq, do_sample, num_drafts in zip(batch.seqs, batch.sample, batch.num_drafts):
            if not do_sample or seq.status is not SequenceStatus.RUNNING:
                continue
            accepted = rng.randrange(0, num_drafts + 1)
            seq.output_token_ids.extend(rng.randrange(100, 1000) for _ in range(accepted + 1))
            if len(seq.output_token_ids) >= seq.params.max_tokens:
                scheduler.finish(seq, "length")
                events["finished"] += 1
            elif num_drafts:
                before = len(seq.block_table)
                scheduler.accept_drafts(seq, accepted)
                events["truncated"] += len(seq.block_table) < before
    events["preempted"] = scheduler.num_preemptions
    events["prefix_hits"] = scheduler.prefix_cache_hits
    return events


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_changes_rebuild_the_whole_tables_through_every_scheduler_event(seed):
    events = drive(seed)
    # the run reached every way a table changes (else the comparison proves little)
    assert all(events[name] > 0 for name in ("admitted", "truncated", "finished", "aborted", "preempted",
                                             "prefix_hits", "freed")), events


def test_a_block_table_remembers_what_changed_but_appending():
    table = BlockTable([5, 6, 7, 8])
    table.unchanged = 4
    table.extend([9, 10])
    table.append(11)
    table += [12]
    assert table.unchanged == 4
    del table[6:]
    assert table.unchanged == 4  # entries 6.. were appended since: the first 4 are still as sent
    del table[2:]
    assert table.unchanged == 2 and table == [5, 6]
    table[1] = 3
    assert table.unchanged == 1
    table.pop()
    assert table.unchanged == 1
    table.insert(0, 1)
    assert table.unchanged == 0
    seq = Sequence("r", 0, [1, 2, 3], SamplingParams(), None)
    seq.block_table = [4, 5]
    assert isinstance(seq.block_table, BlockTable) and seq.block_table.unchanged == 0


def _random_edits(rng: random.Random, tables: dict[int, list], live: dict[int, Sequence], next_id: list[int]):
    """One round of edits of the kinds the scheduler makes, on the sequences in `live`."""
    for seq in list(live.values()):
        kind = rng.random()
        if kind < 0.4:
            seq.block_table.extend(rng.randrange(1000) for _ in range(rng.randrange(1, 4)))
        elif kind < 0.55 and seq.block_table:
            del seq.block_table[rng.randrange(len(seq.block_table)):]
            seq.block_table.extend(rng.randrange(1000) for _ in range(rng.randrange(0, 3)))  # then grows again
        elif kind < 0.65:
            seq.block_table = [rng.randrange(1000) for _ in range(rng.randrange(1, 6))]  # replaced (re-admitted)
        elif kind < 0.72:
            seq.block_table = []  # released
            del live[seq.seq_id]
    while len(live) < 5:
        seq = Sequence(f"r{next_id[0]}", 0, [1], SamplingParams(), None)
        next_id[0] += 1
        seq.block_table = [rng.randrange(1000) for _ in range(rng.randrange(1, 6))]
        live[seq.seq_id] = seq


def test_random_edits_and_subsets_of_the_requests_per_plan():
    """Edits of every kind, and plans that carry only some of the requests (the draft passes): the
    ranks' tables follow; on a CUDA-less machine the rank's table is its host table."""
    rng = random.Random(7)
    sender, rank = BlockTableSender(check=True), RankBlockTables(CPU, 2, 2)
    live: dict[int, Sequence] = {}
    next_id = [0]
    for _ in range(300):
        _random_edits(rng, {}, live, next_id)
        plan_seqs = rng.sample(list(live.values()), rng.randrange(1, len(live) + 1))
        changes = pickle.loads(pickle.dumps(sender.changes(plan_seqs)))
        rank.apply(changes)  # the check of KVSHARD_CHECK_BLOCK_TABLES compares whole tables too
        assert_rank_holds(rank, changes.slots, whole_tables(plan_seqs))
    assert rank.table is rank.host


def _synced_pair():
    sender, rank = BlockTableSender(), RankBlockTables(CPU)
    seqs = [Sequence(f"r{i}", 0, [1], SamplingParams(), None) for i in range(3)]
    for i, seq in enumerate(seqs):
        seq.block_table = [10 * i + j for j in range(i + 2)]
    rank.apply(sender.changes(seqs))
    return sender, rank, seqs


def test_a_rank_that_misses_a_plan_or_gets_one_twice_raises():
    sender, rank, seqs = _synced_pair()
    seqs[0].block_table.append(99)
    lost = sender.changes(seqs)
    seqs[1].block_table.append(98)
    with pytest.raises(BlockTablesOutOfSync, match="plan 3 arrived after plan 1"):
        rank.apply(sender.changes(seqs))
    rank.apply(lost)
    with pytest.raises(BlockTablesOutOfSync, match="plan 2 arrived after plan 2"):
        rank.apply(lost)


def test_a_rank_whose_tables_differ_raises_before_any_metadata():
    sender, rank, seqs = _synced_pair()
    rank.host[1, 2] = 77  # a rank's last block differs
    with pytest.raises(BlockTablesOutOfSync, match=r"request 1 \(slot 1\) holds 3 blocks ending in 77"):
        rank.apply(sender.changes(seqs))
    sender, rank, seqs = _synced_pair()
    seqs[2].block_table.append(5)
    changes = sender.changes(seqs)
    dropped = type(changes)(changes.version, changes.freed, [], changes.slots, changes.num_blocks,
                            changes.last_blocks)  # an update lost on the way
    with pytest.raises(BlockTablesOutOfSync, match="holds 4 blocks ending in 23, rank 0 sent 5 ending in 5"):
        rank.apply(dropped)


def test_the_whole_tables_check_catches_a_difference_inside_a_table():
    sender, rank, seqs = _synced_pair()
    sender.check = True
    rank.host[2, 0] = 55  # neither the count nor the last block shows it
    with pytest.raises(BlockTablesOutOfSync, match=r"holds \[55, 21, 22, 23\], not \[20, 21, 22, 23\]"):
        rank.apply(sender.changes(seqs))


def test_the_plan_does_not_grow_with_the_context():
    short, long = measure(8, 256, steps=3), measure(8, 8192, steps=3)
    assert long["plan_bytes"] < 1.2 * short["plan_bytes"], (short, long)
