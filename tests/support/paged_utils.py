"""Shared helpers for the kernels tests: random paged KV setups and naive loops."""

from __future__ import annotations

import math

import torch


def make_paged(
    context_lens: list[int],
    block_size: int,
    hkv: int,
    d: int,
    dtype: torch.dtype,
    extra_blocks: int = 3,
    pad_cols: int = 1,
    seed: int = 0,
):
    """Random caches plus a block table that maps each sequence to distinct, shuffled
    blocks; unused table entries are -1 (including ``pad_cols`` extra columns)."""
    g = torch.Generator().manual_seed(seed)
    need = [math.ceil(c / block_size) for c in context_lens]
    num_blocks = sum(need) + extra_blocks
    perm = torch.randperm(num_blocks, generator=g)
    max_blocks = max(need + [0]) + pad_cols
    bt = torch.full((len(context_lens), max_blocks), -1, dtype=torch.int32)
    k = 0
    for b, n in enumerate(need):
        bt[b, :n] = perm[k : k + n].to(torch.int32)
        k += n
    k_cache = torch.randn(num_blocks, block_size, hkv, d, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, hkv, d, generator=g).to(dtype)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    return k_cache, v_cache, bt, lens


def token_kv(k_cache, v_cache, bt_row, t: int):
    """K/V ([Hkv, D]) of the token at absolute position t, looked up one at a time."""
    bs = k_cache.shape[1]
    blk = int(bt_row[t // bs])
    assert blk >= 0
    return k_cache[blk, t % bs], v_cache[blk, t % bs]


def naive_attention_one(q_h, keys, values):
    """q_h [D], keys/values [T, D] -> [D], float64, explicit softmax."""
    s = keys.double() @ q_h.double()  # [T]
    p = torch.exp(s - s.max())
    p = p / p.sum()
    return p @ values.double()


def naive_decode(q, k_cache, v_cache, bt, lens, scale):
    b_, hq, d = q.shape
    hkv = k_cache.shape[2]
    group = hq // hkv
    out = torch.zeros(b_, hq, d, dtype=torch.float64)
    for b in range(b_):
        ctx = int(lens[b])
        if ctx == 0:
            continue
        kv = [token_kv(k_cache, v_cache, bt[b], t) for t in range(ctx)]
        ks = torch.stack([x[0] for x in kv])  # [ctx, Hkv, D]
        vs = torch.stack([x[1] for x in kv])
        for h in range(hq):
            out[b, h] = naive_attention_one(q[b, h] * scale, ks[:, h // group], vs[:, h // group])
    return out

def with_threads(threads: int, fn):
    """fn() on `threads` torch intra-op threads (the native kernels' OpenMP count), then
    the old count back."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return fn()
    finally:
        torch.set_num_threads(before)
