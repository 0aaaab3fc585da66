"""`--quantization` (common/quantization.py): weight-only int8 / int4 linears from float
weights, and a GGUF file's Q8_0 / Q4_0 / Q4_1 linears kept as stored. Judged as vLLM judges
quantized models, against the reference on the dequantized weights -- here our float32
engine with every linear's weight replaced by its dequantized form: the quantized engine
multiplies by int8 dot products (activations rounded to int8 per 32 values,
kernels/csrc/gemm_quant_cpu.c), so greedy streams may part, and where they first do each
side's token is in the other's top 5, prefill and fused decode alike."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from pdserve.common import LLM
from pdserve.common.config import ConfigError, EngineConfig
from pdserve.common.engine.kv_layout import layout_of, model_fingerprint
from pdserve.common.engine.scoring import divergence, perplexity, sequence_logits
from pdserve.common.loading.gguf_convert import convert_gguf
from pdserve.common.models.layers import Linear
from pdserve.common.quantization import GGUF_SOURCE, gguf_source
from pdserve.kernels import quant
from tests.support.gguf_fixture import write_gguf
from tests.support.engines import assert_within_top5, make
from tests.support.engines import greedy

pytestmark = pytest.mark.usefixtures("torch_one_thread")


def dequantized_reference(model_dir: str, quantized: LLM) -> LLM:
    """A float32 engine whose linears hold `quantized`'s weights dequantized (the lm_head
    untied from the embedding table, which stays float as in `quantized`)."""
    ref = make(model_dir, "none")
    model = ref.engine.runner.model
    for name, module in quantized.engine.runner.model.named_modules():
        if isinstance(module, Linear) and module.quant is not None:
            target = model.get_submodule(name)
            target.weight = torch.nn.Parameter(quant.dequantize(module.quant), requires_grad=False)
    return ref


@pytest.mark.parametrize("arch,quantization", [("qwen3", "int4"), ("qwen2", "int8"), ("llama", "int4")])
def test_quantized_engine_against_float32_on_the_dequantized_weights_top5(model_dirs, arch, quantization):
    ours = make(model_dirs[arch], quantization)
    model = ours.engine.runner.model
    kinds = {name: m.quant.kind for name, m in model.named_modules() if isinstance(m, Linear)}
    layer_kind = quant.FROM_FLOAT[quantization]
    assert kinds.pop("lm_head") == "q8_0" and set(kinds.values()) == {layer_kind}
    stack = model.decode_stack()  # decode runs fused, on the quantized panels
    assert stack is not None and stack.layers[0].kinds == (quant.KIND_CODES[layer_kind],) * 4
    assert model.model.layers[0].mlp.down_proj.weight.numel() == 0  # the float copy let go
    if model.config.tie_word_embeddings:  # the lookups read the float table
        assert model.model.embed_tokens.weight.dtype == torch.float32 and model.lm_head.weight.numel() > 0
    assert_within_top5(ours, dequantized_reference(model_dirs[arch], ours))


def test_fingerprint_and_config_carry_the_quantization(model_dirs):
    d = model_dirs["qwen3"]
    config = EngineConfig.build(d, quantization="int4")
    assert config.device.quantization == "int4"
    assert EngineConfig.build(d).device.quantization == "none"  # auto, not from a GGUF
    fp = layout_of(config).model_fingerprint
    assert fp.endswith(":float32+int4") and fp != model_fingerprint(d, "float32")
    assert fp.split(":")[0] == model_fingerprint(d, "float32").split(":")[0]
    with pytest.raises(ConfigError, match="quantization"):
        EngineConfig.build(d, quantization="int3")
    with pytest.raises(ConfigError, match="not converted from a GGUF"):
        EngineConfig.build(d, quantization="gguf")
    with pytest.raises(ConfigError, match="CPU only"):
        EngineConfig.build(d, quantization="int8", device="cuda")


def test_router_refuses_a_worker_of_another_quantization(model_dirs):
    from pdserve.common.wire.messages import WorkerHello
    from pdserve.router.core.registry import refusal
    d = model_dirs["qwen3"]
    hello = WorkerHello(worker_id="d1", role="decode", address="tcp://x:1", device="cpu", total_blocks=8, block_size=16,
                        model_fingerprint=model_fingerprint(d, "float32", "int4"))
    why = refusal(hello, 16, model_fingerprint(d, "float32"))
    assert why is not None and "float32+int4 (router: float32" in why and "--quantization none" in why
    assert refusal(hello, 16, model_fingerprint(d, "float32", "int4")) is None


@pytest.mark.parametrize("qtype,arch", [("Q4_1", "llama"), ("Q4_0", "qwen3"), ("Q8_0", "qwen2")])
def test_gguf_linears_stay_quantized_as_stored(model_dirs, tmp_path, qtype, arch):
    """A converted GGUF folder loads its quantized linears from the file by default: the
    same weights as the float32 conversion bit for bit (llama's q/k rows un-permuted),
    greedy within the top 5 of that conversion run in float32."""
    out = convert_gguf(write_gguf(model_dirs[arch], tmp_path / "m.gguf", qtype), tmp_path / "conv", quiet=True)
    assert gguf_source(out) == (tmp_path / "m.gguf").resolve()
    ours, plain = make(out, "auto"), make(out, "none")
    assert ours.engine.config.device.quantization == "gguf"
    model, floats = ours.engine.runner.model, load_file(out / "model.safetensors")
    kind = quant.GGUF_KINDS[qtype][0]
    for name, m in model.named_modules():
        if isinstance(m, Linear):
            assert m.quant is not None and m.quant.kind == kind, name
            want = plain.engine.runner.model.get_submodule(name).weight
            assert torch.equal(quant.dequantize(m.quant), want), name
    assert "model.layers.0.mlp.down_proj.weight" in floats
    assert_within_top5(ours, plain)
    assert ours.engine.runner.model.decode_stack() is not None
    (tmp_path / "m.gguf").unlink()  # the file gone: auto falls back to float, gguf refuses
    assert EngineConfig.build(out).device.quantization == "none"
    with pytest.raises(ConfigError, match="not converted from a GGUF"):
        EngineConfig.build(out, quantization="gguf")
    assert (out / GGUF_SOURCE).is_file()


def test_gguf_linears_cached_in_the_converted_folder(model_dirs, tmp_path, monkeypatch):
    """The repacked linears are kept in the folder (`gguf_linears.cache`) and read back
    equal; a changed GGUF file, other model shapes or a damaged cache remake them; a folder
    that cannot be written still loads; the folder's own loader never takes the cache for
    weights."""
    import dataclasses
    import os

    from pdserve.common.loading import gguf_quant
    gguf = write_gguf(model_dirs["llama"], tmp_path / "m.gguf", "Q4_1")
    out = convert_gguf(gguf, tmp_path / "conv", quiet=True)
    cfg = EngineConfig.build(out).model
    made = []
    real = gguf_quant.gguf_linears
    monkeypatch.setattr(gguf_quant, "gguf_linears", lambda *a: made.append(a) or real(*a))

    def same(a, b):
        assert a.keys() == b.keys() and a
        for name in a:
            assert (a[name].kind, a[name].n, a[name].k) == (b[name].kind, b[name].n, b[name].k), name
            assert torch.equal(a[name].data, b[name].data), name

    want = real(gguf, cfg)
    same(gguf_quant.cached_gguf_linears(gguf, cfg, out), want)
    assert len(made) == 1 and (out / gguf_quant.CACHE_FILE).is_file()
    same(gguf_quant.cached_gguf_linears(gguf, cfg, out), want)
    assert len(made) == 1  # read from the cache
    ours, plain = make(out, "auto"), make(out, "none")  # both load the folder with the cache in it
    assert len(made) == 1
    assert greedy(ours, [5, 9, 2, 7], 8) == greedy(make(out, "auto"), [5, 9, 2, 7], 8)
    assert plain.engine.config.device.quantization == "none"

    other = dataclasses.replace(cfg, num_layers=cfg.num_layers - 1)
    gguf_quant.cached_gguf_linears(gguf, other, out)
    assert len(made) == 2  # other shapes: remade (and the cache now holds those)
    same(gguf_quant.cached_gguf_linears(gguf, cfg, out), want)
    assert len(made) == 3
    st = gguf.stat()
    os.utime(gguf, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # the file changed (or looks so)
    same(gguf_quant.cached_gguf_linears(gguf, cfg, out), want)
    assert len(made) == 4
    (out / gguf_quant.CACHE_FILE).write_bytes(b"\x00" * 64)  # damaged
    same(gguf_quant.cached_gguf_linears(gguf, cfg, out), want)
    assert len(made) == 5
    same(gguf_quant.cached_gguf_linears(gguf, cfg, out), want)
    assert len(made) == 5
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no temporary file left by the writes

    def refuse(*_):
        raise PermissionError("read-only folder")
    (out / gguf_quant.CACHE_FILE).unlink()
    monkeypatch.setattr(gguf_quant, "_write_cache", refuse)
    same(gguf_quant.cached_gguf_linears(gguf, cfg, out), want)
    assert len(made) == 6 and not (out / gguf_quant.CACHE_FILE).exists()


def test_real_model_quantized_against_float32(real_model_dir):
    """SmolLM2 (its GGUF's Q4_1 linears and Q8_0 lm_head) by vLLM's rule against its float32
    conversion: run as stored (`gguf`: the same weights, decode by int8 dot products) and
    re-quantized from those floats (int8, int4), greedy within the top 5 where the streams
    first differ, and perplexity of a fixed text (one prefill: the dequantizing tile) within
    1% (gguf, int8) / 10% (int4) of float32's."""
    from tests.support.engines import TEXT
    llms = {q: LLM(real_model_dir, dtype="float32", num_threads=1, num_kv_blocks=64, max_model_len=512, quantization=q,
                   enable_prefix_caching=False, max_num_batched_tokens=512) for q in ("none", "gguf", "int8", "int4")}
    f32, tok = llms["none"], llms["none"].tokenizer
    ids = tok.encode(TEXT)[:200]
    ppl = {q: perplexity(sequence_logits(llm.engine, ids), ids) for q, llm in llms.items()}
    report = {q: [] for q in llms}
    for text in ("The capital of France is", "Once upon a time, in a small village,"):
        prompt = tok.encode(text)
        ref = greedy(f32, prompt, 24)
        for q, llm in llms.items():
            d = divergence(prompt, ref, greedy(llm, prompt, 24), f32.engine, llm.engine)
            report[q].append(d.position)
            assert d.within_top(5), (q, text, d)
    print(f"\nperplexity {ppl}; first divergence from float32 per prompt (None: identical) {report}")
    assert abs(ppl["gguf"] / ppl["none"] - 1) < 0.01 and abs(ppl["int8"] / ppl["none"] - 1) < 0.01, ppl
    assert abs(ppl["int4"] / ppl["none"] - 1) < 0.10, ppl
