"""Batch invariance: with `batch_invariant=True` a greedy request gets the same tokens and
log-probabilities, bit for bit, alone or inside any batch (docs/serving.md, "Batch invariance").

Run by hand for the full-size server check (128 concurrent clients, several runs):
    python tests/test_batch_invariance.py --clients 128 --runs 3
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from conftest import environment
from kvshard import LLM, SamplingParams
from kvshard.config import SchedulerConfig
from kvshard.engine.scheduler import Scheduler
from kvshard.engine.sequence import Sequence
from kvshard.kv.block_pool import BlockPool
from kvshard.kv.layout import DCPLayout
from kvshard.layers.batch_invariant import ROW_TILE, batch_invariant_active, batch_invariant_mode

linear = torch.nn.functional.linear


# --- the matrix products ---------------------------------------------------------------------

def first_row_for_each_batch(x: torch.Tensor, product) -> list[torch.Tensor]:
    """product's row for x[0], computed with 1 .. len(x) rows in the call, and with x[0] at the last position."""
    results = [product(x[:rows])[0] for rows in range(1, x.shape[0] + 1)]
    return results + [product(torch.cat([x[1:], x[:1]]))[-1]]


@pytest.mark.parametrize("case", ["linear", "linear+bias", "einsum"])
def test_in_the_mode_a_rows_product_does_not_depend_on_the_other_rows(case):
    torch.manual_seed(0)
    weight, bias, heads = torch.randn(768, 256), torch.randn(768), torch.randn(4, 32, 128)
    product, x = {
        "linear": (lambda x: linear(x, weight), torch.randn(2 * ROW_TILE + 5, 256)),
        "linear+bias": (lambda x: linear(x, weight, bias), torch.randn(2 * ROW_TILE + 5, 256)),
        "einsum": (lambda x: torch.einsum("thn,hnc->thc", x, heads), torch.randn(2 * ROW_TILE + 5, 4, 32)),  # MLA
    }[case]
    with torch.inference_mode(), batch_invariant_mode():
        rows = first_row_for_each_batch(x, product)
    assert all(torch.equal(row, rows[0]) for row in rows)
    assert torch.allclose(rows[0], product(x[:1])[0], rtol=1e-5, atol=1e-5)  # still the same product


def test_without_the_mode_a_rows_product_depends_on_how_many_rows_run():
    """The root cause on CPU BLAS (oneDNN / MKL): blocking chosen from the whole product's shape."""
    torch.manual_seed(0)
    weight, x = torch.randn(768, 256), torch.randn(40, 256)
    with torch.inference_mode():
        rows = first_row_for_each_batch(x, lambda x: linear(x, weight))
    assert any(not torch.equal(row, rows[0]) for row in rows)


def test_the_mode_holds_only_inside_its_block():
    assert not batch_invariant_active()
    with batch_invariant_mode():
        assert batch_invariant_active()
    with batch_invariant_mode(enabled=False):
        assert not batch_invariant_active()
    assert not batch_invariant_active()


# --- the scheduler's prompt chunks -----------------------------------------------------------------

def prompt_chunks(fixed_chunks: bool, others: int) -> list[int]:
    """The chunks a 300-token prompt is computed in, arriving while `others` requests decode."""
    scheduler = Scheduler(SchedulerConfig(8, 128, 4096), BlockPool(1000), DCPLayout(4, 1, 1),
                          enable_prefix_caching=False, fixed_chunks=fixed_chunks)

    def step() -> list[tuple[Sequence, int]]:
        batch = scheduler.schedule()
        scheduler.mark_computed(batch)
        for seq, sampled in zip(batch.seqs, batch.sample):
            if sampled:
                seq.output_token_ids.append(3)
        return list(zip(batch.seqs, batch.query_lens))

    for i in range(others):
        scheduler.add(Sequence(f"d{i}", i, [5] * (10 + 37 * i), SamplingParams(max_tokens=100), None))
    while scheduler.waiting or any(s.num_uncomputed_tokens > 1 for s in scheduler.running):
        step()
    prompt = Sequence("p", others, [7] * 300, SamplingParams(max_tokens=1), None)
    scheduler.add(prompt)
    chunks: list[int] = []
    while prompt.num_computed_tokens < 300:
        chunks += [n for seq, n in step() if seq is prompt]
    return chunks


def test_fixed_chunks_cut_a_prompt_the_same_whatever_else_runs():
    assert prompt_chunks(True, others=0) == prompt_chunks(True, others=3) == [120, 120, 60]  # 128 - 8 seqs
    assert prompt_chunks(False, others=0) != prompt_chunks(False, others=3)


# --- a real engine: tp=2, dcp=2, alone vs in a mixed batch ---------------------------------------------

def mixed_prompts(count: int, seed: int = 0) -> list[list[int]]:
    """Token ids of many lengths (3 .. 300): contexts of different lengths, one prompt longer than a chunk."""
    rng = random.Random(seed)
    lengths = [rng.choice([3, 9, 17, 40, 75, 130, 300]) for _ in range(count)]
    return [[rng.randrange(2, 500) for _ in range(n)] for n in lengths]


