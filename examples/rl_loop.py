#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The whole job: policy-gradient RL on a real Llama with replicas that generate with the newest
published weights.

A trainer process converts the llama2.c checkpoint stories260K.bin (weightbus convert-llama2c),
loads it as a Hugging Face-layout PyTorch Llama with fp32 master weights, and runs GRPO-style
REINFORCE steps (group-normalized advantages, no KL term) on a programmatic reward: the fraction
of generated tokens equal to a target token. After every step it publishes the policy, cast to
bf16, over disk:// (the default transport). Two replica processes each hold a vLLM-shaped Llama
(fused qkv_proj / gate_up_proj, weightbus.testing.llama) inside a stand-in vLLM worker with
weightbus.vllm.WeightbusWorkerExtension: between rollouts they pull the newest version
(weightbus_update), generate completions by sampling, and report which version produced each
rollout. Rollouts may be up to --max-lag versions behind the trainer (one-step off-policy by
default, so generation overlaps training).

Per step it prints the trainer's stall (how long publish blocked), the time from the start of
each publish until each replica had the version applied (loaded, post-processed), the version
lag of the rollouts the step trained on, and the reward; at the end it checks that every
version each replica applied was bit-exact (sha256 of the bf16 tensors it holds, un-fused, equal
to the trainer's) and prints the reward curve. Exit status 0 only if all versions matched.

    /usr/bin/python3 examples/rl_loop.py               # 40 steps, a couple of minutes on 2 cores
"""
import argparse
import hashlib
import json
import multiprocessing as mp
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bindings" / "python"))

import torch  # noqa: E402

import weightbus  # noqa: E402
from weightbus.testing.llama import (HfLlamaForCausalLM, LlamaConfig,  # noqa: E402
                                     VllmStyleLlamaForCausalLM, load_hf_checkpoint)
from weightbus.testing.worker import make_worker  # noqa: E402
from weightbus.vllm import WeightbusWorkerExtension, process_weights_after_loading  # noqa: E402


def digest(tensors):
    """sha256 over the bf16 bytes of (name, tensor) pairs, in name order."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].to(torch.bfloat16).contiguous().view(torch.int16).numpy()
                 .tobytes())
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------
# Replica process
# ---------------------------------------------------------------------------------------------

def replica_main(index, uri, config_dict, requests, results):
    """Serves rollout requests: pull the newest version (at least the one asked for), generate,
    report. A request with step None only applies (the final version)."""
    try:
        torch.set_num_threads(1)
        config = LlamaConfig.from_json(config_dict)
        worker = make_worker(VllmStyleLlamaForCausalLM(config), WeightbusWorkerExtension)
        worker.weightbus_init(uri)
        results.put({"type": "ready", "replica": index})
        while True:
            request = requests.get()
            if request is None:
                break
            before = worker.weightbus_version()
            version = worker.weightbus_update(min_version=request["min_version"], timeout=300)
            if version != before:
                last = worker.weightbus_last_update()
                results.put({"type": "applied", "replica": index, "version": version,
                             "applied_unix": last["applied_unix"], "receive_s": last["receive_s"],
                             "load_s": last["load_s"],
                             "digest": digest(worker.model_runner.model.hf_state_dict())})
            if request["step"] is None:
                continue
            generator = torch.Generator().manual_seed(request["seed"])
            prompts = request["prompts"].repeat_interleave(request["group_size"], dim=0)
            start = time.perf_counter()
            completions = worker.model_runner.model.generate(prompts, request["new_tokens"],
                                                             temperature=1.0,
                                                             generator=generator)
            results.put({"type": "rollout", "replica": index, "step": request["step"],
                         "version": version, "prompts": prompts, "completions": completions,
                         "generate_s": time.perf_counter() - start})
        worker.weightbus_close()
    except BaseException:
        results.put({"type": "error", "replica": index, "error": traceback.format_exc()})
        raise


# ---------------------------------------------------------------------------------------------
# Trainer
# ---------------------------------------------------------------------------------------------

