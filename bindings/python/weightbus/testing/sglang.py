# SPDX-License-Identifier: Apache-2.0
"""An SGLang-shaped engine for testing weightbus.sglang without SGLang: the classes, call order
and arguments of SGLang's two weight-update paths, written from its source (sgl-project/sglang,
python/sglang/srt/...), in one process, one scheduler per TP rank:

  Engine.update_weights_from_disk(model_path, load_format)            entrypoints/engine.py
    -> UpdateWeightFromDiskReqInput                                     managers/io_struct.py
    -> TokenizerManager: every scheduler; on success model_path (and weight_version) updated
    -> Scheduler.update_weights_from_disk: TpModelWorker, flush_cache on success
                                               managers/scheduler_update_weights_mixin.py
    -> ModelRunner.update_weights_from_disk(model_path, load_format)    model_executor/
       model_runner.py: DefaultModelLoader's weights iterator over the directory's
       *.safetensors (model.safetensors.index.json filters them), load_weights_and_postprocess;
       (False, "Failed to get weights iterator: ...") when the directory cannot be read.

  Engine.update_weights_from_tensor(named_tensors, load_format, flush_cache)
    -> one MultiprocessingSerializer.serialize(named_tensors) per TP rank
    -> UpdateWeightsFromTensorReqInput
    -> Scheduler.update_weights_from_tensor: TpModelWorker deserializes its rank's payload,
       flush_cache when asked and successful
    -> ModelRunner.update_weights_from_tensor(named_tensors, load_format): tensors moved to the
       device (_unwrap_tensor), then load_format None: model.load_weights; a load_format listed
       in server_args.custom_weight_loader: dynamic_import(load_format)(self.model,
       named_tensors); "direct" and "flattened_bucket" are not reproduced
       (NotImplementedError, as for an unknown format). An exception of the loader is not
       caught there (model_runner.py) and propagates out of the Engine call here.

Models are anything with SGLang's `load_weights(weights)` (iterable of (name, tensor)), e.g.
weightbus.testing.llama.VllmStyleLlamaForCausalLM (SGLang's Llama fuses q/k/v and gate/up the
same way). Not thread-safe.
"""
import importlib
import io
import pickle
from dataclasses import dataclass, field
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from .llama import read_safetensors

# ---- managers/io_struct.py ----


@dataclass
class UpdateWeightFromDiskReqInput:
    model_path: str = ""
    load_format: Optional[str] = None
    abort_all_requests: bool = False
    weight_version: Optional[str] = None


@dataclass
class UpdateWeightsFromTensorReqInput:
    serialized_named_tensors: List[Any] = field(default_factory=list)
    load_format: Optional[str] = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: Optional[str] = None


# ---- utils: MultiprocessingSerializer, dynamic_import ----


class MultiprocessingSerializer:
    """SGLang's serializer of named tensors between processes (ForkingPickler: torch's
    multiprocessing reductions)."""

    @staticmethod
    def serialize(obj: Any) -> bytes:
        buf = io.BytesIO()
        ForkingPickler(buf).dump(obj)
        return buf.getvalue()

    @staticmethod
    def deserialize(data: bytes) -> Any:
        return pickle.loads(data)


def dynamic_import(func_path: str):
    """utils.dynamic_import: "package.module.function" -> the function."""
    module_path, _, name = func_path.rpartition(".")
    return getattr(importlib.import_module(module_path), name)


@dataclass
class ServerArgs:
    """The server_args the update paths read (server_args.py)."""
    model_path: str = ""
    tp_size: int = 1
    load_format: Optional[str] = None
    custom_weight_loader: List[str] = field(default_factory=list)  # --custom-weight-loader
    device: str = "cpu"


# ---- model_executor/model_runner.py ----


def _weights_from_directory(model_path: str) -> Iterator[Tuple[str, torch.Tensor]]:
    """DefaultModelLoader._get_weights_iterator for a local directory of safetensors files:
    *.safetensors, only those named in model.safetensors.index.json when it exists. Raises
    before yielding when the directory has none (as _prepare_weights does)."""
    folder = Path(model_path)
    files = sorted(folder.glob("*.safetensors"))
    index = folder / "model.safetensors.index.json"
    if index.exists():
        import json
        wanted = set(json.loads(index.read_text())["weight_map"].values())
        files = [f for f in files if f.name in wanted]
    if not files:
        raise RuntimeError(f"Cannot find any model weights with `{model_path}`")

    def iterate():
        for f in files:
            yield from read_safetensors(f).items()
    return iterate()


def _load_weights_and_postprocess(model, weights) -> None:
    """DefaultModelLoader.load_weights_and_postprocess: load_weights, then every module's
    quant_method.process_weights_after_loading."""
    model.load_weights(weights)
    for _, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(module)


class ModelRunner:
    def __init__(self, model: torch.nn.Module, tp_rank: int, server_args: ServerArgs):
        self.model = model
        self.tp_rank = tp_rank
        self.tp_size = server_args.tp_size
        self.server_args = server_args
        self.device = server_args.device
        self.model_path = server_args.model_path  # model_config.model_path

    def update_weights_from_disk(self, model_path: str, load_format: Optional[str],
                                 weight_name_filter=None,
                                 recapture_cuda_graph: bool = False) -> Tuple[bool, str]:
        self.model_path = model_path
        try:
            weights = _weights_from_directory(model_path)
        except Exception as e:
            return False, f"Failed to get weights iterator: {e}."
        if weight_name_filter is not None:
            weights = ((n, w) for n, w in weights if weight_name_filter(n))
        try:
            _load_weights_and_postprocess(self.model, weights)
        except Exception as e:
            # SGLang rolls back by loading model_config.model_path again (already the new path).
            message = f"Failed to update weights: {e}.\nRolling back to original weights."
            _load_weights_and_postprocess(self.model, _weights_from_directory(model_path))
            return False, message
        self.server_args.model_path = model_path
        self.server_args.load_format = load_format
        return True, "Succeeded to update model weights."

    def update_weights_from_tensor(self, named_tensors, load_format: Optional[str] = None):
        named_tensors = [(name, tensor.to(self.device)) for name, tensor in named_tensors]
        if load_format in self.server_args.custom_weight_loader:
            custom_loader = dynamic_import(load_format)
            custom_loader(self.model, named_tensors)
        elif load_format is None:
            self.model.load_weights(named_tensors)
        else:
            raise NotImplementedError(f"Unknown load_format={load_format}")
        return True, "Success"


