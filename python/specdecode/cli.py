"""The ``specdecode`` command line: ``demo``, ``generate``, ``judge``, ``steer``, ``specformer``,
``edge-worker`` and ``info``.

* ``specdecode demo`` decodes a few Python prompts with the bundled ``pycode`` pair (target and
  draft of :mod:`specdecode.zoo`) with every drafter, prints the generated code and a table of
  tokens/s, tokens per step and speedup over autoregressive decoding, and checks that the greedy
  output of every drafter is token for token the autoregressive one (exit code 1 if not).
* ``specdecode generate PROMPT`` decodes one prompt with a zoo pair or a local Hugging Face model
  directory and a chosen drafter, streaming text to stdout as tokens are accepted and printing
  the statistics on stderr.
* ``specdecode judge`` fits an AutoJudge judge for ``generate --judge``;
  ``specdecode steer`` trains an SD² steering map for ``generate --steering``;
  ``specdecode specformer`` trains a SpecFormer draft head for ``generate --drafter specformer``.
* ``specdecode edge-worker`` drafts, on this machine, for ``generate --drafter edge`` running on
  another (:mod:`specdecode.edge`).
* ``specdecode info`` reports the version, backends and devices.

User errors (a missing model directory, an unknown zoo name or drafter, an empty prompt or one too
long for the model, a --draft-model the drafter does not use, bad numeric options or devices)
print one line on stderr and exit with code 2, without a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, List, Optional, Sequence, TextIO

# Exit codes: 0 success, 1 the demo found outputs that differ, 2 a user error.
EXIT_MISMATCH = 1
EXIT_USAGE = 2

DRAFTERS = ("none", "cacheback", "model", "model-tree", "combined", "specformer", "edge")
# The drafters that run a draft model (the zoo pair's, or --draft-model's).
MODEL_DRAFTERS = ("model", "model-tree", "combined")

# Stdlib-style function headers and docstrings: the kind of text the pycode pair was trained on,
# and text whose continuations repeat identifiers, which is where drafting pays.
DEMO_PROMPTS = (
    'def read_config(path, encoding="utf-8"):\n'
    '    """Read a configuration file and return a dict of its sections.\n\n'
    "    Lines starting with '#' are comments and are ignored.\n"
    '    """\n',
    "def _is_valid_identifier(name):\n"
    '    """Return True if *name* is a valid Python identifier that is not a keyword."""\n',
    "class LRUCache:\n"
    '    """A mapping that keeps at most *maxsize* items, dropping the least recently used."""\n\n'
    "    def __init__(self, maxsize=128):\n",
    "def split_path(path):\n"
    '    """Split a pathname into a pair (head, tail) where tail is everything after the final\n'
    '    slash. Either part may be empty."""\n',
    "def parse_header_line(line):\n"
    '    """Parse a header line of the form "Name: value" and return (name, value).\n\n'
    "    Raise ValueError if the line has no colon.\n"
    '    """\n',
)


class CLIError(Exception):
    """A user error: reported as one line on stderr with exit code 2."""


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (argparse prints the whole usage block by default)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


# ---- numeric option types (argparse shows the ArgumentTypeError message after the option) --------


def _int_at_least(minimum: int, what: str, maximum: Optional[int] = None) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if value < minimum or (maximum is not None and value > maximum):
            raise argparse.ArgumentTypeError(f"expected {what}, got {value}")
        return value

    return parse


_positive_int = _int_at_least(1, "an integer >= 1")
_nonnegative_int = _int_at_least(0, "an integer >= 0")


def _seed(text: str) -> int:
    value = _nonnegative_int(text)
    if value >= 2**62:
        raise argparse.ArgumentTypeError(f"expected an integer in [0, 2**62), got {value}")
    return value


def _temperature(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}") from None
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text}")
    return value


_nonnegative_float = _temperature  # a finite number >= 0


def _positive_float(text: str) -> float:
    value = _temperature(text)
    if value == 0:
        raise argparse.ArgumentTypeError("expected a number > 0, got 0")
    return value


def _top_p(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}") from None
    if not 0 < value <= 1:  # also rejects nan
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text}")
    return value


# ---- models and tokenizers -----------------------------------------------------------------------


class TextCodec:
    """Text <-> token ids for the command line, over the zoo's or a transformers tokenizer.

    Parameters
    ----------
    encode : callable ``str -> list of int``
        Token ids of a prompt, with the begin-of-sequence token where the model expects one.
    decode : callable ``list of int -> str``
        Text of generated ids, special tokens dropped.
    stop_ids : list of int
        Tokens that end generation (end of sequence).
    """

    def __init__(
        self,
        encode: Callable[[str], List[int]],
        decode: Callable[[Sequence[int]], str],
        stop_ids: Sequence[int],
    ) -> None:
        self.encode = encode
        self.decode = decode
        self.stop_ids = sorted({int(t) for t in stop_ids})


def _zoo_codec(tokenizer: Any) -> TextCodec:
    # The zoo's models were trained on [bos] + file + [eos] streams, so prompts start with bos.
    return TextCodec(
        lambda text: tokenizer.encode(text, bos=True), tokenizer.decode, [tokenizer.eos_id]
    )


@dataclasses.dataclass
class LoadedModel:
    """What ``--model`` resolved to."""

    name: str
    target: Any
    draft: Optional[Any]  # the zoo's bundled draft; None for a directory
    codec: TextCodec


def _zoo_names() -> List[str]:
    from . import zoo

    return sorted(zoo._PAIRS)


def _looks_like_path(spec: str) -> bool:
    # A zoo name wins over a same-named directory in the working directory ("./pycode" is the
    # directory); anything with a separator, or an existing path that is no zoo name, is a path.
    if os.sep in spec or "/" in spec or spec.startswith((".", "~")):
        return True
    return spec not in _zoo_names() and Path(spec).exists()


def load_model(spec: str, option: str = "--model") -> LoadedModel:
    """Resolve ``--model``: a zoo pair name or a local Hugging Face model directory.

    Raises
    ------
    CLIError
        An unknown zoo name, a missing or unreadable directory, or no usable tokenizer.
    """
    if not _looks_like_path(spec):
        from . import zoo

        names = _zoo_names()
        if spec not in names:
            raise CLIError(
                f"{option}: unknown zoo model {spec!r} (known: {', '.join(names)}; "
                "or give the path of a local Hugging Face model directory)"
            )
        try:
            target, draft, tokenizer = zoo.load(spec)
        except FileNotFoundError as exc:
            raise CLIError(f"{option}: {exc}") from None
        return LoadedModel(spec, target, draft, _zoo_codec(tokenizer))
    directory = _check_model_dir(spec, option)
    target = _load_dir(directory, option)
    codec = _dir_codec(directory, option, target)
    return LoadedModel(str(directory), target, None, codec)


def _check_model_dir(spec: str, option: str) -> Path:
    directory = Path(spec).expanduser()
    if not directory.exists():
        raise CLIError(f"{option}: model directory {spec} does not exist")
    if not directory.is_dir():
        raise CLIError(f"{option}: {spec} is not a directory")
    if not (directory / "config.json").is_file():
        raise CLIError(f"{option}: {spec} is not a Hugging Face model directory (no config.json)")
    return directory


def _load_dir(directory: Path, option: str) -> Any:
    """Our :class:`~specdecode.models.Transformer` for its families' configs (MODEL_TYPES), else the
    transformers model behind :class:`~specdecode.models.HFCausalLM`; float32 on the CPU."""
    import torch

    from .models import HFCausalLM, Transformer
    from .models.config import MODEL_TYPES

    try:
        config = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CLIError(f"{option}: cannot read {directory / 'config.json'}: {exc}") from None
    if not isinstance(config, dict):
        raise CLIError(f"{option}: {directory / 'config.json'} does not hold a JSON object")
    model_type = config.get("model_type")
    try:
        if model_type in MODEL_TYPES:
            return Transformer.from_pretrained(directory, dtype=torch.float32).eval()
        try:
            import transformers  # noqa: F401
        except ImportError:
            raise CLIError(
                f"{option}: model_type {model_type!r} needs the transformers package "
                f"(pip install transformers); without it only {', '.join(MODEL_TYPES)} load"
            ) from None
        return HFCausalLM.from_pretrained(directory, dtype=torch.float32)
    except CLIError:
        raise
    except Exception as exc:  # loaders raise many types; the user needs the message only
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CLIError(f"{option}: cannot load the model in {directory}: {message}") from None