def find_cli(explicit):
    for candidate in (explicit, os.environ.get("WB_TEST_CLI"), REPO / "build" / "tools" /
                      "weightbus", shutil.which("weightbus")):
        if candidate and Path(candidate).exists():
            return str(candidate)
    sys.exit("rl_loop: cannot find the weightbus CLI; build it (scripts/setup.sh) or pass --cli")


def policy_loss(model, prompts, completions, advantages):
    """-mean over completion tokens of advantage * log pi(token | prefix)."""
    ids = torch.cat([prompts, completions], dim=1)
    logits = model(ids[:, :-1]).float()
    logp = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None])[..., 0]
    logp = logp[:, prompts.shape[1] - 1:]  # the generated tokens only
    return -(advantages[:, None] * logp).mean()


class Table:
    """Prints one row per training step once every figure of it is known."""

    HEADER = ("# step  version  stall_ms  replica0_ms  replica1_ms  rollout_versions  lag  "
              "reward")

    def __init__(self, replicas):
        self.replicas = replicas
        self.rows = {}
        self.applied = {}      # (replica, version) -> applied_unix
        self.highest = {}      # replica -> highest version applied
        self.next_row = 0
        self.printed = []

    def applied_at(self, replica, version):
        """ms from the start of the publish of `version` until `replica` applied it; "skip"
        when the replica went straight to a newer one; None when not known yet."""
        if (replica, version) in self.applied:
            return self.applied[(replica, version)]
        if self.highest.get(replica, 0) > version:
            return "skip"
        return None

    def flush(self, publish_start):
        while self.next_row in self.rows:
            row = self.rows[self.next_row]
            version = row["version"]
            cells = []
            for r in range(self.replicas):
                at = self.applied_at(r, version)
                if at is None:
                    return
                cells.append(at if at == "skip" else (at - publish_start[version]) * 1e3)
            row["replica_ms"] = cells
            text = "  ".join(f"{c:>11}" if c == "skip" else f"{c:11.2f}" for c in cells)
            trained = row["reward"] is not None  # row 0: the initial version, no training
            print(f"{row['step']:>6}  {version:>7}  {row['stall_ms']:8.2f}  {text}  "
                  f"{'/'.join(map(str, row['rollout_versions'])) if trained else '-':>16}  "
                  f"{'/'.join(map(str, row['lags'])) if trained else '-':>3}  "
                  f"{row['reward'] if trained else float('nan'):6.3f}", flush=True)
            self.printed.append(row)
            self.next_row += 1


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--prompts-per-step", type=int, default=4,
                        help="prompts per step, split between the replicas")
    parser.add_argument("--group-size", type=int, default=8, help="completions per prompt")
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--max-lag", type=int, default=1,
                        help="versions a rollout may be behind the trainer (0: on-policy)")
    parser.add_argument("--target-token", default="auto",
                        help="token id the reward favours; auto: the initial policy's most "
                             "frequent sampled token")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint", default=str(
        Path(os.environ.get("WB_TEST_FIXTURES", REPO.parent / "shared" / "fixtures")) /
        "stories260K.bin"))
    parser.add_argument("--channel", help="channel directory (default: a fresh temporary one)")
    parser.add_argument("--cli", help="the weightbus CLI (default: build/tools/weightbus)")
    parser.add_argument("--json", help="write every figure to this file")
    args = parser.parse_args(argv)
    if args.prompts_per_step % args.replicas:
        parser.error("--prompts-per-step must be a multiple of --replicas")

    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    work = Path(tempfile.mkdtemp(prefix="wb_rl_loop_"))
    channel_dir = Path(args.channel) if args.channel else work / "channel"
    uri = f"disk://{channel_dir}"
    procs = []
    try:
        # The policy: stories260K converted by the CLI, fp32 master weights.
        model_dir = work / "model"
        subprocess.run([find_cli(args.cli), "convert-llama2c", args.checkpoint, str(model_dir),
                        "--dtype", "f32"], check=True, capture_output=True)
        config, tensors = load_hf_checkpoint(model_dir)
        policy = HfLlamaForCausalLM(config)
        policy.load_state_dict({k: v.float() for k, v in tensors.items()})
        optimizer = torch.optim.Adam(policy.parameters(), lr=args.lr, betas=(0.9, 0.95))

        # Prompts: BOS + 4 tokens sampled from the initial policy; the target token.
        sampler = VllmStyleLlamaForCausalLM(config)
        sampler.load_weights(list(tensors.items()))
        process_weights_after_loading(sampler)
        generator = torch.Generator().manual_seed(args.seed)
        bos = torch.full((64, 1), config.bos_token_id, dtype=torch.long)
        pool = torch.cat([bos, sampler.generate(bos, 4, 1.0, generator)], dim=1)
        if args.target_token == "auto":
            sample = sampler.generate(pool, args.new_tokens, 1.0, generator).flatten()
            counts = torch.bincount(sample, minlength=config.vocab_size)
            counts[[config.bos_token_id, config.eos_token_id]] = 0
            target = int(counts.argmax())
            share = counts[target].item() / sample.numel()
        else:
            target, share = int(args.target_token), float("nan")
        del sampler

        print(f"# weightbus {weightbus.__version__} rl_loop: stories260K "
              f"({sum(p.numel() for p in policy.parameters())} parameters), {args.replicas} "
              f"replicas, channel {uri}")
        print(f"# GRPO/REINFORCE: {args.steps} steps, {args.prompts_per_step} prompts x "
              f"{args.group_size} completions of {args.new_tokens} tokens per step, lr "
              f"{args.lr}, max lag {args.max_lag}; reward = share of generated tokens equal to "
              f"token {target} (initially {share:.1%})")
        print("# stall: Publish blocked the trainer; replicaN_ms: from the start of the publish "
              "until replica N had the version loaded (skip: it went straight to a newer one);")
        print("# rollout_versions/lag: the versions that generated the step's rollouts and how "
              "far they were behind the trainer's version")

        ctx = mp.get_context("spawn")
        results = ctx.Queue()
        requests = [ctx.Queue() for _ in range(args.replicas)]
        config_dict = dict(config.__dict__)
        for i in range(args.replicas):
            p = ctx.Process(target=replica_main, args=(i, uri, config_dict, requests[i], results),
                            daemon=True)
            p.start()
            procs.append(p)

        publisher = weightbus.Publisher(uri)
        publish_start, published_digest, stalls = {}, {}, {}

        def publish(version, step):
            weights = {k: v.detach().to(torch.bfloat16) for k, v in policy.state_dict().items()}
            published_digest[version] = digest(weights)
            publish_start[version] = time.time()
            t0 = time.perf_counter()
            publisher.publish(version, weights, metadata={"step": str(step)})
            stalls[version] = (time.perf_counter() - t0) * 1e3

        per_replica = args.prompts_per_step // args.replicas

        def send_requests(step):
            if step > args.steps:
                return
            order = torch.randperm(pool.shape[0], generator=torch.Generator().manual_seed(
                args.seed * 100003 + step))[:args.prompts_per_step]
            for i in range(args.replicas):
                requests[i].put({"step": step, "min_version": max(1, step - args.max_lag),
                                 "prompts": pool[order[i * per_replica:(i + 1) * per_replica]],
                                 "group_size": args.group_size, "new_tokens": args.new_tokens,
                                 "seed": args.seed * 1000003 + step * 101 + i})

        table = Table(args.replicas)
        rollouts = {}
        applied_records = []

        def receive(block=True):
            message = results.get(timeout=600) if block else results.get_nowait()
            kind = message["type"]
            if kind == "error":
                raise RuntimeError(f"replica {message['replica']} failed:\n{message['error']}")
            if kind == "applied":
                r, v = message["replica"], message["version"]
                table.applied[(r, v)] = message["applied_unix"]
                table.highest[r] = max(table.highest.get(r, 0), v)
                applied_records.append(message)
            else:
                rollouts.setdefault(message["step"], []).append(message)
            table.flush(publish_start)

        ready = 0
        while ready < args.replicas:  # started, torch imported, subscribed
            message = results.get(timeout=600)
            if message["type"] == "error":
                raise RuntimeError(f"replica {message['replica']} failed:\n{message['error']}")
            ready += message["type"] == "ready"
        publish(1, 0)
        table.rows[0] = {"step": 0, "version": 1, "stall_ms": stalls[1], "rollout_versions": [],
                         "lags": [], "reward": None, "loss": None}
        print(Table.HEADER)
        print("#                    (ms)         (ms)         (ms)")
        for step in range(1, 2 + args.max_lag):
            send_requests(step)

        rewards_per_step = []
        t_start = time.perf_counter()
        for step in range(1, args.steps + 1):
            while len(rollouts.get(step, [])) < args.replicas:
                receive()
            batch = sorted(rollouts.pop(step), key=lambda m: m["replica"])
            prompts = torch.cat([m["prompts"] for m in batch])
            completions = torch.cat([m["completions"] for m in batch])
            rewards = (completions == target).float().mean(dim=1)
            groups = rewards.view(-1, args.group_size)
            advantages = ((groups - groups.mean(1, keepdim=True)) /
                          (groups.std(1, keepdim=True) + 1e-3)).flatten()
            loss = policy_loss(policy, prompts, completions, advantages)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            publish(step + 1, step)
            send_requests(step + 1 + args.max_lag)
            versions = [m["version"] for m in batch]
            rewards_per_step.append(rewards.mean().item())
            table.rows[step] = {"step": step, "version": step + 1, "stall_ms": stalls[step + 1],
                                "rollout_versions": versions,
                                "lags": [step - v for v in versions],
                                "reward": rewards_per_step[-1], "loss": loss.item()}
            while True:  # drain what has arrived, without waiting
                try:
                    receive(block=False)
                except queue.Empty:
                    break

        # Every replica applies the final version too (no rollout), then stops.
        for i in range(args.replicas):
            requests[i].put({"step": None, "min_version": args.steps + 1})
            requests[i].put(None)
        while table.next_row <= args.steps:
            receive()
        table.flush(publish_start)
        elapsed = time.perf_counter() - t_start
        for p in procs:
            p.join(timeout=120)
        publisher.close()

        checked = [(m["replica"], m["version"], m["digest"] == published_digest[m["version"]])
                   for m in applied_records]
        mismatched = [(r, v) for r, v, ok in checked if not ok]
        k = max(1, min(5, args.steps // 4))
        first = sum(rewards_per_step[:k]) / k
        last = sum(rewards_per_step[-k:]) / k
        stall_list = sorted(stalls.values())
        apply_ms = sorted(c for row in table.printed for c in row["replica_ms"] if c != "skip")
        median = lambda xs: xs[len(xs) // 2] if xs else float("nan")  # noqa: E731
        print(f"# {args.steps} steps in {elapsed:.1f} s; stall median {median(stall_list):.2f} "
              f"ms, max {stall_list[-1]:.2f} ms; replica apply median {median(apply_ms):.2f} "
              f"ms, max {apply_ms[-1] if apply_ms else float('nan'):.2f} ms")
        print(f"# reward: {first:.3f} (mean of steps 1-{k}) -> {last:.3f} (mean of steps "
              f"{args.steps - k + 1}-{args.steps})")
        status = "OK" if not mismatched else "FAILED"
        print(f"# {status}: {len(checked) - len(mismatched)}/{len(checked)} replica versions "
              f"bit-exact" + (f"; mismatched (replica, version): {mismatched}"
                              if mismatched else ""))
        if args.json:
            Path(args.json).write_text(json.dumps({
                "target_token": target, "steps": table.printed, "rewards": rewards_per_step,
                "applied": [{k2: v for k2, v in m.items() if k2 != "type"}
                            for m in applied_records],
                "published_digest": published_digest, "bit_exact": not mismatched,
                "reward_first": first, "reward_last": last, "elapsed_s": elapsed,
                "max_lag": args.max_lag}, indent=1))
        return 0 if not mismatched else 1
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
