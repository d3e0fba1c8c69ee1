"""The native n-gram cache against the OrderedDict reference, and its error handling."""

from __future__ import annotations

import os
import sysconfig
import threading

import numpy as np
import pytest
import torch
from conftest import requires_cuda
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reference_ngram import RefNGramCache
from specdecode.ops import DraftTree, NGramCache, tree_info

import specdecode

I32 = torch.int32


def t32(x) -> torch.Tensor:
    return torch.tensor(x, dtype=I32)


def ragged(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    flat = [t for r in rows for t in r]
    offsets = np.cumsum([0] + [len(r) for r in rows]).tolist()
    return t32(flat), t32(offsets)


def padded(contexts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(c) for c in contexts)
    out = torch.full((len(contexts), width), 7777, dtype=I32)  # junk past the length
    for b, c in enumerate(contexts):
        out[b, : len(c)] = t32(c)
    return out, t32([len(c) for c in contexts])


def assert_same_state(native: NGramCache, ref: RefNGramCache, slots) -> None:
    for slot in slots:
        for k in range(len(ref.specs)):
            assert native.table_state(slot, k) == ref.table_state(slot, k), (slot, k)
        assert native.tail(slot) == ref.tails[slot][-ref.tail_cap :], slot


def assert_same_draft(tree: DraftTree, ref_out) -> None:
    tokens, parents, counts = ref_out
    assert tree.num_nodes.tolist() == counts
    assert tree.tokens.tolist() == tokens
    assert tree.parents.tolist() == parents


def real_tokens(limit: int = 4000) -> list[int]:
    """A real token stream: the bytes of a standard-library source file."""
    path = os.path.join(sysconfig.get_paths()["stdlib"], "collections", "__init__.py")
    with open(path, "rb") as f:
        return list(f.read()[:limit])


# ---------------------------------------------------------------------------------------------
# Hand-checked behaviour


def test_two_level_lru_eviction_order():
    cache = NGramCache(1, 1, max_leaders=2, max_followers=2, max_sequences=1)
    # Stream 1 2 1 3 1 4: leader 1 gets followers 2, 3, 4 (2 evicted); leaders 2 and 3 come and go.
    cache.update(t32([0]), t32([1, 2, 1, 3, 1, 4]), t32([0, 6]))
    # Windows (stamp = position of their last token): (1,2)@2 (2,1)@3 (1,3)@4 (3,1)@5 (1,4)@6;
    # with 2 leaders, leader 2 was evicted by 3, and follower 2 of leader 1 by follower 4.
    assert cache.table_state(0) == [((3,), [((1,), 5)]), ((1,), [((4,), 6), ((3,), 4)])]
    # A hit on an existing follower moves it first; a new leader evicts the LRU leader (3).
    cache.update(t32([0]), t32([3, 9]), t32([0, 2]))
    # New windows: (4,3) evicts leader 3 (LRU), then (3,9) evicts leader 1.
    assert cache.table_state(0) == [((4,), [((3,), 7)]), ((3,), [((9,), 8)])]
    assert cache.tail(0) == [9]


def test_touch_on_read_refreshes_leader():
    for touch in (True, False):
        cache = NGramCache(
            1, 1, max_leaders=2, max_followers=2, touch_on_read=touch, max_sequences=1
        )
        cache.update(t32([0]), t32([1, 2, 3]), t32([0, 3]))  # leaders 1 then 2
        cache.draft(t32([0]), t32([[1]]), t32([1]), max_nodes=2, max_depth=1)  # reads leader 1
        cache.update(t32([0]), t32([5]), t32([0, 1]))  # leader 3 evicts the LRU leader
        leaders = [leader for leader, _ in cache.table_state(0)]
        assert leaders == ([(1,), (3,)] if touch else [(2,), (3,)])


def test_window_tail_across_calls_inserts_each_ngram_once():
    one = NGramCache(2, 3, max_sequences=1)
    many = NGramCache(2, 3, max_sequences=1)
    stream = [4, 1, 4, 1, 4, 2, 4, 1, 4, 1, 4, 2, 7]
    one.update(t32([0]), t32(stream), t32([0, len(stream)]))
    for tok in stream:
        many.update(t32([0]), t32([tok]), t32([0, 1]))
    assert one.table_state(0) == many.table_state(0)
    assert one.tail(0) == many.tail(0) == stream[-4:]
    # Empty updates change nothing.
    many.update(t32([0]), t32([]), t32([0, 0]))
    assert one.table_state(0) == many.table_state(0)


def test_draft_tree_shape_and_chain():
    cache = NGramCache(1, 2, max_sequences=2)
    cache.update(t32([0]), t32([5, 6, 7, 5, 6, 8]), t32([0, 6]))
    tree = cache.draft(t32([0, 1]), t32([[1, 5], [2, 3]]), t32([2, 2]), max_nodes=6, max_depth=4)
    # Followers of 5: (6, 8) then (6, 7), sharing the node 6; then 8 has no follower, 7 -> (5, 6).
    assert tree.tokens[0].tolist() == [5, 6, 8, 7, 5, 6]
    assert tree.parents[0].tolist() == [-1, 0, 1, 1, 3, 4]
    assert tree.num_nodes.tolist() == [6, 1]
    assert tree.tokens[1].tolist() == [3, -1, -1, -1, -1, -1]
    info = tree_info(tree.parents)
    assert info.num_nodes.tolist() == tree.num_nodes.tolist()
    chain = cache.draft(t32([0]), t32([[5]]), t32([1]), max_nodes=8, max_depth=8, chain=True)
    assert chain.tokens[0].tolist()[:3] == [5, 6, 8]
    assert chain.num_nodes.tolist() == [3]


def assert_distinct_siblings(tree) -> None:
    """No node has two children with the same token (a second one would waste the budget)."""
    for b, n in enumerate(tree.num_nodes.tolist()):
        pairs = list(zip(tree.parents[b, 1:n].tolist(), tree.tokens[b, 1:n].tolist()))
        assert len(set(pairs)) == len(pairs), (b, pairs)


def test_followers_of_other_lengths_join_existing_children():
    # Table (1, 1) knows 5 -> 6 and 6 -> 7; table (1, 2) knows 5 -> (6, 7). Expanding the root
    # makes 5 -> 6 -> 7 (shared prefix); expanding node 6 then finds its follower 7 already
    # there, made by the root's expansion, and must join it rather than add a second 7.
    cache = NGramCache(tables=[(1, 1), (1, 2)], max_sequences=1)
    cache.update(t32([0]), t32([5, 6, 7]), t32([0, 3]))
    tree = cache.draft(t32([0]), t32([[5]]), t32([1]), max_nodes=8, max_depth=4)
    assert tree.num_nodes.tolist() == [3]
    assert tree.tokens[0, :3].tolist() == [5, 6, 7]
    assert tree.parents[0, :3].tolist() == [-1, 0, 1]
    ref = RefNGramCache(tables=[(1, 1), (1, 2)], max_sequences=1)
    ref.update([0], [5, 6, 7], [0, 3])
    assert_same_draft(tree, ref.draft([0], [[5]], [1], 8, 4))


def test_nbytes_fixed_and_reset():
    cache = NGramCache(2, 2, max_leaders=8, max_followers=2, max_sequences=3)
    before = cache.nbytes
    rng = np.random.default_rng(0)
    for _ in range(20):
        toks = rng.integers(0, 50, size=30).astype(np.int32)
        cache.update(np.array([1], np.int32), toks, np.array([0, 30], np.int32))
    assert cache.nbytes == before > 0
    assert len(cache.table_state(1)) == 8
    cache.reset(t32([1]))
    assert cache.table_state(1) == [] and cache.tail(1) == []


# ---------------------------------------------------------------------------------------------
# Against the reference (hypothesis): random and real streams, several tables, static, shared

configs = st.fixed_dictionaries(
    {
        "tables": st.lists(
            st.tuples(st.integers(1, 3), st.integers(1, 3)), min_size=1, max_size=3, unique=True
        ),
        "max_leaders": st.integers(1, 6),
        "max_followers": st.integers(1, 4),
        "touch_on_read": st.booleans(),
        "shared": st.booleans(),
    }
)


@st.composite
def scripts(draw):
    config = draw(configs)
    vocab = draw(st.integers(2, 8))
    slots = 3
    steps = []
    for _ in range(draw(st.integers(1, 12))):
        kind = draw(st.sampled_from(["update", "update", "draft", "reset"]))
        batch = draw(st.lists(st.integers(0, slots - 1), min_size=1, max_size=slots, unique=True))
        if kind == "update":
            rows = [draw(st.lists(st.integers(0, vocab - 1), max_size=12)) for _ in batch]
            steps.append(("update", batch, rows))
        elif kind == "draft":
            ctxs = [
                draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=6)) for _ in batch
            ]
            steps.append(
                (
                    "draft",
                    batch,
                    ctxs,
                    draw(st.integers(1, 12)),
                    draw(st.integers(0, 5)),
                    draw(st.booleans()),
                )
            )
        else:
            steps.append(("reset", batch))
    return config, steps


