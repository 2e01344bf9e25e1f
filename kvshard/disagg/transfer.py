"""The data plane of a KV transfer: every rank of both instances moves its own share.

Rank 0 of each instance broadcasts a `TransferTask` (a `KVTransferPlan` and where
to report) to its ranks between two steps, like a step plan; each rank runs its
share on a thread of its own, so that its next step need not wait for another
instance, and says in rank 0's store how it went. Each rank computes the relayout (kv/relayout.py) from both
layouts and block tables and posts its point-to-point sends (producer) or
receives (consumer) on a process group that joins exactly the two instances'
ranks: producer ranks 0..Tp-1, then consumer ranks Tp..Tp+Tc-1. The group is made
directly from a `TCPStore` that the producer's rank 0 hosts (a prefix per
instance pair), not from the default world each instance already uses, and is
kept for the next transfers between the same pair. gloo carries CPU tensors,
NCCL GPU tensors.

A rank packs what one peer needs, all layers, into one buffer: one message per
(producer rank, consumer rank) pair and transfer.
"""

from __future__ import annotations

import datetime
import logging
import socket
import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist

from kvshard.engine.kv_connector import RankTask
from kvshard.kv.cache import KVCacheLayer
from kvshard.kv.relayout import InstanceLayout, RankTransfer, plan_relayout
from kvshard.parallel import ParallelState

logger = logging.getLogger("kvshard.disagg")


@dataclass(frozen=True)
class KVTransferPlan:
    """One request's KV moving between two instances; the same plan on every rank of one side."""

    group_name: str  # one per (producer, consumer) pair and generation
    store: tuple[str, int]  # the producer's rendezvous TCPStore
    is_producer: bool
    producer: InstanceLayout
    producer_blocks: list[int]
    consumer: InstanceLayout
    consumer_blocks: list[int]
    num_tokens: int
    timeout_s: float
    host: str = "127.0.0.1"  # where this side's transfer sockets listen (its kv_ip)

    def transfers(self) -> list[RankTransfer]:
        return plan_relayout(self.producer, self.producer_blocks, self.consumer, self.consumer_blocks,
                             self.num_tokens)


REPORT_PREFIX = "kvshard-rank-transfer"


@dataclass(frozen=True)
class TransferTask(RankTask):
    """What rank 0 broadcasts to its other ranks for one transfer: the plan, and where to say how it went."""

    plan: KVTransferPlan
    task_id: str  # unguessable: the report keys
    report: tuple[str, int] | None  # rank 0's store (None when the instance has one rank)

    def run_on_rank(self, parallel: ParallelState, runner, device: torch.device) -> None:
        """A rank > 0 (engine/workers.py): its share runs on a thread; the rank goes back to its steps."""
        threading.Thread(target=self._share, args=(parallel.rank, runner.kv_caches, device),
                         name="kvshard-kv-transfer", daemon=True).start()

    def _share(self, rank: int, kv_caches: list[KVCacheLayer], device: torch.device) -> None:
        ok = run_transfer(self.plan, rank, kv_caches, WORKER_GROUPS, device)
        try:
            store = dist.TCPStore(self.report[0], self.report[1], is_master=False, wait_for_workers=False,
                                  timeout=datetime.timedelta(seconds=self.plan.timeout_s))
            store.set(f"{REPORT_PREFIX}/{self.task_id}/{rank}", "1" if ok else "0")
        except Exception as error:  # rank 0 gives up waiting and fails the transfer
            logger.warning("rank %d cannot report KV transfer %s: %s", rank, self.plan.group_name, error)

    def wait_for_ranks(self, world_size: int) -> bool:
        """Rank 0, off the engine thread: True if every rank > 0 moved its share. Each rank's share gives up
        after about twice the plan's timeout (making the group, then the messages)."""
        keys = [f"{REPORT_PREFIX}/{self.task_id}/{rank}" for rank in range(1, world_size)]
        timeout = datetime.timedelta(seconds=2 * self.plan.timeout_s + 30)
        try:
            store = dist.TCPStore(self.report[0], self.report[1], is_master=False, wait_for_workers=False,
                                  timeout=timeout)  # a connection of its own: waits on others' run side by side
            store.wait(keys, timeout)
            ok = all(store.get(key) == b"1" for key in keys)
            for key in keys:
                store.delete_key(key)
            return ok
        except Exception as error:
            logger.warning("the ranks' shares of KV transfer %s never reported: %s", self.plan.group_name, error)
            return False


