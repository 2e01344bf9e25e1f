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
import re
from pathlib import Path

import numpy as np

from kvshard.errors import ConfigError
from kvshard.models.demo import cache_dir, cached_checkpoint

# Bump when the conversion's output changes, so stale caches are not reused.
CONVERTER_VERSION = "v2"
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
# llama.cpp's rope frequency factors (Llama 3.1 and later): read into the config, not a weight
_ROPE_FREQS = "rope_freqs.weight"
# the shards of a split file, as llama.cpp's gguf-split names them
_SHARD_NAME = re.compile(r"^(?P<prefix>.+)-(?P<index>\d{5})-of-(?P<count>\d{5})\.gguf$")
# Tokens that end a turn besides the file's EOS: llama.cpp stops on these as well (when the file marks them as
# control or user-defined tokens), so a file whose EOS is <|end_of_text|> still ends a chat turn at <|eot_id|>.
_END_OF_GENERATION_TEXTS = frozenset({
    "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>", "<|im_end|>", "<|endoftext|>", "<|end|>", "<end_of_turn>",
    "<|return|>", "<|call|>", "<EOT>", "_<EOT>",
})
# rope scaling of the file's metadata (`{arch}.rope.scaling.*`) that kvshard reads, by llama.cpp's type name
_ROPE_SCALING_TYPES = ("none", "linear", "yarn")


def find_gguf_file(path: Path) -> Path | None:
    """The .gguf a model path names: the file itself, or the only one in a directory without config.json."""
    if path.is_file():
        return path if path.suffix == ".gguf" else None
    if not path.is_dir() or (path / "config.json").exists():
        return None
    files = sorted(path.glob("*.gguf"))
    shard_sets = {m["prefix"] + m["count"] for f in files if (m := _SHARD_NAME.match(f.name))}
    if len(files) > 1 and len(shard_sets) == 1 and all(_SHARD_NAME.match(f.name) for f in files):
        return files[0]  # the shards of one split file: gguf_shards checks that they are all there
    if len(files) > 1:
        raise ConfigError(
            f"directory {path} holds {len(files)} .gguf files ({', '.join(f.name for f in files)}): pass one file"
        )
    return files[0] if files else None


def file_sha256(*paths: Path, chunk_bytes: int = 1 << 24) -> str:
    """SHA-256 of the files' bytes one after the other (one file: its own SHA-256)."""
    digest = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as f:
            while chunk := f.read(chunk_bytes):
                digest.update(chunk)
    return digest.hexdigest()


