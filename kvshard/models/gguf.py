"""GGUF checkpoints (llama.cpp's single-file format) as Hugging Face directories.

A `.gguf` file is converted once into a cached Hugging Face checkpoint (config.json,
generation_config.json, tokenizer files with the chat template, model.safetensors in
float32) named after the file's SHA-256, so the second start reads safetensors only and
other engines can load the same directory. The tensors are dequantized by the `gguf`
library; config and tokenizer come from transformers' own GGUF support.

The file's header (metadata and tensor table) is walked here (`read_gguf_header`) rather than by
`gguf.GGUFReader`, which builds a numpy view per element of every metadata array: seconds for a
real vocabulary, where this walk skips the arrays it does not need in milliseconds.
`GGUFReader` stays the reference (tests/test_gguf_header.py) and reads what the walk does not
(a big-endian file, a GGUF version other than 2 and 3). transformers still reads the metadata
with `GGUFReader`, once for config and tokenizer together (`_transformers_reads_the_metadata_once`).

The cache is float32 because that loses nothing (F16 and BF16 widen exactly, and the gguf
library computes quantized blocks in float32); kvshard casts to the dtype asked for when it
loads, so one cache per file serves every dtype.
"""

from __future__ import annotations

import copy
import hashlib
import os
import struct
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
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
    from safetensors.torch import save_file
    from tqdm import tqdm
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    reader = read_gguf_header(gguf_path)
    gguf_architecture = reader.fields.get("general.architecture")
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

    with _transformers_reads_the_metadata_once():
        config = _read_with_transformers(AutoConfig, gguf_path)
        # without one, kvshard still serves token-id prompts
        has_tokenizer = "tokenizer.ggml.model" in reader.fields
        tokenizer = _read_with_transformers(AutoTokenizer, gguf_path) if has_tokenizer else None
    config.architectures = [ARCHITECTURES[config.model_type]]
    config.dtype = torch.float32

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
        # F32 data is a read-only view of the mapped file: copied; dequantized blocks are fresh arrays already
        tensors[name] = torch.from_numpy(np.ascontiguousarray(weights) if weights.flags.writeable
                                         else np.array(weights))

    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(directory)
    GenerationConfig.from_model_config(config).save_pretrained(directory)
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)


@dataclass(frozen=True)
class HeaderTensor:
    """One entry of a GGUF file's tensor table, as `gguf.ReaderTensor` has it: `shape` innermost first, `data` a
    read-only view of the mapped file (typed for F16/F32/F64 and the integer types, else its bytes per row)."""

    name: str
    tensor_type: object  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray


@dataclass(frozen=True)
class GGUFHeader:
    """`fields`: every metadata key with its value (numbers, strings, lists of numbers; an array of strings as its
    length, which the conversion never reads); `tensors` in the file's order."""

    fields: dict[str, object]
    tensors: list[HeaderTensor]


# GGUF metadata value types of a fixed width: struct format (little-endian)
_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_GGUF_MAGIC = b"GGUF"
_WALKED_VERSIONS = (2, 3)  # 64-bit counts and lengths; GGUFReader reads the same two


