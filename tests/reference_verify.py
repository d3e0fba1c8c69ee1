"""Pure-PyTorch references for specdecode.ops.verify / sample.

* :func:`processed_probs`: the sampling distribution a target row stands for (temperature, top-k,
  top-p with the kernel's tie rules), in float64.
* :func:`outcome_distribution`: the exact distribution of one sequence's outcome (accepted path
  and the final token) for fixed draft tokens, by enumerating the algorithm's branches in float64
  (block verification of a sampled chain by its closed form).
* :func:`torch_verify_chain`: a vectorised batched implementation of exact chain verification
  (the baseline of the benchmarks).
"""

from __future__ import annotations

from typing import Optional

import torch


def processed_probs(
    rows: torch.Tensor,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    logits: bool = True,
) -> torch.Tensor:
    """The sampling distribution of each row of ``rows`` [..., V] (float64, sums to 1)."""
    x = rows.double()
    v = x.shape[-1]
    if logits:
        w = torch.softmax(x / temperature, dim=-1)
    else:
        w = x / x.sum(-1, keepdim=True)
    if 0 < top_k < v:
        kth = torch.topk(x, top_k, dim=-1).values[..., -1:]
        w = torch.where(x >= kth, w, torch.zeros_like(w))
        w = w / w.sum(-1, keepdim=True)
    if top_p < 1.0:
        # Keep the tokens of weight >= t for the largest t whose kept mass is >= top_p.
        sorted_w, _ = torch.sort(w, dim=-1, descending=True)
        # Mass kept at threshold sorted_w[j]: every weight >= it (ties included).
        kept = torch.stack(
            [torch.where(w >= sorted_w[..., j : j + 1], w, 0).sum(-1) for j in range(v)], -1
        )
        ok = kept >= top_p - 1e-12
        # First j (largest threshold) whose kept mass reaches top_p.
        j = ok.double().argmax(-1, keepdim=True)
        t = sorted_w.gather(-1, j)
        w = torch.where(w >= t, w, torch.zeros_like(w))
        w = w / w.sum(-1, keepdim=True)
    return w


def _children(parents: Optional[list[int]], node: int, count: int) -> list[int]:
    if parents is None:
        return [node + 1] if node + 1 < count else []
    return [c for c in range(node + 1, count) if parents[c] == node]


def outcome_distribution(
    p_rows: torch.Tensor,
    tokens: list[int],
    *,
    parents: Optional[list[int]] = None,
    q_rows: Optional[torch.Tensor] = None,
    method: str = "exact",
    eps: float = 0.0,
    correction: str = "residual",
) -> dict[tuple[tuple[int, ...], int], float]:
    """Exact law of (accepted path, final token) of one sequence with fixed draft tokens.

    ``p_rows`` [N, V] are processed target distributions (see :func:`processed_probs`),
    ``q_rows`` [N, V] the draft distributions or None (deterministic children). Keys are
    (tuple of accepted node indices, final token).
    """
    p_rows = p_rows.double()
    n = p_rows.shape[0]
    is_chain = parents is None or all(parents[i] == i - 1 for i in range(1, n))
    if method == "block" and q_rows is not None and is_chain:
        return _block_outcome_distribution(p_rows, q_rows.double(), tokens)
    if method == "block":
        method = "exact"
    out: dict[tuple[tuple[int, ...], int], float] = {}

    def add(path: tuple[int, ...], dist: torch.Tensor, weight: float) -> None:
        for y in torch.nonzero(dist > 0).flatten().tolist():
            key = (path, y)
            out[key] = out.get(key, 0.0) + weight * float(dist[y])

    def walk(node: int, path: tuple[int, ...], weight: float) -> None:
        p = p_rows[node]
        kids = _children(parents, node, n)
        if not kids:
            add(path, p, weight)
            return
        if method == "greedy":
            a = int(torch.argmax(p))
            for c in kids:
                if tokens[c] == a:
                    walk(c, path + (c,), weight)
                    return
            out[(path, a)] = out.get((path, a), 0.0) + weight
            return
        reject = 1.0
        if q_rows is not None:
            q = q_rows[node].double()
            pl, ql = p.clone(), q.clone()
            tried_q = 0.0
            tried: list[int] = []
            for c in kids:
                x = tokens[c]
                px, qx = float(pl[x]), float(ql[x])
                if qx > 0:
                    a = min(1.0, px / qx + (eps if method == "relaxed" else 0.0))
                else:
                    a = 1.0 if px > 0 else 0.0
                walk(c, path + (c,), weight * reject * a)
                reject *= 1.0 - a
                resid = torch.clamp(pl - ql, min=0)
                beta = float(resid.sum())
                if x not in tried:
                    tried_q += float(q[x])
                    tried.append(x)
                pl = resid / beta if beta > 0 else pl
                ql = q.clone()
                ql[tried] = 0
                ql = ql / (1 - tried_q) if tried_q < 1 else torch.zeros_like(ql)
            if method == "relaxed" and correction == "target":
                add(path, p, weight * reject)
            else:
                # pl now holds the residual after the last rejection.
                add(path, pl, weight * reject)
            return
        # Deterministic children.
        pl = p.clone()
        for c in kids:
            x = tokens[c]
            left = float(pl.sum())
            a = float(pl[x]) / left if left > 0 else 0.0
            if method == "relaxed":
                a = min(1.0, a + eps)
            walk(c, path + (c,), weight * reject * a)
            reject *= 1.0 - a
            pl = pl.clone()
            pl[x] = 0
        if method == "relaxed" and correction == "target":
            add(path, p, weight * reject)
        else:
            add(path, pl / pl.sum(), weight * reject)

    walk(0, (), 1.0)
    return out


