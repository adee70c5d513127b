# SPDX-License-Identifier: Apache-2.0
"""Publisher and subscriber in separate processes (fresh interpreters), both directions."""
import json
import subprocess
import sys

import numpy as np
import torch

import weightbus
from conftest import child_env, run_python

# Deterministic tensors of version v, recomputed independently on each side.
TENSORS = r'''
import torch
def tensors(v):
    g = torch.Generator().manual_seed(v)
    return {"model.embed_tokens.weight": torch.randn(64, 32, generator=g).to(torch.bfloat16),
            "model.norm.weight": torch.rand(32, generator=g),
            "mask": torch.rand(7, generator=g) > 0.5}
'''

PUBLISHER = TENSORS + r'''
import sys, weightbus
uri, last = sys.argv[1], int(sys.argv[2])
with weightbus.Publisher(uri) as pub:
    for v in range(1, last + 1):
        pub.publish(v, tensors(v), metadata={"step": str(v)})
print("published", last)
'''


def test_subscriber_receives_from_a_publisher_process(channel):
    exec(TENSORS, namespace := {})
    tensors = namespace["tensors"]
    # Bind into preallocated tensors, as a replica binds its parameters.
    dest = {name: torch.empty_like(t) for name, t in tensors(1).items()}
    sub = weightbus.Subscriber(channel)
    sub.bind(dest)
    child = subprocess.Popen([sys.executable, "-c", PUBLISHER, channel, "4"], env=child_env(),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen = []
    try:
        while not seen or seen[-1] < 4:
            update = sub.wait(len(seen) and seen[-1] + 1, timeout=120)
            seen.append(update.version)
            assert update.metadata == {"step": str(update.version)}
            for name, want in tensors(update.version).items():
                assert torch.equal(dest[name], want), (update.version, name)
                assert update[name] is dest[name]
    finally:
        out, err = child.communicate(timeout=120)
    assert child.returncode == 0, err
    assert seen == sorted(set(seen)) and seen[-1] == 4  # increasing, may skip versions


SUBSCRIBER = r'''
import hashlib, json, sys
import weightbus                                  # numpy only: torch must stay optional
uri = sys.argv[1]
with weightbus.Subscriber(uri) as sub:
    update = sub.wait(1, timeout=120)
    out = {"version": update.version, "dtypes": update.dtypes,
           "sha256": {n: hashlib.sha256(a.tobytes()).hexdigest() for n, a in update.arrays()},
           "bf16_bits_dtype": str(update.numpy("model.embed_tokens.weight").dtype),
           "torch_imported": "torch" in sys.modules}
print(json.dumps(out))
'''


def test_publisher_reaches_a_subscriber_process_without_torch(channel):
    import hashlib
    exec(TENSORS, namespace := {})
    tensors = namespace["tensors"](1)
    with weightbus.Publisher(channel) as pub:
        pub.publish(1, tensors)
    child = run_python(SUBSCRIBER, channel)
    assert child.returncode == 0, child.stderr
    result = json.loads(child.stdout)
    assert result["version"] == 1 and result["torch_imported"] is False
    assert result["dtypes"] == {"model.embed_tokens.weight": "BF16", "model.norm.weight": "F32",
                                "mask": "BOOL"}
    assert result["bf16_bits_dtype"] == "uint16"
    for name, t in tensors.items():
        raw = t.view(torch.int16).numpy() if t.dtype == torch.bfloat16 else t.numpy()
        assert result["sha256"][name] == hashlib.sha256(raw.tobytes()).hexdigest(), name


def test_numpy_only_publisher_process(channel):
    code = r'''
import sys, numpy as np, weightbus
with weightbus.Publisher(sys.argv[1]) as pub:
    pub.publish(3, {"a": np.arange(10, dtype=np.float64).reshape(2, 5)[:, ::2],
                    "bits": np.array([0x3F80, 0x4040], dtype=np.uint16)},
                dtypes={"bits": "BF16"})
assert "torch" not in sys.modules
'''
    child = run_python(code, channel)
    assert child.returncode == 0, child.stderr
    with weightbus.Subscriber(channel) as sub:
        update = sub.wait(3, timeout=60)
        assert np.array_equal(update.numpy("a"), np.arange(10.0).reshape(2, 5)[:, ::2])
        assert update["bits"].tolist() == [1.0, 3.0]


# One rank of a publisher group: rows of "w" on dimension 0 (an FSDP2 shard, contiguous),
# columns of "v" on dimension 1 (a Megatron column slice: a strided torch view), "b" replicated.
GROUP_RANK = TENSORS + r'''
import sys, torch, weightbus
uri, rank, world = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
g = torch.Generator().manual_seed(7)
w, v, b = torch.randn(8, 6, generator=g), torch.randn(4, 8, generator=g), torch.rand(5, generator=g)
rows, cols = 8 // world, 8 // world
with weightbus.Publisher(uri, rank=rank, world_size=world, poll_interval="5ms") as pub:
    pub.publish(1, {"w": w[rank * rows:(rank + 1) * rows], "v": v[:, rank * cols:(rank + 1) * cols],
                    "b": b},
                shards={"w": ((8, 6), (rank * rows, 0)), "v": ((4, 8), (0, rank * cols))},
                timeout=60)
print("published 1")
'''


def test_publisher_group_processes_and_a_whole_model_subscriber(channel):
    world = 2
    children = [subprocess.Popen([sys.executable, "-c", GROUP_RANK, channel, str(r), str(world)],
                                 env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True) for r in range(world)]
    for child in children:
        out, err = child.communicate(timeout=120)
        assert child.returncode == 0, err
    g = torch.Generator().manual_seed(7)
    want = {"w": torch.randn(8, 6, generator=g), "v": torch.randn(4, 8, generator=g),
            "b": torch.rand(5, generator=g)}
    update = weightbus.Subscriber(channel).receive(1, timeout=60)
    assert sorted(name for name, _ in update) == ["b", "v", "w"]
    for name, tensor in update:
        assert torch.equal(tensor, want[name]), name
        assert update.tensor_info(name).shard is None  # handed over whole
    owners = sorted({t["owner"] for t in update.manifest["tensors"]})
    assert update.manifest["format"] == "weightbus.manifest/2" and owners == [0, 1]
