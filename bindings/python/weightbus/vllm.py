# SPDX-License-Identifier: Apache-2.0
"""vLLM integration: replicas that pull versions from a weightbus channel.

Two adapters, for the two ways vLLM lets weights be updated from outside:

1. WeightbusWorkerExtension, for the `worker_extension_cls` hook (vLLM >= 0.8.0, V0 and V1
   engines). vLLM mixes the class into every worker; the trainer-side driver calls its methods
   on all workers through `collective_rpc`:

       llm = LLM(model=..., worker_extension_cls="weightbus.vllm.WeightbusWorkerExtension")
       llm.collective_rpc("weightbus_init", args=("disk:///mnt/shared/policy",))
       ...                                     # between rollouts:
       versions = llm.collective_rpc("weightbus_update")   # one applied version per worker

   weightbus_update receives a version (zero-copy CPU tensors), hands it to the model's
   `load_weights(weights=[(name, tensor), ...])` (which fuses q/k/v and gate/up) inside
   vLLM's layerwise reload where vLLM has it (else followed by the post-load processing,
   vllm.model_executor.model_loader.utils.process_weights_after_loading), resets the
   worker's LoRA state and returns the version now applied. It relies on the worker
   attributes `model_runner.model`, `model_config` and `device`, as vLLM's own RLHF example
   (examples/offline_inference/rlhf_utils.py) does. weightbus_init(..., prefetch=True)
   receives the next version in the background so that the update only applies it.

   Tensor parallelism (both adapters): a worker whose model is at tp_size > 1 subscribes with
   placements derived from its parameters' own metadata (tensor_parallel_layout: vLLM's
   output_dim / input_dim attributes, its layer classes' head counts and output_sizes, the
   model's packed_modules_mapping; no per-model table), so it receives only its slices (fused
   qkv_proj and gate_up_proj assembled by the library) and copies them into its parameters
   (load_resharded). The workers of one replica must apply the same version: pass the version
   the driver picked to every worker (weightbus_update(version=v), update_weights({"version":
   v})).

2. WeightbusWeightTransferEngine, vLLM's native weight-transfer engine
   (vllm/distributed/weight_transfer/base.py: WeightTransferEngine, with the constructor
   (config, vllm_config, device, model) and the start_weight_update / update_weights /
   finish_weight_update session that vLLM's GPU worker drives). Register it in every vLLM
   process, select it, and run rounds with sync_weights (which labels vLLM's weight version):

       # `pip install .` does this in every vLLM process (the vllm.general_plugins entry
       # point weightbus.vllm:register_plugin); without the installed package, call it (or
       # WeightTransferEngineFactory.register_engine("weightbus", "weightbus.vllm",
       # "WeightbusWeightTransferEngine")) in each process yourself.
       weightbus.vllm.register_plugin()
       llm = LLM(model=..., weight_transfer_config=WeightTransferConfig(backend="weightbus"))
       llm.init_weight_transfer_engine({"init_info": {"uri": "disk:///mnt/shared/policy",
                                                      "prefetch": True}})
       version = weightbus.vllm.sync_weights(llm)      # between rollouts: the newest version

   Some vLLM releases type WeightTransferConfig.backend as a Literal of the built-in names;
   those need the name admitted there too.

vLLM is not a dependency: both adapters are tested against
weightbus.testing.llama.VllmStyleLlamaForCausalLM, whose load_weights does what vLLM's Llama
does, inside the stand-ins of weightbus.testing.worker (vLLM's worker, its engine base class,
factory and GPU-worker lifecycle, written from vLLM's source; bindings/python/tests/test_vllm.py).
"""
import atexit
import contextlib
import logging
import threading
import time
import weakref
from dataclasses import dataclass, field, replace
from typing import Any, Callable, ClassVar, Dict, List, Optional, Tuple, Union

from . import _api
from .errors import CancelledError, FailedPreconditionError, InvalidArgumentError

_log = logging.getLogger(__name__)

# The checkpoint names of the output projection and of the input embedding it may be tied to.
LM_HEAD = "lm_head.weight"
EMBED_TOKENS = "model.embed_tokens.weight"


def process_weights_after_loading(model, model_config=None, device=None) -> None:
    """The post-load step of vLLM's model loader: vLLM's own function when vLLM is installed,
    otherwise the same walk (every module whose quant_method has process_weights_after_loading
    gets it called)."""
    try:
        from vllm.model_executor.model_loader.utils import \
            process_weights_after_loading as vllm_process
    except ImportError:
        vllm_process = None
    if vllm_process is not None and model_config is not None and device is not None:
        vllm_process(model, model_config, device)
        return
    for _, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if method is not None and hasattr(method, "process_weights_after_loading"):
            method.process_weights_after_loading(module)


# The default timeout of an update ("auto"): it bounds both the wait for a version and its
# receive, so a fixed 60 s cannot fit every model (140 GB at 2 GB/s takes 70 s). "auto" is
# AUTO_TIMEOUT_BASE_S plus the model's parameter and buffer bytes at AUTO_TIMEOUT_MIN_RATE (a
# slow shared filesystem): 62 s for 1 GB, 340 s for 140 GB. The trade-off: a replica whose
# channel has no new version waits that long before TimeoutError. Pass seconds to choose, or
# None to wait without a bound.
AUTO_TIMEOUT = "auto"
AUTO_TIMEOUT_BASE_S = 60.0
AUTO_TIMEOUT_MIN_RATE = 0.5e9  # bytes per second


def model_bytes(model) -> int:
    """Bytes of `model`'s parameters and buffers (0 for None or a model without them)."""
    total = 0
    for attr in ("parameters", "buffers"):
        tensors = getattr(model, attr, None)
        if tensors is None:
            continue
        for t in tensors():
            total += t.numel() * t.element_size()
    return total


def resolve_timeout(timeout: Union[None, float, str], model) -> Optional[float]:
    """`timeout` in seconds: AUTO_TIMEOUT ("auto") scaled to `model` as described above, a
    number as given (ValueError when negative), None (no bound) as None."""
    if timeout == AUTO_TIMEOUT:
        return AUTO_TIMEOUT_BASE_S + model_bytes(model) / AUTO_TIMEOUT_MIN_RATE
    if isinstance(timeout, str):
        raise ValueError(f"timeout must be seconds, None or {AUTO_TIMEOUT!r}, not {timeout!r}")
    if timeout is not None and timeout < 0:
        raise ValueError(f"timeout must not be negative, got {timeout}")
    return timeout


def ties_word_embeddings(model, model_config=None) -> bool:
    """Whether `model` ties lm_head.weight to model.embed_tokens.weight: its config (vLLM's
    models keep the Hugging Face config as `model.config`), else vLLM's ModelConfig
    (`hf_text_config` / `hf_config`) says tie_word_embeddings, or the two modules share one
    weight tensor (vLLM's lm_head.tie_weights(embed_tokens))."""
    configs = (getattr(model, "config", None), getattr(model_config, "hf_text_config", None),
               getattr(model_config, "hf_config", None))
    for config in configs:
        tie = getattr(config, "tie_word_embeddings", None)
        if tie is not None:
            return bool(tie)
    head = getattr(getattr(model, "lm_head", None), "weight", None)
    embed = getattr(getattr(getattr(model, "model", None), "embed_tokens", None), "weight", None)
    return head is not None and head is embed


def check_tied_embeddings(update, uri: Optional[str] = None) -> None:
    """For a replica that ties lm_head.weight to model.embed_tokens.weight (so its
    load_weights skips lm_head.weight, as vLLM's do): raises InvalidArgumentError, naming both
    tensors, when the received `update` (a weightbus.Update) has an lm_head.weight the model
    would silently ignore: one without model.embed_tokens.weight, or one whose dtype, shape or
    bytes differ from it. The embedding alone, or an identical copy (bit for bit), is
    accepted. Call it before anything is loaded: when it raises, the model is untouched.
    Messages start with `uri` (the channel) when given."""
    if LM_HEAD not in update:
        return
    where = f"{uri}: " if uri else ""
    tie = ("this replica ties lm_head.weight to model.embed_tokens.weight "
           "(tie_word_embeddings) and would ignore lm_head.weight, computing with the embedding")
    if EMBED_TOKENS not in update:
        raise InvalidArgumentError(
            f'{where}version {update.version} has "{LM_HEAD}" but no "{EMBED_TOKENS}": '
            f"{tie}; publish the embedding (alone, or with an identical lm_head.weight)")
    head, embed = update[LM_HEAD], update[EMBED_TOKENS]
    sides = [(update.dtypes[LM_HEAD], list(head.shape)),
             (update.dtypes[EMBED_TOKENS], list(embed.shape))]
    if sides[0] != sides[1]:
        raise InvalidArgumentError(
            f'{where}version {update.version}: "{LM_HEAD}" is {sides[0][0]} {sides[0][1]} but '
            f'"{EMBED_TOKENS}" is {sides[1][0]} {sides[1][1]}: {tie}; publish identical '
            f"tensors or the embedding alone")
    count = head.numel()
    if count == 0:
        return
    import torch
    head_flat, embed_flat = head.reshape(-1), embed.reshape(-1)
    # Bit for bit (NaN == NaN, -0.0 != 0.0): each element as its bytes.
    differ = (head_flat.view(torch.uint8).reshape(count, -1) !=
              embed_flat.view(torch.uint8).reshape(count, -1)).any(dim=1)
    if bool(differ.any()):
        flat = int(differ.nonzero()[0])
        index, rest = [], flat
        for size in reversed(head.shape):
            rest, i = divmod(rest, size)
            index.insert(0, i)
        raise InvalidArgumentError(
            f'{where}version {update.version}: "{LM_HEAD}" differs from "{EMBED_TOKENS}" '
            f"(first at element {index}: {head_flat[flat].item()!r} vs "
            f"{embed_flat[flat].item()!r}): {tie}; publish identical tensors or the embedding "
            f"alone")


