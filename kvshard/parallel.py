"""Process groups (world = TP, DCP slices of it) and the collectives the model uses.

World size equals the TP size: DCP reuses the TP ranks (docs/design.md#parallel-layout).
Every helper is the identity on a group of one, so a single-rank run needs no
`torch.distributed` at all.
"""

from __future__ import annotations

import datetime
import logging
import os
import pickle
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from kvshard import envs
from kvshard.config import HEAD_SPLIT, REPLICATED, ParallelConfig
from kvshard.shm import ShmGroup, host_identity, shm_supported, slot_bytes

logger = logging.getLogger(__name__)

# A collective that waits longer than this means a peer is gone.


def collective_timeout() -> datetime.timedelta:
    """$KVSHARD_COLLECTIVE_TIMEOUT_S: how long the ranks wait to join, and in one collective."""
    return datetime.timedelta(seconds=envs.get("KVSHARD_COLLECTIVE_TIMEOUT_S"))


@dataclass(frozen=True)
class AttentionHeads:
    """The attention heads one rank works with (global head indices).

    `query`: heads whose query it computes; `kv`: KV heads it computes and caches (for its
    DCP group's share of the sequence); `group`: heads its DCP group attends for;
    `output`: heads overlapping its 1/N share of the group's output features.
    """

    num_heads: int  # H, the model's query heads
    num_kv_heads: int  # the model's KV heads (1 for MLA's latent)
    query: range
    kv: range
    group: range
    output: range
    gathers_queries: bool  # head-split with DCP: the group's queries are all-gathered

    @property
    def heads_per_kv_head(self) -> int:
        return self.num_heads // self.num_kv_heads


