"""Collectives among the ranks of one CPU machine through a shared-memory segment.

Between processes on one host, gloo moves every message through TCP on the
loopback: measured here at 0.4 ms for a 1 KiB all-gather and 1.7 ms for a
1 KiB all-reduce between two ranks, more than a whole layer of a small model.
A decode step issues a few such collectives per layer (TP all-reduces, and
DCP's Q all-gather and merge), so on CPU they would decide the step time.

Here each rank of a group owns two slots of one shared segment and a flag:

  op number n:  wait until every peer has started op n-1 (so none still reads
                slot n % 2 from op n-2) -> copy my part into my slot n % 2 ->
                publish flag = n -> wait until every peer's flag >= n -> read.

Every rank sums peers' parts in rank order, so an all-reduce gives bit-identical
results on every rank. x86-64 keeps stores in order (the flag is written after
the data), so this is used there only; elsewhere, and for messages larger than
a slot, the gloo collective runs instead (the choice depends only on the
message size, so every rank makes the same one).

A waiting rank spins briefly (not at all when the group's ranks alone fill the
cores it may run on: there a spinning waiter holds the core its peer needs to
get to the op), then yields its core, then sleeps in naps of
up to 1 ms (10 ms after a second of waiting: an idle worker costs nearly no
CPU); it checks that its peers' processes are alive, so a dead rank makes it
raise within a fraction of a second instead of waiting forever.
"""

from __future__ import annotations

import mmap
import os
import platform
import time

import torch

from kvshard import envs

DEFAULT_SLOT_BYTES = envs.env("KVSHARD_SHM_SLOT_BYTES").default  # 4 MiB  # per rank and slot: a prefill chunk's activations of a small model
SPIN_ROUNDS = 2000  # polls before a waiter yields: the usual case is a peer a few microseconds behind
_FLAG_STRIDE = 8  # int64 words: each rank's flag and pid on a cache line of their own
_HEADER_WORDS_PER_RANK = 2 * _FLAG_STRIDE


class PeerGoneError(RuntimeError):
    """A peer of a shared-memory collective exited."""


def shm_supported() -> bool:
    return (
        envs.get("KVSHARD_SHM_COLLECTIVES")
        and platform.machine().lower() in ("x86_64", "amd64")
        and os.path.isdir("/dev/shm")
    )


def slot_bytes() -> int:
    return envs.get("KVSHARD_SHM_SLOT_BYTES")


