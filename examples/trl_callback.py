#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""TRL (or any transformers Trainer): publish the policy after every optimizer step with a
TrainerCallback, and let the vLLM replicas pull it with weightbus's worker extension.

transformers calls TrainerCallback.on_step_end(args, state, control, **kwargs) after each
optimizer step, with the model in kwargs["model"] and the step in state.global_step; only the
main process (state.is_world_process_zero) publishes. The replicas run vLLM with
worker_extension_cls="weightbus.vllm.WeightbusWorkerExtension" and, between generations,
weightbus.vllm.update_replica(llm, version=step) (which resets vLLM's prefix cache once per new
version before it returns).
With TRL's GRPOTrainer, leave TRL's own vLLM weight sync off (vllm_mode/colocate settings per
TRL's docs) so the weights reach vLLM one way.

Run without transformers or vLLM: `/usr/bin/python3 examples/trl_callback.py` trains a small
model for a few steps, calling the callback as the Trainer does, and updates two stand-in vLLM
workers (weightbus.testing.worker) after each step; every tensor is checked bit for bit.
"""
import sys
import tempfile
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bindings" / "python"))
import torch  # noqa: E402

import weightbus  # noqa: E402
import weightbus.vllm  # noqa: E402

try:
    from transformers import TrainerCallback
except ImportError:  # transformers is not installed: the same hook, without its base class
    TrainerCallback = object


class WeightbusPublishCallback(TrainerCallback):
    """Publishes model.state_dict() as version state.global_step every `every` steps from the
    main process. `uri` and `options` as for weightbus.Publisher (e.g. retention=3)."""

    def __init__(self, uri: str, every: int = 1, **options):
        self.uri, self.every, self.options = uri, every, options
        self.publisher = None

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if not state.is_world_process_zero or state.global_step % self.every:
            return control
        if self.publisher is None:
            self.publisher = weightbus.Publisher(self.uri, **self.options)
        tensors = {name: t.detach() for name, t in model.state_dict().items()}
        self.publisher.publish(state.global_step, tensors, metadata={"step": str(state.global_step)})
        return control

    def on_train_end(self, args, state, control, **kwargs):
        if self.publisher is not None:
            self.publisher.close()
            self.publisher = None
        return control


class _Replica(torch.nn.Module):
    """The inference side's model: anything with vLLM's load_weights(weights)."""

    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

    def load_weights(self, weights):
        self.load_state_dict(dict(weights), strict=True)


def _demo(uri: str) -> int:
    from weightbus.testing.worker import StandInLLM, make_worker
    torch.manual_seed(0)
    policy = _Replica()
    optimizer = torch.optim.SGD(policy.parameters(), lr=0.1)
    callback = WeightbusPublishCallback(uri, retention=2)
    llm = StandInLLM([make_worker(_Replica(), weightbus.vllm.WeightbusWorkerExtension)
                      for _ in range(2)])
    llm.collective_rpc("weightbus_init", args=(uri,))
    state = types.SimpleNamespace(global_step=0, is_world_process_zero=True)
    x, y = torch.randn(64, 8), torch.randn(64, 1)
    for _ in range(4):
        loss = torch.nn.functional.mse_loss(policy.net(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        state.global_step += 1
        callback.on_step_end(None, state, None, model=policy)
        version = weightbus.vllm.update_replica(llm, version=state.global_step)
        assert version == state.global_step
        for worker in llm.workers:
            held = worker.model_runner.model.state_dict()
            assert all(torch.equal(held[n], t) for n, t in policy.state_dict().items())
    callback.on_train_end(None, state, None)
    llm.collective_rpc("weightbus_close")
    assert llm.prefix_cache_resets == 4
    print("trl_callback: 4 steps published and applied on 2 workers, bit-exact: OK")
    return 0


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as d:
        sys.exit(_demo(f"disk://{d}/policy?fsync=false"))