@dataclass(frozen=True)
class ParallelState:
    """Who this process is: its rank in the world, in TP and in its DCP group.

    Two tensor-parallel views of the same ranks (docs/design.md#parallel-layout): the MLP, embeddings and
    LM head split over all `tp_size` ranks; attention splits its heads `attention_tp_size` =
    tp / dcp ways, one share per DCP group.
    """

    rank: int
    world_size: int
    dcp_rank: int
    dcp_size: int
    dcp_group_index: int
    tp_group: Any = None  # torch.distributed group of all ranks, None when alone
    dcp_group: Any = None  # this rank's DCP group, None when dcp == 1
    control_group: Any = None  # gloo group for step plans (CPU objects), None when alone
    tp_shm: ShmGroup | None = None  # shared-memory collectives when every rank is on this CPU machine
    dcp_shm: ShmGroup | None = None
    attention_layout: str = HEAD_SPLIT  # HEAD_SPLIT or REPLICATED (the same thing when dcp == 1)
    dcp_comm_backend: str = "auto"  # ParallelConfig.dcp_comm_backend
    expert_parallel: bool = False  # ParallelConfig.enable_expert_parallel: whole routed experts on each rank

    @property
    def tp_rank(self) -> int:
        return self.rank

    @property
    def attention_tp_size(self) -> int:
        return self.world_size // self.dcp_size

    @property
    def attention_tp_rank(self) -> int:
        return self.dcp_group_index

    def attention_heads(self, num_heads: int, num_kv_heads: int) -> AttentionHeads:
        """The heads this rank computes for a model of `num_heads` query and `num_kv_heads` KV heads.

        A DCP group holds its 1/A share of the query heads and of the KV heads (one whole KV head,
        replicated over A / kv_heads groups, when A exceeds them). Head-split: each rank computes
        the query of its 1/T share and the group all-gathers them; replicated: each rank computes
        the whole group's.
        """
        a, g, n, r = self.attention_tp_size, self.attention_tp_rank, self.dcp_size, self.dcp_rank
        per_group = num_heads // a
        group = range(g * per_group, (g + 1) * per_group)
        if a <= num_kv_heads:
            kv = range(g * num_kv_heads // a, (g + 1) * num_kv_heads // a)
        else:
            head = g // (a // num_kv_heads)
            kv = range(head, head + 1)
        head_split = self.attention_layout != REPLICATED or n == 1
        per_rank = num_heads // self.world_size
        query = range(self.rank * per_rank, (self.rank + 1) * per_rank) if head_split else group
        # the output features [r/N, (r+1)/N) of the group's cover these heads (partly at either end)
        output = range(group.start + r * per_group // n, group.start + -(-(r + 1) * per_group // n))
        return AttentionHeads(num_heads, num_kv_heads, query, kv, group, output, head_split and n > 1)

    @property
    def tp_size(self) -> int:
        return self.world_size

    @property
    def is_driver(self) -> bool:
        return self.rank == 0


def single_rank_state() -> ParallelState:
    return ParallelState(rank=0, world_size=1, dcp_rank=0, dcp_size=1, dcp_group_index=0)


def uses_agent_store(master: tuple[str, int]) -> bool:
    """Under torchrun the agent of node 0 already hosts a store at MASTER_ADDR:MASTER_PORT: every rank joins it."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and master == (
        os.environ.get("MASTER_ADDR"), int(os.environ.get("MASTER_PORT", "0")))


def _agent_store_prefix() -> str:
    return f"kvshard/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"


def store_client(master: tuple[str, int], timeout_s: float) -> dist.Store:
    """A connection of its own to the ranks' rendezvous store (joined by `init_parallel`), under the same
    prefix: for the heartbeat of ranks a launcher started, which must not share the process group's client.
    Every call on it gives up after `timeout_s`; OSError (or torch's DistError) when the store cannot be reached."""
    host, port = master
    # a store that is gone is an OSError here, not a stack trace from torch at every attempt
    socket.create_connection((host, port), timeout=timeout_s).close()
    store = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s),
                          wait_for_workers=False)
    return dist.PrefixStore(_agent_store_prefix(), store) if uses_agent_store(master) else store


def heartbeat_key(rank: int) -> str:
    """The store key whose counter rank `rank` (started by a launcher) ticks; read without waiting by
    `store.add(key, 0)`."""
    return f"kvshard/heartbeat/{rank}"


_reserved_listeners: dict[tuple[str, int], socket.socket] = {}


def bind_rendezvous(host: str, port: int) -> socket.socket:
    """A listening socket for the rendezvous store on `host` alone; OSError if the address is taken."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((host, port))
        listener.listen(1024)
    except OSError:
        listener.close()
        raise
    return listener


def reserve_rendezvous(host: str, port: int) -> None:
    """Bind the rendezvous address now (a taken port is an error before any rank starts); `init_parallel`
    on rank 0 uses this socket."""
    _reserved_listeners[(host, port)] = bind_rendezvous(host, port)


def take_rendezvous_listener(host: str, port: int) -> socket.socket:
    reserved = _reserved_listeners.pop((host, port), None)
    return reserved if reserved is not None else bind_rendezvous(host, port)


def collective_backend(device_type: str, device_count: int, local_world: int) -> str:
    """NCCL where every rank of a node has a GPU of its own; gloo on CPUs and where ranks share a
    GPU (NCCL refuses two ranks on one device; gloo stages the tensors through host memory)."""
    if device_type != "cuda":
        return "gloo"
    if device_count < local_world:
        logger.warning("kvshard: %d ranks share %d GPU(s) on this node: their collectives run on gloo, not NCCL",
                       local_world, device_count)
        return "gloo"
    return "nccl"


# How ProcessGroupNCCL (torch >= 2.11 names them TORCH_NCCL_*) reacts to a collective that does not finish
# within the group's timeout, as its watchdog thread sees it. Rank 0 hosts the engine (and the server):
# 2 aborts the communicator and keeps the process, so the step's wait fails and the engine reports the
# dead rank; the other ranks take torch's default, 3, which ends the process. Non-blocking waits keep
# the stream asynchronous (and a CUDA graph's capture legal): the watchdog is what gives up.
NCCL_ERROR_HANDLING_DRIVER, NCCL_ERROR_HANDLING_WORKER = "2", "3"


def nccl_timeout() -> datetime.timedelta:
    """The NCCL groups' watchdog timeout: $KVSHARD_STEP_TIMEOUT, what the engine allows a step without
    progress (a collective waits on a peer for at most a step's imbalance)."""
    return datetime.timedelta(seconds=envs.get("KVSHARD_STEP_TIMEOUT"))


def nccl_environment(rank: int) -> dict[str, str]:
    """The TORCH_NCCL_* settings of rank `rank`, put into its environment before its first NCCL group
    (`init_parallel`); a value the user set is kept."""
    handling = NCCL_ERROR_HANDLING_DRIVER if rank == 0 else NCCL_ERROR_HANDLING_WORKER
    return {"TORCH_NCCL_ASYNC_ERROR_HANDLING": handling, "TORCH_NCCL_BLOCKING_WAIT": "0"}


def group_settings(backend: str, rank: int) -> tuple[datetime.timedelta, dict[str, str]]:
    """(timeout, environment) of the TP and DCP groups on `backend`: on NCCL the step timeout and
    `nccl_environment`; on gloo the collective timeout ($KVSHARD_COLLECTIVE_TIMEOUT_S) and nothing."""
    if backend == "nccl":
        return nccl_timeout(), nccl_environment(rank)
    return collective_timeout(), {}


def _local_world_size(world: int) -> int:
    """Ranks on this node: torchrun's LOCAL_WORLD_SIZE, else all of them (kvshard's own spawner)."""
    text = os.environ.get("LOCAL_WORLD_SIZE", "")
    return int(text) if text.isdigit() and int(text) > 0 else world


def init_parallel(
    parallel: ParallelConfig,
    rank: int,
    master: tuple[str, int],
    device: torch.device,
    check_peers: Callable[[], None] | None = None,
) -> ParallelState:
    """Join the world and build the groups. Every rank builds every group, in the same order.

    Rank 0 hosts the rendezvous store and waits for every rank to check in,
    calling `check_peers` while it waits so a rank that died on start-up is
    reported at once instead of after the store's time-out.
    """
    world = parallel.world_size
    if world == 1:
        return single_rank_state()
    global _TIMEOUT_S
    timeout = collective_timeout()
    _TIMEOUT_S = timeout.total_seconds()  # read once per process, as it joins: the collectives below use it
    host, port = master
    agent_store = uses_agent_store(master)
    hosts_store = rank == 0 and not agent_store
    listener = take_rendezvous_listener(host, port) if hosts_store else None
    # the store listens on the configured host only (torch's own listener would take every interface)
    store = dist.TCPStore(host, port, world, is_master=hosts_store, timeout=timeout,
                          wait_for_workers=False, master_listen_fd=listener.fileno() if listener else None)
    if listener is not None:
        listener.detach()  # the store owns the descriptor now
    if agent_store:  # keys of an earlier attempt (a torchrun restart) must not count as joined
        store = dist.PrefixStore(_agent_store_prefix(), store)
    store.set(f"kvshard/joined/{rank}", "1")
    if rank == 0:
        joined = [f"kvshard/joined/{r}" for r in range(world)]
        deadline = time.monotonic() + _TIMEOUT_S
        while not store.check(joined):
            if check_peers is not None:
                check_peers()
            if time.monotonic() > deadline:
                raise TimeoutError(f"not every one of the {world} ranks joined within {timeout}")
            time.sleep(0.05)
    backend = collective_backend(device.type, torch.cuda.device_count() if device.type == "cuda" else 0,
                                 _local_world_size(world))
    group_timeout, group_env = group_settings(backend, rank)
    for name, value in group_env.items():  # read by ProcessGroupNCCL when the group is made
        os.environ.setdefault(name, value)
    if backend == "nccl":
        torch.cuda.set_device(device)  # one device per rank: the NCCL communicators bind to it
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=group_timeout,
                            device_id=device if backend == "nccl" else None)
    # step plans and heartbeats (CPU objects) on gloo, waiting as long as the ranks do to join
    control = (dist.new_group(list(range(world)), backend="gloo", timeout=timeout) if backend != "gloo"
               else dist.group.WORLD)
    dcp_group = None
    for ranks in parallel.dcp_groups():
        group = dist.new_group(ranks, timeout=group_timeout) if len(ranks) > 1 else None
        if rank in ranks:
            dcp_group = group
    dcp = parallel.decode_context_parallel_size
    try:
        tp_shm, dcp_shm = _shared_memory_groups(parallel, rank, device, control)
    except BaseException:
        dist.destroy_process_group()  # a peer died while connecting: leave no process group behind
        raise
    return ParallelState(
        rank=rank,
        world_size=world,
        dcp_rank=rank % dcp,
        dcp_size=dcp,
        dcp_group_index=rank // dcp,
        tp_group=dist.group.WORLD,
        dcp_group=dcp_group,
        control_group=control,
        tp_shm=tp_shm,
        dcp_shm=dcp_shm,
        attention_layout=parallel.attention_layout,
        dcp_comm_backend=parallel.dcp_comm_backend,
        expert_parallel=parallel.enable_expert_parallel,
    )


def _shared_memory_groups(parallel: ParallelConfig, rank: int, device: torch.device, control) -> tuple:
    """(TP, DCP) shared-memory groups when every rank runs on this CPU machine, else (None, None).

    Every rank takes the same branch: the decisions are gathered before they are acted on.
    """
    world = parallel.world_size
    here = [None] * world
    dist.all_gather_object(here, (host_identity(), device.type == "cpu" and shm_supported()), group=control)
    if len({identity for identity, _ in here}) != 1 or not all(ok for _, ok in here):
        return None, None
    token = [(uuid.uuid4().hex[:12], slot_bytes()) if rank == 0 else None]  # rank 0's slot size for all
    dist.broadcast_object_list(token, src=0, group=control)
    name, slot = token[0]
    dcp = parallel.decode_context_parallel_size
    # a DCP group as wide as TP shares TP's segment (the same ranks issue the same ops in the same order)
    specs = [("tp", list(range(world)))] + [(f"dcp{i}", ranks) for i, ranks in enumerate(parallel.dcp_groups())
                                            if 1 < dcp < world]
    mine = {key: ranks for key, ranks in specs if rank in ranks}
    groups: dict[str, ShmGroup] = {}

    def agreed(step) -> bool:
        error = None
        try:
            step()
        except OSError as e:  # no /dev/shm space, ...
            error = str(e)
        outcomes = [None] * world
        dist.all_gather_object(outcomes, error, group=control)
        return all(o is None for o in outcomes)

    def attach(creating: bool) -> None:
        for key, ranks in mine.items():
            if (ranks[0] == rank) == creating:
                groups[key] = ShmGroup(f"kvshard-{name}-{key}", len(ranks), ranks.index(rank), create=creating,
                                       slot_bytes=slot)

    try:
        ok = agreed(lambda: attach(True)) and agreed(lambda: attach(False))
    finally:  # every rank has mapped its segments, given up, or died: drop the names either way
        for key, group in groups.items():
            if mine[key][0] == rank:
                group.unlink()
    if not ok:
        for group in groups.values():
            group.close()
        return None, None
    if dcp == world:
        return groups["tp"], groups["tp"]
    return groups["tp"], groups.get(next((k for k in mine if k != "tp"), ""))


def shutdown_parallel(state: ParallelState) -> None:
    for group in {id(g): g for g in (state.tp_shm, state.dcp_shm) if g is not None}.values():
        group.close()
    if state.world_size > 1 and dist.is_initialized():
        dist.destroy_process_group()


def shm_op_counters(state: ParallelState) -> tuple[tuple[int, ...], ...]:
    """Per shared-memory group of this rank, the last op each member published (empty without them).

    Rank 0's TP group lists every rank and its DCP group ranks 0..dcp-1, so an index there is the global rank.
    """
    groups = {id(g): g for g in (state.tp_shm, state.dcp_shm) if g is not None}
    return tuple(group.op_counters() for group in groups.values())


# --- collectives over TP -------------------------------------------------------

_TIMEOUT_S: float = envs.env("KVSHARD_COLLECTIVE_TIMEOUT_S").default  # until init_distributed reads it
# torch's names for the one-tensor all-gather and reduce-scatter: `*_single` in the torch pinned here, the
# older `all_gather_into_tensor` / `reduce_scatter_tensor` in a GPU machine's older torch (2.11 and on)
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _shm_for(group: ShmGroup | None, x: torch.Tensor) -> ShmGroup | None:
    """The shared-memory group if there is one and x fits its slots; else None (gloo)."""
    return group if group is not None and group.fits(x.numel() * x.element_size()) else None


def tp_all_reduce(x: torch.Tensor, state: ParallelState) -> torch.Tensor:
    """The sum over the TP group (in place where it can). In a graph torch.compile traces, the custom op
    `kvshard::tp_all_reduce` (kvshard/compilation.py) stands for it."""
    if state.tp_size > 1:
        if torch.compiler.is_compiling():
            return torch.ops.kvshard.tp_all_reduce(x)
        if (shm := _shm_for(state.tp_shm, x)) is not None:
            return shm.all_reduce_(x, _TIMEOUT_S)
        dist.all_reduce(x, group=state.tp_group)
    return x


def tp_all_reduce_into_new(x: torch.Tensor, state: ParallelState) -> torch.Tensor:
    """tp_all_reduce's sum into a new tensor, x left as it is (a custom op may not change its input)."""
    if state.tp_size == 1:
        return x.clone()
    if (shm := _shm_for(state.tp_shm, x)) is not None:
        return shm.all_gather(x, _TIMEOUT_S).sum(0)  # the kernel and order of shm.all_reduce_
    out = x.contiguous().clone()
    dist.all_reduce(out, group=state.tp_group)
    return out


def tp_gather_to_driver(x: torch.Tensor, state: ParallelState) -> torch.Tensor | None:
    """Concatenate each rank's last-dim slice on rank 0; other ranks get None."""
    if state.tp_size == 1:
        return x
    if (shm := _shm_for(state.tp_shm, x)) is not None:
        gathered = shm.all_gather(x, _TIMEOUT_S)
        return torch.cat(list(gathered.unbind(0)), dim=-1) if state.is_driver else None
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(state.tp_size)] if state.is_driver else None
    dist.gather(x, parts, dst=0, group=state.tp_group)
    return torch.cat(parts, dim=-1) if state.is_driver else None


