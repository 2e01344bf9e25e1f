"""Structured outputs (guided decoding): a grammar backend behind a small interface, xgrammar by default.

- `backend.py`: the interface (`Backend` compiles a constraint; `Grammar` fills a row's token bitmask,
  accepts tokens, rolls back, says when it terminated).
- `xgrammar_backend.py`: the default backend.
- `manager.py`: compiles off the engine thread with a cache, and masks the logits of the rows that sample.
"""

from kvshard.structured.backend import Backend, Grammar
from kvshard.structured.manager import StructuredOutputManager, apply_masks

__all__ = ["Backend", "Grammar", "StructuredOutputManager", "apply_masks"]