def read_gguf_header(gguf_path: Path) -> GGUFHeader:
    """The metadata and tensor table of a .gguf file, walked with `struct` over a memory map (no tensor data read);
    `gguf.GGUFReader` reads a file this walk does not handle."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import quant_shape_to_byte_shape

    mapped = np.memmap(gguf_path, mode="r", dtype=np.uint8)
    view = memoryview(mapped)
    if bytes(view[:4]) != _GGUF_MAGIC:
        raise ConfigError(f"{gguf_path.name} is not a GGUF file (it does not start with the GGUF magic bytes)")
    (version,) = struct.unpack_from("<I", view, 4)
    if version not in _WALKED_VERSIONS:  # a big-endian file reads as a version above 65535
        return _header_from_reader(gguf_path)

    def string(pos: int) -> tuple[str, int]:
        (length,) = struct.unpack_from("<Q", view, pos)
        return str(view[pos + 8:pos + 8 + length], "utf-8"), pos + 8 + length

    def value(pos: int, value_type: int) -> tuple[object, int]:
        if value_type in _SCALAR_FORMATS:
            fmt = "<" + _SCALAR_FORMATS[value_type]
            return struct.unpack_from(fmt, view, pos)[0], pos + struct.calcsize(fmt)
        if value_type == _STRING:
            return string(pos)
        if value_type == _ARRAY:
            element_type, count = struct.unpack_from("<IQ", view, pos)
            pos += 12
            if element_type in _SCALAR_FORMATS:
                fmt = f"<{count}{_SCALAR_FORMATS[element_type]}"
                return list(struct.unpack_from(fmt, view, pos)), pos + struct.calcsize(fmt)
            if element_type == _STRING:  # a vocabulary or merge table: walked over, kept as its length
                for _ in range(count):
                    pos += 8 + struct.unpack_from("<Q", view, pos)[0]
                return count, pos
            items = []
            for _ in range(count):  # arrays of arrays
                item, pos = value(pos, element_type)
                items.append(item)
            return items, pos
        raise ConfigError(f"GGUF file {gguf_path.name} has a metadata value of unknown type {value_type}")

    tensor_count, field_count = struct.unpack_from("<QQ", view, 8)
    pos, fields = 24, {}
    for _ in range(field_count):
        key, pos = string(pos)
        (value_type,) = struct.unpack_from("<I", view, pos)
        fields[key], pos = value(pos + 4, value_type)
    table = []
    for _ in range(tensor_count):
        name, pos = string(pos)
        (dims,) = struct.unpack_from("<I", view, pos)
        shape = struct.unpack_from(f"<{dims}Q", view, pos + 4)
        pos += 4 + 8 * dims
        raw_type, offset = struct.unpack_from("<IQ", view, pos)
        pos += 12
        table.append((name, shape, raw_type, offset))
    alignment = fields.get("general.alignment", 32)  # llama.cpp's default
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise ConfigError(f"GGUF file {gguf_path.name} has general.alignment {alignment!r}, not a power of two")
    data_start = -(-pos // alignment) * alignment

    typed = {GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F32: np.float32,
             GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
             GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
             GGMLQuantizationType.I64: np.int64}
    tensors, names = [], set()
    for name, shape, raw_type, offset in table:
        if name in names:
            raise ConfigError(f"GGUF file {gguf_path.name} has tensor {name!r} twice")
        names.add(name)
        try:
            tensor_type = GGMLQuantizationType(raw_type)
        except ValueError:
            raise ConfigError(f"GGUF file {gguf_path.name} has tensor {name!r} of unknown type {raw_type}") from None
        elements = int(np.prod(shape, dtype=np.int64))
        block, block_bytes = GGML_QUANT_SIZES[tensor_type]
        start, nbytes = data_start + offset, elements * block_bytes // block
        if start + nbytes > len(mapped):
            raise ConfigError(f"GGUF file {gguf_path.name} ends inside tensor {name!r}: the file is truncated")
        numpy_shape = tuple(reversed(shape))
        if tensor_type in typed:
            data = mapped[start:start + nbytes].view(typed[tensor_type]).reshape(numpy_shape)
        else:
            data = mapped[start:start + nbytes].reshape(quant_shape_to_byte_shape(numpy_shape, tensor_type))
        tensors.append(HeaderTensor(name, tensor_type, tuple(int(d) for d in shape), data))
    return GGUFHeader(fields, tensors)


def _header_from_reader(gguf_path: Path) -> GGUFHeader:
    """The same header through `gguf.GGUFReader` (its pseudo-fields GGUF.* left out)."""
    from gguf import GGUFReader, GGUFValueType

    try:
        reader = GGUFReader(gguf_path)
    except ValueError as error:
        raise ConfigError(f"gguf cannot read {gguf_path.name}: {error}") from None
    fields = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        is_string_array = field.types[:1] == [GGUFValueType.ARRAY] and field.types[-1] == GGUFValueType.STRING
        fields[key] = len(field.data) if is_string_array else field.contents()
    tensors = [HeaderTensor(t.name, t.tensor_type, tuple(int(d) for d in t.shape), t.data) for t in reader.tensors]
    return GGUFHeader(fields, tensors)


@contextmanager
def _transformers_reads_the_metadata_once() -> Iterator[None]:
    """transformers reads a .gguf's whole metadata (`load_gguf_checkpoint`, through `gguf.GGUFReader`: seconds for a
    real vocabulary) for the config, and once more inside AutoTokenizer, which needs the config to pick its class:
    inside this block the second read of a file is a copy of the first's result. Where transformers has no such
    function (another version), nothing changes. One block at a time in a process, so that conversions in two
    threads cannot leave the stand-in in place."""
    try:
        from transformers import modeling_gguf_pytorch_utils as module
    except ImportError:
        module = None
    with _READ_ONCE_LOCK:
        original = getattr(module, "load_gguf_checkpoint", None)
        if original is None:
            yield
            return
        module.load_gguf_checkpoint = _read_once(original)
        try:
            yield
        finally:
            module.load_gguf_checkpoint = original


_READ_ONCE_LOCK = threading.Lock()


def _read_once(original):
    """`original` (transformers' `load_gguf_checkpoint`), its metadata-only reads done once per file."""
    read: dict[str, dict] = {}

    def read_once(gguf_checkpoint_path, return_tensors=False, *args, **kwargs):
        if return_tensors or args or kwargs:  # tensors, or a call this block does not know: as it was
            return original(gguf_checkpoint_path, return_tensors, *args, **kwargs)
        key = os.fspath(gguf_checkpoint_path)
        if key not in read:
            read[key] = original(gguf_checkpoint_path, return_tensors=False)
        return copy.deepcopy(read[key])  # a caller may change what it gets

    return read_once


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
