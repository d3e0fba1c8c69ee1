"""Transformer on a GPU (ops.tree_attention / compact_kv CUDA kernels) against the CPU path."""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import requires_cuda
from reference_models import BASE, randomize
from specdecode.models import ModelConfig, Transformer

from specdecode import ops

pytestmark = [pytest.mark.cuda, requires_cuda]


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-3), (torch.bfloat16, 5e-2)])
def test_cuda_matches_cpu(dtype, tol):
    cpu = randomize(Transformer(ModelConfig(**BASE)), seed=1).to(dtype)
    gpu = Transformer(cpu.config).to(dtype)
    gpu.load_state_dict(cpu.state_dict())
    gpu.to("cuda")
    g = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, BASE["vocab_size"], (3, 40), generator=g)
    parents = torch.tensor([[-1, 0, 0, 1, 1, 2, 3, 3]] * 3, dtype=torch.int32)
    tree = torch.randint(0, BASE["vocab_size"], (3, 8), generator=g)
    results = []
    for model, device in ((cpu, "cpu"), (gpu, "cuda")):
        cache = model.new_cache(3, 64)
        pos = torch.arange(40).expand(3, 40)
        first = model.forward(prompt.to(device), pos.to(device), cache)
        info = ops.tree_info(parents.to(device))
        depth = info.depth.long()
        logits = model.forward(tree.to(device), (40 + depth).to(device), cache, info.mask)
        path = torch.tensor([[0, 1, 3, 6]] * 3, dtype=torch.int32, device=device)
        cache.compact(path, torch.tensor([4, 2, 1], dtype=torch.int32, device=device))
        nxt = torch.tensor([[5], [6], [7]], device=device)
        after = model.forward(nxt, cache.lengths.long().unsqueeze(1), cache)
        results.append([x.float().cpu() for x in (first, logits, after)])
        assert cache.lengths.tolist() == [45, 43, 42]
    for a, b in zip(*results):
        torch.testing.assert_close(b, a, rtol=tol, atol=tol)


def synchronising_calls(fn, *args) -> int:
    """How many operations in fn(*args) made the host wait for the GPU (torch's sync debug
    mode)."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn(*args)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def test_cuda_forward_waits_for_the_device_independently_of_the_layer_count():
    """A decoding step's forward pass does not wait for the GPU once per layer (only for its
    input checks): attention reads no per-layer status on the host."""
    counts = []
    for layers in (1, 4):
        model = Transformer(ModelConfig(**{**BASE, "num_hidden_layers": layers})).to("cuda")
        cache = model.new_cache(2, 64)
        prompt = torch.randint(0, BASE["vocab_size"], (2, 12), device="cuda")
        model.forward(prompt, torch.arange(12, device="cuda").expand(2, 12), cache)
        info = ops.tree_info(torch.tensor([[-1, 0, 0, 1]] * 2, dtype=torch.int32, device="cuda"))
        ids = torch.randint(0, BASE["vocab_size"], (2, 4), device="cuda")
        # The steady state of a decoding loop: the count of the third tree pass.
        for step in range(3):
            pos = (12 + 4 * step + info.depth.long()).to("cuda")
            waits = synchronising_calls(model.forward, ids, pos, cache, info.mask)
        counts.append(waits)
    # A wait per layer would make the 4-layer model wait 3 more times. (On an H200 the 1-layer
    # model, measured first, waited 5 times and the 4-layer one 4, with and without a warm-up
    # pass; the extra wait is not explained yet.)
    assert counts[1] <= counts[0], counts
