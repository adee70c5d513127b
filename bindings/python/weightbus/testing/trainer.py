# SPDX-License-Identifier: Apache-2.0
"""A stand-in for vLLM's trainer-side weight-transfer API, written from vllm-project/vllm's
vllm/distributed/weight_transfer/base.py and factory.py (WeightSource, ModuleSource,
TrainerInitInfo with its `backend` ClassVar, TrainerWeightTransferEngine with the
`trainer_init(init_info, *, client, source)` classmethod and `send_weights()`,
VLLMWeightSyncClient, WeightTransferTrainerFactory dispatching on `init_info.backend`), so that
weightbus.vllm's trainer engine runs over the same classes without vLLM installed. Only what
the trainer side uses; weightbus.vllm imports vLLM's own classes when vLLM is there.

StandInWeightSyncClient is the VLLMWeightSyncClient of a weightbus.testing.worker.StandInLLM:
the four control-plane calls go to its workers, as vLLM's clients route them to an LLM.
"""
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Dict, Iterator, List, Optional, Tuple

import torch

from .worker import WeightTransferEngineFactory


def materialize_full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's full_tensor() (a collective all-gather); other tensors as they are."""
    full_tensor = getattr(tensor, "full_tensor", None)
    return full_tensor() if callable(full_tensor) else tensor


@dataclass(frozen=True)
class ParamMeta:
    name: str
    dtype: torch.dtype
    shape: Tuple[int, ...]


class WeightSource(ABC):
    """Re-iterable (name, tensor) pairs, materialized one at a time; `iter()` is a fresh pass
    each round, and every trainer rank iterates it in lockstep."""

    @abstractmethod
    def metadata(self) -> List[ParamMeta]:
        raise NotImplementedError

    @abstractmethod
    def __iter__(self) -> Iterator[Tuple[str, torch.Tensor]]:
        raise NotImplementedError


class ModuleSource(WeightSource):
    """A WeightSource over module.named_parameters(), gathering DTensors one at a time."""

    def __init__(self, module: torch.nn.Module) -> None:
        self._module = module

    def metadata(self) -> List[ParamMeta]:
        return [ParamMeta(n, p.dtype, tuple(p.shape)) for n, p in self._module.named_parameters()]

    def __iter__(self) -> Iterator[Tuple[str, torch.Tensor]]:
        for name, param in self._module.named_parameters():
            yield name, materialize_full_tensor(param)


@dataclass
class TrainerInitInfo:
    """Which trainer rank this is (keyword-only; rank 0 is the sender). Every concrete subclass
    sets the class-level `backend`, the WeightTransferTrainerFactory key."""

    backend: ClassVar[str]
    rank: int = field(kw_only=True)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if not getattr(cls, "backend", None):
            raise TypeError(f"{cls.__name__} must set a class-level `backend` string "
                            "(the WeightTransferTrainerFactory registry key).")

    @property
    def is_sender(self) -> bool:
        return self.rank == 0


class TrainerWeightTransferEngine(ABC):
    """Trainer-side engine: built by the trainer_init classmethod on every trainer rank, then
    send_weights() each round (start_weight_update, update_weights, finish_weight_update)."""

    init_info_cls: type

    def __init__(self, *, client: Any, source: Optional[WeightSource] = None,
                 is_sender: bool = True) -> None:
        self.is_sender = is_sender
        self.client = client
        self.source = source

    @classmethod
    @abstractmethod
    def trainer_init(cls, init_info: Any, *, client: Any,
                     source: Optional[WeightSource] = None) -> "TrainerWeightTransferEngine":
        raise NotImplementedError

    @abstractmethod
    def send_weights(self) -> None:
        raise NotImplementedError

    def shutdown(self) -> None:
        """Default no-op."""


class WeightTransferTrainerFactory:
    """Registry of trainer engines by backend name; trainer_init dispatches on
    type(init_info).backend."""

    _registry: Dict[str, Callable[[], type]] = {}

    # The same conventions as WeightTransferEngineFactory.register_engine (vLLM's factory.py
    # says so too), on this class's own registry.
    register_engine = classmethod(WeightTransferEngineFactory.register_engine.__func__)

    @classmethod
    def trainer_init(cls, init_info: TrainerInitInfo, *, client: Any,
                     source: Optional[WeightSource] = None) -> TrainerWeightTransferEngine:
        backend = type(init_info).backend
        if backend not in cls._registry:
            raise ValueError(f"Invalid weight transfer backend: {backend}. "
                             f"Available trainer engines: {list(cls._registry)}")
        return cls._registry[backend]().trainer_init(init_info, client=client, source=source)


class StandInWeightSyncClient:
    """VLLMWeightSyncClient over a StandInLLM: the four calls, plain dicts, synchronous. Records
    the calls in order (`calls`) for tests."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm
        self.calls: List[Tuple[str, Any]] = []

    def init_weight_transfer_engine(self, init_info: Dict[str, Any]) -> None:
        self.calls.append(("init_weight_transfer_engine", init_info))
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        self.calls.append(("start_weight_update", None))
        self.llm.start_weight_update()

    def update_weights(self, update_info: Dict[str, Any]) -> None:
        self.calls.append(("update_weights", update_info))
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: Optional[str] = None) -> None:
        self.calls.append(("finish_weight_update", weight_version))
        self.llm.finish_weight_update(weight_version=weight_version)
