"""The native decode stack (kernels/cpu_decode.py, kernels/csrc/decode_layers_cpu.c): a
pure decode batch's layers in one call, against the per-op path with the native kernels
turned off (plain torch), on every architecture: the hidden states and the K/V it stores.
Greedy output against transformers goes through it too (tests/common)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from pdserve.common import LLM, SamplingParams
from pdserve.common.models.layers import Linear
from pdserve.kernels import cpu_native
from pdserve.kernels.cpu_decode import PART_CALLS, PART_TOTAL, PARTS, DecodeStack

ARCHS = ("qwen3", "qwen2", "llama")  # q/k norm; qkv bias; neither (GQA in all three)


@pytest.fixture(scope="module", autouse=True)
def built():
    assert cpu_native.library() is not None, "the native kernels did not build (is a C compiler installed?)"


@pytest.fixture(scope="module")
def engines(model_dirs):
    return {arch: LLM(model_dirs[arch], dtype="float32", num_threads=2, num_kv_blocks=256, max_model_len=256).engine for arch in ARCHS}


def decode_inputs(engine, batch: int):
    """`batch` sequences prefilled (prompt lengths that straddle block edges), then the
    next decode step's model inputs, scheduled but not run."""
    params = SamplingParams(max_tokens=50, ignore_eos=True, temperature=0)
    seqs = []
    for i in range(batch):
        seq = engine.new_sequence([3 + (7 * i + j) % 200 for j in range(15 + 9 * i)], params)
        engine.add(seq)
        seqs.append(seq)
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in seqs):
        engine.step()
    sched = engine.scheduler.schedule()
    assert sched.num_tokens == [1] * batch
    return seqs, engine.runner.prepare(sched.seqs, sched.num_tokens)


def slot_rows(model, slots):
    """Every layer's K and V rows at these cache slots, copied."""
    out = []
    for k_cache, v_cache in model.kv_caches:
        for cache in (k_cache, v_cache):
            out.append(cache.flatten(0, 1)[slots].clone())
    return out


def replan(model):
    """The linear layers plan again at their next call, under the environment then."""
    for module in model.modules():
        if isinstance(module, Linear):
            module._plan_of = None


@pytest.fixture
def torch_path(monkeypatch):
    """torch_path(model): every native kernel off from here on, plain torch (the linear
    layers re-planned); the model's layers plan natively again after the test."""
    models = []

    def off(model):
        monkeypatch.setenv("PDSERVE_CPU_ATTENTION", "torch")
        replan(model)
        models.append(model)

    yield off
    monkeypatch.delenv("PDSERVE_CPU_ATTENTION")
    for model in models:
        replan(model)


def spy(monkeypatch):
    calls = []
    real = DecodeStack.__call__
    monkeypatch.setattr(DecodeStack, "__call__", lambda self, *a: calls.append(a[0].shape[0]) or real(self, *a))
    return calls


