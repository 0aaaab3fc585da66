"""The router's worker table (router/core/registry.py): registration, heartbeats, KV events,
liveness. Time is passed in, so these run without sockets or sleeps."""
from __future__ import annotations

import dataclasses
import random

from pdserve.common.hashing import cacheable_prefix_hashes
from pdserve.common.wire.messages import WorkerStatus
from pdserve.router.core.policy import choose_prefill
from pdserve.router.core.registry import WorkerRegistry, refusal
from tests.support.router_harness import hello

BLOCK = 16


def status(wid: str, role: str = "prefill", free: int = 64, total: int = 64, waiting: int = 0, running: int = 0,
           stored: list[int] = (), evicted: list[int] = ()) -> WorkerStatus:
    return WorkerStatus(worker_id=wid, role=role, waiting=waiting, running=running, free_blocks=free,
                        total_blocks=total, kv_stored=list(stored), kv_evicted=list(evicted))


def live_ids(reg: WorkerRegistry, roles=("prefill", "decode", "colocated")) -> set[str]:
    return {e.worker_id for e in reg.live(roles)}


def test_hello_registers_by_role():
    reg = WorkerRegistry()
    reg.hello(hello("p0"), now=0.0)
    reg.hello(hello("d0", role="decode"), now=0.0)
    reg.hello(hello("c0", role="colocated"), now=0.0)
    assert live_ids(reg, ("prefill",)) == {"p0"}
    assert live_ids(reg, ("decode",)) == {"d0"}
    assert live_ids(reg, ("decode", "colocated")) == {"d0", "c0"}
    e = reg.workers["d0"]
    assert e.role == "decode" and e.alive and e.cached == set() and e.status is None and e.inflight == 0


def test_views_before_any_heartbeat_use_hello_sizes():
    reg = WorkerRegistry()
    e = reg.hello(hello("p0", total=40), now=0.0)
    e.inflight = 3
    (v,) = reg.views([e])
    assert (v.worker_id, v.load, v.free_blocks, v.total_blocks, v.prefix_blocks) == ("p0", 3, 40, 40, 0)


def test_heartbeat_updates_status_and_load_view():
    reg = WorkerRegistry()
    reg.hello(hello("d0", role="decode", total=64), now=0.0)
    e = reg.heartbeat(status("d0", role="decode", free=10, total=64, running=2), now=1.0)
    assert e is reg.workers["d0"] and e.last_seen == 1.0 and e.status.running == 2
    (v,) = reg.views([e])
    assert (v.free_blocks, v.total_blocks) == (10, 64)


def test_kv_events_update_prefix_index():
    reg = WorkerRegistry()
    reg.hello(hello("p0"), now=0.0)
    reg.heartbeat(status("p0", stored=[11, 12, 13]), now=0.5)
    assert reg.workers["p0"].cached == {11, 12, 13}
    reg.heartbeat(status("p0", stored=[14], evicted=[12]), now=1.0)
    assert reg.workers["p0"].cached == {11, 13, 14}
    reg.heartbeat(status("p0"), now=1.5)  # a heartbeat without events changes nothing
    assert reg.workers["p0"].cached == {11, 13, 14}
    (v,) = reg.views([reg.workers["p0"]], prompt_hashes=[11, 13, 12, 14])
    assert v.prefix_blocks == 2  # leading blocks only: 12 was evicted


def test_prefix_index_drives_prefill_choice():
    """Real chained block hashes: the worker that cached a prompt's prefix gets the prompt."""
    reg = WorkerRegistry()
    for wid in ("p0", "p1", "p2"):
        reg.hello(hello(wid), now=0.0)
    shared = list(range(100, 100 + 4 * BLOCK))
    reg.heartbeat(status("p1", stored=cacheable_prefix_hashes(shared + [1], BLOCK)), now=0.1)
    reg.heartbeat(status("p2", stored=cacheable_prefix_hashes(shared[:BLOCK] + [1], BLOCK)), now=0.1)
    prompt = shared + [7, 8, 9]
    views = reg.views(reg.live(("prefill",)), cacheable_prefix_hashes(prompt, BLOCK))
    assert {v.worker_id: v.prefix_blocks for v in views} == {"p0": 0, "p1": 4, "p2": 1}
    for seed in range(20):
        assert choose_prefill(views, "prefix_load", random.Random(seed)) == "p1"


