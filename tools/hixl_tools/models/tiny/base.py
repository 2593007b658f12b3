"""What an architecture of ``hixl model tiny`` says about itself (:class:`TinyArch`): its name, its
transformers class and dtype, the parameters that make its spec, the config built from a spec, and the
edits made to the random weights so that greedy outputs are robust and depend on the context."""
from __future__ import annotations

from typing import Dict, Iterable, Optional, Tuple

__all__ = ["TinyArch", "scale_params"]


def scale_params(model, suffixes: Iterable[str], factor: float) -> int:
    """Multiplies every parameter whose name ends with one of ``suffixes`` by ``factor``; returns how many."""
    suffixes, n = tuple(suffixes), 0
    for name, p in model.named_parameters():
        if name.endswith(suffixes):
            p.mul_(factor)
            n += 1
    return n


class TinyArch:
    """One architecture. Subclasses set the class attributes and implement :meth:`spec`, :meth:`config`
    and :meth:`shape`; the writer (``writer.py``) does the rest the same way for all of them."""

    name = ""                 # the ARCH of ``hixl model tiny ARCH DIR``
    summary = ""              # one line for --help
    model_class = ""          # transformers class, e.g. "LlamaForCausalLM" (config.json's architectures)
    dtype = "float32"         # what vLLM runs it in (--dtype): the margin is measured in it, the files hold it
    seed = 1                  # default seed (one that passes the checks)
    layers: Tuple[int, ...] = (2, 3, 4)  # allowed --layers, the first one the default
    hidden_multiple = 8       # --hidden must be a multiple of it
    marker = ""               # the export's marker file; default hixl_tiny_<name>.json

    def marker_name(self) -> str:
        return self.marker or "hixl_tiny_%s.json" % self.name.replace("-", "_")

    def check_args(self, layers: int, hidden: int) -> Optional[str]:
        """Why these --layers/--hidden are refused, or None."""
        if layers not in self.layers:
            return "--layers must be one of %s for %s" % (", ".join(map(str, self.layers)), self.name)
        if hidden % self.hidden_multiple or hidden <= 0:
            return "--hidden must be a positive multiple of %d for %s" % (self.hidden_multiple, self.name)
        return None

    def spec(self, seed: int, layers: int, hidden: int, **over) -> Dict:
        """Everything that decides the files (compared with the marker of an earlier export)."""
        raise NotImplementedError

    def config(self, spec: Dict, vocab: int, special: Dict[str, Optional[int]]):
        """The transformers config of ``spec`` (``special``: the tokenizer's bos/eos/pad ids)."""
        raise NotImplementedError

    def shape(self, model, spec: Dict) -> None:
        """Edits the freshly initialised float32 weights in place (under ``torch.no_grad``)."""
        raise NotImplementedError

    def describe(self, spec: Dict) -> str:
        """A few words on the shape, for the log line."""
        return "%d layers, hidden %d" % (spec["layers"], spec["hidden"])
