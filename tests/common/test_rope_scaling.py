"""RoPE scaling variants (linear, llama3, yarn, dynamic) in both config spellings
(transformers 4 `rope_scaling` + `rope_theta`, transformers 5 `rope_parameters`): greedy
output equals transformers' on a made model whose config.json carries the scaling."""
from __future__ import annotations

import json
import shutil

import pytest

from pdserve.common import LLM, SamplingParams
from pdserve.common.config import ModelConfig

pytestmark = pytest.mark.usefixtures("torch_one_thread")

MAX_NEW = 10
# long enough for the scaled low frequencies to matter; original context 64 makes
# llama3's and yarn's bands fall inside the tiny model's head_dim 32
PROMPT = list(range(40, 140))
SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    "yarn_mscale": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                    "beta_fast": 16, "beta_slow": 2, "mscale": 0.8, "mscale_all_dim": 0.5},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
}


def _scaled_model(src: str, dst, scaling: dict, spelling: str) -> str:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    theta = 5000.0
    cfg.pop("rope_theta", None)
    if spelling == "v4":
        cfg["rope_theta"] = theta
        cfg["rope_scaling"] = dict(scaling, type=scaling["rope_type"])
        del cfg["rope_scaling"]["rope_type"]
    else:
        cfg["rope_parameters"] = dict(scaling, rope_theta=theta)
    (dst / "config.json").write_text(json.dumps(cfg))
    return str(dst)


# one spelling is enough for the variants of a type
CASES = [(name, spelling) for name in SCALINGS for spelling in ("v4", "v5")
         if not (spelling == "v4" and name in ("yarn_mscale", "dynamic"))]


@pytest.mark.parametrize("name, spelling", CASES)
def test_rope_scaling_matches_transformers(model_dirs, tmp_path, hf_greedy, name, spelling):
    d = _scaled_model(model_dirs["llama"], tmp_path / name, SCALINGS[name], spelling)
    assert ModelConfig.from_dir(d).rope.rope_type == SCALINGS[name]["rope_type"]
    llm = LLM(d, dtype="float32", num_kv_blocks=32, max_model_len=256)
    ours = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=MAX_NEW), use_tqdm=False)[0]["token_ids"]
    assert ours == hf_greedy(d, PROMPT, MAX_NEW)
    if name != "dynamic":  # dynamic equals default below max_position_embeddings
        unscaled = _scaled_model(model_dirs["llama"], tmp_path / f"{name}-none", {"rope_type": "default"}, "v5")
        assert ours != hf_greedy(unscaled, PROMPT, MAX_NEW), "the scaling had no effect on this prompt"