def _synchronize(device) -> None:
    if device is not None and getattr(device, "type", None) == "cuda":
        import torch
        torch.cuda.synchronize(device)


def _device_context(device):
    """`with torch.device(device)`, as vLLM's worker wraps layerwise reload (tensors a reload
    materializes land on the model's device); nothing on a torch without device contexts
    (before 2.0) or without a device."""
    if device is None or not hasattr(type(device), "__enter__"):
        return contextlib.nullcontext()
    return device


# ---------------------------------------------------------------------------------------------
# Tensor parallelism: each worker's placements from the model's own parameter metadata
# ---------------------------------------------------------------------------------------------
#
# A vLLM worker at tensor-parallel degree n > 1 holds one slice of most parameters; which slice
# is what the layer's weight loader narrows a checkpoint tensor to
# (vllm/model_executor/layers/linear.py, vocab_parallel_embedding.py). tensor_parallel_layout
# reads the same metadata those loaders read and turns each parameter into a
# weightbus.Placement, so the worker receives only its slices (docs/RESHARDING.md):
#
#   layer (class or a subclass)   parameter metadata          placement
#   QKVParallelLinear             output_dim (0)              qkv(total_num_heads,
#                                                             total_num_kv_heads, head_size)
#   MergedColumnParallelLinear    output_dim                  merged(fused, parts), on output_dim
#   ColumnParallelLinear          output_dim                  shard(output_dim)
#   RowParallelLinear             input_dim                   shard(input_dim)
#   VocabParallelEmbedding,       output_dim, unpadded        shard(output_dim)
#     ParallelLMHead              vocabulary
#   ReplicatedLinear, a layer with tp_size 1 (disable_tp), a parameter without the attribute
#   its layer's loader reads (a RowParallelLinear bias has output_dim only; norms have none;
#   but a QKV or merged layer's parameter without output_dim is InvalidArgumentError):
#                                                             replicate
#
# The fused names (qkv_proj <- q_proj, k_proj, v_proj; gate_up_proj <- gate_proj, up_proj) come
# from the model's packed_modules_mapping (vLLM's models declare it; the loaders' shard order),
# else from a stacked_params_mapping attribute. The worker's rank and degree are its layers'
# tp_rank / tp_size (LinearBase, VocabParallelEmbedding), which vLLM sets from the TP group.
#   FusedMoE w13_weight, w2_weight  the model's expert       experts_from_each(E, "experts.w13_",
#                                  mapping; the layer's     ["experts.{e}.gate_proj.",
#                                  ep_size/ep_rank,         "experts.{e}.up_proj."], strategy)
#                                  tp_size/tp_rank,         .in_groups((ep_size, ep_rank),
#                                  expert placement         (tp_size, tp_rank), 0); w2 the same
#                                  strategy                 with down_proj on dimension 1
#
# The FusedMoE sources come from the model's expert mapping (get_expert_mapping(), vLLM's
# MixtureOfExperts models, else the layer's expert_mapping): (param_name, weight_name,
# expert_id, shard_id) entries, read backwards (the checkpoint name is the parameter's with
# param_name replaced by weight_name), w1 and w3 fused in that order (FusedMoE._load_w13), each
# split on SHARD_ID_TO_SHARDED_DIM (w1/w3: 0, w2: 1) inside the experts.
# Refused (UnimplementedError naming the parameter): packed (quantized) fused parameters, a
# value head larger than the key head, padded vocabularies, quantized or transposed experts
# and their scales, EPLB's redundant experts, an expert mapping whose names do not follow the
# expert number. A parameter with output_dim/input_dim on a layer of another class is
# InvalidArgumentError: which dimension its loader splits cannot be told from the attribute.

_LAYER_KINDS = ("QKVParallelLinear", "MergedColumnParallelLinear", "ColumnParallelLinear",
                "RowParallelLinear", "VocabParallelEmbedding", "ReplicatedLinear", "FusedMoE")


def _layer_kind(module) -> Optional[str]:
    """The vLLM layer class `module` is (or derives from), by name, so that vLLM's classes and
    weightbus.testing's stand-ins are recognized alike; None for any other module."""
    names = {cls.__name__ for cls in type(module).__mro__}
    return next((kind for kind in _LAYER_KINDS if kind in names), None)


@dataclass(frozen=True)
class TensorParallelLayout:
    """What one TP worker subscribes with: its rank and degree, a Placement per parameter name
    and the destinations (every parameter, fused ones included, in the model's order).
    subscriber_options() gives them as weightbus.Subscriber keyword arguments, with
    skip_absent: a parameter none of whose checkpoint tensors a version has is left as it is, as
    vLLM's load_weights leaves a parameter the weights it is given do not name (a trainer that
    publishes only what it trains; load_resharded says which were left)."""
    tp_rank: int
    tp_size: int
    placements: Dict[str, "_api.Placement"]
    tensors: Tuple[str, ...]

    def subscriber_options(self) -> Dict[str, Any]:
        return {"placements": dict(self.placements), "tp_rank": self.tp_rank,
                "tp_size": self.tp_size, "tensors": list(self.tensors), "skip_absent": True}


def _packed_parts(model, fused: str) -> Optional[List[str]]:
    mapping = getattr(model, "packed_modules_mapping", None)
    if mapping and fused in mapping:
        return list(mapping[fused])
    for module in model.modules():
        stacked = getattr(module, "stacked_params_mapping", None)
        if stacked:
            parts = [(shard_id, part.strip(".")) for param, part, shard_id in stacked
                     if param.strip(".") == fused]
            if parts:
                order = {"q": 0, "k": 1, "v": 2}
                return [p for _, p in sorted(parts, key=lambda x: order.get(x[0], x[0]))]
    return None


def _expert_mapping(model, module) -> Optional[List[Tuple[str, str, int, str]]]:
    """The (param_name, weight_name, expert_id, shard_id) entries vLLM's load_weights maps
    checkpoint experts with: the layer's own expert_mapping (FusedMoE(expert_mapping=...)),
    else the model's get_expert_mapping() (vLLM's MixtureOfExperts models), else that of a
    submodule that has one (the inner model)."""
    mapping = getattr(module, "expert_mapping", None)
    if mapping:
        return list(mapping)
    for candidate in [model] + [m for _, m in model.named_modules()]:
        get = getattr(candidate, "get_expert_mapping", None)
        if callable(get):
            mapping = get()
            if mapping:
                return list(mapping)
    return None


def _fused_moe_placement(model, name: str, module, param, layer: str):
    """The Placement of a FusedMoE parameter (w13_weight or w2_weight) of parameter `name`."""
    from .errors import UnimplementedError
    pname = name.rsplit(".", 1)[-1]
    method = type(getattr(module, "quant_method", None)).__name__
    if pname not in ("w13_weight", "w2_weight") or method != "UnquantizedFusedMoEMethod":
        raise UnimplementedError(
            f"{layer}: only the unquantized experts' w13_weight and w2_weight are derived "
            f"(quant method {method}); quantized experts and their scales are not placements yet")
    if getattr(param, "is_transposed", False):
        raise UnimplementedError(f"{layer}: transposed experts (is_transposed) are not derived")
    experts = int(getattr(module, "global_num_experts"))
    logical = int(getattr(module, "logical_num_experts", experts))
    if experts != logical:
        raise UnimplementedError(
            f"{layer}: {experts - logical} redundant experts (EPLB: {experts} physical for "
            f"{logical} logical) are not derived")
    mapping = _expert_mapping(model, module)
    if mapping is None:
        raise InvalidArgumentError(
            f"{layer}: the model declares no expert mapping (get_expert_mapping(), or the "
            f"layer's expert_mapping), so the checkpoint tensors of its experts are unknown")
    # The entries whose param_name ends this parameter's name: name.replace(weight_name,
    # param_name) in vLLM's load_weights gives `name`.
    by_shard: Dict[str, Dict[int, str]] = {}
    param_names = set()
    for param_name, weight_name, expert_id, shard_id in mapping:
        at = name.rfind(param_name)
        if at < 0 or "." in name[at + len(param_name):]:
            continue
        param_names.add(param_name)
        by_shard.setdefault(shard_id, {})[int(expert_id)] = weight_name
    wanted = ["w1", "w3"] if pname == "w13_weight" else ["w2"]
    if len(param_names) != 1 or sorted(by_shard) != sorted(wanted):
        raise InvalidArgumentError(
            f"{layer}: the model's expert mapping gives it shards {sorted(by_shard)} under "
            f"{sorted(param_names)}; FusedMoE's {pname} takes {wanted} under one name")
    parts = []
    for shard_id in wanted:
        names = by_shard[shard_id]
        if sorted(names) != list(range(experts)):
            raise InvalidArgumentError(
                f"{layer}: the expert mapping's {shard_id} covers experts {sorted(names)[:8]}..."
                f" ({len(names)}), not 0..{experts - 1}")
        template = names[0].replace(".0.", ".{e}.", 1)
        wrong = [e for e, n in names.items() if template.replace("{e}", str(e)) != n]
        if "{e}" not in template or wrong:
            raise UnimplementedError(
                f"{layer}: the checkpoint names of its experts ({names[0]!r}, ...) do not follow "
                f"the expert number as \"{{e}}\" in one place")
        parts.append(template)
    order = getattr(module, "expert_placement_strategy", "linear") or "linear"
    ep = (module.ep_size, module.ep_rank) if getattr(module, "use_ep", False) else (1, 0)
    dim = FUSED_MOE_SHARDED_DIM[wanted[0]]
    return _api.Placement.experts_from_each(experts, param_names.pop(), parts, order).in_groups(
        ep, (module.tp_size, module.tp_rank), dim)


