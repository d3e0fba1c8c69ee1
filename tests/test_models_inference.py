"""The CausalLM protocol on Transformer and HFCausalLM: prefill, decode, trees, rollback,
compaction.

Every incremental result is checked against transformers' own full-sequence forward pass over
the sequence that the cache is supposed to represent at that point.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from reference_models import (
    BASE,
    LLAMA3_ROPE_SCALING,
    YARN_ROPE_SCALING,
    gpt2_model,
    hf_logits,
    hf_model,
)
from specdecode.models import CausalLM, HFCausalLM, ModelConfig, Transformer

from specdecode import ops

V = BASE["vocab_size"]
TOL = dict(rtol=1e-4, atol=1e-4)
# Parents of a 7-node draft tree: root 0 with children 1, 2; 1 has 3, 4; 2 has 5; 3 has 6.
TREE = [-1, 0, 0, 1, 1, 2, 3]


def _tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, V, (n,), generator=g).tolist()


def _path(parents: list[int], node: int) -> list[int]:
    out = []
    while node >= 0:
        out.append(node)
        node = parents[node]
    return out[::-1]


def make_models(family: str, attention: str = "auto"):
    """(our model on the protocol, full-sequence reference logits function)."""
    if family == "gpt2":
        theirs = gpt2_model()
        return HFCausalLM(theirs), lambda ids: hf_logits(theirs, ids)
    hf_kind, _, which = family.partition(":")
    # "llama:llama3": Llama 3.1's scaled RoPE (all three of its frequency bands in use);
    # "qwen2:yarn": Qwen2.5's YaRN (cos and sin scaled too).
    # "phi3:partial": Phi-4-mini's RoPE on 3/4 of each head (the rest passed through).
    scalings = {"llama3": LLAMA3_ROPE_SCALING, "yarn": YARN_ROPE_SCALING}
    rope = {}
    if which in scalings:
        rope = {"rope_parameters": {"rope_theta": BASE["rope_theta"], **scalings[which]}}
    if which == "partial":
        rope = {
            "rope_parameters": {"rope_theta": BASE["rope_theta"], "partial_rotary_factor": 0.75}
        }
    theirs = hf_model(hf_kind, **rope)
    if which == "hf":
        return HFCausalLM(theirs), lambda ids: hf_logits(theirs, ids)
    ours = Transformer(ModelConfig.from_hf_config(theirs.config.to_dict()))
    ours.load_state_dict(theirs.state_dict())
    ours.attention = attention
    return ours, lambda ids: hf_logits(theirs, ids)


def prefill(model: CausalLM, cache, prompts: list[list[int]]) -> torch.Tensor:
    """Ragged prefill: one padded chain pass, then each row truncated to its prompt."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([p + [0] * (width - len(p)) for p in prompts])
    start = cache.lengths.long().unsqueeze(1)
    positions = start + torch.arange(width)
    logits = model.forward(ids, positions, cache)
    cache.truncate((start.squeeze(1) + torch.tensor([len(p) for p in prompts])).tolist())
    return logits


FAMILIES = [
    "llama",
    "qwen2",
    "mistral",
    "llama:hf",
    "qwen2:hf",
    "qwen3",
    "phi3",
    "phi3:partial",
    "qwen3_moe",
    "mixtral",
    "gpt2",
    "llama:llama3",
    "qwen2:yarn",
]


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_decode_tree_compact(family):
    """One row: prefill, decode steps, a tree step, compaction, decode after it."""
    model, full = make_models(family)
    assert isinstance(model, CausalLM)
    cache = model.new_cache(1, 64)
    seq = _tokens(9, seed=1)
    logits = prefill(model, cache, [seq])
    torch.testing.assert_close(logits, full(torch.tensor([seq])), **TOL)
    for step, tok in enumerate(_tokens(3, seed=2)):
        n = len(seq)
        out = model.forward(torch.tensor([[tok]]), torch.tensor([[n]]), cache)
        seq.append(tok)
        assert int(cache.lengths[0]) == len(seq), step
        torch.testing.assert_close(out[0, 0], full(torch.tensor([seq]))[0, -1], **TOL)

    # A tree step: the root is the last committed token (not yet in the cache) plus 6 drafts.
    root, committed = seq[-1], seq[:-1]
    cache.truncate(np.int64(len(committed)))  # an int, numpy's included
    info = ops.tree_info(torch.tensor([TREE], dtype=torch.int32))
    tree_tokens = [root] + _tokens(len(TREE) - 1, seed=3)
    positions = len(committed) + info.depth.long()
    out = model.forward(torch.tensor([tree_tokens]), positions, cache, tree_mask=info.mask)
    for node in range(len(TREE)):
        path_tokens = [tree_tokens[j] for j in _path(TREE, node)]
        expected = full(torch.tensor([committed + path_tokens]))[0, -1]
        torch.testing.assert_close(out[0, node], expected, **TOL)

    # Accept root -> 1 -> 3 -> 6 but keep only three nodes (the verifier rejected node 6).
    accepted = [0, 1, 3]
    cache.compact(
        torch.tensor([[0, 1, 3, 6]], dtype=torch.int32), torch.tensor([3], dtype=torch.int32)
    )
    seq = committed + [tree_tokens[j] for j in accepted]
    assert int(cache.lengths[0]) == len(seq)
    nxt = _tokens(2, seed=4)
    out = model.forward(torch.tensor([nxt]), torch.tensor([[len(seq), len(seq) + 1]]), cache)
    torch.testing.assert_close(out[0], full(torch.tensor([seq + nxt]))[0, -2:], **TOL)


@pytest.mark.parametrize("family", ["llama", "qwen2:hf", "gpt2"])
def test_ragged_batch(family):
    """Rows of different lengths advance by different amounts, as in batched verification."""
    model, full = make_models(family)
    prompts = [_tokens(n, seed=10 + n) for n in (5, 11, 1, 8)]
    cache = model.new_cache(len(prompts), 64)
    logits = prefill(model, cache, prompts)
    for b, p in enumerate(prompts):
        torch.testing.assert_close(logits[b, : len(p)], full(torch.tensor([p]))[0], **TOL)
    assert cache.lengths.tolist() == [len(p) for p in prompts]
    seqs = [list(p) for p in prompts]
    for step in range(3):
        # Chain of 3 per row; row b keeps b % 4 of them (0..3), like ragged acceptance.
        drafts = [_tokens(3, seed=100 * step + b) for b in range(len(seqs))]
        ids = torch.tensor(drafts)
        pos = cache.lengths.long().unsqueeze(1) + torch.arange(3)
        out = model.forward(ids, pos, cache)
        for b, s in enumerate(seqs):
            torch.testing.assert_close(out[b], full(torch.tensor([s + drafts[b]]))[0, -3:], **TOL)
        keep = [(b + step) % 4 for b in range(len(seqs))]
        cache.truncate([len(s) + k for s, k in zip(seqs, keep)])
        for b, k in enumerate(keep):
            seqs[b] += drafts[b][:k]
    last = model.forward(torch.tensor([[7]] * len(seqs)), cache.lengths.long().unsqueeze(1), cache)
    for b, s in enumerate(seqs):
        torch.testing.assert_close(last[b, 0], full(torch.tensor([s + [7]]))[0, -1], **TOL)


@pytest.mark.parametrize("family", ["llama", "llama:hf"])
def test_batched_trees_with_padding_and_compaction(family):
    """Different trees per row (padded with -1), per-row accepted paths, repeated compaction."""
    model, full = make_models(family)
    prompts = [_tokens(6, seed=20), _tokens(3, seed=21)]
    cache = model.new_cache(2, 64)
    prefill(model, cache, prompts)
    trees = [[-1, 0, 0, 1, 2, 4], [-1, 0, 1, -1, -1, -1]]
    committed = [p[:-1] for p in prompts]
    roots = [p[-1] for p in prompts]
    cache.truncate([len(c) for c in committed])
    for step in range(3):
        parents = torch.tensor(trees, dtype=torch.int32)
        info = ops.tree_info(parents)
        toks = [[roots[b]] + _tokens(5, seed=30 + 10 * step + b) for b in range(2)]
        positions = cache.lengths.long().unsqueeze(1) + info.depth.long().clamp_min(0)
        out = model.forward(torch.tensor(toks), positions, cache, tree_mask=info.mask)
        for b in range(2):
            for node in range(int(info.num_nodes[b])):
                path = [toks[b][j] for j in _path(trees[b], node)]
                expected = full(torch.tensor([committed[b] + path]))[0, -1]
                torch.testing.assert_close(out[b, node], expected, **TOL)
        # Row 0 accepts the deepest path root-2-4-5, row 1 only its root.
        paths = torch.tensor([[0, 2, 4, 5], [0, -1, -1, -1]], dtype=torch.int32)
        counts = torch.tensor([4, 1], dtype=torch.int32)
        cache.compact(paths, counts)
        for b in range(2):
            kept = [toks[b][j] for j in paths[b, : counts[b]].tolist()]
            committed[b] = committed[b] + kept[:-1]
            roots[b] = kept[-1]
        # The last accepted node becomes the next root: roll it back out of the cache.
        cache.truncate([len(c) for c in committed])
    if isinstance(model, HFCausalLM):
        # Compaction leaves holes; the physical cache stays bounded by squeezing.
        assert cache.physical_length <= 2 * int(cache.lengths.max()) + 32 + 6