def host_identity() -> str:
    """Ranks with the same identity can share memory."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{platform.node()}|{boot}"


def spin_rounds(group_size: int) -> int:
    """SPIN_ROUNDS when this process may run on more cores than the group has ranks, else 0."""
    return SPIN_ROUNDS if len(os.sched_getaffinity(0)) > group_size else 0


class ShmGroup:
    """One group's segment: `size` ranks, this one at `index`."""

    def __init__(self, name: str, size: int, index: int, create: bool, slot_bytes: int = DEFAULT_SLOT_BYTES) -> None:
        self.size = size
        self.index = index
        self.slot_bytes = slot_bytes
        self.path = f"/dev/shm/{name}"
        header = self._header_bytes = size * _HEADER_WORDS_PER_RANK * 8
        total = header + size * 2 * slot_bytes
        if create:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            try:
                os.posix_fallocate(fd, 0, total)  # fail now (ENOSPC), not with SIGBUS on first write
            except OSError:
                os.close(fd)
                os.unlink(self.path)
                raise
        else:
            fd = os.open(self.path, os.O_RDWR)
        try:
            self._map = mmap.mmap(fd, total)
        finally:
            os.close(fd)
        self._words = memoryview(self._map).cast("B").cast("q")  # flags and pids
        self._bytes = torch.frombuffer(self._map, dtype=torch.uint8, count=total - header, offset=header)
        # every rank's slot of one parity as one strided view [size, slot_bytes]: what an op received
        self._slots_of_parity = self._bytes.view(size, 2, slot_bytes).unbind(1)
        self._op = 0
        self._spin_rounds = spin_rounds(size)
        self._words[self._pid_word(index)] = os.getpid()
        self._words[self._flag_word(index)] = 0

    def unlink(self) -> None:
        """Remove the name once every rank has mapped it: nothing is left behind even on SIGKILL."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        self._bytes = self._slots_of_parity = None
        self._words.release()
        try:
            self._map.close()
        except BufferError:  # a tensor view is still alive somewhere; the mapping goes with the process
            pass

    # --- layout ------------------------------------------------------------------------------
    def _flag_word(self, rank: int) -> int:
        return rank * _HEADER_WORDS_PER_RANK

    def _pid_word(self, rank: int) -> int:
        return rank * _HEADER_WORDS_PER_RANK + _FLAG_STRIDE

    def _slot(self, rank: int, op: int) -> torch.Tensor:
        start = (rank * 2 + op % 2) * self.slot_bytes
        return self._bytes[start:start + self.slot_bytes]

    def op_counters(self) -> tuple[int, ...]:
        """The last op each rank of the group published, by index: the one behind is the one others wait for."""
        return tuple(self._words[self._flag_word(rank)] for rank in range(self.size))

    def fits(self, nbytes: int) -> bool:
        return nbytes <= self.slot_bytes

    # --- collectives ---------------------------------------------------------------------------
    def all_gather(self, x: torch.Tensor, timeout_s: float) -> torch.Tensor:
        """[*shape] from every rank -> [size, *shape] in rank order.

        The result views the segment (no copy out): it holds until this rank's next collective on
        the group, which is when a peer may first reuse its slot. Read or copy it before then.
        """
        nbytes = x.numel() * x.element_size()
        if nbytes == 0:  # every rank has the same shape: all of them skip the exchange
            return torch.empty((self.size, *x.shape), dtype=x.dtype)
        return self._received(self._post([x], timeout_s), 0, x)

    def all_reduce_(self, x: torch.Tensor, timeout_s: float) -> torch.Tensor:
        """Sum over ranks into x, in rank order (the same bits on every rank)."""
        gathered = self.all_gather(x, timeout_s)
        if x.is_contiguous():
            torch.sum(gathered, dim=0, out=x)
        else:
            x.copy_(gathered.sum(0))
        return x

    def reduce_scatter(self, x: torch.Tensor, timeout_s: float) -> torch.Tensor:
        """[size, *shape] from every rank -> [*shape]: the sum of every rank's slice number `index`."""
        piece = x[0].numel() * x.element_size()
        parts = self._received(self._post([x], timeout_s), self.index * piece, x[0])  # [size, *shape]
        out = parts[0].clone()
        for part in parts[1:]:
            out += part
        return out

    def all_to_all(self, chunks: list[torch.Tensor], timeout_s: float) -> torch.Tensor:
        """chunks[j] goes to rank j -> [size, *chunks[index].shape], what each rank sent this one.

        Every rank's chunks[j] has the same shape (and all chunks one dtype), so each chunk sits at
        the same offset of every rank's slot: a rank writes all of its chunks, then reads its own
        from each peer's slot (1/size of what an all-gather would read). The result views the
        segment, as all_gather's does.
        """
        sizes = [c.numel() * c.element_size() for c in chunks]
        mine = chunks[self.index]
        if sum(sizes) == 0:  # the same on every rank: all of them skip the exchange
            return torch.empty((self.size, *mine.shape), dtype=mine.dtype)
        return self._received(self._post(chunks, timeout_s), sum(sizes[:self.index]), mine)

    def broadcast_bytes(self, data: bytes | None, root: int, timeout_s: float | None) -> bytes | None:
        """Root's bytes to every rank; None when they do not fit a slot (the caller falls back)."""
        op = self._begin(timeout_s)
        header = 8
        if self.index == root:
            fits = len(data) + header <= self.slot_bytes
            slot = self._slot(root, op)
            slot[:header].view(torch.int64)[0] = len(data) if fits else -1
            if fits:
                slot[header:header + len(data)].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
            self._publish(op)  # the next op's _begin waits until every rank has read it
            return data if fits else None
        self._wait_for([root], op, timeout_s)
        slot = self._slot(root, op)
        length = int(slot[:header].view(torch.int64)[0])
        start = self._header_bytes + (root * 2 + op % 2) * self.slot_bytes + header
        received = self._map[start:start + length] if length >= 0 else None
        self._publish(op)
        return received

    # --- the protocol ------------------------------------------------------------------------
    def _begin(self, timeout_s: float | None) -> int:
        self._op += 1
        # my slot for this op was last read by peers in op - 2: each must have started op - 1
        self._wait_for([r for r in range(self.size) if r != self.index], self._op - 1, timeout_s)
        return self._op

    def _publish(self, op: int) -> None:
        self._words[self._flag_word(self.index)] = op

    def _received(self, op: int, offset: int, like: torch.Tensor) -> torch.Tensor:
        """What every rank wrote at `offset` of its slot in `op`, shaped as `like`: [size, *like.shape].
        A view: peers overwrite it from this rank's next op on."""
        nbytes = like.numel() * like.element_size()
        return self._slots_of_parity[op % 2][:, offset:offset + nbytes].view(like.dtype).view(self.size, *like.shape)

    def _post(self, tensors: list[torch.Tensor], timeout_s: float) -> int:
        """One op: write `tensors` one after the other into this rank's slot (copy_ from strided
        views: no packing copy first), publish, wait for every peer's; returns the op number."""
        op = self._begin(timeout_s)
        slot = self._slot(self.index, op)
        start = 0
        for x in tensors:
            size = x.numel() * x.element_size()
            if size:
                slot[start:start + size].view(x.dtype).view(x.shape).copy_(x)
            start += size
        self._publish(op)
        self._wait_for([r for r in range(self.size) if r != self.index], op, timeout_s)
        return op

    def _wait_for(self, ranks: list[int], op: int, timeout_s: float | None) -> None:
        words = self._words
        flags = [self._flag_word(r) for r in ranks]
        for _ in range(self._spin_rounds):
            if all(words[f] >= op for f in flags):
                return
        start = last_check = time.monotonic()
        nap = 0.0
        while not all(words[f] >= op for f in flags):
            now = time.monotonic()
            if now - last_check > 0.1:
                last_check = now
                self._check_peers(ranks)
                if timeout_s is not None and now - start > timeout_s:
                    raise TimeoutError(f"a shared-memory collective waited {timeout_s:.0f} s for its peers")
            if now - start < 0.002:
                os.sched_yield()
            else:  # a peer is busy, or idle (a worker waiting for the next plan): nap longer and longer
                nap = min(0.001 if now - start < 1.0 else 0.01, nap + 0.00005)
                time.sleep(nap)

    def _check_peers(self, ranks: list[int]) -> None:
        for rank in ranks:
            pid = self._words[self._pid_word(rank)]
            if not _process_alive(pid):
                raise PeerGoneError(f"rank {rank} of a shared-memory group (pid {pid}) exited")


def process_state(pid: int | None) -> str | None:
    """The process's state letter in /proc (R, S, T: stopped, Z: a zombie, ...), None if it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def _process_alive(pid: int) -> bool:
    return process_state(pid) not in (None, "Z", "X")
