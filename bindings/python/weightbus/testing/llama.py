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
With a forward pass and batched generation (greedy or sampled). With LlamaConfig.num_experts > 0
both have Qwen3-MoE's sparse MLP in the layers its config says: Hugging Face's one MLP per expert
(checkpoint names mlp.experts.{e}.gate_proj/up_proj/down_proj, router mlp.gate) and vLLM's
FusedMoE (w13_weight, w2_weight, split by expert or inside each expert as vLLM's
FusedMoEParallelConfig says).

Both read the config.json that `weightbus convert-llama2c` writes (LlamaConfig fields).
"""
import json
import math
import struct
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Set, Tuple

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
    # Sparse MoE MLPs, as Qwen3-MoE's config has them (transformers Qwen3MoeConfig; vLLM
    # vllm/model_executor/models/qwen3_moe.py): layer i is sparse when num_experts > 0, i is
    # not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0; each token goes to its
    # num_experts_per_tok experts (softmax over all experts, top k, renormalized when
    # norm_topk_prob), each a gated MLP of moe_intermediate_size.
    num_experts: int = 0
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 0
    decoder_sparse_step: int = 1
    mlp_only_layers: List[int] = field(default_factory=list)
    norm_topk_prob: bool = True

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def is_sparse_layer(self, layer_idx: int) -> bool:
        """Whether layer `layer_idx` has the sparse MoE MLP (Qwen3MoeDecoderLayer's rule)."""
        return (layer_idx not in self.mlp_only_layers and self.num_experts > 0 and
                (layer_idx + 1) % self.decoder_sparse_step == 0)

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
    def __init__(self, c: LlamaConfig, intermediate_size: Optional[int] = None):
        super().__init__()
        intermediate_size = intermediate_size or c.intermediate_size
        self.gate_proj = nn.Linear(c.hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, c.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def route_tokens(router_logits: torch.Tensor, top_k: int, renormalize: bool):
    """The router of Qwen3-MoE / Mixtral (transformers' Qwen3MoeSparseMoeBlock, vLLM's
    fused_topk): softmax over every expert in float32, the top_k experts of each token, their
    weights renormalized to sum to 1 when `renormalize`. router_logits [T, E] -> (weights
    [T, k] float32, expert ids [T, k])."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class _HfSparseMoeBlock(nn.Module):
    """transformers' Qwen3MoeSparseMoeBlock: a router `gate` [E, hidden] and one gated MLP per
    expert (checkpoint names mlp.gate.weight, mlp.experts.{e}.gate_proj/up_proj/down_proj)."""

    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.c = c
        self.gate = nn.Linear(c.hidden_size, c.num_experts, bias=False)
        self.experts = nn.ModuleList(_HfMlp(c, c.moe_intermediate_size)
                                     for _ in range(c.num_experts))

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, ids = route_tokens(self.gate(x), self.c.num_experts_per_tok,
                                    self.c.norm_topk_prob)
        weights = weights.to(x.dtype)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            token, slot = (ids == e).nonzero(as_tuple=True)
            if token.numel():
                out.index_add_(0, token, expert(x[token]) * weights[token, slot, None])
        return out.reshape(shape)


class _RmsNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)


class _HfLayer(nn.Module):
    def __init__(self, c: LlamaConfig, layer_idx: int = 0):
        super().__init__()
        self.self_attn = _HfAttention(c)
        self.mlp = _HfSparseMoeBlock(c) if c.is_sparse_layer(layer_idx) else _HfMlp(c)
        self.input_layernorm = _RmsNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = _RmsNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class _HfModel(nn.Module):
    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(_HfLayer(c, i) for i in range(c.num_hidden_layers))
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
# vLLM layout (replica), at any tensor-parallel degree
# ---------------------------------------------------------------------------------------------
#
# Written from vllm-project/vllm: vllm/model_executor/layers/linear.py (LinearBase,
# UnquantizedLinearMethod.create_weights, ColumnParallelLinear, MergedColumnParallelLinear,
# QKVParallelLinear, RowParallelLinear: their per-rank shapes, the `output_dim` / `input_dim`
# attributes of their parameters and the weight loaders that narrow a checkpoint tensor to this
# rank's slice); vllm/model_executor/parameter.py (ModelWeightParameter: input_dim=1,
# output_dim=0; BasevLLMParameter's tp_rank / tp_size); vllm/model_executor/utils.py
# (set_weight_attrs); vllm/model_executor/layers/vocab_parallel_embedding.py
# (VocabParallelEmbedding / ParallelLMHead: the vocabulary padded to a multiple of 64, split
# in equal blocks, org_vocab_size / num_embeddings_padded, the weight loader's row range, the
# masked lookup then all-reduce); vllm/model_executor/models/llama.py (LlamaAttention,
# LlamaMLP, packed_modules_mapping, LlamaModel.load_weights' stacked_params_mapping). The
# stand-in's parameters are plain torch Parameters with the attributes set_weight_attrs gives
# them (vLLM's own UnquantizedLinearMethod now makes ModelWeightParameters, which expose the
# same attributes as properties). Quantized/packed parameters are not modelled.

DEFAULT_VOCAB_PADDING_SIZE = 64


def divide(numerator: int, denominator: int) -> int:
    """vllm.distributed.utils.divide: exact division, else ValueError naming both."""
    if numerator % denominator != 0:
        raise ValueError(f"{numerator} is not divisible by {denominator}")
    return numerator // denominator


def set_weight_attrs(weight: torch.Tensor, weight_attrs: Optional[dict]) -> None:
    """vllm/model_executor/utils.py set_weight_attrs: each attribute set on the tensor; an
    attribute the tensor has already is an error (vLLM asserts)."""
    for key, value in (weight_attrs or {}).items():
        if hasattr(weight, key):
            raise AttributeError(f"overwriting existing tensor attribute: {key}")
        setattr(weight, key, value)


def default_weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
    """vLLM's default_weight_loader: same shape, copy (converting dtype and device)."""
    if param.shape != loaded_weight.shape:
        raise ValueError(f"attempted to load weight {tuple(loaded_weight.shape)} into parameter "
                         f"{tuple(param.shape)}")
    param.data.copy_(loaded_weight)


def _check_shape(layer: str, param_data: torch.Tensor, loaded: torch.Tensor) -> None:
    if param_data.shape != loaded.shape:
        raise ValueError(f"{layer}: loaded {tuple(loaded.shape)} into a parameter slice of "
                         f"{tuple(param_data.shape)}")


class UnquantizedLinearMethod:
    """Like vLLM's UnquantizedLinearMethod: create_weights makes the [sum(output partition
    sizes), input_size_per_partition] weight with input_dim=1, output_dim=0 and the layer's
    weight loader; on its CPU backend, process_weights_after_loading prepares the layout the
    GEMM uses (here a pre-transposed copy of the weight) and apply() computes with that
    prepared copy only."""

    def create_weights(self, layer: nn.Module, input_size_per_partition: int,
                       output_partition_sizes: List[int], input_size: int, output_size: int,
                       params_dtype: torch.dtype, **extra_weight_attrs) -> None:
        weight = nn.Parameter(torch.empty(sum(output_partition_sizes), input_size_per_partition,
                                          dtype=params_dtype), requires_grad=False)
        set_weight_attrs(weight, {"input_dim": 1, "output_dim": 0})
        layer.register_parameter("weight", weight)
        set_weight_attrs(weight, extra_weight_attrs)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        layer.packed_weight_t = layer.weight.detach().t().contiguous()

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return x @ layer.packed_weight_t


class LinearBase(nn.Module):
    """vLLM's LinearBase: input/output sizes, the layer's tp_rank and tp_size, a quant_method
    (prepared once at construction so an unloaded layer still computes)."""

    def __init__(self, input_size: int, output_size: int, tp_rank: int = 0, tp_size: int = 1):
        super().__init__()
        self.input_size, self.output_size = input_size, output_size
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.quant_method = UnquantizedLinearMethod()

    def _create_weights(self) -> None:
        self.quant_method.create_weights(self, self.input_size_per_partition,
                                         self.output_partition_sizes, self.input_size,
                                         self.output_size, torch.float32,
                                         weight_loader=self.weight_loader)
        self.quant_method.process_weights_after_loading(self)

    def forward(self, x):
        """This rank's output (row-parallel: its partial sum; the caller all-reduces)."""
        return self.quant_method.apply(self, x)

    def _load_split(self, param, loaded_weight, attribute: str) -> None:
        """The column- and row-parallel loaders: the checkpoint tensor narrowed on the
        dimension the parameter's `attribute` (output_dim / input_dim) names to this rank's
        block (unless the parameter has none, or is_sharded_weight), then copied."""
        dim = getattr(param, attribute, None)
        if dim is not None and not getattr(param, "is_sharded_weight", False):
            size = param.data.shape[dim]
            loaded_weight = loaded_weight.narrow(dim, self.tp_rank * size, size)
        _check_shape(type(self).__name__, param.data, loaded_weight)
        param.data.copy_(loaded_weight)


class ColumnParallelLinear(LinearBase):
    """The weight split along the output dimension: rank r holds rows
    [r * out / n, (r + 1) * out / n)."""

    def __init__(self, input_size: int, output_size: int, tp_rank: int = 0, tp_size: int = 1):
        super().__init__(input_size, output_size, tp_rank, tp_size)
        self.input_size_per_partition = input_size
        self.output_size_per_partition = divide(output_size, tp_size)
        self.output_partition_sizes = [self.output_size_per_partition]
        if hasattr(self, "output_sizes"):  # QKV or merged: each logical matrix split
            self.output_partition_sizes = [divide(s, tp_size) for s in self.output_sizes]
        self._create_weights()

    def weight_loader(self, param, loaded_weight):
        self._load_split(param, loaded_weight, "output_dim")

    def _load_fused(self, param, loaded_weight, shards) -> None:
        """A checkpoint tensor already fused on disk (Phi-3's qkv_proj / gate_up_proj): split
        into its logical matrices, (shard_id, offset, size) rows each, loaded one by one; a
        parameter without output_dim is copied whole."""
        output_dim = getattr(param, "output_dim", None)
        if output_dim is None:
            _check_shape(type(self).__name__, param.data, loaded_weight)
            param.data.copy_(loaded_weight)
            return
        for shard_id, offset, size in shards:
            self.weight_loader(param, loaded_weight.narrow(output_dim, offset, size), shard_id)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column projections fused along the output dimension (gate | up): rank r holds
    [gate_r; up_r], each logical matrix split on its own."""

    def __init__(self, input_size: int, output_sizes: List[int], tp_rank: int = 0,
                 tp_size: int = 1):
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(output_sizes), tp_rank, tp_size)

    def weight_loader(self, param, loaded_weight, loaded_shard_id=None):
        output_dim = getattr(param, "output_dim", None)
        if loaded_shard_id is None:  # fused on disk (Phi-3's gate_up_proj)
            self._load_fused(param, loaded_weight,
                             [(i, sum(self.output_sizes[:i]), size)
                              for i, size in enumerate(self.output_sizes)])
            return
        if not isinstance(loaded_shard_id, int) or not 0 <= loaded_shard_id < len(
                self.output_sizes):
            raise ValueError(f"MergedColumnParallelLinear: bad shard id {loaded_shard_id!r}")
        param_data = param.data
        if output_dim is not None:
            offset = sum(self.output_sizes[:loaded_shard_id]) // self.tp_size
            size = self.output_sizes[loaded_shard_id] // self.tp_size
            param_data = param_data.narrow(output_dim, offset, size)
            if not getattr(param, "is_sharded_weight", False):
                loaded_weight = loaded_weight.narrow(output_dim, self.tp_rank * size, size)
        _check_shape(type(self).__name__, param_data, loaded_weight)
        param_data.copy_(loaded_weight)


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q, k and v projections, split by heads: rank r holds [q_r; k_r; v_r] with
    num_heads = total_num_heads / n query heads and num_kv_heads KV heads (total / n, or one
    head replicated on num_kv_head_replicas = n / total ranks when n >= total)."""

    def __init__(self, hidden_size: int, head_size: int, total_num_heads: int,
                 total_num_kv_heads: int, tp_rank: int = 0, tp_size: int = 1):
        self.hidden_size, self.head_size, self.v_head_size = hidden_size, head_size, head_size
        self.total_num_heads, self.total_num_kv_heads = total_num_heads, total_num_kv_heads
        self.num_heads = divide(total_num_heads, tp_size)
        if tp_size >= total_num_kv_heads:
            self.num_kv_heads = 1
            self.num_kv_head_replicas = divide(tp_size, total_num_kv_heads)
        else:
            self.num_kv_heads = divide(total_num_kv_heads, tp_size)
            self.num_kv_head_replicas = 1
        self.output_sizes = [self.num_heads * head_size * tp_size,
                             self.num_kv_heads * head_size * tp_size,
                             self.num_kv_heads * self.v_head_size * tp_size]
        super().__init__(hidden_size, sum(self.output_sizes), tp_rank, tp_size)

    def weight_loader(self, param, loaded_weight, loaded_shard_id=None):
        output_dim = getattr(param, "output_dim", None)
        if loaded_shard_id is None:  # fused on disk (Phi-3's qkv_proj)
            q, kv = self.total_num_heads * self.head_size, self.total_num_kv_heads * self.head_size
            self._load_fused(param, loaded_weight, [("q", 0, q), ("k", q, kv), ("v", q + kv, kv)])
            return
        if loaded_shard_id not in ("q", "k", "v"):
            raise ValueError(f"QKVParallelLinear: shard id {loaded_shard_id!r} is not q, k or v")
        param_data = param.data
        if output_dim is not None:
            q, kv = self.num_heads * self.head_size, self.num_kv_heads * self.head_size
            offset, size = {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}[loaded_shard_id]
            param_data = param_data.narrow(output_dim, offset, size)
            shard_rank = (self.tp_rank if loaded_shard_id == "q"
                          else self.tp_rank // self.num_kv_head_replicas)
            if not getattr(param, "is_sharded_weight", False):
                loaded_weight = loaded_weight.narrow(output_dim, shard_rank * size, size)
        _check_shape(type(self).__name__, param_data, loaded_weight)
        param_data.copy_(loaded_weight)


class RowParallelLinear(LinearBase):
    """The weight split along the input dimension: rank r holds columns
    [r * in / n, (r + 1) * in / n) and computes a partial sum (all-reduced by the caller)."""

    def __init__(self, input_size: int, output_size: int, tp_rank: int = 0, tp_size: int = 1):
        super().__init__(input_size, output_size, tp_rank, tp_size)
        self.input_size_per_partition = divide(input_size, tp_size)
        self.output_size_per_partition = output_size
        self.output_partition_sizes = [output_size]
        self._create_weights()

    def weight_loader(self, param, loaded_weight):
        self._load_split(param, loaded_weight, "input_dim")


class ReplicatedLinear(LinearBase):
    """The whole weight on every rank (vLLM's ReplicatedLinear: a MoE router's `gate`); its
    loader copies the checkpoint tensor as it is."""

    def __init__(self, input_size: int, output_size: int, tp_rank: int = 0, tp_size: int = 1):
        super().__init__(input_size, output_size, tp_rank, tp_size)
        self.input_size_per_partition = input_size
        self.output_size_per_partition = output_size
        self.output_partition_sizes = [output_size]
        self._create_weights()

    def weight_loader(self, param, loaded_weight):
        _check_shape(type(self).__name__, param.data, loaded_weight)
        param.data.copy_(loaded_weight)


# ---- FusedMoE ---------------------------------------------------------------------------------
#
# Written from vllm-project/vllm: vllm/model_executor/layers/fused_moe/config.py
# (FusedMoEParallelConfig.make: the TP group flattened across data parallel ranks; with
# enable_expert_parallel every device an expert-parallel rank and no tensor parallelism inside
# the experts), fused_moe/layer.py (determine_expert_map, linear or round robin;
# FusedMoE.__init__: local_num_experts, intermediate_size_per_partition, the `_expert_map`
# buffer; weight_loader(param, loaded_weight, weight_name, shard_id, expert_id): the global
# expert id mapped to the local one (-1: not this rank's, skipped), SHARD_ID_TO_SHARDED_DIM,
# _load_w13 (gate into the first half of the expert's rows, up into the second, each narrowed
# to tp_rank's block) and _load_w2 (down narrowed on its input dimension);
# make_expert_params_mapping), fused_moe/unquantized_fused_moe_method.py (create_weights:
# w13_weight [local experts, 2 * intermediate per partition, hidden], w2_weight [local
# experts, hidden, intermediate per partition], each with the extra weight attributes: the
# layer's weight_loader) and vllm/model_executor/models/qwen3_moe.py (Qwen3MoeSparseMoeBlock:
# the router a ReplicatedLinear `gate`, FusedMoE `experts`, the all-reduce of the partial sums;
# Qwen3MoeModel.get_expert_mapping and load_weights: checkpoint experts.{e}.* through the
# expert mapping, skipped by the stacked (qkv / gate_up) mapping). Quantized experts, EPLB's
# redundant experts and the all-to-all kernels are not modelled; the forward pass is the
# unquantized method's arithmetic in plain torch.


@dataclass(frozen=True)
class FusedMoEParallelConfig:
    """vLLM's FusedMoEParallelConfig: the groups a FusedMoE layer splits its experts over."""
    tp_size: int
    tp_rank: int
    dp_size: int
    dp_rank: int
    ep_size: int
    ep_rank: int
    use_ep: bool

    @staticmethod
    def make(tp_size_: int, tp_rank_: int, dp_size_: int = 1, dp_rank_: int = 0,
             enable_expert_parallel: bool = False) -> "FusedMoEParallelConfig":
        """FusedMoEParallelConfig.make: the TP group flattened across DP (tp_size = dp * tp,
        tp_rank = dp_rank * tp + tp_rank); with expert parallelism those are the EP group and
        the experts are whole (tp_size 1)."""
        tp_size = dp_size_ * tp_size_
        tp_rank = dp_rank_ * tp_size_ + (0 if tp_size_ == 1 else tp_rank_)
        use_ep = dp_size_ * tp_size_ > 1 and enable_expert_parallel
        if not use_ep:
            return FusedMoEParallelConfig(tp_size, tp_rank, dp_size_, dp_rank_, 1, 0, False)
        return FusedMoEParallelConfig(1, 0, dp_size_, dp_rank_, tp_size, tp_rank, True)


def determine_expert_map(ep_size: int, ep_rank: int, global_num_experts: int,
                         expert_placement_strategy: str = "linear"):
    """vLLM's determine_expert_map: (local_num_experts, expert_map), the map [E] int32 of each
    global expert's local index on this rank, -1 elsewhere (None when ep_size is 1)."""
    if ep_size == 1:
        return global_num_experts, None
    base, remainder = divmod(global_num_experts, ep_size)
    local = base + 1 if ep_rank < remainder else base
    expert_map = torch.full((global_num_experts,), -1, dtype=torch.int32)
    if expert_placement_strategy == "linear":
        start = ep_rank * base + min(ep_rank, remainder)
        expert_map[start:start + local] = torch.arange(0, local, dtype=torch.int32)
    elif expert_placement_strategy == "round_robin":
        expert_map[torch.arange(ep_rank, global_num_experts, ep_size)] = \
            torch.arange(0, local, dtype=torch.int32)
    else:
        raise ValueError(f"Unsupported expert placement strategy {expert_placement_strategy!r}")
    return local, expert_map


class UnquantizedFusedMoEMethod:
    """vLLM's UnquantizedFusedMoEMethod: the expert weights and the fused-experts computation
    (here the same arithmetic in torch: each token's top-k experts, SiluAndMul on w13's halves,
    w2, weighted by the router)."""

    def create_weights(self, layer: nn.Module, num_experts: int, hidden_size: int,
                       intermediate_size_per_partition: int, params_dtype: torch.dtype,
                       **extra_weight_attrs) -> None:
        w13_weight = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size_per_partition,
                                              hidden_size, dtype=params_dtype),
                                  requires_grad=False)
        layer.register_parameter("w13_weight", w13_weight)
        set_weight_attrs(w13_weight, extra_weight_attrs)
        w2_weight = nn.Parameter(torch.empty(num_experts, hidden_size,
                                             intermediate_size_per_partition,
                                             dtype=params_dtype), requires_grad=False)
        layer.register_parameter("w2_weight", w2_weight)
        set_weight_attrs(w2_weight, extra_weight_attrs)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        pass

    def apply(self, layer: "FusedMoE", x: torch.Tensor, router_logits: torch.Tensor):
        """This rank's part of the experts' output [T, hidden]: its local experts (expert_map),
        its block of each expert's intermediate dimension; the caller all-reduces."""
        weights, ids = route_tokens(router_logits, layer.top_k, layer.renormalize)
        weights = weights.to(x.dtype)
        local = ids if layer._expert_map is None else layer._expert_map[ids].long()
        out = torch.zeros_like(x)
        half = layer.w13_weight.shape[1] // 2
        for e in range(layer.local_num_experts):
            token, slot = (local == e).nonzero(as_tuple=True)
            if not token.numel():
                continue
            gate_up = x[token] @ layer.w13_weight[e].t()
            act = F.silu(gate_up[:, :half]) * gate_up[:, half:]  # SiluAndMul
            out.index_add_(0, token, (act @ layer.w2_weight[e].t()) * weights[token, slot, None])
        return out


class FusedMoE(nn.Module):
    """vLLM's FusedMoE for one worker: its local experts' w13_weight (gate and up fused) and
    w2_weight (down), split by its FusedMoEParallelConfig (expert parallel: whole experts of
    this EP rank; otherwise every expert, each split on its intermediate dimension)."""

    SHARD_ID_TO_SHARDED_DIM = {"w1": 0, "w2": 1, "w3": 0}

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 renormalize: bool = True, tp_rank: int = 0, tp_size: int = 1,
                 dp_rank: int = 0, dp_size: int = 1, enable_expert_parallel: bool = False,
                 expert_placement_strategy: str = "linear", prefix: str = ""):
        super().__init__()
        self.moe_parallel_config = FusedMoEParallelConfig.make(
            tp_size, tp_rank, dp_size, dp_rank, enable_expert_parallel)
        self.global_num_experts = num_experts
        self.logical_num_experts = num_experts
        self.expert_mapping = None
        self.layer_name = prefix
        self.expert_placement_strategy = expert_placement_strategy
        if self.use_ep:
            self.local_num_experts, expert_map = determine_expert_map(
                self.ep_size, self.ep_rank, self.global_num_experts, expert_placement_strategy)
        else:
            self.local_num_experts, expert_map = self.global_num_experts, None
        self.register_buffer("_expert_map", expert_map)
        self.top_k = top_k
        self.hidden_size = hidden_size
        self.intermediate_size_per_partition = divide(intermediate_size, self.tp_size)
        self.renormalize = renormalize
        self.quant_method = UnquantizedFusedMoEMethod()
        self.quant_method.create_weights(
            self, num_experts=self.local_num_experts, hidden_size=hidden_size,
            intermediate_size_per_partition=self.intermediate_size_per_partition,
            params_dtype=torch.float32, weight_loader=self.weight_loader)

    tp_size = property(lambda self: self.moe_parallel_config.tp_size)
    tp_rank = property(lambda self: self.moe_parallel_config.tp_rank)
    dp_size = property(lambda self: self.moe_parallel_config.dp_size)
    dp_rank = property(lambda self: self.moe_parallel_config.dp_rank)
    ep_size = property(lambda self: self.moe_parallel_config.ep_size)
    ep_rank = property(lambda self: self.moe_parallel_config.ep_rank)
    use_ep = property(lambda self: self.moe_parallel_config.use_ep)

    def _map_global_expert_id_to_local_expert_id(self, expert_id: int) -> int:
        if self._expert_map is None:
            return expert_id
        return int(self._expert_map[expert_id].item())

    def _load_w13(self, expert_data, shard_dim: int, shard_id: str, loaded_weight,
                  tp_rank: int) -> None:
        shard_size = expert_data.shape[shard_dim] // 2
        loaded_weight = loaded_weight.narrow(shard_dim, shard_size * tp_rank, shard_size)
        if shard_id == "w1":  # gate_proj: the first logical weight of w13
            expert_data = expert_data.narrow(shard_dim, 0, shard_size)
        else:  # w3, up_proj: the second
            expert_data = expert_data.narrow(shard_dim, shard_size, shard_size)
        _check_shape(type(self).__name__, expert_data, loaded_weight)
        expert_data.copy_(loaded_weight)

    def _load_w2(self, expert_data, shard_dim: int, loaded_weight, tp_rank: int) -> None:
        shard_size = expert_data.shape[shard_dim]
        loaded_weight = loaded_weight.narrow(shard_dim, shard_size * tp_rank, shard_size)
        _check_shape(type(self).__name__, expert_data, loaded_weight)
        expert_data.copy_(loaded_weight)

    def weight_loader(self, param, loaded_weight, weight_name: str, shard_id: str,
                      expert_id: int, return_success: bool = False):
        expert_id = self._map_global_expert_id_to_local_expert_id(expert_id)
        if expert_id == -1:  # not local to this rank
            return False if return_success else None
        if shard_id not in ("w1", "w2", "w3"):
            raise ValueError(f"shard_id must be ['w1','w2','w3'] but got {shard_id}.")
        shard_dim = self.SHARD_ID_TO_SHARDED_DIM[shard_id]
        if getattr(param, "is_transposed", False):
            shard_dim = int(not shard_dim)
        full_load = len(loaded_weight.shape) == 3
        if full_load:
            shard_dim += 1
        expert_data = param.data if full_load else param.data[expert_id]
        if "weight" in weight_name:
            if shard_id == "w2":
                self._load_w2(expert_data, shard_dim, loaded_weight, self.tp_rank)
            else:
                self._load_w13(expert_data, shard_dim, shard_id, loaded_weight, self.tp_rank)
            return True if return_success else None
        return False if return_success else None

    @classmethod
    def make_expert_params_mapping(cls, ckpt_gate_proj_name: str, ckpt_down_proj_name: str,
                                   ckpt_up_proj_name: str, num_experts: int):
        """(param_name, weight_name, expert_id, shard_id) for every expert and projection
        (without redundant experts, physical ids are the logical ones)."""
        return [("experts.w13_" if weight_name in (ckpt_gate_proj_name, ckpt_up_proj_name)
                 else "experts.w2_", f"experts.{expert_id}.{weight_name}.", expert_id, shard_id)
                for expert_id in range(num_experts)
                for shard_id, weight_name in [("w1", ckpt_gate_proj_name),
                                              ("w2", ckpt_down_proj_name),
                                              ("w3", ckpt_up_proj_name)]]

    def forward(self, hidden_states, router_logits):
        return self.quant_method.apply(self, hidden_states, router_logits)


