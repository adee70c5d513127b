# SPDX-License-Identifier: Apache-2.0
"""Two PyTorch Llamas over the same Hugging Face checkpoint, for tests and examples.

HfLlamaForCausalLM: the Hugging Face layout (separate q/k/v/o, gate/up/down projections), as
transformers' modeling_llama.py computes it; differentiable, used as the trainer's policy and as
the unfused reference.

VllmStyleLlamaForCausalLM: an inference replica shaped like vLLM's LlamaForCausalLM
(vllm/model_executor/models/llama.py): fused `qkv_proj` (QKVParallelLinear) and `gate_up_proj`
(MergedColumnParallelLinear) whose parameters carry `weight_loader`s, a `load_weights` that
maps checkpoint names through `stacked_params_mapping` and skips `lm_head.weight` when the
embeddings are tied, and linear layers with a `quant_method` whose
`process_weights_after_loading` must run after every load (it pre-packs the weights the forward
pass uses, as vLLM's CPU backend does), so a replica that skips it computes with stale weights.
With a forward pass and batched generation (greedy or sampled).

Both read the config.json that `weightbus convert-llama2c` writes (LlamaConfig fields).
"""
import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Set, Tuple

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    bos_token_id: int = 1
    eos_token_id: int = 2

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_json(cls, path_or_dict) -> "LlamaConfig":
        data = path_or_dict
        if not isinstance(data, dict):
            data = json.loads(Path(path_or_dict).read_text())
        fields = cls.__dataclass_fields__
        return cls(**{k: v for k, v in data.items() if k in fields})


_ST_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "F64": torch.float64, "I64": torch.int64, "I32": torch.int32,
              "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}


def read_safetensors(path) -> Dict[str, torch.Tensor]:
    """Reads a .safetensors file (https://github.com/huggingface/safetensors) into CPU tensors,
    in header order. Enough for the checkpoints these tests use; no validation beyond sizes."""
    data = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    header.pop("__metadata__", None)
    base = 8 + n
    out = {}
    for name, entry in header.items():
        begin, end = entry["data_offsets"]
        dtype = _ST_DTYPES[entry["dtype"]]
        raw = bytearray(data[base + begin:base + end])
        tensor = torch.frombuffer(raw, dtype=dtype) if raw else torch.empty(0, dtype=dtype)
        out[name] = tensor.reshape(entry["shape"]).clone()
    return out


def load_hf_checkpoint(model_dir) -> Tuple[LlamaConfig, Dict[str, torch.Tensor]]:
    """config.json and model.safetensors of a Hugging Face model directory."""
    model_dir = Path(model_dir)
    return (LlamaConfig.from_json(model_dir / "config.json"),
            read_safetensors(model_dir / "model.safetensors"))


# ---------------------------------------------------------------------------------------------
# Shared math
# ---------------------------------------------------------------------------------------------

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    variance = x.float().pow(2).mean(-1, keepdim=True)
    return (x.float() * torch.rsqrt(variance + eps)).to(x.dtype) * weight


def rope_cos_sin(config: LlamaConfig, positions: torch.Tensor, dtype=torch.float32):
    """cos and sin of the half-split (Hugging Face / vLLM is_neox_style) rotary embedding for
    `positions` [T]: each [T, head_dim]."""
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, D] rotated by rotate_half (pairs (i, i + D/2))."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def causal_attention(q, k, v, num_kv_groups: int) -> torch.Tensor:
    """q [B, H, T, D] at the last T positions of k and v [B, KV, S, D] (grouped-query; S >= T,
    the first S - T positions come from a KV cache) -> [B, T, H * D]."""
    if num_kv_groups > 1:
        k = k.repeat_interleave(num_kv_groups, dim=1)
        v = v.repeat_interleave(num_kv_groups, dim=1)
    b, h, t, d = q.shape
    s = k.shape[2]
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(d)
    mask = torch.ones(t, s, dtype=torch.bool, device=q.device).triu(s - t + 1)
    scores = scores.masked_fill(mask, float("-inf"))
    out = torch.softmax(scores.float(), dim=-1).to(q.dtype) @ v
    return out.transpose(1, 2).reshape(b, t, h * d)


# ---------------------------------------------------------------------------------------------
# Hugging Face layout (reference, trainable)
# ---------------------------------------------------------------------------------------------

