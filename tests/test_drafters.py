"""CachebackDrafter: the drafter protocol, run against a replay oracle and the reference."""

from __future__ import annotations

import os
import sysconfig

import numpy as np
import pytest
from reference_ngram import RefNGramCache
from specdecode.drafters import CachebackDrafter, Drafter, longest_accepted_path
from specdecode.ops import NGramCache, tree_info


def stdlib_bytes(name: str, limit: int) -> list[int]:
    with open(os.path.join(sysconfig.get_paths()["stdlib"], name), "rb") as f:
        return list(f.read()[:limit])


def replay(drafter: CachebackDrafter, streams: list[list[int]], prompt_len: int, ref=None):
    """Drafts, accepts the longest matching path + one bonus token, observes; for all streams."""
    slots = list(range(len(streams)))
    drafter.start(slots, [s[:prompt_len] for s in streams])
    if ref is not None:
        ref.update(
            slots,
            [t for s in streams for t in s[:prompt_len]],
            np.cumsum([0] + [prompt_len] * len(streams)).tolist(),
        )
    pos = [prompt_len] * len(streams)
    steps = [0] * len(streams)
    out = [list(s[:prompt_len]) for s in streams]
    active = [b for b in slots if pos[b] < len(streams[b])]
    while active:
        tree = drafter.propose(active)
        info = tree_info(tree.parents)
        assert info.num_nodes.tolist() == tree.num_nodes.tolist()
        assert int(info.depth.max()) <= drafter.max_depth
        if ref is not None:
            ctx = [out[b][-4:] for b in active]
            tokens, parents, counts = ref.draft(
                active,
                ctx,
                [len(c) for c in ctx],
                drafter.max_nodes,
                drafter.max_depth,
                drafter.chain,
            )
            assert tree.tokens.tolist() == tokens and tree.parents.tolist() == parents
        committed = []
        for i, b in enumerate(active):
            assert int(tree.tokens[i, 0]) == out[b][-1]  # the root is the last committed token
            truth = streams[b][pos[b] :]
            accepted = longest_accepted_path(tree, i, truth)
            step = accepted + truth[len(accepted) : len(accepted) + 1]  # + the bonus token
            committed.append(step)
            out[b] += step
            pos[b] += len(step)
            steps[b] += 1
        drafter.observe(active, committed)
        if ref is not None:
            ref.update(
                active,
                [t for c in committed for t in c],
                np.cumsum([0] + [len(c) for c in committed]).tolist(),
            )
        active = [b for b in active if pos[b] < len(streams[b])]
    return out, steps


def test_replay_oracle_reproduces_text_and_matches_reference():
    streams = [
        stdlib_bytes("collections/__init__.py", 3000),
        stdlib_bytes("json/decoder.py", 2500),
        stdlib_bytes("textwrap.py", 2000),
    ]
    drafter = CachebackDrafter(
        tables=[(1, 2), (2, 3)],
        max_leaders=128,
        max_followers=4,
        max_sequences=3,
        max_nodes=12,
        max_depth=6,
    )
    ref = RefNGramCache(tables=[(1, 2), (2, 3)], max_leaders=128, max_followers=4, max_sequences=3)
    out, steps = replay(drafter, streams, prompt_len=200, ref=ref)
    assert out == streams
    generated = sum(len(s) - 200 for s in streams)
    tokens_per_step = generated / sum(steps)
    # Source code repeats itself; the cache must draft better than nothing (1 token per step).
    assert tokens_per_step > 1.3, tokens_per_step


def test_chain_mode_and_isinstance():
    drafter = CachebackDrafter(
        leader_len=2, follower_len=3, max_sequences=1, chain=True, max_nodes=8, max_depth=7
    )
    assert isinstance(drafter, Drafter)
    stream = stdlib_bytes("json/encoder.py", 1500)
    out, _ = replay(drafter, [stream], prompt_len=64)
    assert out == [stream]
    tree = drafter.propose([0])
    parents = tree.parents[0, : int(tree.num_nodes[0])].tolist()
    assert parents == list(range(-1, len(parents) - 1))  # a chain


def test_drafts_never_enter_the_cache():
    cache = NGramCache(1, 2, touch_on_read=False, max_sequences=2)
    drafter = CachebackDrafter(cache, max_nodes=16, max_depth=6)
    drafter.start([0, 1], [[1, 2, 3, 1, 2, 4, 1], [7, 8, 7, 8]])
    before = [cache.table_state(s) for s in (0, 1)]
    tree = drafter.propose([1, 0])
    assert int(tree.num_nodes[0]) > 1 and int(tree.num_nodes[1]) > 1
    assert [cache.table_state(s) for s in (0, 1)] == before
    drafter.observe([0, 1], [[2], []])
    after = [cache.table_state(s) for s in (0, 1)]
    assert after[1] == before[1] and after[0] != before[0]
    assert cache.tail(0) == [1, 2]


def test_static_cache_covers_cold_start_and_restart_clears_slot():
    corpus = [stdlib_bytes("textwrap.py", 4000)]
    static = NGramCache.build(corpus, 1, 2, max_leaders=4096)
    drafter = CachebackDrafter(leader_len=1, follower_len=2, max_sequences=1, static=static)
    drafter.start([0], [[ord("d")]])
    assert int(drafter.propose([0]).num_nodes[0]) > 1  # drafts from the static table alone
    drafter.release([0])
    plain = CachebackDrafter(leader_len=1, follower_len=2, max_sequences=1)
    plain.start([0], [[1, 2, 3]])
    plain.release([0])
    plain.start([0], [[1]])
    assert plain.cache.table_state(0) == []  # the old sequence's n-grams are gone
    assert int(plain.propose([0]).num_nodes[0]) == 1


