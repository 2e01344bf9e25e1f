"""The shared-memory collectives on their own: same answers as the arithmetic, fall-back signal for
messages larger than a slot, and a dead peer makes a waiting rank raise instead of hang."""

from __future__ import annotations

import multiprocessing
import os
import time
import uuid

import pytest
import torch

from kvshard.shm import PeerGoneError, ShmGroup, shm_supported

pytestmark = pytest.mark.skipif(not shm_supported(), reason="shared-memory collectives are used on x86-64 Linux only")

SIZE = 3
SLOT = 4096


def _open(name: str, index: int, barrier) -> ShmGroup:
    group = ShmGroup(name, SIZE, index, create=True, slot_bytes=SLOT) if index == 0 else None
    barrier.wait()
    if index:
        group = ShmGroup(name, SIZE, index, create=False, slot_bytes=SLOT)
    barrier.wait()
    if index == 0:
        group.unlink()
    return group


def _collectives(name: str, index: int, barrier, results) -> None:
    group = _open(name, index, barrier)
    out = {}
    for step in range(4):  # several rounds: both slots, reused
        x = torch.arange(6, dtype=torch.float32).view(2, 3) + 10 * index + step
        out[f"gather{step}"] = group.all_gather(x, 10).tolist()
        out[f"reduce{step}"] = group.all_reduce_(x.clone(), 10).tolist()
        per_rank = torch.full((SIZE, 2), float(index + 1)) * torch.arange(1, SIZE + 1).view(SIZE, 1)
        out[f"scatter{step}"] = group.reduce_scatter(per_rank, 10).tolist()
        out[f"bcast{step}"] = group.broadcast_bytes(b"plan %d" % step if index == 0 else None, 0, 10)
        # rank j receives [j, 2] from each sender (nothing for rank 0), sent from strided views
        chunks = [_a2a_chunk(index, dest, step).t().contiguous().t() for dest in range(SIZE)]
        out[f"a2a{step}"] = group.all_to_all(chunks, 10).tolist()
    out["too_big"] = group.broadcast_bytes(b"x" * SLOT if index == 0 else None, 0, 10)
    out["fits"] = (group.fits(SLOT), group.fits(SLOT + 1))
    results[index] = out
    barrier.wait()


def _a2a_chunk(sender: int, dest: int, step: int) -> torch.Tensor:
    return torch.arange(dest * 2, dtype=torch.float32).view(dest, 2) + 100 * sender + 10 * dest + step


def _run_ranks(target) -> tuple[dict, list[int], str]:
    """Run `target(name, index, barrier, results)` in SIZE processes: (results, exit codes, segment name)."""
    context = multiprocessing.get_context("spawn")
    manager = context.Manager()
    results, barrier = manager.dict(), context.Barrier(SIZE)
    name = f"kvshard-test-{uuid.uuid4().hex[:8]}"
    procs = [context.Process(target=target, args=(name, i, barrier, results)) for i in range(SIZE)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    return dict(results), [p.exitcode for p in procs], name


def test_collectives_give_the_arithmetic_on_every_rank():
    results, exit_codes, name = _run_ranks(_collectives)
    assert exit_codes == [0] * SIZE
    assert not os.path.exists(f"/dev/shm/{name}")
    for index in range(SIZE):
        out = results[index]
        for step in range(4):
            parts = [torch.arange(6, dtype=torch.float32).view(2, 3) + 10 * r + step for r in range(SIZE)]
            assert out[f"gather{step}"] == torch.stack(parts).tolist()
            assert out[f"reduce{step}"] == sum(parts).tolist()
            # rank r sends (r + 1) * [1, 2, 3] per row: this rank's row sums (1 + 2 + 3) * (index + 1)
            assert out[f"scatter{step}"] == [6.0 * (index + 1)] * 2
            assert out[f"bcast{step}"] == b"plan %d" % step
            assert out[f"a2a{step}"] == torch.stack([_a2a_chunk(r, index, step) for r in range(SIZE)]).tolist()
        assert out["too_big"] is None  # every rank learns to fall back
        assert out["fits"] == (True, False)


def _wait_for_the_dead(name: str, index: int, barrier, results) -> None:
    group = _open(name, index, barrier)
    if index == 2:
        os._exit(0)  # gone without a word
    start = time.monotonic()
    try:
        group.all_gather(torch.zeros(4), 30)
        results[index] = "returned"
    except PeerGoneError as error:
        results[index] = (str(error), time.monotonic() - start)


def test_a_dead_peer_makes_the_others_raise_quickly():
    results, _, _ = _run_ranks(_wait_for_the_dead)
    for index in (0, 1):
        message, waited = results[index]
        assert "rank 2" in message and "exited" in message
        assert waited < 5
