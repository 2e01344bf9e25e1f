"""GGUF checkpoints (llama.cpp's single-file format) as Hugging Face directories.

A `.gguf` file is converted once into a cached Hugging Face checkpoint (config.json,
generation_config.json, tokenizer files with the chat template, model.safetensors in
float32) named after the file's SHA-256, so the second start reads safetensors only and
other engines can load the same directory. The tensors are dequantized by the `gguf`
library; config and tokenizer come from transformers' own GGUF support.

The cache is float32 because that loses nothing (F16 and BF16 widen exactly, and the gguf
library computes quantized blocks in float32); kvshard casts to the dtype asked for when it
loads, so one cache per file serves every dtype.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np

from kvshard.errors import ConfigError
from kvshard.models.demo import cache_dir, cached_checkpoint

# Bump when the conversion's output changes, so stale caches are not reused.
CONVERTER_VERSION = "v1"
# transformers model_type -> the architecture kvshard serves
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
# llama.cpp names Mistral models "llama" too; transformers tells them apart by general.name.
GGUF_ARCHITECTURES = ("llama", "qwen2")

_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_SHAPE_KEYS = ("block_count", "embedding_length", "feed_forward_length", "attention.head_count")
_MODEL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def find_gguf_file(path: Path) -> Path | None:
    """The .gguf a model path names: the file itself, or the only one in a directory without config.json."""
    if path.is_file():
        return path if path.suffix == ".gguf" else None
    if not path.is_dir() or (path / "config.json").exists():
        return None
    files = sorted(path.glob("*.gguf"))
    if len(files) > 1:
        raise ConfigError(
            f"directory {path} holds {len(files)} .gguf files ({', '.join(f.name for f in files)}): pass one file"
        )
    return files[0] if files else None


def file_sha256(path: Path, chunk_bytes: int = 1 << 24) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


def converted_gguf(gguf_path: Path) -> Path:
    """The cached Hugging Face directory of a .gguf file, converted on first use."""
    gguf_path = gguf_path.resolve()
    target = cache_dir() / "gguf" / f"{gguf_path.stem}-{file_sha256(gguf_path)[:16]}-{CONVERTER_VERSION}"
    return cached_checkpoint(target, lambda staging: convert_gguf(gguf_path, staging))


def convert_gguf(gguf_path: Path, directory: Path) -> None:
    """Write the Hugging Face checkpoint of a Llama-family .gguf into `directory`."""
    import torch
    from gguf import GGUFReader
    from safetensors.torch import save_file
    from tqdm import tqdm
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    reader = GGUFReader(gguf_path)
    gguf_architecture = reader.fields["general.architecture"].contents()
    if gguf_architecture not in GGUF_ARCHITECTURES:
        raise ConfigError(
            f"GGUF file {gguf_path.name} has architecture {gguf_architecture!r}; kvshard reads GGUF files of "
            f"architecture {', '.join(GGUF_ARCHITECTURES)}"
        )
    _check_dequantizable(reader, gguf_path)
    names = [_hf_tensor_name(tensor.name, gguf_path) for tensor in reader.tensors]
    # transformers would fill a missing shape key with its own default: a model of another size
    missing = [key for key in (f"{gguf_architecture}.{k}" for k in _SHAPE_KEYS) if key not in reader.fields]
    if missing:
        raise ConfigError(f"GGUF file {gguf_path.name} lacks the metadata {', '.join(missing)}")

    config = _read_with_transformers(AutoConfig, gguf_path)
    config.architectures = [ARCHITECTURES[config.model_type]]
    config.dtype = torch.float32
    # without one, kvshard still serves token-id prompts
    has_tokenizer = "tokenizer.ggml.model" in reader.fields
    tokenizer = _read_with_transformers(AutoTokenizer, gguf_path) if has_tokenizer else None

    tensors: dict[str, torch.Tensor] = {}
    progress = tqdm(zip(names, reader.tensors), total=len(names), desc=f"dequantizing {gguf_path.name}", unit="tensor")
    for name, tensor in progress:
        weights = _dequantize(tensor)
        # llama.cpp interleaves the rotary halves of each Q and K head (its rope rotates
        # adjacent pairs); Hugging Face rotates the two halves of a head.
        if gguf_architecture == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
            weights = _unpermute_rotary_rows(weights, config.num_attention_heads)
        elif gguf_architecture == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            weights = _unpermute_rotary_rows(weights, config.num_key_value_heads)
        tensors[name] = torch.from_numpy(np.array(weights))  # a copy: F32 data is a read-only map of the file

    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(directory)
    GenerationConfig.from_model_config(config).save_pretrained(directory)
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)


def _read_with_transformers(auto_class, gguf_path: Path):
    """transformers' config or tokenizer of the file; what it cannot read is a one-line error."""
    try:
        return auto_class.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    except (ValueError, KeyError, TypeError) as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ConfigError(f"transformers cannot read GGUF file {gguf_path.name}: {reason}") from None


def _check_dequantizable(reader, gguf_path: Path) -> None:
    """Fail before any work on a tensor type the gguf library cannot dequantize."""
    from gguf import GGML_QUANT_SIZES
    from gguf.quants import dequantize

    for tensor_type in sorted({t.tensor_type for t in reader.tensors}):
        _, block_bytes = GGML_QUANT_SIZES[tensor_type]
        try:
            dequantize(np.zeros((1, block_bytes), dtype=np.uint8), tensor_type)
        except NotImplementedError:
            raise ConfigError(
                f"GGUF file {gguf_path.name} stores tensors as {tensor_type.name}, which kvshard cannot dequantize; "
                f"use a file quantized as F32, F16, BF16, Q8_0, Q4_0/1, Q5_0/1 or a K-quant"
            ) from None


def _dequantize(tensor) -> np.ndarray:
    from gguf.quants import dequantize

    # GGUF lists dimensions innermost first: a [out, in] matrix has shape (in, out).
    shape = tuple(int(d) for d in reversed(tensor.shape))
    return dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False).reshape(shape)


def _hf_tensor_name(gguf_name: str, gguf_path: Path) -> str:
    stem, _, suffix = gguf_name.rpartition(".")  # suffix: weight or bias
    parts = stem.split(".")
    if len(parts) == 1 and parts[0] in _MODEL_TENSORS:
        return f"{_MODEL_TENSORS[parts[0]]}.{suffix}"
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}.{suffix}"
    raise ConfigError(f"GGUF file {gguf_path.name} has tensor {gguf_name!r}, which kvshard's Llama models do not use")


def _unpermute_rotary_rows(weights: np.ndarray, heads: int) -> np.ndarray:
    """Inverse of llama.cpp's row order per head: pairs (0, d/2), (1, d/2 + 1), ... back to halves."""
    rows = weights.shape[0]
    # [heads, d/2, 2, ...] -> [heads, 2, d/2, ...]
    return weights.reshape(heads, rows // heads // 2, 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)


def resolve_gguf(model: str | os.PathLike) -> Path | None:
    """The converted directory when `model` names a GGUF checkpoint (a file, a directory, a known name)."""
    from kvshard.models.fetch import GGUF_MODELS, fetch_gguf_model

    if str(model) in GGUF_MODELS:
        return converted_gguf(fetch_gguf_model(str(model)))
    gguf_file = find_gguf_file(Path(model).expanduser())
    return None if gguf_file is None else converted_gguf(gguf_file)
