"""What rank 0 tells the other ranks, one message per round: the whole protocol of the control plane.

Rank 0 (the executor, kvshard/engine/executor.py) `send`s; every other rank (kvshard/engine/workers.py)
`receive`s the same message and acts on it:

- `StepPlan` (kvshard/engine/step_plan.py): run one step of the model on this rank's shard.
- `Heartbeat`: run nothing, answer a round trip through every rank (the idle engine's liveness check).
- `RankTask` (kvshard/engine/kv_connector.py): run a job between steps on every rank, e.g. a KV
  connector's share of a transfer (`TransferTask`, kvshard/disagg/transfer.py). The engine names no
  feature here: a feature's message is its own subclass.
- `Shutdown`: leave the loop; the rank shuts its process groups down and exits.

Anything else is refused (`TypeError`) on either side, so that a message the ranks cannot act on fails
where it is sent. docs/design.md#ranks-and-steps has the picture.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union

from kvshard.engine.kv_connector import RankTask
from kvshard.engine.step_plan import StepPlan
from kvshard.parallel import ParallelState, broadcast_from_driver


@dataclass(frozen=True)
class Heartbeat:
    """Run nothing; every rank then takes part in one `exchange_heartbeat` round trip."""


@dataclass(frozen=True)
class Shutdown:
    """Leave the loop: rank 0 is closing the engine."""


HEARTBEAT = Heartbeat()
SHUTDOWN = Shutdown()


RankMessage = Union[StepPlan, Heartbeat, RankTask, Shutdown]
MESSAGE_TYPES = (StepPlan, Heartbeat, RankTask, Shutdown)


def check_message(message: Any) -> RankMessage:
    if not isinstance(message, MESSAGE_TYPES):
        raise TypeError(f"{type(message).__name__} {message!r:.80} is not a rank message: send a StepPlan, "
                        "HEARTBEAT, SHUTDOWN or a RankTask (kvshard/engine/rank_messages.py)")
    return message


def send(message: RankMessage, parallel: ParallelState) -> None:
    """Rank 0: the message to every other rank (they are all in `receive`)."""
    broadcast_from_driver(check_message(message), parallel)


def receive(parallel: ParallelState) -> RankMessage:
    """A rank > 0: wait for rank 0's next message."""
    return check_message(broadcast_from_driver(None, parallel))
