"""`--dtype auto` (common/checkpoint_dtype.py): the checkpoint's stored dtype decides, as
in vLLM; and the model fingerprint that P, D and the router compare covers the dtype."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from pdserve.common import LLM
from pdserve.common.checkpoint_dtype import resolve_dtype, stored_dtype
from pdserve.common.config import ConfigError, EngineConfig
from pdserve.common.engine.kv_layout import fingerprint_parts, layout_mismatch, layout_of, model_fingerprint


def folder(tmp_path, **fields) -> str:
    (tmp_path / "config.json").write_text(json.dumps(fields))
    return str(tmp_path)


@pytest.mark.parametrize("fields,device,want", [
    ({"dtype": "bfloat16"}, "cpu", "bfloat16"),
    ({"torch_dtype": "bfloat16"}, "cpu", "bfloat16"),  # transformers 4's key
    ({"dtype": "float32", "torch_dtype": "bfloat16"}, "cpu", "float32"),  # transformers 5's key first
    ({"torch_dtype": "float32"}, "cpu", "float32"),  # a float32 checkpoint stays float32
    ({}, "cpu", "float32"),  # none stored: float32, as vLLM
    ({"torch_dtype": "float16"}, "cpu", "bfloat16"),  # no float16 arithmetic on the CPU
    ({"torch_dtype": "float16"}, "cuda:0", "float16"),
])
def test_auto_follows_the_checkpoint(tmp_path, fields, device, want):
    assert resolve_dtype("auto", folder(tmp_path, **fields), device) == want


def test_an_explicit_dtype_wins_and_is_spelled_one_way(tmp_path):
    d = folder(tmp_path, torch_dtype="bfloat16")
    assert resolve_dtype("float32", d, "cpu") == "float32"
    assert resolve_dtype("bf16", d, "cpu") == "bfloat16"
    with pytest.raises(ConfigError, match="int3"):
        resolve_dtype("int3", d, "cpu")
    with pytest.raises(ConfigError, match="float8"):
        stored_dtype(folder(tmp_path, dtype="float8"))


def _as_bf16_checkpoint(src: str, dst) -> str:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.pop("torch_dtype", None)
    cfg["dtype"] = "bfloat16"
    (dst / "config.json").write_text(json.dumps(cfg))
    return str(dst)


def test_engine_auto_on_a_bf16_and_a_float32_checkpoint(model_dirs, tmp_path):
    bf = _as_bf16_checkpoint(model_dirs["llama"], tmp_path / "bf16")
    assert EngineConfig.build(bf, dtype="auto").device.dtype == "bfloat16"
    assert EngineConfig.build(model_dirs["llama"], dtype="auto").device.dtype == "float32"  # make-model: float32
    llm = LLM(bf, dtype="auto", num_threads=1, num_kv_blocks=16, max_model_len=64)
    assert llm.engine.runner.model.lm_head.weight.dtype == torch.bfloat16


def test_fingerprint_and_layout_cover_the_dtype(model_dirs):
    d = model_dirs["qwen2"]
    f32, bf = model_fingerprint(d, "float32"), model_fingerprint(d, "bf16")
    assert f32 != bf and fingerprint_parts(f32)[0] == fingerprint_parts(bf)[0]
    assert fingerprint_parts(bf)[1] == "bfloat16"
    ours = layout_of(EngineConfig.build(d, dtype="float32"))
    theirs = layout_of(EngineConfig.build(d, dtype="bfloat16"))
    why = layout_mismatch(ours, theirs)
    assert why is not None and "dtype: prefill has 'float32', decode has 'bfloat16'" in why
