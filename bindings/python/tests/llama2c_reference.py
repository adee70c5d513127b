# SPDX-License-Identifier: Apache-2.0
"""llama2.c's forward pass (run.c `forward`) in numpy, straight from a llama2.c checkpoint file:
an independent reference for the converted Hugging Face weights and the PyTorch models (its
rotary embedding rotates adjacent pairs, the original convention, so it also checks the
converter's q/k row permutation)."""
import numpy as np


def read_checkpoint(path):
    raw = open(path, "rb").read()
    dim, hidden, n_layers, n_heads, n_kv, vocab, seq_len = np.frombuffer(raw[:28], np.int32)
    shared = vocab > 0
    vocab = abs(int(vocab))
    head = dim // n_heads
    kv_dim = head * n_kv
    floats = np.frombuffer(raw[28:], np.float32)
    at = 0

    def take(*shape):
        nonlocal at
        n = int(np.prod(shape))
        out = floats[at:at + n].reshape(shape)
        at += n
        return out

    w = {"config": dict(dim=int(dim), hidden=int(hidden), n_layers=int(n_layers),
                        n_heads=int(n_heads), n_kv=int(n_kv), vocab=vocab, seq_len=int(seq_len))}
    w["emb"] = take(vocab, dim)
    w["rms_att"] = take(n_layers, dim)
    w["wq"] = take(n_layers, dim, dim)
    w["wk"] = take(n_layers, kv_dim, dim)
    w["wv"] = take(n_layers, kv_dim, dim)
    w["wo"] = take(n_layers, dim, dim)
    w["rms_ffn"] = take(n_layers, dim)
    w["w1"] = take(n_layers, hidden, dim)
    w["w2"] = take(n_layers, dim, hidden)
    w["w3"] = take(n_layers, hidden, dim)
    w["rms_final"] = take(dim)
    take(seq_len, head // 2)
    take(seq_len, head // 2)
    w["wcls"] = w["emb"] if shared else take(vocab, dim)
    return w


def _rmsnorm(x, weight):
    ss = (x.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-5
    return (x / np.sqrt(ss) * weight).astype(np.float64)


def forward(w, tokens):
    """Logits [T, vocab] (float64) for the token ids `tokens`, positions 0..T-1."""
    c = w["config"]
    dim, n_heads, n_kv = c["dim"], c["n_heads"], c["n_kv"]
    head = dim // n_heads
    kv_mul = n_heads // n_kv
    t = len(tokens)
    x = w["emb"][np.asarray(tokens)].astype(np.float64)
    pos = np.arange(t)[:, None]
    i = np.arange(0, head, 2)
    freq = 1.0 / (10000.0 ** (i / head))
    cos, sin = np.cos(pos * freq), np.sin(pos * freq)  # [T, head/2]

    def rope(v, heads):  # v [T, heads*head]; rotate pairs (2i, 2i+1) of each head
        v = v.reshape(t, heads, head // 2, 2)
        v0, v1 = v[..., 0], v[..., 1]
        c_, s_ = cos[:, None, :], sin[:, None, :]
        return np.stack([v0 * c_ - v1 * s_, v0 * s_ + v1 * c_], -1).reshape(t, heads * head)

    mask = np.triu(np.ones((t, t), bool), 1)
    for l in range(c["n_layers"]):
        xb = _rmsnorm(x, w["rms_att"][l])
        q = rope(xb @ w["wq"][l].T, n_heads).reshape(t, n_heads, head)
        k = rope(xb @ w["wk"][l].T, n_kv).reshape(t, n_kv, head)
        v = (xb @ w["wv"][l].T).reshape(t, n_kv, head)
        out = np.empty((t, n_heads, head))
        for h in range(n_heads):
            scores = q[:, h] @ k[:, h // kv_mul].T / np.sqrt(head)
            scores[mask] = -np.inf
            att = np.exp(scores - scores.max(-1, keepdims=True))
            att /= att.sum(-1, keepdims=True)
            out[:, h] = att @ v[:, h // kv_mul]
        x = x + out.reshape(t, dim) @ w["wo"][l].T
        xb = _rmsnorm(x, w["rms_ffn"][l])
        h1, h3 = xb @ w["w1"][l].T, xb @ w["w3"][l].T
        x = x + (h1 / (1 + np.exp(-h1)) * h3) @ w["w2"][l].T
    return _rmsnorm(x, w["rms_final"]) @ w["wcls"].T
