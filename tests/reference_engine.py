"""Reference decoding for the engine tests: the target's own plain autoregressive output and the
exact distribution of its first generated tokens, computed without the engine."""

from __future__ import annotations

import itertools
from typing import Any

import torch
from specdecode.models import ModelConfig, Transformer


def tiny_transformer(
    seed: int, vocab_size: int = 61, std: float = 0.15, layers: int = 2, max_length: int = 256
) -> Transformer:
    """A small random Llama-style target/draft model with peaked (not uniform) distributions."""
    config = ModelConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=layers,
        num_attention_heads=1,
        num_key_value_heads=1,
        max_position_embeddings=max_length,
        rope_theta=1000.0,
    )
    torch.manual_seed(seed)
    model = Transformer(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                continue
            p.copy_(std * torch.randn(p.shape, generator=gen))
    return model.eval()


@torch.no_grad()
def greedy_reference(model: Any, prompt: list[int], n: int) -> list[int]:
    """The target's greedy continuation, one token per forward pass on a batch of one."""
    cache = model.new_cache(1, min(len(prompt) + n, model.max_length))
    device = model.device
    ids = torch.tensor([prompt], device=device)
    logits = model.forward(ids, torch.arange(len(prompt), device=device).unsqueeze(0), cache)
    out = []
    for i in range(n):
        tok = int(logits[0, -1].float().argmax())
        out.append(tok)
        if i + 1 == n:
            break
        pos = torch.tensor([[len(prompt) + i]], device=device)
        logits = model.forward(torch.tensor([[tok]], device=device), pos, cache)
    return out


@torch.no_grad()
def first_tokens_distribution(model: Transformer, prompt: list[int], n: int = 3) -> torch.Tensor:
    """float64 ``[V ** n]``: the exact joint law of the first ``n`` sampled tokens (temperature 1).

    Index ``t1 * V**(n-1) + ... + tn``. Computed from full-sequence forward passes over every
    continuation, independent of caches, trees and the engine.
    """
    vocab = model.vocab_size
    conts = list(itertools.product(range(vocab), repeat=n - 1))
    ids = torch.tensor([prompt + list(c) for c in conts])
    logp = torch.log_softmax(model.forward_train(ids).double(), dim=-1)
    start = len(prompt) - 1
    joint = torch.zeros([vocab] * n, dtype=torch.float64)
    for row, cont in enumerate(conts):
        # p(t1) p(t2 | t1) ... p(tn | t1..tn-1) for every tn at once.
        lp = sum(float(logp[row, start + i, cont[i]]) for i in range(n - 1))
        joint[cont] = torch.exp(lp + logp[row, start + n - 1])
    return joint.flatten()
