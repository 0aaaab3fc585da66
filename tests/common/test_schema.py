"""common/schema.py and the engine options built on it: one checker for wire messages and
config files (the same bad value is refused with the same words at both edges), and each
engine option written once, in its per-concern config, reachable by its flat name."""
from __future__ import annotations

import dataclasses
import json
from typing import Any

import msgpack
import pytest

from pdserve.common.config import (CacheConfig, ConfigError, DeviceConfig, EngineConfig, EngineOptions, SchedulerConfig,
                           WorkerConfig)
from pdserve.common.wire.messages import PROTOCOL_VERSION, MessageError, decode
from pdserve.common.worker.spec import WorkerSpec

SECTIONS = {"cache": CacheConfig, "scheduler": SchedulerConfig, "device": DeviceConfig}


def _message_error(tag: str, data: dict[str, Any]) -> str:
    with pytest.raises(MessageError) as e:
        decode(msgpack.packb({"v": PROTOCOL_VERSION, "type": tag, "data": data}, use_bin_type=True))
    return str(e.value)


def _worker_error(**fields: Any) -> str:
    data = json.loads(json.dumps({"role": "decode", "worker_id": "d0", **fields}))
    with pytest.raises(ConfigError) as e:
        WorkerConfig.from_dict(data)
    return str(e.value)


def _engine_error(**fields: Any) -> str:
    with pytest.raises(ConfigError) as e:
        EngineOptions.from_dict(json.loads(json.dumps(fields)))
    return str(e.value)


STATUS = {"worker_id": "w", "role": "decode", "waiting": 0, "running": 0, "free_blocks": 1, "total_blocks": 1}


# (message error, config error, what both must say after the field's path)
SAME_REFUSALS = {
    "bool for int": (lambda: _message_error("worker_status", {**STATUS, "waiting": True}),
                     lambda: _worker_error(rank=True), "expected an integer, got bool True"),
    "float for int": (lambda: _message_error("worker_status", {**STATUS, "waiting": 1.5}),
                      lambda: _engine_error(block_size=1.5), "expected an integer, got float 1.5"),
    "str for number": (lambda: _message_error("client_heartbeat", {"interval_s": "2"}),
                       lambda: _worker_error(heartbeat_s="2"), "expected a number, got str '2'"),
    "bool for number": (lambda: _message_error("client_heartbeat", {"interval_s": False}),
                        lambda: _engine_error(memory_fraction=False), "expected a number, got bool False"),
    "int for str": (lambda: _message_error("abort", {"request_id": 7}),
                    lambda: _engine_error(dtype=7), "expected str, got int 7"),
    "int for bool": (lambda: _message_error("token_output", {"request_id": "r", "token_ids": [], "finished": 1}),
                     lambda: _worker_error(verify_transfers=1), "expected bool, got int 1"),
    "str for list": (lambda: _message_error("token_output", {"request_id": "r", "token_ids": "abc"}),
                     lambda: _worker_error(prefill_peers="abc"), "expected a list, got str 'abc'"),
    "null for int": (lambda: _message_error("worker_status", {**STATUS, "waiting": None}),
                     lambda: _worker_error(rank=None), "expected an integer, got null"),
    "str for X | None": (lambda: _message_error("generate", {"request_id": "r", "prompt_token_ids": [1],
                                                         "sampling": {"seed": "x"}}),  # seed: int | None
                               lambda: _engine_error(num_kv_blocks="x"), "expected an integer, got str 'x'"),
}


@pytest.mark.parametrize("name", SAME_REFUSALS)
def test_messages_and_config_files_refuse_a_bad_value_the_same_way(name):
    message, config, words = SAME_REFUSALS[name]
    m, c = message(), config()
    assert m.split(": ", 1)[1] == c.split(": ", 1)[1] == words, (m, c)


