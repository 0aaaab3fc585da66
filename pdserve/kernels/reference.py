"""Pure-torch reference implementations of the KV-cache kernels.

These run on any device: the contract the Triton and native kernels are tested
against, and what runs where no faster flavor applies (gather/scatter on the CPU, the
KV store for other dtypes), so they are vectorized (no per-token Python loops).

KV cache layout (one layer): ``k_cache`` / ``v_cache`` of shape
``[num_blocks, block_size, num_kv_heads, head_dim]``, contiguous. A token's slot is
``block_id * block_size + offset``; slot ``-1`` means "skip this token".
"""

from __future__ import annotations

import torch

__all__ = [
    "store_kv",
    "paged_decode_attention",
    "gather_blocks",
    "scatter_blocks",
]


def store_kv(
    key: torch.Tensor,  # [N, Hkv, D]
    value: torch.Tensor,  # [N, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [N] int64 or int32, -1 = skip
) -> None:
    """Write ``key[i]`` / ``value[i]`` into the caches at ``slot_mapping[i]`` (in place).

    Tokens whose slot is ``-1`` (or any negative value) are skipped.
    """
    n = slot_mapping.shape[0]
    if n == 0:
        return
    block_size = k_cache.shape[1]
    slots = slot_mapping.to(torch.long)  # [N]
    valid = slots >= 0  # [N]
    if not bool(valid.all()):
        slots = slots[valid]
        key = key[valid]
        value = value[valid]
    # by (block, offset): the caches may be views in another memory order (common.engine.kv_layout)
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, offsets] = key.to(k_cache.dtype)
    v_cache[blocks, offsets] = value.to(v_cache.dtype)


def paged_decode_attention(
    q: torch.Tensor,  # [B, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32, -1 padded
    context_lens: torch.Tensor,  # [B] int32
    scale: float,
) -> torch.Tensor:  # [B, Hq, D], q.dtype
    """Single-token (decode) attention over paged KV.

    Query ``b`` attends to the first ``context_lens[b]`` tokens of its blocks
    (its own K/V is already in the cache). GQA: ``Hq = Hkv * group``; query head
    ``h`` uses kv head ``h // group``. Scores/softmax are computed in fp32.
    Sequences with ``context_lens[b] == 0`` get an all-zero output.
    """
    b, hq, d = q.shape
    _, block_size, hkv, _ = k_cache.shape
    group = hq // hkv
    if b == 0 or block_tables.shape[1] == 0:
        return torch.zeros_like(q)
    lens = context_lens.to(device=q.device, dtype=torch.long)  # [B]
    # Only gather the blocks some sequence actually needs.
    max_len = int(lens.max().item())
    nblk = max(1, min(block_tables.shape[1], -(-max_len // block_size)))
    bt = block_tables[:, :nblk].to(device=q.device, dtype=torch.long).clamp(min=0)  # [B, nblk]
    length = nblk * block_size

    k = k_cache[bt].view(b, length, hkv, d)  # [B, L, Hkv, D]
    v = v_cache[bt].view(b, length, hkv, d)  # [B, L, Hkv, D]
    k = k.permute(0, 2, 3, 1).float()  # [B, Hkv, D, L]
    v = v.permute(0, 2, 1, 3).float()  # [B, Hkv, L, D]
    qg = q.reshape(b, hkv, group, d).float()  # [B, Hkv, G, D]

    scores = torch.matmul(qg, k)  # [B, Hkv, G, L]
    scores.mul_(scale)
    pos = torch.arange(length, device=q.device)  # [L]
    masked = pos[None, :] >= lens[:, None]  # [B, L]
    scores.masked_fill_(masked[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)  # [B, Hkv, G, L]
    out = torch.matmul(probs, v)  # [B, Hkv, G, D]
    out = out.reshape(b, hq, d)  # [B, Hq, D]
    out.masked_fill_((lens <= 0)[:, None, None], 0.0)  # empty context -> 0, not NaN
    return out.to(q.dtype)


def gather_blocks(
    cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D] (or any [num_blocks, ...])
    block_ids: torch.Tensor,  # [n] int64
) -> torch.Tensor:  # [n, block_size, Hkv, D], contiguous
    """Copy ``cache[block_ids[i]]`` into a new contiguous buffer ``buf[i]``."""
    return cache.index_select(0, block_ids.to(device=cache.device, dtype=torch.long))


def scatter_blocks(
    cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D] (or any [num_blocks, ...])
    block_ids: torch.Tensor,  # [n] int64
    buf: torch.Tensor,  # [n, block_size, Hkv, D]
) -> None:
    """Inverse of :func:`gather_blocks`: write ``buf[i]`` into ``cache[block_ids[i]]`` in place."""
    if block_ids.numel() == 0:
        return
    cache.index_copy_(
        0,
        block_ids.to(device=cache.device, dtype=torch.long),
        buf.to(device=cache.device, dtype=cache.dtype),
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as transformers computes it: float32 statistics, weight * normed in x's dtype."""
    if x.dtype == torch.float32:
        return torch.nn.functional.rms_norm(x, weight.shape, weight, eps)  # the same bits, fewer ops
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)
