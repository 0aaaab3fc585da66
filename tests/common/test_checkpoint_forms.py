"""Model folders as transformers and the Hub write them: sharded bf16 safetensors with an
index, chat templates in chat_template.jinja or as a list of named templates, rendered
in a sandbox, and generation_config.json with a list of EOS ids or missing."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdserve.common import LLM, SamplingParams
from pdserve.common.text.chat_template import ChatTemplateError
from pdserve.common.config import ConfigError, ModelConfig
from pdserve.common.text.tokenizer import Tokenizer

pytestmark = pytest.mark.usefixtures("torch_one_thread")

MAX_NEW = 10
PROMPT = list(range(30, 70))
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]


def _sharded_bf16(src: str, dst) -> str:
    shutil.copytree(src, dst)
    weights = load_file(dst / "model.safetensors")
    (dst / "model.safetensors").unlink()
    names = sorted(weights)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for file, keys in shards.items():
        save_file({k: weights[k].to(torch.bfloat16) for k in keys}, dst / file, metadata={"format": "pt"})
    index = {"metadata": {"total_size": 0}, "weight_map": {k: f for f, ks in shards.items() for k in ks}}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    cfg = json.loads((dst / "config.json").read_text())
    cfg.pop("torch_dtype", None)
    cfg["dtype"] = "bfloat16"
    (dst / "config.json").write_text(json.dumps(cfg))
    return str(dst)


def test_sharded_bf16_checkpoint_matches_transformers(model_dirs, tmp_path, hf_greedy):
    d = _sharded_bf16(model_dirs["qwen2"], tmp_path / "sharded")
    llm = LLM(d, num_kv_blocks=32, max_model_len=128)  # engine dtype float32; weights upcast on load
    ours = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=MAX_NEW), use_tqdm=False)[0]
    assert ours["token_ids"] == hf_greedy(d, PROMPT, MAX_NEW)


def test_sharded_checkpoint_with_a_missing_shard_names_it(model_dirs, tmp_path):
    d = _sharded_bf16(model_dirs["llama"], tmp_path / "sharded")
    (tmp_path / "sharded" / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ConfigError, match="model-00002-of-00002.safetensors"):
        LLM(d, dtype="float32", num_kv_blocks=8, max_model_len=64)


def _template_folder(src: str, dst, form: str) -> str:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "tokenizer_config.json").read_text())
    template = cfg.pop("chat_template")
    if form == "jinja":
        (dst / "chat_template.jinja").write_text(template)
    elif form == "list":
        cfg["chat_template"] = [{"name": "default", "template": template},
                                {"name": "tool_use", "template": "TOOLS {{ tools | tojson }} " + template}]
    (dst / "tokenizer_config.json").write_text(json.dumps(cfg))
    return str(dst)


@pytest.mark.parametrize("form", ["jinja", "list"])
def test_chat_template_forms_render_as_transformers(model_dirs, tmp_path, form):
    from transformers import AutoTokenizer
    d = _template_folder(model_dirs["qwen3"], tmp_path / form, form)
    ours, hf = Tokenizer(d), AutoTokenizer.from_pretrained(d)
    assert ours.apply_chat_template(MESSAGES) == hf.apply_chat_template(MESSAGES, tokenize=False,
                                                                        add_generation_prompt=True)
    if form == "list":
        tools = [{"type": "function", "function": {"name": "now", "description": "the time, «UTC»"}}]
        got = ours.apply_chat_template(MESSAGES, tools=tools)
        assert got.startswith("TOOLS ") and "«UTC»" in got  # tojson keeps non-ASCII, as transformers' does
        assert got == hf.apply_chat_template(MESSAGES, tools=tools, tokenize=False, add_generation_prompt=True)


def test_chat_template_variables_and_sandbox(model_dirs, tmp_path):
    d = _template_folder(model_dirs["qwen3"], tmp_path / "t", "jinja")
    path = tmp_path / "t" / "chat_template.jinja"
    path.write_text("{{ bos_token }}|{{ eos_token }}|{% if messages|length > 1 %}{{ raise_exception('one only') }}"
                    "{% endif %}{{ messages[0]['content'] }}")
    tok = Tokenizer(d)
    assert tok.apply_chat_template(MESSAGES[1:]) == "None|<|im_end|>|Hi there"
    with pytest.raises(ChatTemplateError, match="one only"):
        tok.apply_chat_template(MESSAGES)
    # a model folder must not run code: attribute escapes are refused by the sandbox
    path.write_text("{{ ''.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(ChatTemplateError):
        Tokenizer(d).apply_chat_template(MESSAGES)
    path.write_text("{% for x in %}")
    with pytest.raises(ConfigError, match="chat_template.jinja: chat template has a syntax error"):
        Tokenizer(d)


def test_no_chat_template_is_a_request_error(model_dirs, tmp_path):
    d = _template_folder(model_dirs["qwen3"], tmp_path / "none", "none")
    with pytest.raises(ChatTemplateError, match="no chat template"):
        Tokenizer(d).apply_chat_template(MESSAGES)


def test_generation_config_eos_list_or_missing(model_dirs, tmp_path):
    d = tmp_path / "g"
    shutil.copytree(model_dirs["llama"], d)
    gen = json.loads((d / "generation_config.json").read_text())
    assert len(gen["eos_token_id"]) == 2
    assert ModelConfig.from_dir(d).eos_token_ids == tuple(gen["eos_token_id"])
    (d / "generation_config.json").unlink()
    cfg = json.loads((d / "config.json").read_text())
    assert ModelConfig.from_dir(d).eos_token_ids == (cfg["eos_token_id"],)