def run_script(native, ref, steps, slots=range(3)):
    for step in steps:
        if step[0] == "update":
            _, batch, rows = step
            toks, offs = ragged(rows)
            native.update(t32(batch), toks, offs)
            ref.update(batch, toks.tolist(), offs.tolist())
        elif step[0] == "draft":
            _, batch, ctxs, max_nodes, max_depth, chain = step
            contexts, lens = padded(ctxs)
            tree = native.draft(t32(batch), contexts, lens, max_nodes, max_depth, chain=chain)
            assert_same_draft(
                tree,
                ref.draft(batch, contexts.tolist(), lens.tolist(), max_nodes, max_depth, chain),
            )
            info = tree_info(tree.parents)
            assert info.num_nodes.tolist() == tree.num_nodes.tolist()
            assert int(info.depth.max()) <= max_depth
            assert_distinct_siblings(tree)
        else:
            native.reset(t32(step[1]))
            ref.reset(step[1])
        assert_same_state(native, ref, slots)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scripts())
def test_matches_reference_random(script):
    config, steps = script
    native = NGramCache(max_sequences=3, **config)
    ref = RefNGramCache(max_sequences=3, **config)
    run_script(native, ref, steps, slots=range(3))


@settings(max_examples=40, deadline=None)
@given(configs, st.integers(0, 3000), st.lists(st.integers(1, 200), min_size=1, max_size=8))
def test_matches_reference_real_stream(config, start, chunks):
    """Bytes of a stdlib source file, fed in random chunks, drafting after every chunk."""
    data = real_tokens()[start:]
    native = NGramCache(max_sequences=1, **config)
    ref = RefNGramCache(max_sequences=1, **config)
    pos = 0
    for size in chunks:
        piece = data[pos : pos + size]
        pos = min(pos + size, len(data))
        if not piece:
            break
        run_script(native, ref, [("update", [0], [piece])], slots=[0])
        ctx = data[max(0, pos - 8) : pos]
        run_script(native, ref, [("draft", [0], [ctx], 24, 6, False)], slots=[0])