def test_protocol_errors():
    drafter = CachebackDrafter(max_sequences=2)
    with pytest.raises(ValueError, match="not open"):
        drafter.propose([0])
    drafter.start([0], [[1, 2]])
    with pytest.raises(ValueError, match="already open"):
        drafter.start([0], [[1]])
    with pytest.raises(ValueError, match="empty"):
        drafter.start([1], [[]])
    with pytest.raises(ValueError, match="appears twice"):
        drafter.observe([0, 0], [[1], [2]])
    with pytest.raises(ValueError, match="expected 1 rows"):
        drafter.observe([0], [[1], [2]])
    with pytest.raises(ValueError, match="slots in"):
        drafter.observe([5], [[1]])
    with pytest.raises(ValueError, match="token ids"):
        drafter.observe([0], [[-3]])
    with pytest.raises(TypeError, match="token ids"):
        drafter.observe([0], [[1.5]])
    with pytest.raises(ValueError, match="frozen"):
        CachebackDrafter(NGramCache.build([[1, 2, 3]]))


# ---- NoDrafter and ModelDrafter -----------------------------------------------------------------


def _tiny(seed: int, vocab: int = 29):
    from reference_engine import tiny_transformer

    return tiny_transformer(seed=seed, vocab_size=vocab, layers=1, max_length=64)


def test_no_drafter_proposes_the_root_alone():
    from specdecode.drafters import NoDrafter

    d = NoDrafter()
    assert isinstance(d, Drafter)
    d.start([0, 1], [[5, 6], [7]])
    tree = d.propose([1, 0])
    assert tree.tokens.tolist() == [[7], [6]] and tree.num_nodes.tolist() == [1, 1]
    d.observe([0, 1], [[8, 9], []])
    assert d.propose([0, 1]).tokens.tolist() == [[9], [7]]
    with pytest.raises(ValueError, match="empty"):
        d.start([2], [[]])
    d.release([0, 1])
    with pytest.raises(ValueError, match="not open"):
        d.propose([0])


def _drafter_of(kind: str):
    from specdecode.drafters import ModelDrafter, NoDrafter

    if kind == "none":
        return NoDrafter(max_sequences=8)
    if kind == "cacheback":
        return CachebackDrafter(max_sequences=8)
    return ModelDrafter(_tiny(2), k=2)


@pytest.mark.parametrize("kind", ["none", "cacheback", "model"])
def test_a_refused_call_changes_no_slot(kind):
    drafter = _drafter_of(kind)
    drafter.start([0, 4], [[1, 2], [3]])  # a model drafter's cache takes rows 0-4 here
    drafter.release([4])
    refused = [
        (([3, 3], [[1], [2]]), ValueError, "appears twice"),
        (([-1], [[1]]), ValueError, "slots in \\[0, "),
        (([2, 1.5], [[1], [2]]), TypeError, "sequence of ints"),
        (([2, 0], [[1], [2]]), ValueError, "slot 0 is already open"),
        (([2, 3], [[1], []]), ValueError, "prompt 1 is empty"),
        (([2, 3], [[1]]), ValueError, "expected 2 rows"),
        (([2, 3], [[1], [-4]]), ValueError, "outside \\[0, 2\\*\\*31\\)"),
    ]
    if kind == "model":  # the only one of the three with a vocabulary (29 ids)
        refused.append((([2, 3], [[1], [29]]), ValueError, "prompt 1 is outside the drafter's"))
    for (slots, prompts), error, match in refused:
        with pytest.raises(error, match=match):
            drafter.start(slots, prompts)
    # The calls on open slots, refused for a slot named twice or one not open (5).
    for call in (
        lambda: drafter.observe([0, 0], [[4], [5]]),
        lambda: drafter.observe([0, 5], [[4], [5]]),
        lambda: drafter.release([0, 0]),
        lambda: drafter.release([0, 5]),
        lambda: drafter.propose([0, 0]),
        lambda: drafter.propose([0, 5]),
    ):
        with pytest.raises(ValueError, match="appears twice|slot 5 is not open"):
            call()
    # Every check ran before the drafter changed anything: slots 2 and 3 (and 3 of the first,
    # twice-named call) are still free, and slot 0 still holds its own sequence, neither
    # observed (its root would be 4 or 5) nor released.
    drafter.start([3, 2], [[5], [6, 7]])
    tree = drafter.propose([0, 2, 3])
    assert tree.tokens[:, 0].tolist() == [2, 7, 5]
    drafter.release([0, 2, 3])


def test_model_drafter_greedy_chain_is_the_draft_models_greedy_continuation():
    import torch
    from reference_engine import greedy_reference
    from specdecode.drafters import ModelDrafter

    model = _tiny(4)
    d = ModelDrafter(model, k=5)
    prompts = [[3, 4, 5], [9], [1, 2, 3, 4, 5, 6]]
    d.start([0, 1, 2], prompts)
    tree = d.propose([0, 1, 2])
    assert not hasattr(tree, "draft_probs")  # temperature 0: argmax drafts
    for b, p in enumerate(prompts):
        assert tree.tokens[b].tolist() == [p[-1]] + greedy_reference(model, p, 5)
    assert tree.parents[0].tolist() == [-1, 0, 1, 2, 3, 4]
    # Commit two drafts and a different token: the cache keeps exactly the matching prefix.
    drafts = tree.tokens[0, 1:].tolist()
    wrong = (drafts[2] + 1) % 29
    d.observe([0, 1, 2], [drafts[:2] + [wrong], [], []])
    assert d._fed[0] == prompts[0] + drafts[:2]
    assert int(d.cache.lengths[0]) == len(d._fed[0])
    # The next chain continues from the committed sequence exactly as a fresh drafter would.
    fresh = ModelDrafter(model, k=5)
    fresh.start([0], [prompts[0] + drafts[:2] + [wrong]])
    torch.testing.assert_close(d.propose([0]).tokens, fresh.propose([0]).tokens)


