"""Models that drafters and verifiers drive: the :class:`CausalLM` protocol and two implementations.

* :class:`Transformer`: a Llama / Qwen2 / Qwen3 / Mistral / Phi-3 style decoder, dense or with
  mixture-of-experts MLPs (Qwen3-MoE, Mixtral), written on specdecode's ops (static
  :class:`KVCache`, ``ops.tree_attention``, ``ops.compact_kv``) that loads and saves the Hugging
  Face checkpoint layout.
* :class:`HFCausalLM`: an adapter around any transformers causal LM.
"""

from __future__ import annotations

from .cache import KVCache
from .config import MODEL_TYPES, ModelConfig
from .hf import HFCache, HFCausalLM
from .protocol import CausalLM, ModelCache
from .transformer import Transformer

__all__ = [
    "MODEL_TYPES",
    "CausalLM",
    "HFCache",
    "HFCausalLM",
    "KVCache",
    "ModelCache",
    "ModelConfig",
    "Transformer",
]