def test_recency_log_compaction_keeps_exact_lru_order():
    """Few leaders touched many times: the native recency log (4 x max_leaders entries) fills and
    is compacted again and again, both by lookups (touch_on_read) and by inserts, with evictions
    in between; the LRU order, hence every eviction and every draft, must stay the reference's."""
    config = dict(tables=[(1, 1), (2, 1)], max_leaders=3, max_followers=2)
    native = NGramCache(max_sequences=2, **config)
    ref = RefNGramCache(max_sequences=2, **config)
    rng = np.random.default_rng(0)
    inserted = 0
    for step in range(400):
        if step % 3:
            ctxs = [rng.integers(0, 5, size=2).tolist() for _ in range(2)]
            run_script(native, ref, [("draft", [0, 1], ctxs, 8, 3, False)], slots=[0, 1])
        else:
            rows = [rng.integers(0, 5, size=int(rng.integers(0, 6))).tolist() for _ in range(2)]
            inserted += len(rows[0])
            run_script(native, ref, [("update", [0, 1], rows)], slots=[0, 1])
    # Slot 0 alone inserted many times more windows than its tables' logs (32 entries) hold.
    assert inserted > 10 * 32


@pytest.mark.parametrize("chain", [False, True])
def test_batched_replay_matches_reference(chain):
    """A batch large enough for the native prefetch pipelines (rows ahead, victims down the LRU
    list, leaders below the root) and tables small enough that nearly every insert evicts and
    moves records inside their probe runs: drafts and whole table states stay exact."""
    data = real_tokens()
    batch = 24
    config = dict(tables=[(1, 2), (2, 3)], max_leaders=48, max_followers=3)
    native = NGramCache(max_sequences=batch, **config)
    ref = RefNGramCache(max_sequences=batch, **config)
    slots = list(range(batch))
    pos = [300 + 97 * b for b in slots]
    run_script(native, ref, [("update", slots, [data[p - 300 : p] for p in pos])], slots=slots)
    for step in range(12):
        ctxs = [data[p - 8 : p] for p in pos]
        run_script(native, ref, [("draft", slots, ctxs, 16, 8, chain)], slots=slots)
        sizes = [1 + (b + step) % 4 for b in slots]
        rows = [data[p : p + n] for p, n in zip(pos, sizes)]
        run_script(native, ref, [("update", slots, rows)], slots=slots)
        pos = [p + n for p, n in zip(pos, sizes)]


