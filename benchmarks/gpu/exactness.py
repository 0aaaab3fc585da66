"""In the same run as the speed figures: float32 greedy tokens of pdserve's engine on the
device equal transformers' on the same device, on the tiny random models of each
architecture, through the attention kernels the device runs (on a GPU the Triton varlen
prefill and the split decode kernels, decode steps from CUDA graphs). The prompts mix
lengths across block edges, share prefixes (cached blocks read in place) and are chunked
by a small token budget (a chunk reads the earlier ones from the cache)."""
from __future__ import annotations

import random
import tempfile
from pathlib import Path

import torch

from pdserve.common.engine.llm import LLM
from pdserve.common.loading.model_factory import make_model
from pdserve.common.sampling_params import SamplingParams

ARCHS = ("qwen3", "llama")
NEW_TOKENS = 12


def prompts(vocab: int, seed: int = 7) -> list[list[int]]:
    rng = random.Random(seed)
    ids = lambda n: [rng.randrange(3, vocab) for _ in range(n)]  # noqa: E731  (0-2 are special)
    out = [ids(n) for n in (1, 5, 16, 17, 33, 64, 100, 150)]
    base = ids(70)
    return out + [base + ids(9), base + ids(30), base[:48] + ids(5)]


def hf_greedy(model_dir: str, prompts: list[list[int]], max_new: int, device: str | torch.device) -> list[list[int]]:
    """transformers' greedy `generate` at float32 on `device`, one prompt at a time: the
    reference every GPU check compares with (gpu_check*.py use this one too)."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    outs = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p], device=device)
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False)
            outs.append(out[0, len(p):].tolist())
    del model
    return outs


def check(device: torch.device, archs: tuple[str, ...] = ARCHS, limit: int | None = None) -> dict:
    """Each of `archs`' tiny model on `device`: our greedy tokens against transformers' on
    the prompts (the first `limit` of them)."""
    rows = {}
    with tempfile.TemporaryDirectory(prefix="pdserve-exactness-") as tmp:
        for arch in archs:
            d = str(make_model(Path(tmp) / arch, arch, "tiny", seed=1))
            batch = prompts(2000)[:limit]
            llm = LLM(d, device=str(device), dtype="float32", num_kv_blocks=256, max_model_len=512,
                      max_num_batched_tokens=64, decode_graphs=True, seed=0)
            got = [o["token_ids"] for o in llm.generate(batch, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0),
                                                        use_tqdm=False)]
            want = hf_greedy(d, batch, NEW_TOKENS, device)
            rows[arch] = {"prompts": len(batch), "equal": got == want,
                          "mismatched": [i for i, (a, b) in enumerate(zip(got, want)) if a != b],
                          "graph_replays": getattr(llm.engine.runner, "replays", None)}
    return {"float32_greedy_equals_transformers": all(r["equal"] for r in rows.values()), "models": rows}
