"""Attacks on real worker processes (a shm prefill/decode pair) by a local process that
can reach their sockets but does not hold the deployment secret -- or holds it (a buggy
or compromised peer) and names memory that is not its own. Each is refused and logged;
the workers go on serving, token-exact."""
from __future__ import annotations

import time

import pytest
import torch
import zmq

from pdserve.common.wire.auth import DeploymentKey, new_secret
from pdserve.common.engine.kv_layout import layout_of
from pdserve.common.worker.host import local_host_id
from pdserve.common.wire.messages import KVHandshake, KVHandshakeReply, PrefillFailed, PrefillRequest
from pdserve.common.sampling_params import SamplingParams
from pdserve.common.wire.transport import Client
from pdserve.common.worker.spec import WorkerSpec
from pdserve.kv_transfer import shm_name_hint
from pdserve.kv_transfer.shm import ShmReceiver
from tests.support.disagg_driver import engine_options, shm_segments, start_pair

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]
MAX_NEW = 6


@pytest.fixture(scope="module")
def pair(model_dirs, tmp_path_factory):
    dep = start_pair(model_dirs["qwen3"], "shm", engine_options(num_kv_blocks=64, max_model_len=256),
                     workdir=tmp_path_factory.mktemp("attacks"), together=True)
    yield dep
    dep.close()


@pytest.fixture(scope="module")
def expected(pair):
    return pair.run([PROMPT], MAX_NEW).outputs()[0]


def _still_serves(pair, expected) -> None:
    assert pair.run([PROMPT], MAX_NEW).outputs() == [expected], pair.logs()


def _log(worker) -> str:
    time.sleep(0.3)
    return worker.log_path.read_text(errors="replace")


def _layout(pair):
    spec = WorkerSpec.of(pair.model_dir, "decode", "x", **engine_options(num_kv_blocks=64, max_model_len=256))
    return layout_of(spec.engine_config())


def test_config_file_holds_the_secret_privately(pair):
    """The secret reaches workers only through their 0600 config file, never argv."""
    cfg = pair.launcher.workdir / f"{pair.decode.name}.json"
    assert cfg.stat().st_mode & 0o077 == 0 and pair.launcher.secret in cfg.read_text()
    cmdline = open(f"/proc/{pair.decode.proc.pid}/cmdline", "rb").read()
    environ = open(f"/proc/{pair.decode.proc.pid}/environ", "rb").read()
    assert pair.launcher.secret.encode() not in cmdline and pair.launcher.secret.encode() not in environ


@pytest.mark.parametrize("key", ["none", "other-deployment"])
def test_forged_generate_request_is_refused(pair, expected, key):
    """A process without the secret cannot submit to (nor read answers from) a worker."""
    k = None if key == "none" else DeploymentKey(new_secret())
    forger = Client(pair.ctx, pair.decode.address, key=k)
    try:
        forger.send(pair.request(PROMPT, MAX_NEW, request_id=f"forged-{key}"))
        with pytest.raises(TimeoutError):
            forger.recv(timeout_ms=1500)
    finally:
        forger.close()
    assert "refused an unauthenticated message" in _log(pair.decode)
    _still_serves(pair, expected)


def test_replayed_generate_request_is_refused(pair, expected):
    """A captured, valid frame sent again is refused: one answer, not two."""
    req = pair.request(PROMPT, MAX_NEW, request_id="replayed")
    frame = pair.client.auth.seal(req)
    pair.client.sock.send_multipart([frame])
    pair.client.sock.send_multipart([frame])
    result = pair.collect(["replayed"])
    assert result.tokens["replayed"] == expected
    with pytest.raises(TimeoutError):
        pair.client.recv(timeout_ms=1000)
    assert "replayed message" in _log(pair.decode)