@settings(max_examples=60, deadline=None)
@given(
    configs,
    st.lists(st.lists(st.integers(0, 5), max_size=20), min_size=1, max_size=4),
    st.lists(st.integers(0, 5), max_size=20),
    st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=4), min_size=1, max_size=3),
)
def test_static_table_matches_reference(config, corpus, live, ctxs):
    shared = config.pop("shared")
    static = NGramCache.build(
        corpus,
        tables=config["tables"],
        max_leaders=config["max_leaders"],
        max_followers=config["max_followers"],
    )
    ref_static = RefNGramCache.build(
        corpus,
        tables=config["tables"],
        max_leaders=config["max_leaders"],
        max_followers=config["max_followers"],
    )
    assert static.frozen
    for k in range(len(config["tables"])):
        assert static.table_state(0, k) == ref_static.table_state(0, k)
    frozen_before = [static.table_state(0, k) for k in range(len(config["tables"]))]
    native = NGramCache(max_sequences=3, shared=shared, static=static, **config)
    ref = RefNGramCache(max_sequences=3, shared=shared, static=ref_static, **config)
    batch = list(range(len(ctxs)))
    run_script(native, ref, [("update", [0], [live]), ("draft", batch, ctxs, 16, 4, False)])
    # The static table is never modified, by drafting or otherwise.
    assert [static.table_state(0, k) for k in range(len(config["tables"]))] == frozen_before
    with pytest.raises(ValueError, match="frozen"):
        static.update(t32([0]), t32([1, 2, 3]), t32([0, 3]))
    with pytest.raises(ValueError, match="frozen"):
        static.reset(t32([0]))


def test_static_followers_come_after_live_ones():
    static = NGramCache.build([[5, 9, 9], [5, 6, 7]], 1, 2)
    live = NGramCache(1, 2, max_sequences=1, static=static)
    live.update(t32([0]), t32([5, 1, 2]), t32([0, 3]))
    tree = live.draft(t32([0]), t32([[5]]), t32([1]), max_nodes=32, max_depth=2)
    # Depth-1 children of the root: the live follower's 1 first, then the static 6 and 9.
    n = int(tree.num_nodes[0])
    children = [int(tree.tokens[0, i]) for i in range(n) if int(tree.parents[0, i]) == 0]
    assert children == [1, 6, 9]
    with pytest.raises(ValueError, match="frozen, shared"):
        NGramCache(max_sequences=1, static=NGramCache(max_sequences=1))


# ---------------------------------------------------------------------------------------------
# Save / load


