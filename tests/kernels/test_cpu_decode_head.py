"""The native decode stack on to the lm_head (`DecodeStack.logits`,
`DecoderForCausalLM.decode_logits`): a pure decode batch's logits and each row's argmax in
the stack's one call, against the stack's hidden states through `compute_logits` (the
same kernels: the same bits), for float, int8 and int4 linears; and the engine's tokens
and logprobs with and without it."""
from __future__ import annotations

import dataclasses
from array import array

import pytest
import torch

from pdserve.common import LLM, SamplingParams
from pdserve.common.models.decoder import DecoderForCausalLM
from pdserve import kernels
from pdserve.kernels import quant
from pdserve.kernels.cpu_decode import DecodeInputs
from pdserve.kernels.cpu_native import NativeKernelError

ARCHS = ("qwen3", "qwen2", "llama")  # qwen3's lm_head is tied to its embedding table


def engine_for(model_dir: str, quantization: str, dtype: str = "float32"):
    return LLM(model_dir, dtype=dtype, num_threads=1, num_kv_blocks=64, max_model_len=128,
               quantization=quantization).engine


def decode_inputs(engine, batch: int):
    """`batch` sequences prefilled, then the next decode step's inputs, scheduled but not run."""
    params = SamplingParams(max_tokens=20, ignore_eos=True, temperature=0)
    seqs = [engine.new_sequence([3 + (5 * i + j) % 200 for j in range(9 + 7 * i)], params) for i in range(batch)]
    for seq in seqs:
        engine.add(seq)
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in seqs):
        engine.step()
    sched = engine.scheduler.schedule()
    assert sched.num_tokens == [1] * batch
    return seqs, engine.runner.prepare(sched.seqs, sched.num_tokens), engine.runner.decode_inputs(sched.seqs)


def fused_and_unfused(engine, batch: int):
    seqs, (ids, positions, meta, _, _), rows = decode_inputs(engine, batch)
    model = engine.runner.model
    try:
        with torch.inference_mode(), kernels.decode_rows():  # as the runner runs a pure decode step
            fused = model.decode_logits(rows)
            unfused = model.compute_logits(model(ids, positions, meta))
    finally:
        for s in seqs:
            engine.abort(s)
    assert fused is not None, "the decode batch did not take the stack's lm_head"
    return (fused[0].clone(), fused[1]), unfused  # the stack's buffer: its next call writes it again


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("quantization", ["none", "int8", "int4"])
@pytest.mark.parametrize("batch", [1, 3, 9])  # 9: past the rows a prompt chunk takes int8 dot products for
def test_stack_logits_equal_compute_logits(model_dirs, arch, quantization, batch):
    engine = engine_for(model_dirs[arch], quantization)
    stack = engine.runner.model.decode_stack()
    assert stack.has_head and stack.model.head_kind == (0 if quantization == "none" else 2)  # int4: int8 lm_head
    (logits, top), unfused = fused_and_unfused(engine, batch)
    assert logits.shape == unfused.shape == (batch, engine.config.model.vocab_size)
    assert torch.equal(logits, unfused)
    assert top == unfused.numpy().argmax(-1).tolist()


@pytest.mark.parametrize("arch", ARCHS)
def test_bf16_stack_logits_equal_compute_logits(model_dirs, arch):
    """bf16 weights (the lm_head's bf16 panels, widened in registers), float32 activations."""
    engine = engine_for(model_dirs[arch], "none", "bfloat16")
    stack = engine.runner.model.decode_stack()
    assert stack.has_head and stack.model.head_p.dtype == torch.bfloat16
    (logits, top), unfused = fused_and_unfused(engine, 3)
    assert torch.equal(logits, unfused)
    assert top == unfused.numpy().argmax(-1).tolist()


def test_argmax_takes_the_first_of_ties_and_the_first_nan(model_dirs):
    """numpy's and torch's argmax: the first index of the largest value; the first NaN
    where a row has one. The lm_head written in place is followed (its plan and the stack
    set up again)."""
    engine = engine_for(model_dirs["llama"], "none")  # an untied lm_head
    head = engine.runner.model.lm_head.weight
    with torch.no_grad():
        head.zero_()  # every logit 0: a tie everywhere
    (logits, top), unfused = fused_and_unfused(engine, 2)
    assert torch.equal(logits, unfused) and top == [0, 0]
    with torch.no_grad():
        head[[41, 77]] = 1.0  # two equal rows of the largest logit (the hidden states sum to > 0 or < 0 alike)
        head[[500, 900]] = float("nan")
    (logits, top), unfused = fused_and_unfused(engine, 2)
    assert torch.equal(logits.isnan(), unfused.isnan()) and top == [500, 500]
    assert top == unfused.numpy().argmax(-1).tolist() == unfused.argmax(-1).tolist()
    with torch.no_grad():
        head[[500, 900]] = 0.0
    (logits, top), unfused = fused_and_unfused(engine, 1)
    expect = unfused.numpy().argmax(-1).tolist()
    assert top == expect and expect[0] in (0, 41)  # 41 before 77 where the pair is the largest