def gguf_shards(gguf_path: Path) -> list[Path]:
    """The files of a checkpoint: the file itself, or every shard of a split file (`NAME-00001-of-00003.gguf`,
    any of whose shards names it), first to last."""
    match = _SHARD_NAME.match(gguf_path.name)
    if match is None:
        return [gguf_path]
    count = int(match["count"])
    shards = [gguf_path.with_name(f"{match['prefix']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    missing = [shard.name for shard in shards if not shard.is_file()]
    if missing:
        raise ConfigError(f"split GGUF file {shards[0].name} lacks its shard(s) {', '.join(missing)} beside it")
    return shards


def converted_gguf(gguf_path: Path) -> Path:
    """The cached Hugging Face directory of a .gguf file (or of a split file's shards), converted on first use."""
    shards = gguf_shards(gguf_path.resolve())
    match = _SHARD_NAME.match(shards[0].name)
    stem = match["prefix"] if len(shards) > 1 and match else shards[0].stem
    target = cache_dir() / "gguf" / f"{stem}-{file_sha256(*shards)[:16]}-{CONVERTER_VERSION}"
    return cached_checkpoint(target, lambda staging: convert_gguf(shards[0], staging))


def convert_gguf(gguf_path: Path, directory: Path) -> None:
    """Write the Hugging Face checkpoint of a Llama-family .gguf (a split file: its first shard) into `directory`."""
    import torch
    from safetensors.torch import save_file
    from tqdm import tqdm
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    shards = gguf_shards(gguf_path)
    readers = [_open_reader(shard) for shard in shards]
    reader = readers[0]  # llama.cpp's gguf-split keeps all metadata in the first shard
    if "general.architecture" not in reader.fields:
        raise ConfigError(f"GGUF file {gguf_path.name} has no general.architecture: it is not a model checkpoint, "
                          "or not the first shard of a split file")
    declared = reader.fields["split.count"].contents() if "split.count" in reader.fields else 1
    if declared != len(shards):
        raise ConfigError(f"GGUF file {gguf_path.name} is shard 1 of {declared} (split.count) but was found as "
                          f"{len(shards)} file(s): pass the first shard, named NAME-00001-of-{declared:05d}.gguf")
    gguf_architecture = reader.fields["general.architecture"].contents()
    if gguf_architecture not in GGUF_ARCHITECTURES:
        raise ConfigError(
            f"GGUF file {gguf_path.name} has architecture {gguf_architecture!r}; kvshard reads GGUF files of "
            f"architecture {', '.join(GGUF_ARCHITECTURES)}"
        )
    gguf_tensors = [tensor for shard_reader in readers for tensor in shard_reader.tensors]
    _check_dequantizable(gguf_tensors, gguf_path)
    rope_freqs = [tensor for tensor in gguf_tensors if tensor.name == _ROPE_FREQS]
    gguf_tensors = [tensor for tensor in gguf_tensors if tensor.name != _ROPE_FREQS]
    names = [_hf_tensor_name(tensor.name, gguf_path) for tensor in gguf_tensors]
    # transformers would fill a missing shape key with its own default: a model of another size
    missing = [key for key in (f"{gguf_architecture}.{k}" for k in _SHAPE_KEYS) if key not in reader.fields]
    if missing:
        raise ConfigError(f"GGUF file {gguf_path.name} lacks the metadata {', '.join(missing)}")

    config = _read_with_transformers(AutoConfig, gguf_path)
    config.architectures = [ARCHITECTURES[config.model_type]]
    config.dtype = torch.float32
    # transformers looks for the output matrix in the first shard only
    config.tie_word_embeddings = "lm_head.weight" not in names
    if config.model_type == "mistral":
        # llama.cpp runs these files as `llama`, with no sliding window, and the file names none
        config.sliding_window = None
    _read_rope_scaling(reader, gguf_architecture, config, rope_freqs, gguf_path)
    # without one, kvshard still serves token-id prompts
    has_tokenizer = "tokenizer.ggml.model" in reader.fields
    tokenizer = _read_with_transformers(AutoTokenizer, gguf_path) if has_tokenizer else None

    tensors: dict[str, torch.Tensor] = {}
    progress = tqdm(zip(names, gguf_tensors), total=len(names), desc=f"dequantizing {gguf_path.name}", unit="tensor")
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
    generation = GenerationConfig.from_model_config(config)
    if has_tokenizer and (stops := _end_of_generation_ids(reader, config.eos_token_id)):
        generation.eos_token_id = stops
    generation.save_pretrained(directory)
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)


def _read_with_transformers(auto_class, gguf_path: Path):
    """transformers' config or tokenizer of the file; what it cannot read is a one-line error."""
    try:
        return auto_class.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    except (ValueError, KeyError, TypeError) as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ConfigError(f"transformers cannot read GGUF file {gguf_path.name}: {reason}") from None


def _open_reader(path: Path):
    """The gguf library's reader of the file (it maps every tensor's data, so a truncated file fails here too);
    a damaged file is a one-line error."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
    except Exception as error:  # the reader fails with whatever a damaged header leads it to (ValueError, IndexError, ...)
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ConfigError(f"GGUF file {path.name} cannot be read ({reason}): it is truncated or corrupt") from None
    return reader


def _read_rope_scaling(reader, architecture: str, config, rope_freqs: list, gguf_path: Path) -> None:
    """The file's rope scaling into `config.rope_parameters` (transformers' reading of the metadata skips it):
    `{arch}.rope.scaling.*` keys (linear, YaRN), or llama.cpp's `rope_freqs` tensor of Llama 3.1 and later."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    prefix = f"{architecture}.rope.scaling."

    def value(key: str, default=None):
        field = reader.fields.get(prefix + key)
        return default if field is None else field.contents()

    scaling = value("type", "none")
    if scaling not in _ROPE_SCALING_TYPES:
        raise ConfigError(f"GGUF file {gguf_path.name} has {prefix}type={scaling!r}; kvshard reads rope scaling "
                          f"{', '.join(_ROPE_SCALING_TYPES)} and Llama 3's rope_freqs")
    unread = sorted(key[len(prefix):] for key in reader.fields if key.startswith(prefix)
                    and key[len(prefix):] not in ("type", "factor", "original_context_length", "finetuned",
                                                  "yarn_beta_fast", "yarn_beta_slow"))
    if unread:
        raise ConfigError(f"GGUF file {gguf_path.name} has rope scaling settings kvshard does not read: "
                          f"{', '.join(prefix + key for key in unread)}")
    factor = value("factor")
    if scaling != "none" and factor is None:
        raise ConfigError(f"GGUF file {gguf_path.name} has {prefix}type={scaling!r} but no {prefix}factor")
    if scaling == "linear":
        params.update(rope_type="linear", factor=float(factor))
    elif scaling == "yarn":
        params.update(rope_type="yarn", factor=float(factor))
        if (original := value("original_context_length")) is not None:
            params["original_max_position_embeddings"] = int(original)
        for key, name in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            if (beta := value(key)) is not None:
                params[name] = float(beta)
    if rope_freqs:
        if scaling != "none":
            raise ConfigError(f"GGUF file {gguf_path.name} has both {prefix}type={scaling!r} and {_ROPE_FREQS}")
        params.update(_llama3_rope_parameters(rope_freqs[0], config, params["rope_theta"], gguf_path))
    config.rope_parameters = params


