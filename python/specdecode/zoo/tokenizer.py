"""The zoo's tokenizer: a sentencepiece BPE model trained on the corpus, wrapped thinly.

Python source depends on exact whitespace, so the sentencepiece model is trained to be lossless:
the ``identity`` normalizer (no NFKC, no whitespace folding), no dummy prefix, whitespace-only
pieces allowed (runs of indentation become single tokens), ``"\\n"`` as a user-defined symbol
(sentencepiece's trainer reads one sentence per line, so newlines would otherwise never be
learned) and byte fallback, so any text, including characters never seen in training, encodes
and decodes back to itself. The one character that cannot round-trip is U+2581 ("▁"), which
sentencepiece uses as its own whitespace marker; :meth:`Tokenizer.encode` refuses it.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any, Iterable, List, Sequence, Union

import numpy as np
import sentencepiece as spm

# Fixed ids of the special pieces (the first four of the vocabulary).
UNK_ID = 0
BOS_ID = 1
EOS_ID = 2
PAD_ID = 3

SP_WHITESPACE = "\u2581"


def train_sentencepiece(
    texts: Iterable[str],
    model_path: Union[str, Path],
    vocab_size: int = 8192,
    num_threads: int = 1,
) -> None:
    """Train the BPE model on ``texts`` (whole files) and write it to ``model_path``.

    Sentencepiece's BPE trainer is deterministic when it reads every sentence
    (``input_sentence_size=0``, no sampling), so the same corpus gives the same model.
    """
    lines: List[str] = []
    for text in texts:
        lines.extend(line for line in text.split("\n") if line)
    proto = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_writer=proto,
        model_type="bpe",
        vocab_size=vocab_size,
        character_coverage=0.9995,
        byte_fallback=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=False,
        allow_whitespace_only_pieces=True,
        split_digits=True,
        max_sentencepiece_length=16,
        user_defined_symbols=["\n"],
        unk_id=UNK_ID,
        bos_id=BOS_ID,
        eos_id=EOS_ID,
        pad_id=PAD_ID,
        input_sentence_size=0,
        num_threads=num_threads,
        minloglevel=2,
    )
    Path(model_path).write_bytes(proto.getvalue())


def _token_id(value: Any, name: str) -> int:
    """An int token id (numpy and 0-d torch ints included); a float, bool or str is a TypeError
    (int() would truncate a float, and a str would be read as its digits)."""
    if hasattr(value, "item") and getattr(value, "ndim", None) == 0:
        value = value.item()
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name}: expected int token ids, got {value!r}")
    return int(value)


class Tokenizer:
    """Encode/decode text with the zoo's sentencepiece model.

    Parameters
    ----------
    model_path : str or Path
        A ``tokenizer.model`` written by :func:`train_sentencepiece`.
    """

    def __init__(self, model_path: Union[str, Path]) -> None:
        path = Path(model_path)
        if not path.is_file():
            raise FileNotFoundError(f"model_path: no sentencepiece model at {path}")
        self.model_path = path
        self._sp = spm.SentencePieceProcessor(model_file=str(path))
        if (self._sp.bos_id(), self._sp.eos_id(), self._sp.pad_id()) != (BOS_ID, EOS_ID, PAD_ID):
            raise ValueError(f"model_path: {path} does not have the zoo's special-token ids")

    @property
    def vocab_size(self) -> int:
        """Number of pieces, special and byte pieces included."""
        return self._sp.get_piece_size()

    @property
    def bos_id(self) -> int:
        """Id of the beginning-of-sequence token."""
        return BOS_ID

    @property
    def eos_id(self) -> int:
        """Id of the end-of-sequence token."""
        return EOS_ID

    @property
    def pad_id(self) -> int:
        """Id of the padding token."""
        return PAD_ID

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> List[int]:
        """Token ids of ``text``; ``bos``/``eos`` add the special tokens at the ends.

        Raises
        ------
        TypeError
            If ``text`` is not a str.
        ValueError
            If ``text`` contains U+2581, which cannot round-trip, or a lone surrogate (not
            UTF-8 encodable; e.g. a command line's undecodable bytes).
        """
        if not isinstance(text, str):
            raise TypeError(f"text: expected str, got {type(text).__name__}")
        if SP_WHITESPACE in text:
            raise ValueError("text: contains U+2581 ('▁'), sentencepiece's whitespace marker")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(
                f"text: not valid Unicode at character {e.start} ({text[e.start]!r}: a lone "
                "surrogate, such as undecodable bytes become)"
            ) from None
        ids = self._sp.encode(text)
        return ([BOS_ID] if bos else []) + ids + ([EOS_ID] if eos else [])

    def decode(self, ids: Sequence[int]) -> str:
        """Text of token ids; special tokens (bos/eos/pad/unk) are dropped.

        Raises
        ------
        ValueError
            If an id is outside ``[0, vocab_size)``.
        """
        if isinstance(ids, (str, bytes)):
            raise TypeError(f"ids: expected a sequence of token ids, got {type(ids).__name__}")
        ids = [_token_id(i, "ids") for i in ids]
        n = self.vocab_size
        for i in ids:
            if not 0 <= i < n:
                raise ValueError(f"ids: token id {i} outside [0, {n})")
        return self._sp.decode([i for i in ids if i > PAD_ID])

    def id_to_piece(self, token_id: int) -> str:
        """The piece string of one id (for display)."""
        token_id = _token_id(token_id, "token_id")
        if not 0 <= token_id < self.vocab_size:
            raise ValueError(f"token_id: {token_id} outside [0, {self.vocab_size})")
        return self._sp.id_to_piece(token_id)
