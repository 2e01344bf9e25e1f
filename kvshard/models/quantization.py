"""Quantized checkpoints: which ones kvshard reads, and how their weights reach the model.

Supported: FP8 with one float32 scale per weight block, as DeepSeek-V3/R1 and Kimi K2
publish them (`quantization_config = {"quant_method": "fp8", "fmt": "e4m3",
"activation_scheme": "dynamic", "weight_block_size": [128, 128]}`). Each quantized
linear `X.weight` is stored as float8 e4m3 next to a float32 `X.weight_scale_inv` of
shape [ceil(out / 128), ceil(in / 128)]; the real weight is `fp8 * scale` over each
block (the blocks of the last row and column may be partial). Everything else (embeddings,
norms, the router gate, `lm_head`) is stored unquantized and loads as usual.

The weights are dequantized to full precision at load, whole tensor by whole tensor,
before the layers' `weight_loader`s cut their tensor-parallel slices: a block that
straddles a TP split is then exact by construction, since no rank ever needs a scale
for a partial block of its own. Cost: at load, one full tensor in float32 at a time
(plus its float8 source); in the model, the weights in the model dtype (bfloat16: twice
the bytes of FP8). Keeping them FP8 on GPUs with FP8 matmuls is the next step (docs/serving.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from kvshard.errors import ConfigError

SUPPORTED_METHODS = ("fp8",)
SCALE_SUFFIX = ".weight_scale_inv"
FLOAT8_DTYPES = tuple(
    getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
    if hasattr(torch, name)
)


@dataclass(frozen=True)
class Fp8BlockQuantization:
    """FP8 e4m3 weights, one float32 scale per `block` = (rows, columns) of a weight."""

    block: tuple[int, int] = (128, 128)


def parse_quantization_config(raw: object, config_file: Path) -> Fp8BlockQuantization | None:
    """config.json's `quantization_config` -> what the loader needs; a ConfigError for anything else."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ConfigError(f"{config_file}: quantization_config must be an object, got {raw!r}")
    method = raw.get("quant_method")
    if method not in SUPPORTED_METHODS:
        raise ConfigError(
            f"{config_file}: quantization method {method!r} is not supported; kvshard reads "
            f"{', '.join(SUPPORTED_METHODS)} (block-scaled, as DeepSeek-V3 and Kimi K2 publish) "
            "or unquantized checkpoints"
        )
    fmt = raw.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ConfigError(f"{config_file}: fp8 format {fmt!r} is not supported; kvshard reads fmt 'e4m3'")
    scheme = raw.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise ConfigError(
            f"{config_file}: fp8 activation_scheme {scheme!r} is not supported (its input scales would be "
            "ignored); kvshard reads 'dynamic'"
        )
    block = raw.get("weight_block_size")
    if block is None:
        raise ConfigError(
            f"{config_file}: fp8 without weight_block_size (one scale per tensor) is not supported; "
            "kvshard reads block-scaled fp8 (weight_block_size [128, 128])"
        )
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ConfigError(f"{config_file}: weight_block_size must be two positive integers, got {block!r}")
    return Fp8BlockQuantization(block=(block[0], block[1]))


def dequantize_block_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """float8 [out, in] and float32 scales [ceil(out/br), ceil(in/bc)] -> float32 [out, in].

    One row of blocks at a time, in place, so the peak is the float32 result itself.
    """
    rows, cols = block
    out = weight.to(torch.float32)  # [out, in]
    for i in range(scale_inv.shape[0]):
        row_scales = scale_inv[i].to(torch.float32).repeat_interleave(cols)[: out.shape[1]]  # [in]
        out[i * rows : (i + 1) * rows] *= row_scales
    return out


class QuantizedCheckpoint:
    """Reads a checkpoint's tensors, dequantizing each float8 weight with its block scales.

    The scale of a weight may sit in another safetensors file than the weight (sharded
    checkpoints do not promise otherwise), so the files holding scales stay open (memory
    mapped, nothing read but their headers) as long as this object lives.
    """

    def __init__(self, files: list[Path], quantization: Fp8BlockQuantization | None) -> None:
        self.quantization = quantization
        self._scale_files: dict[str, object] = {}
        names: set[str] = set()
        for file in files:
            if file.suffix != ".safetensors":  # PyTorch .bin weights carry no block scales
                continue
            handle = safe_open(str(file), framework="pt")
            for name in handle.keys():
                names.add(name)
                if name.endswith(SCALE_SUFFIX):
                    self._scale_files[name] = handle
        orphans = [s for s in self._scale_files if s.removesuffix(SCALE_SUFFIX) + ".weight" not in names]
        if orphans:
            raise ValueError(f"checkpoint scales without their weight: {orphans[:3]}")
        if self._scale_files and quantization is None:
            raise ValueError(
                f"the checkpoint has block scales ({next(iter(self._scale_files))!r}, ...) but config.json has "
                "no quantization_config: add the one the checkpoint was published with"
            )

    @staticmethod
    def is_scale(name: str) -> bool:
        """Scales are read together with their weight, never loaded on their own."""
        return name.endswith(SCALE_SUFFIX)

    def prepare(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The tensor as the model needs it: float8 weights dequantized to float32, the rest unchanged."""
        scale_name = name.removesuffix(".weight") + SCALE_SUFFIX
        has_scale = name.endswith(".weight") and scale_name in self._scale_files
        if tensor.dtype not in FLOAT8_DTYPES:
            if has_scale:
                raise ValueError(f"checkpoint tensor {name!r} has block scales but is stored as {tensor.dtype}")
            return tensor
        if not has_scale:
            raise ValueError(
                f"checkpoint tensor {name!r} is {tensor.dtype} without its {scale_name!r}: kvshard reads float8 "
                "weights only with block scales (quantization_config.weight_block_size)"
            )
        if tensor.dtype != torch.float8_e4m3fn:
            raise ValueError(f"checkpoint tensor {name!r} is {tensor.dtype}; fmt 'e4m3' stores float8_e4m3fn")
        assert self.quantization is not None  # checked in __init__: scales come with a quantization_config
        scale = self._scale_files[scale_name].get_tensor(scale_name)
        rows, cols = self.quantization.block
        expected = tuple(math.ceil(size / b) for size, b in zip(tensor.shape, (rows, cols)))
        if tensor.dim() != 2 or tuple(scale.shape) != expected:
            raise ValueError(
                f"checkpoint tensor {name!r} of shape {tuple(tensor.shape)} has scales of shape "
                f"{tuple(scale.shape)}; {rows}x{cols} blocks need {expected}"
            )
        return dequantize_block_fp8(tensor, scale, self.quantization.block)
