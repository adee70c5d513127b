#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Publish time and extra peak memory of strided (transposed) views against contiguous copies of
the same bytes over disk:// (issue 10, item 10). Baseline in the same run: the contiguous
publish. Extra memory: the kernel's peak resident set size (VmHWM, reset through
/proc/self/clear_refs) above the resident size at the start of one publish.

    PYTHONPATH=bindings/python /usr/bin/python3 bench/strided_publish.py [--dir /dev/shm] [--reps 7]
"""
import argparse
import statistics
import tempfile
import time

import torch
import weightbus


def status_bytes(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return -1


def extra_peak(fn):
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = status_bytes("VmRSS")
    fn()
    return status_bytes("VmHWM") - before


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="/dev/shm")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--tensors", type=int, default=4)
    ap.add_argument("--side", type=int, default=4096, help="each tensor is side x side F32")
    args = ap.parse_args()
    d = tempfile.mkdtemp(dir=args.dir)
    pub = weightbus.Publisher(f"disk://{d}/ch", fsync=False, retention=1)
    src = [torch.randn(args.side, args.side) for _ in range(args.tensors)]
    strided = {f"w{i}": t.t() for i, t in enumerate(src)}  # transposed views: non-contiguous
    contiguous = {k: v.contiguous() for k, v in strided.items()}
    total = sum(t.numel() * 4 for t in src)
    rss_start = status_bytes("VmRSS")
    version = 0
    times = {"contiguous": [], "strided": []}
    peaks = {"contiguous": [], "strided": []}
    for _ in range(args.reps):
        for kind, tensors in (("contiguous", contiguous), ("strided", strided)):
            version += 1

            def publish():
                start = time.perf_counter()
                pub.publish(version, tensors)
                times[kind].append(time.perf_counter() - start)

            peaks[kind].append(extra_peak(publish))
    rss_end = status_bytes("VmRSS")
    print(f"# {args.tensors} x {args.side}x{args.side} F32 = {total / 2**20:.0f} MiB per version, "
          f"disk:// on {args.dir}, fsync=false, median of {args.reps - 2} after 2 warm-up")
    base = statistics.median(times["contiguous"][2:])
    for kind in ("contiguous", "strided"):
        t = statistics.median(times[kind][2:])
        peak = statistics.median(peaks[kind][2:])
        print(f"{kind:11s} publish {t:.3f} s  ({total / t / 1e9:.2f} GB/s, {t / base:.2f}x contiguous)"
              f"  extra peak memory {peak / 2**20:.1f} MiB")
    print(f"resident after the run minus before it: {(rss_end - rss_start) / 2**20:.1f} MiB "
          "(memory that stayed allocated)")


if __name__ == "__main__":
    main()
