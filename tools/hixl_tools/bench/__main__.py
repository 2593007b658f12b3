"""``python -m hixl_tools.bench``: the same as ``hixl bench``."""
import sys

from .driver import main

sys.exit(main())
