"""Bundled presets (JSON files in presets/) and Hugging Face config.json files.

Model presets are config.json files as published, plus a "planner" block with the
published parameter counts; GPU presets hold datasheet figures with their source.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from functools import cache
from pathlib import Path
from typing import Any

from kvshard.planner.arch import ModelArch, parse_hf_config
from kvshard.planner.errors import PlanError
from kvshard.planner.hardware import REQUIRED_CUSTOM_FIELDS, GpuSpec

PRESET_DIR = Path(__file__).parent / "presets"
_NON_MODEL_FILES = {"gpus.json", "workloads.json"}


@dataclass(frozen=True)
class Workload:
    """Every request reads `input_len` prompt tokens and decodes `output_len` tokens."""

    name: str
    input_len: int
    output_len: int
    source: str = ""

    def __post_init__(self) -> None:
        if self.input_len < 1 or self.output_len < 1:
            raise PlanError("--context-len and --output-len must be at least 1")


def _read_json(path: Path) -> dict[str, Any]:
    with path.open() as f:
        return json.load(f)


@cache
def model_presets() -> dict[str, Path]:
    """Preset name (the file stem, e.g. "kimi-k2.6") -> file."""
    files = sorted(PRESET_DIR.glob("*.json"), key=lambda p: p.stem)
    return {p.stem: p for p in files if p.name not in _NON_MODEL_FILES}


def _preset_key(name: str) -> str | None:
    """Match a preset by file stem or by Hugging Face repo id, ignoring case."""
    wanted = name.lower()
    for key, path in model_presets().items():
        repo = _read_json(path).get("planner", {}).get("hf_repo", "")
        if wanted in (key, repo.lower(), repo.lower().split("/")[-1]):
            return key
    return None


def load_model(spec: str) -> ModelArch:
    """`spec` is a config.json, a directory holding one, or a preset name."""
    path = Path(spec).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        try:
            cfg = _read_json(path)
        except json.JSONDecodeError as e:
            raise PlanError(f"{path} is not valid JSON ({e.msg} at line {e.lineno})") from None
        except (OSError, UnicodeDecodeError) as e:
            raise PlanError(f"cannot read {path}: {getattr(e, 'strerror', None) or e}") from None
        if not isinstance(cfg, dict):
            raise PlanError(f"{path} is not a config.json: it holds a JSON {type(cfg).__name__}, not an object")
        try:
            return parse_hf_config(cfg, path.parent.name if path.name == "config.json" else path.stem)
        except PlanError:
            raise
        except (TypeError, ValueError, AttributeError) as e:  # a field of the wrong type, e.g. a string for a size
            raise PlanError(f"{path}: a field the planner reads has the wrong type ({e})") from None
    key = _preset_key(spec)
    if key is None:
        raise PlanError(f"model {spec!r} is neither an existing config.json (file or directory) "
                        f"nor a preset: use one of {', '.join(model_presets())}")
    return parse_hf_config(_read_json(model_presets()[key]), key)


@cache
def gpu_presets() -> dict[str, dict[str, Any]]:
    return _read_json(PRESET_DIR / "gpus.json")


def load_gpu(name: str, overrides: dict[str, float | int | None]) -> GpuSpec:
    """A preset GPU with any given field replaced, or `custom` built from the fields.

    `overrides` uses GpuSpec field names; None means "not given"."""
    given = {k: v for k, v in overrides.items() if v is not None}
    if name.lower() == "custom":
        missing = [f for f in REQUIRED_CUSTOM_FIELDS if f not in given]
        if missing:
            flags = ", ".join("--" + f.replace("_", "-") for f in missing)
            raise PlanError(f"--gpu custom needs {flags}")
        # Stated defaults for a custom GPU: no FP8 tensor cores (FP8 runs at the BF16
        # rate), one 400 Gb/s NIC per GPU, PCIe Gen5 x16, 8 GPUs per node.
        base: dict[str, Any] = {"fp8_tflops": given["bf16_tflops"], "network_gbps": 50,
                                "pcie_gbps": 64, "gpus_per_node": 8, "source": "custom"}
    else:
        presets = {k.lower(): (k, v) for k, v in gpu_presets().items()}
        if name.lower() not in presets:
            raise PlanError(f"unknown GPU {name!r}: use one of {', '.join(gpu_presets())} or custom "
                            "(with --hbm-gib, --hbm-tbps, --bf16-tflops, --nvlink-gbps)")
        name, base = presets[name.lower()]
    spec = {f.name: f for f in fields(GpuSpec)}
    values = {**base, **given, "name": name}
    return GpuSpec(**{k: v for k, v in values.items() if k in spec})


@cache
def workload_presets() -> dict[str, dict[str, Any]]:
    return _read_json(PRESET_DIR / "workloads.json")


def load_workload(name: str | None, context_len: int | None, output_len: int | None) -> Workload:
    if name is not None:
        if context_len is not None or output_len is not None:
            raise PlanError("give either --workload or --context-len/--output-len, not both")
        if name not in workload_presets():
            raise PlanError(f"unknown workload {name!r}: use one of {', '.join(workload_presets())} "
                            "or --context-len L --output-len O")
        return Workload(name=name, **workload_presets()[name])
    if context_len is None or output_len is None:
        raise PlanError("give --workload agentic or both --context-len and --output-len")
    return Workload(name=f"{context_len} in / {output_len} out", input_len=context_len, output_len=output_len)
