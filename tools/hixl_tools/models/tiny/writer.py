"""Builds, checks and writes one tiny model (:func:`write_tiny`), the same way for every architecture."""
from __future__ import annotations

import os
import time
from typing import Optional

from ..._extras import hint
from . import checks, store
from .base import TinyArch
from .registry import arch_of

__all__ = ["write_tiny", "build"]


def build(arch: TinyArch, spec, tok):
    """The model of ``spec``: random weights from ``spec["seed"]``, edited by the architecture, in its dtype."""
    import torch
    import transformers
    special = {k: getattr(tok, k, None) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    cfg = arch.config(spec, len(tok), special)
    torch.manual_seed(spec["seed"])
    model = getattr(transformers, arch.model_class)(cfg).to(torch.float32).eval()
    with torch.no_grad():
        arch.shape(model, spec)
    return model.to(getattr(torch, arch.dtype))


def _load(arch: TinyArch, out: str):
    import torch
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(out, dtype=getattr(torch, arch.dtype)).eval(), store.tokenizer(out)


def write_tiny(name: str, out: str, *, seed: Optional[int] = None, layers: Optional[int] = None,
               hidden: int = 256, tokenizer: Optional[str] = None, force: bool = False, log=print,
               prog: Optional[str] = None, **over) -> float:
    """Writes the ``name`` model to ``out`` unless an export of the same spec is there (``force`` redoes it);
    ``over`` overrides the architecture's other spec entries (e.g. ``head_scale``). Returns the smallest
    relative greedy margin (measured again on a kept export). Raises ``ValueError`` when the arguments or
    the model fail the checks (``checks``), ``ImportError`` (naming the extra) when torch/transformers
    are missing."""
    arch = arch_of(name)
    prog = prog or "hixl model tiny %s" % arch.name
    seed = arch.seed if seed is None else seed
    layers = arch.layers[0] if layers is None else layers
    why = arch.check_args(layers, hidden)
    if why:
        raise ValueError(why)
    try:
        import torch  # noqa: F401
        import safetensors  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as e:
        raise ImportError(f"{prog} needs torch, transformers and safetensors ({e}); install them with: "
                          f"{hint('vllm')}") from e
    out, t0 = os.path.abspath(out), time.monotonic()
    spec = arch.spec(seed, layers, hidden, **over)
    keep = store.kept(out, arch.marker_name(), spec) and not force
    if keep:
        model, tok = _load(arch, out)
    else:
        tok = store.tokenizer(tokenizer)
        model = build(arch, spec, tok)
    rel, gap, outs, sens = checks.measure(model, tok)
    why = checks.verdict(arch.dtype, rel, outs, sens)
    if why is None and not keep:
        made = {"arch": arch.name, "dtype": arch.dtype, "spec": spec, "smallest_relative_greedy_margin": rel,
                "smallest_greedy_gap": gap, "min_margin": checks.MIN_MARGIN[arch.dtype],
                "tokens_changed_by_a_zeroed_cache": sens}
        store.save(model, tok, architecture=arch.model_class, dtype=arch.dtype, marker=arch.marker_name(),
                   made=made, out=out)
    what = "kept" if keep else ("wrote" if why is None else "did not write")
    log(f"{prog}: {what} {out} (seed {seed}, {arch.describe(spec)}, {arch.dtype}); "
        f"{checks.summary(rel, gap, outs, sens)} ({time.monotonic() - t0:.1f} s)")
    if why is not None:
        raise ValueError(why + "; try another --seed")
    return rel
