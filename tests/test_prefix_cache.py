"""Prefix caching (docs/design.md#prefix-caching): block accounting under any sequence of events, and
greedy outputs identical with and without the cache on every layout."""

from __future__ import annotations


import pytest
from hypothesis import event, given, settings, strategies as st

from kvshard.config import FCFS, LPM, SCHEDULING_POLICIES, ConfigError, SchedulerConfig
from kvshard.engine.arg_utils import EngineArgs
from kvshard.engine.llm_engine import LLMEngine
from kvshard.engine.scheduler import Scheduler
from kvshard.engine.sequence import Sequence, SequenceStatus
from kvshard.kv.block_pool import BlockPool
from kvshard.kv.layout import DCPLayout
from kvshard.sampling_params import SamplingParams


def make_scheduler(num_blocks: int, block_size: int = 4, dcp: int = 1, budget: int = 64,
                   enable_prefix_caching: bool = True, policy: str = FCFS) -> Scheduler:
    return Scheduler(SchedulerConfig(8, budget, 4096, policy), BlockPool(num_blocks), DCPLayout(block_size, dcp, 1),
                     enable_prefix_caching)


def make_seq(prompt: list[int], max_tokens: int = 1) -> Sequence:
    return Sequence("r", 0, prompt, SamplingParams(max_tokens=max_tokens), None)