# vLLM's FusedMoE.weight_loader SHARD_ID_TO_SHARDED_DIM: the dimension of one expert's
# checkpoint tensor that tensor parallelism inside the experts splits.
FUSED_MOE_SHARDED_DIM = {"w1": 0, "w2": 1, "w3": 0}


def _parameter_placement(model, name: str, module, param, kind: Optional[str]):
    """The Placement of parameter `name` (of `module`, a layer of `kind`): see the table."""
    from .errors import UnimplementedError
    output_dim = getattr(param, "output_dim", None)
    input_dim = getattr(param, "input_dim", None)
    layer = f'parameter "{name}" ({type(module).__name__})'
    if kind is None:
        if output_dim is not None or input_dim is not None:
            raise InvalidArgumentError(
                f"{layer} has output_dim={output_dim} input_dim={input_dim} but its layer is "
                f"none of vLLM's parallel layers ({', '.join(_LAYER_KINDS)}): which dimension "
                f"its weight loader splits cannot be told")
        return _api.Placement.replicate()
    if kind == "FusedMoE":  # its own groups (FusedMoEParallelConfig), not the TP group's
        return _fused_moe_placement(model, name, module, param, layer)
    if kind == "ReplicatedLinear" or getattr(module, "tp_size", 1) == 1:
        return _api.Placement.replicate()
    if kind == "RowParallelLinear":
        return _api.Placement.replicate() if input_dim is None else \
            _api.Placement.shard(input_dim)
    if output_dim is None:
        if kind in ("QKVParallelLinear", "MergedColumnParallelLinear"):
            # Its loader copies each checkpoint part whole into the whole parameter (vLLM warns
            # "assume the weight is the same for all partitions"): no layout of a weight, and a
            # fused name no checkpoint has, which skip_absent would leave stale.
            raise InvalidArgumentError(
                f"{layer} has no output_dim, which its layer's weight loader needs to split and "
                f"fuse its parts; its placement cannot be derived")
        return _api.Placement.replicate()
    packed = getattr(param, "packed_dim", None) is not None and \
        getattr(param, "packed_dim") == output_dim
    if kind == "ColumnParallelLinear":
        return _api.Placement.shard(output_dim)
    if kind == "VocabParallelEmbedding":
        padded = getattr(module, "num_embeddings_padded", None)
        vocab = getattr(module, "org_vocab_size", None)
        if padded != vocab or getattr(module, "num_embeddings", vocab) != vocab:
            raise UnimplementedError(
                f"{layer}: the vocabulary of {vocab} is padded to {padded} rows (a multiple of "
                f"64 x tp_size {module.tp_size}; added LoRA vocabulary included); padded "
                f"vocabularies are not a placement yet")
        return _api.Placement.shard(output_dim)
    fused = name.split(".")[-2] if "." in name else name
    parts = _packed_parts(model, fused)
    if parts is None:
        raise InvalidArgumentError(
            f"{layer}: the model declares no parts for the fused module {fused!r} "
            f"(packed_modules_mapping or stacked_params_mapping)")
    if packed:
        raise UnimplementedError(f"{layer}: packed parameters (packed_dim == output_dim, "
                                 f"packed_factor {getattr(param, 'packed_factor', None)}) of a "
                                 f"fused layer are not derived yet")
    if kind == "QKVParallelLinear":
        if output_dim != 0 or len(parts) != 3:
            raise UnimplementedError(f"{layer}: qkv on output_dim {output_dim} with parts "
                                     f"{parts} is not a placement (q, k, v on dimension 0)")
        if getattr(module, "v_head_size", module.head_size) != module.head_size:
            raise UnimplementedError(f"{layer}: v_head_size {module.v_head_size} != head_size "
                                     f"{module.head_size} is not carried by the Python API")
        return _api.Placement.qkv(module.total_num_heads, module.total_num_kv_heads,
                                  module.head_size, fused=fused, parts=parts)
    # MergedColumnParallelLinear
    sizes = list(getattr(module, "output_sizes", []))
    if len(sizes) != len(parts):
        raise InvalidArgumentError(f"{layer}: output_sizes {sizes} but the model declares "
                                   f"{len(parts)} parts {parts} for {fused!r}")
    return replace(_api.Placement.merged(fused, parts), dim=output_dim)


def tensor_parallel_layout(model) -> Optional[TensorParallelLayout]:
    """The TensorParallelLayout of `model` (vLLM's model, or weightbus.testing.llama's
    stand-in at tp_size > 1) derived from its parameters' metadata (see the table above), or
    None when nothing is split (no layer with tp_size > 1, no FusedMoE whose experts are split
    over data-parallel ranks): every tensor whole.

    Raises InvalidArgumentError when the layers disagree on (tp_rank, tp_size) or a parameter's
    metadata names a dimension no known loader reads, UnimplementedError for the layouts listed
    above; each names the parameter and its layer class. Pure: reads the model, changes
    nothing."""
    ranks = set()
    split_experts = False
    for module in model.modules():
        kind = _layer_kind(module)
        if kind == "FusedMoE":  # its groups are its own (data parallel ranks too)
            split_experts |= getattr(module, "tp_size", 1) > 1 or getattr(module, "ep_size", 1) > 1
            continue
        # vLLM's VocabParallelEmbedding keeps tp_size but not tp_rank: the linear layers
        # (LinearBase) carry both.
        if kind is not None and getattr(module, "tp_size", 1) > 1 and \
                getattr(module, "tp_rank", None) is not None:
            ranks.add((module.tp_rank, module.tp_size))
    if not ranks and not split_experts:
        return None
    if len(ranks) > 1:
        raise InvalidArgumentError(f"the model's layers are on different (tp_rank, tp_size): "
                                   f"{sorted(ranks)}")
    # TP 1 with experts split over data parallel ranks: a layout of one rank.
    tp_rank, tp_size = ranks.pop() if ranks else (0, 1)
    placements: Dict[str, _api.Placement] = {}
    for module_name, module in model.named_modules():
        kind = _layer_kind(module)
        for pname, param in module.named_parameters(recurse=False):
            name = f"{module_name}.{pname}" if module_name else pname
            placements[name] = _parameter_placement(model, name, module, param, kind)
    return TensorParallelLayout(tp_rank, tp_size, placements, tuple(placements))


def load_resharded(model, update, layout: TensorParallelLayout, uri: str = "") -> List[str]:
    """Copies the slices of `update` (received with layout.subscriber_options()) into the
    model's parameters of the same names: each already this rank's slice, so no weight loader
    runs (vLLM's loaders would narrow again). A parameter the update has no slice for (none of
    its checkpoint tensors was published: skip_absent) is left as it is, as vLLM's load_weights
    leaves a parameter the weights do not name; their names are returned (and logged). Every
    name and shape is checked before any parameter is written: InvalidArgumentError naming the
    parameter, both shapes and the rank (e.g. metadata that does not match the layer: the
    model stays as it was)."""
    params = dict(model.named_parameters())
    where = f"{uri}: " if uri else ""
    pairs, left = [], []
    unknown = [name for name in update.keys() if name not in params]
    if unknown:
        raise InvalidArgumentError(f"{where}version {update.version} has slices for "
                                   f"{unknown[:4]}, which are not parameters of the model")
    for name in layout.tensors:
        if name not in update:
            left.append(name)
            continue
        tensor, param = update[name], params[name]
        if tuple(tensor.shape) != tuple(param.shape):
            raise InvalidArgumentError(
                f"{where}version {update.version}: the slice of \"{name}\" for TP rank "
                f"{layout.tp_rank} of {layout.tp_size} is {list(tensor.shape)} "
                f"(placement {layout.placements[name]}) but the parameter is "
                f"{list(param.shape)}: its metadata (output_dim/input_dim, head counts) does "
                f"not describe how its layer is split")
        pairs.append((param, tensor))
    import torch
    with torch.no_grad():
        for param, tensor in pairs:
            param.data.copy_(tensor)
    if left:
        _log.info("%sversion %d has no checkpoint tensor for %d of %d parameters of TP rank %d "
                  "of %d, left as they were: %s", where, update.version, len(left),
                  len(layout.tensors), layout.tp_rank, layout.tp_size, ", ".join(left[:8]))
    return left