def _dir_codec(directory: Path, option: str, target: Any) -> TextCodec:
    """The tokenizer of a model directory: transformers' when the directory has one, else a zoo
    ``tokenizer.model`` in the directory or its parent (the layout of a zoo pair)."""
    eos = [int(t) for t in getattr(getattr(target, "config", None), "eos_token_ids", []) or []]
    if (directory / "tokenizer_config.json").is_file() or (directory / "tokenizer.json").is_file():
        try:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
        except Exception as exc:
            raise CLIError(f"{option}: cannot load the tokenizer in {directory}: {exc}") from None
        stops = eos + ([tok.eos_token_id] if tok.eos_token_id is not None else [])
        return TextCodec(
            lambda text: list(tok(text)["input_ids"]),
            lambda ids: tok.decode(list(ids), skip_special_tokens=True),
            stops,
        )
    from .zoo.tokenizer import Tokenizer

    for candidate in (directory / "tokenizer.model", directory.parent / "tokenizer.model"):
        if candidate.is_file():
            try:
                return _zoo_codec(Tokenizer(candidate))
            except (ValueError, RuntimeError, OSError) as exc:
                raise CLIError(f"{option}: cannot use the tokenizer {candidate}: {exc}") from None
    raise CLIError(
        f"{option}: no tokenizer in {directory} (expected tokenizer.json / tokenizer_config.json, "
        "or a specdecode zoo tokenizer.model)"
    )


def make_drafter(
    kind: str,
    loaded: LoadedModel,
    draft_dir: Optional[str],
    k: int,
    stop_below: Optional[float] = None,
    steering: Any = None,
    specformer: Any = None,
) -> Any:
    """The drafter named by ``--drafter`` for one sequence; ``stop_below`` is the draft model's
    confidence floor and ``steering`` its SD² map (:class:`~specdecode.drafters.ModelDrafter`);
    ``specformer`` the head of ``--drafter specformer`` (default: the zoo pair's shipped one).

    Raises
    ------
    CLIError
        An unknown drafter, a model drafter with no draft model, or ``draft_dir`` or
        ``stop_below`` given to a drafter that runs no draft model.
    """
    from .drafters import CachebackDrafter, ModelDrafter, NoDrafter

    if kind not in DRAFTERS:
        raise CLIError(f"--drafter: unknown drafter {kind!r} (choose from {', '.join(DRAFTERS)})")
    _check_draft_model_option(kind, draft_dir, stop_below, steering)
    if kind == "none":
        return NoDrafter()
    if kind == "cacheback":
        return CachebackDrafter(max_sequences=1, chain=False)
    if kind == "specformer":
        return specformer_drafter(loaded, specformer, k)
    if kind == "edge":
        raise CLIError("--drafter edge: needs --listen HOST:PORT (edge_drafter builds it)")
    draft = loaded.draft
    if draft_dir is not None:
        draft = _load_dir(_check_model_dir(draft_dir, "--draft-model"), "--draft-model")
        draft = _move(draft, loaded.target.device)
    if draft is None:
        raise CLIError(
            f"--drafter {kind}: needs --draft-model DIR (a small model with the target's "
            "vocabulary) when --model is a directory"
        )
    if int(draft.vocab_size) != int(loaded.target.vocab_size):
        raise CLIError(
            f"--draft-model: its vocabulary has {draft.vocab_size} tokens, the target's "
            f"{loaded.target.vocab_size}; draft and target must share one vocabulary"
        )
    try:
        if kind == "model":
            return ModelDrafter(draft, mode="chain", k=k, stop_below=stop_below, steering=steering)
        if kind == "combined":
            return combined_drafter(draft, k, stop_below, steering)
        return ModelDrafter(
            draft,
            mode="tree",
            k=k,
            branch=2,
            beam=4,
            max_nodes=16,
            stop_below=stop_below,
            steering=steering,
        )
    except (TypeError, ValueError) as exc:  # a steering map made for another draft model
        raise CLIError(f"--steering: {exc}") from None


def specformer_drafter(loaded: LoadedModel, head: Any, k: int) -> Any:
    """``--drafter specformer``: a chain of ``min(k, head.k)`` tokens from ``head`` (default: the
    zoo pair's shipped head)."""
    from .specformer import SpecFormerDrafter

    if head is None:
        if loaded.name not in _zoo_names():
            raise CLIError(
                "--drafter specformer: needs --specformer FILE (a head from specdecode "
                "specformer) when --model is a directory"
            )
        head = _load_specformer(loaded.name)
    try:
        return SpecFormerDrafter(_move(head, loaded.target.device), loaded.target, k=min(k, head.k))
    except (TypeError, ValueError) as exc:  # a head made for another target
        raise CLIError(f"--specformer: {exc}") from None


def _load_specformer(spec: Optional[str]) -> Any:
    """``--specformer``: a zoo pair's shipped head (its name; ``NAME:root`` its root-aware one)
    or a file saved by :meth:`specdecode.specformer.SpecFormerHead.save`; None without the
    option."""
    if spec is None:
        return None
    from .specformer import SpecFormerHead

    try:
        name, root = (spec[: -len(":root")], True) if spec.endswith(":root") else (spec, False)
        if not _looks_like_path(spec) and name in _zoo_names():
            from . import zoo

            return zoo.load_specformer(name, root_aware=root)
        return SpecFormerHead.load(Path(spec).expanduser())
    except (FileNotFoundError, ValueError) as exc:
        raise CLIError(f"--specformer: {exc}") from None


def _check_draft_model_option(
    kind: str, draft_dir: Optional[str], stop_below: Optional[float] = None, steering: Any = None
) -> None:
    """``--draft-model``, ``--stop-below`` and ``--steering`` only with a drafter that runs a
    draft model: ignoring them would decode with another method than the user asked for."""
    for option, value in (
        ("--draft-model", draft_dir),
        ("--stop-below", stop_below),
        ("--steering", steering),
    ):
        if value is not None and kind not in MODEL_DRAFTERS:
            raise CLIError(
                f"{option}: not used by --drafter {kind} (only by --drafter "
                f"{', '.join(MODEL_DRAFTERS)}); drop one of the two options"
            )


EDGE_KEY_ENV = "SPECDECODE_EDGE_KEY"
EDGE_CACHEBACK_SEQUENCES = 64  # an edge-worker's n-gram tables: sequences drafted at once


def _edge_key() -> bytes:
    """The shared secret of ``--drafter edge`` and ``edge-worker`` (the environment's
    ``SPECDECODE_EDGE_KEY``; never an option, which would show in the process list)."""
    key = os.environ.get(EDGE_KEY_ENV, "").encode()
    if len(key) < 8:
        raise CLIError(
            f"{EDGE_KEY_ENV}: set it to the same secret of at least 8 characters on the server "
            "and every worker (it authenticates the link, which carries pickles)"
        )
    return key


