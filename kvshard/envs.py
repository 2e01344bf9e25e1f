"""Every `KVSHARD_*` environment variable, declared once: its name, type, default and what it changes.

Settings a user gives per engine are `EngineArgs` fields (kvshard/engine/arg_utils.py); the ones here
are process-wide knobs that spawned ranks inherit with the environment. Each is read through its
`EnvVar` when it is needed (never when a module is imported), parsed one way per type, and refused
with a `ConfigError` naming the variable. The table in docs/serving.md (section "Environment
variables") is `markdown_table()`, checked by tests/test_settings.py; `python -m kvshard.envs`
prints it. Those marked `numerics` can change a request's bits: the start-up report lists them.

Importing this module imports nothing but the standard library (the planner and the ranks use it).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# The types: how a value is parsed (and what the table in docs/serving.md says it is).
NON_NEGATIVE_INT = "integer >= 0"
POSITIVE_INT = "integer >= 1"
SECONDS = "seconds > 0"
SWITCH = "0 or 1"
PATH = "path"
TEXT = "text"
TYPES = (NON_NEGATIVE_INT, POSITIVE_INT, SECONDS, SWITCH, PATH, TEXT)

_OFF, _ON = ("0", "false", "no", "off"), ("1", "true", "yes", "on")


def _error(message: str) -> Exception:
    from kvshard.errors import ConfigError  # a ValueError

    return ConfigError(message)


@dataclass(frozen=True)
class EnvVar:
    name: str
    type: str  # one of TYPES
    default: Any  # the value when unset (None: none, or derived where it is read; `shown_default` says which)
    what: str  # what it changes, for docs/serving.md
    numerics: bool = False  # can change a request's tokens or logprobs: listed in the start-up report
    aliases: tuple[str, ...] = ()  # further names read, in order, when `name` is unset (other projects' recipes)
    shown_default: str | None = None  # the default as the table shows it, where `default` alone does not say

    def raw(self) -> tuple[str, str] | None:
        """(the name it was read from, its text) of the first of `name`, `aliases` that is set and not blank."""
        for name in (self.name, *self.aliases):
            text = os.environ.get(name, "").strip()
            if text:
                return name, text
        return None

    def is_set(self) -> bool:
        return self.raw() is not None

    def get(self) -> Any:
        """The value now: parsed from the environment, or the default. ConfigError names the variable."""
        found = self.raw()
        if found is None:
            return self.default
        name, text = found
        if self.type == NON_NEGATIVE_INT:
            if not text.isdigit():
                raise _error(f"{name}={text!r} is not a non-negative integer: set it to one, or unset it for "
                             f"{self.default}")
            return int(text)
        if self.type == POSITIVE_INT:
            if not text.isdigit() or int(text) < 1:
                raise _error(f"{name}={text!r} is not an integer >= 1: set one, or unset it for "
                             f"{self.default_text()}")
            return int(text)
        if self.type == SECONDS:
            try:
                value = float(text)
            except ValueError:
                value = float("nan")
            if not 0 < value < float("inf"):
                raise _error(f"{name}={text!r} is not a number of seconds > 0: set e.g. {self.default:g}, "
                             "or unset it")
            return value
        if self.type == SWITCH:
            if text.lower() in _OFF:
                return False
            if text.lower() in _ON:
                return True
            raise _error(f"{name}={text!r} is not 0 or 1: set 0 (off) or 1 (on), or unset it for "
                         f"{self.default_text()}")
        if self.type == PATH:
            return Path(text).expanduser()
        return text

    def default_text(self) -> str:
        if self.shown_default is not None:
            return self.shown_default
        if self.type == SWITCH:
            return str(int(self.default))
        if self.type == SECONDS:
            return f"{self.default:g}"
        if self.name.endswith("_BYTES") and self.default >= 1 << 10 and self.default % (1 << 10) == 0:
            units = [(1 << 20, "MiB"), (1 << 10, "KiB")]
            size, unit = next((s, u) for s, u in units if self.default % s == 0)
            return f"{self.default:,} ({self.default // size} {unit})"
        return "unset" if self.default is None else f"{self.default:,}" if isinstance(self.default, int) \
            else str(self.default)


def _declare(*variables: EnvVar) -> dict[str, EnvVar]:
    return {v.name: v for v in variables}


# Defaults the modules that use them also export under their own names (with the measurements behind them).
DEFAULT_HEARTBEAT_INTERVAL_S = 0.5
DEFAULT_HEARTBEAT_TIMEOUT_S = 3.0
DEFAULT_STEP_TIMEOUT_S = 30.0

REGISTRY: dict[str, EnvVar] = _declare(
    # --- numerics: which kernel or merge runs, how decodes are grouped ---------------------------------
    EnvVar("KVSHARD_DCP_KV_INTERLEAVE_SIZE", POSITIVE_INT, None,
           "consecutive tokens per DCP rank, where `--dcp-kv-interleave-size` is not given "
           "(`VLLM_DCP_KV_INTERLEAVE_SIZE` is read next)", numerics=True,
           aliases=("VLLM_DCP_KV_INTERLEAVE_SIZE",), shown_default="1"),
    EnvVar("KVSHARD_AUTO_REPLICATE_MAX_BYTES", NON_NEGATIVE_INT, 1 << 20,
           "`--dcp-attention-layout auto` replicates a DCP group's queries when that costs a rank at most "
           "this many bytes of query weights per layer; 0 keeps head-split wherever it applies", numerics=True),
    EnvVar("KVSHARD_FUSED_MERGE_MAX_BYTES", NON_NEGATIVE_INT, 256 * 1024,
           "below this many bytes of partial output per rank, the ag_rs merge is one all-gather of "
           "[output, lse]; 0 always takes the LSE all-gather + ReduceScatter", numerics=True),
    EnvVar("KVSHARD_A2A_MAX_BYTES", NON_NEGATIVE_INT, 16 << 20,
           "`--dcp-comm-backend auto` merges by all-to-all up to this many bytes of partial output per rank; "
           "0 always takes ag_rs", numerics=True),
    EnvVar("KVSHARD_MLA_EXPANDED_MIN_ROWS", POSITIVE_INT, None,
           "an MLA prefill chunk of at least this many rows reads the cached context in the expanded form "
           "(keys and values per head, up-projected from the cached latents) instead of the absorbed one",
           numerics=True, shown_default="1.75 c (n + v) / (2c - n - v) (75 in the MLA demo)"),
    EnvVar("KVSHARD_MLA_EXPANDED_PIECE_BYTES", POSITIVE_INT, 64 << 20,
           "an MLA chunk expands its cached latents into per-head keys and values in pieces of at most this many "
           "bytes, merged by LSE (every rank of a DCP group must have the same)", numerics=True),
    EnvVar("KVSHARD_FLASH_CHUNKS", SWITCH, None,
           "the paged backend: 1 runs a long prefill chunk's attention (to itself and to its cached context) in "
           "PyTorch's flash kernel, 0 in the paged kernel", numerics=True,
           shown_default="flash for bfloat16 queries on a CPU with AMX tiles, else the kernel"),
    EnvVar("KVSHARD_AMX_ATTENTION", SWITCH, True,
           "bfloat16 attention on AMX tiles where the CPU has them: the paged kernel's rows over the cache with keys "
           "of head size 32 to 128 (a multiple of 32), and long prefill chunks of head size 32, 64 or 128 with no "
           "mask (to themselves and to their cached context); 0 keeps the kernel's vector registers for the first "
           "and PyTorch's flash kernel for the second", numerics=True),
    EnvVar("KVSHARD_DECODE_GROUP_SPREAD", NON_NEGATIVE_INT, 1024,
           "decodes attend in groups padded to their longest member, spanning at most this many tokens of "
           "local context; 0 gives each local length a group of its own", numerics=True),
    EnvVar("KVSHARD_CHECK_BLOCK_TABLES", SWITCH, False,
           "1: every step's plan also carries each request's whole block table, and every rank checks the "
           "tables it keeps against them (slow: for tests and debugging)"),
    EnvVar("KVSHARD_ONEDNN_LINEAR", SWITCH, True,
           "CPU: linear layers run oneDNN on weights reordered once at load (bfloat16 ones on a CPU with AMX tiles: "
           "KVSHARD_AMX_LINEAR); 0 keeps torch's linear for every weight",
           numerics=True),
    EnvVar("KVSHARD_AMX_LINEAR", SWITCH, True,
           "CPU with AMX tiles: bfloat16 linear layers multiply from their weight in the tiles' pair layout (up "
           "to 512 rows on the kernel extension's AMX tiles, more in torch's linear from a plain copy), the LM "
           "head from its weight as it lies; 0 keeps oneDNN's reordered copy", numerics=True),
    EnvVar("KVSHARD_FUSED_ELEMENTWISE", SWITCH, True,
           "CPU: RMSNorm (with the residual add before it), SiLU-and-multiply, the rotary embedding, the cache "
           "write, the attention's LSE merge and the MoE router's choice run as fused C++ operators of kvshard's "
           "kernel extension; 0 keeps PyTorch's eager operators",
           numerics=True),
    EnvVar("KVSHARD_DECODE_PROGRAM", SWITCH, True,
           "CPU, one rank, a Llama-family model: steps of decodes (and speculative verification rows) run as one "
           "flat program of the kernel extension's calls, the same bits as the layers' modules; 0 keeps the "
           "modules for every step"),
    EnvVar("KVSHARD_NUM_THREADS", POSITIVE_INT, None,
           "torch threads per rank (a matmul's split over threads can change its rounding)", numerics=True,
           shown_default="cores / ranks"),
    EnvVar("KVSHARD_COMPILATION_LEVEL", NON_NEGATIVE_INT, 0,
           "the model step's compilation level where `-O` / `--compilation-config` is not given: 0 eager, 3 "
           "torch.compile (CPU only)", numerics=True),
    # --- collectives and failure detection --------------------------------------------------------------
    EnvVar("KVSHARD_SHM_COLLECTIVES", SWITCH, True,
           "ranks on one x86 machine exchange through shared memory; 0 sends every collective through gloo"),
    EnvVar("KVSHARD_SHM_SLOT_BYTES", POSITIVE_INT, 4 << 20,
           "bytes of one rank's shared-memory slot; a larger message goes through gloo"),
    EnvVar("KVSHARD_COLLECTIVE_TIMEOUT_S", SECONDS, 600.0,
           "how long the ranks wait for each other to join and in one collective"),
    EnvVar("KVSHARD_STEP_TIMEOUT", SECONDS, DEFAULT_STEP_TIMEOUT_S,
           "seconds a step may go without progress before its ranks count as hung"),
    EnvVar("KVSHARD_HEARTBEAT_INTERVAL", SECONDS, DEFAULT_HEARTBEAT_INTERVAL_S,
           "seconds between two ticks of a rank's heartbeat"),
    EnvVar("KVSHARD_HEARTBEAT_TIMEOUT", SECONDS, DEFAULT_HEARTBEAT_TIMEOUT_S,
           "seconds without a tick after which a rank counts as stopped (at least twice the interval)"),
    EnvVar("KVSHARD_DCP_TIMING_EVERY", NON_NEGATIVE_INT, 16,
           "with DCP, the ranks gather their attention timers every this many steps (`kvshard:dcp_seconds_total`); "
           "0 turns the timers off"),
    # --- process and memory -----------------------------------------------------------------------------
    EnvVar("KVSHARD_KEEP_FREED_MEMORY", SWITCH, True,
           "glibc keeps freed memory for the next step instead of returning it to the kernel; 0 leaves glibc's "
           "default"),
    EnvVar("KVSHARD_KV_HUGE_PAGES", SWITCH, True,
           "CPU, Linux: a rank's KV cache is one 2 MiB-aligned buffer advised for transparent huge pages "
           "(madvise) before its first touch; 0 leaves it on the allocator's pages"),
    EnvVar("KVSHARD_WEIGHT_HUGE_PAGES", SWITCH, True,
           "CPU, Linux: a rank's weights are moved, once loaded, into one 2 MiB-aligned buffer advised for "
           "transparent huge pages (oneDNN's reordered copies stay on its own); 0 leaves them on the allocator's "
           "pages"),
    EnvVar("KVSHARD_CACHE_DIR", PATH, None,
           "where kvshard keeps the demo models, converted GGUF checkpoints, compiled kernels and the generated "
           "KV-transfer secret", shown_default="~/.cache/kvshard"),
    EnvVar("KVSHARD_KERNEL_CACHE_DIR", PATH, None,
           "where the compiled paged attention kernel is kept, shared by every run on the machine",
           shown_default="~/.cache/kvshard/torch_extensions"),
    # --- serving ----------------------------------------------------------------------------------------
    EnvVar("KVSHARD_MAX_STREAM_BACKLOG", POSITIVE_INT, 1024,
           "tokens a streaming client may leave unread (summed over its choices) before the request is aborted"),
    EnvVar("KVSHARD_API_KEY", TEXT, None,
           "the default of `serve --api-key`: the bearer key every route but /health requires "
           "(`VLLM_API_KEY` is read next); set but empty, it is refused at start-up",
           aliases=("VLLM_API_KEY",)),
    EnvVar("KVSHARD_KV_TRANSFER_SECRET", TEXT, None,
           "the shared secret of a disaggregated deployment (proxy, producers, consumers), where "
           "`kv_connector_extra_config.shared_secret` is not given",
           shown_default="generated once per user and machine"),
)


def env(name: str) -> EnvVar:
    """The declared variable `name` (KeyError for an undeclared one: declare it in REGISTRY first)."""
    return REGISTRY[name]


def get(name: str) -> Any:
    """The value of the declared variable `name` now (its default when unset)."""
    return REGISTRY[name].get()


# --- readers by name, for the modules that use them ------------------------------------------------------

def heartbeat_interval_s() -> float:
    """$KVSHARD_HEARTBEAT_INTERVAL: seconds between two ticks of a rank's heartbeat."""
    return get("KVSHARD_HEARTBEAT_INTERVAL")


