"""The checks a tiny model must pass before it is written (the same for every architecture).

* Robust greedy outputs: over ``STEPS`` greedy tokens after each of :data:`PROMPTS`, the smallest top-1/top-2
  logit gap divided by the logits' standard deviation (:func:`greedy_margin`), with the model in the dtype
  vLLM runs it in, must reach :data:`MIN_MARGIN` of that dtype. float32 rounding is ~1e-6 of the logits, so
  1e-3 leaves three orders of magnitude. bfloat16 keeps 8 significant bits: the spacing of bf16 numbers at a
  top logit 4-8 standard deviations above the mean is 0.015-0.06 of the deviation, so the top-2 logits of
  random weights often tie; computing the same bf16 weights in float32 moves the top-1/top-2 gap by up to
  0.06 of the deviation on the qwen3-next model (0.02 on the random Llama, whose smallest gaps are ~0.01).
  The bf16 bound, 0.25, is four times that: a bf16 model needs built, not random, margins.
* The context matters: two prompts with the same last tokens (the first and the last of :data:`PROMPTS`)
  must continue differently.
* Every kind of cache matters (:func:`cache_sensitivity`): zeroing, after the prompt, the cache of the layers
  of one kind (full attention, sliding window, linear attention state) must change some greedy token, so that
  a wrong transfer of that kind shows in the tokens.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

__all__ = ["MIN_MARGIN", "PROMPTS", "STEPS", "greedy_margin", "cache_sensitivity", "layer_kinds", "verdict",
           "summary", "measure"]

MIN_MARGIN = {"float32": 1e-3, "bfloat16": 0.25}
# what the margin is measured on (greedy continuations, like the tests' prompts: words, a nonce, a question)
PROMPTS = ("[a1b2c3d4] Question 0: river stone light north. Answer in one sentence:",
           "What is the capital of France?",
           "winter bridge forest letter summer island doctor planet yellow camera " * 8,
           "paper silver window market. Answer in one sentence:")  # ends as the first one does
STEPS = 16


def greedy_margin(model, tok, prompts: Sequence[str] = PROMPTS, steps: int = STEPS):
    """``(smallest relative gap, smallest gap, continuations)``: the top-1/top-2 logit gap (divided by the
    logits' standard deviation for the first) over ``steps`` greedy tokens after each prompt, the logits
    as the model's dtype gives them."""
    import torch
    rel, gap, outs = float("inf"), float("inf"), []
    with torch.no_grad():
        for p in prompts:
            ids = tok(p, return_tensors="pt").input_ids
            n = ids.shape[1]
            for _ in range(steps):
                logits = model(ids).logits[0, -1].to(torch.float64)
                top = torch.topk(logits, 2).values
                gap = min(gap, float(top[0] - top[1]))
                rel = min(rel, float((top[0] - top[1]) / logits.std()))
                ids = torch.cat([ids, logits.argmax().view(1, 1)], dim=1)
            outs.append(ids[0, n:].tolist())
    return rel, gap, outs


def layer_kinds(config) -> List[str]:
    """Each layer's kind: ``full_attention``, ``sliding_attention`` or ``linear_attention``."""
    types = getattr(config, "layer_types", None)
    return list(types) if types else ["full_attention"] * config.num_hidden_layers


def _zero(cache, kinds: List[str], kind: str) -> None:
    for layer, k in zip(cache.layers, kinds):
        if k != kind:
            continue
        for name in ("keys", "values"):
            t = getattr(layer, name, None)
            if t is not None:
                t.zero_()
        for name in ("conv_states", "recurrent_states"):
            for t in (getattr(layer, name, None) or {}).values():
                if t is not None:
                    t.zero_()


def _cached_greedy(model, ids, steps: int, spoil=None) -> List[int]:
    out = model(ids, use_cache=True)
    cache = out.past_key_values
    if spoil is not None:
        spoil(cache)
    toks = []
    for i in range(steps):
        nxt = out.logits[0, -1].argmax().view(1, 1)
        toks.append(int(nxt))
        if i + 1 < steps:
            out = model(nxt, past_key_values=cache, use_cache=True)
    return toks


def cache_sensitivity(model, tok, prompts: Sequence[str] = PROMPTS, steps: int = STEPS) -> Dict[str, float]:
    """For each kind of layer: the fraction of greedy tokens (after the first, which the prompt's own pass
    gives) that change when that kind's cache is zeroed right after the prompt."""
    import torch
    kinds = layer_kinds(model.config)
    out: Dict[str, float] = {}
    with torch.no_grad():
        refs = [_cached_greedy(model, tok(p, return_tensors="pt").input_ids, steps) for p in prompts]
        for kind in sorted(set(kinds)):
            changed = 0
            for p, ref in zip(prompts, refs):
                got = _cached_greedy(model, tok(p, return_tensors="pt").input_ids, steps,
                                     lambda c: _zero(c, kinds, kind))
                changed += sum(a != b for a, b in zip(ref[1:], got[1:]))
            out[kind] = changed / (len(prompts) * (steps - 1))
    return out


def verdict(dtype: str, rel: float, outs: List[List[int]], sensitivity: Dict[str, float]) -> Optional[str]:
    """Why the model is refused, or None."""
    bound = MIN_MARGIN[dtype]
    if rel < bound:
        return (f"the smallest top-1/top-2 greedy logit gap is {rel:.2e} of the logits' spread (< {bound:g} for "
                f"{dtype}) over {len(outs)} prompts: rounding (e.g. tensor parallel) may flip a token")
    if outs[0] == outs[-1]:
        return "two prompts with the same last tokens get the same continuation: the context is ignored"
    blind = sorted(k for k, v in sensitivity.items() if v == 0)
    if blind:
        return (f"zeroing the cache of the {', '.join(blind)} layers after the prompt changes no greedy token: "
                f"a wrong transfer of it would go unseen")
    return None


def summary(rel: float, gap: float, outs: List[List[int]], sensitivity: Dict[str, float]) -> str:
    sens = ", ".join(f"{k} {v:.0%}" for k, v in sorted(sensitivity.items()))
    return (f"smallest greedy margin {gap:.4f} = {rel:.2e} of the logits' spread, "
            f"{len({t for o in outs for t in o})} distinct tokens in {len(outs)} continuations, tokens changed "
            f"by a zeroed cache: {sens}")


def measure(model, tok) -> Tuple[float, float, List[List[int]], Dict[str, float]]:
    rel, gap, outs = greedy_margin(model, tok)
    return rel, gap, outs, cache_sensitivity(model, tok)