def _host_port(text: str, option: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise CLIError(f"{option}: expected HOST:PORT (e.g. 127.0.0.1:7070), got {text!r}")
    return host, int(port)


def edge_drafter(listen: Optional[str], deadline: Optional[float], workers: int = 1) -> Any:
    """``--drafter edge``: waits on ``listen`` for ``workers`` draft workers
    (``specdecode edge-worker``) and drafts through them
    (:class:`specdecode.edge.RemoteDrafter`)."""
    from .edge import RemoteDrafter, WorkerError, WorkerListener

    if listen is None:
        raise CLIError("--drafter edge: needs --listen HOST:PORT (where the workers connect)")
    address = _host_port(listen, "--listen")
    key = _edge_key()
    try:
        with WorkerListener(address, key) as listener:
            host, port = listener.address
            sys.stderr.write(
                f"[edge] waiting for {workers} draft worker{'s' if workers > 1 else ''} on "
                f"{host}:{port} (specdecode edge-worker --connect {host}:{port})\n"
            )
            sys.stderr.flush()
            conns = listener.accept(workers)
        return RemoteDrafter(conns, deadline=deadline)
    except OSError as exc:
        raise CLIError(f"--listen: {listen}: {exc}") from None
    except WorkerError as exc:
        raise CLIError(f"--drafter edge: {exc}") from None


def _edge_worker_drafter(args: argparse.Namespace) -> Any:
    """The drafter ``edge-worker`` serves: the zoo pair's draft model or ``--draft-model DIR``
    (no target is loaded on the worker; with ``--steering``, steered by the target's states the
    server sends), or Cacheback."""
    from .drafters import CachebackDrafter, ModelDrafter

    if args.drafter == "cacheback":
        for option, value in (("--draft-model", args.draft_model), ("--steering", args.steering)):
            if value is not None:
                raise CLIError(f"{option}: not used by --drafter cacheback")
        return CachebackDrafter(max_sequences=EDGE_CACHEBACK_SEQUENCES)
    steering = _load_steering(args.steering)
    if args.draft_model is not None:
        draft = _load_dir(_check_model_dir(args.draft_model, "--draft-model"), "--draft-model")
    elif args.model in _zoo_names():
        from . import zoo

        draft = zoo.load(args.model)[1]
    else:
        raise CLIError(f"--model: unknown zoo pair {args.model!r}; or give --draft-model DIR")
    draft = _move(draft, _device_option(args.device))
    mode = "tree" if args.drafter == "model-tree" else "chain"
    extra = dict(branch=2, beam=4, max_nodes=16) if mode == "tree" else {}
    try:
        return ModelDrafter(draft, mode=mode, k=args.k, steering=steering, **extra)
    except (TypeError, ValueError) as exc:
        if steering is None:
            raise
        raise CLIError(f"--steering: {exc}") from None


def _cmd_edge_worker(args: argparse.Namespace) -> int:
    from .edge import connect_worker

    address = _host_port(args.connect, "--connect")
    key = _edge_key()
    threads = _set_threads(args.threads, small_model=args.draft_model is None)
    drafter = _edge_worker_drafter(args)
    sys.stderr.write(
        f"[edge-worker] {type(drafter).__name__} ({args.drafter}), {threads} torch "
        f"thread{'s' if threads != 1 else ''}; connecting to {args.connect}\n"
    )
    sys.stderr.flush()
    try:
        served = connect_worker(address, key, drafter, retry_for=args.retry_for)
    except OSError as exc:
        raise CLIError(f"--connect: {args.connect}: {exc}") from None
    sys.stderr.write(f"[edge-worker] the server closed the link after {served} requests\n")
    return 0


def combined_drafter(
    draft: Any, k: int, stop_below: Optional[float] = None, steering: Any = None
) -> Any:
    """Cacheback first (its tree wherever the n-gram tables have a draft), the draft model's
    chain of ``k`` tokens where they have none: ``--drafter combined`` and the demo's row."""
    from .drafters import CachebackDrafter, CombinedDrafter, ModelDrafter

    return CombinedDrafter(
        CachebackDrafter(max_sequences=1),
        ModelDrafter(draft, mode="chain", k=k, stop_below=stop_below, steering=steering),
    )


def _load_steering(spec: Optional[str]) -> Any:
    """``--steering``: a zoo pair's shipped map (its name) or a file saved by
    :meth:`specdecode.steering.DraftSteering.save`; None without the option."""
    if spec is None:
        return None
    from .steering import DraftSteering

    try:
        if not _looks_like_path(spec) and spec in _zoo_names():
            from . import zoo

            return zoo.load_steering(spec)
        return DraftSteering.load(Path(spec).expanduser())
    except (FileNotFoundError, ValueError) as exc:
        raise CLIError(f"--steering: {exc}") from None


def _set_threads(threads: Optional[int], small_model: bool) -> int:
    """Sets torch's intra-op threads: ``threads``, else 1 for the zoo's small models (their
    matrices are too small to split, and OpenMP's spin-waiting makes extra threads ten times
    slower on a machine whose cores are busy), else the cores up to 4. specdecode's kernels run
    on torch's OpenMP team with the same count (:func:`specdecode.get_threading`)."""
    import torch

    if threads is None:
        threads = 1 if small_model else max(1, min(os.cpu_count() or 1, 4))
    torch.set_num_threads(threads)
    return threads


# ---- generate ------------------------------------------------------------------------------------


class Streamer:
    """``on_step`` callback that writes the decoded text of one sequence as it grows.

    Decoding the whole generated sequence each time (rather than each step's tokens alone)
    keeps multi-token characters and tokenizers that merge across tokens right; text ending in
    U+FFFD is an incomplete UTF-8 sequence and waits for its remaining bytes.
    """

    def __init__(self, codec: TextCodec, out: TextIO) -> None:
        self.codec = codec
        self.out = out
        self.ids: List[int] = []
        self.shown = 0

    def __call__(self, row: int, new_tokens: List[int]) -> None:
        self.ids.extend(new_tokens)
        self._write(final=False)

    def _write(self, final: bool) -> None:
        text = self.codec.decode(self.ids)
        if not final and text.endswith("\ufffd"):
            return
        if len(text) > self.shown:
            self.out.write(text[self.shown :])
            self.out.flush()
            self.shown = len(text)

    def finish(self) -> str:
        """Writes what is still held back; returns the whole generated text."""
        self._write(final=True)
        return self.codec.decode(self.ids)


def _read_prompt(spec: str) -> str:
    """PROMPT's text: ``spec`` itself, or stdin for ``-``.

    Raises
    ------
    CLIError
        An empty prompt (or empty stdin): there is no text to continue, and tokenizers that add
        no begin-of-sequence token would give no token at all.
    """
    if spec != "-":
        if not spec:
            raise CLIError("PROMPT: empty; give some text to continue (or '-' to read stdin)")
        return spec
    text = sys.stdin.read()
    if not text:
        raise CLIError("PROMPT: '-' read no text from stdin; give some text to continue")
    return text


def _cmd_generate(args: argparse.Namespace) -> int:
    if args.drafter not in DRAFTERS:  # argparse checks choices; kept for direct callers
        raise CLIError(f"--drafter: unknown drafter {args.drafter!r}")
    _check_draft_model_option(args.drafter, args.draft_model, args.stop_below, args.steering)
    prompt = _read_prompt(args.prompt)
    threads = _set_threads(args.threads, small_model=not _looks_like_path(args.model))
    device = _device_option(args.device)
    loaded = load_model(args.model)
    loaded.target = _move(loaded.target, device)
    loaded.draft = _move(loaded.draft, device)
    try:
        ids = loaded.codec.encode(prompt)
    except (TypeError, ValueError) as exc:
        raise CLIError(f"PROMPT: cannot be encoded: {exc}") from None
    if not ids:
        raise CLIError("PROMPT: encodes to no tokens; give some text")
    limit = int(loaded.target.max_length)
    if len(ids) + args.max_new_tokens > limit:
        raise CLIError(
            f"PROMPT: {len(ids)} tokens plus --max-new-tokens {args.max_new_tokens} exceed the "
            f"model's max length of {limit} tokens; shorten the prompt or lower --max-new-tokens"
        )
    steering = _load_steering(args.steering)
    if args.specformer is not None and args.drafter != "specformer":
        raise CLIError(
            f"--specformer: not used by --drafter {args.drafter} (only by --drafter "
            "specformer); drop one of the two options"
        )
    if args.drafter != "edge" and (args.listen, args.deadline) != (None, None):
        option = "--listen" if args.listen is not None else "--deadline"
        raise CLIError(
            f"{option}: not used by --drafter {args.drafter} (only by --drafter edge); drop "
            "one of the two options"
        )
    judge = _load_judge(args.judge, args.temperature)
    if args.drafter == "edge":
        drafter = edge_drafter(args.listen, args.deadline)
    else:
        drafter = make_drafter(
            args.drafter,
            loaded,
            args.draft_model,
            args.k,
            args.stop_below,
            steering,
            _load_specformer(args.specformer),
        )

    from .engine import generate

    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(7), "little")
    if args.echo:
        sys.stdout.write(prompt)
        sys.stdout.flush()
    streamer = Streamer(loaded.codec, sys.stdout)
    try:
        out = generate(
            loaded.target,
            [ids],
            drafter=drafter,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            seed=seed,
            stop_token_ids=loaded.codec.stop_ids,
            on_step=streamer,
            judge=judge,
            method=args.verify,
        )
    except (TypeError, ValueError) as exc:
        raise CLIError(str(exc)) from None
    except RuntimeError as exc:
        from .edge import WorkerError

        if isinstance(exc, WorkerError):  # a worker failed or went away: one line, no trace
            raise CLIError(f"--drafter edge: {exc}") from None
        raise
    finally:
        close = getattr(drafter, "close", None)
        if callable(close):  # an edge drafter tells its workers to stop
            close()
    streamer.finish()
    sys.stdout.write("\n")
    sys.stdout.flush()
    stats = out.stats
    accepted = ", ".join(f"{a:.2f}" for a in stats.accepted_by_position) or "-"
    sys.stderr.write(
        f"[{args.drafter}] {stats.summary()}\n"
        f"[{args.drafter}] finish: {out.finish_reasons[0]}; prompt {len(ids)} tokens; "
        f"accept rate by draft position: {accepted}; temperature {args.temperature}, "
        f"top-k {args.top_k}, top-p {args.top_p}, seed {seed}, {args.verify} verification, "
        f"{threads} torch "
        f"thread{'s' if threads != 1 else ''}, on {_device_name(device)}\n"
    )
    if judge is not None:
        sys.stderr.write(
            f"[{args.drafter}] judge {args.judge}: accepted {stats.judge_accepted} mismatches\n"
        )
    if args.drafter == "edge":
        link = drafter.stats
        sys.stderr.write(
            f"[edge] worker rounds {link.rounds}, late {link.late}; link {link.bytes_sent} bytes "
            f"sent, {link.bytes_received} received; target states sent for {link.states_sent} "
            "sequence-steps\n"
        )
    return 0


