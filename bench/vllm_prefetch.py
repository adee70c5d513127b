#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Update RPC time of weightbus.vllm's native engine with prefetch (the version received in the
background while the engine generates; the round only applies it) against a full receive
inside the round (issue 13, item 9), on the stand-in GPU worker (weightbus.testing.worker) with
a vLLM-style BF16 Llama (weightbus.testing.llama) on the CPU, over disk://.

Each rep publishes a new version; "full" rounds run on an engine without prefetch, "prefetch"
rounds on one with it, after its background receive has ended (prefetched_versions), as it
has between rollouts when generation lasts longer than a receive. The round is
weightbus.vllm.sync_weights (start, update_weights, finish: what the caller of vLLM's weight
sync waits for); receive and apply are the engine's own figures (last_update: receive_s, and
load_s = load_weights + the post-load processing). Medians over the reps; every round checks
the model holds the published bytes.

    PYTHONPATH=bindings/python /usr/bin/python3 bench/vllm_prefetch.py [--dir /dev/shm] \\
        [--reps 5] [--hidden 1024] [--layers 2] [--vocab 16000]
"""
import argparse
import shutil
import statistics
import tempfile
import time

import torch
import weightbus
import weightbus.vllm
from weightbus.testing.llama import HfLlamaForCausalLM, LlamaConfig, VllmStyleLlamaForCausalLM
from weightbus.testing.worker import (StandInGpuWorker, StandInLLM, WeightTransferConfig,
                                      make_vllm_config)


def make_version(config, seed):
    torch.manual_seed(seed)
    model = HfLlamaForCausalLM(config)
    return {k: v.detach().to(torch.bfloat16).clone() for k, v in model.state_dict().items()}


def holds(model, tensors):
    state = model.hf_state_dict()
    return all(torch.equal(state[k].to(v.dtype), v) for k, v in tensors.items())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="/dev/shm")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=16000)
    args = ap.parse_args()
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                         intermediate_size=args.hidden * 11 // 4,
                         num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                         num_key_value_heads=args.hidden // 64)
    versions = [make_version(config, seed) for seed in range(2)]
    size = sum(t.numel() * t.element_size() for t in versions[0].values())
    weightbus.vllm.register_plugin()
    root = tempfile.mkdtemp(dir=args.dir, prefix="wb-vllm-prefetch-")
    uri = f"disk://{root}/policy?fsync=false&retention=2"
    engines = {}
    for mode in ("full", "prefetch"):
        llm = StandInLLM([StandInGpuWorker(VllmStyleLlamaForCausalLM(config, torch.bfloat16),
                                           make_vllm_config(),
                                           WeightTransferConfig(backend="weightbus"))])
        llm.init_weight_transfer_engine({"init_info": {"uri": uri,
                                                       "prefetch": mode == "prefetch"}})
        engines[mode] = llm
    print(f"# weightbus vLLM prefetch bench (weightbus {weightbus.__version__}, torch "
          f"{torch.__version__})")
    print(f"# model: vLLM-style Llama, hidden {args.hidden}, {args.layers} layers, vocab "
          f"{args.vocab}, BF16, {len(versions[0])} tensors, {size} bytes "
          f"({size / 2**20:.1f} MiB); 1 worker on the CPU")
    print(f"# channel: {uri}; {args.reps} reps after 1 warm-up, medians")
    figures = {mode: {"round": [], "receive": [], "apply": []} for mode in engines}
    wrong = 0
    with weightbus.Publisher(uri) as pub:
        for version in range(1, args.reps + 2):
            tensors = versions[version % 2]
            pub.publish(version, tensors)
            for mode, llm in engines.items():
                if mode == "prefetch":
                    assert weightbus.vllm.prefetched_versions(llm, timeout=120) == [version]
                start = time.perf_counter()
                got = weightbus.vllm.sync_weights(llm, {"version": version, "timeout": 120})
                elapsed = time.perf_counter() - start
                last = llm.collective_rpc(weightbus.vllm.last_update)[0]
                if got != version or not holds(llm.workers[0].model_runner.model, tensors) \
                        or last["prefetched"] != (mode == "prefetch"):
                    wrong += 1
                if version == 1:
                    continue  # warm-up
                figures[mode]["round"].append(elapsed)
                figures[mode]["receive"].append(last["receive_s"])
                figures[mode]["apply"].append(last["load_s"])
    for llm in engines.values():
        llm.collective_rpc("shutdown")
    shutil.rmtree(root)
    med = {mode: {k: statistics.median(v) for k, v in f.items()} for mode, f in figures.items()}
    print("#")
    print("# mode       round      receive    apply      round GB/s  #wrong")
    print("#            (ms)       (ms)       (ms)")
    for mode in engines:
        m = med[mode]
        print(f"  {mode:<9}  {m['round'] * 1e3:9.1f}  {m['receive'] * 1e3:9.1f}  "
              f"{m['apply'] * 1e3:9.1f}  {size / m['round'] / 1e9:10.2f}  {wrong:6d}")
    ratio = med["prefetch"]["round"] / med["full"]["round"]
    print(f"# prefetch round = {ratio:.2f}x the full-receive round "
          f"({med['full']['round'] * 1e3:.1f} -> {med['prefetch']['round'] * 1e3:.1f} ms)")
    ok = wrong == 0 and ratio < 1
    print("# OK" if ok else f"# FAILED: {wrong} wrong rounds; ratio {ratio:.2f}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