def test_model_drafter_sampled_chain_records_its_distribution():
    import torch
    from specdecode.drafters import ModelDrafter, SampledDraftTree

    from specdecode import ops

    d = ModelDrafter(_tiny(5), k=3)
    d.start([0, 1], [[1, 2], [3]])
    d.configure([0, 1], temperature=[1.0, 0.7], top_k=[0, 5], top_p=[1.0, 0.9], seed=[1, 2])
    tree = d.propose([0, 1])
    assert isinstance(tree, SampledDraftTree)
    q = tree.draft_probs
    assert q.shape == (2, 4, 29)
    sums = q[:, :3].sum(-1)
    assert bool(((sums - 1).abs() < 1e-5).all()) and bool((q[:, 3] == 0).all())
    for b in range(2):
        for i in range(3):
            assert float(q[b, i, int(tree.tokens[b, i + 1])]) > 0  # drawn from q
    assert int((q[1, 0] > 0).sum()) <= 5  # top-k 5
    # Each row is the draft model's next-token distribution processed as verify processes the
    # target's (ops.sampling_probs), given the tokens drafted before it.
    for b, prompt in enumerate([[1, 2], [3]]):
        seq = prompt + tree.tokens[b, 1:].tolist()
        with torch.no_grad():
            logits = d.model.forward_train(torch.tensor([seq]))[0]
        rows = logits[len(prompt) - 1 : len(prompt) + 2].float().contiguous()
        want = ops.sampling_probs(rows, [1.0, 0.7][b], [0, 5][b], [1.0, 0.9][b]).probs
        torch.testing.assert_close(q[b, :3], want, rtol=1e-4, atol=1e-5)
    # Same seed and committed state: same draft.
    d2 = ModelDrafter(_tiny(5), k=3)
    d2.start([0, 1], [[1, 2], [3]])
    d2.configure([0, 1], temperature=[1.0, 0.7], top_k=[0, 5], top_p=[1.0, 0.9], seed=[1, 2])
    assert d2.propose([0, 1]).tokens.tolist() == tree.tokens.tolist()


class _NaNRows:
    """A draft model whose logits are NaN in the cache rows ``rows`` (a broken or overflowing
    draft distribution for those sequences)."""

    def __init__(self, model, rows):
        self.model, self.rows = model, list(rows)

    def __getattr__(self, name):
        return getattr(self.model, name)

    def forward(self, input_ids, positions, cache, tree_mask=None, output_hidden=None):
        logits = self.model.forward(input_ids, positions, cache, tree_mask, output_hidden)
        logits[self.rows] = float("nan")
        return logits


def test_model_drafter_ends_a_sampled_chain_at_a_bad_draft_distribution():
    """A row whose processed draft distribution is bad draws no token: its chain is the root
    alone, the other rows draft as usual, and generation samples as plain decoding does (before,
    the -1 of the failed draw was fed to the draft model, which raised)."""
    from specdecode.drafters import ModelDrafter, NoDrafter

    from specdecode import generate

    model = _tiny(5)
    d = ModelDrafter(_NaNRows(model, [1]), k=3)
    d.start([0, 1], [[1, 2], [3]])
    d.configure([0, 1], temperature=[1.0, 1.0], top_k=[0, 0], top_p=[1.0, 1.0], seed=[1, 2])
    tree = d.propose([0, 1])
    assert tree.num_nodes.tolist() == [4, 1]
    assert tree.tokens[1].tolist() == [3, -1, -1, -1]
    assert min(tree.tokens[0].tolist()) >= 0
    d.observe([0, 1], [[tree.tokens[0, 1].item()], [4]])
    assert d.propose([0, 1]).num_nodes.tolist() == [4, 1]

    target = _tiny(4)
    prompts = [[1, 2, 3], [9]]
    kwargs = dict(max_new_tokens=6, temperature=1.0, seed=[5, 6])
    broken = ModelDrafter(_NaNRows(_tiny(6), [0, 1]), k=3)
    out = generate(target, prompts, drafter=broken, **kwargs)
    assert out.sequences == generate(target, prompts, drafter=NoDrafter(), **kwargs).sequences
    assert out.stats.accepted_tokens == 0


def test_model_drafter_tree_is_a_valid_budgeted_tree_holding_the_greedy_path():
    from reference_engine import greedy_reference
    from specdecode.drafters import ModelDrafter

    model = _tiny(6)
    d = ModelDrafter(model, mode="tree", k=4, branch=3, beam=3, max_nodes=12)
    prompts = [[1, 2, 3], [7, 7]]
    d.start([0, 1], prompts)
    tree = d.propose([0, 1])
    info = tree_info(tree.parents)
    assert info.num_nodes.tolist() == tree.num_nodes.tolist() == [12, 12]
    assert int(info.depth.max()) <= 4
    for b, p in enumerate(prompts):
        # The draft model's greedy continuation is the top-1 path, so it is in the tree.
        greedy = greedy_reference(model, p, 2)
        kids = [i for i in range(12) if int(tree.parents[b, i]) == 0]
        first = [i for i in kids if int(tree.tokens[b, i]) == greedy[0]]
        assert first
        assert any(
            int(tree.parents[b, i]) == first[0] and int(tree.tokens[b, i]) == greedy[1]
            for i in range(12)
        )
    assert d._fed[0] == prompts[0][:-1]  # drafting left only committed tokens in the cache
    assert int(d.cache.lengths[0]) == 2


