"""``python -m hixl_tools.demo``: the same as ``hixl demo`` (and how the demo starts its worker processes)."""
import sys

from .cli import main

sys.exit(main())
