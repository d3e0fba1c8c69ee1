"""An adapter that drives any transformers causal LM through the :class:`CausalLM` protocol.

transformers' ``DynamicCache`` has one length for the whole batch, while speculative decoding
advances every row by its own accepted count. The adapter therefore keeps a *physical* cache whose
slots are shared by the batch plus a per-row validity mask ``valid[B, P]``:

* a forward pass appends ``T`` slots to every row and scores the new tokens with an explicit 4-D
  additive attention mask (the row's valid slots + the tree's ancestor bits) and explicit
  ``position_ids``, so RoPE / learned positions see each row's true positions;
* rolling back marks slots invalid, and slots no row needs any more are cropped from the end
  (``DynamicCache.crop``);
* compacting a tree keeps the accepted nodes' slots where they are (their K/V were computed at the
  right positions, attending to exactly the accepted path) and drops the rest from the mask;
* after a rollback or a compaction, when the holes outweigh the kept slots, every row's valid
  slots are gathered to the front (so the physical length stays within about twice the longest
  row);
* dropping rows (finished sequences, ``keep_rows``) selects them in every layer, then frees the
  slots only the dropped rows used, as a rollback does.

Invariant: row ``b`` sees exactly its ``lengths[b]`` valid slots, in order; masked slots never
influence a result.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import weakref
from typing import Any, Iterator, Optional, Sequence, Union

import torch

from ._checks import (
    as_lengths,
    check_accepted_path,
    check_compact_args,
    check_hidden_indices,
    check_keep_rows,
    check_positive_int,
    check_steer,
    check_tokens,
    check_tree_mask,
)
from .transformer import _tree_bits


def _cache_tensors(cache: Any) -> list[tuple[Any, str, str]]:
    """(holder, key attribute, value attribute) per layer, for transformers 5 and 4."""
    if hasattr(cache, "layers"):
        return [(layer, "keys", "values") for layer in cache.layers]
    return [(cache, i, i) for i in range(len(cache.key_cache))]


def _get(holder: Any, attr: Any, kind: str) -> torch.Tensor:
    if isinstance(attr, int):
        return (holder.key_cache if kind == "k" else holder.value_cache)[attr]
    return getattr(holder, attr)


def _set(holder: Any, attr: Any, kind: str, value: torch.Tensor) -> None:
    if isinstance(attr, int):
        (holder.key_cache if kind == "k" else holder.value_cache)[attr] = value
    else:
        setattr(holder, attr, value)


class HFCache:
    """KV state of :class:`HFCausalLM`: a transformers ``DynamicCache`` plus per-row slot masks."""

    def __init__(self, batch_size: int, max_length: int, device: torch.device) -> None:
        from transformers import DynamicCache

        batch_size = check_positive_int("batch_size", batch_size)
        max_length = check_positive_int("max_length", max_length)
        self.hf = DynamicCache()
        self._max_length = max_length
        self._device = device
        self._valid = torch.zeros(batch_size, 0, dtype=torch.bool, device=device)
        self._host_lengths = torch.zeros(batch_size, dtype=torch.int64)
        self._lengths = torch.zeros(batch_size, dtype=torch.int32, device=device)
        # The transformers model whose K/V the cache holds (bound by new_cache or the first
        # forward pass): another model would read them as its own, or fail deep inside.
        self._owner: Optional[weakref.ref] = None
        # (first physical slot, T, row lengths before the pass, tree mask or None for a chain)
        # of the last forward pass.
        self._tree: Optional[tuple[int, int, torch.Tensor, Optional[torch.Tensor]]] = None

    @property
    def batch_size(self) -> int:
        return self._valid.shape[0]

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def lengths(self) -> torch.Tensor:
        """int32 ``[B]``: tokens held per row."""
        return self._lengths

    @property
    def physical_length(self) -> int:
        """Slots in transformers' cache (>= every row's length; the excess are holes)."""
        return self._valid.shape[1]

    @property
    def valid(self) -> torch.Tensor:
        """bool ``[B, physical_length]``: the slots each row attends to."""
        return self._valid

    def _set_lengths(self, lengths: torch.Tensor) -> None:
        self._host_lengths.copy_(lengths)
        self._lengths.copy_(lengths.to(self._device, torch.int32))

    def truncate(self, lengths: Union[int, Sequence[int], torch.Tensor]) -> None:
        """Rolls every row back to ``lengths`` tokens (each at most its current length)."""
        new = as_lengths(lengths, self.batch_size)
        bad = (new < 0) | (new > self._host_lengths)
        if bool(bad.any()):
            b = int(torch.nonzero(bad)[0])
            raise ValueError(
                f"lengths: row {b} cannot be truncated to {int(new[b])}: it holds "
                f"{int(self._host_lengths[b])} tokens (truncate only shortens rows)"
            )
        rank = torch.cumsum(self._valid.long(), dim=1)
        self._valid &= rank <= new.to(self._device).unsqueeze(1)
        self._set_lengths(new)
        self._tree = None
        self._tidy()

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Keeps only the given rows, in the given order (the batch shrinks to ``len(rows)``), as
        :meth:`specdecode.models.KVCache.keep_rows` does.

        A decoding loop drops the rows of finished sequences with it, so that later passes cost
        only the running ones. Every layer of transformers' cache keeps those rows
        (``batch_select_indices``, a copy), and so do the slot masks and lengths; the kept rows'
        contents and lengths are unchanged, and a pending tree (forward done, not yet compacted)
        stays compactable on the kept rows. Slots that no kept row uses any more are freed as
        after a rollback: trailing ones are cropped, and the holes are squeezed out once they
        outweigh the kept slots (not while a tree is pending: its slots stay where the forward
        pass put them until it is compacted).

        Parameters
        ----------
        rows : torch.Tensor
            int64 ``[R]`` on the CPU, ``1 <= R``, distinct row indices in ``[0, B)``.

        Raises
        ------
        TypeError, ValueError
            Not an int64 CPU tensor, empty, out of range or repeated; nothing changes then.
        """
        check_keep_rows(rows, self.batch_size)
        on_device = rows.to(self._device)
        if self.physical_length == 0:
            # Nothing is cached, but transformers' layers may hold [B, H, 0, D] tensors (a crop
            # to nothing), which batch_select_indices leaves alone (it selects in layers that
            # hold tokens only) and to which the next pass could not append a smaller batch.
            from transformers import DynamicCache

            self.hf = DynamicCache()
        else:
            self.hf.batch_select_indices(on_device)
        self._valid = self._valid.index_select(0, on_device)
        self._lengths = self._lengths.index_select(0, on_device)
        self._host_lengths = self._host_lengths.index_select(0, rows)
        if self._tree is not None:
            start_slot, t, start, tree_mask = self._tree
            if tree_mask is not None:
                tree_mask = tree_mask.index_select(0, on_device)
            self._tree = (start_slot, t, start.index_select(0, rows), tree_mask)
        self._tidy()

    def compact(self, path: torch.Tensor, num_accepted: torch.Tensor) -> None:
        """Keeps nodes ``path[b, :num_accepted[b]]`` of the last forward's tree (see
        :meth:`specdecode.models.ModelCache.compact`): a root-to-node path, each node a child of
        the one before, as :meth:`specdecode.models.KVCache.compact` requires."""
        if self._tree is None:
            raise ValueError(
                "compact: no tree to compact; call it once right after the forward pass that "
                "scored the tree"
            )
        start_slot, t, start, tree_mask = self._tree
        batch = self.batch_size
        check_compact_args(path, num_accepted, batch)
        path = path.to("cpu", torch.int64)
        counts = num_accepted.to("cpu", torch.int64)
        width = path.shape[1]
        if bool((counts < 0).any()) or bool((counts > width).any()):
            raise ValueError(
                f"num_accepted: expected values in [0, {width}], got {counts.tolist()}"
            )
        used = torch.arange(width).unsqueeze(0) < counts.unsqueeze(1)
        nodes = torch.where(used, path, torch.zeros_like(path))
        if bool((used & ((path < 0) | (path >= t))).any()):
            raise ValueError(f"path: accepted nodes must be in [0, {t}), the last forward's tokens")
        steps = used[:, 1:] & (nodes[:, 1:] <= nodes[:, :-1])
        if bool(steps.any()):
            raise ValueError("path: accepted nodes must be strictly increasing (root first)")
        check_accepted_path(nodes.numpy(), counts.numpy(), tree_mask, t)
        keep = torch.zeros(batch, t, dtype=torch.bool)
        rows = torch.arange(batch).unsqueeze(1).expand(batch, width)
        keep[rows[used], path[used]] = True
        self._valid[:, start_slot : start_slot + t] = keep.to(self._device)
        self._set_lengths(start + counts)
        self._tree = None
        self._tidy()

    def _tidy(self) -> None:
        """Drops the trailing slots no row uses, and removes the holes once they outweigh the
        kept slots (each forward pass appends a slot per row and token, so rows that roll back
        by different amounts leave holes that cropping alone never frees). Squeezing waits while
        a tree is pending: compact finds its nodes at the slots the forward pass gave them."""
        self._crop()
        if self._tree is None and self.physical_length > 2 * int(self._host_lengths.max()) + 32:
            self._squeeze()

    def _crop(self) -> None:
        """Drops trailing slots that no row uses."""
        used = self._valid.any(dim=0)
        keep = int(torch.nonzero(used).max()) + 1 if bool(used.any()) else 0
        remove = self.physical_length - keep
        if remove > 0:
            self.hf.crop(-remove)
            self._valid = self._valid[:, :keep]

    def _drop_slots_after(self, length: int) -> None:
        """Cuts every layer of transformers' cache to ``length`` slots (layers may differ in
        length after a pass that failed midway, which ``DynamicCache.crop`` cannot mend)."""
        for holder, k_attr, v_attr in _cache_tensors(self.hf):
            for attr, kind in ((k_attr, "k"), (v_attr, "v")):
                x = _get(holder, attr, kind)
                if x is not None and x.dim() == 4 and x.shape[2] > length:
                    _set(holder, attr, kind, x[:, :, :length])

    def _squeeze(self) -> None:
        """Gathers each row's valid slots to the front, in order (removes holes)."""
        longest = int(self._host_lengths.max())
        # A stable sort of "invalid" puts valid slots first, keeping their order.
        order = torch.argsort((~self._valid).to(torch.int8), dim=1, stable=True)[:, :longest]
        for holder, k_attr, v_attr in _cache_tensors(self.hf):
            for attr, kind in ((k_attr, "k"), (v_attr, "v")):
                x = _get(holder, attr, kind)
                if x is None or x.numel() == 0:
                    continue
                b, h, _, d = x.shape
                index = order.view(b, 1, longest, 1).expand(b, h, longest, d)
                _set(holder, attr, kind, x.gather(2, index))
        steps = torch.arange(longest, device=self._device).unsqueeze(0)
        self._valid = steps < self._lengths.long().unsqueeze(1)