def layerwise_reload_functions(override=None) -> Optional[Tuple[Callable, Callable]]:
    """vLLM's layerwise reload, (initialize_layerwise_reload(model),
    finalize_layerwise_reload(model, model_config)) from
    vllm.model_executor.model_loader.reload, or None where this vLLM (or no vLLM) lacks it.
    `override`: an object with initialize(model) and finalize(model, model_config) used
    instead (weightbus.testing.worker.LayerwiseReload, the stand-in written from vLLM's
    layerwise.py).

    Layerwise reload is what makes a checkpoint-format reload safe for models whose
    parameters are not in checkpoint format after loading (FP8/INT4 online quantization,
    repacked MoE experts, Marlin layouts): initialize puts each layer's checkpoint-format
    parameters back (on the meta device) and wraps their weight loaders; as soon as a layer
    has all its weights, the layer is materialized, loaded, processed (quant_method.
    process_weights_after_loading) and the processed values are copied into the original
    kernel tensors (same storage, so CUDA graphs stay valid); finalize processes what is left
    and puts untouched layers back. A plain load_weights into processed parameters copies
    checkpoint values into kernel-format tensors instead (wrong values, or a shape error)."""
    if override is not None:
        return override.initialize, override.finalize
    try:
        from vllm.model_executor.model_loader.reload import (finalize_layerwise_reload,
                                                             initialize_layerwise_reload)
    except ImportError:
        return None
    return initialize_layerwise_reload, finalize_layerwise_reload


_PREFETCHES: "weakref.WeakSet[_Prefetch]" = weakref.WeakSet()


@atexit.register
def _close_prefetches() -> None:
    """Ends every background receive before the interpreter (and the library) shut down."""
    for prefetch in list(_PREFETCHES):
        prefetch.close()


class _Prefetch:
    """One version received ahead of the update RPC, in a background thread, into the
    library's memory (the staging): the `prefetch` option of both adapters.

    It has a Subscriber of its own (same URI and options): the adapter's subscriber stays free
    for a full receive (calls on one subscriber are serialized, and a background wait would
    hold it), and its version order is untouched, so a staged version that is not the one
    asked for can be dropped and the asked-for one still received. The background receive is
    a Subscriber.wait (the newest committed version >= floor, waiting for one without a
    bound), so what is staged is a whole, verified version or nothing (all-or-nothing). At
    most one version is staged or in flight: start() drops the previous one first. Not
    Subscriber.bind: a bound receive writes into the parameters, which the engine is still
    generating with; the apply (load_weights) is the one copy into them.

    Thread-safety: start/take/cancel/close from one thread (the adapter's); only the
    background thread touches the prefetch subscriber while a receive is in flight."""

    def __init__(self, uri: str, options: Dict[str, Any]):
        self._uri = uri
        self._options = dict(options)
        self._subscriber: Optional[_api.Subscriber] = None
        self._thread: Optional[threading.Thread] = None
        self._slot: Dict[str, Any] = {}
        self.floor: Optional[int] = None  # the floor of the prefetch in flight or staged
        _PREFETCHES.add(self)

    def start(self, floor: int) -> None:
        """Drops what is staged or in flight, then receives the newest version >= floor in
        the background. A subscriber that cannot be opened is logged; the adapter then does
        full receives (the next start tries again)."""
        self.cancel()
        try:
            if self._subscriber is None:
                self._subscriber = _api.Subscriber(self._uri, **self._options)
        except Exception as e:
            _log.warning("weightbus prefetch: opening %s failed (%s); updates receive in full",
                         self._uri, e)
            return
        subscriber, slot = self._subscriber, {"done": threading.Event()}

        def run():
            try:
                slot["result"] = subscriber.wait(floor, None)
            except BaseException as e:  # kept for take(); a cancelled wait lands here too
                slot["result"] = e
            finally:
                slot["done"].set()

        self._slot, self.floor = slot, floor
        self._thread = threading.Thread(target=run, name="weightbus-prefetch", daemon=True)
        self._thread.start()

    def wait(self, timeout: Optional[float]) -> Optional[int]:
        """Blocks up to `timeout` seconds (None: forever) for the background receive to end;
        returns the staged version, or None (none in flight, failed, or not ended in time)."""
        if self._thread is None or not self._slot["done"].wait(timeout):
            return None
        result = self._slot.get("result")
        return result.version if isinstance(result, _api.Update) else None

    def take(self, version: Optional[int], floor: int, wait: bool,
             timeout: Optional[float]) -> Optional["_api.Update"]:
        """The staged update, handed over (the caller closes it), when it is what the caller
        is about to receive: exactly `version` when given, else any version >= floor. With
        `version` or `wait`, a receive still in flight is waited for up to `timeout` (then
        cancelled); otherwise (the newest without waiting) its wait for a version is
        cancelled, while a receive already under way is let finish and used. Returns None for
        a full receive: nothing started, cancelled, failed (logged), or a version other than
        the one asked for (dropped: one staged version at most)."""
        if self._thread is None:
            return None
        done = self._slot["done"]
        if version is not None or wait:
            if not done.wait(timeout):
                self.cancel()
                return None
        elif not done.is_set():
            self._drop_subscriber()  # cancels a wait; a receive under way finishes first
        self._thread.join()
        self._thread, self.floor = None, None
        result = self._slot.pop("result", None)
        if not isinstance(result, _api.Update):
            if not isinstance(result, CancelledError):
                _log.warning("weightbus prefetch from %s failed (%s: %s); receiving in full",
                             self._uri, type(result).__name__, result)
            self._drop_subscriber()
            return None
        if (version is not None and result.version != version) or result.version < floor:
            result.close()
            return None
        return result

    def cancel(self) -> None:
        """Ends the background receive (a wait in flight is cancelled; the cancelled
        subscriber is closed and a new one opened by the next start) and drops what is
        staged."""
        if self._thread is None:
            return
        if not self._slot["done"].is_set():
            self._drop_subscriber()  # cancels the wait; returns once the call has returned
        self._thread.join()
        self._thread, self.floor = None, None
        result = self._slot.pop("result", None)
        if isinstance(result, _api.Update):
            result.close()

    def close(self) -> None:
        self.cancel()
        self._drop_subscriber()

    def __del__(self):
        try:
            self.close()  # a dropped adapter must not leave a thread waiting for ever
        except Exception:  # interpreter shutdown
            pass

    def _drop_subscriber(self) -> None:
        subscriber, self._subscriber = self._subscriber, None
        if subscriber is not None:
            subscriber.close()


def _fetch(subscriber: "_api.Subscriber", prefetch: Optional[_Prefetch], held: Optional[int],
           version: Optional[int] = None, wait_min: Optional[int] = None,
           timeout: Optional[float] = 60.0) -> Tuple[Optional["_api.Update"], bool]:
    """The receive of both adapters: exactly `version`; else, with `wait_min`, the newest
    version >= wait_min (waiting up to `timeout`); else the newest above `held` without
    waiting (None when there is none). Takes the prefetched version when it is that one
    (True in the result), else receives in full on `subscriber`. For the newest, a staged
    version is used only when nothing newer is committed (a newer one is received in full and
    the staged one dropped). A version below `held` is FailedPreconditionError: what a worker
    applies never goes back, prefetched or not."""
    uri = subscriber.uri
    if version is not None and held is not None and version < held:
        raise FailedPreconditionError(
            f"{uri}: cannot apply version {version}: this worker holds version {held} already, "
            f"and the versions it applies never decrease")
    floor = 0 if held is None else held + 1
    deadline = None if timeout is None else time.monotonic() + timeout

    def left() -> Optional[float]:
        return None if deadline is None else max(0.0, deadline - time.monotonic())

    staged = None
    if prefetch is not None and (version is None or held is None or version > held):
        staged = prefetch.take(version, max(floor, wait_min or 0), wait_min is not None,
                               timeout)
    if staged is not None:
        if version is not None:
            return staged, True
        try:
            newer = subscriber.poll(staged.version + 1, left())
        except BaseException:
            staged.close()
            raise
        if newer is None:
            return staged, True
        staged.close()
        return newer, False
    if version is not None:
        return subscriber.receive(version, left()), False
    if wait_min is not None:
        return subscriber.wait(max(floor, wait_min), left()), False
    return subscriber.poll(floor, timeout), False


@dataclass
class AppliedVersion:
    """What one weightbus_update (or one engine round) did on one worker."""
    version: Optional[int]    # the version now in the model (None: none yet)
    changed: bool             # whether this call applied a new version
    receive_s: float = 0.0    # waiting for and receiving the version (taking it, prefetched)
    load_s: float = 0.0       # load_weights + post-load processing (or layerwise reload)
    applied_unix: float = 0.0  # time.time() when the model held the version
    prefetched: bool = False  # the version came from the prefetch (only applied here)
    bytes: int = 0            # bytes the receive read or moved (UpdateStats.bytes): at TP > 1
                              # this worker's slices (plus checksum-block rounding on disk)
    left: Tuple[str, ...] = ()  # at TP > 1, parameters the version had no checkpoint tensor
                                # for, left as they were (load_resharded)


