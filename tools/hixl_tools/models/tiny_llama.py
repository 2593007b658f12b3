"""``hixl model tiny-llama DIR``: the ``llama`` of ``hixl model tiny`` (``hixl model tiny llama DIR``), a
small Llama in Hugging Face format with random weights from a fixed seed, for tensor-parallel tests:
8 query heads and 4 KV heads (both divide by 2, unlike SmolLM2-135M's 9 and 3), a few layers, SmolLM2's
tokenizer. How its weights are made and checked: ``tiny.llama`` and ``tiny.checks``. Its exports (marker
``hixl_tiny_llama.json``) are the ones this command always wrote, and are kept.
"""
from __future__ import annotations

import sys
from typing import Dict, List, Optional

from .tiny import checks
from .tiny.cli import main as _main
from .tiny.llama import Llama
from .tiny.writer import write_tiny

__all__ = ["spec_dict", "write_tiny_llama", "greedy_margin", "main", "MIN_MARGIN", "PROMPTS"]

MIN_MARGIN = checks.MIN_MARGIN["float32"]
PROMPTS = checks.PROMPTS
greedy_margin = checks.greedy_margin


def spec_dict(seed: int, layers: int, hidden: int, head_scale: float = 16.0, attn_scale: float = 4.0) -> Dict:
    return Llama().spec(seed, layers, hidden, head_scale=head_scale, attn_scale=attn_scale)


def write_tiny_llama(out: str, *, seed: int = 3, layers: int = 2, hidden: int = 256, head_scale: float = 16.0,
                     attn_scale: float = 4.0, tokenizer: Optional[str] = None, force: bool = False, log=print) -> float:
    """``write_tiny("llama", ...)`` (see ``tiny.writer``)."""
    return write_tiny("llama", out, seed=seed, layers=layers, hidden=hidden, tokenizer=tokenizer, force=force,
                      log=log, prog="hixl model tiny-llama", head_scale=head_scale, attn_scale=attn_scale)


def main(argv: Optional[List[str]] = None) -> int:
    return _main(argv, prog="hixl model tiny-llama", arch="llama")


if __name__ == "__main__":
    sys.exit(main())
