"""Range checks of SamplingParams, and the sampler at the extremes of what they let through (no processes)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from kvshard.engine.sampler import _filtered_probs
from kvshard.entrypoints.openai_server import APIError, _deltas, _merged
from kvshard.outputs import CompletionOutput, RequestOutput
from kvshard.sampling_params import INT64_MAX, SamplingParams


@pytest.mark.parametrize("field, value", [
    ("temperature", float("inf")), ("temperature", float("nan")), ("temperature", 10**400), ("temperature", -1e-9),
    ("top_p", 0.0), ("top_p", 1.0 + 1e-9), ("top_p", float("nan")),
    ("top_k", -2), ("top_k", INT64_MAX + 1),
    ("seed", INT64_MAX + 1), ("seed", 2**64), ("seed", 1.5),
    ("max_tokens", 0), ("max_tokens", INT64_MAX + 1), ("n", 0), ("n", True),
    ("logprobs", -1), ("logprobs", 21),
    ("stop", [""]), ("stop", ["x"] * 65), ("stop", ["x" * 1025]), ("stop_token_ids", [-1]),
    ("stop", 5), ("stop_token_ids", 5),
])
def test_out_of_range_value_is_refused_naming_its_field(field, value):
    with pytest.raises(ValueError) as refused:
        SamplingParams(**{field: value})
    assert str(refused.value).split()[0] == field


@pytest.mark.parametrize("extreme", [
    dict(top_p=1e-300), dict(top_p=5e-45), dict(temperature=1e-300), dict(temperature=1e300),
    dict(temperature=1e-45, top_p=1e-40, top_k=1), dict(top_k=INT64_MAX),
])
def test_extreme_legal_values_give_a_distribution(extreme):
    logits = torch.randn(4, 64, generator=torch.Generator().manual_seed(0)) * 10  # [b, V]
    probs = _filtered_probs(logits, [SamplingParams(**extreme)] * 4)
    assert torch.isfinite(probs).all() and (probs >= 0).all()
    assert torch.allclose(probs.sum(dim=-1), torch.ones(4))
    if extreme.get("top_p", 1) < 1e-10 or extreme.get("temperature", 1) < 1e-10:
        # nothing but the top token is left
        assert (probs.argmax(dim=-1) == logits.argmax(dim=-1)).all() and (probs.max(dim=-1).values == 1).all()


# --- behind the door: one failed request, one unread stream (a stand-in engine, no processes) ---------

class _Engine:
    """Yields cumulative outputs of one choice, one token more each time, as AsyncLLMEngine does."""

    def __init__(self, num_tokens: int, error_at: int | None = None) -> None:
        self.num_tokens, self.error_at = num_tokens, error_at
        self.aborted: list[str] = []

    async def generate(self, request_id, prompt, params, stream):
        finished = False
        try:
            for n in range(1, self.num_tokens + 1):
                failed = n == self.error_at
                finished = failed or n == self.num_tokens
                reason = "error" if failed else "length" if finished else None
                yield RequestOutput(request_id, None, prompt, [CompletionOutput(0, "x" * n, list(range(n)), reason)],
                                    finished, error="sampling failed: bad row" if failed else None)
                await asyncio.sleep(0)
                if finished:
                    return
        finally:
            if not finished:
                self.aborted.append(request_id)


def test_a_request_that_fails_alone_is_a_500_naming_the_reason():
    async def run():
        async for _ in _merged(_Engine(8, error_at=3), "r", [[1]], SamplingParams(), True):
            pass

    with pytest.raises(APIError) as failed:
        asyncio.run(run())
    assert failed.value.status == 500 and "sampling failed: bad row" in failed.value.message


def test_a_stream_that_is_not_read_is_aborted_past_its_backlog():
    engine, cut = _Engine(10_000), asyncio.Event()

    async def run():
        async for _ in _merged(engine, "r", [[1]], SamplingParams(), True, max_backlog=50, cut=cut):
            await cut.wait()  # a consumer stuck writing to a client that does not read

    with pytest.raises(Exception, match="stopped reading, 51 tokens behind"):
        asyncio.run(run())
    assert cut.is_set() and engine.aborted == ["r-0"]


def test_a_slow_reader_gets_every_token_and_is_not_aborted():
    engine = _Engine(300)

    async def run() -> list[int]:
        seen = []
        async for _, output in _merged(engine, "r", [[1]], SamplingParams(), True, max_backlog=50):
            seen.append(len(output.outputs[0].token_ids))
            for _ in range(5):
                await asyncio.sleep(0)  # slower than the engine, yet outputs wait coalesced
        return seen

    seen = asyncio.run(run())
    assert seen[-1] == 300 and seen == sorted(seen) and len(seen) < 300 and not engine.aborted


@pytest.mark.parametrize("interval, counts", [(1, [1] * 10), (4, [1, 4, 4, 1]), (3, [1, 3, 3, 3]), (50, [1, 9])])
def test_a_stream_interval_gathers_tokens_after_the_first(interval, counts):
    # --stream-interval: the first token at once, then an event per `interval` tokens, and the rest when it ends
    async def run() -> list:
        return [delta async for delta in _deltas(_Engine(10), "r", [[1]], SamplingParams(), 50, asyncio.Event(),
                                                 interval)]

    deltas = asyncio.run(run())
    assert [len(d.token_ids) for d in deltas] == counts
    assert "".join(d.text for d in deltas) == "x" * 10
    assert [d.token_ids for d in deltas][-1][-1] == 9 and sum((d.token_ids for d in deltas), []) == list(range(10))
    assert [d.finish_reason for d in deltas] == [None] * (len(counts) - 1) + ["length"]