def pad_vocab_size(vocab_size: int, pad_to: int = DEFAULT_VOCAB_PADDING_SIZE) -> int:
    return ((vocab_size + pad_to - 1) // pad_to) * pad_to


class VocabParallelEmbedding(nn.Module):
    """The vocabulary padded to a multiple of 64 and split in equal blocks of
    num_embeddings_per_partition rows; rank r holds rows [org_vocab_start_index,
    org_vocab_end_index) of the checkpoint, zero rows for the padding. Its weight is created by
    UnquantizedLinearMethod (output_dim=0, input_dim=1), kept as `linear_method` (vLLM's
    name), so the post-load walk leaves it alone."""

    def __init__(self, num_embeddings: int, embedding_dim: int, tp_rank: int = 0,
                 tp_size: int = 1, padding_size: int = DEFAULT_VOCAB_PADDING_SIZE):
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.org_vocab_size = num_embeddings
        self.num_embeddings = num_embeddings
        # As vLLM, at every degree (TP 1 included): a vocabulary that is not a multiple of 64
        # has zero rows after it, which the logits cut off (vLLM's LogitsProcessor).
        self.num_embeddings_padded = pad_vocab_size(num_embeddings, padding_size)
        self.num_embeddings_per_partition = divide(self.num_embeddings_padded, tp_size)
        start = tp_rank * self.num_embeddings_per_partition
        self.org_vocab_start_index = min(start, num_embeddings)
        self.org_vocab_end_index = min(start + self.num_embeddings_per_partition, num_embeddings)
        self.embedding_dim = embedding_dim
        self.linear_method = UnquantizedLinearMethod()
        self.linear_method.create_weights(self, embedding_dim,
                                          [self.num_embeddings_per_partition], embedding_dim,
                                          self.num_embeddings_padded, torch.float32,
                                          weight_loader=self.weight_loader)

    def weight_loader(self, param, loaded_weight):
        output_dim = getattr(param, "output_dim", None)
        if output_dim is None:
            _check_shape(type(self).__name__, param.data, loaded_weight)
            param.data.copy_(loaded_weight)
            return
        if loaded_weight.shape[output_dim] != self.org_vocab_size:
            raise ValueError(f"{type(self).__name__}: loaded {tuple(loaded_weight.shape)}, "
                             f"expected {self.org_vocab_size} rows on dimension {output_dim}")
        start, size = self.org_vocab_start_index, \
            self.org_vocab_end_index - self.org_vocab_start_index
        loaded_weight = loaded_weight.narrow(output_dim, start, size)
        param.data[:size].copy_(loaded_weight)
        param.data[size:].fill_(0)

    def forward(self, ids):
        """This rank's part of the lookup (rows it does not hold are zero; the caller
        all-reduces)."""
        if self.tp_size == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.org_vocab_start_index) | (ids >= self.org_vocab_end_index)
        local = (ids - self.org_vocab_start_index).masked_fill(outside, 0)
        return F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0)


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection: this rank's vocabulary rows; the logits of every rank are
    gathered and cut to the vocabulary (vLLM's LogitsProcessor)."""


class _VllmAttention(nn.Module):
    def __init__(self, c: LlamaConfig, tp_rank: int, tp_size: int):
        super().__init__()
        self.c = c
        self.qkv_proj = QKVParallelLinear(c.hidden_size, c.head_dim, c.num_attention_heads,
                                          c.num_key_value_heads, tp_rank, tp_size)
        self.o_proj = RowParallelLinear(c.num_attention_heads * c.head_dim, c.hidden_size,
                                        tp_rank, tp_size)
        self.num_heads = self.qkv_proj.num_heads        # this rank's
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * c.head_dim
        self.kv_size = self.num_kv_heads * c.head_dim

    def forward(self, x, cos, sin, cache=None):
        b, t, _ = x.shape
        hd = self.c.head_dim
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(b, t, self.num_heads, hd).transpose(1, 2)
        k = k.reshape(b, t, self.num_kv_heads, hd).transpose(1, 2)
        v = v.reshape(b, t, self.num_kv_heads, hd).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:  # this layer's KV cache: {"k": [B, KV, S, D], "v": ...}
            if "k" in cache:
                k = torch.cat([cache["k"], k], dim=2)
                v = torch.cat([cache["v"], v], dim=2)
            cache["k"], cache["v"] = k, v
        groups = self.num_heads // self.num_kv_heads
        return self.o_proj(causal_attention(q, k, v, groups))


class _VllmMlp(nn.Module):
    def __init__(self, c: LlamaConfig, tp_rank: int, tp_size: int):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(c.hidden_size, [c.intermediate_size] * 2,
                                                       tp_rank, tp_size)
        self.down_proj = RowParallelLinear(c.intermediate_size, c.hidden_size, tp_rank, tp_size)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)  # SiluAndMul