def _load_judge(path: Optional[str], temperature: float) -> Any:
    """The ``--judge`` file as a TokenJudge (None without the option)."""
    if path is None:
        return None
    if temperature != 0:
        raise CLIError(
            f"--judge: judge decoding is greedy; use --temperature 0 (got {temperature})"
        )
    from .judge import TokenJudge

    try:
        return TokenJudge.load(path)
    except (FileNotFoundError, ValueError) as exc:
        raise CLIError(f"--judge: {exc}") from None


# ---- demo ----------------------------------------------------------------------------------------


class ProgressBar:
    """A one-line progress bar on a stream (stderr), redrawn at most every 0.1 s."""

    def __init__(self, total: int, label: str = "", stream: TextIO | None = None) -> None:
        self.total = max(int(total), 1)
        self.count = 0
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.start = time.perf_counter()
        self._drawn = 0.0
        self._width = 0  # characters of the last line drawn

    def update(self, n: int, label: Optional[str] = None) -> None:
        self.count = min(self.count + int(n), self.total)
        if label is not None:
            self.label = label
        now = time.perf_counter()
        if now - self._drawn >= 0.1 or self.count == self.total:
            self._draw(now)

    def _draw(self, now: float) -> None:
        width = 24
        filled = width * self.count // self.total
        bar = "#" * filled + "." * (width - filled)
        line = f"[{bar}] {self.count}/{self.total} tokens {now - self.start:5.1f}s {self.label}"
        # Blanks over whatever a longer earlier line left past this one's end.
        self.stream.write(f"\r{line:<{self._width}}")
        self._width = len(line)
        self.stream.flush()
        self._drawn = now

    def close(self) -> None:
        self._draw(time.perf_counter())
        self.stream.write("\n")
        self.stream.flush()


@dataclasses.dataclass
class DemoRow:
    """Totals of one drafter over the demo's prompts."""

    name: str
    new_tokens: int = 0
    row_steps: int = 0
    seconds: float = 0.0
    outputs: List[List[int]] = dataclasses.field(default_factory=list)
    # A CombinedDrafter's row: the steps its fallback (the draft model) drafted.
    fallback_steps: int = 0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def tokens_per_step(self) -> float:
        return self.new_tokens / self.row_steps if self.row_steps else 0.0


def find_mismatches(baseline: DemoRow, others: Sequence[DemoRow]) -> List[str]:
    """One line per (drafter, prompt) whose output differs from the baseline's, naming the
    first differing position; empty when every output is identical."""
    lines = []
    for row in others:
        for i, (want, got) in enumerate(zip(baseline.outputs, row.outputs)):
            if want == got:
                continue
            first = next((j for j, (a, b) in enumerate(zip(want, got)) if a != b), None)
            if first is None:
                first = min(len(want), len(got))
            lines.append(
                f"{row.name}: prompt {i + 1} differs from autoregressive at new token {first} "
                f"({len(got)} vs {len(want)} tokens)"
            )
        if len(row.outputs) != len(baseline.outputs):
            lines.append(
                f"{row.name}: {len(row.outputs)} outputs, expected {len(baseline.outputs)}"
            )
    return lines


def format_table(rows: Sequence[DemoRow], baseline: DemoRow) -> str:
    """The speedup table: tokens/s, tokens per step and speedup over ``baseline``."""
    name_width = max(len("drafter"), *(len(r.name) for r in rows))
    lines = [f"{'drafter':<{name_width}}  {'tokens/s':>9}  {'tokens/step':>11}  {'speedup':>7}"]
    lines.append("-" * len(lines[0]))
    base = baseline.tokens_per_second
    for r in rows:
        speedup = r.tokens_per_second / base if base > 0 else 0.0
        lines.append(
            f"{r.name:<{name_width}}  {r.tokens_per_second:>9.1f}  {r.tokens_per_step:>11.2f}  "
            f"{speedup:>6.2f}x"
        )
    return "\n".join(lines)


def _device(text: str) -> str:
    """``--device`` as argparse parses it: ``cpu`` (``cpu:0`` is the same, torch has one CPU
    device), ``cuda`` or ``cuda:N``, returned in torch's spelling (``cpu:0`` as ``cpu``). Whether
    torch sees that GPU is checked when the command runs (:func:`_device_option`)."""
    import torch

    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a device (cpu, cuda or cuda:N)"
        ) from None
    if device.type == "cpu":
        if device.index not in (None, 0):
            raise argparse.ArgumentTypeError(
                f"torch has one CPU device, cpu (or cpu:0); got {text!r}"
            )
        return "cpu"
    if device.type != "cuda":
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {text!r}")
    return str(device)


def _device_option(spec: str) -> Any:
    """``--device``: a torch device the models and the kernels can run on.

    Raises
    ------
    CLIError
        An unparsable device, a CPU index other than 0, a GPU that torch does not see, or a
        build without CUDA kernels.
    """
    import torch

    from ._info import info

    try:
        device = torch.device(_device(spec))
    except argparse.ArgumentTypeError as exc:
        raise CLIError(f"--device: {exc}") from None
    if device.type == "cpu":
        return device
    if not torch.cuda.is_available():
        raise CLIError(f"--device {spec}: torch sees no CUDA device here")
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise CLIError(f"--device {spec}: torch sees {torch.cuda.device_count()} CUDA device(s)")
    if not info()["cuda"]["compiled"]:
        raise CLIError(
            f"--device {spec}: this build of specdecode has no CUDA kernels (reinstall it with "
            "nvcc present, or SPECDECODE_CUDA=ON)"
        )
    return device


def _add_device_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--device",
        type=_device,
        default="cpu",
        help="where the models and kernels run: cpu (default; cpu:0 is the same device), cuda "
        "or cuda:N (a GPU torch sees, with a build of specdecode that has CUDA kernels)",
    )


def _move(model: Any, device: Any) -> Any:
    """The model on ``device``: our ``Transformer`` is a module; ``HFCausalLM`` moves the
    transformers module it wraps (in place) and follows it."""
    import torch

    if model is None:
        return None
    if isinstance(model, torch.nn.Module):
        return model.to(device)
    model.model.to(device)
    return model


def _device_name(device: Any) -> str:
    import torch

    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return str(device)


def _shipped_steering(name: str, device: Any) -> Any:
    """The zoo pair's shipped steering map on ``device`` (the demo's steered row), or None
    when the pair ships none."""
    from . import zoo

    try:
        return _move(zoo.load_steering(name), device)
    except FileNotFoundError:
        return None