class HFCausalLM:
    """Any transformers causal LM (Llama, Qwen2, Mistral, GPT-2, ...) as a :class:`CausalLM`.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        A causal LM whose forward accepts ``attention_mask`` as a 4-D additive mask,
        ``position_ids`` and its KV cache as ``cache`` (transformers 5.24 on) or
        ``past_key_values`` (every decoder-only model in transformers with the ``eager`` or
        ``sdpa`` attention). It is put in eval mode.
    """

    def __init__(self, model: Any) -> None:
        if not isinstance(model, torch.nn.Module) or not hasattr(model, "config"):
            raise TypeError(
                f"model: expected a transformers PreTrainedModel, got {type(model).__name__}"
            )
        impl = getattr(model.config, "_attn_implementation", None) or "eager"
        if "flash" in impl:
            raise ValueError(
                f"model: attention implementation {impl!r} takes no 4-D masks; load the model "
                "with attn_implementation='sdpa' or 'eager'"
            )
        self.model = model.eval()
        # transformers 5.24 renamed the cache argument (past_key_values goes in 5.40).
        self._cache_arg = (
            "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        )
        head = model.get_output_embeddings()
        self._vocab_size = (
            int(head.weight.shape[0]) if head is not None else int(model.config.vocab_size)
        )
        config = model.config
        # The position limit (learned position embeddings have no row beyond it) and the
        # sliding window (beyond it the model attends differently), with the config field each
        # comes from.
        limit = getattr(config, "max_position_embeddings", None)
        limit_field = "max_position_embeddings"
        if not limit:
            limit, limit_field = getattr(config, "n_positions", None), "n_positions"
        window = getattr(config, "sliding_window", None)
        if getattr(config, "use_sliding_window", True) is False:
            window = None
        candidates = [
            (v, f"config.{field}")
            for v, field in ((limit, limit_field), (window, "sliding_window"))
            if isinstance(v, int) and not isinstance(v, bool) and v > 0
        ]
        self._max_length, self._limit_field = (
            min(candidates) if candidates else (1 << 20, "no position limit in the config")
        )
        self._num_layers = int(getattr(config, "num_hidden_layers", None) or config.n_layer)
        self._layers = _decoder_layers(model, self._num_layers)

    @classmethod
    def from_pretrained(cls, directory: Union[str, os.PathLike], **kwargs: Any) -> HFCausalLM:
        """Loads a local checkpoint with ``AutoModelForCausalLM`` (no download) and wraps it."""
        from transformers import AutoModelForCausalLM

        kwargs.setdefault("attn_implementation", "sdpa")
        kwargs.setdefault("local_files_only", True)
        return cls(AutoModelForCausalLM.from_pretrained(directory, **kwargs))

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def num_hidden_layers(self) -> int:
        return self._num_layers

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def config(self) -> Any:
        """The transformers config (``hidden_size``, ``num_hidden_layers``, ...)."""
        return self.model.config

    def _steered(self, steer: Optional[torch.Tensor]) -> contextlib.AbstractContextManager:
        """Adds ``steer[:, :, i]`` (``[B, 1 or T, L, H]``, checked) to decoder layer ``i``'s
        output while the context is open: the residual stream after each layer, as
        :class:`~specdecode.models.Transformer` takes ``steer``."""
        if steer is None:
            return contextlib.nullcontext()
        if self._layers is None:
            raise TypeError(
                f"steer: no list of {self._num_layers} decoder layers found in "
                f"{type(self.model).__name__}, so nothing can be added after each layer"
            )
        return _steer_hooks(self._layers, steer)

    def forward_train(
        self, input_ids: torch.Tensor, steer: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """Logits of whole sequences, differentiable (no cache); what
        :func:`specdecode.steering.fit_steering` trains a map through.

        Parameters
        ----------
        input_ids : torch.Tensor
            Integer ``[B, T]``, ids in ``[0, vocab_size)``, ``1 <= T <= max_length``; token ``t``
            sits at position ``t``.
        steer : torch.Tensor, optional
            Floating ``[B, L, hidden_size]`` or ``[B, T, L, hidden_size]``: vectors added to the
            residual stream after each decoder layer, as :meth:`forward` takes them. Gradients
            flow into it.

        Returns
        -------
        torch.Tensor
            Logits ``[B, T, vocab_size]`` in the model's dtype; ``logits[:, t]`` predicts token
            ``t + 1``.
        """
        device = self.device
        if not isinstance(input_ids, torch.Tensor):
            raise TypeError(f"input_ids: expected a torch.Tensor, got {type(input_ids).__name__}")
        if input_ids.dim() != 2 or input_ids.shape[1] < 1:
            raise ValueError(f"input_ids: expected shape [B, T], got {list(input_ids.shape)}")
        batch, t = input_ids.shape
        if t > self._max_length:
            raise ValueError(
                f"input_ids: {t} tokens exceed the model's max length {self._max_length} "
                f"({self._limit_field})"
            )
        input_ids, _ = check_tokens(
            input_ids,
            torch.arange(t, device=input_ids.device).expand(batch, t),
            self._vocab_size,
            batch,
            device,
        )
        steer = check_steer(steer, batch, t, self._num_layers, self._hidden_size(), device)
        with self._steered(steer):
            out = self.model(input_ids=input_ids, use_cache=False, return_dict=True)
        return out.logits

    def _hidden_size(self) -> int:
        config = self.model.config
        return int(getattr(config, "hidden_size", None) or config.n_embd)

    def new_cache(self, batch_size: int, max_length: Optional[int] = None) -> HFCache:
        """An empty :class:`HFCache`; ``max_length`` defaults to (and may not exceed) the model's
        position limit / sliding window."""
        if max_length is None:
            max_length = self._max_length
        max_length = check_positive_int("max_length", max_length)
        if max_length > self._max_length:
            raise ValueError(
                f"max_length: {max_length} exceeds the model's max length {self._max_length} "
                "(max_position_embeddings / sliding_window)"
            )
        cache = HFCache(batch_size, max_length, self.device)
        cache._owner = weakref.ref(self.model)
        return cache

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cache: HFCache,
        tree_mask: Optional[torch.Tensor] = None,
        output_hidden: Optional[Sequence[int]] = None,
        steer: Optional[torch.Tensor] = None,
    ) -> Union[torch.Tensor, tuple[torch.Tensor, tuple[torch.Tensor, ...]]]:
        """Scores ``T`` new tokens per row (see :meth:`specdecode.models.CausalLM.forward`).

        Hidden state ``i`` is transformers' ``hidden_states[i]`` (0 = embeddings, ``L`` = the
        final norm's output for the decoders in transformers 5). ``steer`` (floating
        ``[B, L, hidden_size]`` per row or ``[B, T, L, hidden_size]`` per token) is added to
        each decoder layer's output through forward hooks, as
        :meth:`specdecode.models.Transformer.forward` adds it (steered drafters,
        :mod:`specdecode.steering`); the hooks are removed when the pass ends.

        Raises
        ------
        TypeError, ValueError
            As :meth:`specdecode.models.Transformer.forward`; the cache is unchanged then.
        Exception
            Whatever the transformers model raises (e.g. out of memory); the cache is unchanged
            then too.
        """
        if not isinstance(cache, HFCache):
            raise TypeError(
                f"cache: expected an HFCache (from new_cache), got {type(cache).__name__}"
            )
        device = self.device
        if cache.valid.device != device:
            raise ValueError(f"cache: on {cache.valid.device}, the model on {device}")
        if cache._owner is not None and cache._owner() is not self.model:
            raise ValueError(
                "cache: it holds the K/V of another model; use a cache from this model's new_cache"
            )
        input_ids, positions = check_tokens(
            input_ids, positions, self._vocab_size, cache.batch_size, device
        )
        batch, t = input_ids.shape
        check_tree_mask(tree_mask, batch, t, device)
        wanted = check_hidden_indices(output_hidden, self._num_layers)
        steer = check_steer(steer, batch, t, self._num_layers, self._hidden_size(), device)
        longest = int(cache._host_lengths.max())
        if longest + t > cache.max_length:
            raise ValueError(
                f"input_ids: {t} new tokens do not fit the cache: a row holds {longest} of at "
                f"most {cache.max_length} tokens (max_length exceeded)"
            )
        if int(positions.max()) >= self._max_length:
            raise ValueError(
                f"positions: {int(positions.max())} is beyond the model's max length "
                f"{self._max_length} ({self._limit_field}); positions must be below it"
            )
        if tree_mask is None:
            visible = torch.ones(t, t, dtype=torch.bool, device=device).tril().expand(batch, t, t)
        else:
            visible = _tree_bits(tree_mask.contiguous(), t)
        p = cache.physical_length
        allowed = torch.cat((cache.valid.unsqueeze(1).expand(batch, t, p), visible), dim=2)
        dtype = self.dtype
        # Additive mask: 0 where a key is visible, the dtype's minimum elsewhere (finite, so a
        # row that sees nothing gives a uniform average instead of NaN).
        mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
        mask.masked_fill_(~allowed, torch.finfo(dtype).min)
        start = cache._host_lengths.clone()
        try:
            with torch.no_grad(), self._steered(steer):
                out = self.model(
                    input_ids=input_ids,
                    attention_mask=mask.unsqueeze(1),
                    position_ids=positions,
                    use_cache=True,
                    output_hidden_states=bool(wanted),
                    return_dict=True,
                    **{self._cache_arg: cache.hf},
                )
        except BaseException:
            # The layers that ran before the error (out of memory, an interrupt) appended their
            # K/V already: drop them, so that the cache is as it was and stays usable.
            cache._drop_slots_after(p)
            raise
        returned = out.get("cache", None)
        if returned is None:
            returned = out.get("past_key_values", None)
        if returned is not None:
            cache.hf = returned
        cache._owner = weakref.ref(self.model)
        cache._valid = torch.cat(
            (cache.valid, torch.ones(batch, t, dtype=torch.bool, device=device)), dim=1
        )
        cache._set_lengths(start + t)
        cache._tree = (p, t, start, tree_mask)
        logits = out.logits
        if output_hidden is None:
            return logits
        return logits, tuple(out.hidden_states[i] for i in wanted)


def _decoder_layers(model: torch.nn.Module, count: int) -> Optional[torch.nn.ModuleList]:
    """The model's list of decoder layers: the first ``ModuleList`` of ``count`` modules
    (``model.layers`` in Llama-like models, ``transformer.h`` in GPT-2), or None."""
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == count:
            return module
    return None


@contextlib.contextmanager
def _steer_hooks(layers: torch.nn.ModuleList, steer: torch.Tensor) -> Iterator[None]:
    """Forward hooks adding ``steer[:, :, i]`` to layer ``i``'s hidden output (a tensor, or the
    first entry of a tuple), removed on exit, errors included."""

    def add(index: int) -> Any:
        def hook(module: torch.nn.Module, args: Any, output: Any) -> Any:
            if isinstance(output, tuple):
                hidden = output[0]
                return (hidden + steer[:, :, index].to(hidden.dtype), *output[1:])
            return output + steer[:, :, index].to(output.dtype)

        return hook

    handles = [layer.register_forward_hook(add(i)) for i, layer in enumerate(layers)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
