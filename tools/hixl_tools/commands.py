"""The ``hixl`` console script's tool commands, registered as entry points (group ``hixl.commands`` in
tools/pyproject.toml): ``hixl bench``, ``hixl demo``, ``hixl model export``, ``hixl model tiny ARCH`` (and
``hixl model tiny-llama``, its ``llama``). Each takes the arguments after its name and returns the exit
code; the tool is imported only when its command runs."""
from __future__ import annotations

import sys
from typing import List


def bench(argv: List[str]) -> int:
    from .bench import main
    return main(argv)


def demo(argv: List[str]) -> int:
    from .demo import main
    return main(argv)


def model(argv: List[str]) -> int:
    if argv[:1] == ["export"]:
        from .models.export import main
        return main(argv[1:])
    if argv[:1] == ["tiny"]:
        from .models.tiny.cli import main as tiny
        return tiny(argv[1:])
    if argv[:1] == ["tiny-llama"]:  # hixl model tiny llama
        from .models.tiny_llama import main as tiny_llama
        return tiny_llama(argv[1:])
    print("usage: hixl model export DIR [--gguf FILE] [--force]\n"
          "       hixl model tiny ARCH DIR [--seed N] [--layers N] [--hidden N] [--force]\n"
          "         ARCH: llama, deepseek-v2, gemma3, gpt-oss, qwen3-next (hixl model tiny -h)\n"
          "       hixl model tiny-llama DIR [--seed N] [--layers N] [--force]  (= hixl model tiny llama)",
          file=sys.stderr)
    return 0 if argv[:1] in (["-h"], ["--help"]) else 2
