"""The built parts of the ``qwen3-next`` tiny model (see ``qwen3_next``): the split residual stream
(:class:`Layout`), the embedding and head, the induction GDN layer and the positional copying attention."""
from __future__ import annotations

import math
from typing import Dict, Sequence

__all__ = ["Layout", "embed_and_head", "induction", "positional_copy"]


class Layout:
    """Dimensions of the residual stream: ``const`` (0), ``hash`` (one-hot bucket of the token),
    ``ind`` (the induction layer's output), ``tok`` (the token's random embedding, read by the head)."""

    def __init__(self, hidden: int, buckets: int):
        self.const = 0
        self.hash = slice(1, 1 + buckets)
        self.ind = slice(1 + buckets, 1 + 2 * buckets)
        self.tok = slice(1 + 2 * buckets, hidden)
        self.buckets = buckets


def embed_and_head(model, lay: Layout, head_scale: float) -> None:
    """Token part: the random embedding; constant and hash: 4 times its spread; head: the token part."""
    import torch
    emb = model.model.embed_tokens.weight
    vocab = emb.shape[0]
    tok = emb[:, lay.tok].clone()
    s = float(tok.std())
    gen = torch.Generator().manual_seed(vocab)  # the buckets: fixed by the vocabulary's size
    bucket = torch.randint(lay.buckets, (vocab,), generator=gen)
    emb.zero_()
    emb[:, lay.tok] = tok
    emb[:, lay.const] = 4 * s
    emb[torch.arange(vocab), lay.hash.start + bucket] = 4 * s
    head = model.lm_head.weight
    head.zero_()
    head[:, lay.tok] = tok * head_scale


def induction(gdn, lay: Layout):
    """Key: hash of x_(t-1) (conv tap 2), query: hash of x_t (tap 3), value: silu(random(token) + ~6) of x_t
    (~ linear: the constant is removed by the output map), z: the constant (silu > 0), beta = sigmoid(~25),
    no decay (dt_bias -30: softplus ~ 1e-13); the constant dimension is ~5 after the input norm. Output: a
    fixed random map of the value into ``ind``. Returns the linear part of token -> ``ind`` ([buckets, tok],
    rows of unit norm on average)."""
    import torch
    nk, nv, dk = gdn.num_k_heads, gdn.num_v_heads, gdn.head_k_dim
    dv, r = gdn.head_v_dim, gdn.num_v_heads // gdn.num_k_heads
    w = gdn.in_proj_qkvz.weight.view(nk, 2 * dk + 2 * r * dv, -1)
    wv = w[:, 2 * dk:2 * dk + r * dv, lay.tok].clone()
    w.zero_()
    eye = torch.eye(dk)
    w[:, :dk, lay.hash] = eye        # query
    w[:, dk:2 * dk, lay.hash] = eye  # key
    scale = 1.0 / float(wv.std()) / math.sqrt(lay.tok.stop - lay.tok.start)
    w[:, 2 * dk:2 * dk + r * dv, lay.tok] = wv * scale  # ~unit rows on a ~unit-RMS token part
    w[:, 2 * dk:2 * dk + r * dv, lay.const] = 1.25        # + ~6
    w[:, 2 * dk + r * dv:, lay.const] = 1.0               # z
    ba = gdn.in_proj_ba.weight.view(nk, 2 * r, -1)
    ba.zero_()
    ba[:, :r, lay.const] = 5.0       # b ~ 25
    gdn.dt_bias.fill_(-30.0)
    gdn.A_log.zero_()
    conv = gdn.conv1d.weight         # [channels, 1, kernel]: q (nk dk), k (nk dk), v (nv dv)
    conv.zero_()
    kq = nk * dk
    conv[:kq, 0, -1] = 1.0
    conv[kq:2 * kq, 0, -2] = 1.0
    conv[2 * kq:, 0, -1] = 1.0
    gdn.norm.weight.fill_(1.0)
    out = gdn.out_proj.weight        # [hidden, nv dv]
    gen = torch.Generator().manual_seed(nv * dv)
    p = torch.randn(lay.buckets, nv, dv, generator=gen)
    p -= p.mean(dim=2, keepdim=True)  # each value head's constant (the + ~6) maps to nothing
    out.zero_()
    out[lay.ind] = p.reshape(lay.buckets, nv * dv) / math.sqrt(nv * dv)
    fwd = out[lay.ind] @ w[:, 2 * dk:2 * dk + r * dv, lay.tok].reshape(nv * dv, -1)
    return fwd * math.sqrt(lay.buckets) / fwd.norm()


def _rope_pattern(cfg, head_dim: int, offset: int, weights: Sequence[float]):
    """Query and key vectors (per head) whose RoPE'd dot product peaks at relative position ``offset``."""
    import torch
    rot = int(head_dim * getattr(cfg, "partial_rotary_factor", 1.0))
    half = rot // 2
    theta = cfg.rope_parameters["rope_theta"]
    inv = theta ** (-torch.arange(0, rot, 2, dtype=torch.float64) / rot)
    amp = torch.sqrt(torch.tensor(weights, dtype=torch.float64) / sum(weights))
    q = torch.zeros(head_dim, dtype=torch.float64)
    k = torch.zeros(head_dim, dtype=torch.float64)
    q[:half], q[half:rot] = amp * torch.cos(offset * inv), -amp * torch.sin(offset * inv)
    k[:half] = amp
    return q.float(), k.float()


def positional_copy(att, lay: Layout, spec: Dict, weights: Sequence[float], cfg, fwd) -> None:
    """Attends OFFSET back (query/key from the constant; q/k norms sharpen), gate 0 (sigmoid 1/2); KV head 0
    carries ``ind``, KV head 1 a random map of ``tok``; the output maps both back onto ``tok`` (transposed:
    ``fwd`` is the induction's token -> ``ind`` map), so a copied token's own head row gains the most."""
    import torch
    h, g, hd = spec["heads"], spec["kv_heads"], spec["head_dim"]
    qv, kv = _rope_pattern(cfg, hd, spec["offset"], weights)
    q = att.q_proj.weight.view(h, 2 * hd, -1)
    q.zero_()
    q[:, :hd, lay.const] = qv
    k = att.k_proj.weight.view(g, hd, -1)
    k.zero_()
    k[:, :, lay.const] = kv
    att.q_norm.weight.fill_(spec["sharpness"] - 1)  # Qwen3-Next's norms scale by 1 + weight
    att.k_norm.weight.fill_(spec["sharpness"] - 1)
    ntok = lay.tok.stop - lay.tok.start
    gen = torch.Generator().manual_seed(hd * ntok)
    b = torch.randn(hd, ntok, generator=gen) / math.sqrt(ntok)
    v = att.v_proj.weight.view(g, hd, -1)
    v.zero_()
    v[0, :, lay.ind] = torch.eye(hd, lay.buckets)
    v[1, :, lay.tok] = b
    o = att.o_proj.weight.view(-1, h, hd)  # [hidden, heads, head_dim]
    o.zero_()
    per = h // g
    o[lay.tok, :per, :] = spec["induction"] * fwd.t().unsqueeze(1) / per
    o[lay.tok, per:, :] = spec["fallback"] * b.t().unsqueeze(1) / per