class KVModel:
    """What each cache slot holds, as the engine would write it: the K/V of a token depend on the
    token and on everything before it, so a slot is recorded as the whole prefix it ends."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.slots: dict[tuple[int, int], tuple[int, ...]] = {}

    def step(self) -> bool:
        """Schedule, check every context read, write the new tokens, sample; False if nothing ran."""
        scheduler, per_block = self.scheduler, self.scheduler.layout.tokens_per_virtual_block
        batch = scheduler.schedule()
        if batch is None:
            return False
        for seq, ctx, n in zip(batch.seqs, batch.context_lens, batch.query_lens):
            tokens = seq.all_token_ids
            for p in range(ctx):  # every token attended to as context holds exactly its prefix's K/V
                assert self.slots.get((seq.block_table[p // per_block], p % per_block)) == tuple(tokens[: p + 1])
            for p in range(ctx, ctx + n):
                self.slots[(seq.block_table[p // per_block], p % per_block)] = tuple(tokens[: p + 1])
        scheduler.mark_computed(batch)
        for seq, do_sample in zip(batch.seqs, batch.sample):
            if do_sample:
                seq.output_token_ids.append(sum(seq.all_token_ids[-3:]) % 3)  # deterministic: sessions repeat
                if len(seq.output_token_ids) == seq.params.max_tokens:
                    scheduler.finish(seq, "length")
        return True


def assert_accounting(scheduler: Scheduler, seqs: list[Sequence]) -> None:
    pool = scheduler.pool
    held = [0] * pool.num_blocks
    for seq in seqs:
        assert len(set(seq.block_table)) == len(seq.block_table)
        if seq.status is not SequenceStatus.RUNNING:
            assert seq.block_table == []  # waiting and finished requests hold nothing
        for block in seq.block_table:
            held[block] += 1
    assert pool.ref_counts == held
    free = list(pool._empty) + list(pool._evictable)
    assert sorted(free) == [b for b in range(pool.num_blocks) if held[b] == 0]  # each free block once
    assert pool.num_free + pool.num_used == pool.num_blocks
    assert all(pool._block_of[h] == b for b, h in pool._hash_of.items()) and len(pool._block_of) == len(pool._hash_of)


EVENTS = st.lists(st.one_of(
    st.tuples(st.just("add"), st.lists(st.integers(0, 1), min_size=1, max_size=10), st.integers(1, 4)),
    st.tuples(st.just("continue"), st.integers(0, 50), st.lists(st.integers(0, 1), max_size=3)),
    st.tuples(st.just("step"), st.integers(1, 6)),
    st.tuples(st.just("abort"), st.integers(0, 50)),
    st.tuples(st.just("reset"),),
), min_size=8, max_size=40)


@settings(max_examples=150, deadline=None)
@given(events=EVENTS, shape=st.sampled_from([(2, 1), (2, 2), (1, 4), (4, 1)]), spare=st.integers(0, 3),
       budget=st.sampled_from([3, 8, 64]), policy=st.sampled_from(SCHEDULING_POLICIES))
def test_any_sequence_of_events_keeps_accounting_exact_and_hits_right(events, shape, spare, budget, policy):
    block_size, dcp = shape
    per_block = block_size * dcp
    longest = 16  # prompts are cut at 12 tokens, then 4 outputs: the pool holds one or two requests
    scheduler = make_scheduler(-(-longest // per_block) + spare, block_size, dcp, budget, policy=policy)
    kv = KVModel(scheduler)
    seqs: list[Sequence] = []
    for op in events:
        if op[0] == "add":
            seqs.append(make_seq(op[1], op[2]))
            scheduler.add(seqs[-1])
        elif op[0] == "continue" and seqs:  # the next turn of a conversation: all of it, then new text
            turn = seqs[op[1] % len(seqs)]
            prompt = (turn.all_token_ids + op[2])[:longest - 4]
            seqs.append(make_seq(prompt, 4))
            scheduler.add(seqs[-1])
        elif op[0] == "step":
            for _ in range(op[1]):
                kv.step()
        elif op[0] == "abort" and seqs:
            seq = seqs[op[1] % len(seqs)]
            if not seq.is_finished:
                scheduler.finish(seq, "abort")
        elif op[0] == "reset":
            scheduler.reset_prefix_cache()
        assert_accounting(scheduler, seqs)
    while scheduler.has_unfinished():
        assert kv.step(), "requests wait but nothing can be scheduled"
        assert_accounting(scheduler, seqs)
    assert scheduler.pool.num_free == scheduler.pool.num_blocks
    assert scheduler.prefix_cache_hits <= scheduler.prefix_cache_queries
    event(f"evictions: {scheduler.pool.num_evictions > 0}, hits: {scheduler.prefix_cache_hits > 0}, "
          f"preemptions: {scheduler.num_preemptions > 0}")


def run(scheduler: Scheduler, *seqs: Sequence) -> None:
    kv = KVModel(scheduler)
    for seq in seqs:
        scheduler.add(seq)
    while scheduler.has_unfinished():
        assert kv.step()


def first_step_context(scheduler: Scheduler, seq: Sequence) -> int:
    """Tokens `seq` takes from the cache: the context of its first scheduled chunk."""
    scheduler.add(seq)
    batch = scheduler.schedule()
    return dict(zip([s.seq_id for s in batch.seqs], batch.context_lens))[seq.seq_id]


def test_a_request_reuses_the_full_blocks_of_an_earlier_prompt_and_computes_the_rest():
    scheduler = make_scheduler(num_blocks=10, block_size=4)
    run(scheduler, make_seq(list(range(10)), max_tokens=3))  # 12 of its tokens computed: 3 full blocks
    follow_up = make_seq(list(range(10)) + [7, 7, 7])
    assert first_step_context(scheduler, follow_up) == 8  # tokens 8, 9 are cached, but block 3 differs
    assert follow_up.num_cached_tokens == 8
    assert (scheduler.prefix_cache_queries, scheduler.prefix_cache_hits) == (10 + 13, 8)


def test_a_hit_leaves_the_last_prompt_token_to_compute():
    scheduler = make_scheduler(num_blocks=10, block_size=4)
    run(scheduler, make_seq(list(range(8))))
    assert first_step_context(scheduler, make_seq(list(range(8)))) == 4  # 8 cached, 7 usable, one block


def test_under_dcp_hits_are_whole_virtual_blocks_shared_by_the_group():
    scheduler = make_scheduler(num_blocks=10, block_size=4, dcp=2)  # 8 tokens per virtual block
    first = make_seq(list(range(20)))
    run(scheduler, first)
    second = make_seq(list(range(20)) + [1])
    assert first_step_context(scheduler, second) == 16
    assert second.block_table[:2] == scheduler.pool.lookup(first.block_hashes[:2])
    assert scheduler.pool.ref_counts[second.block_table[0]] == 1  # the first request is gone, its blocks cached


def test_running_requests_share_cached_blocks_by_reference_count():
    scheduler = make_scheduler(num_blocks=10, block_size=4, budget=8)
    first, second = make_seq(list(range(12)), max_tokens=4), make_seq(list(range(12)), max_tokens=4)
    scheduler.add(first)
    scheduler.mark_computed(scheduler.schedule())  # 8 tokens: two named blocks
    scheduler.add(second)
    batch = scheduler.schedule()  # first's last chunk and second's, from its cached prefix
    assert batch.context_lens == [8, 8]
    assert second.block_table[:2] == first.block_table[:2]
    assert [scheduler.pool.ref_counts[b] for b in first.block_table] == [2, 2, 1]
    scheduler.finish(first, "abort")
    assert [scheduler.pool.ref_counts[b] for b in second.block_table] == [1, 1, 1]


def test_free_cached_blocks_are_evicted_least_recently_freed_first_and_only_when_needed():
    scheduler = make_scheduler(num_blocks=6, block_size=4)
    old, new = make_seq([1] * 9), make_seq([2] * 9)  # 2 full blocks each, then a partial one
    run(scheduler, old)
    run(scheduler, new)
    assert scheduler.pool.num_cached == 4 and scheduler.pool.num_free == 6
    run(scheduler, make_seq([3] * 3))  # a partial block: an unnamed free one, nothing evicted
    assert scheduler.pool.num_evictions == 0
    run(scheduler, make_seq([4] * 9))  # 3 blocks: two partial or unnamed, then the oldest prompt's tail
    assert scheduler.pool.num_evictions == 1
    for prompt, cached in (([2] * 9, 8), ([1] * 9, 4)):
        seq = make_seq(prompt)
        assert first_step_context(scheduler, seq) == cached
        scheduler.finish(seq, "abort")


def test_reset_forgets_every_prefix_and_disabled_caching_never_hits():
    scheduler = make_scheduler(num_blocks=10, block_size=4)
    run(scheduler, make_seq(list(range(9))))
    scheduler.reset_prefix_cache()
    assert scheduler.pool.num_cached == 0
    assert first_step_context(scheduler, make_seq(list(range(9)))) == 0
    disabled = make_scheduler(num_blocks=10, block_size=4, enable_prefix_caching=False)
    run(disabled, make_seq(list(range(9))))
    assert first_step_context(disabled, make_seq(list(range(9)))) == 0
    assert disabled.pool.num_cached == 0


def test_a_preempted_request_resumes_from_its_own_cached_blocks():
    scheduler = make_scheduler(num_blocks=4, block_size=4)
    seq = make_seq(list(range(10)), max_tokens=3)
    scheduler.add(seq)
    scheduler.mark_computed(scheduler.schedule())
    scheduler.running.remove(seq)  # as the decode loop does when blocks run out
    scheduler._release(seq)
    seq.status = SequenceStatus.WAITING
    scheduler.waiting.appendleft(seq)
    batch = scheduler.schedule()
    assert batch.context_lens == [8] and batch.query_lens == [2]
    assert seq.num_cached_tokens == 0  # reported for the first admission only


def test_lpm_admits_the_longest_cached_prefix_first_and_ties_in_arrival_order():
    for policy, admitted in ((FCFS, ["new"]), (LPM, ["turn", "new"])):
        scheduler = make_scheduler(num_blocks=10, block_size=4, budget=8, policy=policy)
        run(scheduler, make_seq(list(range(10)), max_tokens=3))  # 12 tokens computed: 3 named blocks
        names = {}
        for name, prompt in (("new", [50] * 9), ("turn", list(range(10)) + [7, 7]), ("later", [60] * 9)):
            names[name] = make_seq(prompt)
            scheduler.add(names[name])
        scheduler.schedule()  # 8 tokens: fcfs gives them all to "new"; lpm lets "turn" take 4 past its 8 cached
        assert [next(n for n, s in names.items() if s is seq) for seq in scheduler.running] == admitted, policy
        assert names["turn"].num_computed_tokens == (8 if policy == LPM else 0)


def test_lpm_needs_prefix_caching():
    with pytest.raises(ConfigError, match=r"--scheduling-policy lpm orders requests by their cached prefix, but "
                                          r"prefix caching is off \(--no-enable-prefix-caching\): use "
                                          r"--scheduling-policy fcfs"):
        EngineArgs("kvshard-demo-gqa", scheduling_policy=LPM, enable_prefix_caching=False).create_engine_config()
    config = EngineArgs("kvshard-demo-gqa", scheduling_policy=LPM).create_engine_config()
    assert config.scheduler.policy == LPM
    assert "longest cached prefix first (--scheduling-policy lpm)" in config.layout_report()
    assert "in arrival order" in EngineArgs("kvshard-demo-gqa").create_engine_config().layout_report()


# --- greedy outputs with and without the cache, on real ranks ------------------------------------

BLOCK = 4
KV_TOKENS = 160  # per layout: less than the workload's prompts, so cached blocks are evicted
GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=2)
STEM = [(11 * i) % 97 + 2 for i in range(22)]
TAILS = [[5], [6, 7, 8], [9, 10, 11, 12, 13, 14]]
SESSIONS = [[(3 * i) % 89 + 2 for i in range(13)], [(13 * i) % 83 + 2 for i in range(13)]]
NEW_TEXT = [[20, 21, 22, 23, 24], [30, 31, 32, 33, 34]]
TURNS = 3
UNRELATED = [[(p * i + 7) % 101 + 2 for i in range(30)] for p in (17, 19, 23, 29)]

# (model, tp, dcp, interleave); the reference of each model is tp=1 with the cache off
LAYOUTS = [
    ("kvshard-demo-gqa", 1, 1, 1), ("kvshard-demo-gqa", 2, 2, 1), ("kvshard-demo-gqa", 2, 2, BLOCK),
    ("kvshard-demo-gqa", 4, 4, 1),
    ("kvshard-demo", 1, 1, 1), ("kvshard-demo", 2, 2, 1), ("kvshard-demo", 2, 2, BLOCK), ("kvshard-demo", 4, 4, 1),
]


def make_engine(model: str, tp: int, dcp: int, interleave: int, enable_prefix_caching: bool) -> LLMEngine:
    config = EngineArgs(
        model, tensor_parallel_size=tp, decode_context_parallel_size=dcp, dcp_kv_interleave_size=interleave,
        block_size=BLOCK, max_model_len=96, num_kv_blocks=KV_TOKENS // (BLOCK * dcp), max_num_seqs=4,
        max_num_batched_tokens=16, dtype="float32",  # 16: prompts prefill in chunks that later requests hit
        enable_prefix_caching=enable_prefix_caching,
    ).create_engine_config()
    return LLMEngine(config)


class Completion:
    def __init__(self, seq: Sequence) -> None:
        self.prompt_len = len(seq.prompt_token_ids)
        self.tokens = list(seq.output_token_ids)
        self.logprobs = list(seq.output_logprobs)
        self.num_cached_tokens = seq.num_cached_tokens


def generate(engine: LLMEngine, prompts: dict[str, list[int]]) -> dict[str, Completion]:
    seqs = {}
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt, GREEDY)
        seqs[request_id] = engine.requests[request_id].seqs[0]
    while engine.has_unfinished_requests():
        engine.step()
    return {request_id: Completion(seq) for request_id, seq in seqs.items()}


def workload(engine: LLMEngine) -> dict[str, Completion]:
    """A shared-prefix batch, two multi-turn sessions side by side, then more than the cache holds
    and the first prompts again; every request's completion by name."""
    done = generate(engine, {f"stem{i}": STEM + tail for i, tail in enumerate(TAILS)})
    history = [list(prompt) for prompt in SESSIONS]
    for turn in range(TURNS):
        turns = generate(engine, {f"s{s}t{turn}": history[s] for s in range(len(SESSIONS))})
        for s in range(len(SESSIONS)):
            history[s] += turns[f"s{s}t{turn}"].tokens + NEW_TEXT[s]
        done.update(turns)
    done.update(generate(engine, {f"unrelated{i}": p for i, p in enumerate(UNRELATED)}))
    done.update(generate(engine, {"stem0 again": STEM + TAILS[0], "s0 again": history[0]}))
    return done


