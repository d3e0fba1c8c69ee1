"""The native ops of specdecode.

Conventions shared by every op:

* Inputs are torch tensors, numpy arrays or any object with ``__dlpack__``, on the CPU or a
  CUDA device; they are read without a copy. Outputs are torch tensors on the same device. The
  attention ops (:func:`tree_attention`, :func:`compact_kv`), which models call from their
  forward pass and which are torch custom ops, take torch tensors only.
* Nested Python lists (or tuples, of Python or numpy scalars) are converted, with a copy, by the
  values they hold rather than by the scalar types torch would infer: where an op takes integers
  (token ids, node indices, slots, seeds, ``top_k``) a float in the list is a ``TypeError``, as
  a float tensor is; where it takes floats (logits, probabilities) the list becomes float32 and
  one holding only ints is a ``TypeError``, as an int tensor is (write ``1.0``); temperature and
  top_p take either; a bool in a numeric list is a ``TypeError`` (torch would make it 1).
* Every op validates dtype, shape, device, contiguity and value ranges before native code runs and
  raises ``TypeError`` / ``ValueError`` naming the argument and what was expected.
* CUDA inputs run on the current stream of their own device, which the op makes the current
  device for its launches only: the caller's current device is the same after the call, as
  under torch's device guards (an op on ``cuda:1`` leaves ``torch.cuda.current_device()`` as
  it was).
* Ragged batches use -1 (:data:`PAD_TOKEN`) as padding for token ids and node indices.
* Trees use one format everywhere (see :func:`tree_info`): node 0 is the root (the last
  committed token), parents come before children, rows are padded with -1.
"""

from __future__ import annotations

from ._ops.attention import HEAD_DIMS, compact_kv, tree_attention
from ._ops.ngram import DraftTree, NGramCache
from ._ops.tree import MAX_TREE_NODES, TreeInfo, chain_parents, tree_info, tree_paths
from ._ops.verify import (
    MAX_VOCAB,
    STATUS_BAD_DRAFT,
    STATUS_NON_FINITE,
    STATUS_ZERO_MASS,
    SampleResult,
    SamplingProbs,
    VerifyResult,
    sample,
    sampling_probs,
    verify,
)

PAD_TOKEN: int = -1
"""Padding value for token ids and node indices in ragged batches."""

__all__ = [
    "DraftTree",
    "HEAD_DIMS",
    "MAX_TREE_NODES",
    "MAX_VOCAB",
    "NGramCache",
    "PAD_TOKEN",
    "STATUS_BAD_DRAFT",
    "STATUS_NON_FINITE",
    "STATUS_ZERO_MASS",
    "SampleResult",
    "SamplingProbs",
    "TreeInfo",
    "VerifyResult",
    "chain_parents",
    "compact_kv",
    "sample",
    "sampling_probs",
    "tree_attention",
    "tree_info",
    "tree_paths",
    "verify",
]
