"""The KV connector interface: how the scheduler lets KV come from, or go to, another instance.

The core defines the hooks; an implementation (kvshard/disagg/connector.py: the
point-to-point transfer between a prefill and a decode instance) registers under a
name and is chosen at start-up from `--kv-transfer-config`'s `kv_connector`. The
core imports no implementation: `create_kv_connector` loads the registered one.

Three things the scheduler asks, the shape of vLLM's KV connector:

- what to load before a request is scheduled: `get_num_external_tokens(seq)`, asked
  once as a request arrives. If some of its prompt's KV comes from elsewhere, the
  request waits in the scheduler's remote queue; once a sequence slot and blocks for
  its whole prompt are free, the scheduler reserves the blocks and calls
  `start_load(seq, blocks, num_tokens)`, and the request is *loading*: in no batch,
  its blocks written by nobody but the connector.
- what to save when it finishes: `request_finished(seq)`, as a request stops or runs
  out of length. True means the connector sends its KV later: the scheduler keeps
  the request's blocks (*saving*) until the connector says they may go back.
- what is in flight: `get_finished()` answers, between two steps, which loads are
  over (each with its error, or None: the request then runs with those tokens
  computed) and which saves are over (their blocks go back to the pool). A load whose
  request ended meanwhile (`abort_load`) is still answered here, once nothing writes
  its blocks any more; only then are they freed.

Every hook runs on the engine thread, under the engine's lock, between two steps:
none may wait on the network. A connector does its waiting on threads of its own
and calls `wake` (set by the server) when it has something for the engine thread.
`between_steps` is where it does the engine-thread work that must sit between two
steps (e.g. telling the other ranks to start their share of a transfer), again
without waiting for it.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvshard.errors import ConfigError

if TYPE_CHECKING:
    from kvshard.engine.sequence import Sequence


class KVConnectorBase(ABC):
    """What the scheduler and the engine call; see the module's docstring for when."""

    wake: Callable[[], None] = staticmethod(lambda: None)  # set by the server: its engine loop looks for work

    # --- load -------------------------------------------------------------------------
    def get_num_external_tokens(self, seq: Sequence) -> int:
        """Prompt tokens of a new request whose KV another instance provides (0: none, the request is
        computed here). At most `seq.num_tokens - 1`: the last prompt token is computed here, to give
        the logits of the first output token."""
        return 0

    def start_load(self, seq: Sequence, blocks: list[int], num_tokens: int) -> None:
        """The scheduler reserved `blocks` (room for the whole prompt) for `seq`; fill the KV of its first
        `num_tokens` tokens in them, off the engine thread, and answer in `get_finished` once done."""
        raise NotImplementedError(f"{type(self).__name__} loads no KV")

    def abort_load(self, seq: Sequence) -> None:
        """A loading request ended (aborted). Its blocks stay reserved until `get_finished` answers for
        it: a transfer may still be writing them."""

    # --- save -------------------------------------------------------------------------
    def request_finished(self, seq: Sequence) -> bool:
        """A request finished normally, its blocks still its own. True: the connector keeps them (to send
        them) until `get_finished` lists the request as saved; False: they go back now."""
        return False

    # --- in flight --------------------------------------------------------------------
    @abstractmethod
    def get_finished(self) -> tuple[dict[int, str | None], list[int]]:
        """(loads over since the last call: seq_id -> None if the KV is there, else why not;
        saves over: seq_ids whose kept blocks may go back). Engine thread; never waits."""

    def has_pending(self) -> bool:
        """Work for the engine thread even while no request runs (something for `between_steps` or
        `get_finished`)."""
        return False

    def between_steps(self) -> None:
        """Engine thread, before the scheduler runs: start what waits for it, never waiting for it."""

    def close(self) -> None:
        """The engine shuts down: every kept block is listed by the next `get_finished`."""


_REGISTRY: dict[str, str | Callable[..., KVConnectorBase]] = {}


def register_kv_connector(name: str, factory: str | Callable[..., KVConnectorBase]) -> None:
    """Make a connector available as `kv_connector: name`; `factory` is a callable or "module:attribute",
    imported only when that connector is chosen."""
    _REGISTRY[name] = factory


def registered_kv_connectors() -> list[str]:
    return sorted(_REGISTRY)


def create_kv_connector(name: str, *args, **kwargs) -> KVConnectorBase:
    """The connector registered as `name`, built with these arguments; ConfigError for an unknown name."""
    factory = _REGISTRY.get(name)
    if factory is None:
        raise ConfigError(f"--kv-transfer-config: kv_connector {name!r} is not available; "
                          f"registered: {registered_kv_connectors()}")
    if isinstance(factory, str):
        module, _, attribute = factory.partition(":")
        factory = getattr(importlib.import_module(module), attribute)
    connector = factory(*args, **kwargs)
    if not isinstance(connector, KVConnectorBase):
        raise TypeError(f"kv_connector {name!r} made a {type(connector).__name__}, not a KVConnectorBase")
    return connector


class RankTask(ABC):
    """Work rank 0 broadcasts to the other ranks between two steps, other than a step plan (e.g. a
    connector's share of a transfer). `run_on_rank` must return promptly: whatever waits on another
    instance runs on a thread of its own, so that the rank is back for the next step at once."""

    @abstractmethod
    def run_on_rank(self, parallel, runner, device) -> None:
        """On a rank > 0: `parallel` its ParallelState, `runner` its ModelRunner, `device` its device."""
