"""Float32 tolerances from a float64 reference: pdserve's float32 result may differ from
the true value (float64) by at most FLOAT32_MULTIPLE times what transformers' own float32
computation of the same inputs differs by -- never a fixed distance from transformers,
which on another chip (another summation order) is itself off by about that much."""
from __future__ import annotations

import functools
from collections.abc import Callable

import torch

# pdserve's float32 error may be this many times transformers' float32 error on the same
# values (its kernels sum in other orders: chunked prefill, blocked GEMMs, another chip's
# vector width); the floor keeps a lucky near-zero transformers error from asking for more
# than float32 can give (a few ulps of a logprob of ~-20).
FLOAT32_MULTIPLE = 8.0
FLOOR = 64 * torch.finfo(torch.float32).eps * 20


class LogprobReference:
    """One prompt's log_softmax from transformers in float64 (the truth, [len, V]) and in
    float32; indexing reads the float64 values; `tol` is the absolute error pdserve's
    float32 values may have: FLOAT32_MULTIPLE x transformers' largest float32 error over the
    values the tests compare (each row's next prompt token and its top 20), or FLOOR."""

    def __init__(self, ids: list[int], f64: torch.Tensor, f32: torch.Tensor) -> None:
        self.f64 = f64
        err = (f32.double() - f64).abs()
        cols = torch.cat([f64.topk(20, dim=-1).indices,
                          torch.tensor(ids[1:] + ids[-1:]).unsqueeze(1)], dim=1)  # [len, 21]
        self.hf_error = float(err.gather(1, cols).max())
        self.tol = max(FLOAT32_MULTIPLE * self.hf_error, FLOOR)

    def __getitem__(self, index):
        return self.f64[index]


@functools.lru_cache(maxsize=4)
def logprob_reference(model_dir: str) -> Callable[[list[int]], LogprobReference]:
    """ids -> LogprobReference (row t predicts token t + 1), from one transformers model
    loaded in float64 and one in float32."""
    from transformers import AutoModelForCausalLM
    models = {dt: AutoModelForCausalLM.from_pretrained(model_dir, dtype=dt).eval() for dt in (torch.float64, torch.float32)}

    def run(ids: list[int]) -> LogprobReference:
        with torch.no_grad():
            out = {dt: torch.log_softmax(m(torch.tensor([ids])).logits[0].to(dt), dim=-1) for dt, m in models.items()}
        return LogprobReference(ids, out[torch.float64], out[torch.float32])
    return run
