#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Peak resident memory of publishing a model produced tensor by tensor, Publisher.publish of
the gathered list against a streaming publish (Publisher.begin_publish), each in a fresh
process (issue 13, BENCHMARKS.md).

    LIBWEIGHTBUS_PATH=build/lib/libweightbus.so PYTHONPATH=bindings/python \
        /usr/bin/python3 bench/stream_peak_rss.py --model-mib 512 --tensor-mib 8 --dir /tmp/x

A generator yields `model / tensor` float32 tensors of `tensor-mib` each (fresh memory per
tensor, as a gather does). "publish" collects them (what `list(iterator)` does) and publishes
the dict; "stream" adds each to a PublishStream and drops it. Peak = VmHWM after the publish
minus VmRSS before the first tensor (the peak is reset there through /proc/self/clear_refs),
so the interpreter, torch and the Publisher are not counted. The last line is OK when the
subscriber received both versions bit-exact.
"""
import argparse
import json
import os
import subprocess
import sys

CHILD = r"""
import json, sys, torch, weightbus
mode, uri, model_mib, tensor_mib, bucket = sys.argv[1:6]
model_mib, tensor_mib = int(model_mib), int(tensor_mib)
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
def produce():
    for i in range(model_mib // tensor_mib):
        g = torch.Generator().manual_seed(i)
        yield f"layers.{i}.weight", torch.randn(tensor_mib * 262144, generator=g)
pub = weightbus.Publisher(uri, stream_bucket=bucket)
torch.randn(16)  # torch's lazy initialisation before the baseline
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # resets VmHWM to the current RSS
base = status("VmRSS")
if mode == "publish":
    stats = pub.publish(1, dict(produce()), timeout=600)
else:
    with pub.begin_publish(1) as stream:
        for name, tensor in produce():
            stream.add(name, tensor)
            del tensor
        stats = stream.commit(timeout=600)
print(json.dumps({"mode": mode, "baseline": base, "peak": status("VmHWM"),
                  "bytes": stats.bytes}))
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-mib", type=int, default=512)
    ap.add_argument("--tensor-mib", type=int, default=8)
    ap.add_argument("--bucket", default="64MiB", help="the stream_bucket setting")
    ap.add_argument("--dir", required=True, help="directory for the disk:// channel")
    ap.add_argument("--stack", default="disk", choices=["disk", "delta+disk"],
                    help="delta+disk: the layer reads a read-only mapping of the spool file")
    args = ap.parse_args()
    # Each mode publishes version 1 of its own channel (a layer's first version, a keyframe).
    uri = f"{args.stack}://{args.dir}/{{mode}}?fsync=false"
    print(f"# streaming publish peak RSS: model {args.model_mib} MiB in "
          f"{args.model_mib // args.tensor_mib} tensors of {args.tensor_mib} MiB, "
          f"stream_bucket={args.bucket}, {uri}")
    print(f"# {'mode':>8} {'model_MiB':>10} {'peak_above_baseline_MiB':>24} {'ratio':>7}")
    for mode in ("publish", "stream"):
        # A fixed mmap threshold: each freed tensor goes back to the system at once, instead of
        # glibc's dynamic threshold keeping some of the producer's freed tensors in its heap
        # (which made the streamed figure vary by tens of MiB between identical runs).
        env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="1048576")
        out = subprocess.run([sys.executable, "-c", CHILD, mode, uri.format(mode=mode),
                              str(args.model_mib), str(args.tensor_mib), args.bucket],
                             check=True, capture_output=True, text=True, env=env).stdout
        r = json.loads(out.strip().splitlines()[-1])
        peak = (r["peak"] - r["baseline"]) / 2**20
        print(f"  {mode:>8} {r['bytes'] / 2**20:>10.0f} {peak:>24.1f} "
              f"{peak / (r['bytes'] / 2**20):>7.3f}")
    check = subprocess.run([sys.executable, "-c", r"""
import sys, torch, weightbus
model_mib, tensor_mib = int(sys.argv[2]), int(sys.argv[3])
for mode in ("publish", "stream"):
    with weightbus.Subscriber(sys.argv[1].format(mode=mode)) as sub:
        u = sub.receive(1, timeout=120)
        for i in range(model_mib // tensor_mib):
            g = torch.Generator().manual_seed(i)
            assert torch.equal(u[f"layers.{i}.weight"], torch.randn(tensor_mib * 262144, generator=g))
print("OK")
""", uri.split("?")[0], str(args.model_mib), str(args.tensor_mib)],
        capture_output=True, text=True)
    print(check.stdout.strip() or f"FAILED {check.stderr[-500:]}")
    return 0 if check.stdout.strip() == "OK" else 1


if __name__ == "__main__":
    sys.exit(main())