def test_hf_cache_stays_bounded_under_rollbacks_alone():
    """A drafter's cache only ever rolls back (no compact): rows that keep tokens at different
    steps leave holes in the shared physical cache, which must be freed there too, not only
    after a compaction; the rows' results stay exact."""
    model, full = make_models("llama:hf")
    batch = 8
    cache = model.new_cache(batch, 64)
    seqs = [[3 + b] for b in range(batch)]
    model.forward(torch.tensor(seqs), torch.zeros(batch, 1, dtype=torch.long), cache)
    for step in range(96):
        # Every row scores one token; only row step % batch keeps it (rows take turns).
        ids = torch.tensor([[_tokens(1, seed=step)[0]]] * batch)
        model.forward(ids, cache.lengths.long().unsqueeze(1), cache)
        seqs[step % batch].append(int(ids[0, 0]))
        cache.truncate([len(s) for s in seqs])
    longest = max(len(s) for s in seqs)
    assert cache.physical_length <= 2 * longest + 32 + 1, (cache.physical_length, longest)
    out = model.forward(torch.tensor([[7]] * batch), cache.lengths.long().unsqueeze(1), cache)
    for b, s in enumerate(seqs):
        torch.testing.assert_close(out[b, 0], full(torch.tensor([s + [7]]))[0, -1], **TOL)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_rolled_back_entries_never_leak(family):
    """K/V written by a rejected draft must not influence anything after the rollback."""
    model, _ = make_models(family)
    prompt = _tokens(7, seed=40)
    clean = model.new_cache(1, 32)
    prefill(model, clean, [prompt])
    dirty = model.new_cache(1, 32)
    prefill(model, dirty, [prompt])
    junk = torch.tensor([_tokens(5, seed=41)])
    model.forward(junk, 7 + torch.arange(5).unsqueeze(0), dirty)
    dirty.truncate(7)
    nxt = torch.tensor([_tokens(3, seed=42)])
    pos = 7 + torch.arange(3).unsqueeze(0)
    a = model.forward(nxt, pos, clean)
    b = model.forward(nxt, pos, dirty)
    torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    # The detector works: without the rollback the outputs differ.
    dirty2 = model.new_cache(1, 32)
    prefill(model, dirty2, [prompt])
    model.forward(junk, 7 + torch.arange(5).unsqueeze(0), dirty2)
    c = model.forward(nxt, 12 + torch.arange(3).unsqueeze(0), dirty2)
    assert not torch.allclose(a, c, atol=1e-3)


def test_kernel_and_torch_attention_agree():
    kernel, full = make_models("llama", attention="ops")
    reference, _ = make_models("llama", attention="torch")
    prompts = [_tokens(13, seed=50), _tokens(4, seed=51)]
    ck, cr = kernel.new_cache(2, 48), reference.new_cache(2, 48)
    torch.testing.assert_close(prefill(kernel, ck, prompts), prefill(reference, cr, prompts), **TOL)
    info = ops.tree_info(torch.tensor([TREE, TREE], dtype=torch.int32))
    ids = torch.tensor([_tokens(7, seed=52), _tokens(7, seed=53)])
    pos = ck.lengths.long().unsqueeze(1) + info.depth.long()
    torch.testing.assert_close(
        kernel.forward(ids, pos, ck, info.mask), reference.forward(ids, pos, cr, info.mask), **TOL
    )


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float64])
def test_a_cache_in_another_dtype_runs_on_either_path(cache_dtype):
    """new_cache(dtype=...) other than the model's: the kernel runs in the cache's dtype (q cast
    to it), a dtype it lacks (float64) takes the torch path; both give the torch path's logits."""
    kernel, _ = make_models("llama", attention="auto")
    reference, _ = make_models("llama", attention="torch")
    prompts = [_tokens(9, seed=60), _tokens(5, seed=61)]
    ck = kernel.new_cache(2, 48, dtype=cache_dtype)
    cr = reference.new_cache(2, 48, dtype=cache_dtype)
    tol = {"atol": 3e-2, "rtol": 3e-2} if cache_dtype == torch.bfloat16 else TOL
    got, want = prefill(kernel, ck, prompts), prefill(reference, cr, prompts)
    assert got.dtype == want.dtype == torch.float32
    torch.testing.assert_close(got, want, **tol)


@pytest.mark.parametrize("dtype", [torch.int8, torch.bool, torch.complex64, "float16"])
def test_a_cache_dtype_that_is_not_a_float_is_refused(dtype):
    """An integer or bool cache rounded every key and value (wrong logits, no error)."""
    model, _ = make_models("llama")
    with pytest.raises(TypeError, match="dtype: expected a floating-point"):
        model.new_cache(1, 8, dtype=dtype)


def test_unsupported_head_dim_falls_back_to_torch(monkeypatch):
    small = hf_model("llama", num_attention_heads=4, num_key_value_heads=2, head_dim=48)
    assert 48 not in ops.HEAD_DIMS
    ours = Transformer(ModelConfig.from_hf_config(small.config.to_dict()))
    ours.load_state_dict(small.state_dict())
    calls = _count_kernel_calls(monkeypatch)
    cache = ours.new_cache(1, 16)
    seq = _tokens(6, seed=60)
    prefill(ours, cache, [seq])
    out = ours.forward(torch.tensor([[5]]), torch.tensor([[6]]), cache)
    torch.testing.assert_close(out[0, 0], hf_logits(small, torch.tensor([seq + [5]]))[0, -1], **TOL)
    assert calls == []  # "auto" fell back to PyTorch
    ours.attention = "ops"
    with pytest.raises(ValueError, match="head_dim 48"):
        ours.forward(torch.tensor([[5]]), torch.tensor([[7]]), cache)


def _count_kernel_calls(monkeypatch) -> list:
    """Wraps the model's tree-attention kernel call (transformer.tree_attention_in_cache, as the
    model looks it up) to record the head dim of each call."""
    from specdecode.models import transformer

    calls = []
    real = transformer.tree_attention_in_cache

    def counted(q, *args, **kwargs):
        calls.append(q.shape[-1])
        return real(q, *args, **kwargs)

    monkeypatch.setattr(transformer, "tree_attention_in_cache", counted)
    return calls


def test_the_model_reads_no_kernel_status_per_layer(monkeypatch):
    """The cache checks every row's room on the host before a pass, so the model's attention
    calls skip the read of the kernel's status (on a GPU, one wait for the device per layer);
    the public op still reads it."""
    from specdecode._ops import attention

    reads = []
    real = attention._raise_bad_prefix

    def counted(*args):
        reads.append(1)
        return real(*args)

    monkeypatch.setattr(attention, "_raise_bad_prefix", counted)
    calls = _count_kernel_calls(monkeypatch)
    model, _ = make_models("llama", attention="ops")
    cache = model.new_cache(2, 48)
    prefill(model, cache, [_tokens(9, seed=80), _tokens(4, seed=81)])
    info = ops.tree_info(torch.tensor([TREE, TREE], dtype=torch.int32))
    ids = torch.tensor([_tokens(7, seed=82), _tokens(7, seed=83)])
    model.forward(ids, cache.lengths.long().unsqueeze(1) + info.depth.long(), cache, info.mask)
    assert len(calls) == 2 * model.config.num_hidden_layers and reads == []
    q = torch.randn(2, 7, model.config.num_attention_heads, model.config.head_dim)
    ops.tree_attention(q, cache.k[0], cache.v[0], cache.lengths, info.mask)
    assert reads == [1]


