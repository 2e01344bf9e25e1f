"""What one model call reads besides its tensors: the step's attention metadata, the caches, the ranks.

The runner (and a proposer's module) sets it around every forward (`forward_context(...)`); the layers
read it where they attend, run their experts or reduce over the ranks. The model's own code then takes
tensors alone, `forward(input_ids, positions)`, which is what lets `torch.compile` trace the layers
around attention (kvshard/compilation.py): the parts that read the context are opaque custom ops there,
found by their index in `opaque` (the order of `opaque_parts(model)`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvshard.attention.metadata import AttentionMetadata
    from kvshard.kv.cache import KVCacheLayer
    from kvshard.parallel import ParallelState


@dataclass(frozen=True)
class ForwardContext:
    meta: AttentionMetadata  # the step's attention metadata, built once per step on this rank
    caches: Sequence[KVCacheLayer]  # the called model's caches, one per attention layer (its `layer_index`)
    parallel: ParallelState | None = None  # the ranks' groups (the collectives' custom ops read it)
    opaque: Sequence[Callable] = ()  # the model's opaque parts, by index (compilation.opaque_parts)


_current: ForwardContext | None = None


@contextlib.contextmanager
def forward_context(meta: AttentionMetadata, caches: Sequence[KVCacheLayer], parallel: ParallelState | None = None,
                    opaque: Sequence[Callable] = ()) -> Iterator[ForwardContext]:
    """The context of the model call inside the block (restored after: a draft model's call may nest)."""
    global _current
    saved = _current
    _current = ForwardContext(meta, caches, parallel, opaque)
    try:
        yield _current
    finally:
        _current = saved


def get_forward_context() -> ForwardContext:
    if _current is None:
        raise RuntimeError("a model layer ran outside forward_context(...): the runner sets it around every call")
    return _current
