"""Pure-PyTorch float64 references for the attention family (explicit mask + softmax)."""

from __future__ import annotations

from typing import Optional

import torch


def dense_tree_mask(
    prefix_lens: torch.Tensor, tree_mask: Optional[torch.Tensor], t: int, s: int
) -> torch.Tensor:
    """bool [B, T, S]: which cache positions each tree node attends to."""
    batch = prefix_lens.shape[0]
    allowed = torch.zeros(batch, t, s, dtype=torch.bool)
    for b in range(batch):
        p = int(prefix_lens[b])
        allowed[b, :, :p] = True
        if tree_mask is None:
            allowed[b, :, p : p + t] = torch.tril(torch.ones(t, t, dtype=torch.bool))
        else:
            words = tree_mask[b].to(torch.int64) & 0xFFFFFFFF  # [T, W]
            j = torch.arange(t)
            bits = (words[:, j // 32] >> (j % 32)) & 1  # [T, T]
            allowed[b, :, p : p + t] = bits.bool()
    return allowed


def tree_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    prefix_lens: torch.Tensor,
    tree_mask: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 (out [B, T, Hq, D], lse [B, T, Hq]); rows that see nothing give 0 and -inf."""
    batch, t, hq, d = q.shape
    s, hkv = k_cache.shape[1], k_cache.shape[2]
    group = hq // hkv
    scale = d**-0.5 if scale is None else scale
    q64 = q.double().permute(0, 2, 1, 3)  # [B, Hq, T, D]
    k64 = k_cache.double().permute(0, 2, 1, 3).repeat_interleave(group, dim=1)  # [B, Hq, S, D]
    v64 = v_cache.double().permute(0, 2, 1, 3).repeat_interleave(group, dim=1)
    scores = torch.matmul(q64, k64.transpose(-1, -2)) * scale  # [B, Hq, T, S]
    allowed = dense_tree_mask(prefix_lens, tree_mask, t, s)[:, None]  # [B, 1, T, S]
    scores = scores.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [B, Hq, T]
    probs = torch.exp(scores - lse[..., None].clamp_min(-1e300))
    probs = torch.nan_to_num(probs, nan=0.0)
    probs = probs.masked_fill(~allowed, 0.0)
    out = torch.matmul(probs, v64)  # [B, Hq, T, D]
    return out.permute(0, 2, 1, 3), lse.permute(0, 2, 1)


def compact_kv_ref(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    prefix_lens: torch.Tensor,
    path: torch.Tensor,
    num_accepted: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gather reference on copies: (k, v, new_lens)."""
    k = k_cache.clone()
    v = v_cache.clone()
    for b in range(k.shape[0]):
        p, n = int(prefix_lens[b]), int(num_accepted[b])
        src = (p + path[b, :n].long()).tolist()
        k[b, p : p + n] = k_cache[b, src]
        v[b, p : p + n] = v_cache[b, src]
    return k, v, (prefix_lens + num_accepted).to(torch.int32)