class _NumNodesRecorder:
    """A Transformer whose forward records the num_nodes it is given (None when not given)."""

    def __init__(self, model):
        self.model = model
        self.seen = []

    def __getattr__(self, name):
        return getattr(self.model, name)

    def forward(
        self, input_ids, positions, cache, tree_mask=None, output_hidden=None, *, num_nodes=None
    ):
        self.seen.append(
            (tuple(input_ids.shape), None if num_nodes is None else num_nodes.tolist())
        )
        return self.model.forward(
            input_ids, positions, cache, tree_mask, output_hidden, num_nodes=num_nodes
        )


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_model_drafter_passes_only_fed_rows_as_real_tokens(mode):
    # Rows a pass does not feed (sequences another drafter serves this step, finished ones) and
    # the tails of shorter rows are padding: a model that takes num_nodes is told so, and the
    # drafts are those of a drafter that feeds the rows alone.
    from specdecode.drafters import ModelDrafter

    model = _tiny(7)
    options = {"k": 3} if mode == "chain" else {"k": 3, "branch": 2, "beam": 2, "max_nodes": 8}
    recorder = _NumNodesRecorder(model)
    d = ModelDrafter(recorder, mode=mode, **options)
    prompts = [[3, 4, 5], [9, 1], [1, 2, 3, 4, 5, 6]]
    d.start([0, 1, 2], prompts)
    recorder.seen.clear()
    tree = d.propose([2, 0])  # row 1 is not drafted
    assert recorder.seen
    for shape, real in recorder.seen:
        assert real is not None and len(real) == 3 and real[1] == 0
        assert 1 <= real[0] <= shape[1] and 1 <= real[2] <= shape[1]
    # The catch-up pass feeds each row's tokens missing from its cache: 3 and 6 of them here.
    assert recorder.seen[0][1] == [3, 0, 6]
    alone = ModelDrafter(model, mode=mode, **options)
    alone.start([0, 2], [prompts[0], prompts[2]])
    expected = alone.propose([2, 0])
    assert tree.tokens.tolist() == expected.tokens.tolist()
    assert tree.parents.tolist() == expected.parents.tolist()


def _top_probs(model, prompt, drafted):
    """The draft model's largest next-token probability before each drafted token (softmax of
    its raw logits over the prompt and the tokens drafted before it) -> ``[len(drafted)]``."""
    import torch

    seq = prompt + drafted
    with torch.no_grad():
        logits = model.forward_train(torch.tensor([seq]))[0].float()
    rows = logits[len(prompt) - 1 : len(prompt) - 1 + len(drafted)]
    return torch.softmax(rows, dim=-1).amax(dim=-1)


def _floor_between(values):
    """A floor strictly between the two middle values (no value lies on it)."""
    ordered = sorted(values)
    mid = len(ordered) // 2
    return (ordered[mid - 1] + ordered[mid]) / 2


def _ends(tops, floor):
    """Chain length under stop_below=floor: the index of the first top probability below it."""
    return next((i for i, p in enumerate(tops) if p < floor), len(tops))


@pytest.mark.parametrize("sample", [False, True])
def test_model_drafter_stop_below_ends_chains_where_the_draft_model_is_unsure(sample):
    """Each chain is the full chain cut before the first node whose raw next-token distribution
    has its largest probability below stop_below (the draws themselves unchanged: the rule reads
    no draw); at least one chain ends early and one keeps a token."""
    from specdecode.drafters import ModelDrafter

    model = _tiny(4)
    prompts = [[3, 4, 5], [9], [1, 2, 3, 4, 5, 6], [7, 7], [2, 8, 1]]
    slots = list(range(len(prompts)))

    def drafter(**extra):
        d = ModelDrafter(model, k=5, **extra)
        d.start(slots, prompts)
        if sample:
            n = len(slots)
            d.configure(slots, temperature=[1.0] * n, top_k=[0] * n, top_p=[1.0] * n, seed=slots)
        return d

    full = drafter().propose(slots)
    tops = [
        _top_probs(model, p, full.tokens[b, 1:].tolist()).tolist() for b, p in enumerate(prompts)
    ]
    floor = _floor_between([p for row in tops for p in row])
    ends = [_ends(row, floor) for row in tops]
    assert min(ends) < 5 and max(ends) > 0, (ends, tops)
    cut = drafter(stop_below=floor).propose(slots)
    assert cut.num_nodes.tolist() == [e + 1 for e in ends]
    for b, e in enumerate(ends):
        assert cut.tokens[b, : e + 1].tolist() == full.tokens[b, : e + 1].tolist()
        assert set(cut.tokens[b, e + 1 :].tolist()) <= {-1}
        if sample:
            assert bool((cut.draft_probs[b, :e] == full.draft_probs[b, :e]).all())


def test_model_drafter_stop_below_feeds_only_the_chains_still_going():
    """After the catch-up pass, the pass at depth j feeds node j of the chains that drafted it
    (their confidence at node j + 1 is still to be read) and nothing (padding, for a model that
    takes num_nodes) to the chains that ended before it; no pass once all have ended."""
    from specdecode.drafters import ModelDrafter

    model = _tiny(4)
    prompts = [[3, 4, 5], [9], [1, 2, 3, 4, 5, 6], [7, 7], [2, 8, 1]]
    slots = list(range(len(prompts)))
    full = ModelDrafter(model, k=5)
    full.start(slots, prompts)
    drafted = full.propose(slots)
    tops = [
        _top_probs(model, p, drafted.tokens[b, 1:].tolist()).tolist() for b, p in enumerate(prompts)
    ]
    floor = _floor_between([p for row in tops for p in row])
    ends = [_ends(row, floor) for row in tops]
    recorder = _NumNodesRecorder(model)
    d = ModelDrafter(recorder, k=5, stop_below=floor)
    d.start(slots, prompts)
    recorder.seen.clear()
    assert d.propose(slots).num_nodes.tolist() == [e + 1 for e in ends]
    passes = [real for _, real in recorder.seen[1:]]  # after the catch-up
    assert len(passes) == max(0, min(max(ends), 4))
    for depth, real in enumerate(passes, start=1):
        assert real == [int(e >= depth) for e in ends], (depth, real, ends)


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_model_drafter_stop_below_one_drafts_nothing_after_the_catch_up(mode):
    """No softmax is one-hot here, so a floor of 1 ends every draft at the root, after the one
    pass that feeds the committed tokens."""
    from specdecode.drafters import ModelDrafter

    recorder = _NumNodesRecorder(_tiny(7))
    options = {"k": 4} if mode == "chain" else {"k": 4, "branch": 2, "beam": 2, "max_nodes": 8}
    d = ModelDrafter(recorder, mode=mode, stop_below=1.0, **options)
    d.start([0, 1], [[3, 4, 5], [9, 1]])
    recorder.seen.clear()
    tree = d.propose([0, 1])
    assert tree.num_nodes.tolist() == [1, 1]
    assert len(recorder.seen) == 1
    d.observe([0, 1], [[6], [2]])
    assert d.propose([0, 1]).num_nodes.tolist() == [1, 1]


