#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""verl: a weightbus checkpoint engine, the hook a verl user writes to sync weights from the
trainer to the rollout workers over a weightbus channel instead of NCCL.

verl (verl/checkpoint_engine/base.py) transfers weights through a CheckpointEngine registered
with CheckpointEngineRegistry.register(backend): prepare() before each step, the classmethod
build_topology(trainer_world_size, rollout_world_size, metadata) -> (trainer kwargs, rollout
kwargs) for init_process_group(**kwargs), `async send_weights(weights)` on the trainer (a
generator of (name, tensor)), `async receive_weights()` on the rollout side (yields (name,
tensor)), finalize() after each step, and a bucket_size property. Here the channel is the
rendezvous, so prepare returns no metadata and the topology only numbers the ranks; trainer
rank 0 publishes one version per send_weights, the other trainer ranks only drain their
generator (as verl's own engines do), and each rollout worker receives the newest version.

send_weights publishes the whole model as one version, so the generator's tensors are all
alive at once (weightbus commits a version all or nothing); bucket_size is reported to verl but
does not bound that.

Run without verl: `/usr/bin/python3 examples/verl_checkpoint_engine.py` drives one trainer and
two rollout workers in one process over disk:// and checks every tensor bit for bit. With verl
installed the class derives from verl's CheckpointEngine and registers as "weightbus".
"""
import asyncio
import sys
import tempfile
from pathlib import Path
from typing import Any, AsyncIterator, Dict, Iterator, Optional, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bindings" / "python"))
import torch  # noqa: E402

import weightbus  # noqa: E402

try:
    from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry
except ImportError:  # verl is not installed: the same methods, without its base class
    CheckpointEngine, CheckpointEngineRegistry = object, None


class WeightbusCheckpointEngine(CheckpointEngine):
    """One instance per verl worker. `uri`: the channel (e.g. "disk:///mnt/shared/policy" or
    "ucx://trainer-0:7000/policy"); `options`: Publisher/Subscriber settings; `role`: "trainer"
    or "rollout"."""

    def __init__(self, uri: str, role: str, options: Optional[Dict[str, Any]] = None,
                 bucket_size: int = 512 << 20):
        self.uri, self.role, self.options = uri, role, dict(options or {})
        self._bucket_size = bucket_size
        self.rank: Optional[int] = None
        self._publisher: Optional[weightbus.Publisher] = None
        self._subscriber: Optional[weightbus.Subscriber] = None
        self.version = 0  # the last version published or received

    def prepare(self) -> Dict[str, Any]:
        return {}  # no rendezvous metadata: the channel is the meeting point

    @classmethod
    def build_topology(cls, trainer_world_size: int, rollout_world_size: int, metadata):
        return ({"rank": list(range(trainer_world_size))},
                {"rank": list(range(rollout_world_size))})

    def init_process_group(self, rank: int, **kwargs) -> None:
        self.rank = rank
        if self.role == "trainer" and rank == 0 and self._publisher is None:
            self._publisher = weightbus.Publisher(self.uri, **self.options)
            self.version = self._publisher.latest_version or 0
        elif self.role == "rollout" and self._subscriber is None:
            self._subscriber = weightbus.Subscriber(self.uri, **self.options)

    @property
    def bucket_size(self) -> int:
        return self._bucket_size

    async def send_weights(self, weights: Iterator[Tuple[str, torch.Tensor]]) -> None:
        if self._publisher is None:  # trainer ranks other than 0
            for _ in weights:
                pass
            return
        tensors = {name: tensor.detach() for name, tensor in weights}
        self.version += 1
        await asyncio.to_thread(self._publisher.publish, self.version, tensors)

    async def receive_weights(self) -> AsyncIterator[Tuple[str, torch.Tensor]]:
        update = await asyncio.to_thread(self._subscriber.wait, self.version + 1, 600)
        self.version = update.version
        for name, tensor in update:  # zero-copy views; valid while referenced
            yield name, tensor

    def finalize(self) -> None:
        pass  # the channel stays open between steps

    def close(self) -> None:
        for handle in (self._publisher, self._subscriber):
            if handle is not None:
                handle.close()


if CheckpointEngineRegistry is not None:
    CheckpointEngineRegistry.register("weightbus")(WeightbusCheckpointEngine)


async def _demo(uri: str) -> int:
    torch.manual_seed(0)
    policy = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    trainers = [WeightbusCheckpointEngine(uri, "trainer") for _ in range(2)]
    rollouts = [WeightbusCheckpointEngine(uri, "rollout") for _ in range(2)]
    trainer_kw, rollout_kw = WeightbusCheckpointEngine.build_topology(
        2, 2, [e.prepare() for e in trainers + rollouts])
    for i, engine in enumerate(trainers):
        engine.init_process_group(rank=trainer_kw["rank"][i])
    for i, engine in enumerate(rollouts):
        engine.init_process_group(rank=rollout_kw["rank"][i])
    for step in range(1, 4):
        with torch.no_grad():
            for p in policy.parameters():
                p.add_(0.01 * step)
        await asyncio.gather(*(e.send_weights(policy.named_parameters()) for e in trainers))
        want = {n: p.detach().clone() for n, p in policy.named_parameters()}
        for engine in rollouts:
            got = {name: tensor async for name, tensor in engine.receive_weights()}
            assert got.keys() == want.keys() and engine.version == step
            assert all(torch.equal(got[n], want[n]) for n in want), f"step {step}"
        for engine in trainers + rollouts:
            engine.finalize()
    for engine in trainers + rollouts:
        engine.close()
    print("verl_checkpoint_engine: 3 steps, 2 rollout workers, every tensor bit-exact: OK")
    return 0


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as d:
        sys.exit(asyncio.run(_demo(f"disk://{d}/policy?fsync=false")))
