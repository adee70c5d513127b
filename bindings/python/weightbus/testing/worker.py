# SPDX-License-Identifier: Apache-2.0
"""A stand-in for a vLLM worker, to run worker extensions without vLLM.

vLLM (vllm/worker/worker_base.py, WorkerWrapperBase.init_worker) adds the class named by
`worker_extension_cls` to the bases of its worker class, and LLM.collective_rpc(method, args,
kwargs) calls `method` on every worker and returns the results as a list. Extensions reach the
model as `self.model_runner.model` and use `self.model_config` and `self.device`.
"""
import types
from typing import Any, Dict, List, Optional, Sequence

import torch


class StandInWorker:
    """The attributes of vLLM's GPU worker that worker extensions use."""

    def __init__(self, model: torch.nn.Module, device: Optional[torch.device] = None):
        self.model_runner = types.SimpleNamespace(model=model)
        self.model_config = None
        self.device = device or torch.device("cpu")


def make_worker(model: torch.nn.Module, extension_cls: type) -> Any:
    """A worker whose class has `extension_cls` among its bases, as vLLM builds it."""
    worker_cls = type("Worker", (StandInWorker, extension_cls), {})
    return worker_cls(model)


def collective_rpc(workers: Sequence[Any], method: str, args: Sequence[Any] = (),
                   kwargs: Optional[Dict[str, Any]] = None) -> List[Any]:
    """LLM.collective_rpc: `method` on every worker, results in worker order."""
    return [getattr(w, method)(*args, **(kwargs or {})) for w in workers]