class _VllmSparseMoeBlock(nn.Module):
    """vLLM's Qwen3MoeSparseMoeBlock: a replicated router `gate` and FusedMoE `experts`; this
    rank's partial sum (the layer all-reduces it, as the block does through
    maybe_all_reduce_tensor_model_parallel)."""

    def __init__(self, c: LlamaConfig, tp_rank: int, tp_size: int, moe: Dict[str, Any],
                 prefix: str):
        super().__init__()
        if tp_size > c.num_experts:
            raise ValueError(f"Tensor parallel size {tp_size} is greater than the number of "
                             f"experts {c.num_experts}.")
        self.experts = FusedMoE(c.num_experts, c.num_experts_per_tok, c.hidden_size,
                                c.moe_intermediate_size, renormalize=c.norm_topk_prob,
                                tp_rank=tp_rank, tp_size=tp_size, prefix=f"{prefix}.experts",
                                **moe)
        self.gate = ReplicatedLinear(c.hidden_size, c.num_experts, tp_rank, tp_size)

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        return self.experts(x, self.gate(x)).reshape(shape)


class _VllmRmsNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.variance_epsilon = eps

    def forward(self, x):
        return rms_norm(x, self.weight, self.variance_epsilon)


class _VllmLayer(nn.Module):
    def __init__(self, c: LlamaConfig, tp_rank: int, tp_size: int, layer_idx: int = 0,
                 moe: Optional[Dict[str, Any]] = None):
        super().__init__()
        self.self_attn = _VllmAttention(c, tp_rank, tp_size)
        if c.is_sparse_layer(layer_idx):
            self.mlp = _VllmSparseMoeBlock(c, tp_rank, tp_size, moe or {},
                                           f"model.layers.{layer_idx}.mlp")
        else:
            self.mlp = _VllmMlp(c, tp_rank, tp_size)
        self.input_layernorm = _VllmRmsNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = _VllmRmsNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, x, cos, sin, cache, all_reduce):
        x = x + all_reduce(self.self_attn(self.input_layernorm(x), cos, sin, cache))
        return x + all_reduce(self.mlp(self.post_attention_layernorm(x)))