class WeightbusWorkerExtension:
    """Mixin for vLLM workers (worker_extension_cls); see the module docstring. The host class
    provides `model_runner.model` (with load_weights), and optionally `model_config`,
    `device` and `model_runner.reset_lora_state` (vLLM's GPU model runner has all of them).

    At tp_size > 1 (tensor_parallel_layout of the model), the worker subscribes to its slices
    only and applies them with load_resharded + process_weights_after_loading.

    Applying a version: vLLM's layerwise reload where this vLLM has it
    (layerwise_reload_functions: initialize, load_weights, finalize, inside the device
    context as vLLM's worker does), which FP8/INT4 and repacked-MoE models need; else
    load_weights + process_weights_after_loading. Then the device is synchronized, LoRA state
    is reset where the model runner has reset_lora_state (vLLM's worker does the same after a
    native-engine update: adapters built on the old weights are dropped), and
    weightbus_on_applied runs. The prefix cache is the engine's, not a worker's: reset it once
    per new version from the driver (update_replica does, before returning).

    Prefetch (weightbus_init(..., prefetch=True)): after init and after every update, the
    next version (the newest above the applied one, as soon as one is committed) is received
    in a background thread into staging while the worker generates; weightbus_update then
    only applies it when it is the version asked for (exactly `version`, or for the newest:
    when nothing newer has been committed since), else drops it and receives in full. See
    _Prefetch for the rules; memory: one staged version of host memory at most on top of the
    model; a failed prefetch only makes the next update a full receive."""

    # Layerwise reload stand-in (an object with initialize(model) and finalize(model,
    # model_config), e.g. weightbus.testing.worker.LayerwiseReload); None: vLLM's where it
    # exists, else load_weights + process_weights_after_loading.
    weightbus_layerwise = None

    def weightbus_init(self, uri: str, options: Optional[Dict[str, Any]] = None,
                       prefetch: bool = False) -> bool:
        """Subscribes this worker to the channel at `uri` (settings in `options`); with
        `prefetch`, starts receiving the first version in the background (a second
        subscriber on the same channel)."""
        self.weightbus_close()
        model = getattr(self.model_runner, "model", None)
        self._weightbus_tp = None if model is None else tensor_parallel_layout(model)
        options = dict(options or {})
        if self._weightbus_tp is not None:
            options.update(self._weightbus_tp.subscriber_options())
        self._weightbus_subscriber = _api.Subscriber(uri, **options)
        self._weightbus_version: Optional[int] = None
        self._weightbus_last: Optional[AppliedVersion] = None
        self._weightbus_prefetch = _Prefetch(uri, options) if prefetch else None
        self._weightbus_prefetch_next()
        return True

    def weightbus_update(self, min_version: Optional[int] = None,
                         timeout: Union[None, float, str] = AUTO_TIMEOUT,
                         version: Optional[int] = None) -> Optional[int]:
        """Applies the newest version on the channel if it is newer than the one the model
        holds, and returns the version the model now holds (None before the first).

        Without min_version (or with one the model already holds) this never waits for a
        version to appear (Subscriber.poll): it applies what is there now, which is what a
        replica does between rollouts. With min_version above the applied version it blocks up
        to `timeout` seconds (None: forever) for a version >= min_version, also while no
        publisher is there yet (Subscriber.wait: replicas may start before the trainer), and
        raises weightbus.DeadlineExceededError (or UnavailableError when the publisher was never
        reachable) once the whole timeout has passed. `timeout` also bounds the receive;
        "auto" (the default) scales with the model (AUTO_TIMEOUT, resolve_timeout).
        A model that ties lm_head.weight to model.embed_tokens.weight refuses a version whose
        lm_head.weight differs (check_tied_embeddings: InvalidArgumentError, nothing loaded,
        the applied version stays).

        With `version` (instead of min_version), exactly that version (Subscriber.receive),
        also when newer ones exist: what every TP worker of a replica is given, e.g.
        llm.collective_rpc("weightbus_update", kwargs={"version": v}), so that no replica
        mixes versions (README, "One version per tensor-parallel group"). A model that holds
        it already returns at once; NotFoundError when the channel no longer holds it,
        FailedPreconditionError below the version this worker holds.

        With prefetch on, a staged version that is the one asked for is applied without a
        receive (weightbus_last_update()["prefetched"]); a prefetch still receiving it is
        waited for (within `timeout`). Whatever happens, a new prefetch starts before this
        returns or raises."""
        if version is not None and min_version is not None:
            raise ValueError("weightbus_update takes min_version or version, not both")
        subscriber = self._weightbus_require()
        timeout = resolve_timeout(timeout, getattr(self.model_runner, "model", None))
        current = self._weightbus_version
        start = time.perf_counter()
        if version is not None and version == current:
            self._weightbus_last = AppliedVersion(current, False)
            return current
        must_advance = min_version is not None and (current is None or current < min_version)
        try:
            update, prefetched = _fetch(subscriber, self._weightbus_prefetch, current, version,
                                        min_version if must_advance else None, timeout)
            if update is None:
                self._weightbus_last = AppliedVersion(current, False,
                                                      receive_s=time.perf_counter() - start)
                return current
            received = time.perf_counter()
            self._weightbus_left = ()
            with update:
                self._weightbus_load(update)
            _synchronize(getattr(self, "device", None))
            done = time.perf_counter()
            self._weightbus_version = update.version
            reset_lora = getattr(self.model_runner, "reset_lora_state", None)
            if reset_lora is not None:
                reset_lora()
            self._weightbus_last = AppliedVersion(update.version, True, received - start,
                                                  done - received, time.time(), prefetched,
                                                  update.stats.bytes, self._weightbus_left)
        finally:
            self._weightbus_prefetch_next()
        self.weightbus_on_applied(self._weightbus_last)
        return update.version

    def weightbus_on_applied(self, applied: AppliedVersion) -> None:
        """Hook, called once for each version this worker newly applies: after the whole
        version is in the model (load_weights, the post-load processing, the device
        synchronized, LoRA state reset), before weightbus_update returns, so before the
        driver's collective_rpc returns and admits new requests. Not called when
        weightbus_update applied nothing. Default: nothing; override it in a subclass named as
        worker_extension_cls. For work done once per engine, not per worker
        (llm.reset_prefix_cache()), use update_replica on the driver. An exception from it
        propagates out of weightbus_update; the version stays applied (weightbus_version()
        reports it)."""

    def weightbus_version(self) -> Optional[int]:
        """The version the model holds (None before the first update)."""
        return getattr(self, "_weightbus_version", None)

    def weightbus_prefetched(self, timeout: Optional[float] = 0.0) -> Optional[int]:
        """The version staged by the prefetch, waiting up to `timeout` seconds (None:
        forever) for the background receive to end; None when prefetch is off, nothing is
        staged yet, or the prefetch failed (the next update then receives in full)."""
        prefetch = getattr(self, "_weightbus_prefetch", None)
        return None if prefetch is None else prefetch.wait(timeout)

    def weightbus_last_update(self) -> Optional[Dict[str, Any]]:
        """Figures of the last weightbus_update call (a dict, so it crosses collective_rpc)."""
        last = getattr(self, "_weightbus_last", None)
        return None if last is None else dict(last.__dict__)

    def weightbus_close(self) -> bool:
        """Ends the prefetch (a background wait is cancelled) and closes the subscribers."""
        prefetch = getattr(self, "_weightbus_prefetch", None)
        if prefetch is not None:
            prefetch.close()
        self._weightbus_prefetch = None
        subscriber = getattr(self, "_weightbus_subscriber", None)
        if subscriber is not None:
            subscriber.close()
        self._weightbus_subscriber = None
        return True

    # ---- internals ----
    def _weightbus_require(self):
        subscriber = getattr(self, "_weightbus_subscriber", None)
        if subscriber is None:
            raise RuntimeError("weightbus_init(uri) must be called (through collective_rpc) "
                               "before weightbus_update")
        return subscriber

    def _weightbus_prefetch_next(self) -> None:
        prefetch = getattr(self, "_weightbus_prefetch", None)
        current = getattr(self, "_weightbus_version", None)
        floor = 0 if current is None else current + 1
        if prefetch is not None and prefetch.floor != floor:
            prefetch.start(floor)

    def _weightbus_load(self, update) -> None:
        model = self.model_runner.model
        model_config = getattr(self, "model_config", None)
        device = getattr(self, "device", None)
        if ties_word_embeddings(model, model_config):
            check_tied_embeddings(update, self._weightbus_subscriber.uri)
        tp = getattr(self, "_weightbus_tp", None)
        if tp is not None:  # this worker's slices, straight into its parameters
            with _device_context(device):
                self._weightbus_left = tuple(
                    load_resharded(model, update, tp, self._weightbus_subscriber.uri))
                process_weights_after_loading(model, model_config, device)
            return
        reload = layerwise_reload_functions(self.weightbus_layerwise)
        if reload is not None and self.weightbus_layerwise is None and model_config is None:
            reload = None  # vLLM's finalize needs the ModelConfig (attention layers)
        with _device_context(device):
            if reload is None:
                model.load_weights(weights=list(update))
                process_weights_after_loading(model, model_config, device)
                return
            reload[0](model)
            try:
                model.load_weights(weights=list(update))
            finally:  # also on failure, as vLLM's disk engine aborts: no layer left wrapped
                reload[1](model, model_config)


