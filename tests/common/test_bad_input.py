"""Bad requests and bad model directories fail with errors that name the problem, and a
rejected request leaves the engine as it was. Also: transformers-5 config files, the
`pdserve make-model` CLI, and our `kernels` package not passing for HF's `kernels`."""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from pdserve.common import LLM, SamplingParams
from pdserve.common.config import ConfigError, EngineConfig, ModelConfig
from pdserve.common.engine.engine import RequestError

pytestmark = pytest.mark.usefixtures("torch_one_thread")

MAX_MODEL_LEN = 64
GOOD_PROMPT = list(range(10, 30))
MAX_NEW = 8


@pytest.fixture(scope="module")
def llm(model_dirs) -> LLM:
    return LLM(model_dirs["qwen2"], dtype="float32", num_kv_blocks=32, max_model_len=MAX_MODEL_LEN)


def _assert_healthy(llm: LLM, model_dir: str, hf_greedy) -> None:
    """Nothing was left queued or held, and the engine still generates correctly."""
    engine = llm.engine
    assert not engine.has_work(), "the rejected request was left queued"
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    out = llm.generate(GOOD_PROMPT, SamplingParams(temperature=0, max_tokens=MAX_NEW), use_tqdm=False)[0]
    assert out["token_ids"] == hf_greedy(model_dir, GOOD_PROMPT, MAX_NEW)
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks


# ---- bad requests ----------------------------------------------------------------------
@pytest.mark.parametrize("prompts, words", [
    ([list(range(1, MAX_MODEL_LEN + 1))], (f"{MAX_MODEL_LEN} tokens", f"max_model_len is {MAX_MODEL_LEN}")),
    ([list(range(1, MAX_MODEL_LEN + 40))], (f"{MAX_MODEL_LEN + 39} tokens", f"max_model_len is {MAX_MODEL_LEN}")),
    ([""], ("empty",)),
    ([[]], ("empty",)),
    ([[5, 100_000, 6]], ("100000", "vocabulary")),
    ([[5, -1]], ("-1", "vocabulary")),
    ([[5, 6.0]], ("list of token ids",)),
    # a bad prompt after a good one: nothing may be queued
    ([GOOD_PROMPT, ""], ("empty",)),
    ([GOOD_PROMPT, list(range(1, 200))], ("199 tokens",)),
], ids=["at-max-model-len", "over-max-model-len", "empty-text", "empty-ids", "id-too-big", "id-negative",
        "float-id", "good-then-empty", "good-then-too-long"])
def test_bad_prompt_is_rejected_and_engine_stays_usable(llm, model_dirs, hf_greedy, prompts, words):
    with pytest.raises(RequestError) as e:
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    for w in words:
        assert w in str(e.value)
    _assert_healthy(llm, model_dirs["qwen2"], hf_greedy)


def test_longest_allowed_prompt_is_served(llm, model_dirs, hf_greedy):
    prompt = list(range(1, MAX_MODEL_LEN))  # max_model_len - 1 tokens
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
    assert out["token_ids"] == hf_greedy(model_dirs["qwen2"], prompt, 1)
    assert out["finish_reason"] == "length"
    _assert_healthy(llm, model_dirs["qwen2"], hf_greedy)


def test_max_tokens_below_one_is_rejected(llm, model_dirs, hf_greedy):
    with pytest.raises(ValueError, match="max_tokens must be >= 1, got 0"):
        llm.generate(GOOD_PROMPT, SamplingParams(temperature=0, max_tokens=0), use_tqdm=False)
    _assert_healthy(llm, model_dirs["qwen2"], hf_greedy)


def test_wrong_number_of_sampling_params_is_rejected(llm, model_dirs, hf_greedy):
    with pytest.raises(RequestError, match="2 sampling params for 3 prompts"):
        llm.generate([GOOD_PROMPT] * 3, [SamplingParams()] * 2, use_tqdm=False)
    _assert_healthy(llm, model_dirs["qwen2"], hf_greedy)