def test_model_drafter_stop_below_keeps_confident_tree_children_only():
    """Every node of a tree drafted with stop_below has a probability given its parent of at
    least the floor, and the floor prunes: fewer nodes than without it."""
    import torch
    from specdecode.drafters import ModelDrafter

    model = _tiny(6)
    prompts = [[1, 2, 3], [7, 7]]
    options = {"mode": "tree", "k": 4, "branch": 3, "beam": 3, "max_nodes": 12}

    def conditional(b, tree, node):
        path = []
        while node > 0:
            path.append(int(tree.tokens[b, node]))
            node = int(tree.parents[b, node])
        path.reverse()
        seq = prompts[b] + path
        with torch.no_grad():
            logits = model.forward_train(torch.tensor([seq]))[0, len(seq) - 2].float()
        return float(torch.softmax(logits, dim=-1)[path[-1]])

    full = ModelDrafter(model, **options)
    full.start([0, 1], prompts)
    free = full.propose([0, 1])
    probs = [conditional(b, free, i) for b in range(2) for i in range(1, int(free.num_nodes[b]))]
    floor = _floor_between(probs)
    d = ModelDrafter(model, stop_below=floor, **options)
    d.start([0, 1], prompts)
    tree = d.propose([0, 1])
    info = tree_info(tree.parents)
    assert info.num_nodes.tolist() == tree.num_nodes.tolist()
    assert int(tree.num_nodes.sum()) < int(free.num_nodes.sum())
    for b in range(2):
        for i in range(1, int(tree.num_nodes[b])):
            assert conditional(b, tree, i) >= floor - 1e-6


def test_model_drafter_stop_below_decodes_as_the_target():
    """Greedy decoding with a confidence floor gives the target's own greedy tokens, with fewer
    drafted tokens than without the floor."""
    from specdecode.drafters import ModelDrafter, NoDrafter

    from specdecode import generate

    target, draft = _tiny(4), _tiny(5)
    prompts = [[1, 2, 3], [9], [4, 4, 4, 4]]
    plain = generate(target, prompts, drafter=NoDrafter(), max_new_tokens=12)
    free = generate(target, prompts, drafter=ModelDrafter(draft, k=4), max_new_tokens=12)
    floored = generate(
        target, prompts, drafter=ModelDrafter(draft, k=4, stop_below=0.3), max_new_tokens=12
    )
    assert floored.sequences == free.sequences == plain.sequences
    assert sum(floored.stats.offered_by_position) < sum(free.stats.offered_by_position)


def test_model_drafter_errors():
    from specdecode.drafters import ModelDrafter

    with pytest.raises(TypeError, match="CausalLM"):
        ModelDrafter(object())
    with pytest.raises(ValueError, match="mode"):
        ModelDrafter(_tiny(1), mode="beam")
    with pytest.raises(ValueError, match="k"):
        ModelDrafter(_tiny(1), k=0)
    for bad in (0.0, 1.5, -0.1, float("nan")):
        with pytest.raises(ValueError, match="stop_below"):
            ModelDrafter(_tiny(1), stop_below=bad)
    with pytest.raises(TypeError, match="stop_below"):
        ModelDrafter(_tiny(1), stop_below="0.5")
    d = ModelDrafter(_tiny(1))
    with pytest.raises(ValueError, match="vocabulary"):
        d.start([0], [[1, 29]])
    with pytest.raises(ValueError, match="not open"):
        d.propose([0])


class FixedDrafter:
    """Proposes the trees it is given, one per slot, and records what it is asked and told."""

    def __init__(self, trees: dict, vocab_size=None, probs: dict | None = None) -> None:
        self.trees, self.probs = trees, probs
        if vocab_size is not None:
            self.vocab_size = vocab_size
        self.asked: list[list[int]] = []
        self.events: list[tuple] = []

    def start(self, slots, prompts):
        self.events.append(("start", list(slots)))

    def observe(self, slots, committed):
        self.events.append(("observe", list(slots), [list(c) for c in committed]))

    def release(self, slots):
        self.events.append(("release", list(slots)))

    def propose(self, slots):
        import torch
        from specdecode.drafters import SampledDraftTree
        from specdecode.ops import DraftTree

        self.asked.append(list(slots))
        width = max(len(self.trees[s][0]) for s in slots)
        tokens = torch.full((len(slots), width), -1, dtype=torch.int32)
        parents = torch.full((len(slots), width), -1, dtype=torch.int32)
        for b, s in enumerate(slots):
            tok, par = self.trees[s]
            tokens[b, : len(tok)] = torch.tensor(tok, dtype=torch.int32)
            parents[b, : len(par)] = torch.tensor(par, dtype=torch.int32)
        num = torch.tensor([len(self.trees[s][0]) for s in slots], dtype=torch.int32)
        if self.probs is None:
            return DraftTree(tokens, parents, num)
        probs = torch.zeros((len(slots), width, self.vocab_size))
        for b, s in enumerate(slots):
            probs[b, : len(self.probs[s])] = torch.tensor(self.probs[s])
        return SampledDraftTree(tokens, parents, num, probs)