class _VllmLlamaModel(nn.Module):
    # vLLM LlamaModel.load_weights: (param_name, shard_name, shard_id)
    stacked_params_mapping = [
        (".qkv_proj", ".q_proj", "q"),
        (".qkv_proj", ".k_proj", "k"),
        (".qkv_proj", ".v_proj", "v"),
        (".gate_up_proj", ".gate_proj", 0),
        (".gate_up_proj", ".up_proj", 1),
    ]

    def __init__(self, c: LlamaConfig, tp_rank: int, tp_size: int,
                 moe: Optional[Dict[str, Any]] = None):
        super().__init__()
        self.config = c
        self.embed_tokens = VocabParallelEmbedding(c.vocab_size, c.hidden_size, tp_rank, tp_size)
        self.layers = nn.ModuleList(_VllmLayer(c, tp_rank, tp_size, i, moe)
                                    for i in range(c.num_hidden_layers))
        self.norm = _VllmRmsNorm(c.hidden_size, c.rms_norm_eps)

    def get_expert_mapping(self) -> List[Tuple[str, str, int, str]]:
        """Qwen3MoeModel.get_expert_mapping: the checkpoint's experts.{e}.gate_proj / down_proj /
        up_proj to FusedMoE's w13_ / w2_ (empty without experts)."""
        if self.config.num_experts == 0:
            return []
        return FusedMoE.make_expert_params_mapping(
            ckpt_gate_proj_name="gate_proj", ckpt_down_proj_name="down_proj",
            ckpt_up_proj_name="up_proj", num_experts=self.config.num_experts)

    def load_weights(self, weights: Iterable[Tuple[str, torch.Tensor]]) -> Set[str]:
        params_dict = dict(self.named_parameters())
        loaded: Set[str] = set()
        expert_params_mapping = self.get_expert_mapping()
        for name, loaded_weight in weights:
            if "rotary_emb.inv_freq" in name or "rotary_emb.cos_cached" in name or \
                    "rotary_emb.sin_cached" in name:
                continue
            for param_name, weight_name, shard_id in self.stacked_params_mapping:
                if weight_name not in name:
                    continue
                # Qwen3MoeModel: experts.{e}.gate_proj is the expert mapping's, not gate_up's.
                if "mlp.experts" in name:
                    continue
                name = name.replace(weight_name, param_name)
                param = params_dict[name]
                param.weight_loader(param, loaded_weight, shard_id)
                break
            else:
                for param_name, weight_name, expert_id, shard_id in expert_params_mapping:
                    if weight_name not in name:
                        continue
                    name = name.replace(weight_name, param_name)
                    param = params_dict[name]
                    param.weight_loader(param, loaded_weight, name, shard_id=shard_id,
                                        expert_id=expert_id)
                    break
                else:
                    self._load_plain(params_dict, name, loaded_weight)
            loaded.add(name)
        return loaded

    @staticmethod
    def _load_plain(params_dict, name: str, loaded_weight) -> None:
        if name not in params_dict:
            raise KeyError(f"checkpoint tensor {name!r} matches no parameter of the model")
        param = params_dict[name]
        getattr(param, "weight_loader", default_weight_loader)(param, loaded_weight)