class _HfAttention(nn.Module):
    def __init__(self, c: LlamaConfig):
        super().__init__()
        d, hd = c.hidden_size, c.head_dim
        self.c = c
        self.q_proj = nn.Linear(d, c.num_attention_heads * hd, bias=False)
        self.k_proj = nn.Linear(d, c.num_key_value_heads * hd, bias=False)
        self.v_proj = nn.Linear(d, c.num_key_value_heads * hd, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * hd, d, bias=False)

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        c, hd = self.c, self.c.head_dim
        q = self.q_proj(x).view(b, t, c.num_attention_heads, hd).transpose(1, 2)
        k = self.k_proj(x).view(b, t, c.num_key_value_heads, hd).transpose(1, 2)
        v = self.v_proj(x).view(b, t, c.num_key_value_heads, hd).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        groups = c.num_attention_heads // c.num_key_value_heads
        return self.o_proj(causal_attention(q, k, v, groups))


class _HfMlp(nn.Module):
    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _RmsNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)


class _HfLayer(nn.Module):
    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.self_attn = _HfAttention(c)
        self.mlp = _HfMlp(c)
        self.input_layernorm = _RmsNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = _RmsNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class _HfModel(nn.Module):
    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(_HfLayer(c) for _ in range(c.num_hidden_layers))
        self.norm = _RmsNorm(c.hidden_size, c.rms_norm_eps)