def test_the_error_names_the_field_by_its_path():
    assert _message_error("worker_status", {**STATUS, "waiting": True}).startswith("worker_status.waiting: ")
    assert _worker_error(rank=True).startswith("worker.rank: ")
    assert _engine_error(block_size="16").startswith("engine.block_size: ")
    assert _message_error("token_output", {"request_id": "r", "token_ids": [1, True]}).startswith(
        "token_output.token_ids[1]: ")
    assert _worker_error(prefill_peers=["a", 2]).startswith("worker.prefill_peers[1]: ")


def test_unknown_and_missing_fields_are_refused_the_same_way():
    assert _message_error("abort", {"request_id": "r", "bogus": 1}) == "abort: unknown field(s) 'bogus'"
    assert _worker_error(bogus=1) == "worker: unknown field(s) 'bogus'"
    assert _engine_error(bogus=1) == "engine: unknown field(s) 'bogus'"
    assert _message_error("abort", {}) == "abort: missing field(s) 'request_id'"
    with pytest.raises(ConfigError) as e:
        WorkerConfig.from_dict({"role": "decode"})
    assert str(e.value) == "worker: missing field(s) 'worker_id'"
    assert _message_error("abort", [1]) == "abort: expected a map, got list"
    with pytest.raises(ConfigError, match="^worker: expected a map, got null$"):
        WorkerConfig.from_dict(None)


def test_json_values_come_back_as_the_declared_types():
    w = WorkerConfig.from_dict({"role": "decode", "worker_id": "d0", "prefill_peers": ["tcp://a:1"], "heartbeat_s": 1})
    assert w.prefill_peers == ("tcp://a:1",) and w.heartbeat_s == 1.0 and isinstance(w.heartbeat_s, float)
    e = EngineOptions.from_dict({"num_kv_blocks": None, "max_model_len": 128, "enable_prefix_caching": False})
    assert e == EngineOptions.of(max_model_len=128, enable_prefix_caching=False)


# ---- one schema for the engine options ---------------------------------------------------

def test_every_section_field_is_an_option_by_its_own_name():
    options = EngineOptions.options()
    want = [f.name for cls in SECTIONS.values() for f in dataclasses.fields(cls)] + ["seed", "decode_graphs", "speculative_config"]
    assert list(options) == want
    for name, o in options.items():
        owner = SECTIONS[o.section] if o.section else EngineOptions
        (f,) = [f for f in dataclasses.fields(owner) if f.name == name]
        assert o.default == f.default and o.help, name  # the default and help live in the field itself


def test_flat_options_set_the_sections_fields():
    e = EngineOptions.of(block_size=32, num_kv_blocks=64, max_num_seqs=8, dtype="bfloat16", seed=3)
    assert e.cache == CacheConfig(block_size=32, num_kv_blocks=64)
    assert e.scheduler == SchedulerConfig(max_num_seqs=8) and e.device == DeviceConfig(dtype="bfloat16")
    assert e.seed == 3 and EngineOptions.of() == EngineOptions()
    assert EngineOptions.of(**e.to_dict()) == e == EngineOptions.from_dict(json.loads(json.dumps(e.to_dict())))
    assert e.replace(device="cuda:1").device == DeviceConfig(device="cuda:1", dtype="bfloat16")  # no GPU needed here
    with pytest.raises(ConfigError, match="unknown engine option.*'num_blocks'.*num_kv_blocks"):
        EngineOptions.of(num_blocks=64)
    with pytest.raises(ConfigError, match="block_size must be a positive power of two, got 24"):
        EngineOptions.of(block_size=24)
    with pytest.raises(ConfigError, match="block_size must be a positive power of two"):
        EngineOptions.from_dict({"block_size": 24})


def test_a_worker_spec_file_keeps_the_flat_engine_object(tmp_path):
    spec = WorkerSpec.of("/models/m", "prefill", "p0", block_size=32, num_kv_blocks=64, enable_prefix_caching=False)
    data = json.loads(spec.write(tmp_path / "w.json").read_text())
    assert data["engine"] == EngineOptions.of(block_size=32, num_kv_blocks=64, enable_prefix_caching=False).to_dict()
    assert data["engine"]["block_size"] == 32 and data["engine"]["max_model_len"] is None
    assert WorkerSpec.read(tmp_path / "w.json") == spec


