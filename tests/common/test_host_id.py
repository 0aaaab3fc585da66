"""Host identity: what "same host" means for pid liveness and the KV transport choice."""
import os
import subprocess
import sys

from pdserve.common.worker.host import cross_host_refusal, local_host_id, pair_transport, same_host


def test_host_id_is_boot_id_and_network_namespace():
    boot = open("/proc/sys/kernel/random/boot_id").read().strip()
    assert local_host_id() == f"{boot}/{os.stat('/proc/self/ns/net').st_ino}"
    assert local_host_id("rack7-node3") == "rack7-node3"  # --host-id wins


def test_another_process_in_this_namespace_is_this_host():
    out = subprocess.run([sys.executable, "-c", "from pdserve.common.worker.host import local_host_id; print(local_host_id())"],
                         capture_output=True, text=True, check=True, env=dict(os.environ, PYTHONPATH=os.getcwd()))
    assert out.stdout.strip() == local_host_id()


def test_same_host_needs_an_equal_nonempty_id():
    me = local_host_id()
    assert same_host(me, me)
    assert not same_host(me, me.split("/")[0] + "/1")  # one kernel, another network namespace
    assert not same_host(me, "")  # an old peer that sent none: another host, its pid is not ours to read
    assert not same_host(me, None) and not same_host(me, 42)


def test_auto_transport_follows_where_the_pair_is():
    assert pair_transport("auto", "cpu", True) == "shm"
    assert pair_transport("auto", "cuda:0", True) == "cuda_ipc"
    assert pair_transport("auto", "cpu", False) == "tcp"
    assert pair_transport("auto", "cuda:1", None) == "tcp"  # unknown at start (a joined worker)
    assert pair_transport("gloo", "cpu", True) == "gloo"  # what is asked for is kept


def test_memory_sharing_backends_are_refused_across_hosts():
    assert cross_host_refusal("shm", "a/1", "a/1") is None
    why = cross_host_refusal("shm", "a/1", "a/2")
    assert why and "two" in why and "tcp" in why
    assert cross_host_refusal("cuda_ipc", "a/1", "") is not None
    assert cross_host_refusal("tcp", "a/1", "b/9") is None
