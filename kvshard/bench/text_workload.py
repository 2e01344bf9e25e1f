"""The `repeat` workload: chat requests that ask a real model to repeat or lightly edit a passage.

Speculation by prompt lookup (`{"method": "ngram"}`) pays where the answer
copies spans of the prompt: quoting a document, editing code, summarising with
the source's own words. Random token ids never do, so this workload gives the
model real English to copy. Each request is the model's chat template around
one instruction and one of the passages below (original text about this
project), in a fixed order; its output length is the passage's token count
plus a margin, generated in full (`ignore_eos`) as in every workload here, so
runs with and without speculation produce the same number of tokens.

Unlike the token-id workloads this one needs the model's tokenizer (its chat
template and vocabulary).
"""

from __future__ import annotations

from pathlib import Path

from kvshard.bench.workloads import BenchRequest

REPEAT = "repeat"

INSTRUCTIONS = (
    "Repeat the following text exactly, word for word:\n\n{passage}",
    "Copy the following text, changing nothing but the first word of each sentence to upper case:\n\n{passage}",
)
OUTPUT_MARGIN = 16  # tokens beyond the passage's own length

PASSAGES = (
    "Decode context parallelism splits the key and value cache of every request along the sequence. Each rank "
    "of a group holds one slice of the tokens, computes attention over its slice only, and returns a partial "
    "output together with the log of its softmax denominator. The partial outputs are then merged exactly, as "
    "if one rank had read the whole context.",
    "A long conversation with an agent resends the same history at every turn. The history grows by the "
    "answer and by whatever the tools returned, and the question at the end is short. A serving engine that "
    "remembers the blocks of earlier prompts only computes the new part, which turns most of each turn's "
    "prefill into a lookup.",
    "The scheduler admits a waiting request when its prompt fits in the free blocks with room to spare for "
    "the requests that are already running. When the cache runs out, the newest running request is "
    "preempted: its blocks are freed and it is computed again later, so that no request is ever lost.",
    "Speculative decoding proposes a few tokens cheaply and lets the large model check all of them in one "
    "step. Every proposed token that the large model would have chosen itself is kept, and the first one it "
    "rejects is replaced by its own choice, so greedy answers are exactly the same as without speculation.",
    "A memory-bound decode step reads every weight of the model and the whole cached context of every "
    "request in the batch. The time it takes cannot be shorter than those bytes divided by the bandwidth of "
    "the memory, and that floor is the first number to compare a measured step against.",
    "Tensor parallelism splits each weight matrix across the ranks of a group, so that every rank computes a "
    "part of each layer and an all-reduce adds the parts together. It divides the weights, but with few key "
    "and value heads it cannot divide the cache, and that is where the sequence dimension helps.",
    "An interleave of one places consecutive tokens on consecutive ranks; a larger interleave keeps runs of "
    "tokens together on one rank before moving to the next. Both hold the same number of tokens per rank to "
    "within one run, and both give the same answers, because the merge does not care where a token lives.",
    "Disaggregated serving runs the prefill of a request on one set of machines and its decode on another. "
    "The cache computed by the first set travels to the second, which may shard it in a different way, and "
    "each token goes straight from the rank that holds it to the rank that will own it.",
)


def repeat_requests(model_path: Path, num: int) -> list[BenchRequest]:
    """`num` requests: request i asks for instruction i % 2 applied to passage i % len(PASSAGES)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    if not tokenizer.chat_template:
        raise ValueError(f"the repeat workload needs a chat model: {model_path} has no chat template")
    requests = []
    for i in range(num):
        passage = PASSAGES[i % len(PASSAGES)]
        chat = [{"role": "user", "content": INSTRUCTIONS[i % len(INSTRUCTIONS)].format(passage=passage)}]
        prompt = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
        if not isinstance(prompt, list):  # transformers 5 returns a BatchEncoding
            prompt = prompt["input_ids"]
        requests.append(BenchRequest(list(prompt), len(tokenizer.encode(passage)) + OUTPUT_MARGIN))
    return requests


def describe_repeat(num: int) -> str:
    return (f"repeat: {num} chat requests asking to repeat or lightly edit one of {len(PASSAGES)} passages "
            f"(output: the passage's length + {OUTPUT_MARGIN} tokens)")