def _model(tmp_path, max_positions: int) -> str:
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "qwen3", "vocab_size": 64, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
        "num_attention_heads": 2, "max_position_embeddings": max_positions}))
    return str(tmp_path)


@pytest.mark.parametrize("max_positions, asked, expected", [(8192, None, 4096), (1024, None, 1024), (8192, 6000, 6000)])
def test_max_model_len_none_is_the_models_limit_at_most_4096(tmp_path, max_positions, asked, expected):
    config = EngineConfig.build(_model(tmp_path, max_positions), max_model_len=asked, num_kv_blocks=4)
    assert config.scheduler.max_model_len == expected and config.cache.num_kv_blocks == 4


def test_max_model_len_is_checked_against_the_model_and_chunking(tmp_path):
    with pytest.raises(ConfigError, match="max_model_len 2048 exceeds the model's max_position_embeddings 1024"):
        EngineConfig.build(_model(tmp_path, 1024), max_model_len=2048)
    with pytest.raises(ConfigError, match=r"max_num_batched_tokens \(512\) must be >= max_model_len \(1024\)"):
        EngineConfig.build(_model(tmp_path, 1024), enable_chunked_prefill=False, max_num_batched_tokens=512)


def test_a_gpu_device_is_refused_where_the_engine_is_built_not_where_it_is_planned(tmp_path, monkeypatch):
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    options = EngineOptions.of(device="cuda:0")  # a router may plan a worker on a GPU it lacks itself
    with pytest.raises(ConfigError, match="'cuda:0' requested but CUDA is not available"):
        options.engine_config(_model(tmp_path, 1024))


# ---- the checker itself ----------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Inner:
    n: int


@dataclasses.dataclass(frozen=True)
class _Outer:
    either: int | str
    items: tuple[int, ...] = ()
    inner: _Inner | None = None
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)


def test_build_checks_nested_and_union_fields():
    from pdserve.common import schema
    got = schema.build(_Outer, {"either": "a", "items": [1, 2], "inner": {"n": 3}, "extra": {"k": [None]}}, "o", ValueError)
    assert got == _Outer("a", (1, 2), _Inner(3), {"k": [None]})
    with pytest.raises(ValueError, match=r"^o\.either: expected an integer or str, got float 1\.5$"):
        schema.build(_Outer, {"either": 1.5}, "o", ValueError)
    with pytest.raises(ValueError, match=r"^o\.inner\.n: expected an integer, got bool True$"):
        schema.build(_Outer, {"either": 1, "inner": {"n": True}}, "o", ValueError)
    with pytest.raises(ValueError, match=r"^o\.items\[2\]: expected an integer, got bool False$"):
        schema.build(_Outer, {"either": 1, "items": [1, 2, False]}, "o", ValueError)


def test_a_field_type_the_checker_does_not_know_is_a_bug_not_bad_input():
    from pdserve.common import schema

    @dataclasses.dataclass
    class Odd:
        when: set[int]
    with pytest.raises(TypeError, match="unsupported field type"):
        schema.build(Odd, {"when": [1]}, "odd", ValueError)


def test_a_fixed_length_tuple_is_a_list_of_exactly_those_items():
    """logit_bias travels as [token id, bias] pairs: each pair is checked item by item."""
    req = {"request_id": "r", "prompt_token_ids": [1], "sampling": {"logit_bias": [[5, -100], [7, 2.5]]}}
    assert decode(msgpack.packb({"v": PROTOCOL_VERSION, "type": "generate", "data": req})).sampling.logit_bias == (
        (5, -100.0), (7, 2.5))
    for bad, says in (([[5]], "expected a list of 2 items"), ([[5, "x"]], "logit_bias[0][1]: expected a number"),
                      ([[5.5, 1]], "logit_bias[0][0]: expected an integer"), ([5], "expected a list of 2 items")):
        msg = _message_error("generate", {**req, "sampling": {"logit_bias": bad}})
        assert says in msg, msg
