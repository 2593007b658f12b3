"""Optional dependencies of the tools: which pip extra provides each, and a clear error when one is missing.

The tools need hixl and numpy; the rest comes with extras declared in tools/pyproject.toml: ``demo``
(the SmolLM2 demo: gguf, tokenizers, rich), ``bench`` (rich, matplotlib). ``hixl model export`` uses
hixl's own ``vllm`` extra (torch, transformers, accelerate, safetensors, gguf).
"""
from __future__ import annotations

from types import ModuleType

from hixl._extras import require as _library_require

# top-level import name -> (distribution, extra) that installs it
EXTRA_OF = {
    "gguf": ("hixl-tools", "demo"), "tokenizers": ("hixl-tools", "demo"), "rich": ("hixl-tools", "demo"),
    "matplotlib": ("hixl-tools", "bench"),
    "torch": ("hixl", "vllm"), "transformers": ("hixl", "vllm"), "accelerate": ("hixl", "vllm"),
    "safetensors": ("hixl", "vllm"), "vllm": ("hixl", "vllm"),
}


def hint(module: str) -> str:
    """``pip install 'hixl-tools[EXTRA]'`` (or ``'hixl[EXTRA]'``) for the extra that provides ``module``."""
    dist_extra = EXTRA_OF.get(module.split(".")[0])
    return "pip install '%s[%s]'" % dist_extra if dist_extra else "pip install %s" % module.split(".")[0]


def require(module: str, what: str) -> ModuleType:
    """Imports ``module``; when it is missing, an ImportError that says who needs it and which extra to install."""
    return _library_require(module, what, hint)