def tp_all_gather_last_dim(x: torch.Tensor, state: ParallelState) -> torch.Tensor:
    if state.tp_size == 1:
        return x
    gathered = _all_gather_stacked(x, state.tp_size, state.tp_group, state.tp_shm)  # [tp, *shape]
    return torch.cat(list(gathered.unbind(0)), dim=-1)


# --- collectives over the DCP group ------------------------------------------------

def dcp_all_gather(x: torch.Tensor, state: ParallelState) -> torch.Tensor:
    """[*shape] -> [dcp, *shape], stacked in DCP-rank order."""
    if state.dcp_size == 1:
        return x.unsqueeze(0)
    return _all_gather_stacked(x, state.dcp_size, state.dcp_group, state.dcp_shm)


def dcp_reduce_scatter(x: torch.Tensor, state: ParallelState) -> torch.Tensor:
    """[dcp, *shape] -> [*shape]: sum over ranks of the slice that belongs to this rank."""
    if state.dcp_size == 1:
        return x[0]
    if (shm := _shm_for(state.dcp_shm, x)) is not None:
        return shm.reduce_scatter(x, _TIMEOUT_S)
    out = torch.empty(x.shape[1:], dtype=x.dtype, device=x.device)
    _reduce_scatter_single(out, x.contiguous().flatten(0, 1), group=state.dcp_group)
    return out


