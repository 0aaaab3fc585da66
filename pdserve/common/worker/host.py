"""Which host a process is on, for deciding "same host": a host id, never a hostname or
an IP. Network namespaces share a hostname and may share addresses, yet a process in one
cannot reach another's loopback or see its pids as its peers' -- so two namespaces are
two hosts. The id is `--host-id` when given, else the kernel's boot id plus the network
namespace's inode (both read from /proc; the pid namespace is assumed to follow the
network namespace, as it does under `ip netns exec` and in containers)."""
from __future__ import annotations

import os
import socket

from pdserve.common.config import BACKENDS

BOOT_ID = "/proc/sys/kernel/random/boot_id"
NET_NS = "/proc/self/ns/net"


def local_host_id(override: str = "") -> str:
    """`override` if given, else "<boot id>/<netns inode>"; on a system without /proc,
    the hostname (the only identity left)."""
    if override:
        return override
    try:
        with open(BOOT_ID) as f:
            boot = f.read().strip()
        return f"{boot}/{os.stat(NET_NS).st_ino}"
    except OSError:
        return socket.gethostname()


def same_host(mine: str, theirs: object) -> bool:
    """Whether a peer announcing host id `theirs` (from the wire: any type) shares our
    host; an absent or malformed id is another host (its pid means nothing here)."""
    return isinstance(theirs, str) and bool(theirs) and theirs == mine


def pair_transport(requested: str, device: str, same: bool | None) -> str:
    """The KV transport a P/D pair uses. `auto`: the same-host fast path (cuda_ipc on
    GPU, shm on CPU) when both are on one host, tcp when they are not or when it is not
    known at start-up (`same` None: a joined worker, whose peers may be anywhere).
    Anything else is the name asked for."""
    if requested != "auto":
        return requested
    if same:
        return "cuda_ipc" if device.startswith("cuda") else "shm"
    return "tcp"


def resolve_backend(name: str, device: str) -> str:
    """`auto` picks the same-host fast path for the device: cuda_ipc on GPU, shm on CPU
    (every worker of `pdserve serve` is on one host; a joined worker resolves `auto` with
    common.worker.host.pair_transport before it gets here)."""
    if name == "auto":
        return pair_transport(name, device, same=True)
    if name not in BACKENDS:
        raise ValueError(f"unknown kv transfer backend {name!r} (choose from auto, {', '.join(BACKENDS)})")
    gpu_only = {"cuda_ipc", "nccl"}
    if name in gpu_only and not device.startswith("cuda"):
        raise ValueError(f"kv transfer backend {name!r} needs a CUDA device, workers run on {device!r}")
    if name == "shm" and device.startswith("cuda"):
        raise ValueError("kv transfer backend 'shm' is for CPU workers; use cuda_ipc on GPUs")
    return name


def cross_host_refusal(backend: str, mine: str, theirs: object) -> str | None:
    """Why a P must refuse a D's handshake for a backend that shares memory (shm, CUDA
    IPC) when they are on two hosts, or None."""
    if backend in ("shm", "cuda_ipc") and not same_host(mine, theirs):
        return (f"kv transfer {backend!r} shares memory, so both workers must be on one host; this pair is on "
                f"two (host ids {mine!r} and {theirs!r}): use --kv-transfer tcp (or auto on a joined worker)")
    return None
