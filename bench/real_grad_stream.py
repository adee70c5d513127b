# SPDX-License-Identifier: Apache-2.0
"""Consecutive bf16 versions of a real model trained with real gradients: the stories260K update
stream of BENCHMARKS.md ("delta").

Input: a Hugging Face Llama directory with float32 weights (model.safetensors + config.json), as
`weightbus convert-llama2c stories260K.bin DIR --dtype f32` writes it. The float32 weights are the
master copy; every step computes a next-token cross-entropy loss on text found on the machine
(by default the license texts under /usr/share/common-licenses), runs torch.optim.Adam (betas
0.9/0.95, eps 1e-8, no weight decay) on the master and writes the master cast to bf16 (round to
nearest even, as torch does) as a new version:

  OUT/v00000.safetensors   the converted model, cast to bf16 (before any step)
  OUT/v00001.safetensors   after one Adam step, ...
  OUT/stream.json          the parameters, the text files and their sha256, the loss per step
  OUT/check_tokens.i32     the first sequence of step 1 (int32) and the float32 logits the torch
  OUT/check_logits.f32     model gives for it before any step, so that a caller can check this
                           forward pass against an independent one (weightbus-delta-bench does,
                           against tools/weightbus/llama_forward.h)

Text becomes tokens through llama2.c's byte fallback: byte b is token 3 + b (ids 0..2 are <unk>,
<s>, </s>; sentencepiece with byte_fallback puts <0x00>..<0xFF> right after them), so no
tokenizer file is needed. Batches are windows of the token stream at positions drawn from
numpy's PCG64 seeded with --seed. Torch runs on one thread with deterministic algorithms: the same
arguments give byte-identical files.

Run with Debian's interpreter, which sees python3-torch: /usr/bin/python3 real_grad_stream.py ...
Prints one JSON line per step ({"step", "loss"}) and exits 0; exits 2 with a JSON line
{"skipped": reason} when torch cannot be imported.
"""
import argparse
import glob
import hashlib
import json
import math
import os
import struct
import sys


def read_safetensors(path, torch):
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    start = 8 + n
    out = {}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        if e["dtype"] != "F32":
            raise SystemExit(f"{path}: tensor {name} is {e['dtype']}, expected F32 (convert "
                             "with --dtype f32)")
        b, end = e["data_offsets"]
        t = torch.frombuffer(bytearray(data[start + b:start + end]), dtype=torch.float32)
        out[name] = t.reshape(e["shape"]).clone()
    return out