def update_replica(llm, version: Optional[int] = None, min_version: Optional[int] = None,
                   timeout: Union[None, float, str] = AUTO_TIMEOUT,
                   on_applied: Optional[Callable[[int], None]] = None,
                   reset_prefix_cache: bool = True) -> Optional[int]:
    """One weightbus_update on every worker of a vLLM `LLM` whose worker_extension_cls is
    WeightbusWorkerExtension (anything with its collective_rpc): `version` (exactly that one),
    `min_version` (wait for one at least that new) or neither (the newest, without waiting), as
    WeightbusWorkerExtension.weightbus_update takes them. Returns the version every worker
    holds (None before the first).

    When some worker newly applied the version, after every worker holds all of it and before
    this returns (so before the caller submits new requests): `llm.reset_prefix_cache()` when
    `reset_prefix_cache` and the engine has it (KV blocks cached for prefixes under the old
    weights must not be reused), then on_applied(version), once. Raises what a worker raised
    (then neither runs), or RuntimeError naming each worker's version when the workers hold
    different versions."""
    kwargs: Dict[str, Any] = {"timeout": timeout}
    if version is not None:
        kwargs["version"] = version
    if min_version is not None:
        kwargs["min_version"] = min_version
    held = llm.collective_rpc("weightbus_update", kwargs=kwargs)
    if len(set(held)) != 1:
        raise RuntimeError(f"the workers hold different versions {held} (in worker order)")
    changed = any(last is not None and last["changed"]
                  for last in llm.collective_rpc("weightbus_last_update"))
    if changed:
        _after_new_version(llm, held[0], on_applied, reset_prefix_cache)
    return held[0]


def _after_new_version(llm, version: int, on_applied: Optional[Callable[[int], None]],
                       reset_prefix_cache: bool) -> None:
    """What both drivers do once per newly applied version, before new requests."""
    if reset_prefix_cache and hasattr(llm, "reset_prefix_cache"):
        llm.reset_prefix_cache()
    if on_applied is not None:
        on_applied(version)


# ---------------------------------------------------------------------------------------------
# Native weight-transfer engine interface
# ---------------------------------------------------------------------------------------------

try:  # vLLM's base classes when vLLM is installed; weightbus.testing's copy of them otherwise.
    from vllm.distributed.weight_transfer.base import WeightTransferEngine as _EngineBase
    from vllm.distributed.weight_transfer.base import WeightTransferInitInfo as _InitInfoBase
    from vllm.distributed.weight_transfer.base import WeightTransferUpdateInfo as _UpdateInfoBase
except Exception:  # ImportError, or an import-time failure of a partial installation
    from .testing.worker import WeightTransferEngine as _EngineBase
    from .testing.worker import WeightTransferInitInfo as _InitInfoBase
    from .testing.worker import WeightTransferUpdateInfo as _UpdateInfoBase


@dataclass
class WeightbusInitInfo(_InitInfoBase):
    """init_info of WeightbusWeightTransferEngine: the channel and its settings (Subscriber
    options), and optionally the channel of the speculative draft (MTP/EAGLE) model: without
    `draft_uri` the engine refuses draft updates (supports_draft_weight_update is False).

    prefetch: receive the next target version in the background while the engine generates
    (after init and after every round: the newest version above the applied one, as soon as
    one is committed), so that update_weights only applies it (WeightbusWeightTransferEngine,
    "Prefetch"). Costs one more subscriber on the channel and up to one version of host
    memory."""
    uri: str
    options: Dict[str, Any] = field(default_factory=dict)
    draft_uri: Optional[str] = None
    draft_options: Dict[str, Any] = field(default_factory=dict)
    prefetch: bool = False


@dataclass
class WeightbusUpdateInfo(_UpdateInfoBase):
    """update_info of one update_weights call.

    version: None loads the newest committed version above the one the model holds, without
    waiting for one to appear (none newer: nothing is loaded and finish_weight_update keeps
    the model as it is). An int loads exactly that version (Subscriber.receive), also when
    newer ones exist, waiting up to `timeout` seconds if it is not committed yet: every TP
    worker given the same number loads the same weights (README, "One version per
    tensor-parallel group"). NotFoundError when the channel no longer holds it,
    FailedPreconditionError below the version this worker holds. With prefetch, a staged
    version is taken when it is the one these rules pick (WeightbusWeightTransferEngine,
    "Prefetch").
    timeout: seconds (None: forever) for the wait and for the receive; "auto" (the default)
    scales with the model (AUTO_TIMEOUT: 60 s plus its bytes at 0.5 GB/s).
    is_checkpoint_format: the tensors are in checkpoint (Hugging Face) names and layout and go
    through the model's load_weights; weightbus versions always are."""
    version: Optional[int] = None
    timeout: Union[None, float, str] = AUTO_TIMEOUT
    is_checkpoint_format: bool = True


def received_version(worker) -> Optional[int]:
    """For `llm.collective_rpc(weightbus.vllm.received_version)` between update_weights and
    finish_weight_update: the version this worker's engine received in the open session (None:
    none, e.g. update_weights({}) found nothing newer). vLLM labels the weights only from the
    caller's `finish_weight_update(weight_version=...)`, so this is how a caller learns the
    label. Over vLLM's multiprocess executor a callable needs
    VLLM_ALLOW_INSECURE_SERIALIZATION=1 (as vLLM's own tests set)."""
    return worker.weight_transfer_engine.received_version


def last_update(worker) -> Optional[Dict[str, Any]]:
    """For `llm.collective_rpc(weightbus.vllm.last_update)`: this worker's engine's figures of
    its last round (WeightbusWeightTransferEngine.last_update: receive_s, load_s, prefetched).
    Callables over vLLM's multiprocess executor: see received_version."""
    return worker.weight_transfer_engine.last_update


def _prefetched(worker, timeout: Optional[float]) -> Optional[int]:
    return worker.weight_transfer_engine.wait_prefetched(timeout)


def prefetched_versions(llm, timeout: Optional[float] = 0.0) -> List[Optional[int]]:
    """The version each worker's engine has prefetched (in worker order; None: prefetch off,
    nothing staged, or failed), waiting up to `timeout` seconds per worker (None: forever) for
    its background receive to end: e.g. before a round, to know it will only apply. Runs a
    callable through collective_rpc (see received_version)."""
    return llm.collective_rpc(_prefetched, kwargs={"timeout": timeout})


def sync_weights(llm, update_info: Union[None, Dict[str, Any], List[Dict[str, Any]]] = None, *,
                 draft: bool = False,
                 on_applied: Optional[Callable[[int], None]] = None,
                 reset_prefix_cache: bool = True) -> Optional[int]:
    """One whole update round on a vLLM `LLM` (or anything with its weight-sync methods) whose
    engine is WeightbusWeightTransferEngine: start_weight_update (start_draft_weight_update
    with `draft`), update_weights(update_info: one dict for every worker or a list of
    per-worker dicts; None: {}), finish_weight_update(weight_version=str(v)) where v is the
    version every worker received. Returns v: the version the model (the draft model with
    `draft`) now holds, or, when nothing newer was there, the one it held (None before the
    first).

    Raises what the update raised (vLLM's worker has then reset the target and the engine
    aborted its session; workers whose update succeeded in that round are finished without a
    label: the next round starts clean on every worker, but until then TP workers may hold
    different versions, so name the version in the next round), or RuntimeError naming each worker's
    version when TP workers received different versions (the round is finished, unlabelled).
    A draft round never moves the label: vLLM's weight version names the target model.

    When the round applied a new version v, after finish_weight_update (every worker
    finalized; vLLM's worker reset LoRA state after a target round) and before this returns,
    so before the caller admits new requests: `llm.reset_prefix_cache()` when
    `reset_prefix_cache` and the engine has it (a draft round too: the draft model's KV
    blocks are cached with the target's), then on_applied(v), once."""
    (llm.start_draft_weight_update if draft else llm.start_weight_update)()
    try:
        llm.update_weights({"update_info": {} if update_info is None else update_info})
    except Exception:
        # vLLM runs the RPC on every worker: a worker whose update failed has reset its target
        # and ended its session, but others may have loaded their version and still hold an
        # open session, which would refuse every later start. Finish theirs (unlabelled); the
        # workers without a session refuse the finish, which is expected here.
        try:
            llm.finish_weight_update()
        except Exception:
            pass
        raise
    received = llm.collective_rpc(received_version)
    if len(set(received)) != 1:
        llm.finish_weight_update()
        raise RuntimeError(f"workers received different versions {received} (in worker "
                           f"order); the round was finished without a weight_version label")
    version = received[0]
    label = None if draft or version is None else str(version)
    llm.finish_weight_update(weight_version=label)
    if version is not None:
        _after_new_version(llm, version, on_applied, reset_prefix_cache)
        return version
    held = llm.collective_rpc(_applied_draft_version if draft else _applied_version)
    if len(set(held)) != 1:
        raise RuntimeError(f"nothing newer was received, and the workers hold different "
                           f"versions {held} (in worker order)")
    return held[0]


ENGINE_NAME = "weightbus"


