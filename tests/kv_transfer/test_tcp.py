"""The tcp backend: P gathers blocks into one raw frame behind KVReady; D checks the
frame against its reservation before scattering it into the reserved blocks."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import zmq

from pdserve.common.wire.messages import KVReady, StatusRequest
from pdserve.common.wire.transport import Client, Server
from pdserve.kv_transfer.base import TransferError
from pdserve.kv_transfer.tcp import TcpReceiver, TcpSender

SHAPE = (2, 3, 10, 4, 2, 5)  # [2, L, num_blocks, block_size, H, D]
SRC_BLOCKS = [1, 4, 5]
DST_BLOCKS = [0, 6, 7]


@pytest.fixture
def sent() -> tuple[torch.Tensor, KVReady, list[bytes]]:
    """P's cache, and the KVReady and frames its TcpSender produced for SRC_BLOCKS."""
    src = torch.randn(SHAPE, generator=torch.Generator().manual_seed(0))
    sender = TcpSender(src, {})
    ready = KVReady("req-1", first_token=17, num_blocks=len(SRC_BLOCKS))
    frames = sender.send(ready, SRC_BLOCKS, DST_BLOCKS)
    assert ready.payload_shape == [2, 3, 3, 4, 2, 5] and ready.payload_dtype == "float32"
    assert ready.num_frames == len(frames) == 1
    assert sender.bytes_sent == 3 * 2 * 3 * 4 * 2 * 5 * 4
    return src, ready, [bytes(f) for f in frames]


def test_round_trip_lands_identical_blocks(sent):
    src, ready, frames = sent
    receiver = TcpReceiver(torch.zeros(SHAPE))
    receiver.receive(ready, frames, DST_BLOCKS, {})
    for s, d in zip(SRC_BLOCKS, DST_BLOCKS):
        assert torch.equal(receiver.kv_cache[:, :, d], src[:, :, s])
    others = [b for b in range(SHAPE[2]) if b not in DST_BLOCKS]
    assert not receiver.kv_cache[:, :, others].any()


def test_round_trip_through_zeromq_frames(sent):
    """The raw frame travels behind the encoded KVReady on a real socket pair."""
    src, ready, _ = sent
    sender = TcpSender(src, {})
    ctx = zmq.Context()
    server = Server(ctx, "inproc://tcp-kv-test")
    client = Client(ctx, server.address)
    try:
        client.send(StatusRequest())  # the decode side connects first, as D does
        assert server.sock.poll(5000)
        identity = server.recv().identity
        ready2 = KVReady("req-2", first_token=3, num_blocks=len(SRC_BLOCKS))
        server.send(identity, ready2, sender.send(ready2, SRC_BLOCKS, DST_BLOCKS))
        inc = client.recv(timeout_ms=5000)
        receiver = TcpReceiver(torch.zeros(SHAPE))
        receiver.receive(inc.msg, inc.frames, DST_BLOCKS, {})
        assert inc.msg == ready2
        for s, d in zip(SRC_BLOCKS, DST_BLOCKS):
            assert torch.equal(receiver.kv_cache[:, :, d], src[:, :, s])
    finally:
        client.close()
        server.close()
        ctx.term()


def _rejects(ready: KVReady, frames: list[bytes], dst: list[int] = DST_BLOCKS) -> str:
    receiver = TcpReceiver(torch.zeros(SHAPE))
    with pytest.raises(TransferError) as e:
        receiver.receive(ready, frames, dst, {})
    assert not receiver.kv_cache.any(), "a rejected transfer wrote into the cache"
    assert ready.request_id in str(e.value)
    return str(e.value)


def test_rejects_wrong_shape_of_the_same_size(sent):
    _, ready, frames = sent
    _rejects(dataclasses.replace(ready, payload_shape=[2, 3, 3, 2, 4, 5]), frames)


def test_rejects_fewer_blocks_than_reserved(sent):
    _, ready, frames = sent
    msg = _rejects(ready, frames, DST_BLOCKS + [8])
    assert "4 were reserved" in msg


def test_rejects_truncated_payload(sent):
    _, ready, frames = sent
    _rejects(ready, [frames[0][:-4]])


def test_rejects_oversized_payload(sent):
    _, ready, frames = sent
    _rejects(ready, [frames[0] + b"\0" * 4])


def test_rejects_missing_or_extra_frames(sent):
    _, ready, frames = sent
    _rejects(ready, [])
    _rejects(ready, frames + frames)


def test_rejects_wrong_dtype(sent):
    _, ready, frames = sent
    # the same byte count, read as another dtype, would be garbage
    _rejects(dataclasses.replace(ready, payload_dtype="float16"), frames)


@pytest.mark.parametrize("dtype", ["int8", ""])
def test_rejects_dtype_it_does_not_know_as_transfer_error(sent, dtype):
    """D catches TransferError around receive(); any other exception escapes its loop."""
    _, ready, frames = sent
    _rejects(dataclasses.replace(ready, payload_dtype=dtype), frames)