def test_bad_sampling_params_object_queues_nothing(model_dirs, hf_greedy):
    """A dict where SamplingParams belong, after a good pair: nothing may stay queued."""
    llm = LLM(model_dirs["qwen2"], dtype="float32", num_kv_blocks=32, max_model_len=MAX_MODEL_LEN)  # not shared: may be left dirty
    with pytest.raises(RequestError, match="SamplingParams"):
        llm.generate([GOOD_PROMPT, GOOD_PROMPT], [SamplingParams(temperature=0), {"temperature": 0}],
                     use_tqdm=False)
    _assert_healthy(llm, model_dirs["qwen2"], hf_greedy)


# ---- bad model directories ---------------------------------------------------------------
def _copy(model_dirs, tmp_path: Path, arch: str = "llama") -> Path:
    return Path(shutil.copytree(model_dirs[arch], tmp_path / arch))


def _edit_config(path: Path, **changes) -> None:
    cfg = json.loads((path / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (path / "config.json").write_text(json.dumps(cfg))


def test_unknown_arch(model_dirs, tmp_path):
    d = _copy(model_dirs, tmp_path)
    _edit_config(d, model_type="mamba")
    with pytest.raises(ConfigError, match=r"unknown arch 'mamba'.*supported: qwen3, qwen2, llama"):
        EngineConfig.build(d)


def test_missing_config_json(model_dirs, tmp_path):
    d = _copy(model_dirs, tmp_path)
    (d / "config.json").unlink()
    with pytest.raises(ConfigError, match="config.json not found"):
        ModelConfig.from_dir(d)


def test_config_json_not_json(model_dirs, tmp_path):
    d = _copy(model_dirs, tmp_path)
    (d / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelConfig.from_dir(d)


@pytest.mark.parametrize("name", ["config.json", "generation_config.json", "tokenizer_config.json",
                                  "tokenizer.json"])
def test_corrupt_json_file_names_the_file(model_dirs, tmp_path, name):
    d = _copy(model_dirs, tmp_path)
    (d / name).write_text('{"vocab_size": 12,')
    with pytest.raises(ConfigError, match=name.replace(".", r"\.")):
        LLM(d, dtype="float32", num_kv_blocks=8, max_model_len=64)


def test_config_json_missing_a_required_field(model_dirs, tmp_path):
    d = _copy(model_dirs, tmp_path)
    _edit_config(d, num_hidden_layers=None)
    with pytest.raises(ConfigError, match="num_hidden_layers"):
        ModelConfig.from_dir(d)


def test_missing_weight_file(model_dirs, tmp_path):
    d = _copy(model_dirs, tmp_path)
    (d / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match=r"no \*\.safetensors weight file"):
        LLM(d, dtype="float32", num_kv_blocks=8, max_model_len=64)


@pytest.mark.parametrize("keep_bytes", [0, 5, 1000, 2_000_000])
def test_truncated_weight_file(model_dirs, tmp_path, keep_bytes):
    d = _copy(model_dirs, tmp_path)
    with open(d / "model.safetensors", "r+b") as f:
        f.truncate(keep_bytes)
    with pytest.raises(ConfigError, match="cannot read weight file .*model.safetensors"):
        LLM(d, dtype="float32", num_kv_blocks=8, max_model_len=64)


def test_weight_file_missing_a_plain_tensor(model_dirs, tmp_path):
    d = _copy(model_dirs, tmp_path)
    weights = load_file(d / "model.safetensors")
    del weights["model.layers.1.mlp.down_proj.weight"]
    save_file(weights, d / "model.safetensors")
    with pytest.raises(ConfigError, match=r"weights missing .*model\.layers\.1\.mlp\.down_proj\.weight"):
        LLM(d, dtype="float32", num_kv_blocks=8, max_model_len=64)


def test_weight_file_missing_a_fused_shard_names_the_checkpoint_tensor(model_dirs, tmp_path):
    """k_proj is loaded into the fused qkv_proj; the user's checkpoint has no tensor by that
    name, so the error must name the one it lacks."""
    d = _copy(model_dirs, tmp_path)
    weights = load_file(d / "model.safetensors")
    del weights["model.layers.0.self_attn.k_proj.weight"]
    save_file(weights, d / "model.safetensors")
    with pytest.raises(ConfigError) as e:
        LLM(d, dtype="float32", num_kv_blocks=8, max_model_len=64)
    assert "missing" in str(e.value)
    assert "model.layers.0.self_attn.k_proj.weight" in str(e.value)


def test_weight_with_wrong_shape(model_dirs, tmp_path):
    d = _copy(model_dirs, tmp_path)
    weights = load_file(d / "model.safetensors")
    weights["model.norm.weight"] = weights["model.norm.weight"][:-1].clone()
    save_file(weights, d / "model.safetensors")
    with pytest.raises(ConfigError, match=r"'model\.norm\.weight' has shape \(127,\)"):
        LLM(d, dtype="float32", num_kv_blocks=8, max_model_len=64)


def test_transformers5_rope_parameters(model_dirs, tmp_path, hf_greedy):
    d = _copy(model_dirs, tmp_path)
    _edit_config(d, rope_theta=None, rope_parameters={"rope_type": "default", "rope_theta": 500.0})
    assert ModelConfig.from_dir(d).rope_theta == 500.0
    assert ModelConfig.from_dir(model_dirs["llama"]).rope_theta == 10000.0
    # the engine really uses it: greedy output matches transformers on the edited model
    llm = LLM(d, dtype="float32", num_kv_blocks=16, max_model_len=64)
    prompt = list(range(40, 60))
    ours = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=MAX_NEW), use_tqdm=False)[0]
    assert ours["token_ids"] == hf_greedy(str(d), prompt, MAX_NEW)
    assert ours["token_ids"] != hf_greedy(model_dirs["llama"], prompt, MAX_NEW), "theta had no effect"


@pytest.mark.parametrize("changes, message", [
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 500.0, "factor": 4.0}},
     r"rope_parameters\.rope_type 'longrope' is not supported"),
    ({"rope_scaling": {"type": "su", "factor": 4.0}}, r"rope_scaling\.rope_type 'su' is not supported"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, r"rope_scaling with rope_type 'llama3' needs 'low_freq_factor'"),
    ({"partial_rotary_factor": 0.5}, r"partial_rotary_factor 0\.5 is not supported"),
    ({"hidden_act": "gelu"}, r"hidden_act 'gelu' is not supported"),
    ({"torch_dtype": "float8"}, r"torch_dtype 'float8' is not supported"),
    ({"use_sliding_window": True}, r"use_sliding_window true is not supported"),
])
def test_unsupported_config_fields_are_named(model_dirs, tmp_path, changes, message):
    d = _copy(model_dirs, tmp_path)
    _edit_config(d, **changes)
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_dir(d)


