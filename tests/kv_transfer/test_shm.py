"""The shm backend in one process: D's cache lives in a POSIX shared-memory segment,
P maps it and copies blocks layer by layer; D's close() removes the segment."""
from __future__ import annotations

from multiprocessing import resource_tracker
from pathlib import Path

import pytest
import torch

from pdserve.common.wire.messages import KVReady
from pdserve.kv_transfer.shm import ShmReceiver, ShmSender

SHAPE = (2, 3, 8, 4, 2, 5)  # [2, L, num_blocks, block_size, H, D]


def _sender(kv_cache: torch.Tensor, receiver: ShmReceiver) -> ShmSender:
    """A sender mapping receiver's segment. In two processes the sender's tracker opt-out
    touches only its own process; here both share one tracker, so give the receiver's
    registration back (else its unlink makes the tracker print a KeyError)."""
    sender = ShmSender(kv_cache, receiver.backend_info())
    resource_tracker.register(receiver._shm._name, "shared_memory")  # type: ignore[attr-defined]
    return sender


@pytest.fixture
def receiver():
    r = ShmReceiver(SHAPE, torch.float32, "unit-test")
    yield r
    if hasattr(r, "kv_cache"):  # not closed by the test itself
        r.close()


def test_receiver_cache_is_a_zeroed_shared_segment(receiver):
    info = receiver.backend_info()
    assert info == {"shm_name": receiver.name, "shape": list(SHAPE), "dtype": "float32"}
    assert receiver.name.startswith("pdserve-unit-test-")
    assert Path("/dev/shm", receiver.name).exists()
    assert tuple(receiver.kv_cache.shape) == SHAPE and not receiver.kv_cache.any()


def test_write_layer_copies_blocks_into_the_shared_cache(receiver):
    src = torch.randn(SHAPE, generator=torch.Generator().manual_seed(0))
    sender = _sender(src, receiver)
    try:
        mapping = {0: 5, 3: 6, 4: 7, 6: 1}  # src block -> dst block (two runs and two singles)
        src_ids, dst_ids = list(mapping), list(mapping.values())
        sender.write_layer(0, src_ids, dst_ids)
        # layer by layer: after layer 0 only layer 0 has landed
        for s, d in mapping.items():
            assert torch.equal(receiver.kv_cache[:, 0, d], src[:, 0, s])
            assert not receiver.kv_cache[:, 1:, d].any()
        for layer in range(1, SHAPE[1]):
            sender.write_layer(layer, src_ids, dst_ids)
        for s, d in mapping.items():
            assert torch.equal(receiver.kv_cache[:, :, d], src[:, :, s])
        others = [b for b in range(SHAPE[2]) if b not in dst_ids]
        assert not receiver.kv_cache[:, :, others].any()
        block_bytes = 2 * SHAPE[1] * SHAPE[3] * SHAPE[4] * SHAPE[5] * 4  # K and V of every layer
        assert sender.bytes_sent == len(mapping) * block_bytes
        assert sender.send(KVReady("r", 1, len(mapping)), src_ids, dst_ids) == []  # nothing left to send
    finally:
        sender.close()


def test_close_unlinks_the_segment_even_while_a_sender_maps_it(receiver):
    sender = _sender(torch.zeros(SHAPE), receiver)
    path = Path("/dev/shm", receiver.name)
    assert path.exists()
    receiver.close()
    assert not path.exists(), "the shared KV cache segment outlived close()"
    sender.close()


def test_close_unlinks_the_segment(receiver):
    path = Path("/dev/shm", receiver.name)
    receiver.close()
    assert not path.exists()