def dcp_all_to_all(chunks: list[torch.Tensor], state: ParallelState) -> torch.Tensor:
    """chunks[j] goes to DCP rank j -> [dcp, *chunks[dcp_rank].shape]: what each rank sent this one.

    The shape and dtype of chunks[j] must be the same on every rank (a function of j alone), so
    every rank knows what it receives without a size exchange.
    """
    if state.dcp_size == 1:
        return chunks[0].unsqueeze(0)
    shm = state.dcp_shm
    if shm is not None and shm.fits(sum(c.numel() * c.element_size() for c in chunks)):
        return shm.all_to_all(chunks, _TIMEOUT_S)
    mine = chunks[state.dcp_rank]
    send = torch.cat([c.reshape(-1) for c in chunks])
    received = torch.empty(state.dcp_size * mine.numel(), dtype=mine.dtype, device=mine.device)
    dist.all_to_all_single(received, send, output_split_sizes=[mine.numel()] * state.dcp_size,
                           input_split_sizes=[c.numel() for c in chunks], group=state.dcp_group)
    return received.view(state.dcp_size, *mine.shape)


def _all_gather_stacked(x: torch.Tensor, size: int, group, shm: ShmGroup | None) -> torch.Tensor:
    """[*shape] from each of `size` ranks -> [size, *shape] (flat along dim 0 on the wire)."""
    if _shm_for(shm, x) is not None:
        return shm.all_gather(x, _TIMEOUT_S)
    x = x.contiguous()
    gathered = torch.empty((size * x.shape[0], *x.shape[1:]) if x.dim() else (size,), dtype=x.dtype, device=x.device)
    _all_gather_single(gathered, x.view(-1) if not x.dim() else x, group=group)
    return gathered.view(size, *x.shape)


