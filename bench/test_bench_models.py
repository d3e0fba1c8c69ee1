"""One target forward pass of the model layer: decode (T=1) and tree verification (T=16, 64).

Three implementations of the same step on the same weights (a Llama-style model, 4 layers,
hidden 512, 8 query / 2 KV heads of dim 64, vocab 8192, float32, CPU), over a cached prefix:

* ``native``: :class:`specdecode.models.Transformer`, attention through ``ops.tree_attention``;
* ``torch``: the same model with ``attention="torch"`` (dense boolean mask + SDPA);
* ``hf``: transformers' ``LlamaForCausalLM`` through :class:`specdecode.models.HFCausalLM`
  (DynamicCache, 4-D additive mask, explicit position ids): the baseline.

Both libraries run single-threaded (see the fixture). Each round scores the T new tokens and
rolls the cache back to the prefix (truncate), which is what a rejected verification costs.
Logits of the three are checked equal first.

    flock /tmp/specdecode-bench.lock pytest bench/test_bench_models.py --benchmark-only \
        --benchmark-json=models.json && python bench/report.py models.json --baseline hf
"""

from __future__ import annotations

import pytest
import torch
from specdecode.models import HFCausalLM, ModelConfig, Transformer

import specdecode
from specdecode import ops

transformers = pytest.importorskip("transformers")

HF_CONFIG = dict(
    vocab_size=8192,
    hidden_size=512,
    intermediate_size=1408,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    rope_theta=10000.0,
)
CASES = [(b, s, t) for b in (1, 4) for s in (512, 2048) for t in (1, 16, 64)]


@pytest.fixture(scope="module")
def models():
    # One thread for torch and for specdecode: on a small, shared machine two OpenMP threads
    # spin at every matmul barrier while the other is descheduled, which made timings swing by
    # 10-40x between runs; one thread measures the work instead of the scheduler.
    torch_threads, sd_threads = torch.get_num_threads(), specdecode.get_num_threads()
    torch.set_num_threads(1)
    specdecode.set_num_threads(1)
    yield _build()
    torch.set_num_threads(torch_threads)
    specdecode.set_num_threads(sd_threads)


def _build():
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**HF_CONFIG)).eval()
    hf.config._attn_implementation = "sdpa"
    ours = Transformer(ModelConfig.from_hf_config(hf.config.to_dict()))
    ours.load_state_dict(hf.state_dict())
    torch_ref = Transformer(ours.config)
    torch_ref.load_state_dict(hf.state_dict())
    torch_ref.attention = "torch"
    return {"native": ours, "torch": torch_ref, "hf": HFCausalLM(hf)}


def _tree(t: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A bushy tree of t nodes (parent of i uniform in [i-4, i)), its mask and depths."""
    g = torch.Generator().manual_seed(t)
    parents = [-1] + [int(torch.randint(max(0, i - 4), i, (1,), generator=g)) for i in range(1, t)]
    info = ops.tree_info(torch.tensor([parents] * batch, dtype=torch.int32))
    return info.mask, info.depth.long()


def _step(model, cache, ids, positions, mask, prefix: int) -> torch.Tensor:
    logits = model.forward(ids, positions, cache, tree_mask=mask)
    cache.truncate(prefix)
    return logits


@pytest.mark.parametrize("batch, prefix, t", CASES, ids=[f"B{b}-S{s}-T{t}" for b, s, t in CASES])
@pytest.mark.parametrize("impl", ["native", "torch", "hf"])
def test_forward_step(benchmark, models, impl, batch, prefix, t):
    model = models[impl]
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, HF_CONFIG["vocab_size"], (batch, prefix), generator=g)
    ids = torch.randint(0, HF_CONFIG["vocab_size"], (batch, t), generator=g)
    mask, depth = _tree(t, batch) if t > 1 else (None, torch.zeros(batch, 1, dtype=torch.long))
    positions = prefix + depth
    cache = model.new_cache(batch, prefix + t)
    model.forward(prompt, torch.arange(prefix).expand(batch, prefix), cache)
    # All three give the target's logits (checked once, outside the timing).
    if impl != "hf":
        ref = models["hf"]
        ref_cache = ref.new_cache(batch, prefix + t)
        ref.forward(prompt, torch.arange(prefix).expand(batch, prefix), ref_cache)
        expected = ref.forward(ids, positions, ref_cache, tree_mask=mask)
        got = _step(model, cache, ids, positions, mask, prefix)
        torch.testing.assert_close(got, expected, rtol=1e-3, atol=1e-3)
    benchmark.group = f"forward B={batch} S={prefix} T={t}"
    benchmark.extra_info.update(impl=impl, batch=batch, prefix=prefix, t=t)
    benchmark.pedantic(
        _step, args=(model, cache, ids, positions, mask, prefix), rounds=7, warmup_rounds=1
    )
