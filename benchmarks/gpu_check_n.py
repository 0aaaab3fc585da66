"""n > 1 on a GPU (the fork's block copy on a CUDA cache, eager and through the decode
graphs, a 1-token prompt included): greedy choices equal the n = 1 output, seeded choice i
equals the n = 1 request seeded seed + i, the choices differ, and every block is free
after. Run: python benchmarks/gpu_check_n.py [cuda]; prints one line per case, then
ALL OK or FAILED (exit status 1)."""
from __future__ import annotations

import sys
import tempfile

from pdserve.common.config import EngineConfig
from pdserve.common.engine.engine import LLMEngine
from pdserve.common.loading.model_factory import make_model
from pdserve.common.sampling_params import SamplingParams


def run(engine: LLMEngine, ids: list[int], **params: object) -> list[list[int]]:
    """Every choice's output of one request."""
    seq = engine.add_request(ids, SamplingParams(**params))
    choices = [seq, *seq.forks]
    while engine.has_work():
        engine.step()
    return [c.output_token_ids for c in choices]


def check(engine: LLMEngine, ids: list[int]) -> list[bool]:
    plain = dict(max_tokens=10, ignore_eos=True)
    greedy = run(engine, ids, n=3, temperature=0, **plain)
    seeded = run(engine, ids, n=4, temperature=1, seed=9, **plain)
    return [greedy == run(engine, ids, temperature=0, **plain) * 3,
            seeded[0] == run(engine, ids, temperature=1, seed=9, **plain)[0],
            seeded[2] == run(engine, ids, temperature=1, seed=11, **plain)[0],
            len({tuple(s) for s in seeded}) == 4,
            engine.block_manager.num_free_blocks == engine.block_manager.num_blocks]


def main() -> int:
    device = sys.argv[1] if len(sys.argv) > 1 else "cuda"
    model = str(make_model(tempfile.mkdtemp() + "/m", "qwen3", "tiny", seed=1))
    ok = True
    for graphs in (False, True):
        engine = LLMEngine(EngineConfig.build(model, device=device, num_kv_blocks=64, max_model_len=256,
                                              decode_graphs=graphs))
        for ids in ([5], list(range(5, 45)), list(range(5, 53))):  # one token, a partial last block, none
            results = check(engine, ids)
            ok &= all(results)
            print(f"decode_graphs={graphs} prompt={len(ids)} tokens: {results}", flush=True)
    print("ALL OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
