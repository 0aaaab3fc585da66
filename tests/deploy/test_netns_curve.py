"""Trust across hosts, over a real interface: the router, a prefill and a decode worker in
three network namespaces (tests/support/netns.py), the client in a
fourth, and a capture of every frame on the bridge between them (a raw AF_PACKET socket
in the bridge's namespace). Internal traffic is CurveZMQ-encrypted: no internal message
can be read in the capture, while the client's plain HTTP can (so the capture sees
payloads, and the check can fail); greedy output equals the offline engine's. A worker
given another secret, on a fifth host, cannot join: it exits naming the reason, the router
logs the refused connection and keeps serving.

Needs root (CI runs as root): without the privilege it FAILS, saying so."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import msgpack

from pdserve.common import LLM, SamplingParams
from pdserve.common.text.tokenizer import Tokenizer
from tests.support.netns import CLI, CLIENT, CONTROL, HTTP, Hosts, read_logs, start_cluster, tails, write_secret

PROMPTS = ["Hello there", "Curve keeps this prompt off the wire between hosts"]
MAX_TOKENS = 8

CAPTURE = r"""
import signal, socket, sys
s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0003))  # every frame, every interface
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
with open(sys.argv[1], "wb") as out:
    print("capturing", flush=True)
    try:
        while True:
            out.write(s.recv(1 << 18))
    except KeyboardInterrupt:
        pass
"""


def test_internal_traffic_is_encrypted_and_a_stranger_cannot_join(model_dirs, tmp_path):
    model = model_dirs["qwen3"]
    common = ["--secret-file", write_secret(tmp_path / "secret"), "--dtype", "float32"]
    hosts = Hosts()
    try:
        addr = hosts.open(["router", "prefill", "decode", "client", "xstranger"])
        capture = hosts.run("hub", [sys.executable, "-c", CAPTURE, str(tmp_path / "wire.bin")], tmp_path / "cap.log")
        procs = start_cluster(hosts, model, addr, {"prefill": "prefill", "decode": "decode"}, tmp_path, common)
        join = f"tcp://{addr['router']}:{CONTROL}"
        stranger = hosts.run("xstranger", [*CLI, "worker", model, "--role", "prefill", "--join", join, "--host",
                                           addr["xstranger"], "--worker-id", "stranger", "--dtype", "float32",
                                           "--secret-file", write_secret(tmp_path / "other")], tmp_path / "stranger.log")
        client = subprocess.run([*hosts.inside("client"), sys.executable, "-c", CLIENT,
                                 f"http://{addr['router']}:{HTTP}", json.dumps(PROMPTS),
                                 str(MAX_TOKENS), Path(model).name], capture_output=True, text=True, timeout=300)
        stranger_rc = stranger.wait(120)
        capture.terminate()  # its SIGTERM handler ends the capture (SIGINT is ignored in a background job)
        capture.wait(15)
        logs = read_logs(tmp_path, [*procs, "stranger", "cap"])
        assert client.returncode == 0, f"client: {client.stderr}\n" + tails(logs)
        got = json.loads(client.stdout)
        llm = LLM(model, dtype="float32", num_kv_blocks=256)
        want = [o["token_ids"] for o in llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))]
        assert got["token_ids"] == want
        for role in ("prefill", "decode"):
            assert "kv transfer tcp" in logs[role] and "CurveZMQ on" in logs[role], logs[role]

        wire = (tmp_path / "wire.bin").read_bytes()
        assert PROMPTS[1].encode() in wire, "the capture holds no HTTP payload: it saw nothing"
        prompt_ids = msgpack.packb(Tokenizer(model).encode(PROMPTS[1]))[1:]  # the ids as a message holds them
        for plain in (b"prompt_token_ids", b"kv_ready", b"worker_hello", prompt_ids):
            assert plain not in wire, f"{plain!r} crossed the network in the clear"

        # the stranger: refused at the handshake, says why, and the router serves on without it
        assert stranger_rc == 2, logs["stranger"][-3000:]
        assert "cannot join the router" in logs["stranger"] and "another deployment secret" in logs["stranger"]
        assert "router control socket: refused a connection" in logs["router"], logs["router"][-3000:]
        assert 'worker_id="stranger"' not in got["metrics"]
        for name, proc in procs.items():
            assert proc.poll() is None, f"{name} exited:\n{logs[name][-3000:]}"
    finally:
        hosts.close()
    assert not hosts.leftover()