# ---- the CLI and transformers interplay -----------------------------------------------------
def test_make_model_cli_writes_a_model_transformers_loads(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    out = tmp_path / "cli-llama"
    proc = subprocess.run(["pdserve", "make-model", str(out), "--arch", "llama", "--size", "tiny", "--seed", "3"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert str(out) in proc.stdout
    model, info = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    cfg = ModelConfig.from_dir(out)
    assert cfg.arch == "llama" and cfg.vocab_size == model.config.vocab_size


def test_make_model_cli_rejects_unknown_arch(tmp_path, capsys):
    from pdserve.router.cli.main import main

    with pytest.raises(SystemExit) as e:
        main(["make-model", str(tmp_path / "x"), "--arch", "gpt2"])
    assert e.value.code == 2 and "gpt2" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_our_kernels_package_is_not_taken_for_hf_kernels():
    """pdserve's kernels live at pdserve.kernels; a top-level `kernels` (Hugging Face's,
    which transformers >= 5.25 requires) is never ours, and transformers still imports."""
    import importlib.util

    import transformers.activations  # noqa: F401  (imports HF's `kernels` where installed)

    from pdserve import kernels
    assert Path(kernels.__file__).resolve().parent == Path(__file__).resolve().parents[2] / "pdserve" / "kernels"
    assert callable(kernels.store_kv) and callable(kernels.paged_decode_attention)
    top = importlib.util.find_spec("kernels")
    if top is not None:
        assert Path(top.origin).resolve().parent != Path(kernels.__file__).resolve().parent
