# SPDX-License-Identifier: Apache-2.0
"""weightbus.Shard.from_dtensor with torch's own DTensor: two real processes on a gloo process
group over loopback (a file:// rendezvous) distribute tensors on a 1-D CPU DeviceMesh as FSDP2
does (Shard(0), uneven and with an empty last shard), as a Megatron-style column slice
(Shard(1)) and replicated, publish their local tensors as a publisher group with the Shards
from_dtensor gives, and a subscriber receives every tensor whole, bit for bit.

Skipped where torch has no DTensor (torch.distributed.tensor, torch >= 2.4, or
torch.distributed._tensor, 2.0-2.3): Debian's python3-torch 1.13 has neither."""
import ast
import subprocess
import sys

import pytest
import torch

import weightbus
from conftest import child_env


def _has_dtensor() -> bool:
    for module in ("torch.distributed.tensor", "torch.distributed._tensor"):
        try:
            __import__(module)
            return True
        except ImportError:
            continue
    return False


pytestmark = pytest.mark.skipif(
    not _has_dtensor() or not torch.distributed.is_available() or
    not torch.distributed.is_gloo_available(),
    reason=f"torch {torch.__version__} has no DTensor (torch.distributed.tensor or "
           f"torch.distributed._tensor) with gloo; Debian's python3-torch 1.13 predates it")

FULL = r'''
import torch
def full():
    g = torch.Generator().manual_seed(11)
    return {"w": torch.randn(6, 4, generator=g),       # Shard(0): rows 0-2 | 3-5
            "uneven": torch.randn(5, 3, generator=g),  # Shard(0): rows 0-2 | 3-4
            "empty": torch.randn(1, 4, generator=g),   # Shard(0): row 0 | nothing
            "cols": torch.randn(3, 5, generator=g),    # Shard(1): columns 0-2 | 3-4
            "norm": torch.randn(7, generator=g)}       # Replicate()
'''

RANK = FULL + r'''
import sys
import torch.distributed as dist
import weightbus
try:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
except ImportError:
    from torch.distributed._tensor import Replicate, Shard, distribute_tensor
from torch.distributed.device_mesh import DeviceMesh

uri, init, rank = sys.argv[1], sys.argv[2], int(sys.argv[3])
dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
mesh = DeviceMesh("cpu", [0, 1])
layouts = {"w": [Shard(0)], "uneven": [Shard(0)], "empty": [Shard(0)], "cols": [Shard(1)],
           "norm": [Replicate()]}
tensors = {name: distribute_tensor(t, mesh, layouts[name]) for name, t in full().items()}
local = {name: t.to_local().contiguous() for name, t in tensors.items()}
shards = {name: weightbus.Shard.from_dtensor(t) for name, t in tensors.items()}
with weightbus.Publisher(uri, rank=rank, world_size=2) as pub:
    pub.publish(1, local, shards=shards, timeout=60)
print(repr({name: (s.global_shape, s.offsets, tuple(local[name].shape))
            for name, s in shards.items()}))
dist.barrier()
dist.destroy_process_group()
'''


def test_dtensor_shards_published_by_a_group_arrive_whole(tmp_path):
    channel = f"disk://{tmp_path}/channel?fsync=false"
    init = f"file://{tmp_path}/rendezvous"
    children = [subprocess.Popen([sys.executable, "-c", RANK, channel, init, str(rank)],
                                 env=child_env(), stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True) for rank in range(2)]
    outputs = []
    for child in children:
        out, err = child.communicate(timeout=120)
        assert child.returncode == 0, err
        outputs.append(ast.literal_eval(out.strip().splitlines()[-1]))
    # The mapping: global shape, offsets and local shape of each rank's piece.
    assert outputs[0] == {"w": ((6, 4), (0, 0), (3, 4)), "uneven": ((5, 3), (0, 0), (3, 3)),
                          "empty": ((1, 4), (0, 0), (1, 4)), "cols": ((3, 5), (0, 0), (3, 3)),
                          "norm": ((7,), (0,), (7,))}
    assert outputs[1] == {"w": ((6, 4), (3, 0), (3, 4)), "uneven": ((5, 3), (3, 0), (2, 3)),
                          "empty": ((1, 4), (1, 0), (0, 4)), "cols": ((3, 5), (0, 3), (3, 2)),
                          "norm": ((7,), (0,), (7,))}
    scope = {}
    exec(FULL, scope)
    want = scope["full"]()
    update = weightbus.Subscriber(channel).receive(1, timeout=60)
    assert sorted(update.keys()) == sorted(want)
    for name, tensor in update:
        assert torch.equal(tensor, want[name]), name
    assert sorted({t["owner"] for t in update.manifest["tensors"]}) == [0, 1]
