"""What moving KV blocks costs with one transfer backend, measured in this process
(`pdserve profile`): the KV of n blocks of an engine's cache moved into a decode worker's
cache (shm: a shared segment written layer by layer as P does; tcp: gathered, sent over a
loopback ZeroMQ socket, scattered; cuda_ipc: a copy between two caches on the device)."""
from __future__ import annotations

import os
import time
from collections.abc import Callable

import torch

from pdserve.common.config import EngineConfig
from pdserve.common.engine.kv_layout import kv_cache_tensor
from pdserve.common.engine.model_runner import kv_cache_shape
from pdserve.common.engine.profile import ProfilePlan
from pdserve.common.models.precision import kv_cache_dtype
from pdserve.kv_transfer.base import copy_blocks

MEASURED_BACKENDS = ("shm", "tcp", "cuda_ipc")


def measure_transfer(config: EngineConfig, src: torch.Tensor, backend: str, plan: ProfilePlan) -> list[tuple[int, float]]:
    """Seconds to move the KV of n blocks of `src` into another cache, per n."""
    shape, dtype = kv_cache_shape(config, max(plan.blocks)), kv_cache_dtype(config.device)
    move, close = _mover(backend, src, shape, dtype, config)
    out = []
    try:
        for n in sorted(set(plan.blocks)):
            ids = list(range(n))
            for rep in range(plan.reps + 1):
                t0 = time.perf_counter()
                move(ids)
                if rep:
                    out.append((n, time.perf_counter() - t0))
    finally:
        close()
    return out


def _mover(backend: str, src: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, config: EngineConfig
           ) -> tuple[Callable[[list[int]], None], Callable[[], None]]:
    """(move(block ids), close()) for one backend, moving blocks i -> i."""
    layers = range(config.model.num_layers)
    if backend == "shm":
        from multiprocessing import resource_tracker

        from pdserve.kv_transfer.shm import ShmReceiver, ShmSender
        receiver = ShmReceiver(shape, dtype, f"profile-{os.getpid()}")
        sender = ShmSender(src, receiver.backend_info())
        # the sender, made for another process, took the segment off this process's
        # resource tracker; here the receiver owns it, and unlinks it on close
        resource_tracker.register(receiver._shm._name, "shared_memory")  # type: ignore[union-attr]

        def close_shm() -> None:
            sender.close()
            receiver.close()
        return (lambda ids: [sender.write_layer(layer, ids, ids) for layer in layers]), close_shm
    if backend == "tcp":
        return _tcp_mover(src, shape, dtype)
    if backend == "cuda_ipc":
        dst = kv_cache_tensor(shape, dtype, src.device)

        def move_device(ids: list[int]) -> None:
            copy_blocks(dst, src, ids, ids)
            torch.cuda.synchronize(src.device)
        return move_device, lambda: None
    raise AssertionError(f"no mover for {backend!r}")  # the caller checked it against MEASURED_BACKENDS


def _tcp_mover(src: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype
               ) -> tuple[Callable[[list[int]], None], Callable[[], None]]:
    import zmq

    from pdserve.common.wire.messages import KVReady
    from pdserve.kv_transfer.tcp import TcpReceiver, TcpSender
    ctx = zmq.Context()
    p_sock, d_sock = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    port = p_sock.bind_to_random_port("tcp://127.0.0.1")
    d_sock.connect(f"tcp://127.0.0.1:{port}")
    sender, receiver = TcpSender(src, {}), TcpReceiver(kv_cache_tensor(shape, dtype, "cpu"))

    def move(ids: list[int]) -> None:
        ready = KVReady("profile", 0, len(ids))
        p_sock.send_multipart(sender.send(ready, ids, ids), copy=False)
        receiver.receive(ready, d_sock.recv_multipart(), ids, {})

    def close() -> None:
        p_sock.close(0)
        d_sock.close(0)
        ctx.term()
    return move, close
