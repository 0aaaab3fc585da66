"""GGUF K-quant linears kept quantized (common/loading/gguf_quant.py): Q4_K as q4_1 with
float16 sub-block scales and minimums, Q5_K / Q6_K (and a fused group of mixed kinds)
re-quantized to q8_0. Blocks are packed here from random codes and scales
(tests/support/gguf_fixture.py; `gguf` has no K-quant quantizer) and judged against gguf-py's
dequantize of the same bytes: within the stated bounds, in the GEMM, and end to end on a
Q4_K_M-like file against its float32 conversion by vLLM's top-5 rule."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from pdserve.common import SamplingParams
from pdserve.common.loading import model_factory
from pdserve.common.loading.gguf_convert import convert_gguf
from pdserve.common.loading.gguf_quant import repack
from pdserve.common.models.layers import Linear
from pdserve.kernels import quant
from tests.support.engines import assert_within_top5, make
from tests.support.gguf_fixture import QK_K, pack_q4_k, pack_q5_k, pack_q6_k, write_gguf

pytestmark = pytest.mark.usefixtures("torch_one_thread")

F16_ROUNDING = 2.0 ** -11  # float16's relative rounding bound (unit roundoff) for normal values
SLACK = 1 + 2.0 ** -10  # the float32 roundings on top


def random_blocks(qtype: str, rows: int, k: int, seed: int
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]:
    """Random K-quant blocks for a [rows, k] tensor: (uint8 [rows, bytes per row], codes
    [rows, k] as stored (Q6_K: -32..31), and for Q4_K / Q5_K each 32 values' scale d sc_j and
    minimum -(dmin m_j) [rows, k / 32] in float32, exact)."""
    rng = np.random.default_rng(seed)
    b = rows * k // QK_K
    d = (rng.uniform(0.5, 2.0, b) * 2.0 ** -10).astype(np.float16)  # normal float16, typical of real files
    if qtype == "Q6_K":
        sc = rng.integers(-128, 128, (b, 16)).astype(np.int8)
        q = rng.integers(-32, 32, (b, QK_K)).astype(np.int8)
        return pack_q6_k(d, sc, q).reshape(rows, -1), q.reshape(rows, k), None, None
    dmin = (rng.uniform(0.5, 2.0, b) * 2.0 ** -8).astype(np.float16)
    sc, m = rng.integers(0, 64, (b, 8)).astype(np.uint8), rng.integers(0, 64, (b, 8)).astype(np.uint8)
    q = rng.integers(0, 16 if qtype == "Q4_K" else 32, (b, QK_K)).astype(np.uint8)
    pack = pack_q4_k if qtype == "Q4_K" else pack_q5_k
    scale = (d.astype(np.float32)[:, None] * sc).reshape(rows, -1)
    minimum = -(dmin.astype(np.float32)[:, None] * m).reshape(rows, -1)
    return pack(d, dmin, sc, m, q).reshape(rows, -1), q.reshape(rows, k), scale, minimum


def gguf_values(qtype: str, raw: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype]))


def stated_bound(w: quant.QuantWeight) -> torch.Tensor:
    """[n, k]: how far w may be from the values it was made from. q4_1 from Q4_K: its float16
    scale d' and minimum m' each rounded, 2^-11 (15 |d'| + |m'|); q8_0 re-quantized: half a
    step, d / 2 (= max |w| / 254 over its 32 values)."""
    _, d, m = quant.unpack(w)
    d = d.float().abs()
    per_group = F16_ROUNDING * (15 * d + m.float().abs()) if w.kind == "q4_1" else d / 2
    return per_group.repeat_interleave(quant.GROUP, dim=1) * SLACK


@pytest.mark.parametrize("qtype,kind", [("Q4_K", "q4_1"), ("Q4_K", "q8_0"), ("Q5_K", "q8_0"), ("Q6_K", "q8_0")])
def test_k_quant_blocks_repack_within_the_stated_bound_of_gguf_py(qtype, kind):
    n, k = 20, 2 * QK_K  # a panel tail; two super-blocks per row
    raw, codes, scale, minimum = random_blocks(qtype, n, k, seed=0)
    want = gguf_values(qtype, raw)
    ours = repack(qtype, raw, n, k, kind)
    assert (ours.kind, ours.n, ours.k) == (kind, n, k)
    q, d, m = quant.unpack(ours)
    if kind == "q4_1":  # the file's codes in place, each scale and minimum rounded once to float16
        assert torch.equal(q, torch.from_numpy(codes))
        assert torch.equal(d, torch.from_numpy(scale).to(torch.float16))
        assert torch.equal(m, torch.from_numpy(minimum).to(torch.float16))
    else:  # q8_0 of the values: d = max |w| / 127 per 32, in float16
        assert torch.equal(d, (want.reshape(n, -1, quant.GROUP).abs().amax(-1) / 127).to(torch.float16))
    err = (quant.dequantize(ours) - want).abs()
    assert bool((err <= stated_bound(ours)).all()), float((err / stated_bound(ours)).max())


# the float16 fields of each block (byte offsets: d, and dmin where there is one); the rest
# of a block is codes and packed sub-scales, any bytes of which are valid
F16_FIELDS = {"Q5_0": (0,), "Q5_1": (0, 2), "IQ4_NL": (0,), "IQ4_XS": (0,), "Q2_K": (80, 82), "Q3_K": (108,)}


@pytest.mark.parametrize("qtype", sorted(F16_FIELDS))
def test_other_kept_types_requantize_to_q8_0_within_half_a_step(qtype):
    """llama.cpp's fallbacks in a K-quant file (Q5_0, Q5_1, IQ4_NL for rows not a multiple
    of 256) and the low-bit K / IQ types: gguf-py's values re-quantized to q8_0."""
    block, nbytes = gguf.constants.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
    n, k = 20, 512
    rng = np.random.default_rng(3)
    raw = rng.integers(0, 256, (n * k // block, nbytes), dtype=np.uint8)
    for at in F16_FIELDS[qtype]:
        raw[:, at:at + 2] = (rng.uniform(0.5, 2.0, (len(raw), 1)) * 2.0 ** -8).astype(np.float16).view(np.uint8)
    raw = raw.reshape(n, -1)
    want = gguf_values(qtype, raw)
    assert want.shape == (n, k) and bool(want.abs().max() > 0)
    ours = repack(qtype, raw, n, k)
    assert ours.kind == "q8_0"
    err = (quant.dequantize(ours) - want).abs()
    assert bool((err <= stated_bound(ours)).all()), float((err / stated_bound(ours)).max())


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
@pytest.mark.parametrize("m", [1, 9])  # by int8 dot products (a decode batch), by the dequantizing tile
def test_gemm_on_repacked_k_quants_is_the_product_with_gguf_py_values(qtype, m):
    """gemm_q on the repacked weight against x @ gguf-py's values^T, within the weight's
    stated bound and (dot products) the activations' int8 rounding."""
    n, k = 40, QK_K
    raw, *_ = random_blocks(qtype, n, k, seed=m)
    w, want = repack(qtype, raw, n, k), gguf_values(qtype, raw).double()
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    got = quant.gemm_q(x, w).double()
    dense = quant.dequantize(w).abs().double()
    bound = x.abs().double() @ stated_bound(w).double().T + 1e-6 * (x.abs().double() @ dense.T) + 1e-6
    if m <= quant.QDOT_ROWS:  # x rounded to int8 per 32: half a step of max |x| / 127 per value
        step = x.abs().reshape(m, -1, quant.GROUP).amax(-1).repeat_interleave(quant.GROUP, dim=1) / 127 / 2
        bound += step.double() @ dense.T
    assert bool(((got - x.double() @ want.T).abs() <= bound).all())


# a Q4_K_M-like file: Q4_K, with a Q6_K attn_v beside Q4_K q / k (a mixed qkv), Q6_K and
# Q5_K ffn_down, a Q4_1 ffn_up beside a Q4_K ffn_gate (one kind), and a Q6_K output
TYPES = {"blk.0.attn_v": "Q6_K", "blk.0.ffn_down": "Q6_K", "blk.1.ffn_down": "Q5_K", "blk.1.ffn_up": "Q4_1",
         "output": "Q6_K"}
KINDS = {"model.layers.0.self_attn.qkv_proj": "q8_0", "model.layers.0.self_attn.o_proj": "q4_1",
         "model.layers.0.mlp.gate_up_proj": "q4_1", "model.layers.0.mlp.down_proj": "q8_0",
         "model.layers.1.self_attn.qkv_proj": "q4_1", "model.layers.1.self_attn.o_proj": "q4_1",
         "model.layers.1.mlp.gate_up_proj": "q4_1", "model.layers.1.mlp.down_proj": "q8_0", "lm_head": "q8_0"}
# K-quant rows need k a multiple of 256: hidden, intermediate and heads x head_dim
KQUANT_SIZE = model_factory.ModelSize(hidden=256, intermediate=512, layers=2, heads=4, kv_heads=2, head_dim=64,
                                      vocab=2048, max_positions=2048)


def test_a_k_quant_file_runs_its_linears_quantized_within_top5_of_float32(tmp_path, monkeypatch, hf_greedy):
    monkeypatch.setitem(model_factory.SIZES, "kquant", KQUANT_SIZE)
    src = model_factory.make_model(tmp_path / "src", "llama", "kquant", seed=1)  # untied: output.weight; q/k permuted
    path = write_gguf(src, tmp_path / "m.gguf", "Q4_K", TYPES)
    out = convert_gguf(path, tmp_path / "conv", quiet=True)
    # the conversion: gguf-py's values for every tensor (the Q4_K embedding, float32 norms),
    # greedy as transformers' on them
    tensors = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    floats = load_file(out / "model.safetensors")
    embed = tensors["token_embd.weight"]
    assert embed.tensor_type.name == "Q4_K"
    assert torch.equal(floats["model.embed_tokens.weight"], gguf_values("Q4_K", np.asarray(embed.data)))
    assert torch.equal(floats["model.norm.weight"], torch.from_numpy(np.array(tensors["output_norm.weight"].data)))
    plain = make(out, "none")
    prompt = list(range(20, 50))
    params = SamplingParams(temperature=0, max_tokens=8)
    assert plain.generate(prompt, params, use_tqdm=False)[0]["token_ids"] == hf_greedy(str(out), prompt, 8)

    ours = make(out, "auto")
    assert ours.engine.config.device.quantization == "gguf"
    model = ours.engine.runner.model
    linears = {name: mod for name, mod in model.named_modules() if isinstance(mod, Linear)}
    assert {name: mod.quant and mod.quant.kind for name, mod in linears.items()} == KINDS
    for name, mod in linears.items():  # llama's q / k rows un-permuted as the conversion's
        err = (quant.dequantize(mod.quant) - plain.engine.runner.model.get_submodule(name).weight).abs()
        assert bool((err <= stated_bound(mod.quant)).all()), name
    assert torch.equal(model.model.embed_tokens.weight, floats["model.embed_tokens.weight"])
    stack = model.decode_stack()  # decode runs fused, each matrix in its own kind
    layer0 = [KINDS[f"model.layers.0.{name}"] for name in ("self_attn.qkv_proj", "self_attn.o_proj",
                                                           "mlp.gate_up_proj", "mlp.down_proj")]
    assert stack is not None and stack.layers[0].kinds == tuple(quant.KIND_CODES[k] for k in layer0)
    assert_within_top5(ours, plain)
