#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Where the CPU went while each version was in flight: a `perf record -a` of a weightbus-bench
run, cut into the bench's version windows and attributed to processes and activities.

    perf record -a -e cpu-clock -k CLOCK_REALTIME -F 4000 -o P.data -- \
        build/bench/weightbus-bench run --transports ucx ... --json R.json
    python3 bench/cpu_by_activity.py --freq 4000 --perf P.data --json R.json

A version's window runs from the start of its Publish to the moment its last replica held it
(`publish_start_unix_ns` + the largest `ready_s`, from R.json; perf must record with
CLOCK_REALTIME so that its timestamps compare with them). Every sample in a window is counted
for the process that took it (the transport's publisher, its subscribers, anything else) and for
an activity read from the sampled symbol (see ACTIVITIES). The event must be cpu-clock (a timer:
it samples every core at F per second, idle or not; a hardware cycles event stops while a core
halts): a sample stands for 1/F s of one core. A sample of the idle task (pid 0) counts as idle
only in an idle function; elsewhere it is the kernel working on the idle task's time (interrupts,
softirq: loopback tcp is mostly received there), counted as process "kernel (softirq)". `busy`
is the non-idle samples' CPU time over cores x window: the share of all the host's cores that
did work over the window; near 100% means the CPU was the saturated resource for that
version.

Output: per transport, the median over its measured versions of each (process, activity) in
CPU-milliseconds, the median window, and the busy share. Standard library only.
"""

import argparse
import collections
import json
import os
import re
import statistics
import subprocess
import sys

# (activity, pattern on the symbol, pattern on the object) — the first that matches wins.
ACTIVITIES = [
    ("idle", r"^(pv_native_safe_halt|default_idle|cpu_idle|intel_idle|acpi_idle|poll_idle|"
             r"mwait_idle|native_safe_halt|do_idle|cpuidle_enter_state|cpuidle_enter|acpi_safe_halt|"
             r"arch_cpu_idle|cpu_startup_entry)", None),
    ("bench check", None, r"libxxhash"),  # the bench's own XXH3 of what a replica received
    ("checksum", r"xxh3|XXH3|TensorHasher", None),
    ("copy", r"memmove|memcpy|StageWithChecksum|StreamCopy|CopyWithChecksum|PackStrided", None),
    ("kernel copy", r"copy_to_iter|copy_from_iter|copy_page_to_iter|copy_user|process_vm|"
                    r"follow_page|get_user_pages|pin_user|unpin_user|gup_|try_grab|"
                    r"shmem_file_read|filemap", None),
    ("tcp stack", r"^(tcp_|__tcp|ip_|__ip|skb|__skb|sock_|__sock|net_rx|__netif|loopback|"
                  r"__dev_queue|dev_hard|inet_)", None),
    ("page faults", r"page_fault|clear_page|do_anonymous|handle_mm_fault|__handle_mm|"
                    r"memset|folio|alloc_pages|lru", None),
    ("ucx", None, r"libuc[pts]|ucx/"),
]
COMPILED = [(a, re.compile(s) if s else None, re.compile(o) if o else None)
            for a, s, o in ACTIVITIES]
LINE = re.compile(r"^\s*(\d+)/(\d+)\s+([\d.]+):\s+(?:\S+\s+)?(.*?)\s+\((.*)\)\s*$")


def activity(symbol, dso):
    for name, sym, obj in COMPILED:
        if sym is not None and sym.search(symbol):
            return name
        if obj is not None and obj.search(dso):
            return name
    return "other"


def samples(perf_data, perf):
    """Yields (pid, tid, unix seconds, symbol, object) for each sample of perf_data."""
    proc = subprocess.Popen([perf, "script", "-i", perf_data, "-F", "pid,tid,time,ip,sym,dso"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            errors="replace")
    for line in proc.stdout:
        m = LINE.match(line)
        if m:
            yield int(m[1]), int(m[2]), float(m[3]), m[4], m[5]
    if proc.wait() != 0:
        raise SystemExit(f"{perf} script -i {perf_data} failed (exit {proc.returncode})")


def windows(run):
    """Per transport: its processes {pid: role} and [(version, start s, end s)] measured."""
    out = []
    for t in run["transports"]:
        roles = {p["pid"]: p["role"] for p in t.get("processes", []) if p.get("pid", 0) > 0}
        spans = []
        for v in t["versions"]:
            ready = [r["ready_s"] for r in v.get("replicas", []) if r.get("ok")]
            if not v.get("measured") or not v.get("published") or not ready:
                continue
            start = v["publish_start_unix_ns"] / 1e9
            spans.append((v["version"], start, start + max(ready)))
        out.append((t["name"], roles, spans))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--perf", required=True, help="perf.data recorded with -a -k CLOCK_REALTIME")
    ap.add_argument("--json", required=True, help="the bench run's --json")
    ap.add_argument("--freq", type=float, default=4000, help="perf record -F (samples/s/core)")
    ap.add_argument("--cores", type=int, default=os.cpu_count())
    ap.add_argument("--perf-binary", default="perf")
    args = ap.parse_args()

    with open(args.json) as f:
        run = json.load(f)
    plan = windows(run)
    # (transport index, version) -> Counter[(process, activity)] of samples
    counts = collections.defaultdict(collections.Counter)
    spans = [(ti, v, a, b) for ti, (_, _, s) in enumerate(plan) for v, a, b in s]
    spans.sort(key=lambda x: x[2])
    for pid, tid, at, sym, dso in samples(args.perf, args.perf_binary):
        for ti, v, a, b in spans:  # few versions: a linear scan is enough
            if a <= at < b:
                roles = plan[ti][1]
                act = activity(sym, dso)
                if pid == 0:
                    who = "idle" if act == "idle" else "kernel (softirq)"
                else:
                    who = roles.get(pid, "other processes")
                counts[(ti, v)][(who, act)] += 1
                break

    ms = 1e3 / args.freq  # CPU milliseconds per sample
    for ti, (name, roles, vs) in enumerate(plan):
        if not vs:
            continue
        keys = sorted({k for v, _, _ in vs for k in counts[(ti, v)]})
        walls = [(b - a) * 1e3 for _, a, b in vs]
        busy = []
        for v, a, b in vs:
            worked = sum(n for (who, _), n in counts[(ti, v)].items() if who != "idle")
            busy.append(100.0 * worked * ms / (args.cores * (b - a) * 1e3))
        print(f"# {name}: {len(vs)} measured versions, median window "
              f"{statistics.median(walls):.1f} ms on {args.cores} cores "
              f"({args.cores * statistics.median(walls):.1f} core-ms); "
              f"busy (not idle) median {statistics.median(busy):.0f}% "
              f"(per version: {', '.join(f'{x:.0f}%' for x in busy)})")
        print(f"#   {'process':<18} {'activity':<14} {'cpu ms':>8}   (median over versions)")
        by_process = collections.defaultdict(float)
        for who, act in keys:
            if who == "idle":
                continue
            med = statistics.median(counts[(ti, v)][(who, act)] for v, _, _ in vs) * ms
            by_process[who] += med
            if med >= 0.5:
                print(f"#   {who:<18} {act:<14} {med:8.1f}")
        idle = statistics.median(counts[(ti, v)][("idle", "idle")] for v, _, _ in vs) * ms
        for who, total in sorted(by_process.items()):
            print(f"#   {who:<18} {'(all)':<14} {total:8.1f}")
        print(f"#   {'idle':<18} {'':<14} {idle:8.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