def _llama3_rope_parameters(tensor, config, theta: float, gguf_path: Path) -> dict:
    """Llama 3's rope scaling whose frequency divisors are the file's `rope_freqs` (llama.cpp's converter writes
    them from factor, low_freq_factor, high_freq_factor and original_max_position_embeddings): the largest
    divisor is the factor; the others are Llama 3.1's and 3.2's, checked by computing the divisors back."""
    import copy

    import torch
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    divisors = _dequantize(tensor).astype(np.float64).reshape(-1)
    params = dict(rope_type="llama3", factor=float(divisors.max()), low_freq_factor=1.0, high_freq_factor=4.0,
                  original_max_position_embeddings=8192)
    trial = copy.deepcopy(config)
    trial.rope_parameters = dict(rope_theta=theta, **params)
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](trial, torch.device("cpu"))
    dim = 2 * scaled.numel()
    plain = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    if divisors.shape != (dim // 2,) or not np.allclose(plain / scaled.double().numpy(), divisors, rtol=1e-4):
        raise ConfigError(
            f"GGUF file {gguf_path.name} has a {_ROPE_FREQS} tensor of {divisors.size} values that is not Llama 3's "
            f"rope scaling with low_freq_factor 1, high_freq_factor 4 and original context 8192; kvshard reads only that")
    return params


def _end_of_generation_ids(reader, eos_token_id) -> list[int]:
    """EOS, the file's end-of-turn and end-of-message tokens, and the special tokens llama.cpp ends generation
    on (`_END_OF_GENERATION_TEXTS`), when they are more than EOS alone."""
    ids = [] if eos_token_id is None else list(eos_token_id) if isinstance(eos_token_id, list) else [eos_token_id]
    for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        if key in reader.fields and (token := int(reader.fields[key].contents())) not in ids:
            ids.append(token)
    if "tokenizer.ggml.tokens" in reader.fields and "tokenizer.ggml.token_type" in reader.fields:
        tokens = reader.fields["tokenizer.ggml.tokens"].contents()
        types = reader.fields["tokenizer.ggml.token_type"].contents()
        for token, (text, kind) in enumerate(zip(tokens, types)):
            if kind in (3, 4) and text in _END_OF_GENERATION_TEXTS and token not in ids:  # control, user-defined
                ids.append(token)
    return ids if len(ids) > 1 else []


def _check_dequantizable(gguf_tensors: list, gguf_path: Path) -> None:
    """Fail before any work on a tensor type the gguf library cannot dequantize."""
    from gguf import GGML_QUANT_SIZES
    from gguf.quants import dequantize

    for tensor_type in sorted({t.tensor_type for t in gguf_tensors}):
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