def write_safetensors(path, tensors, torch):
    """Writes bf16 tensors (name order kept) in the safetensors format, data 8-byte aligned."""
    header = {"__metadata__": {"format": "pt"}}
    blobs = []
    offset = 0
    for name, t in tensors:
        raw = t.contiguous().view(torch.int16).numpy().tobytes()
        header[name] = {"dtype": "BF16", "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * ((8 - (8 + len(text)) % 8) % 8)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for raw in blobs:
            f.write(raw)
    os.replace(tmp, path)


class TinyLlama:
    """LlamaForCausalLM's forward pass over HF-named tensors (transformers' modeling_llama.py):
    RMSNorm, half-split RoPE, grouped-query causal attention, SwiGLU MLP, tied embeddings."""

    def __init__(self, params, cfg, torch):
        self.t = torch
        self.p = params
        self.dim = cfg["hidden_size"]
        self.layers = cfg["num_hidden_layers"]
        self.heads = cfg["num_attention_heads"]
        self.kv_heads = cfg.get("num_key_value_heads", self.heads)
        self.head_dim = self.dim // self.heads
        self.eps = cfg.get("rms_norm_eps", 1e-6)
        theta = cfg.get("rope_theta", 10000.0)
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float32)
                                         / self.head_dim))
        self.tied = cfg.get("tie_word_embeddings", False)

    def norm(self, x, w):
        t = self.t
        return x * t.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * w

    def rope(self, x, cos, sin):
        half = x.shape[-1] // 2
        rotated = self.t.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    def __call__(self, tokens):
        t, p = self.t, self.p
        B, T = tokens.shape
        h = p["model.embed_tokens.weight"][tokens]
        pos = t.arange(T, dtype=t.float32)
        freqs = t.outer(pos, self.inv_freq)
        emb = t.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        mask = t.full((T, T), float("-inf")).triu(1)
        for i in range(self.layers):
            pre = f"model.layers.{i}."
            x = self.norm(h, p[pre + "input_layernorm.weight"])
            q = (x @ p[pre + "self_attn.q_proj.weight"].T).view(B, T, self.heads, self.head_dim)
            k = (x @ p[pre + "self_attn.k_proj.weight"].T).view(B, T, self.kv_heads, self.head_dim)
            v = (x @ p[pre + "self_attn.v_proj.weight"].T).view(B, T, self.kv_heads, self.head_dim)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            q, k = self.rope(q, cos, sin), self.rope(k, cos, sin)
            rep = self.heads // self.kv_heads
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
            att = (q @ k.transpose(-1, -2)) / math.sqrt(self.head_dim) + mask
            o = (att.softmax(-1) @ v).transpose(1, 2).reshape(B, T, self.dim)
            h = h + o @ p[pre + "self_attn.o_proj.weight"].T
            x = self.norm(h, p[pre + "post_attention_layernorm.weight"])
            gate = x @ p[pre + "mlp.gate_proj.weight"].T
            up = x @ p[pre + "mlp.up_proj.weight"].T
            h = h + (t.nn.functional.silu(gate) * up) @ p[pre + "mlp.down_proj.weight"].T
        h = self.norm(h, p["model.norm.weight"])
        head = p["model.embed_tokens.weight"] if self.tied else p["lm_head.weight"]
        return h @ head.T


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="HF Llama dir with float32 model.safetensors")
    ap.add_argument("--out", required=True)
    ap.add_argument("--lr", type=float, required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--text", action="append",
                    help="glob of text files (repeatable); default /usr/share/common-licenses/*")
    a = ap.parse_args()
    try:
        import numpy as np
        import torch
    except ImportError as e:
        print(json.dumps({"skipped": f"torch or numpy not importable: {e}"}), flush=True)
        return 2
    torch.manual_seed(a.seed)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)

    with open(os.path.join(a.model, "config.json")) as f:
        cfg = json.load(f)
    master = read_safetensors(os.path.join(a.model, "model.safetensors"), torch)
    names = list(master.keys())  # file order
    params = {n: torch.nn.Parameter(t) for n, t in master.items()}
    model = TinyLlama(params, cfg, torch)
    opt = torch.optim.Adam(params.values(), lr=a.lr, betas=(0.9, 0.95), eps=1e-8,
                           weight_decay=0.0)

    files = []
    for pattern in a.text or ["/usr/share/common-licenses/*"]:
        files += sorted(p for p in glob.glob(pattern) if os.path.isfile(p))
    corpus = bytearray()
    text_info = []
    for path in files:
        with open(path, "rb") as f:
            b = f.read()
        corpus += b
        text_info.append({"path": path, "bytes": len(b), "sha256": hashlib.sha256(b).hexdigest()})
    tokens = torch.from_numpy(np.frombuffer(bytes(corpus), dtype=np.uint8).astype(np.int64) + 3)
    if len(tokens) < a.seq_len + 2:
        raise SystemExit(f"only {len(tokens)} bytes of text in {files}")
    rng = np.random.default_rng(a.seed)

    os.makedirs(a.out, exist_ok=True)

    def write_version(step):
        write_safetensors(os.path.join(a.out, f"v{step:05d}.safetensors"),
                          [(n, params[n].detach().to(torch.bfloat16)) for n in names], torch)

    write_version(0)
    losses = []
    for step in range(1, a.steps + 1):
        starts = torch.from_numpy(rng.integers(0, len(tokens) - a.seq_len - 1, size=a.batch))
        index = starts[:, None] + torch.arange(a.seq_len + 1)[None, :]
        window = tokens[index]
        x, y = window[:, :-1], window[:, 1:]
        if step == 1:
            with torch.no_grad():
                check = model(x[:1, :32])[0]
            x[0, :32].to(torch.int32).numpy().tofile(os.path.join(a.out, "check_tokens.i32"))
            check.numpy().astype(np.float32).tofile(os.path.join(a.out, "check_logits.f32"))
        logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                 y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        write_version(step)
        print(json.dumps({"step": step, "loss": loss.item()}), flush=True)

    with open(os.path.join(a.out, "stream.json"), "w") as f:
        json.dump({"model": os.path.abspath(a.model), "lr": a.lr, "steps": a.steps,
                   "seed": a.seed, "batch": a.batch, "seq_len": a.seq_len,
                   "optimizer": "torch.optim.Adam betas=(0.9, 0.95) eps=1e-8",
                   "tokens": "byte b -> 3 + b (llama2.c byte fallback)",
                   "torch": torch.__version__, "text": text_info, "loss": losses}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