def _shipped_specformer(name: str, device: Any, root_aware: bool = False) -> Any:
    """The zoo pair's shipped SpecFormer head (the paper's or the root-aware one) on ``device``
    (the demo's SpecFormer rows), or None when the pair ships none."""
    from . import zoo

    try:
        return _move(zoo.load_specformer(name, root_aware=root_aware), device)
    except FileNotFoundError:
        return None


def _cmd_demo(args: argparse.Namespace) -> int:
    from .drafters import CachebackDrafter, ModelDrafter, NoDrafter
    from .engine import generate

    threads = _set_threads(args.threads, small_model=True)
    names = _zoo_names()
    if args.model not in names:
        raise CLIError(f"--model: unknown zoo model {args.model!r} (known: {', '.join(names)})")
    device = _device_option(args.device)
    t_load = time.perf_counter()
    loaded = load_model(args.model)
    load_seconds = time.perf_counter() - t_load
    target, draft, codec = _move(loaded.target, device), _move(loaded.draft, device), loaded.codec
    texts = list(DEMO_PROMPTS[: args.prompts])
    prompts = [codec.encode(t) for t in texts]
    longest = max(len(p) for p in prompts)
    if longest + args.max_new_tokens > int(target.max_length):
        raise CLIError(
            f"--max-new-tokens: {args.max_new_tokens} plus the longest demo prompt ({longest} "
            f"tokens) exceed the model's max length {target.max_length}"
        )
    k = args.k
    steering = _shipped_steering(args.model, device)
    drafters: List[tuple[str, Callable[[], Any]]] = [
        ("autoregressive", lambda: NoDrafter()),
        ("Cacheback", lambda: CachebackDrafter(max_sequences=1)),
        (f"draft model (chain, k={k})", lambda: ModelDrafter(draft, mode="chain", k=k)),
    ]
    if steering is not None:
        drafters.append(
            (
                f"steered draft model (chain, k={k})",
                lambda: ModelDrafter(draft, mode="chain", k=k, steering=steering),
            )
        )
    drafters += [
        (
            f"draft model (tree, k={k})",
            lambda: ModelDrafter(draft, mode="tree", k=k, branch=2, beam=4, max_nodes=16),
        ),
        (f"Cacheback + draft model (chain, k={k})", lambda: combined_drafter(draft, k)),
    ]
    for root_aware, label in ((False, "SpecFormer head"), (True, "root-aware SpecFormer head")):
        head = _shipped_specformer(args.model, device, root_aware)
        if head is None:
            continue
        from .specformer import SpecFormerDrafter

        depth = min(k, head.k)
        # Before the combined row: the demo's note reads the last row's fallback steps.
        drafters.insert(
            len(drafters) - 1,
            (
                f"{label} (chain, k={depth})",
                lambda head=head, depth=depth: SpecFormerDrafter(head, target, k=depth),
            ),
        )

    def params(model: Any) -> str:
        return f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M"

    print(
        f"specdecode demo: zoo pair {args.model!r} (target {params(target)} parameters, draft "
        f"{params(draft)}), {len(prompts)} Python prompts, up to {args.max_new_tokens} new tokens "
        f"each, greedy, batch 1, best of {args.repeats} runs, {threads} torch "
        f"thread{'s' if threads != 1 else ''}, on {_device_name(device)} "
        f"(loaded in {load_seconds:.1f}s)",
        flush=True,
    )
    # One short run per drafter first, so that no row of the table pays for first-call costs
    # (lazy initialisation, allocator warm-up).
    for _, make in drafters:
        generate(target, [prompts[0]], drafter=make(), max_new_tokens=4, temperature=0.0)

    rows = [DemoRow(name) for name, _ in drafters]
    bar = ProgressBar(len(prompts) * len(drafters) * args.repeats * args.max_new_tokens)
    done = 0
    # Prompts outer, drafters inner: load from other processes then spreads over all drafters
    # alike instead of landing on whichever runs during a busy moment.
    # Each (prompt, drafter) counts its fastest of --repeats runs: on a shared machine a run
    # can only be slowed down by other load, never sped up. Every repeat's output is checked.
    mismatched_repeats = []
    for i, ids in enumerate(prompts):
        for row, (name, make) in zip(rows, drafters):
            best = None
            for rep in range(args.repeats):
                bar.update(0, f"prompt {i + 1}/{len(prompts)}, {name}")
                drafter = make()
                out = generate(
                    target,
                    [ids],
                    drafter=drafter,
                    max_new_tokens=args.max_new_tokens,
                    temperature=0.0,
                    stop_token_ids=codec.stop_ids,
                    on_step=lambda _row, new: bar.update(len(new)),
                )
                if best is not None and out.sequences != best.sequences:
                    mismatched_repeats.append(f"{name}: prompt {i + 1}, repeat {rep + 1}")
                if best is None or out.stats.wall_time < best.stats.wall_time:
                    best = out
                    fallback_steps = getattr(drafter, "counts", {}).get("fallback", 0)
                done += args.max_new_tokens
                # A run that stopped early (end of sequence) still fills its share of the bar.
                bar.update(done - bar.count)
            row.new_tokens += best.stats.new_tokens
            row.row_steps += best.stats.row_steps
            row.seconds += best.stats.wall_time
            row.outputs.append(best.sequences[0])
            row.fallback_steps += fallback_steps
    bar.close()

    for i, (text, out_ids) in enumerate(zip(texts, rows[0].outputs)):
        print(f"\n--- prompt {i + 1} + generated code ---")
        print(text + codec.decode(out_ids))
    print()
    print(format_table(rows, rows[0]))
    combined = rows[-1]
    print(
        "(last row: Cacheback's tree where its n-gram tables have a draft, the draft model's "
        f"chain where they have none: {combined.fallback_steps} of {combined.row_steps} steps)"
    )
    mismatches = find_mismatches(rows[0], rows[1:]) + [
        f"{line} differs from the same drafter's other runs" for line in mismatched_repeats
    ]
    if mismatches:
        print("greedy outputs are NOT the same as autoregressive:")
        for line in mismatches:
            print(f"  {line}")
        return EXIT_MISMATCH
    print(
        f"greedy outputs of all {len(rows) - 1} drafters are identical to autoregressive "
        f"({len(prompts)} prompts, {sum(len(o) for o in rows[0].outputs)} tokens each drafter)"
    )
    return 0


# ---- info ----------------------------------------------------------------------------------------


# ---- judge ---------------------------------------------------------------------------------------

JUDGE_CHECKS = ("python-code", "final-number")


def _load_pair(args: argparse.Namespace, device: Any) -> tuple[LoadedModel, Any, Any]:
    """``--model`` and ``--draft-model`` (default: the zoo pair's draft) of ``judge`` and
    ``steer``, both on ``device``."""
    loaded = load_model(args.model)
    target = _move(loaded.target, device)
    draft = loaded.draft
    if args.draft_model is not None:
        draft = _load_dir(_check_model_dir(args.draft_model, "--draft-model"), "--draft-model")
    if draft is None:
        raise CLIError("--draft-model: needed (a small model with the target's vocabulary)")
    return loaded, target, _move(draft, device)


def _add_pair_arguments(parser: argparse.ArgumentParser) -> None:
    """``--model`` and ``--draft-model`` of the commands that fit something to a pair."""
    parser.add_argument(
        "--model",
        default="pycode",
        help="a zoo pair name (default: pycode) or a local Hugging Face model directory",
    )
    parser.add_argument(
        "--draft-model", metavar="DIR", default=None, help="draft model (default: the zoo pair's)"
    )


