"""Transfer over torch.distributed point-to-point: gloo on CPU, NCCL on GPU, same code.
P gathers the blocks into one contiguous buffer and `isend`s it; D, on the KVReady that
precedes the data, posts the matching `irecv` and goes on decoding; once it completes,
D scatters the buffer into the reserved blocks. Each P/D pair keeps FIFO order, so the
n-th KVReady matches the n-th send."""
from __future__ import annotations

import datetime
import math
import os
import socket
import threading
from urllib.parse import urlsplit

import torch
import torch.distributed as dist

from pdserve.common.config import parse_dtype
from pdserve.common.wire.messages import KVReady
from pdserve.kv_transfer.base import KVReceiver, KVSender, PendingReceive, TransferError, dtype_name, gather_kv, scatter_kv


def init_group(backend: str, init_method: str, rank: int, world_size: int, device: str = "cpu") -> None:
    """Join the transfer process group (every P and D of a deployment, ranks by launcher).

    `init_method` is tcp://HOST:PORT. Rank 0's TCPStore listens on HOST only: torch's own
    store binds every interface whatever host it is given, so rank 0 binds the listening
    socket itself and hands torch its fd. On a loopback HOST gloo's pairs stay on `lo` too.

    NCCL is bound to `device` and its communicator made here, while every rank is in this
    call. Left lazy, the first isend would make a two-rank communicator, which blocks until
    the peer joins it; D joins only in its irecv, after the KVReady that P sends once the
    isend returns: a deadlock (seen on an H100, docs/gpu.md). Made here, a failure (two
    ranks on one GPU, say) stops the worker at start-up with NCCL's reason."""
    if dist.is_initialized():
        return
    url = urlsplit(init_method)
    if url.scheme != "tcp" or not url.hostname or not url.port:
        raise ValueError(f"dist_init must be tcp://host:port, got {init_method!r}")
    timeout = datetime.timedelta(seconds=120)
    listen = None
    if rank == 0:
        listen = socket.create_server((url.hostname, url.port), backlog=128, reuse_port=False)
    try:
        store = dist.TCPStore(url.hostname, url.port, world_size, rank == 0, timeout=timeout,
                              wait_for_workers=False, **({"master_listen_fd": listen.fileno()} if listen else {}))
    finally:
        if listen is not None:
            listen.detach()  # the store owns the fd now
    if backend == "gloo" and url.hostname in ("127.0.0.1", "localhost"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # this process's own setting, read by gloo below
    bound: dict = {}
    if backend == "nccl":
        torch.cuda.set_device(torch.device(device))
        bound = {"device_id": torch.device(device)}  # eager: the communicator is made now, by all ranks
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout, **bound)


class Waiter:
    """Completion of a point-to-point Work, observable without blocking. gloo's send and
    recv Works never report `is_completed()` until someone waits on them, so a daemon
    thread waits (torch releases the GIL there) and sets an event."""

    def __init__(self, work: dist.Work) -> None:
        self.error: Exception | None = None
        self.event = threading.Event()
        threading.Thread(target=self._wait, args=(work,), name="p2p-wait", daemon=True).start()

    def _wait(self, work: dist.Work) -> None:
        try:
            work.wait()
        except Exception as e:  # the peer died or the group timed out: reported by the owner
            self.error = e
        finally:
            self.event.set()

    def done(self) -> bool:
        return self.event.is_set()


class DistReceiver(KVReceiver):
    def __init__(self, kv_cache: torch.Tensor, backend: str) -> None:
        super().__init__(kv_cache)
        self.backend = backend

    def backend_info(self) -> dict:
        return {"rank": dist.get_rank()}

    def receive(self, ready: KVReady, frames: list[bytes], dst_blocks: list[int], peer: dict) -> PendingReceive:
        super().receive(ready, frames, dst_blocks, peer)
        want = self.expected_shape(len(dst_blocks))
        if ready.payload_shape != want or ready.payload_dtype != dtype_name(self.kv_cache.dtype):
            # the data is on its way regardless: drain it so the pair stays in step
            try:
                sink_dtype = parse_dtype(ready.payload_dtype)
            except ValueError:
                sink_dtype = None
            if sink_dtype is not None and math.prod(ready.payload_shape) > 0:
                sink = torch.empty(ready.payload_shape, dtype=sink_dtype, device=self.kv_cache.device)
                dist.recv(sink, src=peer["rank"])
            raise TransferError(f"request {ready.request_id}: payload {ready.payload_shape} "
                                f"{ready.payload_dtype}; expected {want} {self.kv_cache.dtype}")
        buf = torch.empty(want, dtype=self.kv_cache.dtype, device=self.kv_cache.device)
        waiter = Waiter(dist.irecv(buf, src=peer["rank"]))

        def land() -> None:
            if waiter.error is not None:
                raise TransferError(f"request {ready.request_id}: receive failed: {waiter.error}")
            scatter_kv(self.kv_cache, dst_blocks, buf)

        return PendingReceive(waiter.done, land)


class DistSender(KVSender):
    def __init__(self, kv_cache: torch.Tensor, peer_info: dict, backend: str) -> None:
        super().__init__(kv_cache, peer_info)
        self.backend = backend
        self._pending: list[tuple[Waiter, torch.Tensor]] = []  # buffers kept alive until sent

    def send(self, ready: KVReady, src: list[int], dst: list[int]) -> list:
        buf = gather_kv(self.kv_cache, src)
        ready.payload_shape = list(buf.shape)
        ready.payload_dtype = dtype_name(buf.dtype)
        self._pending.append((Waiter(dist.isend(buf, dst=self.peer_info["rank"])), buf))
        self.bytes_sent += buf.numel() * buf.element_size()
        return []

    def poll(self) -> None:
        self._pending = [(w, b) for w, b in self._pending if not w.done()]

    def close(self) -> None:
        for waiter, _ in self._pending:
            waiter.event.wait()
        self._pending = []