def _block_outcome_distribution(
    p_rows: torch.Tensor, q_rows: torch.Tensor, tokens: list[int]
) -> dict[tuple[tuple[int, ...], int], float]:
    """The law of block verification's outcome for a chain of g = N - 1 drafts, in float64:
    P(tau = t) = h_t * prod_{j > t} (1 - h_j) (h_0 = 1), then the last token from the scaled
    residual norm(max(p_t P_t - Q_t, 0)) at t < g, from P_g at t = g."""
    g = p_rows.shape[0] - 1
    p = [1.0]
    for j in range(1, g + 1):
        x = tokens[j]
        num = p[-1] * float(p_rows[j - 1, x])
        qx = float(q_rows[j - 1, x])
        p.append(0.0 if num <= 0 else (1.0 if num >= qx else num / qx))
    h = [1.0]
    for j in range(1, g + 1):
        if j == g or p[j] >= 1.0:
            h.append(p[j])
        else:
            r = float(torch.clamp(p[j] * p_rows[j] - q_rows[j], min=0).sum())
            h.append(r / (r + 1.0 - p[j]))
    out: dict[tuple[tuple[int, ...], int], float] = {}
    for t in range(g + 1):
        weight = h[t]
        for j in range(t + 1, g + 1):
            weight *= 1.0 - h[j]
        if weight <= 0:
            continue
        if t == g:
            dist = p_rows[g]
        else:
            resid = torch.clamp(p[t] * p_rows[t] - q_rows[t], min=0)
            dist = resid / resid.sum() if float(resid.sum()) > 0 else p_rows[t]
        for y in torch.nonzero(dist > 0).flatten().tolist():
            key = (tuple(range(1, t + 1)), y)
            out[key] = out.get(key, 0.0) + weight * float(dist[y])
    return out


def torch_verify_chain(
    target: torch.Tensor,
    draft_probs: Optional[torch.Tensor],
    tokens: torch.Tensor,
    temperature: float = 1.0,
    generator: Optional[torch.Generator] = None,
    target_is_logits: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Vectorised exact verification of B chains of k drafts (the usual PyTorch formulation).

    ``target`` [B, k+1, V] logits (or probabilities), ``draft_probs`` [B, k+1, V] (row i is q of
    the draft at node i + 1; None for deterministic drafts such as n-gram ones: a draft is then
    accepted with p(x) and the correction drawn from p without x), ``tokens`` [B, k+1] with the
    root first. Returns (emitted [B, k+1] padded with -1, num_emitted [B]).
    """
    b, n, v = target.shape
    k = n - 1
    if target_is_logits:
        p = torch.softmax(target.float() / temperature, dim=-1)
    else:
        p = target.float()
    drafts = tokens[:, 1:].long()
    px = p[:, :k].gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
    if draft_probs is None:
        qx = torch.ones_like(px)
    else:
        q = draft_probs.float()
        qx = q[:, :k].gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
    u = torch.rand((b, k), generator=generator, device=target.device)
    accepted = u * qx < px
    # Number of leading accepts.
    num_acc = torch.cumprod(accepted.int(), dim=1).sum(1)
    rows = torch.arange(b, device=target.device)
    stop_p = p[rows, num_acc]
    rejected = num_acc < k
    if draft_probs is None:
        # q is the one-hot of the rejected draft: p - q clamped is p without that token.
        stop_q = torch.zeros_like(stop_p)
        stop_x = drafts.gather(1, num_acc.clamp(max=k - 1).unsqueeze(1))
        stop_q.scatter_(1, stop_x, 1.0)
    else:
        stop_q = q[rows, num_acc]
    resid = torch.where(rejected.unsqueeze(-1), torch.clamp(stop_p - stop_q, min=0), stop_p)
    zero = resid.sum(-1, keepdim=True) <= 0
    resid = torch.where(zero, stop_p, resid)
    final = torch.multinomial(resid, 1, generator=generator).squeeze(-1)
    pos = torch.arange(k + 1, device=target.device).unsqueeze(0)
    emitted = torch.where(pos < num_acc.unsqueeze(1), tokens.long().roll(-1, 1), -1)
    emitted = emitted.scatter(1, num_acc.unsqueeze(1), final.unsqueeze(1))
    return emitted.int(), (num_acc + 1).int()
