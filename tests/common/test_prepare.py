"""The model runner's flat inputs (common/engine/model_runner.py): a decode batch's fast
path from plain lists gives what the general path gives, tensor for tensor."""
from __future__ import annotations

import torch

from pdserve.common import LLM, SamplingParams


def test_decode_batch_inputs_equal_the_general_paths(model_dirs):
    """Sequences whose contexts straddle block edges (tables of different lengths): ids,
    positions, slots, padded tables, lengths and the sampled rows agree."""
    engine = LLM(model_dirs["llama"], dtype="float32", num_threads=1, num_kv_blocks=64, max_model_len=256).engine
    params = SamplingParams(max_tokens=20, ignore_eos=True, temperature=0)
    seqs = [engine.new_sequence([3 + (7 * i + j) % 150 for j in range(n)], params) for i, n in enumerate((15, 16, 33))]
    for s in seqs:
        engine.add(s)
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in seqs):
        engine.step()
    sched = engine.scheduler.schedule()
    assert sched.num_tokens == [1, 1, 1]
    fast = engine.runner.prepare_decode(sched.seqs)
    general = engine.runner.prepare_mixed(sched.seqs, sched.num_tokens)
    assert fast[0].dtype == general[0].dtype and torch.equal(fast[0], general[0])
    for a, b in ((fast[1], general[1]), (fast[3], general[3])):
        assert a.dtype == b.dtype and torch.equal(a, b)
    for name in ("slot_mapping", "decode_block_tables", "decode_context_lens"):
        a, b = getattr(fast[2], name), getattr(general[2], name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert fast[2].num_decode == general[2].num_decode == 3 and fast[4] == general[4]
    assert len({len(s.block_table) for s in sched.seqs}) > 1  # the tables were padded
    assert engine.runner.prepare(sched.seqs, sched.num_tokens)[0] is not None
    for s in seqs:
        engine.abort(s)