class HfLlamaForCausalLM(nn.Module):
    """LlamaForCausalLM in the Hugging Face layout. state_dict() names match the checkpoint
    (lm_head.weight is omitted when tied)."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        self.model = _HfModel(config)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def lm_head_weight(self) -> torch.Tensor:
        if self.config.tie_word_embeddings:
            return self.model.embed_tokens.weight
        return self.lm_head.weight

    @classmethod
    def from_checkpoint(cls, model_dir) -> "HfLlamaForCausalLM":
        config, tensors = load_hf_checkpoint(model_dir)
        model = cls(config)
        model.load_state_dict({k: v.float() for k, v in tensors.items()}, strict=True)
        return model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [B, T] -> logits [B, T, vocab] (positions 0..T-1)."""
        x = self.model.embed_tokens(input_ids)
        cos, sin = rope_cos_sin(self.config, torch.arange(input_ids.shape[1]), x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        return self.model.norm(x) @ self.lm_head_weight().t()


# ---------------------------------------------------------------------------------------------
# vLLM layout (replica)
# ---------------------------------------------------------------------------------------------

def default_weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
    """vLLM's default_weight_loader: same shape, copy (converting dtype and device)."""
    if param.shape != loaded_weight.shape:
        raise ValueError(f"attempted to load weight {tuple(loaded_weight.shape)} into parameter "
                         f"{tuple(param.shape)}")
    param.data.copy_(loaded_weight)


class UnquantizedLinearMethod:
    """Like vLLM's UnquantizedLinearMethod on its CPU backend: after weights are loaded,
    process_weights_after_loading prepares the layout the GEMM uses (here a pre-transposed copy
    of the weight); apply() computes with that prepared copy only."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        layer.packed_weight_t = layer.weight.detach().t().contiguous()

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return x @ layer.packed_weight_t


class _LinearBase(nn.Module):
    def __init__(self, input_size: int, output_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.quant_method = UnquantizedLinearMethod()
        self.quant_method.process_weights_after_loading(self)

    def weight_loader(self, param, loaded_weight, loaded_shard_id=None):
        default_weight_loader(param, loaded_weight)

    def forward(self, x):
        return self.quant_method.apply(self, x)


class RowParallelLinear(_LinearBase):
    pass


class QKVParallelLinear(_LinearBase):
    """Fused q, k and v projections; rows [q | k | v]."""

    def __init__(self, hidden_size: int, head_size: int, num_heads: int, num_kv_heads: int):
        self.head_size, self.num_heads, self.num_kv_heads = head_size, num_heads, num_kv_heads
        super().__init__(hidden_size, (num_heads + 2 * num_kv_heads) * head_size)

    def weight_loader(self, param, loaded_weight, loaded_shard_id=None):
        q, kv = self.num_heads * self.head_size, self.num_kv_heads * self.head_size
        offsets = {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}
        if loaded_shard_id not in offsets:
            raise ValueError(f"QKVParallelLinear: shard id {loaded_shard_id!r} is not q, k or v")
        offset, size = offsets[loaded_shard_id]
        target = param.data.narrow(0, offset, size)
        if target.shape != loaded_weight.shape:
            raise ValueError(f"QKVParallelLinear: shard {loaded_shard_id} is "
                             f"{tuple(loaded_weight.shape)}, expected {tuple(target.shape)}")
        target.copy_(loaded_weight)


class MergedColumnParallelLinear(_LinearBase):
    """Several column projections fused along the output dimension (gate | up)."""

    def __init__(self, input_size: int, output_sizes: List[int]):
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(output_sizes))

    def weight_loader(self, param, loaded_weight, loaded_shard_id=None):
        if not isinstance(loaded_shard_id, int) or not 0 <= loaded_shard_id < len(
                self.output_sizes):
            raise ValueError(f"MergedColumnParallelLinear: bad shard id {loaded_shard_id!r}")
        offset = sum(self.output_sizes[:loaded_shard_id])
        target = param.data.narrow(0, offset, self.output_sizes[loaded_shard_id])
        if target.shape != loaded_weight.shape:
            raise ValueError(f"MergedColumnParallelLinear: shard {loaded_shard_id} is "
                             f"{tuple(loaded_weight.shape)}, expected {tuple(target.shape)}")
        target.copy_(loaded_weight)


class _VllmAttention(nn.Module):
    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.c = c
        self.qkv_proj = QKVParallelLinear(c.hidden_size, c.head_dim, c.num_attention_heads,
                                          c.num_key_value_heads)
        self.o_proj = RowParallelLinear(c.num_attention_heads * c.head_dim, c.hidden_size)
        self.q_size = c.num_attention_heads * c.head_dim
        self.kv_size = c.num_key_value_heads * c.head_dim

    def forward(self, x, cos, sin, cache=None):
        b, t, _ = x.shape
        c, hd = self.c, self.c.head_dim
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(b, t, c.num_attention_heads, hd).transpose(1, 2)
        k = k.reshape(b, t, c.num_key_value_heads, hd).transpose(1, 2)
        v = v.reshape(b, t, c.num_key_value_heads, hd).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:  # this layer's KV cache: {"k": [B, KV, S, D], "v": ...}
            if "k" in cache:
                k = torch.cat([cache["k"], k], dim=2)
                v = torch.cat([cache["v"], v], dim=2)
            cache["k"], cache["v"] = k, v
        groups = c.num_attention_heads // c.num_key_value_heads
        return self.o_proj(causal_attention(q, k, v, groups))


class _VllmMlp(nn.Module):
    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(c.hidden_size, [c.intermediate_size] * 2)
        self.down_proj = RowParallelLinear(c.intermediate_size, c.hidden_size)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)  # SiluAndMul


class _VllmRmsNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.variance_epsilon = eps

    def forward(self, x):
        return rms_norm(x, self.weight, self.variance_epsilon)


class _VllmLayer(nn.Module):
    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.self_attn = _VllmAttention(c)
        self.mlp = _VllmMlp(c)
        self.input_layernorm = _VllmRmsNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = _VllmRmsNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, x, cos, sin, cache=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class _VllmEmbedding(nn.Module):
    """VocabParallelEmbedding (one rank)."""

    def __init__(self, vocab: int, hidden: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab, hidden), requires_grad=False)

    def forward(self, ids):
        return F.embedding(ids, self.weight)


class _VllmLlamaModel(nn.Module):
    # vLLM LlamaModel.load_weights: (param_name, shard_name, shard_id)
    stacked_params_mapping = [
        (".qkv_proj", ".q_proj", "q"),
        (".qkv_proj", ".k_proj", "k"),
        (".qkv_proj", ".v_proj", "v"),
        (".gate_up_proj", ".gate_proj", 0),
        (".gate_up_proj", ".up_proj", 1),
    ]

    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.embed_tokens = _VllmEmbedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(_VllmLayer(c) for _ in range(c.num_hidden_layers))
        self.norm = _VllmRmsNorm(c.hidden_size, c.rms_norm_eps)

    def load_weights(self, weights: Iterable[Tuple[str, torch.Tensor]]) -> Set[str]:
        params_dict = dict(self.named_parameters())
        loaded: Set[str] = set()
        for name, loaded_weight in weights:
            if "rotary_emb.inv_freq" in name or "rotary_emb.cos_cached" in name or \
                    "rotary_emb.sin_cached" in name:
                continue
            for param_name, weight_name, shard_id in self.stacked_params_mapping:
                if weight_name not in name:
                    continue
                name = name.replace(weight_name, param_name)
                param = params_dict[name]
                param.weight_loader(param, loaded_weight, shard_id)
                break
            else:
                if name not in params_dict:
                    raise KeyError(f"checkpoint tensor {name!r} matches no parameter of the "
                                   f"model")
                param = params_dict[name]
                getattr(param, "weight_loader", default_weight_loader)(param, loaded_weight)
            loaded.add(name)
        return loaded


class VllmStyleLlamaForCausalLM(nn.Module):
    """An inference replica laid out like vLLM's LlamaForCausalLM (see the module docstring).
    Parameters are created uninitialized: load_weights, then process_weights_after_loading
    (weightbus.vllm.process_weights_after_loading), before use."""

    def __init__(self, config: LlamaConfig, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.config = config
        self.model = _VllmLlamaModel(config)
        if config.tie_word_embeddings:
            self.lm_head = self.model.embed_tokens  # vLLM: lm_head.tie_weights(embed_tokens)
        else:
            self.lm_head = _VllmEmbedding(config.vocab_size, config.hidden_size)
        self.to(dtype)
        self.dtype = dtype

    def load_weights(self, weights: Iterable[Tuple[str, torch.Tensor]]) -> Set[str]:
        """vLLM's LlamaForCausalLM.load_weights (AutoWeightsLoader): `model.*` names go to
        LlamaModel.load_weights, `lm_head.*` is skipped when tied. Returns the parameter names
        loaded."""
        model_weights, loaded = [], set()
        for name, tensor in weights:
            if name.startswith("lm_head."):
                if self.config.tie_word_embeddings:
                    continue
                head = self.lm_head.weight  # vLLM's AutoWeightsLoader: the param's loader
                getattr(head, "weight_loader", default_weight_loader)(head, tensor)
                loaded.add("lm_head.weight")
            elif name.startswith("model."):
                model_weights.append((name[len("model."):], tensor))
            else:
                raise KeyError(f"checkpoint tensor {name!r} is neither model.* nor lm_head.*")
        loaded |= {"model." + n for n in self.model.load_weights(model_weights)}
        return loaded

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, start_pos: int = 0,
                kv_cache: Optional[List[dict]] = None) -> torch.Tensor:
        """input_ids [B, T] at positions start_pos..start_pos+T-1 -> logits [B, T, vocab].
        kv_cache (one dict per layer, from a previous call) holds the keys and values of
        positions 0..start_pos-1 and is extended in place."""
        x = self.model.embed_tokens(input_ids)
        positions = torch.arange(start_pos, start_pos + input_ids.shape[1])
        cos, sin = rope_cos_sin(self.config, positions, x.dtype)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, None if kv_cache is None else kv_cache[i])
        return self.model.norm(x) @ self.lm_head.weight.t()

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, temperature: float = 0.0,
                 generator: Optional[torch.Generator] = None) -> torch.Tensor:
        """Continues each row of input_ids [B, T0] by max_new_tokens tokens with a KV cache:
        greedy (argmax) when temperature is 0, else sampled from softmax(logits / temperature)
        with `generator`. Returns the new tokens [B, max_new_tokens]."""
        cache = [{} for _ in self.model.layers]
        logits = self.forward(input_ids, 0, cache)[:, -1, :].float()
        pos = input_ids.shape[1]
        out = []
        for step in range(max_new_tokens):
            if temperature == 0.0:
                nxt = logits.argmax(dim=-1, keepdim=True)
            else:
                probs = torch.softmax(logits / temperature, dim=-1)
                nxt = torch.multinomial(probs, 1, generator=generator)
            out.append(nxt)
            if step + 1 < max_new_tokens:
                logits = self.forward(nxt, pos, cache)[:, -1, :].float()
                pos += 1
        if not out:
            return input_ids.new_zeros((input_ids.shape[0], 0))
        return torch.cat(out, dim=1)

    def hf_state_dict(self) -> Dict[str, torch.Tensor]:
        """The parameters back in checkpoint (Hugging Face) names, un-fusing qkv_proj and
        gate_up_proj: what load_weights was given."""
        out = {"model.embed_tokens.weight": self.model.embed_tokens.weight.detach()}
        c = self.config
        q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        for i, layer in enumerate(self.model.layers):
            p = f"model.layers.{i}."
            qkv = layer.self_attn.qkv_proj.weight.detach()
            out[p + "self_attn.q_proj.weight"] = qkv[:q]
            out[p + "self_attn.k_proj.weight"] = qkv[q:q + kv]
            out[p + "self_attn.v_proj.weight"] = qkv[q + kv:]
            out[p + "self_attn.o_proj.weight"] = layer.self_attn.o_proj.weight.detach()
            gate_up = layer.mlp.gate_up_proj.weight.detach()
            out[p + "mlp.gate_proj.weight"] = gate_up[:c.intermediate_size]
            out[p + "mlp.up_proj.weight"] = gate_up[c.intermediate_size:]
            out[p + "mlp.down_proj.weight"] = layer.mlp.down_proj.weight.detach()
            out[p + "input_layernorm.weight"] = layer.input_layernorm.weight.detach()
            out[p + "post_attention_layernorm.weight"] = \
                layer.post_attention_layernorm.weight.detach()
        out["model.norm.weight"] = self.model.norm.weight.detach()
        if not c.tie_word_embeddings:
            out["lm_head.weight"] = self.lm_head.weight.detach()
        return out
