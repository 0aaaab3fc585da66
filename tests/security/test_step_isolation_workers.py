"""Worker survival across processes: a prompt that makes the prefill step raise (the
env-gated test hook PDSERVE_TEST_FAULT_TOKEN, common/worker/faults.py's `PoisonToken`,
stands for a real per-request failure) fails that request alone with an error; the others in the same
batch finish token-exact and the workers go on serving."""
from __future__ import annotations

import pytest

from pdserve.common.worker.faults import FAULT_TOKEN_ENV
from tests.support.disagg_driver import engine_options, start_pair

POISON = 333
PROMPTS = [[5, 6, 7, 8] * 5, [9, 10, 11], [12, 13, 14, 15, 16] * 4]


@pytest.fixture(scope="module")
def pair(model_dirs, tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv(FAULT_TOKEN_ENV, str(POISON))  # the workers inherit it; this process never steps
    try:
        dep = start_pair(model_dirs["qwen3"], "shm", engine_options(num_kv_blocks=64, max_model_len=256),
                         workdir=tmp_path_factory.mktemp("isolation"), together=True)
    finally:
        mp.undo()
    yield dep
    dep.close()


def test_failing_prompt_fails_alone(pair):
    clean = pair.run(PROMPTS, 8, timeout_s=180).outputs()
    requests = [pair.request(p, 8) for p in PROMPTS]
    bad = pair.request([POISON, 20, 21, 22], 8)
    pair.send(requests[:1] + [bad] + requests[1:])  # all in flight: P batches them
    result = pair.collect([r.request_id for r in requests] + [bad.request_id], timeout_s=180)  # a loaded 2-core box
    assert set(result.errors) == {bad.request_id}
    assert "injected fault" in result.errors[bad.request_id].message
    assert result.outputs([r.request_id for r in requests]) == clean, pair.logs()
    assert pair.run(PROMPTS, 8).outputs() == clean  # and they go on serving
    assert "fails the step alone" in pair.prefill.log_path.read_text()
    d, p = pair.statuses()
    assert d.free_blocks == d.total_blocks and p.free_blocks == p.total_blocks
