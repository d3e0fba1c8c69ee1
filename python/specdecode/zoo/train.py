"""Train the zoo's models: ``python -m specdecode.zoo.train --help``.

One command trains one model of the pair (``--model target`` or ``--model draft``) on the token
stream of the corpus (:mod:`specdecode.zoo.corpus`), with the tokenizer of
:mod:`specdecode.zoo.tokenizer`, and writes into ``--run-dir``:

* ``tokenizer.model`` and ``corpus_manifest.json`` (trained/written once, reused by later runs
  that share the run directory's ``--data-dir``),
* ``log.jsonl``: one line per log interval with the mean train loss, the learning rate and, every
  ``--eval-every`` steps, the held-out loss,
* ``checkpoint.pt``: model, optimizer, step and RNG states, written atomically every
  ``--checkpoint-minutes`` and at the end; ``--resume`` continues from it bit for bit (batches are
  drawn from a generator keyed by (seed, step), so a resumed run sees the same batches),
* ``final/``: the trained model in the Hugging Face layout (``save_pretrained``).

``--distill-from DIR`` trains a draft on the soft targets of the target in ``DIR``
(KL(target || draft) at temperature ``--distill-temperature``, mixed with the hard-label loss by
``--distill-alpha``); ``--init-from DIR`` starts from the weights of an earlier run.

Training is meant for a shared 2-core machine: one intra-op thread by default (``--threads``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from pathlib import Path
from typing import Dict, Optional, Tuple

import numpy as np
import torch
import torch.nn.functional as F

from ._paths import existing_dir, exit_with_error, float_in, int_at_least, writable_dir
from .corpus import MANIFEST_NAME, Corpus
from .tokenizer import BOS_ID, EOS_ID, PAD_ID, Tokenizer, train_sentencepiece

# The pair's architectures. Cost per token (forward FLOPs, see ``flops_per_token``): the draft
# is ~21% of the target at a 512-token context, within the "a quarter of the target".
MODEL_PRESETS: Dict[str, Dict] = {
    "target": dict(
        vocab_size=8192,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=32,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
    ),
    "draft": dict(
        vocab_size=8192,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
    ),
    # For tests of the training command only: trains in seconds on a handful of files.
    "tiny": dict(
        vocab_size=512,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    ),
}

TOKENIZER_NAME = "tokenizer.model"
PROG = "python -m specdecode.zoo.train"


def flops_per_token(cfg: Dict, context: int) -> int:
    """Forward FLOPs (multiply-add = 2) to decode one token at ``context`` earlier tokens.

    Counts every matmul: q/k/v/o projections, the gated MLP, the LM head (``vocab x hidden``,
    paid on every token even when tied to the embedding) and attention's QK^T and PV over the
    context. Norms, RoPE and softmax are O(hidden) and left out.
    """
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    qd = cfg["num_attention_heads"] * cfg["head_dim"]
    kvd = cfg["num_key_value_heads"] * cfg["head_dim"]
    per_layer = 2 * (h * qd + 2 * h * kvd + qd * h + 3 * h * inter) + 2 * 2 * qd * context
    return cfg["num_hidden_layers"] * per_layer + 2 * h * cfg["vocab_size"]


def _model_api():
    from specdecode.models import ModelConfig, Transformer

    return ModelConfig, Transformer


def build_model(preset: Dict) -> torch.nn.Module:
    """A freshly initialised model of the preset (with the tokenizer's special ids)."""
    ModelConfig, Transformer = _model_api()
    cfg = ModelConfig(
        **preset, bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID, model_type="llama"
    )
    return Transformer(cfg)


def load_model(directory: Path) -> torch.nn.Module:
    """A model saved with ``save_pretrained``."""
    _, Transformer = _model_api()
    return Transformer.from_pretrained(str(directory))


# ----------------------------------------------------------------------------- data


def prepare_data(
    data_dir: Path, vocab_size: int, corpus_root: Optional[Path] = None
) -> Tuple[Path, np.ndarray, np.ndarray]:
    """Tokenizer and token streams of the corpus, built once and cached in ``data_dir``.

    Each file contributes ``[bos] + tokens + [eos]``; the train and held-out streams are the
    concatenations over the files of each split, as uint16 (vocab <= 65536).

    Raises
    ------
    FileNotFoundError
        ``corpus_root`` does not exist.
    ValueError
        ``data_dir`` cannot be created or written, or ``corpus_root`` is not a directory.
    """
    writable_dir(data_dir, "data directory").mkdir(parents=True, exist_ok=True)
    tok_path = data_dir / TOKENIZER_NAME
    train_path, heldout_path = data_dir / "train.npy", data_dir / "heldout.npy"
    corpus = Corpus.collect(corpus_root)
    if not any(f.heldout for f in corpus.files) or all(f.heldout for f in corpus.files):
        raise SystemExit(f"the corpus at {corpus.root} needs files in both splits")
    manifest_path = data_dir / MANIFEST_NAME
    if manifest_path.exists():
        old = json.loads(manifest_path.read_text(encoding="utf-8"))
        if old["combined_sha256"] != corpus.combined_hash():
            raise SystemExit(
                f"--data-dir {data_dir} was built from another corpus "
                f"({old['combined_sha256'][:12]} != {corpus.combined_hash()[:12]}); use a new one"
            )
    else:
        corpus.write_manifest(manifest_path)
    if not tok_path.exists():
        _log(f"training the tokenizer on {len(corpus.files)} files")
        train_sentencepiece(corpus.texts(heldout=False), tok_path, vocab_size=vocab_size)
    tok = Tokenizer(tok_path)
    if tok.vocab_size != vocab_size:
        raise SystemExit(f"tokenizer in {data_dir} has {tok.vocab_size} pieces, not {vocab_size}")
    if not (train_path.exists() and heldout_path.exists()):
        for heldout, path in ((False, train_path), (True, heldout_path)):
            ids = []
            for text in corpus.texts(heldout=heldout):
                ids.extend(tok.encode(text, bos=True, eos=True))
            np.save(path, np.asarray(ids, dtype=np.uint16))
    train = np.load(train_path)
    heldout = np.load(heldout_path)
    _log(f"data: {train.size} train tokens, {heldout.size} held-out tokens")
    return tok_path, train, heldout


def batch_at(stream: torch.Tensor, seed: int, step: int, batch: int, seq: int) -> torch.Tensor:
    """The training batch of ``step``: ``batch`` random windows of ``seq + 1`` tokens.

    The offsets come from a generator keyed by (seed, step) alone, so a resumed run draws exactly
    the batches the uninterrupted run would have drawn.
    """
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, stream.numel() - seq - 1, (batch,), generator=g)
    return torch.stack([stream[s : s + seq + 1] for s in starts.tolist()]).long()


