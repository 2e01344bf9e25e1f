"""The rank protocol is typed: rank 0 sends a StepPlan, HEARTBEAT, a RankTask or SHUTDOWN
(kvshard/engine/rank_messages.py), each rank acts on it by type, and anything else is refused on both
sides. In-process: one rank's loop body against stand-ins, a single-rank `ParallelState`."""

from __future__ import annotations

import pickle
import re
from pathlib import Path

import pytest

from kvshard.engine import rank_messages, workers
from kvshard.engine.kv_connector import RankTask
from kvshard.engine.rank_messages import HEARTBEAT, SHUTDOWN, Heartbeat, Shutdown, check_message
from kvshard.engine.step_plan import StepPlan
from kvshard.parallel import single_rank_state

ROOT = Path(__file__).resolve().parent.parent
PLAN = StepPlan(token_ids=[1, 2], query_lens=[2], context_lens=[0], block_tables=[[0]], sample_rows=[1])


class Runner:
    def __init__(self) -> None:
        self.ran: list[StepPlan] = []

    def execute(self, plan: StepPlan) -> None:
        self.ran.append(plan)


class Task(RankTask):
    def __init__(self) -> None:
        self.calls = []

    def run_on_rank(self, parallel, runner, device) -> bool:
        self.calls.append((parallel, runner, device))
        return True


def test_each_message_is_acted_on_by_its_type(monkeypatch):
    exchanged = []
    monkeypatch.setattr(workers, "exchange_heartbeat", exchanged.append)
    state, runner, task = object(), Runner(), Task()
    assert workers.handle_message(PLAN, state, runner, "cpu") and runner.ran == [PLAN] and not exchanged
    assert workers.handle_message(HEARTBEAT, state, runner, "cpu") and exchanged == [state]
    assert workers.handle_message(task, state, runner, "cpu") and task.calls == [(state, runner, "cpu")]
    assert workers.handle_message(SHUTDOWN, state, runner, "cpu") is False
    assert runner.ran == [PLAN] and exchanged == [state]


@pytest.mark.parametrize("message", [None, "heartbeat", 0, [PLAN], {"token_ids": []}])
def test_what_is_not_a_message_is_refused_on_both_sides(message, monkeypatch):
    with pytest.raises(TypeError, match="is not a rank message"):
        rank_messages.send(message, single_rank_state())
    monkeypatch.setattr(rank_messages, "broadcast_from_driver", lambda obj, parallel: message)
    with pytest.raises(TypeError, match="is not a rank message"):
        rank_messages.receive(single_rank_state())


def test_the_messages_survive_the_wire_as_their_types(monkeypatch):
    wire = []
    monkeypatch.setattr(rank_messages, "broadcast_from_driver",
                        lambda obj, parallel: wire.append(pickle.dumps(obj)) if obj is not None
                        else pickle.loads(wire.pop(0)))
    for message in (PLAN, HEARTBEAT, SHUTDOWN):
        rank_messages.send(message, single_rank_state())
        got = rank_messages.receive(single_rank_state())
        assert type(got) is type(message) and got == message
    assert isinstance(Task(), RankTask) and not isinstance(PLAN, RankTask)
    assert check_message(Heartbeat()) == HEARTBEAT and check_message(Shutdown()) == SHUTDOWN


def test_rank_zero_and_the_ranks_speak_only_through_the_messages():
    """No bare sentinel (None, a string) and no broadcast outside rank_messages in the executor or the ranks."""
    for name in ("executor.py", "workers.py"):
        text = (ROOT / "kvshard" / "engine" / name).read_text()
        assert not re.search(r"==\s*HEARTBEAT|\"heartbeat\"|plan is None", text), name
    senders = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "kvshard").rglob("*.py")
                     if "broadcast_from_driver" in p.read_text())
    assert senders == ["kvshard/engine/rank_messages.py", "kvshard/parallel.py"], senders