def test_head_dim_32_uses_the_kernel_and_matches_transformers(monkeypatch):
    # The shipped zoo pair's attention shape (head_dim 32, two query heads per KV head): "auto"
    # runs ops.tree_attention, and ragged prefill, a tree pass and decode all give transformers'
    # logits and the PyTorch-attention path's logits.
    small = hf_model("llama", num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    ours = Transformer(ModelConfig.from_hf_config(small.config.to_dict()))
    ours.load_state_dict(small.state_dict())
    reference = Transformer(ModelConfig.from_hf_config(small.config.to_dict()))
    reference.load_state_dict(small.state_dict())
    reference.attention = "torch"
    calls = _count_kernel_calls(monkeypatch)
    prompts = [_tokens(11, seed=61), _tokens(3, seed=62)]
    ck, cr = ours.new_cache(2, 48), reference.new_cache(2, 48)
    got = prefill(ours, ck, prompts)
    assert calls and set(calls) == {32}
    n_kernel = len(calls)
    torch.testing.assert_close(got, prefill(reference, cr, prompts), **TOL)
    assert len(calls) == n_kernel  # the reference never calls the kernel
    for b, p in enumerate(prompts):
        expect = hf_logits(small, torch.tensor([p]))[0, -1]
        torch.testing.assert_close(got[b, len(p) - 1], expect, **TOL)
    info = ops.tree_info(torch.tensor([TREE, TREE], dtype=torch.int32))
    ids = torch.tensor([_tokens(7, seed=63), _tokens(7, seed=64)])
    pos = ck.lengths.long().unsqueeze(1) + info.depth.long()
    tree_logits = ours.forward(ids, pos, ck, info.mask)
    torch.testing.assert_close(tree_logits, reference.forward(ids, pos, cr, info.mask), **TOL)
    for b, p in enumerate(prompts):
        for node in (4, 6):
            path = _path(TREE, node)
            seq = p + [int(ids[b, j]) for j in path]
            expect = hf_logits(small, torch.tensor([seq]))[0, -1]
            torch.testing.assert_close(tree_logits[b, node], expect, **TOL)


def test_zoo_pair_auto_attention_uses_the_kernel(monkeypatch):
    from specdecode import zoo

    target, draft, _ = zoo.load()
    for model in (target, draft):
        assert model.attention == "auto" and model.config.head_dim == 32
    calls = _count_kernel_calls(monkeypatch)
    logits = {}
    for mode in ("auto", "torch"):
        target.attention = mode
        cache = target.new_cache(2, 32)
        logits[mode] = prefill(target, cache, [[1, 5, 9, 200, 31], [1, 77]])
        nxt = torch.tensor([[40], [41]])
        logits[mode + "-step"] = target.forward(nxt, cache.lengths.long().unsqueeze(1), cache)
        if mode == "auto":
            assert len(calls) == 2 * target.config.num_hidden_layers
    assert len(calls) == 2 * target.config.num_hidden_layers
    torch.testing.assert_close(logits["auto"], logits["torch"], **TOL)
    torch.testing.assert_close(logits["auto-step"], logits["torch-step"], **TOL)


@pytest.mark.parametrize("family", ["llama", "llama:hf"])
def test_hidden_states(family):
    model, _ = make_models(family)
    theirs = hf_model("llama")
    seq = _tokens(8, seed=70)
    cache = model.new_cache(1, 16)
    logits, hidden = model.forward(
        torch.tensor([seq]), torch.arange(8).unsqueeze(0), cache, output_hidden=[1, 0, -2, 2, -1]
    )
    with torch.no_grad():
        ref = theirs(torch.tensor([seq]), output_hidden_states=True).hidden_states
    assert len(hidden) == 5
    for got, index in zip(hidden, [1, 0, 1, 2, 2]):
        torch.testing.assert_close(got, ref[index], **TOL)
    # The last one is what lm_head reads.
    head = model.model.lm_head if isinstance(model, HFCausalLM) else model.lm_head
    with torch.no_grad():
        torch.testing.assert_close(head(hidden[-1]), logits, **TOL)
    with pytest.raises(ValueError, match="output_hidden"):
        model.forward(torch.tensor([[1]]), torch.tensor([[8]]), cache, output_hidden=[3])


@pytest.mark.parametrize("family", ["llama", "llama:hf"])
def test_numpy_integers_size_caches_and_index_hidden_states(family):
    """Sizes and layer indices may be numpy integers (as lengths and the engine's counts may):
    they become Python ints; a numpy bool is refused like a bool."""
    model, _ = make_models(family)
    cache = model.new_cache(np.int64(2), np.int32(16))
    assert type(cache.batch_size) is int and cache.batch_size == 2
    assert type(cache.max_length) is int and cache.max_length == 16
    seq = torch.tensor([_tokens(4, seed=71)] * 2)
    logits, (hidden,) = model.forward(
        seq, torch.arange(4).expand(2, 4), cache, output_hidden=[np.int64(-1)]
    )
    assert hidden.shape[:2] == (2, 4)
    with pytest.raises(TypeError, match="batch_size"):
        model.new_cache(np.bool_(True), 16)
    with pytest.raises(TypeError, match="output_hidden"):
        model.forward(seq[:, :1], torch.tensor([[4], [4]]), cache, output_hidden=[np.bool_(1)])


@pytest.mark.parametrize("family", ["llama", "llama:hf"])
def test_compact_keeps_only_a_root_to_node_path(family):
    """compact keeps K/V computed while each kept node attended to its tree ancestors: a path
    that skips the root, jumps between branches or skips a chain node would leave a cache that
    disagrees with its tokens, so it is refused and the cache left as it was."""
    model, _ = make_models(family)
    i32 = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731

    def scored(parents):
        cache = model.new_cache(1, 16)
        model.forward(torch.tensor([[5, 6, 7]]), torch.tensor([[0, 1, 2]]), cache)
        if parents is None:
            model.forward(torch.tensor([[8, 9, 10]]), torch.tensor([[3, 4, 5]]), cache)
        else:
            info = ops.tree_info(i32([parents]))
            ids = torch.tensor([[8, 9, 10, 11][: len(parents)]])
            model.forward(ids, 3 + info.depth.long(), cache, tree_mask=info.mask)
        return cache

    cases = [
        ([-1, 0, 1, 1], [1, 3], "root"),  # skips the root
        ([-1, 0, 1, 1], [0, 2, 3], "child"),  # 3 is 2's sibling
        ([-1, 0, 0], [0, 1, 2], "child"),  # node order, but 2 is 1's sibling
        (None, [0, 2], "child"),  # a chain keeps a prefix
        ([-1, 0, 1, 1], [0, 1, 1], "path"),  # a repeated node
    ]
    for parents, path, match in cases:
        cache = scored(parents)
        with pytest.raises(ValueError, match=match):
            cache.compact(i32([path]), i32([len(path)]))
        assert cache.lengths.tolist() == [3 + (3 if parents is None else len(parents))]
    # The same caches take a real path.
    for parents, path in (([-1, 0, 1, 1], [0, 1, 3]), ([-1, 0, 0], [0, 2]), (None, [0, 1])):
        cache = scored(parents)
        cache.compact(i32([path + [-1]]), i32([len(path)]))
        assert cache.lengths.tolist() == [3 + len(path)]


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_bad_requests_raise_before_work(family):
    model, _ = make_models(family)
    cache = model.new_cache(2, 8)
    ok_ids, ok_pos = torch.tensor([[1, 2], [3, 4]]), torch.tensor([[0, 1], [0, 1]])
    cases = [
        ((torch.tensor([[1, V], [3, 4]]), ok_pos), ValueError, "vocabulary"),
        ((torch.tensor([[1, -2], [3, 4]]), ok_pos), ValueError, "vocabulary"),
        ((torch.tensor([[1, 2]]), torch.tensor([[0, 1]])), ValueError, "batch"),
        ((ok_ids, torch.tensor([[0, 1, 2], [0, 1, 2]])), ValueError, "shape"),
        ((ok_ids, torch.tensor([[0, -1], [0, 1]])), ValueError, "positions"),
        ((ok_ids.float(), ok_pos), TypeError, "integer"),
        (
            (torch.zeros(2, 9, dtype=torch.long), torch.zeros(2, 9, dtype=torch.long)),
            ValueError,
            "max_length",
        ),
    ]
    for (ids, pos), error, match in cases:
        with pytest.raises(error, match=match):
            model.forward(ids, pos, cache)
        assert cache.lengths.tolist() == [0, 0]
    bad_mask = torch.zeros(2, 2, 2, dtype=torch.uint32)
    with pytest.raises(ValueError, match="tree_mask"):
        model.forward(ok_ids, ok_pos, cache, tree_mask=bad_mask)
    with pytest.raises(TypeError, match="tree_mask"):
        model.forward(ok_ids, ok_pos, cache, tree_mask=torch.zeros(2, 2, 1, dtype=torch.int32))
    with pytest.raises(ValueError, match="compact"):
        cache.compact(torch.zeros(2, 1, dtype=torch.int32), torch.ones(2, dtype=torch.int32))
    model.forward(ok_ids, ok_pos, cache)
    with pytest.raises(ValueError, match="path"):
        cache.compact(
            torch.tensor([[0, 2], [0, 1]], dtype=torch.int32),
            torch.tensor([2, 2], dtype=torch.int32),
        )
    with pytest.raises(ValueError, match="num_accepted"):
        cache.compact(
            torch.tensor([[0, 1], [0, 1]], dtype=torch.int32),
            torch.tensor([3, 1], dtype=torch.int32),
        )
    with pytest.raises(TypeError, match="path"):
        cache.compact(torch.tensor([[0, 1], [0, 1]]), torch.tensor([1, 1], dtype=torch.int32))
    assert cache.lengths.tolist() == [2, 2]
    with pytest.raises(ValueError, match="truncate"):
        cache.truncate([3, 1])
    with pytest.raises(ValueError, match="max_length"):
        model.new_cache(1, model.max_length + 1)
    with pytest.raises(ValueError, match="batch_size"):
        model.new_cache(0, 4)


def test_hf_cache_belongs_to_its_model_and_device():
    """A cache holds one model's K/V on one device: another model would fail deep inside
    transformers (or, with the same shapes, read them as its own)."""
    from specdecode.models import HFCache

    llama, _ = make_models("llama:hf")
    same_shapes = HFCausalLM(hf_model("llama", seed=3))
    gpt2, _ = make_models("gpt2")
    cache = llama.new_cache(1, 16)
    llama.forward(torch.tensor([[1, 2]]), torch.tensor([[0, 1]]), cache)
    for model in (same_shapes, gpt2):
        with pytest.raises(ValueError, match="cache: it holds the K/V of another model"):
            model.forward(torch.tensor([[3]]), torch.tensor([[2]]), cache)
    assert cache.lengths.tolist() == [2] and cache.physical_length == 2
    # A wrapper around the same transformers model shares it.
    HFCausalLM(llama.model).forward(torch.tensor([[3]]), torch.tensor([[2]]), cache)
    assert cache.lengths.tolist() == [3]
    with pytest.raises(ValueError, match="cache: on meta"):
        llama.forward(torch.tensor([[3]]), torch.tensor([[0]]), HFCache(1, 16, "meta"))


def test_hf_cache_is_unchanged_when_the_model_fails_midway():
    """An error inside the transformers model (out of memory, say) after some layers appended
    their K/V must not leave layers of different lengths behind."""
    model, full = make_models("llama:hf")
    cache = model.new_cache(1, 16)
    seq = _tokens(4, seed=60)
    model.forward(torch.tensor([seq]), torch.arange(4).unsqueeze(0), cache)

    def fail(*_):
        raise RuntimeError("out of memory (simulated)")

    hook = model.model.model.layers[-1].register_forward_pre_hook(fail)
    with pytest.raises(RuntimeError, match="simulated"):
        model.forward(torch.tensor([[5, 6]]), torch.tensor([[4, 5]]), cache)
    hook.remove()
    assert cache.lengths.tolist() == [4] and cache.physical_length == 4
    assert [layer.keys.shape[2] for layer in cache.hf.layers] == [4, 4]
    out = model.forward(torch.tensor([[7]]), torch.tensor([[4]]), cache)
    torch.testing.assert_close(out[0, 0], full(torch.tensor([seq + [7]]))[0, -1], **TOL)


@pytest.mark.parametrize("family", ["llama", "llama:hf"])
def test_truncate_refuses_bools_and_floats(family):
    """A cast read True as 1 and truncated 1.7 to 1 (a wrong rollback, no error)."""
    model, _ = make_models(family)
    cache = model.new_cache(1, 8)
    model.forward(torch.tensor([[1, 2, 3]]), torch.tensor([[0, 1, 2]]), cache)
    for bad in ([True], [1.7], np.array([1.7]), np.array([True]), 2.0):
        with pytest.raises(TypeError, match="lengths: expected"):
            cache.truncate(bad)
        assert cache.lengths.tolist() == [3]
    cache.truncate(np.array([2], dtype=np.int32))
    assert cache.lengths.tolist() == [2]


@pytest.mark.parametrize("family", ["gpt2", "llama:hf"])
def test_hf_positions_beyond_the_models_limit_are_refused(family):
    """GPT-2's learned position embeddings have no row past n_positions (an IndexError deep in
    the model on the CPU, a device-side assert on CUDA): refused before the model runs, naming
    the limit and the config field it comes from (GPT2Config maps max_position_embeddings to
    n_positions)."""
    model, _ = make_models(family)
    limit = model.max_length
    cache = model.new_cache(1, 8)
    expected = rf"positions: {limit} .* {limit} \(config.max_position_embeddings\)"
    with pytest.raises(ValueError, match=expected):
        model.forward(torch.tensor([[1, 2]]), torch.tensor([[limit - 1, limit]]), cache)
    assert cache.lengths.tolist() == [0] and cache.physical_length == 0
    model.forward(torch.tensor([[1, 2]]), torch.tensor([[limit - 2, limit - 1]]), cache)


def test_sliding_window_limits_the_length():
    model, _ = make_models("llama")
    theirs = hf_model("mistral", sliding_window=16)
    ours = Transformer(ModelConfig.from_hf_config(theirs.config.to_dict()))
    assert ours.max_length == 16
    with pytest.raises(ValueError, match="max_length"):
        ours.new_cache(1, 17)
    with pytest.raises(ValueError, match="max length"):
        ours.forward_train(torch.zeros(1, 17, dtype=torch.long))
    wrapped = HFCausalLM(theirs)
    assert wrapped.max_length == 16
    with pytest.raises(ValueError, match=r"16 \(config.sliding_window\)"):
        wrapped.forward(torch.tensor([[1]]), torch.tensor([[16]]), wrapped.new_cache(1, 8))


def test_chain_longer_than_the_kernel_limit_is_chunked():
    """A prefill of more than ops.MAX_TREE_NODES tokens runs in chunks with the same result."""
    theirs = hf_model("llama", max_position_embeddings=1100)
    ours = Transformer(ModelConfig.from_hf_config(theirs.config.to_dict()))
    ours.load_state_dict(theirs.state_dict())
    n = ops.MAX_TREE_NODES + 40
    seq = torch.tensor([_tokens(n, seed=80)])
    cache = ours.new_cache(1, n + 8)
    logits, hidden = ours.forward(seq, torch.arange(n).unsqueeze(0), cache, output_hidden=[1])
    assert logits.shape == (1, n, V) and hidden[0].shape == (1, n, BASE["hidden_size"])
    assert int(cache.lengths[0]) == n
    tail = slice(n - 50, n)  # across the chunk boundary
    torch.testing.assert_close(logits[:, tail], hf_logits(theirs, seq)[:, tail], **TOL)
    # compact() after a chunked pass refers to the whole chain.
    cache.compact(
        torch.tensor([[0, 1, 2]], dtype=torch.int32), torch.tensor([3], dtype=torch.int32)
    )
    assert int(cache.lengths[0]) == 3


def test_a_tree_mask_beyond_the_kernel_limit_names_tree_mask():
    """The kernel's limit was reported as the internal argument q."""
    model = Transformer(ModelConfig(**{**BASE, "max_position_embeddings": 1100}))
    n = ops.MAX_TREE_NODES + 1
    words = (n + 31) // 32
    chain = np.tril(np.ones((n, 32 * words), dtype=bool))
    mask = torch.from_numpy(np.packbits(chain, axis=1, bitorder="little").view(np.uint32))
    ids, pos = torch.zeros((1, n), dtype=torch.long), torch.arange(n).unsqueeze(0)
    cache = model.new_cache(1, n)
    with pytest.raises(ValueError, match="tree_mask: ops.tree_attention scores at most 1024"):
        model.forward(ids, pos, cache, tree_mask=mask.unsqueeze(0))
    assert cache.lengths.tolist() == [0]


def test_a_chunked_chain_that_fails_midway_leaves_the_cache_as_it_was(monkeypatch):
    """The first chunk of a long chain was committed when a later one failed (out of memory,
    say): the cache then held half a prompt that the caller never learned about."""
    model = Transformer(ModelConfig(**{**BASE, "max_position_embeddings": 1100}))
    n = ops.MAX_TREE_NODES + 8
    cache = model.new_cache(1, n + 1)
    model.forward(torch.tensor([[1]]), torch.tensor([[0]]), cache)
    run, calls = model._run_cached, []

    def fail_second(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("out of memory (simulated)")
        return run(*args, **kwargs)

    monkeypatch.setattr(model, "_run_cached", fail_second)
    ids, pos = torch.zeros((1, n), dtype=torch.long), 1 + torch.arange(n).unsqueeze(0)
    with pytest.raises(RuntimeError, match="simulated"):
        model.forward(ids, pos, cache)
    assert cache.lengths.tolist() == [1] and cache._host_lengths.tolist() == [1]


# ---- the fused inference weights -----------------------------------------------------------------


def _incremental_logits(model: Transformer, ids: torch.Tensor) -> torch.Tensor:
    cache = model.new_cache(ids.shape[0], 64)
    positions = torch.arange(ids.shape[1]).expand(ids.shape[0], -1)
    return model.forward(ids, positions, cache)


@pytest.mark.parametrize("bias", [False, True])
def test_inference_copies_follow_parameter_updates(tmp_path, bias):
    theirs = hf_model("qwen2" if bias else "llama")
    theirs.save_pretrained(tmp_path)
    ours = Transformer.from_pretrained(tmp_path)
    ids = torch.randint(0, V, (2, 11), generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(_incremental_logits(ours, ids), hf_logits(theirs, ids), **TOL)
    # In-place updates (what optimizers and load_state_dict do) must reach the fused copies.
    with torch.no_grad():
        ours.model.layers[0].self_attn.k_proj.weight.mul_(1.5)
        ours.model.layers[1].mlp.up_proj.weight.add_(0.01)
        theirs.model.layers[0].self_attn.k_proj.weight.mul_(1.5)
        theirs.model.layers[1].mlp.up_proj.weight.add_(0.01)
    torch.testing.assert_close(_incremental_logits(ours, ids), hf_logits(theirs, ids), **TOL)
    torch.testing.assert_close(_incremental_logits(ours, ids), ours.forward_train(ids), **TOL)
    fresh = Transformer.from_pretrained(tmp_path)
    ours.load_state_dict(fresh.state_dict())
    torch.testing.assert_close(
        _incremental_logits(ours, ids), _incremental_logits(fresh, ids), rtol=0, atol=0
    )
    # .to() replaces the storage: the copies are rebuilt in the new dtype.
    ours.to(torch.float64)
    assert _incremental_logits(ours, ids).dtype == torch.float64


def test_state_dict_round_trip_is_unchanged_by_inference(tmp_path):
    theirs = hf_model("llama")
    theirs.save_pretrained(tmp_path)
    ours = Transformer.from_pretrained(tmp_path)
    before = {k: v.clone() for k, v in ours.state_dict().items()}
    _incremental_logits(ours, torch.randint(0, V, (1, 5)))
    after = ours.state_dict()
    assert list(after) == list(before)  # the Hugging Face names, no fused tensors
    assert all(torch.equal(before[k], after[k]) for k in before)
    ours.save_pretrained(tmp_path / "again")
    again = Transformer.from_pretrained(tmp_path / "again")
    assert all(torch.equal(before[k], again.state_dict()[k]) for k in before)


def test_compact_of_a_prefix_path_equals_the_general_move():
    model = Transformer(ModelConfig(**{**BASE, "model_type": "llama"}))
    ids = torch.randint(0, V, (2, 6), generator=torch.Generator().manual_seed(7))
    keep = torch.tensor([4, 2], dtype=torch.int32)
    # Row 0 a chain; row 1 a tree where nodes 1 and 2 are both children of the root, so that
    # [0, 1] and [0, 2] are both accepted paths.
    info = ops.tree_info(torch.tensor([[-1, 0, 1, 2], [-1, 0, 0, 2]], dtype=torch.int32))
    caches = []
    for path in ([[0, 1, 2, 3], [0, 1, -1, -1]], [[0, 1, 2, 3], [0, 2, -1, -1]]):
        cache = model.new_cache(2, 32)
        model.forward(ids[:, :2], torch.arange(2).expand(2, 2), cache)
        model.forward(ids[:, 2:], 2 + info.depth.long(), cache, tree_mask=info.mask)
        cache.compact(torch.tensor(path, dtype=torch.int32), keep)
        caches.append(cache)
    prefix, moved = caches
    # The prefix path needed no move (a truncate); both keep 2 + 4 and 2 + 2 tokens.
    assert prefix.lengths.tolist() == moved.lengths.tolist() == [6, 4]
    assert prefix._host_lengths.tolist() == [6, 4]
    nxt = ids[:, :1]
    got = model.forward(nxt, prefix.lengths.long().unsqueeze(1), prefix)
    # Reference: a cache filled with the kept tokens directly.
    ref = model.new_cache(2, 32)
    model.forward(ids, torch.arange(6).expand(2, 6), ref)
    ref.truncate([6, 4])
    torch.testing.assert_close(got, model.forward(nxt, ref.lengths.long().unsqueeze(1), ref), **TOL)
    # Row 0 of the moved cache kept the same prefix path: same result there.
    other = model.forward(nxt, moved.lengths.long().unsqueeze(1), moved)
    torch.testing.assert_close(other[0], got[0], **TOL)


# ---- ragged batches: num_nodes skips the padding -------------------------------------------------


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("attention", ["auto", "torch"])
def test_num_nodes_skips_padding_and_matches_transformers(family, attention):
    """Rows with fewer real nodes than the padded width: the real nodes' logits equal
    transformers', padding gives zeros and leaves its cache slots untouched, and the kept paths
    are the same as after a dense pass."""
    model, full = make_models(family, attention)
    prompts = [_tokens(6, seed=70), _tokens(3, seed=71), _tokens(5, seed=72)]
    cache = model.new_cache(3, 64)
    dense = model.new_cache(3, 64)
    # Ragged prefill through num_nodes: each row's padding (the tail of the chain) is skipped.
    width = max(len(p) for p in prompts)
    ids = torch.tensor([p + [0] * (width - len(p)) for p in prompts])
    real = torch.tensor([len(p) for p in prompts])
    logits = model.forward(ids, torch.arange(width).expand(3, width), cache, num_nodes=real)
    for b, p in enumerate(prompts):
        torch.testing.assert_close(logits[b, : len(p)], full(torch.tensor([p]))[0], **TOL)
        assert bool((logits[b, len(p) :] == 0).all())
    cache.truncate(real.tolist())
    prefill(model, dense, prompts)
    trees = [[-1, 0, 0, 1, 2, 4], [-1, 0, 1, -1, -1, -1], [-1, -1, -1, -1, -1, -1]]
    nodes = torch.tensor([6, 3, 0])  # the last row scores nothing (a finished sequence)
    parents = torch.tensor(trees, dtype=torch.int32)
    parents[2, 0] = -1
    info = ops.tree_info(parents)
    toks = torch.tensor([[p[-1]] + _tokens(5, seed=80 + b) for b, p in enumerate(prompts)])
    positions = cache.lengths.long().unsqueeze(1) + info.depth.long().clamp_min(0)
    before = cache.k.clone()
    out = model.forward(toks, positions, cache, tree_mask=info.mask, num_nodes=nodes)
    ref = model.forward(toks, positions, dense, tree_mask=info.mask)
    for b in range(3):
        k = int(nodes[b])
        for node in range(k):
            path = [int(toks[b, j]) for j in _path(trees[b], node)]
            expected = full(torch.tensor([prompts[b] + path]))[0, -1]
            torch.testing.assert_close(out[b, node], expected, **TOL)
        torch.testing.assert_close(out[b, :k], ref[b, :k], rtol=0, atol=1e-5)
        assert bool((out[b, k:] == 0).all())
        # Padding slots were not written.
        pad = slice(len(prompts[b]) + k, len(prompts[b]) + 6)
        assert torch.equal(cache.k[:, b, pad], before[:, b, pad])
    paths = torch.tensor([[0, 2, 4], [0, 1, 2], [0, -1, -1]], dtype=torch.int32)
    counts = torch.tensor([3, 3, 0], dtype=torch.int32)
    cache.compact(paths, counts)
    dense.compact(paths, counts)
    assert cache.lengths.tolist() == dense.lengths.tolist()
    for b in range(3):
        n = int(cache.lengths[b])
        torch.testing.assert_close(cache.k[:, b, :n], dense.k[:, b, :n], rtol=0, atol=1e-5)
        torch.testing.assert_close(cache.v[:, b, :n], dense.v[:, b, :n], rtol=0, atol=1e-5)


def test_num_nodes_bad_values_raise_before_work():
    model, _ = make_models("llama")
    cache = model.new_cache(2, 16)
    ids = torch.zeros((2, 3), dtype=torch.int64)
    pos = torch.arange(3).expand(2, 3)
    for bad, err in (
        ([3, 3], TypeError),
        (torch.tensor([1.0, 2.0]), TypeError),
        (torch.tensor([1, 2, 3]), ValueError),
        (torch.tensor([4, 1]), ValueError),
        (torch.tensor([-1, 1]), ValueError),
    ):
        with pytest.raises(err, match="num_nodes"):
            model.forward(ids, pos, cache, num_nodes=bad)
        assert cache.lengths.tolist() == [0, 0]


def test_compact_refuses_padding_tokens():
    """A chain's padding tokens (past num_nodes) were never computed: keeping one kept stale
    K/V without an error (a tree's padding rows see nothing, which the path check refuses)."""
    model, _ = make_models("llama")
    cache = model.new_cache(2, 16)
    ids, pos = torch.tensor([[1, 2, 3]] * 2), torch.arange(3).expand(2, 3)
    model.forward(ids, pos, cache, num_nodes=torch.tensor([3, 1]))
    path = torch.tensor([[0, 1, 2], [0, 1, -1]], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"path: row 1 keeps node 1, a padding token"):
        cache.compact(path, torch.tensor([3, 2], dtype=torch.int32))
    cache.compact(path, torch.tensor([3, 1], dtype=torch.int32))
    assert cache.lengths.tolist() == [3, 1]


def test_keep_rows_drops_and_reorders_rows():
    model, _ = make_models("llama")
    cache = model.new_cache(3, 16)
    prompts = [_tokens(4, seed=90), _tokens(2, seed=91), _tokens(5, seed=92)]
    prefill(model, cache, prompts)
    k, v, lengths = cache.k.clone(), cache.v.clone(), cache.lengths.tolist()
    cache.keep_rows(torch.tensor([2, 0]))
    assert cache.batch_size == 2 and cache.lengths.tolist() == [lengths[2], lengths[0]]
    assert torch.equal(cache.k, k[:, [2, 0]]) and torch.equal(cache.v, v[:, [2, 0]])
    # The kept rows decode as before.
    nxt = torch.tensor([[7], [9]])
    pos = cache.lengths.long().unsqueeze(1)
    out = model.forward(nxt, pos, cache)
    again = model.new_cache(2, 16)
    prefill(model, again, [prompts[2], prompts[0]])
    torch.testing.assert_close(out, model.forward(nxt, pos, again), **TOL)
    for bad, err in (
        ([0], TypeError),
        (torch.tensor([0], dtype=torch.int32), TypeError),
        (torch.tensor([], dtype=torch.int64), ValueError),
        (torch.tensor([2]), ValueError),
        (torch.tensor([1, 1]), ValueError),
    ):
        with pytest.raises(err, match="rows"):
            cache.keep_rows(bad)
    assert cache.batch_size == 2
    # A pending tree (scored, not yet compacted) stays compactable on the kept rows, each
    # checked against its own tree: [0, 2] is a path of row 1's tree only.
    info = ops.tree_info(torch.tensor([[-1, 0, 1], [-1, 0, 0]], dtype=torch.int32))
    start = cache.lengths.tolist()
    pos = cache.lengths.long().unsqueeze(1) + info.depth.long()
    model.forward(torch.tensor([[1, 2, 3]] * 2), pos, cache, info.mask)
    cache.keep_rows(torch.tensor([1]))
    cache.compact(torch.tensor([[0, 2]], dtype=torch.int32), torch.tensor([2], dtype=torch.int32))
    assert cache.lengths.tolist() == [start[1] + 2]


def _hf_layer_batches(cache) -> set[int]:
    """The batch dimension of every K/V tensor in an HFCache's transformers cache."""
    return {layer.keys.shape[0] for layer in cache.hf.layers} | {
        layer.values.shape[0] for layer in cache.hf.layers
    }


@pytest.mark.parametrize("family", ["llama:hf", "qwen2:hf", "mistral:hf", "gpt2"])
def test_hf_keep_rows_decodes_as_a_cache_of_the_kept_rows(family):
    """Rows of different lengths, with holes from ragged rollbacks, kept in a new order: every
    layer shrinks to the kept rows, and the next passes give the logits of a cache built from
    scratch for those rows' sequences (and of transformers' full forward)."""
    model, full = make_models(family)
    prompts = [_tokens(n, seed=60 + n) for n in (6, 11, 2, 8)]
    cache = model.new_cache(len(prompts), 64)
    prefill(model, cache, prompts)
    seqs = [list(p) for p in prompts]
    for step in range(2):
        drafts = [_tokens(3, seed=70 + 10 * step + b) for b in range(len(seqs))]
        model.forward(
            torch.tensor(drafts), cache.lengths.long().unsqueeze(1) + torch.arange(3), cache
        )
        keep = [(b + step) % 4 for b in range(len(seqs))]
        cache.truncate([len(s) + k for s, k in zip(seqs, keep)])
        for b, k in enumerate(keep):
            seqs[b] += drafts[b][:k]
    rows = [3, 0, 2]
    cache.keep_rows(torch.tensor(rows))
    kept = [seqs[r] for r in rows]
    assert cache.batch_size == 3 and cache.lengths.tolist() == [len(s) for s in kept]
    assert cache.valid.shape[0] == 3 and _hf_layer_batches(cache) == {3}
    scratch = model.new_cache(3, 64)
    prefill(model, scratch, kept)
    for step in range(2):
        nxt = torch.tensor([_tokens(2, seed=80 + 10 * step + b) for b in range(3)])
        pos = cache.lengths.long().unsqueeze(1) + torch.arange(2)
        out = model.forward(nxt, pos, cache)
        torch.testing.assert_close(out, model.forward(nxt, pos, scratch), **TOL)
        for b, s in enumerate(kept):
            s += nxt[b].tolist()
            torch.testing.assert_close(out[b], full(torch.tensor([s]))[0, -2:], **TOL)


@pytest.mark.parametrize("family", ["llama:hf", "gpt2"])
def test_hf_keep_rows_keeps_a_pending_tree_compactable(family):
    """keep_rows between a tree pass and its compaction: each kept row is checked against and
    compacted along its own tree, and decodes as the accepted sequence afterwards."""
    model, full = make_models(family)
    prompts = [_tokens(5, seed=110), _tokens(9, seed=111), _tokens(3, seed=112)]
    cache = model.new_cache(3, 64)
    prefill(model, cache, prompts)
    trees = [[-1, 0, 1, 0], [-1, 0, 0, 1], [-1, 0, 0, 2]]
    info = ops.tree_info(torch.tensor(trees, dtype=torch.int32))
    toks = [_tokens(4, seed=120 + b) for b in range(3)]
    pos = cache.lengths.long().unsqueeze(1) + info.depth.long()
    model.forward(torch.tensor(toks), pos, cache, tree_mask=info.mask)
    cache.keep_rows(torch.tensor([2, 0]))
    assert cache.batch_size == 2 and cache.lengths.tolist() == [3 + 4, 5 + 4]
    # [0, 2, 3] is a root-to-node path of row 2's tree only, [0, 1, 2] of row 0's only.
    with pytest.raises(ValueError, match="path"):
        cache.compact(
            torch.tensor([[0, 1, 2], [0, 1, 2]], dtype=torch.int32),
            torch.tensor([3, 3], dtype=torch.int32),
        )
    cache.compact(
        torch.tensor([[0, 2, 3], [0, 1, 2]], dtype=torch.int32),
        torch.tensor([3, 3], dtype=torch.int32),
    )
    kept = [prompts[2] + [toks[2][j] for j in (0, 2, 3)], prompts[0] + toks[0][:3]]
    assert cache.lengths.tolist() == [len(s) for s in kept]
    nxt = torch.tensor([[7], [9]])
    out = model.forward(nxt, cache.lengths.long().unsqueeze(1), cache)
    for b, s in enumerate(kept):
        torch.testing.assert_close(out[b, 0], full(torch.tensor([s + [int(nxt[b])]]))[0, -1], **TOL)


def test_hf_keep_rows_frees_the_slots_only_dropped_rows_used():
    """Dropping the longest row crops the slots only it used; holes that then outweigh the kept
    slots are squeezed out (as after a rollback), but not under a pending tree."""
    model, full = make_models("llama:hf")
    cache = model.new_cache(2, 128)
    seqs = [_tokens(30, seed=130), _tokens(2, seed=131)]
    prefill(model, cache, seqs)
    assert cache.physical_length == 30
    cache.keep_rows(torch.tensor([1]))
    assert cache.physical_length == 2
    # Two rows again: row 1 keeps a token every 10th step, row 0 every step, so row 1's slots
    # end up spread thinly over the physical cache.
    cache = model.new_cache(2, 128)
    prefill(model, cache, seqs)
    for step in range(40):
        tok = _tokens(1, seed=140 + step)[0]
        model.forward(torch.tensor([[tok]] * 2), cache.lengths.long().unsqueeze(1), cache)
        seqs[0].append(tok)
        if step % 10 == 9:
            seqs[1].append(tok)
        cache.truncate([len(s) for s in seqs])
    assert cache.physical_length == 70 and cache.lengths.tolist() == [70, 6]
    # Under a pending tree the slots stay put; its compaction squeezes them.
    model.forward(
        torch.tensor([[5, 6]] * 2), cache.lengths.long().unsqueeze(1) + torch.arange(2), cache
    )
    cache.keep_rows(torch.tensor([1]))
    assert cache.physical_length == 72
    cache.compact(torch.tensor([[0, 1]], dtype=torch.int32), torch.tensor([1], dtype=torch.int32))
    assert cache.physical_length == 7
    seqs[1].append(5)
    out = model.forward(torch.tensor([[9]]), cache.lengths.long().unsqueeze(1), cache)
    torch.testing.assert_close(out[0, 0], full(torch.tensor([seqs[1] + [9]]))[0, -1], **TOL)


def test_hf_keep_rows_of_an_empty_cache():
    """A cache that holds nothing (new, or rolled back to nothing) keeps rows too, and the next
    pass runs at the kept batch size."""
    model, full = make_models("llama:hf")
    prompts = [_tokens(4, seed=150), _tokens(6, seed=151), _tokens(3, seed=152)]
    for rolled_back in (False, True):
        cache = model.new_cache(3, 32)
        if rolled_back:
            prefill(model, cache, prompts)
            cache.truncate(0)
        cache.keep_rows(torch.tensor([2, 1]))
        assert cache.batch_size == 2 and cache.physical_length == 0
        logits = prefill(model, cache, [prompts[2], prompts[1]])
        for b, p in enumerate([prompts[2], prompts[1]]):
            torch.testing.assert_close(logits[b, : len(p)], full(torch.tensor([p]))[0], **TOL)


@pytest.mark.parametrize("family", ["llama", "llama:hf"])
def test_keep_rows_refuses_bad_rows_and_changes_nothing(family):
    """Both caches refuse the same bad ``rows`` with the same kinds of errors, naming rows."""
    model, _ = make_models(family)
    cache = model.new_cache(3, 16)
    prefill(model, cache, [_tokens(4, seed=160), _tokens(2, seed=161), _tokens(5, seed=162)])
    lengths = cache.lengths.tolist()
    for bad, err in (
        ([0], TypeError),
        (torch.tensor([0], dtype=torch.int32), TypeError),
        (torch.tensor([0.0]), TypeError),
        (torch.tensor([], dtype=torch.int64), ValueError),
        (torch.tensor([[0, 1]]), ValueError),
        (torch.tensor([3]), ValueError),
        (torch.tensor([-1]), ValueError),
        (torch.tensor([1, 1]), ValueError),
    ):
        with pytest.raises(err, match="rows"):
            cache.keep_rows(bad)
        assert cache.batch_size == 3 and cache.lengths.tolist() == lengths
    if isinstance(model, HFCausalLM):
        assert cache.valid.shape[0] == 3 and _hf_layer_batches(cache) == {3}


def test_prepacked_products_match_torch_mm():
    from specdecode.models import transformer as tr

    if not tr._onednn_usable(torch.device("cpu"), torch.float32):
        pytest.skip("this torch build has no usable oneDNN")
    g = torch.Generator().manual_seed(11)
    w = torch.randn(300, 64, generator=g)  # [out, in], as nn.Linear stores it
    packed = tr._pack_weight(w)
    assert packed is not None
    w_t = w.t().contiguous()
    for rows in (0, 1, 2, 3, 17, 70):
        x = torch.randn(rows, 64, generator=g)
        got = tr._mm_rows(x, w_t, packed)
        assert got.shape == (rows, 300)
        torch.testing.assert_close(got, x @ w_t, rtol=1e-5, atol=1e-5)
    # A non-contiguous input (a column slice) is read correctly too.
    x = torch.randn(5, 128, generator=g)[:, ::2]
    torch.testing.assert_close(tr._mm_rows(x, w_t, packed), x @ w_t, rtol=1e-5, atol=1e-5)
    # Only float32 CPU weights are packed; others keep torch.mm.
    assert tr._pack_weight(w.double()) is None
    assert tr._mm_rows(x.double(), w_t.double(), None).dtype == torch.float64


def test_forward_with_and_without_prepacked_weights_agree(monkeypatch):
    from specdecode.models import transformer as tr

    model = Transformer(ModelConfig(**{**BASE, "model_type": "llama"})).eval()
    fast = model._inference_weights()
    if tr._onednn_usable(torch.device("cpu"), torch.float32):
        assert fast.head_p is not None
        assert all(layer.gate_up_p is not None for layer in fast.layers)
    parents = torch.tensor([TREE], dtype=torch.int32).expand(2, -1).contiguous()
    mask = ops.tree_info(parents).mask
    ids = torch.randint(0, V, (2, 9), generator=torch.Generator().manual_seed(12))
    tree = torch.randint(0, V, (2, len(TREE)), generator=torch.Generator().manual_seed(13))
    depth = ops.tree_info(parents).depth.long()

    def run() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        cache = model.new_cache(2, 32)
        pre = model.forward(ids, torch.arange(9).expand(2, -1), cache)
        one = model.forward(tree[:, :1], torch.full((2, 1), 9), cache)
        cache.truncate(9)
        logits = model.forward(tree, 9 + depth, cache, tree_mask=mask)
        return pre, one, logits

    packed = run()
    monkeypatch.setattr(tr, "_pack_weight", lambda w: None)
    model._fast = None
    plain = run()
    assert model._inference_weights().head_p is None
    for a, b in zip(packed, plain):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_ragged_padding_rows_of_logits_and_hidden_states_are_zero():
    model = Transformer(ModelConfig(**{**BASE, "model_type": "llama"})).eval()
    cache = model.new_cache(3, 32)
    ids = torch.randint(0, V, (3, 6), generator=torch.Generator().manual_seed(21))
    real = torch.tensor([6, 2, 0])
    # A reused output buffer must not leak: run a full pass first, then the ragged one.
    model.forward(ids, torch.arange(6).expand(3, -1), cache)
    cache.truncate(0)
    logits, hidden = model.forward(
        ids, torch.arange(6).expand(3, -1), cache, output_hidden=[1, -1], num_nodes=real
    )
    for b, k in enumerate(real.tolist()):
        assert bool((logits[b, k:] == 0).all())
        assert all(bool((h[b, k:] == 0).all()) for h in hidden)
        if k:
            assert bool((logits[b, :k] != 0).any())
    full = model.new_cache(1, 32)
    want = model.forward(ids[:1, :6], torch.arange(6).unsqueeze(0), full)
    torch.testing.assert_close(logits[0], want[0], rtol=1e-5, atol=1e-5)


def test_hf_wrapper_passes_the_cache_by_the_models_own_argument():
    """transformers 5.24 renamed past_key_values to cache (the old name goes in 5.40): the
    wrapper uses whichever the model's forward has, so no deprecation warning."""
    import warnings

    model, full = make_models("llama:hf")
    cache = model.new_cache(1, 16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.forward(torch.tensor([[1, 2, 3]]), torch.arange(3)[None], cache)
        step = model.forward(torch.tensor([[4]]), torch.tensor([[3]]), cache)
    assert not [w for w in caught if "past_key_values" in str(w.message)]
    torch.testing.assert_close(step[0, 0], full(torch.tensor([[1, 2, 3, 4]]))[0, -1], **TOL)


# ---- steer: vectors added after each layer (steered drafters) ----------------------------------

STEER_V, STEER_H = 61, 64


def steer_model(hidden: int = STEER_H, max_length: int = 64) -> Transformer:
    """A 2-layer model with peaked distributions (random weights of std 0.15)."""
    config = ModelConfig(
        vocab_size=STEER_V,
        hidden_size=hidden,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=1,
        num_key_value_heads=1,
        max_position_embeddings=max_length,
    )
    torch.manual_seed(2)
    model = Transformer(config)
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.copy_(0.15 * torch.randn(p.shape, generator=gen))
    return model.eval()


def test_steer_in_the_cached_forward_matches_the_training_forward():
    draft_model = steer_model()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, STEER_V, (3, 11), generator=g)
    per_row = 0.3 * torch.randn(3, 2, STEER_H, generator=g)
    per_token = 0.3 * torch.randn(3, 11, 2, STEER_H, generator=g)
    positions = torch.arange(11).expand(3, 11)
    for steer in (per_row, per_token):
        expect = draft_model.forward_train(ids, steer=steer)
        cache = draft_model.new_cache(3, 32)
        got = draft_model.forward(ids, positions, cache, steer=steer)
        torch.testing.assert_close(got, expect, rtol=1e-4, atol=1e-4)
        assert not torch.allclose(expect, draft_model.forward_train(ids), atol=1e-3)
    cache = draft_model.new_cache(3, 32)
    plain = draft_model.forward(ids, positions, cache)
    cache = draft_model.new_cache(3, 32)
    zero = draft_model.forward(ids, positions, cache, steer=torch.zeros(3, 2, STEER_H))
    assert torch.equal(plain, zero)


def test_steer_shapes_the_cached_keys_of_later_layers():
    """A steered token's K/V in layer 2 differ, so a later unsteered token sees the steering."""
    draft_model = steer_model()
    ids = torch.tensor([[5, 9, 13, 2]])
    positions = torch.arange(4).unsqueeze(0)
    steer = torch.zeros(1, 4, 2, STEER_H)
    steer[0, 1, 0] = 0.5  # token 1, after layer 1: the input of layer 2
    expect = draft_model.forward_train(ids, steer=steer)
    cache = draft_model.new_cache(1, 8)
    draft_model.forward(ids[:, :2], positions[:, :2], cache, steer=steer[:, :2])
    tail = draft_model.forward(ids[:, 2:], positions[:, 2:], cache)
    torch.testing.assert_close(tail, expect[:, 2:], rtol=1e-4, atol=1e-4)
    assert not torch.allclose(tail, draft_model.forward_train(ids)[:, 2:], atol=1e-3)


def test_steer_with_ragged_rows_and_long_chunked_chains():
    model = steer_model(hidden=32, max_length=1100)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, STEER_V, (2, 1030), generator=g)
    steer = 0.2 * torch.randn(2, 1030, 2, 32, generator=g)
    positions = torch.arange(1030).expand(2, 1030)
    expect = model.forward_train(ids, steer=steer)
    cache = model.new_cache(2, 1100)
    got = model.forward(ids, positions, cache, steer=steer)  # chunks of 1024 and 6
    torch.testing.assert_close(got, expect, rtol=1e-4, atol=1e-4)
    row = steer[:, 0]
    cache = model.new_cache(2, 1100)
    got = model.forward(ids, positions, cache, steer=row)
    torch.testing.assert_close(got, model.forward_train(ids, steer=row), rtol=1e-4, atol=1e-4)
    # Ragged rows: row 1 holds 3 real tokens; its real logits are those of a 3-token pass.
    cache = model.new_cache(2, 16)
    short = ids[:, :5]
    got = model.forward(
        short, positions[:, :5], cache, steer=steer[:, :5], num_nodes=torch.tensor([5, 3])
    )
    torch.testing.assert_close(
        got[1, :3], model.forward_train(short[1:, :3], steer=steer[1:, :3])[0], atol=1e-4, rtol=1e-4
    )
    assert torch.count_nonzero(got[1, 3:]) == 0


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_hf_steer_adds_after_each_decoder_layer_as_our_transformer_does(family):
    theirs = gpt2_model() if family == "gpt2" else hf_model(family)
    model = HFCausalLM(theirs)
    hidden, layers = model.config.hidden_size, model.num_hidden_layers
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, V, (2, 7), generator=g)
    positions = torch.arange(7).expand(2, 7)
    per_row = 0.5 * torch.randn(2, layers, hidden, generator=g)
    per_token = 0.5 * torch.randn(2, 7, layers, hidden, generator=g)
    for steer in (per_row, per_token):
        full = model.forward_train(ids, steer=steer)
        assert not torch.allclose(full, model.forward_train(ids), atol=1e-3)
        # Cached, in two passes: the steered K/V of the first reach the second.
        cache = model.new_cache(2, 16)
        part = steer if steer.dim() == 3 else steer[:, :4]
        head = model.forward(ids[:, :4], positions[:, :4], cache, steer=part)
        part = steer if steer.dim() == 3 else steer[:, 4:]
        tail = model.forward(ids[:, 4:], positions[:, 4:], cache, steer=part)
        torch.testing.assert_close(torch.cat([head, tail], 1), full, **TOL)
        if family != "gpt2":  # our Transformer loads Llama-like checkpoints
            ours = Transformer(ModelConfig.from_hf_config(theirs.config.to_dict()))
            ours.load_state_dict(theirs.state_dict())
            torch.testing.assert_close(ours.forward_train(ids, steer=steer), full, **TOL)
    # The hooks live for one pass only, errors included.
    with pytest.raises(ValueError, match="steer: expected shape"):
        model.forward(ids, positions, model.new_cache(2, 16), steer=per_row[:, :1])
    assert all(not layer._forward_hooks for layer in model._layers)
    torch.testing.assert_close(model.forward_train(ids), hf_logits(theirs, ids), **TOL)
    steered = per_row.clone().requires_grad_(True)
    model.forward_train(ids, steer=steered).sum().backward()
    assert steered.grad is not None and bool(steered.grad.abs().sum() > 0)


def test_hf_steer_needs_the_list_of_decoder_layers(monkeypatch):
    import specdecode.models.hf as hf

    monkeypatch.setattr(hf, "_decoder_layers", lambda model, count: None)  # a model without one
    model = HFCausalLM(hf_model("llama"))
    ids = torch.tensor([[5, 6, 7]])
    steer = torch.zeros(1, model.num_hidden_layers, model.config.hidden_size)
    with pytest.raises(TypeError, match="no list of 2 decoder layers found in LlamaForCausalLM"):
        model.forward(ids, torch.arange(3)[None], model.new_cache(1, 8), steer=steer)
    cache = model.new_cache(1, 8)
    model.forward(ids, torch.arange(3)[None], cache)  # unsteered passes need no list
    assert cache.lengths.tolist() == [3]


def test_steer_rejects_bad_input():
    draft_model = steer_model()
    ids = torch.zeros((2, 3), dtype=torch.int64)
    positions = torch.arange(3).expand(2, 3)
    for steer, match in (
        (torch.zeros(2, 3, STEER_H), "expected shape"),
        (torch.zeros(2, 3, 2, STEER_H + 1), "expected shape"),
        (torch.zeros(2, 2, STEER_H, dtype=torch.int64), "floating"),
        ([[0.0]], "torch.Tensor"),
    ):
        cache = draft_model.new_cache(2, 8)
        with pytest.raises((TypeError, ValueError), match=match):
            draft_model.forward(ids, positions, cache, steer=steer)
        assert cache.lengths.tolist() == [0, 0]  # nothing written
        with pytest.raises((TypeError, ValueError), match=match):
            draft_model.forward_train(ids, steer=steer)


def test_head_logits_are_the_final_norm_and_lm_head():
    """``Transformer.head_logits`` (packed weights, no autograd) equals the modules' product, for
    one row and for several, and checks the width."""
    from reference_engine import tiny_transformer

    model = tiny_transformer(seed=3, layers=1)
    for shape in ((1, 64), (2, 5, 64)):
        x = torch.randn(shape)
        want = model.lm_head(model.model.norm(x))
        torch.testing.assert_close(model.head_logits(x), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"\[\.\.\., 64\]"):
        model.head_logits(torch.randn(2, 63))