def heldout_windows(stream: torch.Tensor, seq: int, count: int) -> torch.Tensor:
    """Up to ``count`` non-overlapping ``seq + 1``-token windows, evenly spread over the stream."""
    n = (stream.numel() - 1) // seq
    picks = np.linspace(0, n - 1, num=min(count, n)).astype(np.int64)
    return torch.stack([stream[i * seq : i * seq + seq + 1] for i in picks.tolist()]).long()


# ----------------------------------------------------------------------------- training


def lr_at(step: int, args: argparse.Namespace) -> float:
    """Linear warmup to ``--lr`` over ``--warmup`` steps, then cosine decay to ``--min-lr``."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    frac = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.min_lr + 0.5 * (args.lr - args.min_lr) * (1 + math.cos(math.pi * min(1.0, frac)))


def make_optimizer(model: torch.nn.Module, args: argparse.Namespace) -> torch.optim.Optimizer:
    """AdamW; weight decay on matrices only (norm gains stay undecayed)."""
    decay, no_decay = [], []
    seen = set()
    for p in model.parameters():
        if id(p) in seen or not p.requires_grad:
            continue  # tied embeddings appear twice
        seen.add(id(p))
        (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [
        {"params": decay, "weight_decay": args.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8)


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy; ``logits`` [B, T, V] predicts ``labels`` [B, T]."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))


def distill_loss(
    logits: torch.Tensor, teacher: torch.Tensor, labels: torch.Tensor, alpha: float, temp: float
) -> torch.Tensor:
    """``alpha * T^2 * KL(teacher_T || student_T) + (1 - alpha) * CE(labels)``.

    The KL is taken per position over the vocabulary and averaged over positions; the T^2 factor
    keeps its gradient scale independent of the temperature (Hinton et al.).
    """
    v = logits.shape[-1]
    s = F.log_softmax(logits.reshape(-1, v).float() / temp, dim=-1)
    t = F.log_softmax(teacher.reshape(-1, v).float() / temp, dim=-1)
    kl = F.kl_div(s, t, log_target=True, reduction="batchmean") * temp * temp
    if alpha >= 1.0:
        return kl
    return alpha * kl + (1 - alpha) * lm_loss(logits, labels)


@torch.no_grad()
def evaluate(model: torch.nn.Module, windows: torch.Tensor, batch: int) -> float:
    """Mean next-token cross-entropy (nats) of ``model`` over the held-out ``windows``."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for i in range(0, windows.shape[0], batch):
        w = windows[i : i + batch]
        logits = model.forward_train(w[:, :-1])
        total += lm_loss(logits, w[:, 1:]).item() * w[:, 1:].numel()
        count += w[:, 1:].numel()
    model.train(was_training)
    return total / count


def _rng_state() -> Dict:
    return {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
    }


