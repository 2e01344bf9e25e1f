"""Shared fixtures: tiny Hugging Face checkpoints made here (random weights, fixed seed)."""

from __future__ import annotations

import glob
import os
from pathlib import Path

import pytest

# Built-in demo models go to a per-session cache, never to the user's home.
os.environ.setdefault("KVSHARD_CACHE_DIR", str(Path(__file__).parent.parent / ".pytest_cache" / "kvshard"))


@pytest.fixture(scope="session", autouse=True)
def no_shared_memory_left_behind():
    """Every shared-memory segment the ranks create is unlinked once mapped, also when a run fails."""
    before = set(glob.glob("/dev/shm/kvshard-*"))
    yield
    left = set(glob.glob("/dev/shm/kvshard-*")) - before
    assert not left, f"shared-memory segments left behind: {sorted(left)}"


def save_hf_checkpoint(config, directory: Path, seed: int = 0) -> Path:
    """Random weights from `seed`, written with transformers' own save_pretrained."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.eos_token_id = None  # greedy references run to max_new_tokens
    model.save_pretrained(directory)
    return directory


def hf_greedy(directory: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Reference continuations from transformers' generate, one prompt at a time."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    outputs = []
    for prompt in prompts:
        ids = model.generate(
            torch.tensor([prompt]), max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
            do_sample=False, pad_token_id=0,
        )
        outputs.append(ids[0, len(prompt):].tolist())
    return outputs


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """Factory: checkpoints(name, config) -> directory, made once per session."""
    made: dict[str, Path] = {}

    def make(name: str, config) -> Path:
        if name not in made:
            made[name] = save_hf_checkpoint(config, tmp_path_factory.mktemp(name))
        return made[name]

    return make