@settings(max_examples=40, deadline=None)
@given(scripts())
def test_save_load_round_trip(tmp_path_factory, script):
    config, steps = script
    native = NGramCache(max_sequences=3, **config)
    ref = RefNGramCache(max_sequences=3, **config)
    half = len(steps) // 2
    run_script(native, ref, steps[:half])
    path = tmp_path_factory.mktemp("ngram") / "cache.bin"
    native.save(path)
    loaded = NGramCache.load(path)
    assert loaded.config == native.config
    assert loaded.nbytes == native.nbytes
    assert loaded.to_bytes() == native.to_bytes()
    # The loaded cache carries on exactly like the reference (recency, stamps, tails).
    run_script(loaded, ref, steps[half:])


def test_save_load_static_keeps_frozen(tmp_path):
    static = NGramCache.build([real_tokens(2000)], 2, 3, max_leaders=512)
    static.save(tmp_path / "static.bin")
    again = NGramCache.load(tmp_path / "static.bin")
    assert again.frozen and again.config == static.config
    assert again.table_state(0) == static.table_state(0)
    live = NGramCache(2, 3, max_sequences=1, static=again)
    tree = live.draft(t32([0]), t32([real_tokens(2000)[100:102]]), t32([2]), 16, 5)
    assert int(tree.num_nodes[0]) > 1


def _saved(tmp_path) -> bytes:
    cache = NGramCache(1, 2, max_leaders=4, max_sequences=2)
    cache.update(t32([0, 1]), t32([1, 2, 3, 1, 2, 4, 5]), t32([0, 4, 7]))
    return cache.to_bytes()


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda b: b[:-1], "checksum|truncated"),
        (lambda b: b[:20], "checksum|truncated"),
        (lambda b: b[:10] + bytes([b[10] ^ 1]) + b[11:], "version"),
        (lambda b: b[:40] + bytes([b[40] ^ 0x10]) + b[41:], "checksum"),
        (lambda b: b"PK\x03\x04" + b[4:], "magic"),
        (lambda b: b"", "magic"),
        (lambda b: b + b"\x00", "checksum"),
    ],
)
def test_corrupted_or_foreign_file_raises(tmp_path, mutate, match):
    bad = mutate(_saved(tmp_path))
    path = tmp_path / "bad.bin"
    path.write_bytes(bad)
    with pytest.raises(ValueError, match=match):
        NGramCache.load(path)


def test_every_single_byte_corruption_is_caught(tmp_path):
    good = _saved(tmp_path)
    for i in range(0, len(good), 3):
        bad = bytearray(good)
        bad[i] ^= 0xA5
        with pytest.raises(ValueError):
            NGramCache.from_bytes(bytes(bad))


def test_consistent_checksum_but_bad_content_raises(tmp_path):
    """A file with a valid checksum but impossible content (a forged row) is still rejected."""
    import struct

    body = bytearray(_saved(tmp_path)[:-8])
    # Slot 0's tail length follows the 40-byte header; claim more tokens than a tail can hold.
    body[40:44] = struct.pack("<I", 99)
    with pytest.raises(ValueError, match="inconsistent"):
        NGramCache.from_bytes(_sealed(bytes(body)))