def _set_rng_state(state: Dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])


def save_checkpoint(path: Path, model, opt, step: int, args, extra: Dict) -> None:
    """Write to a temporary file and rename it, so a kill never leaves half a checkpoint."""
    tmp = path.with_suffix(".tmp")
    torch.save(
        {
            "model": model.state_dict(),
            "optimizer": opt.state_dict(),
            "step": step,
            "rng": _rng_state(),
            "args": vars(args),
            **extra,
        },
        tmp,
    )
    os.replace(tmp, path)


# Arguments that must match between a run and its resumption (the rest, e.g. --checkpoint-minutes,
# may change).
_RESUME_MUST_MATCH = (
    "model",
    "steps",
    "batch_size",
    "seq_len",
    "lr",
    "min_lr",
    "warmup",
    "weight_decay",
    "seed",
    "distill_from",
    "distill_alpha",
    "distill_temperature",
)


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Train a zoo model (target or draft) on the Python standard library's sources.",
    )
    p.add_argument("--model", choices=sorted(MODEL_PRESETS), required=True)
    p.add_argument("--run-dir", type=Path, required=True, help="checkpoints, log, final model")
    p.add_argument(
        "--data-dir", type=Path, default=None, help="tokenizer + token cache (default: run dir)"
    )
    p.add_argument(
        "--corpus-root", type=Path, default=None, help="default: this interpreter's stdlib"
    )
    # A number out of range is argparse's usage error naming the option (its type checks it).
    positive = float_in(0.0, low_open=True)
    p.add_argument("--steps", type=int_at_least(1), default=1500)
    p.add_argument("--batch-size", type=int_at_least(1), default=4)
    p.add_argument("--seq-len", type=int_at_least(1), default=512)
    p.add_argument("--lr", type=positive, default=1e-3)
    p.add_argument("--min-lr", type=float_in(0.0), default=1e-4)
    p.add_argument("--warmup", type=int_at_least(0), default=50)
    p.add_argument("--weight-decay", type=float_in(0.0), default=0.1)
    p.add_argument("--clip", type=positive, default=1.0, help="gradient-norm clipping")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--threads", type=int_at_least(1), default=1, help="torch intra-op threads")
    p.add_argument("--log-every", type=int_at_least(1), default=10)
    p.add_argument("--eval-every", type=int_at_least(1), default=100)
    p.add_argument(
        "--eval-windows", type=int_at_least(1), default=32, help="held-out windows of --seq-len"
    )
    p.add_argument("--checkpoint-minutes", type=float_in(0.0), default=5.0)
    p.add_argument("--resume", action="store_true", help="continue from run-dir/checkpoint.pt")
    p.add_argument(
        "--stop-after",
        type=int_at_least(1),
        default=None,
        help="checkpoint and exit after this step",
    )
    p.add_argument("--init-from", type=Path, default=None, help="start from these weights")
    p.add_argument("--distill-from", type=Path, default=None, help="teacher (target) directory")
    p.add_argument(
        "--distill-alpha", type=float_in(0.0, 1.0), default=1.0, help="weight of the KL term"
    )
    p.add_argument("--distill-temperature", type=positive, default=1.0)
    args = p.parse_args(argv)
    longest = MODEL_PRESETS[args.model]["max_position_embeddings"]
    if args.seq_len > longest:
        p.error(
            f"argument --seq-len: {args.seq_len} exceeds the {args.model} model's "
            f"max_position_embeddings {longest}"
        )
    return args


def check_paths(args: argparse.Namespace) -> None:
    """The directories of the command line, before any work is done.

    Raises
    ------
    FileNotFoundError
        ``--corpus-root``, ``--init-from`` or ``--distill-from`` does not exist, or one of the
        latter two holds no ``config.json``.
    ValueError
        ``--run-dir`` or ``--data-dir`` cannot be created or written, or a directory argument
        is not a directory.
    """
    writable_dir(args.run_dir, "--run-dir")
    if args.data_dir is not None:
        writable_dir(args.data_dir, "--data-dir")
    if args.corpus_root is not None:
        existing_dir(args.corpus_root, "--corpus-root")
    for option, directory in (
        ("--init-from", args.init_from),
        ("--distill-from", args.distill_from),
    ):
        if directory is not None:
            existing_dir(directory, option, ("config.json",))