def test_combined_drafter_asks_the_fallback_only_where_the_primary_has_too_little():
    from specdecode.drafters import CombinedDrafter

    primary = FixedDrafter(
        {
            0: ([5, 6, 7], [-1, 0, 1]),  # two drafts
            1: ([5], [-1]),  # none
            2: ([5, 8], [-1, 0]),  # one
            3: ([5], [-1]),  # none, and the fallback has none either
        }
    )
    fallback = FixedDrafter(
        {1: ([5, 1, 2, 3], [-1, 0, 1, 2]), 2: ([5, 4, 4], [-1, 0, 1]), 3: ([5], [-1])}
    )
    d = CombinedDrafter(primary, fallback, min_drafts=2)
    d.start([0, 1, 2, 3], [[5]] * 4)
    tree = d.propose([0, 1, 2, 3])
    assert fallback.asked == [[1, 2, 3]]
    assert not hasattr(tree, "draft_probs")
    assert tree.num_nodes.tolist() == [3, 4, 3, 1]
    assert tree.tokens.tolist() == [
        [5, 6, 7, -1],
        [5, 1, 2, 3],
        [5, 4, 4, -1],
        [5, -1, -1, -1],
    ]
    assert tree.parents[:, :3].tolist() == [[-1, 0, 1], [-1, 0, 1], [-1, 0, 1], [-1, -1, -1]]
    assert d.counts == {"primary": 2, "fallback": 2}
    # Every row has enough: the fallback is not asked.
    d.propose([0])
    assert fallback.asked == [[1, 2, 3]] and d.counts == {"primary": 3, "fallback": 2}
    d.observe([0, 1], [[6], [1, 2]])
    d.release([0, 1, 2, 3])
    for part in (primary, fallback):
        assert part.events == [
            ("start", [0, 1, 2, 3]),
            ("observe", [0, 1], [[6], [1, 2]]),
            ("release", [0, 1, 2, 3]),
        ]


@pytest.mark.parametrize("mixed_steps", ["path", "tree"])
def test_combined_drafter_flags_primary_rows_deterministic_beside_sampled_ones(mixed_steps):
    import torch
    from specdecode.drafters import CombinedDrafter, SampledDraftTree

    v = 10
    # Slot 0: a deterministic tree with two children of the root and a grandchild under the
    # second; slot 1: nothing from the primary, a sampled chain from the fallback.
    primary = FixedDrafter({0: ([5, 3, 4, 9, 2], [-1, 0, 0, 2, 1]), 1: ([5], [-1])})
    q = [[0.5] * 2 + [0.0] * 8, [0.1] * 10, [0.0] * 10]
    fallback = FixedDrafter({1: ([5, 0, 7], [-1, 0, 1])}, vocab_size=v, probs={1: q})
    d = CombinedDrafter(primary, fallback, mixed_steps=mixed_steps)
    assert d.vocab_size == v
    d.configure([0, 1], temperature=[0.8, 0.8])
    tree = d.propose([0, 1])
    assert isinstance(tree, SampledDraftTree)
    # Row 0 is flagged deterministic (its draft rows are not read: zeros) and keeps its whole
    # tree, or its first root path 5 -> 3 -> 2 (then no column wider than the rows need).
    assert tree.draft_deterministic.dtype == torch.bool
    assert tree.draft_deterministic.tolist() == [True, False]
    width = 5 if mixed_steps == "tree" else 3
    assert tree.tokens.shape == (2, width) and tree.draft_probs.shape == (2, width, v)
    if mixed_steps == "tree":
        assert tree.num_nodes.tolist() == [5, 3]
        assert tree.tokens[0].tolist() == [5, 3, 4, 9, 2]
        assert tree.parents[0].tolist() == [-1, 0, 0, 2, 1]
    else:
        assert tree.num_nodes.tolist() == [3, 3]
        assert tree.tokens[0].tolist() == [5, 3, 2]
        assert tree.parents[0].tolist() == [-1, 0, 1]
    assert not bool(tree.draft_probs[0].any())
    assert torch.equal(tree.draft_probs[1, :3], torch.tensor(q))
    assert not bool(tree.draft_probs[1, 3:].any())
    assert tree.tokens[1, :3].tolist() == [5, 0, 7]
    assert tree.tokens[1, 3:].tolist() == [-1] * (width - 3)
    # The rule looks at the row's own sequence: a sampling row alone is cut as beside the
    # fallback's rows (its drafts do not depend on the batch), a greedy row keeps its tree.
    alone = d.propose([0])
    assert alone.num_nodes.tolist() == ([5] if mixed_steps == "tree" else [3])
    assert (
        alone.tokens[0].tolist()[: int(alone.num_nodes[0])]
        == tree.tokens[0].tolist()[: int(tree.num_nodes[0])]
    )
    d.configure([0], temperature=[0.0])
    greedy = d.propose([0, 1])
    assert greedy.num_nodes.tolist() == [5, 3]
    assert greedy.tokens[0].tolist() == [5, 3, 4, 9, 2]


def test_combined_drafter_errors():
    from specdecode.drafters import CombinedDrafter

    a = FixedDrafter({0: ([1], [-1])}, vocab_size=10)
    b = FixedDrafter({0: ([1], [-1])}, vocab_size=12)
    with pytest.raises(TypeError, match="fallback: expected a Drafter"):
        CombinedDrafter(a, object())
    with pytest.raises(ValueError, match="two different drafters"):
        CombinedDrafter(a, a)
    with pytest.raises(ValueError, match="share one vocabulary"):
        CombinedDrafter(a, b)
    with pytest.raises(ValueError, match="mixed_steps: expected 'path' or 'tree'"):
        CombinedDrafter(a, FixedDrafter({0: ([1], [-1])}), mixed_steps="chain")
    with pytest.raises(ValueError, match="min_drafts"):
        CombinedDrafter(a, FixedDrafter({}), min_drafts=0)
    with pytest.raises(TypeError, match="min_drafts"):
        CombinedDrafter(a, FixedDrafter({}), min_drafts=1.5)

    class FailingStart(FixedDrafter):
        def start(self, slots, prompts):
            raise ValueError("no room")

    d = CombinedDrafter(a, FailingStart({}))
    with pytest.raises(ValueError, match="no room"):
        d.start([0], [[1]])
    # The primary's slot was closed again: nothing is left open by a failed start.
    assert a.events == [("start", [0]), ("release", [0])]