class PairGroups:
    """This rank's process groups with other instances, by name, made on first use. Threads of the rank
    use it side by side: each group has a store connection of its own."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._groups: dict[str, dist.ProcessGroup] = {}

    def get(self, plan: KVTransferPlan, rank: int, device: torch.device) -> dist.ProcessGroup:
        with self._lock:
            group = self._groups.get(plan.group_name)
        if group is not None:
            return group
        timeout = datetime.timedelta(seconds=plan.timeout_s)
        store = dist.TCPStore(plan.store[0], plan.store[1], is_master=False, timeout=timeout,
                              wait_for_workers=False)
        size = plan.producer.tp + plan.consumer.tp
        member = rank if plan.is_producer else plan.producer.tp + rank
        prefixed = dist.PrefixStore(plan.group_name, store)
        if device.type == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            group = dist.ProcessGroupNCCL(prefixed, member, size, options)
        else:
            options = dist.ProcessGroupGloo._Options()
            options._timeout = timeout
            options._devices = [dist.ProcessGroupGloo.create_device(hostname=plan.host)]  # not every interface
            group = dist.ProcessGroupGloo(prefixed, member, size, options)
        with self._lock:
            self._groups[plan.group_name] = group
        return group

    def drop(self, plan: KVTransferPlan) -> None:
        """Forget a group whose peer failed, and its store connection (the producer may have restarted):
        the next transfer with that instance makes new ones."""
        with self._lock:
            self._groups.pop(plan.group_name, None)


WORKER_GROUPS = PairGroups()  # a rank > 0's groups with the instances this one exchanges KV with


def bound_store(host: str, port: int) -> dist.TCPStore:
    """A master `TCPStore` that listens on `host` only (TCPStore alone listens on every interface)."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, port))
        listener.listen(128)
    except OSError:
        listener.close()
        raise
    # the store owns the socket from here: detached, Python never closes it under the store
    return dist.TCPStore(host, listener.getsockname()[1], is_master=True, wait_for_workers=False,
                         master_listen_fd=listener.detach(), use_libuv=False)


def run_transfer(plan: KVTransferPlan, rank: int, kv_caches: list[KVCacheLayer], groups: PairGroups,
                 device: torch.device) -> bool:
    """This rank's share of the transfer; False (and the group dropped) if a peer failed or timed out. Runs on
    a thread of the rank's own (the CUDA device is per thread: set here)."""
    try:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        group = groups.get(plan, rank, device)
        works, received = [], []
        # the tag is the transfer's place in the whole plan, which both sides compute alike
        for tag, t in enumerate(plan.transfers()):
            if (t.src_rank if plan.is_producer else t.dst_rank) != rank:
                continue
            if plan.is_producer:
                buffer = _pack(kv_caches, t, t.src_slots.to(device), t.src_heads(plan.producer))
                works.append(group.send([buffer], plan.producer.tp + t.dst_rank, tag))
            else:
                buffer = torch.empty(_packed_numel(kv_caches, t), dtype=kv_caches[0].key.dtype, device=device)
                works.append(group.recv([buffer], t.src_rank, tag))
                received.append((t, buffer))
        for work in works:
            work.wait()
        for t, buffer in received:
            _unpack(kv_caches, t, t.dst_slots.to(device), t.dst_heads(plan.consumer), buffer)
        return True
    except Exception as error:  # a peer died or never came: the instance goes on, this request fails
        logger.warning("KV transfer %s failed on rank %d: %s", plan.group_name, rank, error)
        groups.drop(plan)
        return False


def _tensors(layer: KVCacheLayer) -> list[torch.Tensor]:
    # MLA's value is a view of the latent: moving the key moves it
    return [layer.key] if layer.value_is_view else [layer.key, layer.value]


def _packed_numel(kv_caches: list[KVCacheLayer], t: RankTransfer) -> int:
    n, h = t.dst_slots.numel(), len(t.heads)
    return sum(n * h * x.shape[-1] for layer in kv_caches for x in _tensors(layer))


def _pack(kv_caches: list[KVCacheLayer], t: RankTransfer, slots: torch.Tensor, heads: slice) -> torch.Tensor:
    # [n, h, d] per layer and tensor, flattened into one message
    return torch.cat([x[slots, heads].flatten() for layer in kv_caches for x in _tensors(layer)])


def _unpack(kv_caches: list[KVCacheLayer], t: RankTransfer, slots: torch.Tensor, heads: slice,
            buffer: torch.Tensor) -> None:
    offset, n, h = 0, slots.numel(), len(t.heads)
    for layer in kv_caches:
        for x in _tensors(layer):
            size = n * h * x.shape[-1]
            x[slots, heads] = buffer[offset: offset + size].view(n, h, x.shape[-1])
            offset += size