@pytest.fixture(scope="module")
def reference():
    made: dict[str, dict[str, Completion]] = {}

    def get(model: str) -> dict[str, Completion]:
        if model not in made:
            engine = make_engine(model, 1, 1, 1, enable_prefix_caching=False)
            try:
                made[model] = workload(engine)
                assert engine.stats().prefix_cache_hits == 0
            finally:
                engine.shutdown()
        return made[model]

    return get


@pytest.mark.parametrize("model, tp, dcp, interleave", LAYOUTS)
def test_greedy_outputs_are_the_same_with_the_cache(reference, model, tp, dcp, interleave):
    engine = make_engine(model, tp, dcp, interleave, enable_prefix_caching=True)
    try:
        got = workload(engine)
        stats = engine.stats()
        evictions = engine.pool.num_evictions
    finally:
        engine.shutdown()
    want = reference(model)
    assert got.keys() == want.keys()
    for name, completion in want.items():
        assert got[name].tokens == completion.tokens, name
        for got_step, want_step in zip(got[name].logprobs, completion.logprobs, strict=True):
            assert got_step.keys() == want_step.keys(), name
            for token, logprob in want_step.items():
                assert got_step[token] == pytest.approx(logprob, abs=2e-4), name

    per_block = BLOCK * dcp
    # the batch: the first prompt prefills in 16-token chunks; the second, admitted with its last
    # chunk, finds the first 16 tokens, and the third finds them too, or also the blocks of that chunk
    assert got["stem1"].num_cached_tokens == 16
    assert 16 <= got["stem2"].num_cached_tokens <= len(STEM) // per_block * per_block
    # each turn reuses the whole conversation so far, in full virtual blocks, but for the last answer
    # token (sampled, never computed) and the last prompt token (computed for its logits)
    for s in range(len(SESSIONS)):
        for turn in range(1, TURNS):
            before = got[f"s{s}t{turn - 1}"]
            computed = before.prompt_len + len(before.tokens) - 1
            now = got[f"s{s}t{turn}"]
            assert now.num_cached_tokens == min(computed, now.prompt_len - 1) // per_block * per_block
    assert evictions > 0 and stats.prefix_cache_hits > 0
    assert stats.kv_blocks_used == 0 and stats.kv_blocks_cached > 0
