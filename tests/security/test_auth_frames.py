"""common/wire/auth.py: what a Verifier refuses -- no tag, another deployment's tag, an
altered payload or data frame, a replayed frame, a frame outside the time window."""
from __future__ import annotations

import os
import struct

import pytest

from pdserve.common.wire.auth import AuthError, DeploymentKey, new_secret, read_secret_file


@pytest.fixture
def key() -> DeploymentKey:
    return DeploymentKey(new_secret())


def test_round_trip_and_replay(key):
    signer, verifier = key.signer(), key.verifier()
    first = signer.sign(b"payload", [b"kv-data"])
    assert verifier.verify(first, [b"kv-data"]) == b"payload"
    with pytest.raises(AuthError, match="replayed"):
        verifier.verify(first, [b"kv-data"])
    assert verifier.verify(signer.sign(b"next"), []) == b"next"  # the counter moved on


@pytest.mark.parametrize("case", ["unsigned", "other-deployment", "payload", "frame", "stale"])
def test_forgeries_are_refused(key, case):
    signer, verifier = key.signer(), key.verifier(window_s=5)
    first, frames = signer.sign(b"payload", [b"kv"]), [b"kv"]
    if case == "unsigned":
        first = b"payload"
    elif case == "other-deployment":
        first = DeploymentKey(new_secret()).signer().sign(b"payload", [b"kv"])
    elif case == "payload":
        first = first[:-1] + b"X"
    elif case == "frame":
        frames = [b"kx"]
    elif case == "stale":  # an old time put into a frame breaks its tag
        first = first[:20] + struct.pack(">Q", 0) + first[28:]
    with pytest.raises(AuthError):
        verifier.verify(first, frames)


def test_secret_file_must_be_private(tmp_path):
    path = tmp_path / "secret"
    path.write_text(new_secret())
    os.chmod(path, 0o644)
    with pytest.raises(ValueError, match="chmod 600"):
        read_secret_file(path)
    os.chmod(path, 0o600)
    assert DeploymentKey(read_secret_file(path)).deployment_id
    path.write_text("not hex")
    with pytest.raises(ValueError, match="hex"):
        read_secret_file(path)


def test_frame_outside_the_window_is_refused(key, monkeypatch):
    """A validly signed frame captured long ago (its receiver since restarted: no replay
    table) is refused by its time."""
    signer = key.signer()
    import pdserve.common.wire.auth as auth
    real = auth.time.time
    monkeypatch.setattr(auth.time, "time", lambda: real() - 120)
    old = signer.sign(b"payload")
    monkeypatch.setattr(auth.time, "time", real)
    with pytest.raises(AuthError, match="stale"):
        key.verifier(window_s=60).verify(old)
