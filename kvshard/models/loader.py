"""Load a Hugging Face checkpoint (safetensors or PyTorch `.bin`, one file or many) into a TP-sharded model.

The files read are those an index (model.safetensors.index.json, pytorch_model.bin.index.json) names where
there is one, else every *.safetensors file, else every pytorch_model*.bin (`checkpoint_files`): a directory
may hold other copies of the same weights (Mistral's consolidated.safetensors, say). Each parameter's own
`weight_loader` cuts this rank's slice; checkpoint names of
projections that kvshard fuses (q/k/v, gate/up) are mapped by the model's
`packed_modules`. Every parameter must be filled exactly: a missing tensor is an error.
FP8 block-scaled weights are dequantized whole before any slicing (`quantization.py`).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from kvshard.errors import ConfigError
from kvshard.models.quantization import Fp8BlockQuantization, QuantizedCheckpoint

# Buffers some checkpoints carry that kvshard recomputes.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq", ".k_scale", ".v_scale", ".kv_scale")  # KV scales: kv/cache.py


def checkpoint_to_parameter(name: str, packed_modules: dict[str, tuple[str, object]]) -> tuple[str, object]:
    for checkpoint_part, (fused_part, shard_id) in packed_modules.items():
        token = f".{checkpoint_part}."
        if token in name:
            return name.replace(token, f".{fused_part}."), shard_id
    return name, None


# (file pattern, the index that names the shards) in the order kvshard looks for them
WEIGHT_FORMATS = (("*.safetensors", "model.safetensors.index.json"), ("pytorch_model*.bin", "pytorch_model.bin.index.json"))


def checkpoint_files(path: Path) -> list[Path]:
    """The weight files of the checkpoint at `path`: the shards its index names (every one must be there), else
    every *.safetensors file, else every pytorch_model*.bin file; [] if it has none."""
    for pattern, index_name in WEIGHT_FORMATS:
        index = path / index_name
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                names = sorted(set(weight_map.values()))
                if not names or not all(isinstance(name, str) and "/" not in name for name in names):
                    raise ValueError("its weight_map names no files of the directory")
            except (UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as error:
                raise ConfigError(f"{index} cannot be read ({error}); the checkpoint is corrupt: download it again") \
                    from None
            absent = [name for name in names if not (path / name).is_file()]
            if absent:
                raise ConfigError(f"{index} names {len(absent)} weight files missing from {path}, e.g. {absent[0]}; "
                                  "the download is incomplete: fetch the checkpoint again")
            return [path / name for name in names]
        files = sorted(path.glob(pattern))
        if files:
            return files
    return []


def _load_bin(file: Path) -> dict[str, torch.Tensor]:
    """A PyTorch `.bin` state dict, memory-mapped, tensors only (`weights_only`: no code runs)."""
    try:
        try:
            state = torch.load(str(file), map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as error:  # the legacy (pre-zip) format cannot be memory-mapped: read it whole
            if "mmap" not in str(error):
                raise
            state = torch.load(str(file), map_location="cpu", weights_only=True)
    except Exception as error:  # pickle, zipfile and torch errors alike
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise ConfigError(f"{file} is not a readable PyTorch checkpoint ({reason}); download it again") from None
    if not isinstance(state, dict) or not all(isinstance(t, torch.Tensor) for t in state.values()):
        raise ConfigError(f"{file} does not hold a state dict of tensors; it is not a Hugging Face weight file")
    return state


def check_checkpoint_files(path: Path) -> dict[str, tuple[Path, list[int]]]:
    """Read only the headers of every *.safetensors file (`checkpoint_files`): a truncated or corrupt one is a
    ConfigError naming the file, before any rank starts (the format: an 8-byte little-endian header length, a
    JSON header giving each tensor's byte range, then the data); a `.bin` file is memory-mapped. Returns each
    tensor's file and shape."""
    shapes: dict[str, tuple[Path, list[int]]] = {}
    for file in checkpoint_files(path):
        if file.suffix == ".bin":
            shapes.update((name, (file, list(tensor.shape))) for name, tensor in _load_bin(file).items())
            continue
        size = file.stat().st_size
        try:
            with open(file, "rb") as f:
                (header_len,) = struct.unpack("<Q", f.read(8))
                if header_len > size - 8:
                    raise ValueError(f"its header claims {header_len:,} bytes but the file has {size:,}")
                header = json.loads(f.read(header_len))
            ends = [entry["data_offsets"][1] for name, entry in header.items() if name != "__metadata__"]
            shapes.update((name, (file, list(entry["shape"]))) for name, entry in header.items()
                          if name != "__metadata__")
        except (struct.error, ValueError, TypeError, KeyError, IndexError, AttributeError) as error:
            raise ConfigError(f"{file} is not a readable safetensors file ({error}); download it again") from None
        if 8 + header_len + max(ends, default=0) > size:
            raise ConfigError(f"{file} is truncated: {size:,} bytes, its header needs "
                              f"{8 + header_len + max(ends):,}; download it again")
    return shapes


def check_vocab_size(config_file: Path, vocab_size: int, shapes: dict[str, tuple[Path, list[int]]]) -> None:
    """The embedding (and a separate LM head) has one row per token of the vocabulary: a config that
    says otherwise would index past the table, or leave rows no token id reaches."""
    for name, (file, shape) in shapes.items():
        if name.endswith(("embed_tokens.weight", "lm_head.weight")) and len(shape) == 2 and shape[0] != vocab_size:
            relation = "smaller" if vocab_size < shape[0] else "larger"
            raise ConfigError(f"{config_file}: vocab_size={vocab_size} is {relation} than the {shape[0]} rows of "
                              f"{name} in {file}; the checkpoint is inconsistent")


def load_weights(model: nn.Module, path: Path, quantization: Fp8BlockQuantization | None = None) -> None:
    params = dict(model.named_parameters())
    filled: dict[str, set] = {}  # parameter -> shards loaded into it (None for a whole tensor)
    packed = getattr(model, "packed_modules", {})
    files = checkpoint_files(path)
    checkpoint = QuantizedCheckpoint(files, quantization)
    for file in files:
        try:
            _load_file(model, file, params, packed, filled, checkpoint)
        except SafetensorError as error:  # corrupt although its header looked whole
            raise ConfigError(f"{file} cannot be read: {error}; download it again") from None
    missing = sorted(set(params) - set(filled))
    missing += sorted(
        f"{name} ({', '.join(sorted(map(str, lacking)))})"
        for name, shards in filled.items()
        if (lacking := _packed_shards(name, packed) - shards)
    )
    if missing:
        raise ConfigError(f"checkpoint at {path} lacks {len(missing)} tensors, e.g. {missing[:3]}: the checkpoint "
                          "is incomplete or does not match its config.json")


def _load_file(model: nn.Module, file: Path, params: dict[str, nn.Parameter], packed: dict[str, tuple[str, object]],
               filled: dict[str, set], checkpoint: QuantizedCheckpoint) -> None:
    for name, get_tensor in checkpoint_tensors(file):
        if name.endswith(IGNORED_SUFFIXES) or checkpoint.is_scale(name):
            continue
        target, shard_id = checkpoint_to_parameter(name, packed)
        if hasattr(model, "remap_weight_name"):
            target, shard_id = model.remap_weight_name(target, shard_id)
        if target is None:
            continue
        if target not in params:
            if target == "lm_head.weight":
                continue  # tied to the embedding, already shared
            raise ConfigError(f"checkpoint tensor {name!r} in {file} has no place in {type(model).__name__}: the "
                              "checkpoint does not match its config.json's architecture and sizes")
        param = params[target]
        loader = param.weight_loader
        tensor = checkpoint.prepare(name, get_tensor())
        if shard_id is None:
            loader(param, tensor)
        else:
            loader(param, tensor, shard_id)
        filled.setdefault(target, set()).add(shard_id)


def checkpoint_tensors(file: Path) -> Iterator[tuple[str, object]]:
    """(name, a function that reads the tensor) for each tensor of a weight file, read one at a time."""
    if file.suffix == ".bin":
        for name, tensor in _load_bin(file).items():
            yield name, lambda tensor=tensor: tensor
        return
    with safe_open(str(file), framework="pt") as f:
        for name in f.keys():
            yield name, lambda name=name: f.get_tensor(name)


def _packed_shards(name: str, packed_modules: dict[str, tuple[str, object]]) -> set:
    """The shards a fused parameter needs from the checkpoint: q, k and v for qkv_proj, say."""
    return {shard for fused, shard in packed_modules.values() if f".{fused}." in name}