def heartbeat_timeout_s() -> float:
    """$KVSHARD_HEARTBEAT_TIMEOUT: seconds without a tick after which a rank counts as stopped (also the
    deadline of the idle engine's round trip through every rank)."""
    return get("KVSHARD_HEARTBEAT_TIMEOUT")


def cache_dir() -> Path:
    """Where kvshard keeps what it builds or converts: $KVSHARD_CACHE_DIR, else ~/.cache/kvshard."""
    return get("KVSHARD_CACHE_DIR") or Path.home() / ".cache" / "kvshard"


def api_key() -> tuple[str, str] | None:
    """`serve --api-key`'s default: (the variable it was read from, the key) of the first of $KVSHARD_API_KEY,
    $VLLM_API_KEY that is set; None when neither is. Unlike the other variables', a blank value is not taken for
    unset but refused by name: it would serve every client where a key was meant."""
    variable = REGISTRY["KVSHARD_API_KEY"]
    for name in (variable.name, *variable.aliases):
        if name in os.environ:
            key = os.environ[name].strip()
            if not key:
                raise _error(f"${name} is set but empty: no request could match it; set it to a key, or unset it")
            return name, key
    return None


# The variable that holds the shared secret of a disaggregated deployment (docs/disaggregation.md).
KV_TRANSFER_SECRET = "KVSHARD_KV_TRANSFER_SECRET"


# --- what users see ---------------------------------------------------------------------------------------

def numerics_report() -> str:
    """The start-up report's line: the numerics-changing variables set in this environment and their values."""
    chosen = []
    for variable in REGISTRY.values():
        if variable.numerics and (found := variable.raw()) is not None:
            value = variable.get()
            shown = int(value) if isinstance(value, bool) else value
            chosen.append(f"{found[0]}={shown} (default {variable.default_text()})")
    if not chosen:
        return "numerics settings from the environment: none set (every KVSHARD_* numerics setting at its default)"
    return "numerics settings from the environment: " + ", ".join(chosen)


def markdown_table() -> str:
    """The table of docs/serving.md's "Environment variables" section."""
    rows = ["| variable | type | default | numerics | what it changes |", "|---|---|---|---|---|"]
    for v in REGISTRY.values():
        rows.append(f"| `{v.name}` | {v.type} | {v.default_text()} | {'yes' if v.numerics else ''} | {v.what} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(markdown_table())