def alone_and_batched(batch_invariant: bool, model: str = "kvshard-demo", until_one_differs: bool = False
                      ) -> tuple[list, list]:
    """(outputs one request at a time, outputs of all at once) for the same greedy requests;
    `until_one_differs`: the requests alone stop at the first whose output differs from its batched one."""
    prompts = mixed_prompts(12)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1)
    # decode groups of at most 8 tokens of context spread: these lengths span several groups
    with environment({"KVSHARD_DECODE_GROUP_SPREAD": "8"}), \
            LLM(model, tensor_parallel_size=2, dcp=2, batch_invariant=batch_invariant, enable_prefix_caching=False,
                max_model_len=512, block_size=4, max_num_batched_tokens=256) as llm:
        batched = llm.generate(prompts, params, use_tqdm=False)
        alone = []
        for prompt, in_batch in zip(prompts, batched):
            alone.append(llm.generate([prompt], params, use_tqdm=False)[0])
            if until_one_differs and tokens_and_logprobs(alone[-1:]) != tokens_and_logprobs([in_batch]):
                return alone, batched[:len(alone)]
    return alone, batched


def tokens_and_logprobs(outputs) -> list[tuple[list[int], list[dict[int, float]]]]:
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]


def test_greedy_tokens_and_logprobs_are_bit_identical_alone_and_in_a_mixed_batch():
    alone, batched = alone_and_batched(batch_invariant=True)
    assert tokens_and_logprobs(batched) == tokens_and_logprobs(alone)  # float equality: every bit


def test_without_the_mode_logprobs_depend_on_the_batch():
    """What the mode fixes: on CPU BLAS the same requests' log-probabilities differ in their last bits."""
    alone, batched = alone_and_batched(batch_invariant=False, until_one_differs=True)
    assert tokens_and_logprobs(batched) != tokens_and_logprobs(alone)


# --- the real server: concurrent clients vs one at a time ------------------------------------------

def server_prompts(count: int) -> list[str]:
    rng = random.Random(1)
    words = "decode context parallelism shards the key value cache of every request along the sequence".split()
    return [f"Client {i}: " + " ".join(rng.choice(words) for _ in range(rng.randrange(1, 60))) for i in range(count)]


def start_server(log_path: Path):
    """`kvshard serve --batch-invariant` at tp=2, dcp=2."""
    from server_harness import SERVE_ARGS, Server

    return Server([*SERVE_ARGS, "--batch-invariant", "--max-num-seqs", "64"], log_path)


def concurrent_vs_one_at_a_time(server, clients: int, runs: int, max_tokens: int = 32) -> list[int]:
    """For each run, how many of `clients` concurrent greedy completions (text and logprobs) from a
    --batch-invariant server differ from the same prompts sent one at a time."""
    from server_harness import MODEL

    prompts = server_prompts(clients)
    request = dict(model=MODEL, max_tokens=max_tokens, temperature=0, logprobs=1, extra_body={"ignore_eos": True})

    def result(choice) -> tuple[str, list[float]]:
        return choice.text, choice.logprobs.token_logprobs

    client = server.client()
    one_at_a_time = [result(client.completions.create(prompt=p, **request).choices[0]) for p in prompts]

    async def all_at_once():
        async with server.async_client() as aclient:
            answers = await asyncio.gather(*(aclient.completions.create(prompt=p, **request) for p in prompts))
        return [result(a.choices[0]) for a in answers]

    differing = []
    for _ in range(runs):
        concurrent = asyncio.run(all_at_once())
        differing.append(sum(c != o for c, o in zip(concurrent, one_at_a_time)))
    return differing


@pytest.fixture(scope="module", autouse=True)
def server_started(tmp_path_factory) -> Iterator[Future]:
    """The server test's server, started in the background as the module begins, while the engine tests run."""
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with ThreadPoolExecutor(1) as pool:
        start = pool.submit(start_server, log)
        yield start
    if start.exception() is None:
        server = start.result()
        assert server.stop() == 0, server.log


def test_32_concurrent_greedy_clients_equal_one_at_a_time_in_every_run(server_started):
    # 16 new tokens each: the one-at-a-time pass (32 x 16 steps) is most of the cost; every one of the
    # 512 greedy positions is still compared, computed in batches of requests of different lengths
    assert concurrent_vs_one_at_a_time(server_started.result(), clients=32, runs=2, max_tokens=16) == [0, 0]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="concurrent greedy clients vs one at a time, --batch-invariant")
    parser.add_argument("--clients", type=int, default=128)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).parent))
    with tempfile.TemporaryDirectory() as log_dir:
        server = start_server(Path(log_dir) / "serve.log")
        try:
            differing = concurrent_vs_one_at_a_time(server, args.clients, args.runs)
        finally:
            assert server.stop() == 0, server.log
    print(f"{args.clients} concurrent greedy clients, tp=2, dcp=2, --batch-invariant: "
          f"outputs different from one at a time, per run: {differing}")
    sys.exit(1 if any(differing) else 0)
