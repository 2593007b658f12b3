"""The architectures of ``hixl model tiny ARCH DIR``, by name."""
from __future__ import annotations

from typing import Dict

from .base import TinyArch
from .deepseek_v2 import DeepseekV2
from .gemma3 import Gemma3
from .gpt_oss import GptOss
from .llama import Llama
from .qwen3_next import Qwen3Next

__all__ = ["ARCHS", "arch_of"]

ARCHS: Dict[str, TinyArch] = {a.name: a for a in (Llama(), DeepseekV2(), Gemma3(), GptOss(), Qwen3Next())}


def arch_of(name: str) -> TinyArch:
    try:
        return ARCHS[name]
    except KeyError:
        raise ValueError("unknown architecture %r (one of: %s)" % (name, ", ".join(ARCHS))) from None
