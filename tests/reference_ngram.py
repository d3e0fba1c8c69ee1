"""Pure-Python reference of Cacheback's two-level LRU n-gram cache (OrderedDict based).

Semantics the native cache must match exactly:

* A table is an OrderedDict leader -> row, least recently used leader first; a row is an
  OrderedDict follower -> stamp, most recently used follower *last* here (``table_state`` reports
  rows most recent first).
* ``insert``: a known leader moves to most recent; a new leader in a full table evicts the least
  recent leader (with its row). In the row, a known follower moves to most recent and a new one
  in a full row evicts the least recent follower. The follower's stamp becomes the insert's.
* ``update``: for each new token, the stamp (the slot's clock, or the shared clock) advances by
  one, and every table whose window ``leader_len + follower_len`` fits in the stream so far
  inserts the window ending at that token. The last ``max window - 1`` tokens are kept as the
  slot's tail, so every n-gram is inserted once, also across calls.
* ``draft``: breadth-first expansion from the root; each expansion looks up the path's last
  tokens in every table (refreshing a found leader if touch_on_read), merges the rows by stamp
  (most recent first, ties to the earlier table), then the static cache's followers likewise,
  and inserts them level by level as paths under the node, sharing common prefixes (a path
  joins any existing child with its next token, so no node has two children with the same
  token), within max_nodes and max_depth; the end of every complete path is queued for
  expansion.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence


class RefTable:
    def __init__(self, leader_len: int, follower_len: int, max_leaders: int, max_followers: int):
        self.leader_len = leader_len
        self.follower_len = follower_len
        self.max_leaders = max_leaders
        self.max_followers = max_followers
        self.rows: OrderedDict[tuple, OrderedDict[tuple, int]] = OrderedDict()

    def insert(self, leader: tuple, follower: tuple, stamp: int) -> None:
        row = self.rows.get(leader)
        if row is not None:
            self.rows.move_to_end(leader)
        else:
            if len(self.rows) >= self.max_leaders:
                self.rows.popitem(last=False)
            row = self.rows[leader] = OrderedDict()
        if follower in row:
            row.move_to_end(follower)
        elif len(row) >= self.max_followers:
            row.popitem(last=False)
        row[follower] = stamp

    def lookup(self, leader: tuple, touch: bool) -> list[tuple[tuple, int]]:
        row = self.rows.get(leader)
        if row is None:
            return []
        if touch:
            self.rows.move_to_end(leader)
        return [(f, s) for f, s in reversed(row.items())]

    def state(self) -> list:
        return [
            (leader, [(f, s) for f, s in reversed(row.items())])
            for leader, row in self.rows.items()
        ]


class RefNGramCache:
    def __init__(
        self,
        leader_len: int = 1,
        follower_len: int = 2,
        max_leaders: int = 256,
        max_followers: int = 4,
        touch_on_read: bool = True,
        max_sequences: int = 256,
        shared: bool = False,
        static: RefNGramCache | None = None,
        tables: Sequence[tuple[int, int]] | None = None,
    ):
        self.specs = list(tables) if tables is not None else [(leader_len, follower_len)]
        self.max_leaders = max_leaders
        self.max_followers = max_followers
        self.touch_on_read = touch_on_read
        self.max_sequences = max_sequences
        self.shared = shared
        self.static = static
        self.frozen = False
        self.tail_cap = max(leader + follower for leader, follower in self.specs) - 1
        self.max_leader_len = max(leader for leader, _ in self.specs)
        states = 1 if shared else max_sequences
        self.tables = [self._new_tables() for _ in range(states)]
        self.clocks = [0] * states
        self.tails: list[list[int]] = [[] for _ in range(max_sequences)]

    def _new_tables(self) -> list[RefTable]:
        return [
            RefTable(lead, fol, self.max_leaders, self.max_followers) for lead, fol in self.specs
        ]

    def _state(self, slot: int) -> int:
        return 0 if self.shared else slot

    # ---- updates ---------------------------------------------------------------------------

    def update_one(self, slot: int, tokens: Sequence[int]) -> None:
        assert not self.frozen
        st = self._state(slot)
        seq = self.tails[slot] + [int(t) for t in tokens]
        start = len(self.tails[slot])
        for end in range(start + 1, len(seq) + 1):
            self.clocks[st] += 1
            for table in self.tables[st]:
                w = table.leader_len + table.follower_len
                if end < w:
                    continue
                window = seq[end - w : end]
                table.insert(
                    tuple(window[: table.leader_len]),
                    tuple(window[table.leader_len :]),
                    self.clocks[st],
                )
        if tokens is not None and len(seq) > start:
            self.tails[slot] = seq[-self.tail_cap :]

    def update(self, slots: Sequence[int], tokens: Sequence[int], offsets: Sequence[int]) -> None:
        for b, slot in enumerate(slots):
            self.update_one(int(slot), list(tokens[offsets[b] : offsets[b + 1]]))

    def reset(self, slots: Sequence[int]) -> None:
        for slot in slots:
            self.tails[slot] = []
            if not self.shared:
                self.tables[slot] = self._new_tables()
                self.clocks[slot] = 0

    def end_stream(self, slots: Sequence[int]) -> None:
        for slot in slots:
            self.tails[slot] = []

    @classmethod
    def build(cls, streams, **kwargs) -> RefNGramCache:
        cache = cls(touch_on_read=False, max_sequences=1, shared=True, **kwargs)
        for stream in streams:
            cache.update_one(0, list(stream))
            cache.end_stream([0])
        cache.frozen = True
        return cache

    # ---- drafting ----------------------------------------------------------------------------

    def _lookup(self, state: int, touch: bool, path: list[int]) -> list[tuple[tuple, int]]:
        found: list[tuple[tuple, int]] = []
        for table in self.tables[state]:
            if len(path) < table.leader_len:
                continue
            found += table.lookup(tuple(path[len(path) - table.leader_len :]), touch)
        # Stable: equal stamps keep table order.
        return sorted(found, key=lambda fs: -fs[1])

    def draft_one(
        self, slot: int, context: Sequence[int], max_nodes: int, max_depth: int, chain: bool
    ) -> tuple[list[int], list[int]]:
        st = self._state(slot)
        touch = self.touch_on_read and not self.frozen
        tokens, parents, depth = [int(context[-1])], [-1], [0]
        queue, queued = [0], {0}
        qhead = 0
        while qhead < len(queue) and len(tokens) < max_nodes:
            v = queue[qhead]
            qhead += 1
            if depth[v] >= max_depth:
                continue
            suffix = []
            u = v
            while u > 0:
                suffix.append(tokens[u])
                u = parents[u]
            path = list(context) + suffix[::-1]
            cands = [f for f, _ in self._lookup(st, touch, path)]
            if self.static is not None:
                cands += [f for f, _ in self.static._lookup(0, False, path)]
            if not cands:
                continue
            if chain:
                cands = cands[:1]
            cur = [v] * len(cands)
            alive = [True] * len(cands)
            for j in range(max(len(c) for c in cands)):
                for c, cand in enumerate(cands):
                    if not alive[c] or j >= len(cand):
                        continue
                    at = cur[c]
                    if depth[at] >= max_depth:
                        alive[c] = False
                        continue
                    # Any existing child with the token, whichever expansion made it: no two
                    # children of a node carry the same token.
                    child = next(
                        (
                            u
                            for u in range(at + 1, len(tokens))
                            if parents[u] == at and tokens[u] == cand[j]
                        ),
                        None,
                    )
                    if child is None:
                        if len(tokens) >= max_nodes:
                            alive[c] = False
                            continue
                        child = len(tokens)
                        tokens.append(cand[j])
                        parents.append(at)
                        depth.append(depth[at] + 1)
                    cur[c] = child
            for c in range(len(cands)):
                if alive[c] and cur[c] not in queued:
                    queued.add(cur[c])
                    queue.append(cur[c])
        return tokens, parents

    def draft(self, slots, contexts, context_lens, max_nodes, max_depth, chain=False):
        """Returns lists (tokens rows, parents rows, num_nodes), rows padded to max_nodes."""
        out_tokens, out_parents, counts = [], [], []
        for b, slot in enumerate(slots):
            ctx = list(contexts[b][: context_lens[b]])
            tok, par = self.draft_one(int(slot), ctx, max_nodes, max_depth, chain)
            counts.append(len(tok))
            out_tokens.append(tok + [-1] * (max_nodes - len(tok)))
            out_parents.append(par + [-1] * (max_nodes - len(par)))
        return out_tokens, out_parents, counts

    # ---- introspection -------------------------------------------------------------------------

    def table_state(self, slot: int = 0, table: int = 0) -> list:
        return self.tables[self._state(slot)][table].state()
