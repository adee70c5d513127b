# SPDX-License-Identifier: Apache-2.0
"""torch.save / torch.load of the synthetic Qwen2.5-0.5B-shaped bf16 model: the baseline of what
users do without weightbus.

Builds the state dict once, prints one JSON line {"ready": true, "bytes": N, "torch": version}
(or {"skipped": reason} when python3-torch is missing), then for every line "run" read from
stdin saves and loads once and prints {"save_s": .., "save_fsync_s": .., "load_s": ..}. The
benchmark driver interleaves these runs with its own measurements, so slow phases of shared
storage hit both alike. Run with Debian's interpreter (/usr/bin/python3), which sees python3-torch.
"""
import argparse
import json
import os
import sys
import time


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", required=True)
    p.add_argument("--scale", type=float, default=1.0)
    p.add_argument("--dir", required=True)
    a = p.parse_args()
    try:
        import torch
    except ImportError as e:  # python3-torch missing
        print(json.dumps({"skipped": f"python3-torch not importable: {e}"}), flush=True)
        return 0
    torch.manual_seed(42)
    with open(a.shapes) as f:
        shapes = json.load(f)["tensors"]
    state = {}
    nbytes = 0
    for name, shape in shapes.items():
        shape = list(shape)
        if shape:
            shape[0] = max(1, round(shape[0] * a.scale))
        if name.endswith(".bias"):
            t = torch.zeros(shape, dtype=torch.bfloat16)
        elif "norm" in name:
            t = torch.ones(shape, dtype=torch.bfloat16)
        else:
            t = (torch.randn(shape) * 0.02).to(torch.bfloat16)
        state[name] = t
        nbytes += t.numel() * 2
    print(json.dumps({"ready": True, "bytes": nbytes, "torch": torch.__version__}), flush=True)
    run = 0
    for line in sys.stdin:
        if line.strip() != "run":
            break
        # A new file per run: deleting 1 GiB while timing would disturb shared storage.
        path = os.path.join(a.dir, f"torch_state_{run}.pt")
        run += 1
        t0 = time.perf_counter()
        torch.save(state, path)
        t1 = time.perf_counter()
        with open(path, "rb+") as f:
            os.fsync(f.fileno())
        t2 = time.perf_counter()
        loaded = torch.load(path)
        t3 = time.perf_counter()
        assert len(loaded) == len(state)
        del loaded
        print(json.dumps({"save_s": t1 - t0, "save_fsync_s": t2 - t0, "load_s": t3 - t2}),
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
