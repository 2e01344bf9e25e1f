"""Built-in demo models: tiny random-weight checkpoints in Hugging Face format.

They are made deterministically (fixed seed, a byte-level BPE tokenizer trained
offline on the text below) the first time their name is used, saved under the
kvshard cache directory, and then loaded through the same loader as any model.
Their output is random text: they exist to run and measure the engine anywhere.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from kvshard import envs

DEMO_VERSION = "v1"
DEFAULT_DEMO_MODEL = "kvshard-demo"

_CORPUS = """\
Decode context parallelism shards the key value cache of every request along the sequence.
Each rank of a group keeps one token in N, so the same memory holds N times the tokens.
One decode step gathers the queries, attends to the local shard and merges the partial results
by their log-sum-exp, then hands every rank back its own heads.
Long prompts, short answers: an agent reads a large context and writes a few hundred tokens.
The scheduler admits requests while free blocks remain and preempts the newest when they run out.
The quick brown fox jumps over the lazy dog. Hello, world! What is the capital of France?
Paris is the capital of France. Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000.
"""
_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
_SPECIAL_TOKENS = ["<|begin|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]


def _gqa_config():
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=512, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=1, head_dim=32, max_position_embeddings=32768,
        rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=0, eos_token_id=1,
        initializer_range=0.05, architectures=["LlamaForCausalLM"],
    )


def _mla_config():
    """DeepSeek-V3 in miniature: latent attention (one latent "KV head" shared by every query
    head, so the cache splits along the sequence only) and a small MoE with grouped routing after one dense layer."""
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        vocab_size=512, hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=8, q_lora_rank=64, kv_lora_rank=128, qk_rope_head_dim=32, qk_nope_head_dim=32,
        v_head_dim=32, first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
        moe_intermediate_size=128, n_group=2, topk_group=1, max_position_embeddings=32768, rms_norm_eps=1e-6,
        tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, initializer_range=0.05,
        architectures=["DeepseekV3ForCausalLM"],
    )


# name -> config factory; "kvshard-demo" is the default model of every command
DEMO_CONFIGS = {
    "kvshard-demo-mla": _mla_config,
    "kvshard-demo-gqa": _gqa_config,
}
DEMO_ALIASES = {DEFAULT_DEMO_MODEL: "kvshard-demo-mla"}
DEMO_MODELS = [DEFAULT_DEMO_MODEL, *DEMO_CONFIGS]


def cache_dir() -> Path:
    return envs.cache_dir() / "models"


def ensure_demo_model(name: str) -> Path:
    name = DEMO_ALIASES.get(name, name)
    return cached_checkpoint(cache_dir() / f"{name}-{DEMO_VERSION}",
                             lambda staging: build_demo_model(DEMO_CONFIGS[name](), staging))


def cached_checkpoint(target: Path, build: Callable[[Path], None]) -> Path:
    """`target`, built on first use: `build` writes into a staging folder that is then renamed, so a
    reader never sees half a checkpoint and two processes building at once both end with one."""
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        build(staging)
        try:
            staging.rename(target)
        except OSError:  # another process built it first
            pass
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def train_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=_SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS.splitlines(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<|begin|>", eos_token="<|end|>")
    fast.chat_template = _CHAT_TEMPLATE
    return fast


def build_demo_model(config, directory: Path, seed: int = 0) -> None:
    """Random weights from a fixed seed, saved as a Hugging Face checkpoint with its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM

    tokenizer = train_tokenizer(config.vocab_size)
    config.bos_token_id = tokenizer.bos_token_id
    config.eos_token_id = tokenizer.eos_token_id
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