@pytest.fixture(scope="module", autouse=True)
def widened_bf16_prompts():
    """Every product through the widened bf16 tile on every CPU (not torch's bf16 matmul
    from a shape's crossover where the CPU has bf16 dot products, `kernels.bf16_dot_cpu`):
    the stack takes every batch, and it and the torch path are compared from the same
    prefilled state everywhere."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PDSERVE_CPU_BF16_DOT", "0")
        yield


@pytest.fixture(scope="module")
def bf16_engines(model_dirs):
    """bf16 weights, float32 activations and cache (common.models.precision)."""
    return {arch: LLM(model_dirs[arch], num_threads=2, num_kv_blocks=256, max_model_len=256,
                      dtype="bfloat16").engine for arch in ARCHS}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("batch", [1, 3, 7, 17])  # 7 and 17: past a 6-row register tile
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_stack_matches_torch_path(engines, bf16_engines, arch, batch, dtype, monkeypatch, torch_path):
    """bfloat16: the stack reads the bf16 panels and the bf16 cache; the torch path
    multiplies by the same bf16 weights widened (F.linear in float32) and reads the same
    cache widened, so the two agree as closely."""
    engine = (engines if dtype == "float32" else bf16_engines)[arch]
    if dtype == "bfloat16":
        layer = engine.runner.model.decode_stack().layers[0]
        assert layer.qkv_p.dtype == layer.k_cache.dtype == torch.bfloat16
    seqs, (ids, positions, meta, _, _) = decode_inputs(engine, batch)
    model = engine.runner.model
    calls = spy(monkeypatch)
    try:
        with torch.inference_mode():
            fast = model(ids, positions, meta)
            fast_kv = slot_rows(model, meta.slot_mapping)
            assert calls == [batch], "the decode batch did not take the native stack"
            torch_path(model)
            slow = model(ids, positions, meta)
            slow_kv = slot_rows(model, meta.slot_mapping)
        assert calls == [batch]
        # float rounding of other summation orders (attention, norms), carried through the
        # layers: up to ~1.2e-4 on hidden states of magnitude ~3.5 seen; a wrong head,
        # slot or weight is off by far more
        torch.testing.assert_close(fast, slow, rtol=1e-4, atol=3e-4)
        # a bf16 cache: those differences may round a stored value one bf16 step (2^-8
        # relative, half-way cases) apart
        kv_rtol = 1e-4 if dtype == "float32" else 2 ** -7
        for a, b in zip(fast_kv, slow_kv):
            torch.testing.assert_close(a, b, rtol=kv_rtol, atol=3e-4)
    finally:
        for s in seqs:
            engine.abort(s)


def test_negative_slot_is_not_stored(engines, monkeypatch):
    engine = engines["qwen3"]
    seqs, (ids, positions, meta, _, _) = decode_inputs(engine, 2)
    model = engine.runner.model
    try:
        real_slots = meta.slot_mapping.clone()
        before = slot_rows(model, real_slots)
        meta.slot_mapping = torch.tensor([-1, int(real_slots[1])])
        with torch.inference_mode():
            model(ids, positions, meta)
        after = slot_rows(model, real_slots)
        for a, b in zip(before, after):
            torch.testing.assert_close(a[0], b[0], rtol=0, atol=0)  # the skipped token's rows untouched
        assert any(not torch.equal(a[1], b[1]) for a, b in zip(before, after)), "the other token was not stored"
    finally:
        for s in seqs:
            engine.abort(s)


def test_slot_outside_cache_is_refused_before_any_write(engines):
    engine = engines["llama"]
    seqs, (ids, positions, meta, _, _) = decode_inputs(engine, 1)
    model = engine.runner.model
    try:
        snapshot = [c.clone() for kv in model.kv_caches for c in kv]
        k_cache = model.kv_caches[0][0]
        meta.slot_mapping = torch.tensor([k_cache.shape[0] * k_cache.shape[1]])
        with pytest.raises(cpu_native.NativeKernelError, match="bad arguments"), torch.inference_mode():
            model(ids, positions, meta)
        assert all(torch.equal(a, b) for a, b in zip(snapshot, (c for kv in model.kv_caches for c in kv)))
    finally:
        for s in seqs:
            engine.abort(s)


def test_swapped_weight_storage_is_followed(model_dirs, torch_path):
    """A weight whose storage is replaced (`param.data = ...`) after the stack was set up:
    the next step reads the new one (the stack's pointers would otherwise dangle)."""
    engine = LLM(model_dirs["qwen2"], dtype="float32", num_threads=2, num_kv_blocks=32, max_model_len=128).engine
    seqs, (ids, positions, meta, _, _) = decode_inputs(engine, 2)
    model = engine.runner.model
    with torch.inference_mode():
        model(ids, positions, meta)  # sets the stack up
        down = model.model.layers[0].mlp.down_proj
        down.weight.data = torch.randn_like(down.weight) * 0.5
        qkv = model.model.layers[1].self_attn.qkv_proj
        qkv.bias.data = torch.randn_like(qkv.bias)
        fast = model(ids, positions, meta)
        torch_path(model)
        slow = model(ids, positions, meta)
    torch.testing.assert_close(fast, slow, rtol=1e-4, atol=1e-4)


def test_written_weight_replaced_norm_and_swapped_final_norm_are_followed(model_dirs, torch_path):
    """After the stack was set up: a linear's weight written in place and planned again
    elsewhere (as a prefill step's per-op path does), a layer norm's parameter replaced
    by a new one, the final norm's storage swapped: the next decode step reads them all."""
    engine = LLM(model_dirs["llama"], dtype="float32", num_threads=1, num_kv_blocks=32, max_model_len=128).engine
    seqs, (ids, positions, meta, _, _) = decode_inputs(engine, 2)
    model = engine.runner.model
    with torch.inference_mode():
        before = model(ids, positions, meta)  # sets the stack up
    with torch.no_grad():
        o = model.model.layers[0].self_attn.o_proj
        o.weight.mul_(0.5)
        o.plan()
        norm = model.model.layers[1].post_attention_layernorm
        norm.weight = torch.nn.Parameter(norm.weight * 1.5, requires_grad=False)
        model.model.norm.weight.data = model.model.norm.weight * 0.9
    with torch.inference_mode():
        fast = model(ids, positions, meta)
        torch_path(model)
        slow = model(ids, positions, meta)
    assert not torch.allclose(before, fast, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(fast, slow, rtol=1e-4, atol=1e-4)


def test_a_token_id_outside_the_table_is_refused(engines):
    engine = engines["qwen2"]
    seqs, (ids, positions, meta, _, _) = decode_inputs(engine, 1)
    try:
        with torch.inference_mode(), pytest.raises(cpu_native.NativeKernelError, match="token id or position"):
            engine.runner.model(torch.full_like(ids, engine.config.model.vocab_size), positions, meta)
    finally:
        for s in seqs:
            engine.abort(s)


def test_not_taken_where_it_does_not_apply(engines, monkeypatch):
    """With a layer hook (layer-wise KV push), and with the native kernels off, the
    per-op path runs."""
    engine = engines["qwen3"]
    calls = spy(monkeypatch)
    seqs, (ids, positions, meta, _, _) = decode_inputs(engine, 2)
    try:
        with torch.inference_mode():
            hooked = []
            engine.runner.model(ids, positions, meta, layer_hook=hooked.append)
            assert hooked == list(range(len(engine.runner.model.model.layers)))
            monkeypatch.setenv("PDSERVE_CPU_ATTENTION", "torch")
            engine.runner.model(ids, positions, meta)
    finally:
        for s in seqs:
            engine.abort(s)
    assert calls == []


def test_no_stack_for_other_dtypes(model_dirs):
    engine = LLM(model_dirs["llama"], num_threads=1, num_kv_blocks=16, max_model_len=64, dtype="float16").engine
    assert engine.runner.model.decode_stack() is None


def test_no_stack_for_a_wrong_length_vector(engines):
    """The native code reads each norm and bias at the model's sizes: a tensor of another
    length is refused at set-up, not read past its end."""
    model = engines["qwen2"].runner.model
    stack = model.decode_stack()
    assert stack is not None
    for field in ("input_norm", "qkv_b"):
        layers = list(stack.layers)
        layers[1] = dataclasses.replace(layers[1], **{field: getattr(layers[1], field)[:-1]})
        assert DecodeStack.build(layers, stack.dims, stack.model) is None, field
    assert DecodeStack.build(list(stack.layers), stack.dims, stack.model) is not None


def test_parts_time_a_step_without_changing_it(engines):
    """`DecodeStack.parts`: the same logits and argmax with the step timed as without; one
    call counted; every part that runs has time, the laps sum to the call's whole time;
    a tensor of the wrong kind is refused before the call."""
    engine = engines["qwen3"]
    seqs, _ = decode_inputs(engine, 3)
    model = engine.runner.model
    stack = model.decode_stack()
    rows = engine.runner.decode_inputs(seqs)
    try:
        with torch.inference_mode():
            plain, plain_top = model.decode_logits(rows)
            plain = plain.clone()  # the stack's buffer: the next call writes it again
            stack.parts = torch.zeros(len(PARTS) + 2, dtype=torch.float64)
            timed, timed_top = model.decode_logits(rows)
            parts = stack.parts.clone()
            assert torch.equal(plain, timed) and plain_top == timed_top
            assert parts[PART_CALLS] == 1
            by_name = dict(zip(PARTS, parts.tolist()))
            assert all(by_name[p] > 0 for p in ("norms", "qkv", "rope_store", "attention", "o", "gate_up", "down",
                                                "lm_head")), by_name
            assert float(parts[:len(PARTS)].sum()) == pytest.approx(float(parts[PART_TOTAL]), rel=1e-9)
            stack.parts = torch.zeros(len(PARTS) + 2, dtype=torch.float32)
            with pytest.raises(ValueError, match="float64"):
                model.decode_logits(rows)
    finally:
        stack.parts = None
        for s in seqs:
            engine.abort(s)