def _sealed(body: bytes) -> bytes:
    """body with the file's FNV-1a checksum appended (a forger's file)."""
    import struct

    fnv = 0xCBF29CE484222325
    for byte in body:
        fnv = ((fnv ^ byte) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return body + struct.pack("<Q", fnv)


def test_a_forged_clock_of_two_to_the_62_or_more_is_refused():
    """A clock counts tokens: near INT64_MAX it can only be forged, and the next updates would
    overflow its stamps (undefined behaviour)."""
    import struct

    raw = NGramCache(max_sequences=1).to_bytes()[:-8]
    at = 44  # magic, version, tables, (leader, follower), sizes, flags, the tail: then the clock
    assert struct.unpack("<q", raw[at : at + 8])[0] == 0
    for clock, ok in ((2**62 - 1, True), (2**63 - 1, False), (2**62, False)):
        data = _sealed(raw[:at] + struct.pack("<q", clock) + raw[at + 8 :])
        if ok:
            assert NGramCache.from_bytes(data).to_bytes() == data
        else:
            with pytest.raises(ValueError, match="clock out of range"):
                NGramCache.from_bytes(data)


# ---------------------------------------------------------------------------------------------
# Bad input


@pytest.fixture()
def cache():
    c = NGramCache(1, 2, max_sequences=4)
    c.update(t32([0]), t32([1, 2, 3, 1, 2]), t32([0, 5]))
    return c


def test_update_errors(cache):
    with pytest.raises(ValueError, match="tokens: token ids must be >= 0"):
        cache.update(t32([0]), t32([1, -5]), t32([0, 2]))
    with pytest.raises(ValueError, match="slots: slot 4 .* out of range"):
        cache.update(t32([4]), t32([1]), t32([0, 1]))
    with pytest.raises(ValueError, match="slots: slot -1"):
        cache.update(t32([-1]), t32([1]), t32([0, 1]))
    with pytest.raises(ValueError, match="appears twice"):
        cache.update(t32([1, 1]), t32([1, 2]), t32([0, 1, 2]))
    with pytest.raises(ValueError, match="offsets: must be non-decreasing"):
        cache.update(t32([0, 1]), t32([1, 2]), t32([0, 2, 1]))
    with pytest.raises(ValueError, match="offsets: must start at 0"):
        cache.update(t32([0]), t32([1, 2]), t32([1, 2]))
    with pytest.raises(ValueError, match="offsets: the last offset"):
        cache.update(t32([0]), t32([1, 2]), t32([0, 1]))
    with pytest.raises(ValueError, match="offsets: expected shape"):
        cache.update(t32([0]), t32([1, 2]), t32([0, 1, 2]))
    with pytest.raises(TypeError, match="tokens: expected dtype int32"):
        cache.update(t32([0]), torch.tensor([1, 2]), t32([0, 2]))
    with pytest.raises(TypeError, match="slots: expected dtype int32"):
        cache.update(np.array([0.0]), t32([1, 2]), t32([0, 2]))
    with pytest.raises(ValueError, match="tokens: must be contiguous"):
        cache.update(t32([0]), t32([1, 2, 3, 4])[::2], t32([0, 2]))
    with pytest.raises(TypeError, match="DLPack"):
        cache.update(t32([0]), "abc", t32([0, 2]))
    # Nothing above changed the cache.
    assert cache.table_state(0) == [
        ((1,), [((2, 3), 3)]),
        ((2,), [((3, 1), 4)]),
        ((3,), [((1, 2), 5)]),
    ]


def test_draft_errors(cache):
    ctx = t32([[1, 2]])
    with pytest.raises(ValueError, match="context_lens"):
        cache.draft(t32([0]), ctx, t32([3]), 4, 2)
    with pytest.raises(ValueError, match="context_lens"):
        cache.draft(t32([0]), ctx, t32([0]), 4, 2)
    with pytest.raises(ValueError, match="contexts: token ids must be >= 0"):
        cache.draft(t32([0]), t32([[1, -2]]), t32([2]), 4, 2)
    with pytest.raises(ValueError, match="max_nodes"):
        cache.draft(t32([0]), ctx, t32([2]), 0, 2)
    with pytest.raises(ValueError, match="max_nodes"):
        cache.draft(t32([0]), ctx, t32([2]), 1025, 2)
    with pytest.raises(ValueError, match="max_depth"):
        cache.draft(t32([0]), ctx, t32([2]), 4, -1)
    with pytest.raises(ValueError, match="contexts: expected shape"):
        cache.draft(t32([0, 1]), ctx, t32([2, 2]), 4, 2)
    with pytest.raises(ValueError, match="contexts: expected 2 dimensions"):
        cache.draft(t32([0]), t32([1, 2]), t32([2]), 4, 2)
    with pytest.raises(TypeError, match="contexts: expected dtype int32"):
        cache.draft(t32([0]), ctx.long(), t32([2]), 4, 2)
    with pytest.raises(ValueError, match="slots: slot 9"):
        cache.draft(t32([9]), ctx, t32([2]), 4, 2)
    with pytest.raises(TypeError, match="max_nodes"):
        cache.draft(t32([0]), ctx, t32([2]), 4.0, 2)


@pytest.mark.parametrize("dtype", [">i4", object])
def test_numpy_dtypes_dlpack_cannot_carry_are_type_errors(cache, dtype):
    """A big-endian or object numpy array failed in the DLPack export with a ValueError that
    named no dtype; it is a TypeError, as the other wrong dtypes are."""
    before = cache.table_state(0)

    def bad(values):
        return np.array(values).astype(dtype)

    got = "expected dtype int32, got a numpy array of dtype " + (
        "object" if dtype is object else ">i4"
    )
    with pytest.raises(TypeError, match=f"tokens: {got}"):
        cache.update(t32([0]), bad([1, 2]), t32([0, 2]))
    with pytest.raises(TypeError, match=f"offsets: {got}"):
        cache.update(t32([0]), t32([1, 2]), bad([0, 2]))
    with pytest.raises(TypeError, match=f"contexts: {got}"):
        cache.draft(t32([0]), bad([[1, 2]]), t32([2]), 4, 2)
    with pytest.raises(TypeError, match=f"context_lens: {got}"):
        cache.draft(t32([0]), t32([[1, 2]]), bad([2]), 4, 2)
    with pytest.raises(TypeError, match=f"slots: {got}"):
        cache.reset(bad([0]))
    with pytest.raises(TypeError, match=f"slots: {got}"):
        cache.end_stream(bad([0]))
    assert cache.table_state(0) == before
    # Other errors of a call with good numpy dtypes are unchanged.
    with pytest.raises(ValueError, match="offsets: the last offset"):
        cache.update(
            np.array([0], np.int32), np.array([1, 2], np.int32), np.array([0, 1], np.int32)
        )


def test_draft_reads_strided_context_rows():
    c = NGramCache(1, 2, max_sequences=2)
    c.update(t32([0, 1]), t32([1, 2, 3, 1, 2, 3]), t32([0, 3, 6]))
    big = torch.zeros(2, 10, dtype=I32)
    big[:, :4] = t32([[5, 5, 5, 1], [5, 5, 5, 1]])
    tree = c.draft(t32([0, 1]), big[:, :4], t32([4, 4]), 4, 3)
    assert tree.tokens.tolist() == [[1, 2, 3, -1], [1, 2, 3, -1]]


def test_config_errors():
    with pytest.raises(ValueError, match="leader_len"):
        NGramCache(0, 2)
    with pytest.raises(ValueError, match="follower_len"):
        NGramCache(1, 33)
    with pytest.raises(ValueError, match="max_followers"):
        NGramCache(max_followers=65)
    with pytest.raises(ValueError, match="given twice"):
        NGramCache(tables=[(1, 2), (1, 2)])
    with pytest.raises(TypeError, match="tables"):
        NGramCache(tables=[1])
    with pytest.raises(ValueError, match="physical memory"):
        NGramCache(max_leaders=1 << 24, max_followers=64, max_sequences=1024)


@pytest.mark.cuda
@requires_cuda
def test_cuda_arrays_are_refused(cache):
    with pytest.raises(ValueError, match="lives on the host"):
        cache.update(t32([0]).cuda(), t32([1]), t32([0, 1]))
    with pytest.raises(ValueError, match="lives on the host"):
        cache.draft(t32([0]), t32([[1, 2]]).cuda(), t32([2]), 4, 2)


# ---------------------------------------------------------------------------------------------
# Threads


def _batch_run(threads: int) -> tuple[list, list]:
    specdecode.set_num_threads(threads)
    try:
        rng = np.random.default_rng(1)
        c = NGramCache(tables=[(1, 2), (2, 2)], max_leaders=16, max_sequences=64)
        slots = np.arange(64, dtype=np.int32)
        trees = []
        for _ in range(5):
            lens = rng.integers(0, 40, size=64)
            toks = rng.integers(0, 12, size=int(lens.sum())).astype(np.int32)
            offs = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
            c.update(slots, toks, offs)
            ctx = rng.integers(0, 12, size=(64, 3)).astype(np.int32)
            trees.append(c.draft(slots, ctx, np.full(64, 3, np.int32), 32, 6).tokens)
        return [c.table_state(s, 1) for s in range(64)], trees
    finally:
        specdecode.set_num_threads(0)


def test_results_do_not_depend_on_thread_count():
    states1, trees1 = _batch_run(1)
    states2, trees2 = _batch_run(4)
    assert states1 == states2
    assert all(torch.equal(a, b) for a, b in zip(trees1, trees2))


def run_threads(jobs) -> None:
    errors = []

    def guard(job):
        try:
            job()
        except BaseException as exc:  # re-raised in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=guard, args=(job,)) for job in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def test_concurrent_calls_on_distinct_slots_are_safe():
    data = real_tokens(4000)
    c = NGramCache(2, 3, max_leaders=64, max_sequences=8)
    ref = NGramCache(2, 3, max_leaders=64, max_sequences=8)

    def work(slot: int, cache: NGramCache) -> None:
        stream = data[slot * 300 : slot * 300 + 900]
        for i in range(0, len(stream), 7):
            cache.update(t32([slot]), t32(stream[i : i + 7]), t32([0, len(stream[i : i + 7])]))
            ctx = stream[max(0, i - 3) : i + 7]
            cache.draft(t32([slot]), t32([ctx]), t32([len(ctx)]), 16, 4)

    run_threads([lambda s=s: work(s, c) for s in range(8)])
    for s in range(8):
        work(s, ref)
    for s in range(8):
        assert c.table_state(s) == ref.table_state(s)


def test_shared_tables_are_safe_under_threads():
    c = NGramCache(1, 2, max_leaders=4096, max_followers=8, max_sequences=8, shared=True)
    data = real_tokens(4000)

    def work(slot: int) -> None:
        for i in range(0, 800, 5):
            piece = data[slot * 100 + i : slot * 100 + i + 5]
            c.update(t32([slot]), t32(piece), t32([0, len(piece)]))
            c.draft(t32([slot]), t32([piece]), t32([len(piece)]), 16, 4)

    run_threads([lambda s=s: work(s) for s in range(8)])
    # Each slot fed 800 tokens; every one advanced the shared clock exactly once.
    state = c.table_state(0)
    assert max(stamp for _, row in state for _, stamp in row) == 8 * 800


def test_list_inputs_must_be_ints_in_range():
    """Lists are checked before the int32 cast, which would truncate floats and wrap big ints."""
    c = NGramCache(leader_len=1, follower_len=1, max_sequences=4)
    with pytest.raises(TypeError, match="tokens: expected integers"):
        c.update([0], [1.7, 2.2, 3.99], [0, 3])
    with pytest.raises(TypeError, match="slots: expected integers"):
        c.update([True], [5, 6], [0, 2])
    with pytest.raises(ValueError, match="tokens: 2147483648 is outside"):
        c.update([0], [2**31], [0, 1])
    with pytest.raises(ValueError, match="slots"):
        c.update([2**70], [1], [0, 1])
    c.update([0], [1, 2, 3, 1, 2], [0, 5])
    # Any max_depth >= 0 is a limit; past the deepest possible tree it changes nothing.
    want = c.draft([0], [[1]], [1], 8, 1024)
    assert all(torch.equal(a, b) for a, b in zip(c.draft([0], [[1]], [1], 8, 2**31), want))


def test_build_takes_any_integer_stream_and_checks_shared_slots():
    stream = [1, 2, 3, 1, 2, 4, 1, 2, 3]
    want = NGramCache.build([np.asarray(stream, np.int32)], 1, 2).to_bytes()
    for dtype in (np.int8, np.uint8, np.int16, np.uint16, np.uint32, np.int64):
        assert NGramCache.build([np.asarray(stream, dtype)], 1, 2).to_bytes() == want
    assert NGramCache.build([torch.tensor(stream, dtype=torch.int16)], 1, 2).to_bytes() == want
    with pytest.raises(TypeError, match="stream 0 must hold integer token ids"):
        NGramCache.build([[1.5, 2.0]], 1, 2)
    shared = NGramCache(shared=True, max_sequences=2)
    for bad in (-5, 2):
        with pytest.raises(ValueError, match="slot"):
            shared.table_state(bad)
    with pytest.raises(TypeError, match="slot"):
        shared.table_state("x")
