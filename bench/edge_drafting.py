"""Edge drafting on the shipped pycode pair: draft workers in other processes vs drafting in place.

    python bench/edge_drafting.py [--prompts 16] [--max-new 64] [--batch 1 8]
        [--temperatures 0 1] [--workers 1 2] [--repeats 3] [--spike-ms 40] [--spike-every 4]
        [--deadline-ms 15] [--steered]

The server holds the target; draft workers (:func:`specdecode.edge.spawn_draft_workers`, one
torch thread each, each loading the pair's draft model itself) stand in for edge devices and draft
chains of k=4 for the sequences placed on them (:class:`specdecode.edge.RemoteDrafter`). Compared
in the same run, per batch size and temperature: no drafter (autoregressive, the baseline), the
same draft model drafting on the server (:class:`specdecode.drafters.ModelDrafter`), and W remote
workers; with ``--spike-ms`` also two workers of which one takes that much longer on every
``--spike-every``-th draft request (a device that is sometimes busy), without and with a deadline
of ``--deadline-ms``; with ``--steered`` also the draft model steered by the pair's shipped SD² map
(:mod:`specdecode.steering`), on the server and on one worker (the server then sends the target's
states at every step).

Reported: tokens per step, wall tokens per second and its ratio to autoregressive decoding, and
the server's own time per 100 tokens (wall time less the time it waited for remote drafts: the
capacity the server keeps for other batches, which is what edge drafting buys) with its ratio to
the autoregressive server time, link bytes per step, late draft answers, and, greedy, whether the
output is identical to the autoregressive one (it must be: everything here is lossless).

Everything runs offline on the shipped weights. On a machine with fewer cores than workers plus
server, the workers share cores with each other (never with the server's work: the server waits
while they draft), so their wait time is a pessimistic stand-in for devices of their own.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch
from specdecode.benchmark import humaneval_prompts
from specdecode.drafters import ModelDrafter, NoDrafter
from specdecode.edge import RemoteDrafter, spawn_draft_workers, zoo_draft_model
from specdecode.engine import SpeculativeDecoder

from specdecode import zoo


class SpikyDevice:
    """A drafter that takes ``delay`` seconds longer on every ``every``-th draft request (a
    device that is sometimes busy, or a link with latency spikes)."""

    def __init__(self, inner, delay, every):
        self.inner, self.delay, self.every, self.calls = inner, delay, every, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def propose(self, slots):
        self.calls += 1
        if self.calls % self.every == 0:
            time.sleep(self.delay)
        return self.inner.propose(slots)


def spiky_or_steady_draft_model(spiky: bool, delay: float, every: int):
    """A worker's drafter: the pair's draft model, with latency spikes when asked."""
    drafter = zoo_draft_model("pycode", 4)
    return SpikyDevice(drafter, delay, every) if spiky else drafter


def steered_draft_model():
    """A worker's drafter: the pair's draft model steered by its shipped map (both loaded in the
    worker)."""
    return zoo_draft_model("pycode", 4, steering=zoo.load_steering("pycode"))


def run(target, drafter, prompts, batch, temperature, max_new):
    """One pass over ``prompts`` in batches of ``batch``: (seconds, new tokens, row-steps, steps,
    waited, bytes, late, sequences)."""
    new = row_steps = steps = 0
    seconds = 0.0
    sequences = []
    remote = isinstance(drafter, RemoteDrafter)
    before = (
        (drafter.stats.wait_time, drafter.stats.bytes_sent + drafter.stats.bytes_received)
        if remote
        else (0.0, 0)
    )
    late_before = sum(drafter.stats.late) if remote else 0
    for i in range(0, len(prompts), batch):
        decoder = SpeculativeDecoder(target, drafter)
        t0 = time.perf_counter()
        out = decoder.generate(
            prompts[i : i + batch], max_new_tokens=max_new, temperature=temperature, seed=1234 + i
        )
        seconds += time.perf_counter() - t0
        new, row_steps = new + out.stats.new_tokens, row_steps + out.stats.row_steps
        steps += out.stats.steps
        sequences += out.sequences
    waited = link = late = 0
    if remote:
        waited = drafter.stats.wait_time - before[0]
        link = drafter.stats.bytes_sent + drafter.stats.bytes_received - before[1]
        late = sum(drafter.stats.late) - late_before
    return seconds, new, row_steps, steps, waited, link, late, sequences


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--max-new", type=int, default=64)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--spike-ms", type=float, default=40.0, help="0: no spiky-device rows")
    p.add_argument("--spike-every", type=int, default=4)
    p.add_argument("--deadline-ms", type=float, default=15.0)
    p.add_argument("--threads", type=int, default=1, help="the server's torch threads")
    p.add_argument("--steered", action="store_true", help="add the SD²-steered draft model rows")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    target, draft, tok = zoo.load("pycode")
    texts = humaneval_prompts(164)[-args.prompts :]
    prompts = [tok.encode(t, bos=True) for t in texts]
    print(
        f"# edge_drafting: {len(prompts)} HumanEval prompts (the last ones), {args.max_new} new "
        f"tokens, draft chains k=4; {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores, torch {torch.__version__}, server {args.threads} thread(s), "
        f"workers 1 thread each, {time.strftime('%Y-%m-%d %H:%M')}"
    )
    drafters = {
        "autoregressive": NoDrafter(),
        "draft model on the server": ModelDrafter(draft, k=4),
    }
    remotes = []
    for w in args.workers:
        r = RemoteDrafter(spawn_draft_workers(zoo_draft_model, w, "pycode", 4))
        remotes.append(r)
        drafters[f"{w} remote worker{'s' if w > 1 else ''}"] = r
    if args.steered:
        drafters["steered draft model on the server"] = ModelDrafter(
            draft, k=4, steering=zoo.load_steering("pycode")
        )
        r = RemoteDrafter(spawn_draft_workers(steered_draft_model, 1))
        remotes.append(r)
        drafters["1 remote worker, steered"] = r
    if args.spike_ms > 0:
        delay = args.spike_ms / 1000
        for deadline in (None, args.deadline_ms / 1000):
            workers = []
            for spiky in (False, True):
                workers += spawn_draft_workers(
                    spiky_or_steady_draft_model, 1, spiky, delay, args.spike_every
                )
            r = RemoteDrafter(workers, deadline=deadline)
            remotes.append(r)
            name = f"2 workers, one +{args.spike_ms:g} ms every {args.spike_every}th draft"
            if deadline is not None:
                name += f", deadline {args.deadline_ms:g} ms"
            drafters[name] = r
    try:
        for drafter in drafters.values():  # warm-up
            run(target, drafter, prompts[:2], 2, 0.0, 8)
        print(
            "| batch | temperature | drafter | tokens/step | tok/s | vs autoregressive "
            "| server s/100 tok | server time vs AR | link KB/step | late | identical |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for batch in args.batch:
            for temperature in args.temperatures:
                times = {name: [] for name in drafters}
                last = {}
                for _ in range(args.repeats):
                    for name, drafter in drafters.items():
                        r = run(target, drafter, prompts, batch, temperature, args.max_new)
                        times[name].append((r[0], r[0] - r[4]))
                        last[name] = r
                wall = {n: statistics.median(t[0] for t in times[n]) for n in drafters}
                server = {n: statistics.median(t[1] for t in times[n]) for n in drafters}
                base = "autoregressive"
                for name in drafters:
                    _, new, row_steps, steps, _, link, late, seqs = last[name]
                    same = "yes" if seqs == last[base][7] else "NO"
                    if temperature > 0:
                        same = "n/a (sampled)"
                    tps = new / wall[name]
                    per100 = 100 * server[name] / new
                    print(
                        f"| {batch} | {temperature:g} | {name} | {new / row_steps:.3f} "
                        f"| {tps:.1f} | {tps / (last[base][1] / wall[base]):.3f}x "
                        f"| {per100:.3f} | {server[name] / server[base]:.3f}x "
                        f"| {link / steps / 1024:.1f} | {late} | {same} |",
                        flush=True,
                    )
    finally:
        for r in remotes:
            r.close()


if __name__ == "__main__":
    main()