def _fake_decode(pair, name: str, backend_info: dict):
    """A peer holding the secret that handshakes with P as decode worker `name`."""
    client = Client(pair.ctx, pair.prefill.address, identity=name.encode(), key=pair.key)
    backend_info = {"host": local_host_id(), **backend_info}  # a process on P's host: shm is allowed
    try:
        client.send(KVHandshake(name, "tcp://127.0.0.1:1", _layout(pair), "shm", backend_info))
        return client, client.recv(timeout_ms=20000).msg
    except BaseException:
        client.close()  # an open socket would hang the deployment's ctx.term() at teardown
        raise


def test_forged_prefill_request_is_refused(pair, expected):
    """Without the secret, a PrefillRequest naming D's blocks never reaches P's engine;
    with it but on a connection that never handshook as D, P refuses it too."""
    d_name = pair.decode.name
    req = PrefillRequest("steal", d_name, [99] * 20, SamplingParams.unchecked(temperature=0.0), 0, [0, 1])
    unsigned = Client(pair.ctx, pair.prefill.address, identity=d_name.encode() + b"x")
    try:
        unsigned.send(req)
        with pytest.raises(TimeoutError):
            unsigned.recv(timeout_ms=1000)
    finally:
        unsigned.close()
    assert "refused an unauthenticated message" in _log(pair.prefill)
    other = Client(pair.ctx, pair.prefill.address, identity=b"intruder", key=pair.key)
    try:
        other.send(req)
        reply = other.recv(timeout_ms=20000).msg
    finally:
        other.close()
    assert isinstance(reply, PrefillFailed) and "handshake" in reply.message
    _still_serves(pair, expected)


def test_foreign_shm_name_is_refused(pair, expected):
    """A handshake naming D's segment (or any other) as its own cache is refused: P
    derives the name it will map from the deployment and the handshaking worker's id."""
    (d_segment,) = shm_segments(pair.decode)
    shape = [2, *_layout_shape(pair)]
    for i, name in enumerate((d_segment.removeprefix("/dev/shm/"), "psm_12345", "../../etc/passwd")):
        # a new identity each time: a ROUTER ignores a second connection under an identity it still holds
        client, reply = _fake_decode(pair, f"d-evil{i}", {"shm_name": name, "shape": shape, "dtype": "float32",
                                                          "num_blocks": 64})
        client.close()
        assert isinstance(reply, KVHandshakeReply) and not reply.ok and "is not decode worker" in reply.error
    assert "refused decode worker d-evil2: shared-memory" in _log(pair.prefill)
    _still_serves(pair, expected)


def _layout_shape(pair) -> list[int]:
    lay = _layout(pair)
    return [lay.num_layers, 64, lay.block_size, lay.num_kv_heads, lay.head_dim]


def test_out_of_range_block_ids_are_refused(pair, expected):
    """A handshaken peer (its own, correctly named cache) asks P to write block 10**6:
    refused with PrefillFailed, P alive. It used to crash P."""
    name = "d-fake"
    receiver = ShmReceiver(tuple([2, *_layout_shape(pair)]), torch.float32,
                           shm_name_hint(name, pair.key.deployment_id))
    try:
        client, reply = _fake_decode(pair, name, dict(receiver.backend_info(), num_blocks=64))
        try:
            assert isinstance(reply, KVHandshakeReply) and reply.ok, reply
            for i, dst in enumerate(([10**6], [-1], [64], [3, 3])):
                prompt = [7] * 16 * len(dst)
                client.send(PrefillRequest(f"oob-{i}", name, prompt, SamplingParams.unchecked(temperature=0.0),
                                           0, dst))
                msg = client.recv(timeout_ms=20000).msg
                assert isinstance(msg, PrefillFailed) and "reservation refused" in msg.message, msg
        finally:
            client.close()
    finally:
        receiver.close()
    assert pair.prefill.proc.poll() is None
    assert "prefill request 'oob-0' from 'd-fake' refused" in _log(pair.prefill)
    _still_serves(pair, expected)


def test_unauthenticated_flood_does_not_stop_the_worker(pair, expected):
    sock = pair.ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(pair.decode.address)
    for i in range(500):
        sock.send(b"PDA1" + bytes(60) + str(i).encode())
    sock.close(0)
    _still_serves(pair, expected)
