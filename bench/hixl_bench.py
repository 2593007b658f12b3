#!/usr/bin/env python3
"""`hixl bench` from a checkout: the same as `python3 -m hixl_tools.bench` (see bench/README.md)."""
import sys

from hixl_tools.bench import main

if __name__ == "__main__":
    sys.exit(main())