def test_a_head_that_does_not_fit_leaves_the_stack_without_logits(model_dirs):
    engine = engine_for(model_dirs["qwen2"], "int8")
    model = engine.runner.model
    stack = model.decode_stack()
    bad = dataclasses.replace(stack.model, head_n=stack.model.head_n + 16)  # the packed weight is too short
    other = type(stack).build(list(stack.layers), stack.dims, bad)
    assert other is not None and not other.has_head
    with pytest.raises(ValueError, match="without an lm_head"):
        other.logits(DecodeInputs.of([1], [0], [[0]], stack.block_size))


@pytest.mark.parametrize("quantization", ["none", "int4"])
def test_engine_output_with_and_without_the_fused_head(model_dirs, quantization, monkeypatch):
    """Greedy, seeded sampling with penalties, logit bias and logprobs: the same tokens and
    logprobs whether the decode steps take the stack's logits or compute them apart."""
    llm = LLM(model_dirs["qwen3"], dtype="float32", num_threads=1, num_kv_blocks=64, max_model_len=128,
              quantization=quantization)
    prompts = [[5, 9, 33, 70, 12], [40, 41, 42]]
    params = [SamplingParams(max_tokens=12, ignore_eos=True, temperature=0),
              SamplingParams(max_tokens=12, ignore_eos=True, temperature=0, logprobs=3),
              SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.8, seed=7, repetition_penalty=1.3,
                             logit_bias={17: 2.0}, top_k=20)]
    calls = []
    real = DecoderForCausalLM.decode_logits
    monkeypatch.setattr(DecoderForCausalLM, "decode_logits", lambda *a: calls.append(1) or real(*a))

    def run():
        return [[(o["token_ids"], o.get("logprobs")) for o in llm.generate(prompts, p, use_tqdm=False)] for p in params]

    fused = run()
    assert calls, "no decode step took the stack's logits"
    monkeypatch.setattr(DecoderForCausalLM, "decode_logits", lambda *a: None)
    assert run() == fused


@pytest.mark.parametrize("name", ["model.layers.0.mlp.down_proj", "lm_head"])
def test_a_replaced_quant_is_followed(model_dirs, name):
    """A quantized linear's `quant` replaced after the stack was set up: the next step
    reads the new blocks (the same logits as a stack set up afresh)."""
    engine = engine_for(model_dirs["qwen2"], "int8")
    model = engine.runner.model
    (before, _), _ = fused_and_unfused(engine, 2)
    lin = model.get_submodule(name)
    lin.quant = quant.quantize(torch.randn(lin.out_features, lin.in_features), lin.quant.kind)
    (followed, _), _ = fused_and_unfused(engine, 2)
    model._stack_of = None  # set up afresh
    (fresh, _), _ = fused_and_unfused(engine, 2)
    assert not torch.allclose(before, followed, rtol=1e-2, atol=1e-2)
    assert torch.equal(followed, fresh)


def test_decode_inputs_hold_what_prepare_gives(model_dirs):
    """The runner's plain-array inputs of a decode step (`ModelRunner.decode_inputs`) hold
    what `prepare` puts in its tensors: token ids, positions, slots, block tables padded
    with -1 to the widest, context lengths."""
    engine = engine_for(model_dirs["qwen2"], "none")
    seqs, (ids, positions, meta, _, _), rows = decode_inputs(engine, 3)  # 9, 16, 23 prompt tokens
    for s in seqs:
        engine.abort(s)
    tables = meta.decode_block_tables
    assert (tables == -1).any(), "the rows' block tables should differ in width"
    assert list(rows.ids) == ids.tolist() and list(rows.positions) == positions.tolist()
    assert list(rows.slots) == meta.slot_mapping.tolist() and list(rows.lens) == meta.decode_context_lens.tolist()
    assert rows.width == tables.shape[1] and list(rows.tables) == tables.flatten().tolist()


def test_rows_that_do_not_fit_are_refused_and_the_buffers_kept(model_dirs):
    """`DecodeStack.logits`: rows of unequal lengths or the wrong item type are refused
    before the call; a block id outside the cache by the native check; the same rows
    then give the same logits, in the buffer of the first call of that many rows; a
    batch of another size gets its own."""
    engine = engine_for(model_dirs["llama"], "int8")
    seqs, _, rows = decode_inputs(engine, 2)
    stack = engine.runner.model.decode_stack()
    try:
        with torch.inference_mode():
            logits, top = stack.logits(rows)
            first = logits.clone()
            for bad in (rows._replace(lens=rows.lens[:1]),
                        rows._replace(ids=array("i", rows.ids))):
                with pytest.raises(ValueError, match="one row per token"):
                    stack.logits(bad)
            outside = array("i", [stack.num_blocks] * len(rows.tables))
            with pytest.raises(NativeKernelError, match="block id outside the cache"):
                stack.logits(rows._replace(tables=outside))
            again, again_top = stack.logits(rows)
            assert again is logits and torch.equal(again, first) and again_top == top
            one = DecodeInputs(rows.ids[:1], rows.positions[:1], rows.slots[:1], rows.tables[:rows.width],
                               rows.width, rows.lens[:1])
            single, single_top = stack.logits(one)
            assert single.shape == (1, first.shape[1]) and single_top == top[:1]
            torch.testing.assert_close(single, first[:1], rtol=1e-5, atol=1e-5)
    finally:
        for s in seqs:
            engine.abort(s)