def test_combined_cacheback_and_model_drafter_greedy_equals_the_target():
    from reference_engine import greedy_reference
    from specdecode.drafters import CombinedDrafter, ModelDrafter
    from specdecode.engine import generate

    target, draft = _tiny(7), _tiny(8)
    prompts = [[1, 2, 3, 1, 2, 3, 1, 2], [4, 5], [6, 6, 6, 6, 6], [7, 8, 9]]
    d = CombinedDrafter(CachebackDrafter(max_sequences=4), ModelDrafter(draft, k=3))
    out = generate(target, prompts, drafter=d, max_new_tokens=12, temperature=0.0)
    assert out.sequences == [greedy_reference(target, p, 12) for p in prompts]
    assert d.counts["primary"] > 0 and d.counts["fallback"] > 0, d.counts


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_combined_drafter_near_the_draft_context_end_equals_the_target(mode):
    """Every cache row of the fallback takes part in its passes, padded to their width: rows
    the primary drafts for sit out holding many tokens, a short row catches up on several at
    once. Near the end of the draft model's context such a pass overflowed its cache ("max_length
    exceeded"); the fallback now drafts only as deep as every row has room for."""
    from reference_engine import greedy_reference, tiny_transformer
    from specdecode.drafters import CombinedDrafter, ModelDrafter
    from specdecode.engine import generate

    target = tiny_transformer(seed=1, max_length=64)
    draft = tiny_transformer(seed=2, layers=1, max_length=64)
    prompts = [[14, 51, 19], [16, 34], [52, 46]]
    fallback = ModelDrafter(draft, mode=mode, k=3 if mode == "tree" else 4)
    d = CombinedDrafter(CachebackDrafter(max_sequences=8), fallback)
    out = generate(target, prompts, drafter=d, max_new_tokens=61, max_nodes=64)
    assert out.sequences == [greedy_reference(target, p, 61) for p in prompts]
    assert d.counts["primary"] > 0 and d.counts["fallback"] > 0, d.counts


def test_model_drafter_tree_with_a_wide_beam_drafts_near_the_context_end():
    """A beam wider than the room left drafts as deep as the frontiers fit (a frontier at depth j
    holds at most min(beam, branch ** j) nodes): with beam 1024 and 24 positions left the tree
    still reaches depth 3 (2 + 4 + 8 nodes); sized by the beam alone it never drafted."""
    from reference_engine import greedy_reference, tiny_transformer
    from specdecode.drafters import ModelDrafter
    from specdecode.engine import generate

    target = tiny_transformer(seed=1, max_length=64)
    draft = tiny_transformer(seed=2, layers=1, max_length=64)
    prompt = [int(x) for x in np.random.default_rng(0).integers(0, 60, 40)]
    d = ModelDrafter(draft, mode="tree", k=3, branch=2, beam=1024, max_nodes=16)
    d.start([0], [prompt])
    tree = d.propose([0])
    assert int(tree.num_nodes[0]) == 15 and int(tree_info(tree.parents).depth.max()) == 3
    d.release([0])
    out = generate(target, [prompt], drafter=d, max_new_tokens=23, max_nodes=16)
    assert out.sequences == [greedy_reference(target, prompt, 23)]


class _CountingCache:
    """A KV cache stand-in that holds lengths only and, as KVCache, refuses a pass that would
    take any row past ``max_length``."""

    def __init__(self, batch_size: int, max_length: int) -> None:
        import torch

        self.batch_size, self.max_length = batch_size, max_length
        self.lengths = torch.zeros(batch_size, dtype=torch.int64)

    def truncate(self, lengths) -> None:
        import torch

        new = torch.as_tensor(lengths, dtype=torch.int64)
        assert bool((new >= 0).all()) and bool((new <= self.lengths).all())
        self.lengths = new.clone()


class _CountingLM:
    """A CausalLM stand-in that counts its forward passes (one per draft depth) and returns
    fixed random logits; a pass that does not fit its cache or positions is an error."""

    def __init__(self, vocab_size: int = 5, max_length: int = 4096) -> None:
        import torch

        self.vocab_size, self.max_length = vocab_size, max_length
        self.device = torch.device("cpu")
        self.table = torch.randn(vocab_size, vocab_size, generator=torch.Generator().manual_seed(0))
        self.passes = 0

    def new_cache(self, batch_size: int, max_length: int) -> _CountingCache:
        return _CountingCache(batch_size, max_length)

    def forward(self, input_ids, positions, cache, tree_mask=None):
        width = input_ids.shape[1]
        if int(cache.lengths.max()) + width > cache.max_length:
            raise ValueError("the pass does not fit the cache")
        if int(positions.max()) >= cache.max_length:
            raise ValueError("a position is past the cache")
        self.passes += 1
        cache.lengths = cache.lengths + width
        return self.table[input_ids]


def _room_by_definition(k, beam, branch, tree, max_length, longest, held, pending):
    """The draft depth that fits, spelled out: the largest d <= k whose nodes (one per depth for
    a chain, min(beam, branch ** j) at depth j for a tree) fit on the longest committed
    sequence; 0 when the catch-up does not fit; a tree pass at depth d (fed on the longest held
    row, the root re-fed) must fit with the frontiers of depths 1 .. d - 1."""

    def nodes(d):
        return sum(min(beam, branch**j) if tree else 1 for j in range(1, d + 1))

    depth = max(d for d in range(k + 1) if d == 0 or longest + nodes(d) <= max_length)
    if held + pending > max_length:
        return 0
    if tree:
        base = max(held, longest - 1)
        depth = max(
            [d for d in range(1, depth + 1) if d == 1 or base + 1 + nodes(d - 1) <= max_length],
            default=0,
        )
    return depth


