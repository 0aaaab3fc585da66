"""Fault injection (common/worker/faults.py): each wrapper fires at the Nth occurrence of
its point and passes everything else through; with nothing armed no wrapper is
installed, so a worker runs its own server, step and runner."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from pdserve.common.config import ConfigError, EngineConfig, WorkerConfig
from pdserve.common.engine.scheduler import ScheduledBatch
from pdserve.common.engine.sequence import Sequence
from pdserve.common.sampling_params import SamplingParams
from pdserve.common.wire.auth import new_secret
from pdserve.common.wire.messages import ErrorReply, KVReady, RequestOutput, StepOutputs
from pdserve.common.wire.transport import Server
from pdserve.common.worker import faults as faults_mod
from pdserve.common.worker.faults import (ENV_VAR, FAULT_TOKEN_ENV, DelayedStep, Faults, HandOffFaults, KillAtToken,
                                  KillMidTransfer, PoisonToken)


class Killed(Exception):
    """Stands in for the SIGKILL an armed fault sends its own process."""


@pytest.fixture(autouse=True)
def no_sigkill(monkeypatch):
    def kill(self, where: str) -> None:
        raise Killed(where)
    monkeypatch.setattr(Faults, "kill", kill)


class Recorder:
    """The inner server socket: records what reaches the wire."""

    address = "tcp://127.0.0.1:0"

    def __init__(self) -> None:
        self.sent: list[object] = []

    def send(self, identity: bytes, msg: object, frames=()) -> None:
        self.sent.append(msg)


def ready(i: int, checksum: int = 1000) -> KVReady:
    return KVReady(f"r{i}", 7, 1, checksum=checksum)


def test_parse_targets_and_rejects():
    f = Faults.parse("kill_mid_decode=3@decode-0, drop_transfer=2@prefill-0, delay_step_ms=5", "decode-0")
    assert (f.kill_mid_decode, f.drop_transfer, f.delay_step_ms) == (3, 0, 5)
    for bad in ("nope=1", "drop_transfer", "drop_transfer=x", "fault_token=3"):
        with pytest.raises(ConfigError, match=ENV_VAR):
            Faults.parse(bad, "p")


def test_pass_tokens_fires_once_where_the_nth_falls():
    f = Faults(kill_mid_decode=5)
    assert [f.pass_tokens("kill_mid_decode", n) for n in (2, 2, 2, 2)] == [False, False, True, False]
    assert not Faults().pass_tokens("kill_mid_decode", 10)  # unarmed never fires


@pytest.mark.parametrize("name", ["drop_transfer", "kill_after_prefill"])
def test_hand_off_loses_the_nth_kvready_only(name):
    inner, logs = Recorder(), []
    server = HandOffFaults(inner, Faults(**{name: 2}), logs.append)
    server.send(b"d", ErrorReply("r0", "not a hand-off"))  # other messages are not counted
    server.send(b"d", ready(1))
    if name == "kill_after_prefill":
        with pytest.raises(Killed):
            server.send(b"d", ready(2))
    else:
        server.send(b"d", ready(2))
    server.send(b"d", ready(3))
    assert [m.request_id for m in inner.sent] == ["r0", "r1", "r3"]


def test_hand_off_corrupts_and_delays_the_nth(monkeypatch):
    slept: list[float] = []
    monkeypatch.setattr(faults_mod.time, "sleep", slept.append)
    inner = Recorder()
    server = HandOffFaults(inner, Faults(corrupt_transfer=2, delay_transfer_ms=300, delay_transfer_at=3), print)
    for i in range(1, 5):
        server.send(b"d", ready(i))
    server.send(b"d", ready(5, checksum=-1))  # not verified: nothing to corrupt, nothing counted wrong
    assert [m.checksum for m in inner.sent] == [1000, 1001, 1000, 1000, -1]
    assert slept == [0.3]


def test_kill_at_token_counts_the_tokens_of_outgoing_messages():
    inner = Recorder()
    server = KillAtToken(inner, Faults(kill_mid_decode=5))
    server.send(b"r", StepOutputs([RequestOutput("a", [1]), RequestOutput("b", [2])]))
    server.send(b"r", ErrorReply("c", "no tokens"))
    server.send(b"r", StepOutputs([RequestOutput("a", [3, 4])]))
    with pytest.raises(Killed):
        server.send(b"r", StepOutputs([RequestOutput("a", [5]), RequestOutput("b", [6])]))  # the 5th: never sent
    assert [[e.token_ids for e in m.outputs] if isinstance(m, StepOutputs) else None for m in inner.sent] == \
        [[[1], [2]], None, [[3, 4]]]


def test_server_wrapper_passes_the_rest_through():
    inner = Recorder()
    server = KillAtToken(inner, Faults(kill_mid_decode=1))
    assert server.address == inner.address and isinstance(server, Server)


def test_delayed_step(monkeypatch):
    slept: list[float] = []
    monkeypatch.setattr(faults_mod.time, "sleep", slept.append)
    steps: list[int] = []
    step = DelayedStep(lambda: steps.append(len(slept)), 40)
    step()
    step()
    assert steps == [1, 2] and slept == [0.04, 0.04]  # the wait comes before each step


def _batch(*token_lists: list[int]) -> ScheduledBatch:
    seqs = [Sequence(i, list(t), SamplingParams()) for i, t in enumerate(token_lists)]
    return ScheduledBatch(seqs, [len(t) for t in token_lists])


def test_kill_mid_transfer_in_the_nth_layerwise_step():
    written: list[int] = []

    def execute(batch, layer_hook=None):
        for layer in range(4):
            if layer_hook is not None:
                layer_hook(layer)
        return {s.seq_id: 1 for s in batch.seqs}

    run = KillMidTransfer(execute, Faults(kill_mid_transfer=2), num_layers=4)
    batch = _batch([1, 2, 3])
    run(batch)  # no layer hook: not a layerwise step, not counted
    run(batch, written.append)
    written.clear()
    with pytest.raises(Killed, match="layer 2"):
        run(batch, written.append)
    assert written == [0, 1, 2]  # half the layers went out, then the process died
    written.clear()
    run(batch, written.append)  # fired once
    assert written == [0, 1, 2, 3]


def test_poison_token_raises_for_a_sampled_sequence_holding_it():
    def execute(batch, layer_hook=None):
        return {s.seq_id: 1 for s, n in zip(batch.seqs, batch.num_tokens) if n == len(s)}

    run = PoisonToken(execute, 333)
    assert run(_batch([1, 2], [3, 4])) == {0: 1, 1: 1}
    with pytest.raises(RuntimeError, match="injected fault"):
        run(_batch([1, 2], [333, 4]))
    partial = _batch([1, 2], [333, 4, 5])
    partial.num_tokens[1] = 2  # a chunk of the poisoned prompt: nothing sampled for it yet
    assert run(partial) == {0: 1}


def _fake_worker() -> SimpleNamespace:
    runner = SimpleNamespace(execute=lambda batch, layer_hook=None: {})
    return SimpleNamespace(server=Recorder(), step=lambda: None, log=print,
                           engine=SimpleNamespace(runner=runner),
                           config=SimpleNamespace(model=SimpleNamespace(num_layers=4)))


def test_wrappers_go_where_their_faults_are_armed():
    w = _fake_worker()
    Faults(drop_transfer=1, kill_mid_transfer=1, fault_token=5).wrap_prefill(w)
    assert isinstance(w.server, HandOffFaults) and isinstance(w.engine.runner.execute, PoisonToken)
    assert isinstance(w.engine.runner.execute.execute, KillMidTransfer) and not isinstance(w.step, DelayedStep)
    w = _fake_worker()
    Faults(delay_step_ms=1).wrap_prefill(w)  # a slow prefill worker: prompts stay in flight on it
    assert isinstance(w.step, DelayedStep) and type(w.server) is Recorder
    w = _fake_worker()
    Faults(kill_mid_decode=1, delay_step_ms=1).wrap_decode(w)
    assert isinstance(w.server, KillAtToken) and isinstance(w.step, DelayedStep)


@pytest.fixture(scope="module")
def engine_config(model_dirs) -> EngineConfig:
    return EngineConfig.build(model_dirs["qwen3"], block_size=16, num_kv_blocks=16, max_model_len=64, num_threads=1)


def _worker(role: str, engine_config: EngineConfig):
    from pdserve.decode_node.colocated import ColocatedWorker
    from pdserve.prefill_node.worker import PrefillWorker
    cls = PrefillWorker if role == "prefill" else ColocatedWorker
    return cls(engine_config, WorkerConfig(role=role, worker_id=f"{role}-0", kv_transfer="tcp", secret=new_secret()))


@pytest.mark.parametrize("role", ["prefill", "colocated"])
def test_a_worker_with_no_faults_runs_its_own_parts(role, engine_config, monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    monkeypatch.delenv(FAULT_TOKEN_ENV, raising=False)
    w = _worker(role, engine_config)
    try:
        assert type(w.server) is Server
        assert "step" not in vars(w) and "execute" not in vars(w.engine.runner)  # the class's own methods
    finally:
        w.close()


@pytest.mark.parametrize("role,faults,wrapped", [("prefill", "drop_transfer=3@prefill-0", HandOffFaults),
                                                 ("colocated", "kill_mid_decode=9@colocated-0", KillAtToken)])
def test_a_worker_with_faults_sends_through_the_wrapper(role, faults, wrapped, engine_config, monkeypatch):
    monkeypatch.setenv(ENV_VAR, faults)
    monkeypatch.setenv(FAULT_TOKEN_ENV, "333")
    w = _worker(role, engine_config)
    try:
        assert type(w.server) is wrapped and type(w.server.inner) is Server
        assert isinstance(w.engine.runner.execute, PoisonToken)
    finally:
        w.close()
