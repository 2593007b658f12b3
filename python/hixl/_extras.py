"""Optional dependencies: which pip extra of hixl provides each, and a clear error when one is missing.

The core (``hixl.Hixl``, ``hixl.kv``, ``hixl.acl``, ``hixl.Endpoint``) needs numpy only; the
integrations need more, declared as extras in pyproject.toml: ``proxy`` (aiohttp), ``metrics``
(prometheus-client: ``/metrics`` of ``HixlMetricsPort``; ``Hixl.metrics()`` needs nothing), ``vllm`` (the
connector, and hixl-tools' model export), ``test`` (pytest and what tier 1 runs). The tools (``hixl bench``,
``hixl demo``) are another distribution, hixl-tools (tools/pyproject.toml), with extras of their own.
"""
from __future__ import annotations

import importlib
from types import ModuleType
from typing import Callable

# top-level import name -> the extra that installs it
EXTRA_OF = {
    "aiohttp": "proxy",
    "prometheus_client": "metrics",
    "vllm": "vllm", "torch": "vllm", "transformers": "vllm", "accelerate": "vllm", "safetensors": "vllm",
}


def hint(module: str) -> str:
    """``pip install 'hixl[EXTRA]'`` for the extra that provides ``module``."""
    extra = EXTRA_OF.get(module.split(".")[0])
    return "pip install 'hixl[%s]'" % extra if extra else "pip install %s" % module.split(".")[0]


def require(module: str, what: str, hint_of: Callable[[str], str] = hint) -> ModuleType:
    """Imports ``module``; when it is missing, an ImportError that says who needs it and which extra to
    install (``hint_of``: the install command for a module; hixl-tools passes its own)."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError("%s needs %s (%s): %s" % (what, module.split(".")[0], e, hint_of(module))) from e