def test_model_drafter_drafts_as_deep_as_the_room_definition_allows():
    """Chains and trees over many depths, beams, branches, context limits and slot mixes: each
    draft runs exactly as many forward passes (one per depth) as the room definition allows,
    and no pass overflows the cache."""
    from specdecode.drafters import ModelDrafter

    rng = np.random.default_rng(0)
    cases = [("chain", 1023, 1, 1, 1100), ("tree", 300, 1, 1, 400), ("tree", 40, 1024, 64, 900)]
    for _ in range(60):
        cases.append(
            (
                str(rng.choice(["chain", "tree"])),
                int(rng.integers(1, 9)),
                int(rng.integers(1, 6)),
                int(rng.integers(1, 4)),
                int(rng.integers(2, 40)),
            )
        )
    checked = set()
    for mode, k, beam, branch, max_length in cases:
        model = _CountingLM()
        d = ModelDrafter(
            model,
            mode=mode,
            k=k,
            beam=beam,
            branch=branch,
            max_nodes=8,
            sample=False,
            max_length=max_length,
        )
        slots = list(range(int(rng.integers(1, 4))))
        seqs = {s: [1] * int(rng.integers(1, max_length + 3)) for s in slots}
        d.start(slots, [seqs[s] for s in slots])
        for _ in range(3):
            ask = sorted(
                int(s)
                for s in rng.choice(slots, int(rng.integers(1, len(slots) + 1)), replace=False)
            )
            held = int(d.cache.lengths.max())
            pending = max(len(seqs[s]) - int(d.cache.lengths[s]) for s in ask)
            longest = max(len(seqs[s]) for s in ask)
            want = _room_by_definition(
                k, beam, branch, mode == "tree", max_length, longest, held, pending
            )
            before = model.passes
            tree = d.propose(ask)
            assert model.passes - before == want, (mode, k, beam, branch, max_length)
            if mode == "chain":
                assert tree.tokens.shape[1] == want + 1
            checked.add((mode, want > 0))
            # A chain commits a prefix of its draft (whose K/V the cache keeps) and one token
            # more; a tree (whose drafts never stay in the cache) one to three tokens.
            committed = []
            for i in range(len(ask)):
                draft = [int(t) for t in tree.tokens[i, 1 : int(tree.num_nodes[i])]]
                if mode == "tree":
                    draft = [int(t) for t in rng.integers(0, 5, 2)]
                cut = int(rng.integers(0, len(draft) + 1))
                committed.append(draft[:cut] + [int(rng.integers(0, 5))])
            d.observe(ask, committed)
            for s, c in zip(ask, committed):
                seqs[s] += c
    assert checked == {("chain", False), ("chain", True), ("tree", False), ("tree", True)}


def test_model_drafter_room_is_linear_in_the_depth():
    """The room of a k = 1023 draft is a running sum over the depths, not a sum per depth: the
    interpreter runs O(k) lines for it (a quadratic count ran about 1.5 million)."""
    import sys

    from specdecode.drafters import ModelDrafter

    for mode in ("chain", "tree"):
        d = ModelDrafter(_CountingLM(), mode=mode, k=1023, beam=1, branch=2, max_length=2048)
        d.start([0], [[1]])
        lines = 0

        def trace(frame, event, arg):
            nonlocal lines
            lines += event == "line"
            return trace

        previous = sys.gettrace()
        sys.settrace(trace)
        try:
            room = d._room([0], tree=mode == "tree")
        finally:
            sys.settrace(previous)
        assert room == 1023
        assert lines < 20 * 1023, (mode, lines)


def test_cacheback_slots_outside_the_range_are_refused_not_wrapped():
    """Slots are checked before the int32 cast, which would wrap 2**32 + s onto slot s."""
    d = CachebackDrafter(max_sequences=4)
    for bad in (2**32, 2**32 + 1, -(2**32) + 2, 4, -1):
        with pytest.raises(ValueError, match="slots in"):
            d.start([bad], [[1, 2, 3]])
    d.start([0], [[1, 2, 3, 1, 2]])
    with pytest.raises(ValueError, match="slots in"):
        d.propose([2**32])
    with pytest.raises(ValueError, match="slots in"):
        d.observe([2**32], [[3]])


def test_an_empty_batch_drafts_nothing():
    """propose([]) and draft() of no rows, with numpy's zero-size strides (leaders of 2)."""
    d = CachebackDrafter(leader_len=2, max_sequences=4)
    tree = d.propose([])
    assert tree.tokens.shape[0] == 0 and tree.num_nodes.shape == (0,)
    cache = NGramCache(leader_len=2, max_sequences=4)
    cache.update([], [], [0])
    cache.draft([], np.zeros((0, 3), np.int32), np.zeros(0, np.int32), 8, 4)
    with pytest.raises(ValueError, match="at least one column"):
        cache.draft([0], np.zeros((1, 0), np.int32), [1], 8, 4)


def test_a_static_cache_attached_too_late_is_an_error_not_a_silent_miss():
    """The drafter keeps as many tokens per slot as the longest leader it was built with; a
    static cache with longer leaders attached afterwards could never match."""
    static = NGramCache.build([[1, 2, 3, 4, 5, 6] * 20], 3, 2, max_leaders=64)
    late = CachebackDrafter(cache=NGramCache(1, 2, max_sequences=2))
    late.start([0], [[9, 1, 2, 3]])
    late.cache.static = static
    with pytest.raises(ValueError, match="attach the static cache before"):
        late.propose([0])
    early = CachebackDrafter(cache=NGramCache(1, 2, max_sequences=2, static=static))
    early.start([0], [[9, 1, 2, 3]])
    assert early.propose([0]).tokens[0, :3].tolist() == [3, 4, 5]


def test_a_frozen_cache_takes_no_static():
    static = NGramCache.build([[1, 2, 3] * 10], 1, 2, max_leaders=8)
    frozen = NGramCache.build([[4, 5, 6] * 10], 1, 2, max_leaders=8)
    with pytest.raises(ValueError, match="frozen"):
        frozen.static = static
    again = NGramCache.from_bytes(frozen.to_bytes(), static=static)  # loading may attach one
    assert again.frozen and again.static is static


def test_cacheback_limits_are_ints():
    with pytest.raises(TypeError, match="max_nodes"):
        CachebackDrafter(max_sequences=2, max_nodes=2.9)
    d = CachebackDrafter(max_sequences=2, max_depth=2**31)  # any depth limit >= 0
    d.start([0], [[1, 2, 1]])
    assert int(d.propose([0]).num_nodes[0]) >= 2
