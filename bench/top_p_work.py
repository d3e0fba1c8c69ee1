"""Work of the top-p threshold search, counted: chunk reads of plain bisection against the search
with settled chunks (``verify::top_p_settling_search``), on rows of a large vocabulary.

Each try of a search reads some 256-token chunks of the row; on the GPU every read chunk is one
thread's loop over 256 exps. This script replays both searches in numpy over the row weights
``exp(x - max)`` (float32, as the kernels' ``w_i`` up to their exp approximation) with the same
tries and settling rule as ``src/specdecode/verify.h`` and reports, per row, the tries and the
chunks read. Masses are float64 here, not the kernels' canonical float32 sums, so a try whose
mass lies within float32 rounding of ``wanted`` could go the other way natively; the table
gives the smallest relative margin of any try (float32 sums over a row are good to about
1e-6). Both searches must end on the same threshold (checked).

    python bench/top_p_work.py
"""

from __future__ import annotations

import numpy as np

CHUNK = 256


def as_float(bits: int) -> np.float32:
    return np.array([bits], dtype=np.uint32).view(np.float32)[0]


def next_try(lo: int, hi: int, found: bool, back: list[int]) -> int:
    """verify::top_p_next_try."""
    e_lo, e_hi = lo >> 23, hi >> 23
    if not found:
        e = e_hi - back[0] if back[0] < e_hi else 0
        back[0] = 2 * back[0] + 1
        if e > e_lo and (e << 23) > lo:
            return e << 23
    if e_hi > e_lo + 1:
        return (e_lo + (e_hi - e_lo + 1) // 2) << 23
    return lo + (hi - lo + 1) // 2


def plain(w: np.ndarray, wanted: float) -> tuple[int, int, int]:
    """verify::top_p_bisect: (threshold bits, tries, chunks read)."""
    chunks = -(-w.size // CHUNK)
    lo, hi = 0, int(w.view(np.uint32).max())
    tries = 0
    while lo < hi:
        mid = lo + (hi - lo + 1) // 2
        tries += 1
        if w[w >= as_float(mid)].sum(dtype=np.float64) >= wanted:
            lo = mid
        else:
            hi = mid - 1
    return lo, tries, tries * chunks


def settling(w: np.ndarray, wanted: float) -> tuple[int, int, int, float]:
    """verify::top_p_settling_search: (threshold bits, tries, chunks read, smallest relative
    margin of a try's mass to ``wanted``)."""
    chunks = -(-w.size // CHUNK)
    pad = np.zeros(chunks * CHUNK, dtype=np.float32)
    pad[: w.size] = w
    rows = pad.reshape(chunks, CHUNK)
    lo, hi = 0, int(w.view(np.uint32).max())
    found, back = False, [0]
    settled = np.zeros(chunks, dtype=bool)
    kept_sum = np.zeros(chunks)
    tries = reads = 0
    margin = np.inf
    while lo < hi:
        mid = next_try(lo, hi, found, back)
        t, lo_f, hi_f = as_float(mid), as_float(lo), as_float(hi)
        tries += 1
        open_ = ~settled
        reads += int(open_.sum())
        part = rows[open_]
        trial = np.where(part >= t, part, 0).sum(axis=1, dtype=np.float64)
        below = ((part > 0) & (part >= lo_f) & (part < t)).any(axis=1)
        above = ((part >= t) & (part <= hi_f)).any(axis=1)
        total = kept_sum[settled].sum() + trial.sum()
        margin = min(margin, abs(total - wanted) / wanted)
        keep = total >= wanted
        settle = ~above if keep else ~below
        idx = np.flatnonzero(open_)[settle]
        settled[idx] = True
        kept_sum[idx] = trial[settle]
        if keep:
            lo, found = mid, True
        else:
            hi = mid - 1
    return lo, tries, reads, margin


def rows(v: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    ranks = rng.permutation(v) + 1.0
    return {
        "randn*3": rng.standard_normal(v) * 3,
        "randn": rng.standard_normal(v),
        "power law": -1.1 * np.log(ranks) + rng.standard_normal(v) * 0.3,
    }


def main() -> None:
    v = 128256
    print(f"V = {v}, {-(-v // CHUNK)} chunks of {CHUNK}")
    print(
        "| row | top_p | plain tries | plain chunk reads | settling tries | settling chunk reads "
        "| reads saved | smallest margin |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, x in rows(v).items():
        w = np.exp((x - x.max()).astype(np.float32)).astype(np.float32)
        for top_p in (0.9, 0.95):
            wanted = top_p * w.sum(dtype=np.float64)
            a, pt, pr = plain(w, wanted)
            b, st, sr, margin = settling(w, wanted)
            assert a == b, (name, top_p, hex(a), hex(b))
            print(
                f"| {name} | {top_p} | {pt} | {pr} | {st} | {sr} | {pr / sr:.2f}x | {margin:.1e} |"
            )


if __name__ == "__main__":
    main()