def register_plugin() -> None:
    """The `vllm.general_plugins` entry point of the installed package (pyproject.toml): vLLM
    calls it in each of its processes (vllm/plugins/__init__.py, load_general_plugins), so the
    engine is registered wherever vLLM's GPU worker creates engines. Registers
    WeightbusWeightTransferEngine as "weightbus" with vLLM's WeightTransferEngineFactory
    (vllm/distributed/weight_transfer/factory.py), lazily by module path, so weightbus.vllm's
    engine is imported only when a WeightTransferConfig(backend="weightbus") selects it.
    Without vLLM it registers with weightbus.testing.worker's factory (its stand-in).

    Safe to call more than once per process (vLLM's plugins may be): an existing "weightbus"
    entry is kept. Thread-safety: call it from one thread (vLLM does, at start-up)."""
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    except ImportError:
        from .testing.worker import WeightTransferEngineFactory
    try:
        WeightTransferEngineFactory.register_engine(ENGINE_NAME, __name__,
                                                    "WeightbusWeightTransferEngine")
    except ValueError:  # "already registered" (the only ValueError with a class_name given)
        pass


def _applied_version(worker) -> Optional[int]:
    return worker.weight_transfer_engine.applied_version


def _applied_draft_version(worker) -> Optional[int]:
    return worker.weight_transfer_engine.applied_draft_version


class WeightbusWeightTransferEngine(_EngineBase):
    """vLLM's weight-transfer engine (vllm/distributed/weight_transfer/base.py) over a weightbus
    channel; register it in every vLLM process with
    `WeightTransferEngineFactory.register_engine("weightbus", "weightbus.vllm",
    "WeightbusWeightTransferEngine")` and select it with WeightTransferConfig(backend=
    "weightbus"). vLLM's GPU worker drives it:

    - init_transfer_engine(WeightbusInitInfo): subscribes (and to draft_uri when given).
    - start_weight_update(): opens a session on the current target (vLLM retargets the engine
      at the draft model for start_draft_weight_update); initializes layerwise reload where
      vLLM has it. Refuses a second session, and a draft target without draft_uri.
    - update_weights(dict) -> receive_weights(WeightbusUpdateInfo): receives one version and
      hands it to the target's load_weights. One version per session. On any failure the
      session is aborted as vLLM's disk engine aborts its own (layerwise reload finalized),
      then the error is raised: vLLM's worker resets the target and the next round is clean.
    - finish_weight_update(): finalizes (layerwise reload, or the post-load processing) and
      makes the received version the applied one. vLLM labels the weights only from the
      caller's LLM.finish_weight_update(weight_version=...): see sync_weights.
    - shutdown(): aborts an open session, ends the prefetch and closes the subscribers.

    Prefetch (init_info "prefetch": true): after init and after every round (also a failed
    one), a background thread receives the next target version, the newest above the applied
    one, as soon as one is committed, into staging (library memory), while vLLM's worker goes
    on serving. update_weights then takes it instead of receiving, so the RPC only applies
    (load_weights, layerwise reload): exactly the version update_info names, as without
    prefetch. The rule for a staged version that is not the one asked for: it is dropped
    (freed) and the asked-for version received in full; for update_info without a version,
    the staged one is applied unless a newer one was committed meanwhile (that one is received
    in full). A receive still in flight is waited for when update_info names a version
    (within its timeout); without one, a background wait for a version is cancelled and a
    receive already under way is let finish and used. A prefetch that fails is logged and the update
    receives in full; at most one version is staged. Draft rounds never use it.
    last_update tells which way a round went.

    Tensor parallelism: a target model at tp_size > 1 subscribes with the placements derived
    from its parameters (tensor_parallel_layout), so each worker receives only its slices,
    which go straight into its parameters (load_resharded), then the post-load processing at
    finish_weight_update; layerwise reload is not used for them (the slices are in the
    parameters' layout already; online-quantized models at TP > 1 are not supported this
    way). A draft model receives whole tensors through its load_weights. Not thread-safe: vLLM
    calls one worker's engine from one thread (the prefetch's background thread touches only
    its own subscriber)."""

    init_info_cls = WeightbusInitInfo
    update_info_cls = WeightbusUpdateInfo

    # False until init_transfer_engine is given a draft_uri (an instance attribute then):
    # vLLM's worker refuses start_draft_weight_update while it is False.
    supports_draft_weight_update = False

    # Layerwise reload: an object with initialize(model) and finalize(model, model_config)
    # (weightbus.testing.worker.LayerwiseReload); None: vLLM's
    # vllm.model_executor.model_loader.reload where it exists, else the post-load processing.
    layerwise = None

    def __init__(self, config: Any, vllm_config: Any, device: Any, model: Any) -> None:
        super().__init__(config, vllm_config, device, model)
        self._subscriber: Optional[_api.Subscriber] = None
        self._draft_subscriber: Optional[_api.Subscriber] = None
        self._version: Optional[int] = None
        self._draft_version: Optional[int] = None
        self._session: Optional[Dict[str, Any]] = None
        self._prefetch: Optional[_Prefetch] = None
        self._last: Optional[AppliedVersion] = None
        self._tp: Optional[TensorParallelLayout] = None  # the target's, at tp_size > 1

    # -- the interface --
    def init_transfer_engine(self, init_info: WeightbusInitInfo) -> None:
        if isinstance(init_info, dict):
            init_info = self.parse_init_info(init_info)
        self.shutdown()
        self._tp = None if self.model is None else tensor_parallel_layout(self.model)
        options = dict(init_info.options)
        if self._tp is not None:
            options.update(self._tp.subscriber_options())
        self._subscriber = _api.Subscriber(init_info.uri, **options)
        if init_info.draft_uri is not None:
            self._draft_subscriber = _api.Subscriber(init_info.draft_uri,
                                                     **init_info.draft_options)
        self.supports_draft_weight_update = self._draft_subscriber is not None
        if init_info.prefetch:
            self._prefetch = _Prefetch(init_info.uri, options)
            self._prefetch_next()

    def start_weight_update(self) -> None:
        if self._subscriber is None:
            raise RuntimeError("init_weight_transfer_engine must be called before "
                               "start_weight_update")
        if self._session is not None:
            raise RuntimeError("a weightbus weight update is already in progress")
        draft = self.model is not self._default_model
        if draft and self._draft_subscriber is None:
            raise RuntimeError(
                f"{type(self).__name__}: a draft model weight update needs a draft channel "
                f'(init_info "draft_uri"); without one the draft model would be given the '
                f"target model's tensors from {self._subscriber.uri}")
        reload = self._layerwise()
        self._session = {"version": None, "draft": draft, "reload": None}
        if reload is not None:
            try:
                with _device_context(self.device):
                    reload[0](self.model)
            except BaseException:
                self._session = None
                raise
            self._session["reload"] = reload[1]

    def update_weights(self, update_info: Dict[str, Any]) -> None:
        """vLLM's update_weights (parse, receive_weights, synchronize), aborting the session on
        any failure before raising it."""
        try:
            super().update_weights(update_info)
        except BaseException:
            self._abort_session()
            raise

    def receive_weights(self, update_info: WeightbusUpdateInfo) -> None:
        """Receives the version update_info names (see WeightbusUpdateInfo) from the target's
        channel and loads it into the target model. With a model (or model_config) that ties
        lm_head.weight to model.embed_tokens.weight, a version whose lm_head.weight differs is
        refused first (check_tied_embeddings: nothing loaded)."""
        if isinstance(update_info, dict):
            update_info = self.parse_update_info(update_info)
        session = self._session
        if session is None:
            raise RuntimeError("start_weight_update must be called before update_weights")
        if session["version"] is not None:
            raise RuntimeError(f"{type(self).__name__} loads one version per update session "
                               f"(version {session['version']} was loaded in this one); "
                               f"finish_weight_update, then start another")
        draft = session["draft"]
        subscriber = self._draft_subscriber if draft else self._subscriber
        applied = self._draft_version if draft else self._version
        timeout = resolve_timeout(update_info.timeout, self.model)
        start = time.perf_counter()
        if update_info.version is not None and update_info.version == applied:
            update, prefetched = subscriber.receive(applied, timeout), False
        else:
            update, prefetched = _fetch(subscriber, None if draft else self._prefetch, applied,
                                        update_info.version, None, timeout)
        received = time.perf_counter()
        if update is None:
            self._last = AppliedVersion(applied, False, receive_s=received - start)
            return
        with update:
            if ties_word_embeddings(self.model, self.model_config):
                check_tied_embeddings(update, subscriber.uri)
            if self.model is None:
                raise RuntimeError("no model to load into")
            left: Tuple[str, ...] = ()
            with _device_context(self.device):
                if self._tp is not None and not draft:
                    left = tuple(load_resharded(self.model, update, self._tp, subscriber.uri))
                else:
                    self.model.load_weights(weights=list(update))
            session["version"] = update.version
        session["figures"] = (received - start, time.perf_counter() - received, prefetched,
                              update.stats.bytes, left)

    def finish_weight_update(self) -> None:
        """Finalizes the session: the layerwise reload (or the post-load processing) runs and
        the received version becomes the applied one. With nothing received (update_weights({})
        found nothing newer) the model is left as it was."""
        if self._session is None:
            raise RuntimeError("no weightbus weight update is in progress")
        session = self._session
        finish = time.perf_counter()
        try:
            with _device_context(self.device):
                if session["reload"] is not None:
                    session["reload"](self.model, self.model_config)
                elif session["version"] is not None and self.model is not None:
                    process_weights_after_loading(self.model, self.model_config, self.device)
            _synchronize(self.device)
        finally:
            self._session = None
            if session["version"] is not None:
                if session["draft"]:
                    self._draft_version = session["version"]
                else:
                    self._version = session["version"]
            self._prefetch_next()
        if session["version"] is not None:
            receive_s, load_s, prefetched, nbytes, left = session["figures"]
            self._last = AppliedVersion(session["version"], True, receive_s,
                                        load_s + time.perf_counter() - finish, time.time(),
                                        prefetched, nbytes, left)

    @property
    def received_version(self) -> Optional[int]:
        """The version received in the open session (None: no session, or none received)."""
        return None if self._session is None else self._session["version"]

    @property
    def applied_version(self) -> Optional[int]:
        """The version the target model holds (None before the first)."""
        return self._version

    @property
    def applied_draft_version(self) -> Optional[int]:
        """The version the draft model holds (None before the first)."""
        return self._draft_version

    @property
    def last_update(self) -> Optional[Dict[str, Any]]:
        """Figures of the last round that received (AppliedVersion's fields, a dict): for a
        finished round, receive_s (taking the staged version, or the full receive), load_s
        (load_weights and finalizing: the apply), prefetched; None before the first."""
        return None if self._last is None else dict(self._last.__dict__)

    def wait_prefetched(self, timeout: Optional[float] = 0.0) -> Optional[int]:
        """The version the prefetch has staged, waiting up to `timeout` seconds (None:
        forever) for its background receive to end; None when prefetch is off, nothing is
        staged yet, or the prefetch failed (the next round then receives in full)."""
        return None if self._prefetch is None else self._prefetch.wait(timeout)

    def shutdown(self) -> None:
        self._abort_session()
        if self._prefetch is not None:
            self._prefetch.close()
            self._prefetch = None
        for subscriber in (self._subscriber, self._draft_subscriber):
            if subscriber is not None:
                subscriber.close()
        self._subscriber = self._draft_subscriber = None
        self.supports_draft_weight_update = False

    # -- internals --
    def _layerwise(self) -> Optional[Tuple[Callable, Callable]]:
        if self._tp is not None and self.model is self._default_model:
            return None  # slices go straight into the parameters (tensor_parallel_layout)
        if self.layerwise is None and (self.model is None or self.model_config is None):
            return None
        return layerwise_reload_functions(self.layerwise)

    def _prefetch_next(self) -> None:
        """Starts the prefetch of the version after the applied one, unless that one is in
        flight or staged already."""
        floor = 0 if self._version is None else self._version + 1
        if self._prefetch is not None and self._prefetch.floor != floor:
            self._prefetch.start(floor)

    def _abort_session(self) -> None:
        """Ends an open session without applying it, as vLLM's disk engine does: the layerwise
        reload is finalized so the model is not left wrapped for reloading (what was loaded
        before the failure stays loaded: a receive fails before anything is loaded, a
        load_weights that raises midway does not)."""
        session, self._session = self._session, None
        if session is not None and session["reload"] is not None:
            try:
                with _device_context(self.device):
                    session["reload"](self.model, self.model_config)
            except Exception as e:  # the original error is the one to raise
                _log.exception(
                    "weightbus: finalizing the layerwise reload of an aborted update failed: %s",
                    e)
        self._prefetch_next()