class VllmStyleLlamaForCausalLM(nn.Module):
    """An inference replica laid out like vLLM's LlamaForCausalLM (see the module docstring),
    as rank `tp_rank` of a tensor-parallel group of `tp_size` (each parameter this rank's
    shape, with vLLM's attributes; see the vLLM layout section). Parameters are created
    uninitialized: load_weights, then process_weights_after_loading
    (weightbus.vllm.process_weights_after_loading), before use. At tp_size 1, forward and
    generate run alone; at tp_size > 1 the ranks of a group compute together through
    tensor_parallel_forward."""

    # vLLM's models declare the fused modules and their checkpoint parts (SupportsLoRA /
    # SupportsQuant; the order is the loaders' shard order): weightbus.vllm derives the fused
    # placements from it.
    packed_modules_mapping = {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
    }

    def __init__(self, config: LlamaConfig, dtype: torch.dtype = torch.float32,
                 tp_rank: int = 0, tp_size: int = 1, enable_expert_parallel: bool = False,
                 dp_rank: int = 0, dp_size: int = 1, expert_placement_strategy: str = "linear"):
        """MoE layers (config.num_experts > 0) split their experts as vLLM's ParallelConfig
        says: enable_expert_parallel (whole experts dealt over the dp_size * tp_size devices by
        expert_placement_strategy, "linear" or "round_robin"), else every expert split on its
        intermediate dimension over them. dp_rank / dp_size are this replica's data-parallel
        coordinates (they matter only to the experts)."""
        super().__init__()
        if not 0 <= tp_rank < tp_size:
            raise ValueError(f"tp_rank {tp_rank} is outside [0, {tp_size})")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} is outside [0, {dp_size})")
        self.config = config
        self.tp_rank, self.tp_size = tp_rank, tp_size
        moe = {"dp_rank": dp_rank, "dp_size": dp_size,
               "enable_expert_parallel": enable_expert_parallel,
               "expert_placement_strategy": expert_placement_strategy}
        self.model = _VllmLlamaModel(config, tp_rank, tp_size, moe)
        if config.tie_word_embeddings:
            self.lm_head = self.model.embed_tokens  # vLLM: lm_head.tie_weights(embed_tokens)
        else:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp_rank,
                                          tp_size)
        self.to(dtype)
        self.dtype = dtype
        self.tp_group: Optional["ThreadTpGroup"] = None  # set by tensor_parallel_forward

    def load_weights(self, weights: Iterable[Tuple[str, torch.Tensor]]) -> Set[str]:
        """vLLM's LlamaForCausalLM.load_weights (AutoWeightsLoader): `model.*` names go to
        LlamaModel.load_weights, `lm_head.*` is skipped when tied. Each parameter's weight
        loader narrows the checkpoint tensor to this rank's slice. Returns the parameter names
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

    def get_expert_mapping(self) -> List[Tuple[str, str, int, str]]:
        """Qwen3MoeForCausalLM.get_expert_mapping (vLLM's MixtureOfExperts models)."""
        return self.model.get_expert_mapping()

    def _all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.tp_size == 1 else self._group().all_reduce(self.tp_rank, x)

    def _group(self) -> "ThreadTpGroup":
        if self.tp_group is None:
            raise RuntimeError(f"rank {self.tp_rank} of a TP group of {self.tp_size} computes "
                               f"with its group: use tensor_parallel_forward")
        return self.tp_group

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, start_pos: int = 0,
                kv_cache: Optional[List[dict]] = None) -> torch.Tensor:
        """input_ids [B, T] at positions start_pos..start_pos+T-1 -> logits [B, T, vocab].
        kv_cache (one dict per layer, from a previous call) holds the keys and values of
        positions 0..start_pos-1 (this rank's KV heads) and is extended in place. At
        tp_size > 1, every rank of the group calls it at once (tensor_parallel_forward)."""
        x = self._all_reduce(self.model.embed_tokens(input_ids))
        positions = torch.arange(start_pos, start_pos + input_ids.shape[1])
        cos, sin = rope_cos_sin(self.config, positions, x.dtype)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, None if kv_cache is None else kv_cache[i], self._all_reduce)
        logits = self.model.norm(x) @ self.lm_head.weight.t()
        if self.tp_size > 1:
            logits = self._group().all_gather(self.tp_rank, logits)
        return logits[..., :self.config.vocab_size]

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
        gate_up_proj: what load_weights was given (tp_size 1 only: ValueError otherwise)."""
        if self.tp_size != 1:
            raise ValueError(f"hf_state_dict of rank {self.tp_rank} of {self.tp_size}: the "
                             f"parameters are this rank's slices, not the checkpoint")
        c = self.config
        out = {"model.embed_tokens.weight":
               self.model.embed_tokens.weight.detach()[:c.vocab_size]}
        q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        for i, layer in enumerate(self.model.layers):
            p = f"model.layers.{i}."
            qkv = layer.self_attn.qkv_proj.weight.detach()
            out[p + "self_attn.q_proj.weight"] = qkv[:q]
            out[p + "self_attn.k_proj.weight"] = qkv[q:q + kv]
            out[p + "self_attn.v_proj.weight"] = qkv[q + kv:]
            out[p + "self_attn.o_proj.weight"] = layer.self_attn.o_proj.weight.detach()
            if isinstance(layer.mlp, _VllmSparseMoeBlock):
                experts = layer.mlp.experts
                if experts.use_ep:
                    raise ValueError("hf_state_dict of an expert-parallel replica: its experts "
                                     "are this rank's, not the checkpoint's")
                out[p + "mlp.gate.weight"] = layer.mlp.gate.weight.detach()
                inter = c.moe_intermediate_size
                for e in range(c.num_experts):
                    w13, w2 = experts.w13_weight.detach()[e], experts.w2_weight.detach()[e]
                    out[p + f"mlp.experts.{e}.gate_proj.weight"] = w13[:inter]
                    out[p + f"mlp.experts.{e}.up_proj.weight"] = w13[inter:]
                    out[p + f"mlp.experts.{e}.down_proj.weight"] = w2
            else:
                gate_up = layer.mlp.gate_up_proj.weight.detach()
                out[p + "mlp.gate_proj.weight"] = gate_up[:c.intermediate_size]
                out[p + "mlp.up_proj.weight"] = gate_up[c.intermediate_size:]
                out[p + "mlp.down_proj.weight"] = layer.mlp.down_proj.weight.detach()
            out[p + "input_layernorm.weight"] = layer.input_layernorm.weight.detach()
            out[p + "post_attention_layernorm.weight"] = \
                layer.post_attention_layernorm.weight.detach()
        out["model.norm.weight"] = self.model.norm.weight.detach()
        if not c.tie_word_embeddings:
            out["lm_head.weight"] = self.lm_head.weight.detach()[:c.vocab_size]
        return out


# ---------------------------------------------------------------------------------------------
# A tensor-parallel group of replicas in one process
# ---------------------------------------------------------------------------------------------

class ThreadTpGroup:
    """The tensor-parallel communicator of a TP group whose ranks run as threads of one
    process (what vLLM's GroupCoordinator gives its layers: all_reduce after row-parallel
    layers and the embedding, all_gather of the logits). The sum is taken in rank order, so
    every rank gets the same tensor. Every rank must make the same calls in the same order; a
    rank that fails breaks the barrier, and the others raise threading.BrokenBarrierError."""

    def __init__(self, size: int, timeout: float = 60.0):
        self.size = size
        self._slots: List[Optional[torch.Tensor]] = [None] * size
        self._barrier = threading.Barrier(size, timeout=timeout)

    def _exchange(self, rank: int, tensor: torch.Tensor) -> List[torch.Tensor]:
        self._slots[rank] = tensor
        self._barrier.wait()
        gathered = list(self._slots)
        self._barrier.wait()  # every rank has read before the next exchange writes
        return gathered

    def all_reduce(self, rank: int, tensor: torch.Tensor) -> torch.Tensor:
        parts = self._exchange(rank, tensor)
        out = parts[0].clone()
        for part in parts[1:]:
            out += part
        return out

    def all_gather(self, rank: int, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return torch.cat(self._exchange(rank, tensor), dim=dim)

    def abort(self) -> None:
        self._barrier.abort()


def tensor_parallel_forward(replicas: List["VllmStyleLlamaForCausalLM"],
                            input_ids: torch.Tensor) -> torch.Tensor:
    """One forward pass of a TP group: replicas[r] (rank r of len(replicas), each holding only
    its slices) runs in thread r, the ranks exchanging partial sums and logits through a
    ThreadTpGroup as vLLM's layers do through NCCL. Returns the logits [B, T, vocab] (rank 0's;
    every rank's are the same). Raises the first rank's exception."""
    size = len(replicas)
    for r, replica in enumerate(replicas):
        if (replica.tp_rank, replica.tp_size) != (r, size):
            raise ValueError(f"replicas[{r}] is rank {replica.tp_rank} of {replica.tp_size}, "
                             f"not rank {r} of {size}")
    if size == 1:
        return replicas[0](input_ids)
    group = ThreadTpGroup(size)
    results: List[Any] = [None] * size
    errors: List[Optional[BaseException]] = [None] * size

    def run(r: int) -> None:
        replicas[r].tp_group = group
        try:
            results[r] = replicas[r](input_ids)
        except BaseException as e:  # re-raised below
            errors[r] = e
            group.abort()
        finally:
            replicas[r].tp_group = None

    threads = [threading.Thread(target=run, args=(r,), name=f"tp-rank-{r}") for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    first = next((e for e in errors if e is not None and
                  not isinstance(e, threading.BrokenBarrierError)), None)
    first = first or next((e for e in errors if e is not None), None)
    if first is not None:
        raise first
    return results[0]
