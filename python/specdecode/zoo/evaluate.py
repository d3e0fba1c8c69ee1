"""Measure a zoo pair: ``python -m specdecode.zoo.evaluate --target DIR --draft DIR ...``.

Reports, as JSON:

* ``heldout_loss`` of each model: mean next-token cross-entropy (nats) over every
  non-overlapping ``--seq-len`` window of the held-out files;
* ``greedy_agreement``: the fraction of held-out positions (real text as the prefix) where the
  draft's greedy token equals the target's greedy token;
* ``chain_k``: for greedy speculative decoding with draft chains of ``k`` tokens, the mean number
  of draft tokens the target accepts per step and the mean tokens emitted per step (accepted +
  the bonus/correction token), measured exactly on the target's own greedy continuations of
  held-out prompts. On a sequence the target generated greedily, the target's greedy token at
  each position *is* the next token, and the draft's chain stays on that sequence for as long as
  it matches, so one teacher-forced draft pass gives every step's accepted length;
* ``samples``: greedy continuations of a few code prompts by the target.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

import numpy as np
import torch

from ._paths import existing_dir, existing_file, exit_with_error, int_at_least, writable_file
from .tokenizer import Tokenizer

SAMPLE_PROMPTS = (
    "def fibonacci(n):\n",
    "import os\nimport sys\n\n\ndef main():\n",
    "class Stack:\n    def __init__(self):\n",
    "    for i, line in enumerate(",
)

# Draft chain lengths of the chain statistics (``chain_k``).
CHAIN_KS = (1, 2, 4, 8)


@torch.no_grad()
def greedy_generate(
    model: torch.nn.Module, ids: torch.Tensor, new_tokens: int, use_cache: bool = True
) -> torch.Tensor:
    """Greedy continuation of ``ids``.

    Parameters
    ----------
    model : Transformer
    ids : torch.Tensor
        int64 [B, T] prompts (same length).
    new_tokens : int
        Tokens to append.
    use_cache : bool
        Decode with the model's KV cache (``model.forward`` one token at a time); False recomputes
        the whole prefix with ``forward_train`` for every token (the reference the cached path is
        tested against).

    Returns
    -------
    torch.Tensor
        int64 [B, T + new_tokens].
    """
    b, t = ids.shape
    if not use_cache:
        out = ids
        for _ in range(new_tokens):
            nxt = model.forward_train(out)[:, -1].argmax(-1, keepdim=True)
            out = torch.cat([out, nxt], dim=1)
        return out
    cache = model.new_cache(b, t + new_tokens)
    positions = torch.arange(t).expand(b, t)
    logits = model(ids, positions, cache)
    out = [ids]
    for i in range(new_tokens):
        nxt = logits[:, -1].argmax(-1, keepdim=True)
        out.append(nxt)
        if i + 1 < new_tokens:
            logits = model(nxt, torch.full((b, 1), t + i), cache)
    return torch.cat(out, dim=1)


def chain_accept_lengths(match: np.ndarray, k: int) -> np.ndarray:
    """Accepted lengths of greedy chains of ``k`` draft tokens, one per starting position.

    Parameters
    ----------
    match : np.ndarray
        bool [N]: ``match[j]`` says the draft's greedy token at position ``j`` equals the target's.
    k : int
        Chain length.

    Returns
    -------
    np.ndarray
        int64 [N - k + 1]: for each start ``t``, the number of leading ``True`` in
        ``match[t : t + k]``.
    """
    n = match.shape[0] - k + 1
    if n <= 0:
        return np.zeros(0, dtype=np.int64)
    out = np.zeros(n, dtype=np.int64)
    alive = np.ones(n, dtype=bool)
    for i in range(k):
        alive &= match[i : i + n]
        out += alive
    return out


def simulate_steps(match: np.ndarray, k: int) -> List[int]:
    """Accepted counts of the successive steps of greedy decoding along one sequence.

    Decoding starts at position 0; each step accepts ``a`` draft tokens and emits ``a + 1``
    tokens (the last is the target's bonus or correction token), so the next step starts
    ``a + 1`` positions later. Steps that would run past the end are not counted.
    """
    lengths = chain_accept_lengths(match, k)
    steps, t = [], 0
    while t < lengths.shape[0]:
        steps.append(int(lengths[t]))
        t += int(lengths[t]) + 1
    return steps


@torch.no_grad()
def pair_stats(target, draft, windows: torch.Tensor, batch: int = 8) -> Dict[str, float]:
    """Held-out loss of both models and greedy agreement on ``windows`` [N, T + 1]."""
    tl = dl = 0.0
    agree = count = 0
    for i in range(0, windows.shape[0], batch):
        w = windows[i : i + batch]
        inp, lab = w[:, :-1], w[:, 1:]
        t = target.forward_train(inp).float()
        d = draft.forward_train(inp).float()
        n = lab.numel()
        tl += torch.nn.functional.cross_entropy(t.reshape(n, -1), lab.reshape(-1)).item() * n
        dl += torch.nn.functional.cross_entropy(d.reshape(n, -1), lab.reshape(-1)).item() * n
        agree += (t.argmax(-1) == d.argmax(-1)).sum().item()
        count += n
    return {
        "target_heldout_loss": tl / count,
        "draft_heldout_loss": dl / count,
        "greedy_agreement": agree / count,
        "positions": count,
    }


@torch.no_grad()
def chain_stats(
    target, draft, prompts: torch.Tensor, new_tokens: int, ks: Sequence[int] = (4,)
) -> Dict[str, Dict[str, float]]:
    """Greedy speculative decoding statistics on the target's continuations of ``prompts``."""
    seqs = greedy_generate(target, prompts, new_tokens)
    p = prompts.shape[1]
    # Draft greedy predictions for the generated positions, teacher-forced on the sequence.
    d_pred = draft.forward_train(seqs[:, :-1]).argmax(-1)[:, p - 1 :]
    match = (d_pred == seqs[:, p:]).numpy()
    out = {}
    for k in ks:
        steps = [a for row in match for a in simulate_steps(row, k)]
        out[str(k)] = {
            "mean_accepted": float(np.mean(steps)),
            "tokens_per_step": float(np.mean(steps)) + 1.0,
            "steps": len(steps),
        }
    out["generated_tokens"] = int(match.size)
    out["greedy_agreement_on_target_text"] = float(match.mean())
    return out


def heldout_windows_all(stream: np.ndarray, seq: int) -> torch.Tensor:
    """Every non-overlapping window of ``seq + 1`` tokens (consecutive windows share one token)."""
    n = (stream.size - 1) // seq
    t = torch.from_numpy(stream.astype(np.int64))
    return torch.stack([t[i * seq : i * seq + seq + 1] for i in range(n)])


def check_paths(args: argparse.Namespace) -> None:
    """The paths of the command line, before any work is done.

    Raises
    ------
    FileNotFoundError
        An input does not exist, a model directory holds no ``config.json``, or the directory of
        ``--out`` does not exist.
    ValueError
        An input is of the wrong kind (a file for a directory or the reverse), or ``--out``
        cannot be written.
    """
    existing_dir(args.target, "--target", ("config.json",))
    existing_dir(args.draft, "--draft", ("config.json",))
    existing_file(args.tokenizer, "--tokenizer")
    existing_file(args.heldout, "--heldout")
    if args.out is not None:
        writable_file(args.out, "--out")


def load_inputs(
    args: argparse.Namespace,
) -> Tuple[torch.nn.Module, torch.nn.Module, Tokenizer, np.ndarray]:
    """Target, draft (float32, eval mode), tokenizer and held-out token stream of ``args``.

    Raises
    ------
    FileNotFoundError, ValueError
        As :func:`check_paths`, a model, the tokenizer or the stream cannot be loaded, or they do
        not fit the options (:func:`check_inputs`).
    """
    from ..models import Transformer

    check_paths(args)
    target = Transformer.from_pretrained(str(args.target), dtype=torch.float32).eval()
    draft = Transformer.from_pretrained(str(args.draft), dtype=torch.float32).eval()
    try:
        tok = Tokenizer(args.tokenizer)
    except RuntimeError as exc:  # sentencepiece's error for a file it cannot parse
        raise ValueError(
            f"--tokenizer {args.tokenizer} is not a sentencepiece model: {exc}"
        ) from None
    try:
        stream = np.load(args.heldout)
    except ValueError as exc:
        raise ValueError(f"--heldout {args.heldout} is not a .npy token stream: {exc}") from None
    check_inputs(args, target, draft, tok, stream)
    return target, draft, tok, stream


def check_inputs(
    args: argparse.Namespace, target, draft, tok: Tokenizer, stream: np.ndarray
) -> None:
    """The loaded inputs against the options, before any work is done.

    Raises
    ------
    ValueError
        The held-out stream is not a 1-D integer array, holds fewer than ``--seq-len + 1``
        tokens (one window) or a token outside the models' vocabulary; ``--seq-len``, or
        ``--prompt-len`` with ``--new-tokens``, exceeds the models' max length; or (unless
        ``--no-samples``) a sample prompt with ``--sample-tokens`` exceeds the target's max
        length, or the tokenizer has more pieces than the target's vocabulary.
    """
    if stream.ndim != 1 or not np.issubdtype(stream.dtype, np.integer):
        raise ValueError(
            f"--heldout {args.heldout} is not a token stream: expected a 1-D integer array, got "
            f"a {stream.ndim}-D {stream.dtype} array"
        )
    if stream.size < args.seq_len + 1:
        raise ValueError(
            f"--heldout {args.heldout} holds {stream.size} tokens, fewer than one window of "
            f"--seq-len {args.seq_len} + 1"
        )
    vocab = min(int(target.vocab_size), int(draft.vocab_size))
    low, high = int(stream.min()), int(stream.max())
    if low < 0 or high >= vocab:
        raise ValueError(
            f"--heldout {args.heldout} holds token id {low if low < 0 else high}, outside the "
            f"models' vocabulary [0, {vocab})"
        )
    length = min(int(target.max_length), int(draft.max_length))
    if args.seq_len > length:
        raise ValueError(f"--seq-len {args.seq_len} exceeds the models' max length {length}")
    if args.prompt_len + args.new_tokens > length:
        raise ValueError(
            f"--prompt-len {args.prompt_len} + --new-tokens {args.new_tokens} exceed the models' "
            f"max length {length}"
        )
    if args.no_samples:
        return
    if tok.vocab_size > int(target.vocab_size):
        raise ValueError(
            f"--tokenizer {args.tokenizer} has {tok.vocab_size} pieces, more than the target's "
            f"vocabulary of {int(target.vocab_size)}"
        )
    longest = max(len(tok.encode(text, bos=True)) for text in SAMPLE_PROMPTS)
    if longest + args.sample_tokens > int(target.max_length):
        raise ValueError(
            f"--sample-tokens {args.sample_tokens} after the longest sample prompt ({longest} "
            f"tokens) exceed the target's max length {int(target.max_length)}"
        )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m specdecode.zoo.evaluate", description=__doc__)
    p.add_argument("--target", type=Path, required=True)
    p.add_argument("--draft", type=Path, required=True)
    p.add_argument("--tokenizer", type=Path, required=True)
    p.add_argument("--heldout", type=Path, required=True, help="heldout.npy of the data dir")
    p.add_argument("--seq-len", type=int_at_least(1), default=512)
    p.add_argument("--max-windows", type=int_at_least(1), default=1000)
    p.add_argument(
        "--prompts", type=int_at_least(1), default=16, help="held-out prompts for chain stats"
    )
    p.add_argument("--prompt-len", type=int_at_least(1), default=128, help="at most --seq-len + 1")
    p.add_argument(
        "--new-tokens",
        type=int_at_least(max(CHAIN_KS)),
        default=96,
        help=f"target tokens per prompt for chain stats (>= {max(CHAIN_KS)}, the longest chain)",
    )
    p.add_argument("--sample-tokens", type=int_at_least(0), default=80)
    p.add_argument("--threads", type=int_at_least(1), default=1)
    p.add_argument("--no-samples", action="store_true")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if args.prompt_len > args.seq_len + 1:
        # A prompt is the start of a held-out window of --seq-len + 1 tokens.
        p.error(
            f"argument --prompt-len: {args.prompt_len} exceeds --seq-len + 1 = {args.seq_len + 1}"
        )
    torch.set_num_threads(args.threads)
    try:
        target, draft, tok, stream = load_inputs(args)
    except (ValueError, OSError) as exc:
        exit_with_error(p.prog, exc)
    windows = heldout_windows_all(stream, args.seq_len)[: args.max_windows]
    result: Dict = {"pair": pair_stats(target, draft, windows)}
    # Prompts: evenly spaced held-out windows' first prompt-len tokens.
    idx = np.linspace(0, windows.shape[0] - 1, num=min(args.prompts, windows.shape[0]))
    prompts = windows[idx.astype(np.int64)][:, : args.prompt_len]
    result["chains"] = chain_stats(target, draft, prompts, args.new_tokens, ks=CHAIN_KS)
    if not args.no_samples:
        samples = []
        for text in SAMPLE_PROMPTS:
            ids = torch.tensor([tok.encode(text, bos=True)])
            out = greedy_generate(target, ids, args.sample_tokens)[0, ids.shape[1] :].tolist()
            if tok.eos_id in out:
                out = out[: out.index(tok.eos_id)]
            samples.append({"prompt": text, "completion": tok.decode(out)})
        result["samples"] = samples
    text = json.dumps(result, indent=1)
    if args.out is not None:
        args.out.write_text(text + "\n", encoding="utf-8")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