# ---------------------------------------------------------------------------------------------
# Trainer side: vLLM's TrainerWeightTransferEngine over a streaming publish
# ---------------------------------------------------------------------------------------------

try:  # vLLM's trainer-side classes when vLLM has them; weightbus.testing's copy otherwise.
    from vllm.distributed.weight_transfer.base import TrainerInitInfo as _TrainerInitInfoBase
    from vllm.distributed.weight_transfer.base import \
        TrainerWeightTransferEngine as _TrainerEngineBase
except Exception:  # ImportError (no vLLM, or a vLLM without the trainer API)
    from .testing.trainer import TrainerInitInfo as _TrainerInitInfoBase
    from .testing.trainer import TrainerWeightTransferEngine as _TrainerEngineBase


@dataclass
class WeightbusTrainerInitInfo(_TrainerInitInfoBase):
    """init_info of WeightbusTrainerEngine (vLLM's TrainerInitInfo: `rank` keyword-only, rank 0
    the sender; `backend` is "weightbus", the key WeightTransferTrainerFactory dispatches on).

    uri: the channel the sender publishes to; options: its Publisher settings (e.g.
    stream_bucket, the host memory the streaming publish stages through, and stream_spill_dir).
    worker_uri / worker_options: what the inference workers subscribe with (WeightbusInitInfo;
    default: `uri` without its query, and no options), sent to them by trainer_init.
    timeout: seconds for each round's commit and for the workers' receive (None: forever)."""
    backend: ClassVar[str] = ENGINE_NAME
    uri: str
    options: Dict[str, Any] = field(default_factory=dict)
    worker_uri: Optional[str] = None
    worker_options: Dict[str, Any] = field(default_factory=dict)
    timeout: Optional[float] = 600.0


class WeightbusTrainerEngine(_TrainerEngineBase):
    """vLLM's trainer-side engine for weightbus (TrainerWeightTransferEngine): each round,
    send_weights() consumes the trainer's WeightSource one tensor at a time into a streaming
    publish (Publisher.begin_publish: each tensor is copied into a bounded bucket, CUDA tensors
    asynchronously into pinned memory, and may be freed before the next one is gathered; the
    whole model is never alive at once), commits it as the next version, then drives the
    inference side through the client: start_weight_update, update_weights({"version": v}) so
    every worker loads exactly that version, finish_weight_update(weight_version=str(v)).

    Every trainer rank calls trainer_init and send_weights and iterates the source (its
    materialization is a collective); only the sender (rank 0) publishes and calls the client.
    Errors: a failed commit raises before the inference side is asked to update (nothing was
    published); a failed update_weights raises after the worker engines aborted their session
    (the published version stays on the channel, and the next round publishes a newer one).
    Not thread-safe: one round at a time."""

    init_info_cls = WeightbusTrainerInitInfo

    def __init__(self, init_info: WeightbusTrainerInitInfo, *, client: Any, source: Any,
                 publisher: Optional["_api.Publisher"]) -> None:
        super().__init__(client=client, source=source, is_sender=init_info.is_sender)
        self.init_info = init_info
        self.publisher = publisher
        self.last_version: Optional[int] = None

    @classmethod
    def trainer_init(cls, init_info: WeightbusTrainerInitInfo, *, client: Any,
                     source: Any = None) -> "WeightbusTrainerEngine":
        """Opens the sender's Publisher on init_info.uri and tells the inference workers where
        to subscribe (client.init_weight_transfer_engine with WeightbusInitInfo's fields);
        other ranks only keep the source. Raises ValueError without a source or a uri."""
        if source is None:
            raise ValueError("WeightbusTrainerEngine needs a WeightSource (trainer_init's "
                             "`source`): it publishes the full model each round")
        if not init_info.uri:
            raise ValueError("WeightbusTrainerInitInfo.uri is empty: name the channel")
        publisher = None
        if init_info.is_sender:
            publisher = _api.Publisher(init_info.uri, **init_info.options)
            try:
                client.init_weight_transfer_engine({
                    "uri": init_info.worker_uri or init_info.uri.split("?", 1)[0],
                    "options": dict(init_info.worker_options)})
            except BaseException:
                publisher.close()
                raise
        return cls(init_info, client=client, source=source, publisher=publisher)

    def send_weights(self) -> None:
        """One round: streams the source as the channel's next version, then updates the
        inference side to exactly that version (see the class docstring)."""
        if not self.is_sender:
            for _name, tensor in self.source:  # drives the collectives; nothing is sent
                del tensor
            return
        latest = self.publisher.latest_version
        version = 1 if latest is None else latest + 1
        with self.publisher.begin_publish(version, metadata={"weight_version": str(version)}) \
                as stream:
            for name, tensor in self.source:
                stream.add(name, tensor)
                del tensor  # the stream holds a copy (or, for CUDA, the copy in flight)
            stream.commit(timeout=self.init_info.timeout)
        self.last_version = version
        self.client.start_weight_update()
        self.client.update_weights({"version": version, "timeout": self.init_info.timeout})
        self.client.finish_weight_update(weight_version=str(version))

    def shutdown(self) -> None:
        """Closes the sender's Publisher (published versions stay on a durable channel)."""
        if self.publisher is not None:
            self.publisher.close()
            self.publisher = None


def register_trainer_engine() -> None:
    """Registers WeightbusTrainerEngine as "weightbus" with vLLM's WeightTransferTrainerFactory
    (weightbus.testing.trainer's without vLLM), lazily by module path; an existing entry is
    kept. Then WeightTransferTrainerFactory.trainer_init(WeightbusTrainerInitInfo(...,
    rank=r), client=..., source=ModuleSource(model)) builds the engine."""
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    except ImportError:
        from .testing.trainer import WeightTransferTrainerFactory
    try:
        WeightTransferTrainerFactory.register_engine(ENGINE_NAME, __name__,
                                                     "WeightbusTrainerEngine")
    except ValueError:  # already registered
        pass
