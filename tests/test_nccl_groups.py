"""The process groups on CUDA (kvshard/parallel.py), checked without a GPU: `init_parallel` runs with
torch.distributed's calls replaced by recorders, so what it asks of them (backend, timeouts, the
TORCH_NCCL_* environment as it stands when a group is made, the device) is seen, not what NCCL does."""

from __future__ import annotations

import datetime
import os

import pytest
import torch
import torch.distributed as dist

from kvshard import parallel
from kvshard.config import ParallelConfig

NCCL_VARIABLES = ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_BLOCKING_WAIT")


class _Store:
    """A rendezvous store where every rank has already joined."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def set(self, key, value) -> None:
        pass

    def check(self, keys) -> bool:
        return True


@pytest.fixture
def recorded(monkeypatch):
    """init_parallel's calls into torch.distributed, recorded: [(call, backend, timeout, env, extra)]."""
    calls = []
    for name in NCCL_VARIABLES:
        monkeypatch.setenv(name, "unset-marker")
        monkeypatch.delenv(name)  # absent now, and absent again after the test
    monkeypatch.setenv("KVSHARD_STEP_TIMEOUT", "7")
    monkeypatch.setenv("KVSHARD_COLLECTIVE_TIMEOUT_S", "90")
    monkeypatch.setattr(parallel, "_TIMEOUT_S", parallel._TIMEOUT_S)  # init_parallel sets it for the process
    monkeypatch.setattr(parallel, "take_rendezvous_listener", lambda host, port: None)
    monkeypatch.setattr(dist, "TCPStore", _Store)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append(("set_device", device)))
    monkeypatch.setattr(parallel, "_shared_memory_groups", lambda *args: (None, None))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)

    def env():
        return {name: os.environ.get(name) for name in NCCL_VARIABLES}

    def init_process_group(backend, store=None, rank=0, world_size=1, timeout=None, device_id=None):
        calls.append(("init", backend, timeout, env(), device_id))

    def new_group(ranks, timeout=None, backend=None):
        calls.append(("new_group", backend, timeout, env(), tuple(ranks)))
        return f"group{tuple(ranks)}"

    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    monkeypatch.setattr(dist, "new_group", new_group)
    return calls


def _init(rank: int, device: str, tp: int = 2, dcp: int = 2):
    config = ParallelConfig(tensor_parallel_size=tp, decode_context_parallel_size=dcp, dcp_kv_interleave_size=1)
    return parallel.init_parallel(config, rank, ("127.0.0.1", 1), torch.device(device))


@pytest.mark.parametrize("rank,handling", [(0, "2"), (1, "3")])
def test_on_cuda_the_tp_and_dcp_groups_are_nccl_with_the_step_timeout_and_torch_nccl_settings(recorded, rank,
                                                                                               handling):
    state = _init(rank, f"cuda:{rank}", tp=2, dcp=2)
    step = datetime.timedelta(seconds=7)
    nccl_env = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": handling, "TORCH_NCCL_BLOCKING_WAIT": "0"}
    assert recorded[0] == ("set_device", torch.device(f"cuda:{rank}"))
    assert recorded[1] == ("init", "nccl", step, nccl_env, torch.device(f"cuda:{rank}"))
    # the control plane on gloo, waiting as long as the ranks wait to join; the DCP group on the default (NCCL)
    assert recorded[2] == ("new_group", "gloo", datetime.timedelta(seconds=90), nccl_env, (0, 1))
    assert recorded[3] == ("new_group", None, step, nccl_env, (0, 1))
    assert state.dcp_group == "group(0, 1)" and state.control_group == "group(0, 1)"


def test_a_user_setting_of_torch_nccl_is_kept(recorded, monkeypatch):
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    _init(0, "cuda:0")
    assert recorded[1][3]["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"


@pytest.mark.parametrize("device,local_world", [("cpu", "2"), ("cuda:0", "4")], ids=["cpu", "4-ranks-on-2-gpus"])
def test_gloo_groups_keep_the_collective_timeout_and_touch_no_nccl_setting(recorded, monkeypatch, device,
                                                                           local_world):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", local_world)
    _init(0, device, tp=4, dcp=2)
    collective = datetime.timedelta(seconds=90)
    unset = dict.fromkeys(NCCL_VARIABLES)
    assert [c for c in recorded if c[0] == "set_device"] == []
    assert recorded[0] == ("init", "gloo", collective, unset, None)
    # no separate control group: the world is gloo already; the two DCP groups with the collective timeout
    assert recorded[1:] == [("new_group", None, collective, unset, (0, 1)),
                            ("new_group", None, collective, unset, (2, 3))]


def test_the_shared_memory_collectives_are_for_cpu_ranks_only(monkeypatch):
    # every rank reports the same host; on a CUDA device none takes the shared-memory path (and nothing
    # further is exchanged: a broadcast here would fail, no process group exists)
    monkeypatch.setattr(dist, "all_gather_object",
                        lambda out, obj, group=None: out.__setitem__(slice(None), [obj] * len(out)))
    monkeypatch.setattr(parallel, "shm_supported", lambda: True)
    config = ParallelConfig(tensor_parallel_size=2, decode_context_parallel_size=2, dcp_kv_interleave_size=1)
    assert parallel._shared_memory_groups(config, 0, torch.device("cuda:0"), None) == (None, None)
