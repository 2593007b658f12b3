"""``KVLayout``: the shape of one token's K (or V) in one layer, and the paging."""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from typing import Any, Optional, Tuple

import numpy as np

_DTYPES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int8": 1, "uint8": 1, "float8": 1}


@dataclass(frozen=True)
class KVLayout:
    """Shape of one token's K (or V) in one layer, and the paging.

    A block holds ``block_tokens`` tokens of one (layer, K|V): ``[block_tokens, n_kv_heads, head_dim]``
    elements, contiguous. ``dtype`` is a name (``float32``, ``float16``, ``bfloat16``, ...); numpy
    has no bfloat16, so its views use ``uint16`` bit patterns.
    """

    n_layers: int
    n_kv_heads: int
    head_dim: int
    dtype: str = "float16"
    block_tokens: int = 16

    def __post_init__(self) -> None:
        for name in ("n_layers", "n_kv_heads", "head_dim", "block_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"KVLayout.{name} must be a positive int, not {v!r}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"KVLayout.dtype {self.dtype!r} is not one of {sorted(_DTYPES)}")

    @property
    def itemsize(self) -> int:
        return _DTYPES[self.dtype]

    @property
    def np_dtype(self) -> np.dtype:
        """The numpy dtype of views (bfloat16 -> uint16, float8 -> uint8: bit patterns)."""
        return np.dtype({"bfloat16": "uint16", "float8": "uint8"}.get(self.dtype, self.dtype))

    @property
    def token_bytes(self) -> int:
        """Bytes of one token's K (or V) in one layer."""
        return self.n_kv_heads * self.head_dim * self.itemsize

    @property
    def block_bytes(self) -> int:
        return self.block_tokens * self.token_bytes

    def blocks_for(self, n_tokens: int) -> int:
        return -(-int(n_tokens) // self.block_tokens)

    def kv_bytes(self, n_tokens: int, layers: Optional[Tuple[int, int]] = None) -> int:
        """Bytes of K plus V of ``n_tokens`` tokens over ``layers`` (default: all)."""
        lo, hi = layers or (0, self.n_layers)
        return (hi - lo) * 2 * int(n_tokens) * self.token_bytes

    def fingerprint(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:16]

    @classmethod
    def for_model(cls, config: Any, dtype: str = "float32", block_tokens: int = 16) -> "KVLayout":
        """From a model config with ``n_layers``, ``n_kv_heads`` and ``head_dim`` attributes."""
        return cls(int(config.n_layers), int(config.n_kv_heads), int(config.head_dim), dtype, block_tokens)
