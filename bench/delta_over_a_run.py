#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The delta layer over a run (issue 16, BENCHMARKS.md): the late-joiner catch-up time after a
full chain (a 0.5 MB model) and after a keyframe and 99 deltas (a 64 MiB bf16 model), the first
version of a restarted publisher, the time to repair one corrupted delta, the time a late joiner stopped by a delta
damaged at rest after the publisher's check (or by a missing version of the chain) takes to be
caught up through a keyframe request (over disk, and over ucx for a delta damaged in the
publisher's staging memory), and one host with 2 replicas of a 256 MiB model of which
14% of the elements change per version, delta+disk against plain disk.

    PYTHONPATH=bindings/python /usr/bin/python3 bench/delta_over_a_run.py [--dir /tmp/wb-run]
        [--only ucx-repair|late-joiner|restart]

Models are uint16 arrays (bf16 bit patterns) of random values of which a fraction moves by one
unit per version. Times are wall times of this process (publisher and subscribers in threads,
as replicas in one host share its cores); the kind of each version is read from its record.
"""
import argparse
import glob
import json
import os
import shutil
import threading
import time

import numpy as np
import weightbus

rng = np.random.default_rng(1)


def stream(nbytes, fraction, versions):
    w = rng.integers(0, 1 << 16, nbytes // 2, dtype=np.uint16)
    for _ in range(versions):
        yield w
        w = w.copy()
        w[rng.integers(0, w.size, int(w.size * fraction))] += 1


def fresh(path):
    shutil.rmtree(path, ignore_errors=True)
    return path


def kind(channel, v):
    """The record's kind and reason of version v of a delta+disk channel ("plain disk" else)."""
    path = f"{channel}/versions/v{v:020d}/weightbus.manifest.json"
    metadata = json.load(open(path))["metadata"]
    if "weightbus.delta" not in metadata:
        return "plain disk"
    record = json.loads(metadata["weightbus.delta"])
    return f"{record['kind']}: {record.get('reason', '')[:100]}"


def late_joiner(work):
    channel = fresh(f"{work}/late")
    uri = f"delta+disk://{channel}?fsync=false"
    with weightbus.Publisher(uri) as pub:
        for v, w in enumerate(stream(520064, 0.01, 1000), 1):
            pub.publish(v, {"w": w})
        start = time.perf_counter()
        with weightbus.Subscriber(uri) as sub:
            u = sub.wait(min_version=1000, timeout=60)
            took = time.perf_counter() - start
    print(f"late joiner after a keyframe and 999 deltas of a 0.5 MB model (1% changed per "
          f"version): {took * 1000:.0f} ms to version {u.version}")


def bf16_stream(nbytes, fraction, versions):
    """As stream(), but the weights are bf16 values of N(0, 0.02) (what a model holds), published
    as torch bf16 tensors, each changed element moving by one unit in the last place."""
    import torch
    w = torch.from_numpy(rng.standard_normal(nbytes // 2).astype(np.float32) * 0.02)
    bits = w.to(torch.bfloat16).view(torch.int16).numpy().copy()
    for _ in range(versions):
        yield torch.from_numpy(bits.copy()).view(torch.bfloat16)
        bits[rng.integers(0, bits.size, int(bits.size * fraction))] += 1


def late_joiner_large(work, nbytes=64 << 20, deltas=99):
    """A late joiner of a large bf16 model: the time a new subscriber takes to hold a keyframe
    alone (the channel's first version: one keyframe transfer, read and decoded), and to hold the
    newest version after a keyframe and `deltas` deltas (1% of the elements changed per
    version), which it replays; the replay is bounded by delta_max_chain (1000 by default)."""
    channel = fresh(f"{work}/late-large")
    uri = f"delta+disk://{channel}?fsync=false&delta_send_plain=false"
    versions = bf16_stream(nbytes, 0.01, deltas + 1)
    with weightbus.Publisher(uri) as pub:
        pub.publish(1, {"w": next(versions)})
        start = time.perf_counter()
        with weightbus.Subscriber(uri) as sub:
            sub.wait(min_version=1, timeout=600)
            keyframe = time.perf_counter() - start
        for v, w in enumerate(versions, 2):
            pub.publish(v, {"w": w})
        start = time.perf_counter()
        with weightbus.Subscriber(uri) as sub:
            u = sub.wait(min_version=deltas + 1, timeout=600)
            took = time.perf_counter() - start
            how = u.stats.encoding
    per_delta = (took - keyframe) / deltas
    print(f"late joiner, {nbytes / 1e6:.1f} MB bf16 model (1% changed per version): a keyframe alone "
          f"{keyframe * 1000:.0f} ms; keyframe + {deltas} deltas to version {u.version} "
          f"{took * 1000:.0f} ms ({per_delta * 1000:.1f} ms per delta replayed{'; ' + how if how else ''}); "
          f"bound with delta_max_chain=1000: {(keyframe + 1000 * per_delta):.1f} s")


def restart(work, nbytes=64 << 20):
    """A restarted publisher (a trainer resumed from its checkpoint) continues the channel's
    chain: its first version is a delta against the channel's newest version, which it reads back
    and checks against the channel's checksums first. The time of that first publish against a
    publish of the running publisher, and what a subscriber that held the newest version does."""
    channel = fresh(f"{work}/restart")
    uri = f"delta+disk://{channel}?fsync=false&delta_send_plain=false"
    versions = stream(nbytes, 0.01, 5)
    with weightbus.Subscriber(uri) as sub:
        with weightbus.Publisher(uri) as pub:
            for v in (1, 2, 3):
                start = time.perf_counter()
                pub.publish(v, {"w": next(versions)})
                running = time.perf_counter() - start
                sub.wait(min_version=v, timeout=120)
        with weightbus.Publisher(uri) as pub:  # the restarted trainer
            start = time.perf_counter()
            pub.publish(4, {"w": next(versions)})
            resumed = time.perf_counter() - start
            u = sub.wait(min_version=4, timeout=120)
            held = u.stats.encoding
    print(f"restarted publisher, {nbytes / 1e6:.1f} MB model: version 4 ({kind(channel, 4)[:90]}) "
          f"published in {resumed * 1000:.0f} ms (reading back and checking version 3 included) "
          f"against {running * 1000:.0f} ms for version 3 by the running publisher; the subscriber "
          f"holding 3 received {u.version}{' as ' + held if held else ''}")


def repair(work):
    channel = fresh(f"{work}/repair")
    uri = f"delta+disk://{channel}?fsync=false"
    versions = stream(64 << 20, 0.01, 4)
    with weightbus.Publisher(uri) as pub, weightbus.Subscriber(uri) as sub:
        for v in (1, 2):
            pub.publish(v, {"w": next(versions)})
            sub.wait(min_version=v, timeout=60)
        pub.publish(3, {"w": next(versions)})
        data = glob.glob(f"{channel}/versions/*3/model.safetensors")[0]
        with open(data, "r+b") as f:  # one bit at rest
            f.seek(-10, 2)
            b = f.read(1)
            f.seek(-10, 2)
            f.write(bytes([b[0] ^ 4]))
        try:
            sub.wait(min_version=3, timeout=5)
            raise SystemExit("FAILED: the corrupt version 3 was applied")
        except weightbus.DataLossError:
            pass
        held = sub.current_version
        start = time.perf_counter()
        pub.publish(4, {"w": next(versions)})
        u = sub.wait(min_version=4, timeout=60)
        took = time.perf_counter() - start
    print(f"repair of one corrupted delta (64 MiB model, 1% changed): version 3 (a delta) refused,"
          f" the subscriber kept version {held}; version 4 ({kind(channel, 4)[:70]}...) held "
          f"{took * 1000:.0f} ms after its publish began")


def repair_on_request(work, nbytes, damage):
    """A late joiner stopped by version 3 (damaged at rest after version 4 was published on it,
    or its directory gone) asks for a keyframe; the time from the next publish's start until it
    holds that version."""
    channel = fresh(f"{work}/request-{damage}")
    # Always encoded: a version sent plainly needs no base, and the chain would not break.
    uri = f"delta+disk://{channel}?fsync=false&delta_send_plain=false"
    versions = stream(nbytes, 0.01, 6)
    with weightbus.Publisher(uri) as pub:
        for v in (1, 2, 3, 4):
            pub.publish(v, {"w": next(versions)})
        vdir = glob.glob(f"{channel}/versions/*3")[0]
        if damage == "bit":
            with open(f"{vdir}/model.safetensors", "r+b") as f:
                f.seek(-10, 2)
                b = f.read(1)
                f.seek(-10, 2)
                f.write(bytes([b[0] ^ 4]))
        else:
            shutil.rmtree(vdir)
        with weightbus.Subscriber(uri) as late:
            try:
                late.wait(min_version=4, timeout=2)
                raise SystemExit("FAILED: the late joiner applied a broken chain")
            except (weightbus.DataLossError, TimeoutError):
                pass
            requests = glob.glob(f"{channel}/delta-requests/*.json")
            start = time.perf_counter()
            pub.publish(5, {"w": next(versions)})
            u = late.wait(min_version=5, timeout=60)
            took = time.perf_counter() - start
    left = glob.glob(f"{channel}/delta-requests/*.json")
    print(f"late joiner stopped by version 3 ({'one bit flipped at rest' if damage == 'bit' else 'its directory removed'}), "
          f"{nbytes / 1e6:.1f} MB model: {len(requests)} request(s) left; version 5 "
          f"({kind(channel, 5)[:60]}...) held {took * 1000:.0f} ms after its publish began "
          f"(version {u.version}; {len(left)} request(s) left after)")


def free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def repair_over_ucx(nbytes, tls):
    """delta+ucx: version 3, a delta, damaged in the publisher's staging memory after it was
    staged and checksummed (fail point ucx.damage_staged); the subscriber holding version 2
    fails on it, keeps 2 and asks for a keyframe over the control connection; the time from the
    next publish's start until it holds that version."""
    os.environ["UCX_TLS"] = "posix,sysv,cma,self" if tls == "shm" else "tcp"
    if tls == "tcp":
        os.environ["UCX_NET_DEVICES"] = "lo"
    uri = f"delta+ucx://127.0.0.1:{free_port()}/policy"
    versions = stream(nbytes, 0.01, 5)
    os.environ["WEIGHTBUS_FAILPOINTS"] = "ucx.damage_staged=error@3"
    try:
        pub = weightbus.Publisher(uri + "?delta_send_plain=false")
    finally:
        del os.environ["WEIGHTBUS_FAILPOINTS"]
    with pub, weightbus.Subscriber(uri) as held:
        for v in (1, 2):
            pub.publish(v, {"w": next(versions)})
            held.wait(min_version=v, timeout=60)
        pub.publish(3, {"w": next(versions)})
        try:
            held.wait(min_version=3, timeout=60)
            raise SystemExit("FAILED: the subscriber applied a damaged delta")
        except weightbus.DataLossError:
            pass
        start = time.perf_counter()
        pub.publish(4, {"w": next(versions)})
        encoding = pub.last_stats.encoding
        u = held.wait(min_version=3, timeout=60)
        took = time.perf_counter() - start
    os.environ.pop("UCX_TLS")
    os.environ.pop("UCX_NET_DEVICES", None)
    print(f"delta+ucx ({tls}), {nbytes / 1e6:.1f} MB model, version 3 damaged in staging memory: "
          f"the subscriber holding 2 asked; version {u.version} ({encoding[:70]}...) held "
          f"{took * 1000:.0f} ms after its publish began")


def one_host(uri, channel, versions=6):
    subs = [weightbus.Subscriber(uri) for _ in range(2)]
    times = []
    with weightbus.Publisher(uri) as pub:
        for v, w in enumerate(stream(256 << 20, 0.14, versions), 1):
            start = time.perf_counter()
            pub.publish(v, {"w": w})
            done = []

            def receive(s):
                s.wait(min_version=v, timeout=120)
                done.append(time.perf_counter() - start)

            threads = [threading.Thread(target=receive, args=(s,)) for s in subs]
            [t.start() for t in threads]
            [t.join() for t in threads]
            times.append(max(done))
            print(f"  {uri.split('?')[0]:40s} version {v}: {max(done) * 1000:5.0f} ms to the "
                  f"last replica; {kind(channel, v)}")
    for s in subs:
        s.close()
    return sorted(times)[len(times) // 2], times


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", default="/tmp/wb-delta-over-a-run")
    parser.add_argument("--only", choices=("all", "ucx-repair", "late-joiner", "restart"),
                        default="all",
                        help="ucx-repair: only the keyframe-on-request figures over delta+ucx; "
                        "late-joiner: only the late joiners; restart: only the restarted publisher")
    args = parser.parse_args()
    work = args.dir
    os.makedirs(work, exist_ok=True)
    if args.only in ("all", "ucx-repair"):
        for nbytes in (520064, 64 << 20):
            for tls in ("shm", "tcp"):
                repair_over_ucx(nbytes, tls)
    if args.only in ("all", "late-joiner"):
        late_joiner(work)
        late_joiner_large(work)
    if args.only in ("all", "restart"):
        restart(work)
    if args.only != "all":
        return
    repair(work)
    for nbytes in (520064, 64 << 20):
        for damage in ("bit", "missing"):
            repair_on_request(work, nbytes, damage)
    print("one host, 2 replicas, 256 MiB, 14% of the elements changed per version:")
    results = {}
    for name, query in (("disk", None), ("delta+disk", ""),
                        ("delta+disk, delta_send_plain=false", "&delta_send_plain=false")):
        channel = fresh(f"{work}/{name.split(',')[0]}")
        uri = (f"disk://{channel}?fsync=false" if query is None
               else f"delta+disk://{channel}?fsync=false{query}")
        results[name] = one_host(uri, channel)
    for name, (median, times) in results.items():
        print(f"  {name:36s} median {median * 1000:5.0f} ms to the last replica, all versions "
              f"{' '.join(f'{t * 1000:.0f}' for t in times)} ms")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
