"""Work of the top-p threshold search in the CUDA kernel, counted: plain bisection against the
search with settled chunks, without and with the histograms' first tries
(``verify::top_p_settling_search`` and ``verify::top_p_locate``), on rows of large vocabularies.

Each try of a search reads the row's unsettled 256-token chunks, and so does each histogram pass;
on the GPU every chunk read is one thread's loop over 256 exps, and every try ends in two block
barriers and a serial total over the chunks. Plain bisection is replayed here in numpy (float64
masses); the two searches run natively (``specdecode._C.top_p_search_work``: the kernel's steps on
one CPU thread, with the same per-chunk functions and canonical float32 totals), which must end on
the same threshold (checked). The numpy bisection's masses are float64, so where one of its tries
lies within float32 rounding of ``wanted`` it may end a few bit patterns away: the table marks
such rows with ``*`` and gives the smallest relative margin of any of its tries.

    python bench/top_p_work.py
"""

from __future__ import annotations

import numpy as np

from specdecode import _C

CHUNK = 256


def as_float(bits: int) -> np.float32:
    return np.array([bits], dtype=np.uint32).view(np.float32)[0]


def plain(w: np.ndarray, wanted: float) -> tuple[int, int, int, float]:
    """verify::top_p_bisect: (threshold bits, tries, chunks read, smallest relative margin of a
    try's mass to ``wanted``)."""
    chunks = -(-w.size // CHUNK)
    lo, hi = 0, int(w.view(np.uint32).max())
    tries = 0
    margin = np.inf
    while lo < hi:
        mid = lo + (hi - lo + 1) // 2
        tries += 1
        mass = w[w >= as_float(mid)].sum(dtype=np.float64)
        margin = min(margin, abs(mass - wanted) / wanted)
        if mass >= wanted:
            lo = mid
        else:
            hi = mid - 1
    return lo, tries, tries * chunks, margin


def rows(v: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    ranks = rng.permutation(v) + 1.0
    return {
        "randn*3": rng.standard_normal(v) * 3,
        "randn": rng.standard_normal(v),
        "power law": -1.1 * np.log(ranks) + rng.standard_normal(v) * 0.3,
    }


def main() -> None:
    print(
        "| V | row | top_p | plain: tries, chunk reads | settling: tries, chunk reads "
        "| histograms: passes + tries, chunk reads | reads vs settling | passes vs settling "
        "| smallest margin |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for v in (32000, 128256, 151936):
        for name, x in rows(v).items():
            w = np.exp((x - x.max()).astype(np.float32)).astype(np.float32)
            for top_p in (0.9, 0.95):
                wanted = top_p * w.sum(dtype=np.float64)
                a, pt, pr, margin = plain(w, wanted)
                b, st, _, sr = _C.top_p_search_work(w, wanted, False)
                c, ht, hp, hr = _C.top_p_search_work(w, wanted, True)
                assert b == c, (v, name, top_p, hex(b), hex(c))
                star = "" if a == b else " *"
                print(
                    f"| {v} | {name} | {top_p} | {pt}, {pr} | {st}, {sr} | {hp} + {ht}, {hr} "
                    f"| {sr / hr:.2f}x | {st / (hp + ht):.2f}x | {margin:.1e}{star} |"
                )


if __name__ == "__main__":
    main()