def test_stale_worker_leaves_rotation_and_loses_its_index():
    reg = WorkerRegistry(stale_after_s=3.0)
    reg.hello(hello("p0"), now=0.0)
    reg.hello(hello("p1"), now=0.0)
    reg.heartbeat(status("p0", stored=[1, 2]), now=1.0)
    reg.heartbeat(status("p1", stored=[1, 2]), now=1.0)
    reg.heartbeat(status("p1"), now=3.5)
    assert reg.expire(now=4.0) == []  # exactly stale_after_s since p0's last heartbeat: not yet
    dead = reg.expire(now=4.01)
    assert [e.worker_id for e in dead] == ["p0"]
    assert live_ids(reg) == {"p1"}
    assert reg.workers["p0"].cached == set() and not reg.workers["p0"].alive
    assert reg.workers["p1"].cached == {1, 2}
    assert reg.expire(now=5.0) == []  # reported once, when it dies


def test_heartbeat_brings_a_stale_worker_back():
    reg = WorkerRegistry(stale_after_s=3.0)
    reg.hello(hello("p0"), now=0.0)
    reg.heartbeat(status("p0", stored=[1, 2]), now=0.5)
    assert [e.worker_id for e in reg.expire(now=10.0)] == ["p0"]
    e = reg.heartbeat(status("p0", stored=[3]), now=11.0)
    assert e is not None and e.alive and live_ids(reg) == {"p0"}
    assert e.cached == {3}  # the cleared index is rebuilt from new events only
    assert reg.expire(now=12.0) == []


def test_heartbeat_before_hello_is_ignored():
    reg = WorkerRegistry()
    assert reg.heartbeat(status("ghost", stored=[1]), now=0.0) is None
    assert "ghost" not in reg.workers and reg.live(("prefill",)) == []
    reg.hello(hello("ghost"), now=1.0)
    assert reg.workers["ghost"].cached == set()  # events sent before hello are not kept


def test_hello_again_from_same_address_keeps_state():
    reg = WorkerRegistry()
    e = reg.hello(hello("p0", address="tcp://127.0.0.1:7001"), now=0.0)
    reg.heartbeat(status("p0", stored=[5]), now=0.5)
    e.inflight = 2
    again = reg.hello(hello("p0", address="tcp://127.0.0.1:7001"), now=1.0)
    assert again is e and again.cached == {5} and again.inflight == 2 and again.last_seen == 1.0


def test_hello_from_new_address_is_a_restart():
    reg = WorkerRegistry(stale_after_s=3.0)
    e = reg.hello(hello("p0", address="tcp://127.0.0.1:7001"), now=0.0)
    reg.heartbeat(status("p0", stored=[5]), now=0.5)
    reg.expire(now=10.0)
    fresh = reg.hello(hello("p0", address="tcp://127.0.0.1:7002"), now=11.0)
    assert fresh is not e and fresh.alive and fresh.cached == set() and fresh.inflight == 0
    assert fresh.hello.address == "tcp://127.0.0.1:7002" and live_ids(reg) == {"p0"}


# ---- refusal at registration: block size and model must be the router's ---------------

def test_refusal_accepts_a_matching_worker():
    assert refusal(hello("p0"), BLOCK, "fp") is None


def test_refusal_names_a_different_block_size():
    why = refusal(dataclasses.replace(hello("p0"), block_size=32), BLOCK, "fp")
    assert why is not None and "p0" in why and "block_size 32" in why and f"router: {BLOCK}" in why


def test_refusal_names_a_different_model():
    why = refusal(hello("d0", role="decode"), BLOCK, "other")
    assert why is not None and "d0" in why and "'fp'" in why and "'other'" in why


def test_refusal_names_both_differences():
    why = refusal(dataclasses.replace(hello("c0", role="colocated"), block_size=8), BLOCK, "other")
    assert "block_size 8" in why and "fingerprint" in why


def test_refusal_names_a_different_dtype_of_the_same_model():
    """The fingerprint covers the engine dtype: the same weights at bfloat16 are refused by
    a float32 deployment, with the flag that fixes it."""
    why = refusal(dataclasses.replace(hello("d1", role="decode"), model_fingerprint="ab12:bfloat16"), BLOCK,
                  "ab12:float32")
    assert why is not None and "d1" in why and "dtype bfloat16 (router: float32" in why and "--dtype float32" in why
    assert refusal(dataclasses.replace(hello("d1"), model_fingerprint="ab12:float32"), BLOCK, "ab12:float32") is None