def _add_training_arguments(
    parser: argparse.ArgumentParser, what: str, steps: int, lr: float
) -> None:
    """The text, optimiser and output options of the commands that train a piece on text
    (``steer``, ``specformer``); ``what`` names the piece in the help."""
    from .zoo._paths import float_in

    parser.add_argument(
        "--text",
        metavar="FILE",
        action="append",
        default=None,
        help="UTF-8 text to train on (repeatable; the last tenth of its tokens is held out); "
        "default: the zoo pair's corpus",
    )
    parser.add_argument(
        "--tokens",
        type=_int_at_least(1024, "an integer >= 1024"),
        default=400_000,
        help="training tokens read from the zoo corpus (default 400000)",
    )
    parser.add_argument(
        "--seq-len", type=_int_at_least(4, "an integer >= 4"), default=256, help="(default 256)"
    )
    parser.add_argument("--steps", type=_positive_int, default=steps, help=f"(default {steps})")
    parser.add_argument("--batch-size", type=_positive_int, default=8, help="(default 8)")
    parser.add_argument(
        "--lr",
        type=float_in(0.0, 1.0, low_open=True),
        default=lr,
        help=f"peak learning rate (default {lr:g})",
    )
    parser.add_argument("--held-out-windows", type=_positive_int, default=48, help="(default 48)")
    parser.add_argument("--seed", type=_seed, default=0, help="(default 0)")
    parser.add_argument(
        "--dtype",
        choices=("float32", "float16"),
        default="float32",
        help=f"precision of the saved {what} (default float32)",
    )
    _add_device_argument(parser)
    _add_threads_argument(parser)


def _add_threads_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--threads",
        type=_positive_int,
        default=None,
        help="torch threads, and the kernels' (default: 1 for a zoo model, else the cores up to 4)",
    )


def _judge_prompts(args: argparse.Namespace) -> List[str]:
    """The prompt texts of ``specdecode judge``: ``--prompts FILE`` (JSON Lines, each line a
    string or an object with a ``"prompt"`` string) or ``--humaneval N``."""
    if (args.prompts is None) == (args.humaneval is None):
        raise CLIError("give the prompts with either --prompts FILE or --humaneval N")
    if args.humaneval is not None:
        from .benchmark import humaneval_prompts

        try:
            return humaneval_prompts(args.humaneval)
        except ModuleNotFoundError as exc:
            raise CLIError(f"--humaneval: {exc}") from None
    path = Path(args.prompts).expanduser()
    if not path.is_file():
        raise CLIError(f"--prompts: no file {args.prompts}")
    texts = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as exc:
                raise CLIError(f"--prompts: {path}:{number}: not JSON ({exc.msg})") from None
            if isinstance(item, dict):
                item = item.get("prompt")
            if not isinstance(item, str) or not item:
                raise CLIError(
                    f"--prompts: {path}:{number}: expected a non-empty JSON string or an object "
                    'with a "prompt" string'
                )
            texts.append(item)
    if len(texts) < 2:
        raise CLIError(f"--prompts: {path} holds {len(texts)} prompt(s); the judge needs 2 or more")
    return texts


def _cmd_judge(args: argparse.Namespace) -> int:
    from .judge import TokenJudge, mine_important_tokens, same_final_number, same_python_code
    from .zoo._paths import writable_file

    try:
        out_path = writable_file(Path(args.out).expanduser(), "--out")
    except (FileNotFoundError, ValueError) as exc:
        raise CLIError(str(exc)) from None
    texts = _judge_prompts(args)
    held_count = max(1, round(args.held_out * len(texts)))
    if held_count >= len(texts):
        raise CLIError(
            f"--held-out {args.held_out}: leaves no prompt to fit on ({len(texts)} prompts)"
        )
    threads = _set_threads(args.threads, small_model=not _looks_like_path(args.model))
    device = _device_option(args.device)
    loaded, target, draft = _load_pair(args, device)
    codec = loaded.codec
    ids = [codec.encode(t) for t in texts]
    if any(not row for row in ids):
        raise CLIError("--prompts: a prompt encodes to no tokens")
    check = {"python-code": same_python_code, "final-number": same_final_number}[args.check]

    def equivalent(prompt: List[int], reference: List[int], candidate: List[int]) -> bool:
        return check(codec.decode(reference), codec.decode(candidate))

    try:
        mined = mine_important_tokens(
            target,
            draft,
            ids,
            equivalent,
            max_new_tokens=args.max_new_tokens,
            stop_token_ids=codec.stop_ids,
            draft_k=args.k,
            progress=True,
        )
    except (TypeError, ValueError) as exc:
        raise CLIError(str(exc)) from None
    split = len(ids) - held_count
    fit_set, held = mined.select(range(split)), mined.select(range(split, len(ids)))
    sys.stderr.write(f"mined: {mined.summary()}; {threads} torch threads\n")
    try:
        judge = TokenJudge.fit(fit_set.features, fit_set.important, recall=args.recall)
    except ValueError as exc:
        raise CLIError(
            f"cannot fit a judge on {fit_set.summary()} ({exc}); give more prompts, longer "
            "responses (--max-new-tokens) or another --check"
        ) from None
    where = "the fitting prompts' mismatches"
    if 0 < int(held.important.sum()) < held.important.numel():
        judge = judge.with_threshold(
            judge.threshold_for_recall(held.features, held.important, args.recall)
        )
        where = f"the held-out prompts' mismatches ({held.summary()})"
    scores = judge.importance(held.features) if held.important.numel() else None
    judge.save(out_path)
    print(
        f"judge: {judge.num_features} features, threshold {judge.threshold:.4g} "
        f"(recall {args.recall} on {where})"
    )
    if scores is not None:
        allowed = scores < judge.threshold
        for name, rows in (("unimportant", ~held.important), ("important", held.important)):
            if rows.any():
                share = float(allowed[rows].double().mean())
                print(f"held out: accepts {share:.1%} of the {name} mismatches")
    print(f"saved to {out_path}; decode with: specdecode generate --judge {out_path} ...")
    return 0


# ---- steer ---------------------------------------------------------------------------------------