# --- control plane ---------------------------------------------------------------------

def broadcast_from_driver(obj: Any, state: ParallelState) -> Any:
    """Rank 0 sends a small picklable object (the step plan) to every rank."""
    if state.world_size == 1:
        return obj
    if state.tp_shm is not None:
        # a worker waits here while the engine idles: no time-out, only rank 0's exit ends the wait
        sent = state.tp_shm.broadcast_bytes(pickle.dumps(obj) if state.is_driver else None, 0, None)
        if sent is not None:
            return obj if state.is_driver else pickle.loads(sent)
    holder = [obj]
    dist.broadcast_object_list(holder, src=0, group=state.control_group)
    return holder[0]


def exchange_heartbeat(state: ParallelState, poll_s: float | None = None) -> None:
    """A round trip through every rank: one whose peer is gone raises instead of returning.

    (A broadcast alone can succeed into a dead peer's socket buffer.) With `poll_s`, rank 0 waits for it in a
    loop of naps of `poll_s` s rather than inside gloo, where a signal (Ctrl-C, SIGTERM) is handled only once
    the collective returns: at the collective timeout, for a rank that takes its time.
    """
    work = dist.all_reduce(torch.zeros(1), group=state.control_group, async_op=poll_s is not None)
    if work is not None:
        while not work.is_completed():
            time.sleep(poll_s)
        work.wait()  # its error, if it failed
