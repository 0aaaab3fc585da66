"""Three hosts on one machine: the router, a prefill worker and a decode worker each in
its own network namespace, joined by a bridge (in a fourth namespace, away from the
machine's firewall rules), started with `pdserve router` and `pdserve worker --join`. Real
bytes cross the veths: greedy output over HTTP equals the offline engine's at float32
(which tests/common proves equal to transformers'), and the P/D pair uses tcp, never shm.

Needs root (CI runs as root): without the privilege it FAILS, saying so."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from pdserve.common import LLM, SamplingParams
from tests.support.netns import CLIENT, HTTP, Hosts, read_logs, start_cluster, tails, write_secret

PROMPTS = ["Hello there", "The router sends the request to a prefill worker"]
MAX_TOKENS = 8


def test_router_and_workers_in_three_namespaces(model_dirs, tmp_path):
    model = model_dirs["qwen3"]
    common = ["--secret-file", write_secret(tmp_path / "secret"), "--dtype", "float32"]
    hosts = Hosts()
    try:
        addr = hosts.open(["router", "prefill", "decode"])
        procs = start_cluster(hosts, model, addr, {"prefill": "prefill", "decode": "decode"}, tmp_path, common)
        client = subprocess.run([*hosts.inside("router"), sys.executable, "-c", CLIENT,
                                 f"http://{addr['router']}:{HTTP}", json.dumps(PROMPTS),
                                 str(MAX_TOKENS), Path(model).name], capture_output=True, text=True, timeout=300)
        logs = read_logs(tmp_path, procs)
        assert client.returncode == 0, f"client: {client.stderr}\n" + tails(logs)
        got = json.loads(client.stdout)
        llm = LLM(model, dtype="float32", num_kv_blocks=256)
        want = [o["token_ids"] for o in llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))]
        assert got["token_ids"] == want
        # the pair is on two hosts: tcp, and its KV bytes really went over it
        for role in ("prefill", "decode"):
            assert "kv transfer tcp" in logs[role] and "shm" not in logs[role], logs[role]
        sent = [line for line in got["metrics"].splitlines()
                if line.startswith("pdserve_worker_kv_transfer_bytes{") and 'worker_id="prefill"' in line]
        assert sent and float(sent[0].rsplit(" ", 1)[1]) > 0, got["metrics"][-2000:]
        for name, proc in procs.items():
            assert proc.poll() is None, f"{name} exited:\n{logs[name][-3000:]}"
    finally:
        hosts.close()
    assert not hosts.leftover()
