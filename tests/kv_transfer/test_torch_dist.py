"""gloo transfer between two real processes: D's receive completes without D blocking
on it (gloo's Works only report completion once waited on), lands exactly the sent
blocks, and P's sender lets go of the buffers it sent."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from pdserve.router.launch.local import free_port

RANK_SCRIPT = textwrap.dedent("""
    import json, sys, time
    import torch
    from pdserve.common.wire.messages import KVReady
    from pdserve.kv_transfer.torch_dist import DistReceiver, DistSender, init_group

    rank, port, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    torch.set_num_threads(1)
    init_group("gloo", f"tcp://127.0.0.1:{port}", rank, 2)
    shape = (2, 3, 8, 4, 2, 8)  # [2, layers, blocks, block_size, kv heads, head dim]
    src, dst = [5, 1, 2], [0, 6, 7]
    ready = KVReady("r", 7, len(src))
    if rank == 0:  # P
        cache = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).view(shape)
        sender = DistSender(cache, {"rank": 1}, "gloo")
        sender.send(ready, src, dst)
        ready_msg = {"payload_shape": ready.payload_shape, "payload_dtype": ready.payload_dtype}
        pending_after_send = len(sender._pending)
        deadline = time.monotonic() + 30
        while sender._pending and time.monotonic() < deadline:
            sender.poll()
            time.sleep(0.01)
        result = {"ready": ready_msg, "pending_after_send": pending_after_send, "pending_at_end": len(sender._pending)}
    else:  # D
        receiver = DistReceiver(torch.zeros(shape), "gloo")
        ready.payload_shape, ready.payload_dtype = [2, 3, 3, 4, 2, 8], "float32"
        pending = receiver.receive(ready, [], dst, {"rank": 0})
        deadline, polls = time.monotonic() + 30, 0
        while not pending.done() and time.monotonic() < deadline:
            polls += 1
            time.sleep(0.01)
        done = pending.done()
        pending.land()
        want = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).view(shape)
        same = all(torch.equal(receiver.kv_cache[:, :, d], want[:, :, s]) for s, d in zip(src, dst))
        others = [b for b in range(shape[2]) if b not in dst]
        untouched = bool((receiver.kv_cache[:, :, others] == 0).all())
        result = {"done": done, "same": same, "untouched": untouched}
    json.dump(result, open(out, "w"))
    torch.distributed.destroy_process_group()
""")


def test_gloo_receive_completes_without_waiting_and_sender_lets_go(tmp_path: Path):
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    port = str(free_port())
    repo = str(Path(__file__).resolve().parents[2])
    procs = [subprocess.Popen([sys.executable, str(script), str(r), port, str(tmp_path / f"r{r}.json")],
                              cwd=repo, env=dict(os.environ, PYTHONPATH=repo)) for r in (0, 1)]
    try:
        assert [p.wait(timeout=120) for p in procs] == [0, 0]
    finally:
        for p in procs:
            p.kill()
    p_side, d_side = (json.loads((tmp_path / f"r{r}.json").read_text()) for r in (0, 1))
    assert p_side["ready"] == {"payload_shape": [2, 3, 3, 4, 2, 8], "payload_dtype": "float32"}
    assert p_side["pending_after_send"] == 1 and p_side["pending_at_end"] == 0, "P kept a sent buffer"
    assert d_side == {"done": True, "same": True, "untouched": True}


def test_a_group_that_cannot_form_is_a_start_up_error_with_the_reason(monkeypatch):
    """What NCCL said on an H100 with P and D on one GPU reaches the worker's exit message
    (worker_main prints a ConfigError and exits 2), not a traceback from torch's internals."""
    import pytest
    import torch.distributed as dist

    import pdserve.kv_transfer.torch_dist as torch_dist
    from pdserve.common.config import ConfigError, WorkerConfig
    from pdserve.kv_transfer import init_transfer_group

    def refuse(*args):
        raise dist.DistBackendError("NCCL error in: NCCLUtils.cpp:93, invalid usage\nLast error:\n"
                                    "Duplicate GPU detected : rank 1 and rank 0 both on CUDA device 60\n")

    monkeypatch.setattr(torch_dist, "init_group", refuse)
    w = WorkerConfig(role="decode", worker_id="d", kv_transfer="nccl", dist_init="tcp://127.0.0.1:1", rank=1, world_size=2)
    with pytest.raises(ConfigError, match=r"kv transfer nccl: rank 1 of 2 on cuda:0 .*: Duplicate GPU detected"):
        init_transfer_group(w, "cuda:0")
