"""The interface every drafter and verifier uses to talk to a model.

A model scores ``T`` new tokens per sequence given their absolute positions and a KV cache that
holds everything before them. The ``T`` tokens are a chain (``tree_mask=None``: token ``i`` sees
tokens ``0..i``) or a draft tree in the format of :func:`specdecode.ops.tree_info` (node 0 the
root, parents before children; pass ``tree_info(parents).mask`` and positions
``prefix_len + depth``). After verification the cache is either truncated (rollback of a rejected
chain suffix) or compacted (keep the accepted root-to-node path of a tree).
"""

from __future__ import annotations

import inspect
from typing import Any, Optional, Protocol, Sequence, Union, runtime_checkable

import torch


@runtime_checkable
class ModelCache(Protocol):
    """Per-sequence KV state of a :class:`CausalLM`.

    Invariant: row ``b`` holds the keys/values of exactly ``lengths[b]`` committed-or-pending
    tokens, at positions ``0 .. lengths[b] - 1`` of that sequence; nothing past ``lengths[b]`` is
    ever visible to a later forward pass.
    """

    @property
    def batch_size(self) -> int:
        """Number of sequences ``B``."""
        ...

    @property
    def max_length(self) -> int:
        """Most tokens a row can hold."""
        ...

    @property
    def lengths(self) -> torch.Tensor:
        """int32 ``[B]`` (CPU or model device): tokens held per row."""
        ...

    def truncate(self, lengths: Union[int, Sequence[int], torch.Tensor]) -> None:
        """Rolls rows back to ``lengths`` (each at most the current length)."""
        ...

    def compact(self, path: torch.Tensor, num_accepted: torch.Tensor) -> None:
        """Keeps only the accepted path of the tree scored by the last forward pass.

        Row ``b`` keeps tree nodes ``path[b, :num_accepted[b]]`` (a root-to-node path: node 0
        first, each node a child of the one before) as its tokens ``start[b] .. start[b] +
        num_accepted[b] - 1``, where ``start`` is ``lengths`` before that forward pass; the rest
        of the tree is dropped. Any other selection raises ValueError (the kept K/V were
        computed attending to each node's own ancestors, so only a path describes the kept
        tokens).
        """
        ...


@runtime_checkable
class CausalLM(Protocol):
    """A causal language model that drafters and verifiers can drive step by step."""

    @property
    def vocab_size(self) -> int:
        """Size ``V`` of the logits' last dimension."""
        ...

    @property
    def num_hidden_layers(self) -> int:
        """Number of decoder layers ``L`` (hidden-state indices run over ``0..L``)."""
        ...

    @property
    def max_length(self) -> int:
        """Longest sequence (prompt + generated) the model handles."""
        ...

    @property
    def device(self) -> torch.device:
        """Where inputs must live."""
        ...

    def new_cache(self, batch_size: int, max_length: Optional[int] = None) -> ModelCache:
        """An empty cache for ``batch_size`` sequences of up to ``max_length`` tokens."""
        ...

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cache: Any,
        tree_mask: Optional[torch.Tensor] = None,
        output_hidden: Optional[Sequence[int]] = None,
    ) -> Union[torch.Tensor, tuple[torch.Tensor, tuple[torch.Tensor, ...]]]:
        """Scores ``T`` new tokens per sequence and appends their K/V to ``cache``.

        Parameters
        ----------
        input_ids : torch.Tensor
            integer ``[B, T]``, ids in ``[0, V)``.
        positions : torch.Tensor
            integer ``[B, T]``: absolute position of each token (``lengths[b] + depth`` in a
            tree, ``lengths[b] + t`` in a chain).
        cache : ModelCache
            From :meth:`new_cache`; row ``b`` receives the new tokens at
            ``[lengths[b], lengths[b] + T)`` and ``lengths`` grows by ``T``.
        tree_mask : torch.Tensor, optional
            uint32 ``[B, T, ceil(T / 32)]`` ancestor bitmask (:func:`specdecode.ops.tree_info`);
            None means a causal chain.
        output_hidden : sequence of int, optional
            Hidden states to return, indexed as transformers' ``hidden_states``: 0 is the
            embedding output, ``i`` the output of layer ``i`` for ``i < L``, and ``L`` the output
            of the final norm (the input of ``lm_head``); negative indices count from ``L + 1``.

        Returns
        -------
        torch.Tensor or (torch.Tensor, tuple of torch.Tensor)
            logits ``[B, T, V]``; with ``output_hidden``, also the requested hidden states, each
            ``[B, T, hidden]``, in the requested order.

        Notes
        -----
        An implementation may also take a keyword-only ``num_nodes`` (integer ``[B]``: the real
        tokens of each row, the rest padding it need not compute), as
        :meth:`specdecode.models.Transformer.forward` does; the engine passes it when the
        signature has it.
        """
        ...


def accepts_num_nodes(model: Any) -> bool:
    """Whether ``model.forward`` takes ``num_nodes=`` (an optional extension of
    :meth:`CausalLM.forward`: the real tokens per row of a ragged batch, whose padding is then
    not computed, as :meth:`specdecode.models.Transformer.forward` does)."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False
    return "num_nodes" in params


def accepts_steer(model: Any) -> bool:
    """Whether ``model.forward`` takes ``steer=`` (vectors added after each layer, as
    :meth:`specdecode.models.Transformer.forward` does): what a steered drafter needs."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False
    return "steer" in params