# ---- managers/tp_worker.py, scheduler_update_weights_mixin.py ----


class TpModelWorker:
    def __init__(self, model_runner: ModelRunner):
        self.model_runner = model_runner
        self.tp_rank = model_runner.tp_rank

    def update_weights_from_disk(self, recv_req: UpdateWeightFromDiskReqInput):
        return self.model_runner.update_weights_from_disk(recv_req.model_path,
                                                          recv_req.load_format)

    def update_weights_from_tensor(self, recv_req: UpdateWeightsFromTensorReqInput):
        return self.model_runner.update_weights_from_tensor(
            named_tensors=MultiprocessingSerializer.deserialize(
                recv_req.serialized_named_tensors[self.tp_rank]),
            load_format=recv_req.load_format)


@dataclass
class UpdateWeightFromDiskReqOutput:
    success: bool
    message: str
    num_paused_requests: int = 0


@dataclass
class UpdateWeightsFromTensorReqOutput:
    success: bool
    message: str


class Scheduler:
    def __init__(self, tp_worker: TpModelWorker):
        self.tp_worker = tp_worker
        self.cache_flushes = 0  # flush_cache calls: the radix (prefix) cache reset

    def flush_cache(self) -> bool:
        self.cache_flushes += 1
        return True

    def update_weights_from_disk(self, recv_req: UpdateWeightFromDiskReqInput):
        success, message = self.tp_worker.update_weights_from_disk(recv_req)
        if success:
            assert self.flush_cache(), "Cache flush failed after updating weights"
        return UpdateWeightFromDiskReqOutput(success, message, 0)

    def update_weights_from_tensor(self, recv_req: UpdateWeightsFromTensorReqInput):
        success, message = self.tp_worker.update_weights_from_tensor(recv_req)
        if success and recv_req.flush_cache:
            assert self.flush_cache(), "Cache flush failed after updating weights"
        return UpdateWeightsFromTensorReqOutput(success, message)


# ---- managers/tokenizer_manager.py, entrypoints/engine.py ----


class TokenizerManager:
    def __init__(self, schedulers: Sequence[Scheduler], server_args: ServerArgs):
        self.schedulers = list(schedulers)
        self.server_args = server_args
        self.model_path = server_args.model_path
        self.weight_version: Optional[str] = None

    def update_weights_from_disk(self, obj: UpdateWeightFromDiskReqInput):
        results = [s.update_weights_from_disk(obj) for s in self.schedulers]
        success = all(r.success for r in results)
        message = results[0].message if len({r.message for r in results}) == 1 else \
            " | ".join(r.message for r in results)
        if success:
            self.model_path = self.server_args.model_path = obj.model_path
            if obj.weight_version is not None:
                self.weight_version = obj.weight_version
                message += f" Weight version updated to {obj.weight_version}."
        return success, message, results[0].num_paused_requests

    def update_weights_from_tensor(self, obj: UpdateWeightsFromTensorReqInput):
        results = [s.update_weights_from_tensor(obj) for s in self.schedulers]
        success = all(r.success for r in results)
        if success and obj.weight_version is not None:
            self.weight_version = obj.weight_version
        return success, results[0].message


class Engine:
    """sglang.Engine's weight-update calls over one in-process scheduler per TP rank; `models`
    are the TP ranks' models, in rank order."""

    def __init__(self, models: Sequence[torch.nn.Module], server_args: ServerArgs):
        server_args.tp_size = len(models)
        self.server_args = server_args
        self.schedulers = [Scheduler(TpModelWorker(ModelRunner(m, rank, server_args)))
                           for rank, m in enumerate(models)]
        self.tokenizer_manager = TokenizerManager(self.schedulers, server_args)

    def update_weights_from_tensor(self, named_tensors: List[Tuple[str, torch.Tensor]],
                                   load_format: Optional[str] = None, flush_cache: bool = True):
        serialized_named_tensors = [MultiprocessingSerializer.serialize(named_tensors)
                                    for _ in range(self.server_args.tp_size)]
        obj = UpdateWeightsFromTensorReqInput(serialized_named_tensors=serialized_named_tensors,
                                              load_format=load_format, flush_cache=flush_cache)
        return self.tokenizer_manager.update_weights_from_tensor(obj)

    def update_weights_from_disk(self, model_path: str, load_format: Optional[str] = None):
        obj = UpdateWeightFromDiskReqInput(model_path=model_path, load_format=load_format)
        return self.tokenizer_manager.update_weights_from_disk(obj)

    def http_update_weights_from_disk(self, body: Dict[str, Any]):
        """POST /update_weights_from_disk (http_server.py): the JSON body is an
        UpdateWeightFromDiskReqInput, weight_version included."""
        return self.tokenizer_manager.update_weights_from_disk(
            UpdateWeightFromDiskReqInput(**body))