def read_checkpoint(args: argparse.Namespace) -> Optional[Dict]:
    """The checkpoint of ``--run-dir`` that ``--resume`` continues from (None without
    ``--resume``), checked against the command line before any work is done.

    Raises
    ------
    FileNotFoundError
        ``--resume`` and the run directory holds no checkpoint.
    ValueError
        The run directory holds a checkpoint and ``--resume`` is not given, or an option that
        must not change between a run and its resumption differs from the checkpoint's.
    """
    path = args.run_dir / "checkpoint.pt"
    if not args.resume:
        if path.exists():
            raise ValueError(f"{path} exists: pass --resume or use a new --run-dir")
        return None
    if not path.is_file():
        raise FileNotFoundError(f"--resume: no checkpoint at {path}")
    ck = torch.load(path, weights_only=False)
    for key in _RESUME_MUST_MATCH:
        old = ck["args"].get(key)
        new = getattr(args, key)
        if str(old) != str(new):
            raise ValueError(f"--resume: --{key.replace('_', '-')} was {old}, now {new}")
    return ck


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        check_paths(args)
        ck = read_checkpoint(args)
    except (ValueError, FileNotFoundError) as exc:
        exit_with_error(PROG, exc)
    torch.set_num_threads(args.threads)
    run_dir: Path = args.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    data_dir = args.data_dir or run_dir
    preset = MODEL_PRESETS[args.model]
    tok_path, train_np, heldout_np = prepare_data(data_dir, preset["vocab_size"], args.corpus_root)
    train_stream = torch.from_numpy(train_np.astype(np.int64))
    heldout = heldout_windows(
        torch.from_numpy(heldout_np.astype(np.int64)), args.seq_len, args.eval_windows
    )

    ckpt_path = run_dir / "checkpoint.pt"
    log_path = run_dir / "log.jsonl"
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    model = build_model(preset)
    if args.init_from is not None:
        model.load_state_dict(load_model(args.init_from).state_dict())
    opt = make_optimizer(model, args)
    teacher = None
    if args.distill_from is not None:
        teacher = load_model(args.distill_from).eval()
        for p in teacher.parameters():
            p.requires_grad_(False)

    step = 0
    elapsed_before = 0.0
    # Running sum of train losses since the last log line (kept in checkpoints so a resumed
    # run logs the same means).
    run_loss, run_n = 0.0, 0
    if ck is not None:
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["optimizer"])
        step = ck["step"]
        elapsed_before = ck.get("elapsed_s", 0.0)
        run_loss, run_n = ck.get("run_loss", 0.0), ck.get("run_n", 0)
        _set_rng_state(ck["rng"])
        _log(f"resumed at step {step}")

    n_params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    _log(
        f"{args.model}: {n_params} parameters, {flops_per_token(preset, args.seq_len)} FLOPs/token "
        f"at context {args.seq_len}; {args.steps} steps of {args.batch_size}x{args.seq_len} tokens"
    )
    t_start = time.time()
    last_ckpt = time.time()
    model.train()
    with log_path.open("a", encoding="utf-8") as log:
        while step < args.steps:
            lr = lr_at(step, args)
            for g in opt.param_groups:
                g["lr"] = lr
            batch = batch_at(train_stream, args.seed, step, args.batch_size, args.seq_len)
            inputs, labels = batch[:, :-1], batch[:, 1:]
            logits = model.forward_train(inputs)
            if teacher is not None:
                with torch.no_grad():
                    t_logits = teacher.forward_train(inputs)
                loss = distill_loss(
                    logits, t_logits, labels, args.distill_alpha, args.distill_temperature
                )
            else:
                loss = lm_loss(logits, labels)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            opt.step()
            step += 1
            run_loss += loss.item()
            run_n += 1
            record = None
            if step % args.log_every == 0 or step == args.steps:
                elapsed = elapsed_before + time.time() - t_start
                record = {
                    "step": step,
                    "lr": lr,
                    "train_loss": run_loss / run_n,
                    "grad_norm": float(grad_norm),
                    "tokens": step * args.batch_size * args.seq_len,
                    "elapsed_s": round(elapsed, 1),
                }
                run_loss, run_n = 0.0, 0
            if step % args.eval_every == 0 or step == args.steps:
                record = record or {"step": step}
                record["heldout_loss"] = evaluate(model, heldout, args.batch_size)
            if record is not None:
                log.write(json.dumps(record) + "\n")
                log.flush()
                _log(json.dumps(record))
            done = step == args.steps or step == args.stop_after
            if done or time.time() - last_ckpt > 60 * args.checkpoint_minutes:
                extra = {
                    "elapsed_s": elapsed_before + time.time() - t_start,
                    "run_loss": run_loss,
                    "run_n": run_n,
                }
                save_checkpoint(ckpt_path, model, opt, step, args, extra)
                last_ckpt = time.time()
            if step == args.stop_after:
                _log(f"stopped after step {step} (--stop-after); continue with --resume")
                return 0
    final = run_dir / "final"
    model.save_pretrained(str(final))
    (final / TOKENIZER_NAME).write_bytes(Path(tok_path).read_bytes())
    manifest = Path(data_dir) / MANIFEST_NAME
    (final / MANIFEST_NAME).write_bytes(manifest.read_bytes())
    _log(f"saved {final}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
