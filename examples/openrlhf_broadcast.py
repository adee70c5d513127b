#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""OpenRLHF: replace the actor's NCCL broadcast to the vLLM engines with a weightbus publish.

OpenRLHF's PPO trainer calls the actor group's broadcast_to_vllm() after each training step
(openrlhf/trainer/ppo_trainer.py, _broadcast_to_vllm); the actor walks model.named_parameters()
(skipping the critic's "value_head", gathering ZeRO-3 shards) and every vLLM engine receives
each tensor. The hook below does that walk once, publishes the parameters as version
`global_step` from rank 0, and then has every engine apply exactly that version with
weightbus.vllm.update_replica (the engines run vLLM with
worker_extension_cls="weightbus.vllm.WeightbusWorkerExtension"; OpenRLHF's engines are Ray
actors, so that call runs inside each engine actor, e.g. a method added to its LLM actor class).
The prefix cache is reset once per engine after the version is in, as OpenRLHF does before its
own broadcast.

With ZeRO-3, gather each parameter (deepspeed.zero.GatheredParameters) before publishing: the
whole model is one version, so all gathered tensors are alive until publish returns.

Run without OpenRLHF, Ray or vLLM: `/usr/bin/python3 examples/openrlhf_broadcast.py` runs three
steps against two stand-in vLLM engines (weightbus.testing.worker), checking every tensor bit
for bit and that the value head never reaches them.
"""
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bindings" / "python"))
import torch  # noqa: E402

import weightbus  # noqa: E402
import weightbus.vllm  # noqa: E402


class WeightbusBroadcast:
    """The actor side: `broadcast_to_vllm(model, global_step, rank)` in place of OpenRLHF's
    NCCL broadcast. `engines`: objects with vLLM's collective_rpc (vllm.LLM in each engine)."""

    def __init__(self, uri: str, engines, **options):
        self.engines = list(engines)
        self.publisher = weightbus.Publisher(uri, **options)
        for engine in self.engines:
            engine.collective_rpc("weightbus_init", args=(uri,))

    def broadcast_to_vllm(self, model: torch.nn.Module, global_step: int, rank: int = 0) -> None:
        if rank == 0:
            tensors = {name: p.detach() for name, p in model.named_parameters()
                       if "value_head" not in name}
            self.publisher.publish(global_step, tensors)
        for engine in self.engines:  # exactly this version on every TP worker; prefix
            weightbus.vllm.update_replica(engine, version=global_step)  # cache reset inside

    def close(self) -> None:
        for engine in self.engines:
            engine.collective_rpc("weightbus_close")
        self.publisher.close()


class _Actor(torch.nn.Module):
    def __init__(self, with_value_head: bool):
        super().__init__()
        self.body = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 4)
        if with_value_head:
            self.value_head = torch.nn.Linear(8, 1)

    def load_weights(self, weights):  # vLLM's load_weights, for the stand-in engines
        self.load_state_dict(dict(weights), strict=True)


def _demo(uri: str) -> int:
    from weightbus.testing.worker import StandInLLM, make_worker
    torch.manual_seed(0)
    actor = _Actor(with_value_head=True)
    engines = [StandInLLM([make_worker(_Actor(with_value_head=False),
                                       weightbus.vllm.WeightbusWorkerExtension)
                           for _ in range(2)]) for _ in range(2)]   # 2 engines x TP 2
    sync = WeightbusBroadcast(uri, engines, retention=2)
    for step in range(1, 4):
        with torch.no_grad():
            for p in actor.parameters():
                p.mul_(0.9).add_(0.01 * step)
        sync.broadcast_to_vllm(actor, step)
        want = {n: p for n, p in actor.named_parameters() if "value_head" not in n}
        for engine in engines:
            for worker in engine.workers:
                held = dict(worker.model_runner.model.named_parameters())
                assert held.keys() == want.keys()
                assert all(torch.equal(held[n], want[n]) for n in want), f"step {step}"
    sync.close()
    assert [e.prefix_cache_resets for e in engines] == [3, 3]
    print("openrlhf_broadcast: 3 steps on 2 engines x 2 workers, bit-exact, no value head: OK")
    return 0


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as d:
        sys.exit(_demo(f"disk://{d}/policy?fsync=false"))
