# SPDX-License-Identifier: Apache-2.0
"""Baselines of `weightbus-bench run`: what users do without weightbus, on the same bytes.

Rank 0 (started by the bench) loads version 1 of the run's store (STORE/index.json and
STORE/v1.bin: the tensors the transports publish), starts `--readers` reader processes (this
script with --rank), and joins them in a gloo process group on 127.0.0.1. It prints one JSON
line {"ready": true, "torch": version} (or {"skipped": reason} when torch cannot be imported),
then serves commands read from stdin, one JSON line of results each:

  save       rank 0: torch.save of the state dict into DIR + fsync; then every reader
             torch.load()s it. {"stall_s": save+fsync, "ready_s": [per reader, from the start of
             the save until its load returned], "ok": [bytes equal to rank 0's, per reader]}
  broadcast  dist.broadcast of every tensor from rank 0 (gloo, TCP on loopback) into buffers
             the readers allocated beforehand. {"stall_s": rank 0's broadcast loop, "ready_s":
             [...], "ok": [...]}
  quit       stop every rank.

All ranks are on one host, so their wall clocks (time.time()) agree. Run with Debian's
/usr/bin/python3 (python3-torch).
"""
import argparse
import hashlib
import json
import os
import subprocess
import sys
import time


def raw_digest(torch, tensors):
    """Hash of the tensors' bytes (bf16 viewed as int16: numpy has no bfloat16)."""
    h = hashlib.blake2b(digest_size=16)
    for t in tensors:
        if t.dtype == torch.bfloat16:
            t = t.view(torch.int16)
        h.update(t.contiguous().numpy().tobytes())
    return h.hexdigest()


DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "I8": "int8", "U8": "uint8",
          "I16": "int16", "I32": "int32", "I64": "int64", "F64": "float64"}


def die_with_parent():
    """In a reader process before exec: SIGKILL it when rank 0 dies (prctl PR_SET_PDEATHSIG)."""
    import ctypes
    import signal
    ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # 1: PR_SET_PDEATHSIG


def load_store(torch, store, fill):
    with open(os.path.join(store, "index.json")) as f:
        index = json.load(f)
    raw = None
    if fill:
        with open(os.path.join(store, "v1.bin"), "rb") as f:
            raw = bytearray(f.read())
    state = {}
    for t in index["tensors"]:
        dtype = getattr(torch, DTYPES[t["dtype"]])
        if fill:
            flat = torch.frombuffer(raw, dtype=torch.uint8, offset=t["offset"],
                                    count=t["nbytes"]).clone()
            state[t["name"]] = flat.view(dtype).reshape(t["shape"])
        else:
            state[t["name"]] = torch.empty(t["shape"], dtype=dtype)
    return state


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--store", required=True)
    p.add_argument("--dir", required=True)
    p.add_argument("--readers", type=int, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--rank", type=int, default=0)
    a = p.parse_args()
    try:
        import torch
        import torch.distributed as dist
    except ImportError as e:  # python3-torch missing
        if a.rank == 0:
            print(json.dumps({"skipped": f"python3-torch not importable: {e}"}), flush=True)
        return 0
    world = a.readers + 1
    children = []
    if a.rank == 0:
        for r in range(1, world):
            children.append(subprocess.Popen(
                [sys.executable, __file__, "--store", a.store, "--dir", a.dir, "--readers",
                 str(a.readers), "--port", str(a.port), "--rank", str(r)],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, preexec_fn=die_with_parent))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{a.port}", rank=a.rank,
                            world_size=world)
    state = load_store(torch, a.store, fill=a.rank == 0)
    # gloo (torch 1.13) broadcasts float, half, double, int8, uint8, int32 and int64 only: bf16
    # and int16 tensors travel as their bytes (uint8 views of the same storage).
    gloo_types = (torch.float32, torch.float16, torch.float64, torch.int8, torch.uint8,
                  torch.int32, torch.int64)
    wire = [t if t.dtype in gloo_types else t.reshape(-1).view(torch.uint8)
            for t in state.values()]
    mine = raw_digest(torch, list(state.values())) if a.rank == 0 else None
    if a.rank == 0:
        print(json.dumps({"ready": True, "torch": torch.__version__, "world": world}),
              flush=True)
    rep = 0
    while True:
        cmd = [sys.stdin.readline().strip() if a.rank == 0 else None]
        if a.rank == 0 and cmd[0] == "":
            cmd[0] = "quit"
        dist.broadcast_object_list(cmd, src=0)
        what = cmd[0]
        if what not in ("save", "broadcast"):
            break
        rep += 1
        dist.barrier()
        t0 = time.time()
        stall = 0.0
        ok = True
        if what == "save":
            path = os.path.join(a.dir, f"torch-baseline-{rep}.pt")
            if a.rank == 0:
                torch.save(state, path)
                with open(path, "rb+") as f:
                    os.fsync(f.fileno())
                stall = time.time() - t0
            dist.barrier()
            if a.rank != 0:
                loaded = torch.load(path)
                done = time.time()
                ok = list(loaded) == list(state)
                got = raw_digest(torch, list(loaded.values()))
                del loaded
            else:
                done = time.time()
                got = mine
        else:
            for t in wire:
                dist.broadcast(t, src=0)
            done = time.time()
            if a.rank == 0:
                stall = done - t0
                got = mine
            else:
                got = raw_digest(torch, list(state.values()))
        reports = [None] * world
        dist.all_gather_object(reports, {"t0": t0, "done": done, "digest": got, "ok": ok,
                                         "stall": stall})
        if a.rank == 0:
            start = reports[0]["t0"]
            readers = reports[1:]
            print(json.dumps({
                "what": what,
                "stall_s": reports[0]["stall"],
                "ready_s": [r["done"] - start for r in readers],
                "ok": [bool(r["ok"] and r["digest"] == mine) for r in readers],
            }), flush=True)
            if what == "save":
                os.unlink(path)
    dist.destroy_process_group()
    for c in children:
        c.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