def _training_streams(args: argparse.Namespace, loaded: LoadedModel) -> tuple[List[int], List[int]]:
    """The training and held-out token streams of ``specdecode steer`` and ``specformer``:
    ``--text`` files (the
    last tenth of their tokens held out), else a zoo pair's own corpus (the Python standard
    library's sources, with the pair's held-out split), each file ``[bos] + text + [eos]``."""
    if args.text:
        tokens: List[int] = []
        for name in args.text:
            f = Path(name).expanduser()
            if not f.is_file():
                raise CLIError(f"--text: {name} is not a file")
            try:
                tokens.extend(loaded.codec.encode(f.read_text(encoding="utf-8")))
            except UnicodeDecodeError:
                raise CLIError(f"--text: {name} is not UTF-8 text") from None
        cut = len(tokens) - len(tokens) // 10
        return tokens[:cut], tokens[cut:]
    if _looks_like_path(args.model):
        raise CLIError("--text: needed with a model directory (text to train on)")
    from . import zoo
    from .zoo.corpus import Corpus

    tok = zoo.load_tokenizer(loaded.name)
    corpus = Corpus.collect()
    streams = []
    for heldout, limit in ((False, args.tokens), (True, max(args.tokens // 10, 4 * args.seq_len))):
        ids: List[int] = []
        for text in corpus.texts(heldout=heldout):
            ids.extend(tok.encode(text, bos=True, eos=True))
            if len(ids) >= limit:
                break
        streams.append(ids[:limit])
    return streams[0], streams[1]


def _windows(tokens: List[int], seq: int, what: str) -> Any:
    import torch

    n = len(tokens) // seq
    if n < 1:
        raise CLIError(f"{what}: {len(tokens)} tokens, fewer than one window of --seq-len {seq}")
    return torch.tensor(tokens[: n * seq], dtype=torch.int64).view(n, seq)


def _cmd_steer(args: argparse.Namespace) -> int:
    import torch

    from .steering import fit_steering
    from .zoo._paths import writable_file

    try:
        out_path = writable_file(Path(args.out).expanduser(), "--out")
    except (FileNotFoundError, ValueError) as exc:
        raise CLIError(str(exc)) from None
    threads = _set_threads(args.threads, small_model=not _looks_like_path(args.model))
    device = _device_option(args.device)
    loaded, target, draft = _load_pair(args, device)
    if not callable(getattr(draft, "forward_train", None)):
        raise CLIError(
            "--draft-model: a steered draft model must load as specdecode's Transformer "
            "(Llama / Qwen / Mistral / Phi-3 families)"
        )
    limit = min(int(target.max_length), int(draft.max_length))
    if args.seq_len > limit:
        raise CLIError(f"--seq-len: {args.seq_len} exceeds the models' max length {limit}")
    train, held = _training_streams(args, loaded)
    windows = _windows(train, args.seq_len, "training text")
    held_out = _windows(held, args.seq_len, "held-out text")[: args.held_out_windows]
    sys.stderr.write(
        f"steer: {windows.shape[0]} training windows and {held_out.shape[0]} held-out windows "
        f"of {args.seq_len} tokens; {args.steps} steps of {args.batch_size}; {threads} torch "
        f"thread{'s' if threads != 1 else ''}, on {_device_name(device)}\n"
    )
    try:
        fit = fit_steering(
            target,
            draft,
            windows,
            k=args.k,
            steps=args.steps,
            batch_size=args.batch_size,
            lr=args.lr,
            rank=args.rank,
            held_out=held_out,
            seed=args.seed,
            progress=True,
        )
    except (TypeError, ValueError) as exc:
        raise CLIError(str(exc)) from None
    dtype = {"float32": torch.float32, "float16": torch.float16}[args.dtype]
    fit.steering.save(out_path, dtype=dtype)
    r = fit.held_out
    print(
        f"held out: KL(target || draft) {r['kl_unsteered']:.4f} -> {r['kl_steered']:.4f} nats, "
        f"greedy agreement {r['agreement_unsteered']:.2%} -> {r['agreement_steered']:.2%}"
    )
    print(f"saved to {out_path}; decode with: specdecode generate --steering {out_path} ...")
    return 0


# ---- specformer ----------------------------------------------------------------------------------


def _cmd_specformer(args: argparse.Namespace) -> int:
    import torch

    from .specformer import fit_specformer
    from .zoo._paths import writable_file

    try:
        out_path = writable_file(Path(args.out).expanduser(), "--out")
    except (FileNotFoundError, ValueError) as exc:
        raise CLIError(str(exc)) from None
    threads = _set_threads(args.threads, small_model=not _looks_like_path(args.model))
    device = _device_option(args.device)
    loaded = load_model(args.model)
    target = _move(loaded.target, device)
    if args.seq_len > int(target.max_length):
        raise CLIError(
            f"--seq-len: {args.seq_len} exceeds the model's max length {target.max_length}"
        )
    if args.seq_len < args.k + 2:
        raise CLIError(f"--seq-len: {args.seq_len} holds no position with -k {args.k} targets")
    train, held = _training_streams(args, loaded)
    windows = _windows(train, args.seq_len, "training text")
    held_out = _windows(held, args.seq_len, "held-out text")[: args.held_out_windows]
    sys.stderr.write(
        f"specformer: {windows.shape[0]} training windows and {held_out.shape[0]} held-out "
        f"windows of {args.seq_len} tokens; {args.steps} steps of {args.batch_size}; {threads} "
        f"torch thread{'s' if threads != 1 else ''}, on {_device_name(device)}\n"
    )
    try:
        fit = fit_specformer(
            target,
            windows,
            k=args.k,
            steps=args.steps,
            batch_size=args.batch_size,
            positions_per_window=args.positions,
            root_aware=args.root_aware,
            lr=args.lr,
            held_out=held_out,
            seed=args.seed,
            progress=True,
        )
    except (TypeError, ValueError) as exc:
        raise CLIError(str(exc)) from None
    dtype = {"float32": torch.float32, "float16": torch.float16}[args.dtype]
    fit.head.save(out_path, dtype=dtype)
    r = fit.held_out
    by_slot = ", ".join(f"{a:.2%}" for a in r["agreement_by_slot"])
    print(
        f"held out: KL(target || slot) {r['kl']:.4f} nats, greedy agreement {r['agreement']:.2%} "
        f"(by slot: {by_slot})"
    )
    print(
        f"saved to {out_path}; decode with: specdecode generate --drafter specformer "
        f"--specformer {out_path} ..."
    )
    return 0


def _cmd_info(args: argparse.Namespace) -> int:
    from ._info import format_info, info

    if args.json:
        print(json.dumps(info(), indent=2))
    else:
        print(format_info())
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from .benchmark import run_from_args

    return run_from_args(args, " ".join(["specdecode", *sys.argv[1:]]))


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="specdecode", description="Speculative decoding for PyTorch models.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    p_demo = sub.add_parser(
        "demo",
        help="decode Python prompts with the bundled pair and every drafter; speedup table",
        description="Decodes a few Python prompts with the bundled target/draft pair, once per "
        "drafter, prints the generated code and a table of tokens/s, tokens per step and speedup "
        "over autoregressive decoding, and checks that every drafter's greedy output is "
        "identical to the autoregressive one (exit code 1 if not).",
    )
    p_demo.add_argument("--model", default="pycode", help="zoo pair (default: pycode)")
    p_demo.add_argument(
        "--max-new-tokens", type=_positive_int, default=64, help="per prompt (default 64)"
    )
    p_demo.add_argument(
        "--prompts",
        type=_int_at_least(1, f"an integer in [1, {len(DEMO_PROMPTS)}]", len(DEMO_PROMPTS)),
        default=len(DEMO_PROMPTS),
        help=f"how many of the {len(DEMO_PROMPTS)} demo prompts to run (default all)",
    )
    p_demo.add_argument(
        "--repeats",
        type=_positive_int,
        default=2,
        help="runs per prompt and drafter; the fastest counts (default 2)",
    )
    p_demo.add_argument("-k", type=_positive_int, default=3, help="draft depth (default 3)")
    _add_device_argument(p_demo)
    p_demo.add_argument(
        "--threads",
        type=_positive_int,
        default=None,
        help="torch threads, and the kernels' (default 1)",
    )
    p_demo.set_defaults(func=_cmd_demo)

    p_gen = sub.add_parser(
        "generate",
        help="generate text from a prompt, streamed as tokens are accepted",
        description="Generates a continuation of PROMPT with speculative decoding, writing the "
        "text to stdout as tokens are accepted and the statistics to stderr.",
    )
    p_gen.add_argument("prompt", metavar="PROMPT", help="prompt text ('-' reads stdin)")
    p_gen.add_argument(
        "--model",
        default="pycode",
        help="a zoo pair name (default: pycode) or a local Hugging Face model directory",
    )
    p_gen.add_argument(
        "--drafter",
        choices=DRAFTERS,
        default="cacheback",
        help="none (autoregressive), cacheback (n-gram, default), model (draft model chain), "
        "model-tree (draft model dynamic tree), combined (cacheback, and the draft model's "
        "chain where cacheback has no draft), specformer (a SpecFormer head over the target's "
        "hidden states: a chain in one step), edge (drafts from specdecode edge-worker "
        "processes, here or on other machines: see --listen)",
    )
    p_gen.add_argument(
        "--draft-model",
        metavar="DIR",
        default=None,
        help="draft model directory for --drafter model/model-tree/combined (default: the zoo "
        "pair's); an error with the other drafters",
    )
    p_gen.add_argument("--max-new-tokens", type=_positive_int, default=128, help="(default 128)")
    p_gen.add_argument(
        "--temperature", type=_temperature, default=0.0, help="0 = greedy (default 0)"
    )
    p_gen.add_argument("--top-k", type=_nonnegative_int, default=0, help="0 = off (default)")
    p_gen.add_argument("--top-p", type=_top_p, default=1.0, help="in (0, 1]; 1 = off (default)")
    p_gen.add_argument("--seed", type=_seed, default=None, help="sampling seed (default random)")
    p_gen.add_argument(
        "-k",
        type=_positive_int,
        default=3,
        help="draft depth (default 3; with --drafter edge, the workers' own -k)",
    )
    p_gen.add_argument(
        "--stop-below",
        metavar="P",
        type=_top_p,
        default=None,
        help="draft model drafters: end a draft where the draft model's top next-token "
        "probability is below P, in (0, 1] (default: draft k tokens whatever the confidence)",
    )
    p_gen.add_argument(
        "--verify",
        choices=("exact", "block"),
        default="exact",
        help="how sampled drafts are verified, both lossless: exact (token by token, default) "
        "or block (block verification: a draft model's sampled chains keep at least as many "
        "tokens per step in expectation; other drafts as exact); greedy decoding is the same "
        "with both",
    )
    p_gen.add_argument(
        "--judge",
        metavar="FILE",
        default=None,
        help="a TokenJudge saved by specdecode.judge (AutoJudge): accept the draft/target "
        "mismatches it judges unimportant (lossy; greedy only, --temperature 0)",
    )
    p_gen.add_argument(
        "--steering",
        metavar="FILE|PAIR",
        default=None,
        help="draft model drafters: steer the draft model with the target's hidden states "
        "(SD²) using this map, a file from specdecode steer or a zoo pair's shipped one (e.g. "
        "pycode); lossless",
    )
    p_gen.add_argument(
        "--specformer",
        metavar="FILE|PAIR[:root]",
        default=None,
        help="--drafter specformer: the head, a file from specdecode specformer or a zoo pair's "
        "shipped one: PAIR the paper's head, PAIR:root the root-aware one (default: the zoo "
        "pair's paper head)",
    )
    p_gen.add_argument(
        "--listen",
        metavar="HOST:PORT",
        default=None,
        help="--drafter edge: where to wait for a draft worker (specdecode edge-worker "
        f"--connect HOST:PORT, with the same {EDGE_KEY_ENV} in both environments)",
    )
    p_gen.add_argument(
        "--deadline",
        metavar="SECONDS",
        type=_positive_float,
        default=None,
        help="--drafter edge: wait at most this long for drafts per step; a late worker's "
        "sequence takes the target's own token that step (default: wait)",
    )
    _add_device_argument(p_gen)
    p_gen.add_argument(
        "--echo",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="print the prompt before the generated text (default: yes)",
    )
    _add_threads_argument(p_gen)
    p_gen.set_defaults(func=_cmd_generate)

    from .zoo._paths import float_in

    p_judge = sub.add_parser(
        "judge",
        help="mine a model pair's mismatches and fit an AutoJudge judge for generate --judge",
        description="Labels the mismatches between the draft and the target model on the given "
        "prompts (AutoJudge's search: a mismatch is unimportant when swapping the draft token in "
        "leaves the task check true), fits a logistic-regression judge on the target's verify "
        "features, calibrates its threshold on held-out prompts and saves it.",
    )
    p_judge.add_argument("--out", required=True, metavar="FILE", help="where to save the judge")
    _add_pair_arguments(p_judge)
    p_judge.add_argument(
        "--prompts",
        metavar="FILE",
        default=None,
        help='JSON Lines: one string, or one object with a "prompt" string, per line',
    )
    p_judge.add_argument(
        "--humaneval",
        type=_positive_int,
        metavar="N",
        default=None,
        help="the first N HumanEval prompts",
    )
    p_judge.add_argument(
        "--check",
        choices=JUDGE_CHECKS,
        default="python-code",
        help="the task check: python-code (the same program, comments and docstrings aside; "
        "default) or final-number (the same last number, as in math answers)",
    )
    p_judge.add_argument(
        "--max-new-tokens", type=_positive_int, default=64, help="response length (default 64)"
    )
    p_judge.add_argument(
        "--recall",
        type=_top_p,
        default=0.95,
        help="fraction of important mismatches the judge must keep rejecting, in (0, 1] "
        "(default 0.95)",
    )
    p_judge.add_argument(
        "--held-out",
        type=float_in(0.0, 1.0, low_open=True),
        default=0.2,
        help="fraction of the prompts the threshold is calibrated on, in (0, 1) (default 0.2)",
    )
    p_judge.add_argument(
        "-k",
        type=_positive_int,
        default=4,
        help="draft depth of the mining's generations (default 4)",
    )
    _add_device_argument(p_judge)
    _add_threads_argument(p_judge)
    p_judge.set_defaults(func=_cmd_judge)

    p_steer = sub.add_parser(
        "steer",
        help="train an SD² steering map (target states -> draft model) for generate --steering",
        description="Trains the linear map that turns the target's hidden states into steering "
        "vectors for the draft model (SD², specdecode.steering) by distillation on text: the "
        "zoo pair's own corpus by default, or --text files. The draft model stays frozen. "
        "Reports the held-out divergence and greedy agreement with and without steering.",
    )
    p_steer.add_argument("--out", required=True, metavar="FILE", help="where to save the map")
    _add_pair_arguments(p_steer)
    _add_training_arguments(p_steer, "map's weights", steps=800, lr=2e-3)
    p_steer.add_argument("-k", type=_positive_int, default=4, help="draft depth (default 4)")
    p_steer.add_argument(
        "--rank",
        type=_nonnegative_int,
        default=None,
        help="factorise the map through RANK dimensions; 0 = never (default: rank 256 where "
        "the full map would be larger)",
    )
    p_steer.set_defaults(func=_cmd_steer)

    p_sf = sub.add_parser(
        "specformer",
        help="train a SpecFormer draft head (target states -> k drafts in one step) for "
        "generate --drafter specformer",
        description="Trains a SpecFormer draft head (specdecode.specformer: a causal block over "
        "the target's hidden states, then k draft slots that attend to each other) by "
        "distillation from the frozen target on text: the zoo pair's own corpus by default, or "
        "--text files. Reports the held-out divergence and greedy agreement per slot.",
    )
    p_sf.add_argument("--out", required=True, metavar="FILE", help="where to save the head")
    p_sf.add_argument(
        "--model",
        default="pycode",
        help="a zoo pair name (default: pycode) or a local Hugging Face model directory",
    )
    _add_training_arguments(p_sf, "head's weights", steps=1500, lr=1e-3)
    p_sf.add_argument(
        "--positions",
        type=_positive_int,
        default=64,
        help="positions per window that train the draft slots (default 64)",
    )
    p_sf.add_argument(
        "-k",
        type=_int_at_least(1, "an integer in [1, 64]", 64),
        default=4,
        help="draft slots (default 4)",
    )
    p_sf.add_argument(
        "--root-aware",
        action="store_true",
        help="a root-aware head (beyond the paper): the slots also read the round's root token",
    )
    p_sf.set_defaults(func=_cmd_specformer)

    p_edge = sub.add_parser(
        "edge-worker",
        help="serve drafts to generate --drafter edge on another process or machine",
        description="Runs a drafter on this machine (an edge device) for a server running "
        "specdecode generate --drafter edge --listen HOST:PORT: connects to it, drafts for the "
        "sequences it sends, and exits when the server closes the link. The link is "
        f"authenticated with the secret in {EDGE_KEY_ENV} (the same on both ends).",
    )
    p_edge.add_argument(
        "--connect", required=True, metavar="HOST:PORT", help="the server's --listen address"
    )
    p_edge.add_argument(
        "--model", default="pycode", help="a zoo pair whose draft model drafts (default: pycode)"
    )
    p_edge.add_argument(
        "--draft-model",
        metavar="DIR",
        default=None,
        help="a local Hugging Face draft model directory instead (the target's vocabulary)",
    )
    p_edge.add_argument(
        "--drafter",
        choices=("model", "model-tree", "cacheback"),
        default="model",
        help="model (draft model chain, default), model-tree (its dynamic tree), cacheback "
        "(n-gram, no model)",
    )
    p_edge.add_argument("-k", type=_positive_int, default=3, help="draft depth (default 3)")
    p_edge.add_argument(
        "--steering",
        metavar="FILE|PAIR",
        default=None,
        help="steer the draft model with the target's hidden states (SD²), which the server "
        "then sends every step: a map from specdecode steer or a zoo pair's shipped one",
    )
    p_edge.add_argument(
        "--retry-for",
        metavar="SECONDS",
        type=_nonnegative_float,
        default=0.0,
        help="keep trying to connect this long while the server is not up yet (default 0)",
    )
    _add_device_argument(p_edge)
    _add_threads_argument(p_edge)
    p_edge.set_defaults(func=_cmd_edge_worker)

    p_info = sub.add_parser("info", help="version, backends, CUDA devices, threads")
    p_info.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p_info.set_defaults(func=_cmd_info)
    from .benchmark import add_arguments

    p_bench = sub.add_parser("bench", help="end-to-end benchmark against transformers")
    add_arguments(p_bench)
    p_bench.set_defaults(func=_cmd_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line; returns the exit code (errors in ``argv`` exit with code 2)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except CLIError as exc:
        sys.stderr.write(f"specdecode {args.command}: error: {exc}\n")
        return EXIT_USAGE
    except KeyboardInterrupt:
        sys.stderr.write("\ninterrupted\n")
        return 130


if __name__ == "__main__":
    sys.exit(main())
