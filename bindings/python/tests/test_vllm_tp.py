# SPDX-License-Identifier: Apache-2.0
"""weightbus.vllm at tensor parallelism 2 and 4: the vLLM-shaped replica of weightbus.testing
(parameters of each rank's shape with vLLM's output_dim / input_dim attributes, QKV head counts,
merged output_sizes and the model's packed_modules_mapping) subscribes with the placements
weightbus.vllm.tensor_parallel_layout derives from that metadata, so each worker receives only
its slices, from a single publisher and from a publisher group of 2 (disk, FSDP2-style row
shards). Checked as a consumer would: a tensor-parallel forward pass on the workers' own
parameters (tensor_parallel_forward: all-reduce and all-gather across the ranks) reproduces the
reference logits within a tolerance measured from float32 reduction-order noise; each rank's
parameters equal, bit for bit, what vLLM's weight loaders make of the whole checkpoint; and each
rank's bytes read (UpdateStats.bytes, through weightbus_last_update) are exactly the checksum
tiles holding its slices. Wrong metadata is caught: gate and up swapped in
packed_modules_mapping by the logits, a removed output_dim or input_dim before any parameter is
written.
MoE: vLLM's FusedMoE (Qwen3-MoE's sparse block) at TP 2 and 4, its experts split inside (tensor
parallel) or dealt whole (expert parallel, linear and round robin, and over data-parallel
ranks), each placement derived from the layer's groups and the model's expert mapping; gate and
up swapped in the mapping, or a placement strategy the layer does not follow, caught by the
logits. A version without some of the model's checkpoint tensors leaves those parameters as
they were, as vLLM's load_weights does."""
import json

import pytest
import torch

import weightbus
import weightbus.vllm
from conftest import publish_as_group, readme_snippet, run_python
from weightbus.testing.llama import (HfLlamaForCausalLM, LlamaConfig, VllmStyleLlamaForCausalLM,
                                     load_hf_checkpoint, tensor_parallel_forward)
from weightbus.testing.worker import (StandInGpuWorker, StandInLLM, WeightTransferConfig,
                                      WeightTransferEngineFactory, collective_rpc,
                                      make_vllm_config, make_worker)
from weightbus.vllm import WeightbusWorkerExtension, tensor_parallel_layout

TOKENS = torch.tensor([[1, 403, 407, 261, 378, 290, 500, 13, 100, 50, 499, 2]])
BLOCK = 4096  # the publishers' checksum_block: slices are read tile by tile (RESHARDING.md)

# Grouped-query attention with fewer KV heads than TP ranks at TP 4 (each KV head replicated on
# two ranks), an untied, sharded lm_head (ParallelLMHead).
GQA = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=8, num_key_value_heads=2)


def _random_version(config, seed):
    torch.manual_seed(seed)
    return {k: v.detach().clone() for k, v in HfLlamaForCausalLM(config).state_dict().items()}


def _publish(channel, version, tensors, publishers):
    """Publishes `tensors` as `version`: one publisher, or a group of `publishers` ranks (in
    threads) each owning its torch.chunk row block (dimension 0) of every tensor, as FSDP2
    shards parameters."""
    if publishers == 1:
        with weightbus.Publisher(channel, checksum_block=f"{BLOCK}B") as pub:
            pub.publish(version, tensors)
        return
    parts, shards = [], []
    for rank in range(publishers):
        parts.append({})
        shards.append({})
        for name, t in tensors.items():
            chunks = torch.chunk(t, publishers, dim=0)
            if rank < len(chunks):
                parts[rank][name] = chunks[rank].contiguous()
                offset = sum(c.shape[0] for c in chunks[:rank])
                shards[rank][name] = weightbus.Shard(tuple(t.shape),
                                                     (offset,) + (0,) * (t.dim() - 1))
    publish_as_group(channel, version, parts, shards, checksum_block=f"{BLOCK}B")


def _loaded_by_vllm(config, tensors, tp_rank, tp_size, dtype=torch.float32, **moe):
    """Rank `tp_rank`'s parameters as vLLM's weight loaders fill them from the whole
    checkpoint (load_weights: every loader narrows to the rank's slice; FusedMoE's skips the
    experts of other ranks). `moe`: the model's expert parallel settings."""
    model = VllmStyleLlamaForCausalLM(config, dtype, tp_rank, tp_size, **moe)
    model.load_weights([(k, v.to(dtype)) for k, v in tensors.items()])
    return model


def _published_tiles(channel, version):
    """The checksum tiles the publishers recorded for each published part of `version`:
    {(name, its first row): (rows, bytes)} from the version's manifest (docs/FORMAT.md,
    "Block checksums": "tile": [rows, bytes] of the part's row view)."""
    root = channel[len("disk://"):].split("?")[0]
    with open(f"{root}/versions/v{version:020d}/weightbus.manifest.json") as f:
        manifest = json.load(f)
    return {(t["name"], (t.get("shard") or {"offsets": [0]})["offsets"][0]): tuple(t["tile"])
            for t in manifest["tensors"]}


def _expected_bytes_read(config, tensors, tp_rank, tp_size, publishers, tiles, **moe):
    """The bytes TP rank `tp_rank` must read: every checksum tile (`tiles`, as the manifest
    records them) of a published part (a whole tensor, or a rank's torch.chunk row block) that
    holds an element the rank's parameters take. Which elements those are is found without
    weightbus: a checkpoint whose elements are their own indices (float64, exact) loaded through
    vLLM's weight loaders. A part is seen as the rows of its last dimension (one row for a
    vector), cut into tiles of `rows` rows x `bytes` bytes."""
    base = {name: float((i + 1) * 2 ** 32) for i, name in enumerate(tensors)}
    index = {name: (torch.arange(t.numel(), dtype=torch.float64) + base[name]).reshape(t.shape)
             for name, t in tensors.items()}
    taken = torch.cat([p.detach().reshape(-1) for p in
                       _loaded_by_vllm(config, index, tp_rank, tp_size, torch.float64, **moe)
                       .parameters()])
    total = 0
    for name, t in tensors.items():
        mine = taken[(taken >= base[name]) & (taken < base[name] + t.numel())]
        elements = torch.unique((mine - base[name]).long())
        row = t.numel() // t.shape[0]
        start, first_row = 0, 0
        for chunk in torch.chunk(t, publishers, dim=0):
            end = start + chunk.shape[0] * row  # the part's elements [start, end)
            local = elements[(elements >= start) & (elements < end)] - start
            rows, row_bytes = ((chunk.shape[0], t.shape[-1] * t.element_size()) if t.dim() >= 2
                               else (1, chunk.numel() * t.element_size()))
            tile_rows, tile_bytes = tiles[(name, first_row)]
            per_row = row_bytes // t.element_size()
            bands = local // per_row // tile_rows
            columns = local % per_row * t.element_size() // tile_bytes
            for band, column in set(zip(bands.tolist(), columns.tolist())):
                total += ((min(rows, (band + 1) * tile_rows) - band * tile_rows) *
                          (min(row_bytes, (column + 1) * tile_bytes) - column * tile_bytes))
            start, first_row = end, first_row + chunk.shape[0]
    return total


def _reference(config, tensors):
    """The Hugging Face model's logits in float64, and the float32 noise of the same
    computation (max |float32 - float64|): the tolerance is a few times that."""
    model = HfLlamaForCausalLM(config)
    model.load_state_dict({k: v.float() for k, v in tensors.items()})
    with torch.no_grad():
        f32 = model(TOKENS % config.vocab_size)
        f64 = model.double()(TOKENS % config.vocab_size)
    return f64, (f32.double() - f64).abs().max().item()


def _assert_logits(models, tensors, config):
    want, noise = _reference(config, tensors)
    got = tensor_parallel_forward(models, TOKENS % config.vocab_size).double()
    error = (got - want).abs().max().item()
    assert error <= 4 * noise, (error, noise)
    return error, noise


def test_layout_follows_vllms_parameter_metadata():
    """The placements of a TP-2 replica, parameter by parameter, from its own metadata; none at
    TP 1 (every tensor whole)."""
    assert tensor_parallel_layout(VllmStyleLlamaForCausalLM(GQA)) is None
    model = VllmStyleLlamaForCausalLM(GQA, tp_rank=1, tp_size=2)
    layout = tensor_parallel_layout(model)
    assert (layout.tp_rank, layout.tp_size) == (1, 2)
    assert list(layout.tensors) == [name for name, _ in model.named_parameters()]
    p = layout.placements
    layer = "model.layers.1."
    assert p[layer + "self_attn.qkv_proj.weight"] == weightbus.Placement.qkv(8, 2, 8)
    assert p[layer + "mlp.gate_up_proj.weight"] == weightbus.Placement.gate_up()
    assert p[layer + "self_attn.o_proj.weight"] == weightbus.Placement.shard(1)
    assert p[layer + "mlp.down_proj.weight"] == weightbus.Placement.shard(1)
    assert p["model.embed_tokens.weight"] == weightbus.Placement.shard(0)
    assert p["lm_head.weight"] == weightbus.Placement.shard(0)
    assert p[layer + "input_layernorm.weight"] == weightbus.Placement.replicate()
    assert p["model.norm.weight"] == weightbus.Placement.replicate()
    # A padded vocabulary is refused, naming the parameter.
    padded = VllmStyleLlamaForCausalLM(
        LlamaConfig(vocab_size=200, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                    num_attention_heads=8, num_key_value_heads=2), tp_rank=0, tp_size=2)
    with pytest.raises(weightbus.UnimplementedError,
                       match='"model.embed_tokens.weight".*200 is padded to 256'):
        tensor_parallel_layout(padded)


@pytest.mark.parametrize("publishers", [1, 2])
@pytest.mark.parametrize("tp", [2, 4])
def test_tp_workers_receive_their_slices_and_compute_the_reference_logits(stories_dir, tmp_path,
                                                                          tp, publishers):
    """stories260K (8 heads, 4 KV heads, tied embeddings) on TP workers of the worker
    extension; two versions through one subscriber (the plan replayed)."""
    config, tensors = load_hf_checkpoint(stories_dir)
    channel = f"disk://{tmp_path}/channel?fsync=false&retention=4"
    workers = [make_worker(VllmStyleLlamaForCausalLM(config, tp_rank=r, tp_size=tp),
                           WeightbusWorkerExtension) for r in range(tp)]
    models = [w.model_runner.model for w in workers]
    assert collective_rpc(workers, "weightbus_init", (channel,)) == [True] * tp
    whole = sum(t.numel() * t.element_size() for t in tensors.values())
    for version, factor in ((1, 1.0), (2, 0.5)):
        published = {k: v * factor for k, v in tensors.items()}
        _publish(channel, version, published, publishers)
        tiles = _published_tiles(channel, version)
        expected_bytes = [_expected_bytes_read(config, tensors, r, tp, publishers, tiles)
                          for r in range(tp)]
        assert collective_rpc(workers, "weightbus_update",
                              kwargs={"version": version, "timeout": 30}) == [version] * tp
        for r, model in enumerate(models):
            want = dict(_loaded_by_vllm(config, published, r, tp).named_parameters())
            for name, param in model.named_parameters():
                assert torch.equal(param, want[name]), (r, name)
        read = [s["bytes"] for s in collective_rpc(workers, "weightbus_last_update")]
        assert read == expected_bytes
        assert max(read) < whole
        _assert_logits(models, published, config)
    assert collective_rpc(workers, "weightbus_close") == [True] * tp


def _engine_llm(config, tp):
    if "weightbus" not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine("weightbus", "weightbus.vllm",
                                                    "WeightbusWeightTransferEngine")
    return StandInLLM([
        StandInGpuWorker(VllmStyleLlamaForCausalLM(config, tp_rank=r, tp_size=tp),
                         make_vllm_config(tensor_parallel_size=tp),
                         WeightTransferConfig(backend="weightbus"), rank=r)
        for r in range(tp)])


def test_engine_at_tp4_with_kv_heads_replicated(tmp_path):
    """The native weight-transfer engine at TP 4 on a GQA model with 2 KV heads (each on two
    ranks) and a sharded lm_head, from a publisher group of 2."""
    channel = f"disk://{tmp_path}/channel?fsync=false"
    llm = _engine_llm(GQA, 4)
    llm.init_weight_transfer_engine({"init_info": {"uri": channel}})
    tensors = _random_version(GQA, 3)
    _publish(channel, 1, tensors, 2)
    assert weightbus.vllm.sync_weights(llm, {"version": 1, "timeout": 30}) == 1
    models = [w.model_runner.model for w in llm.workers]
    for r, model in enumerate(models):
        want = dict(_loaded_by_vllm(GQA, tensors, r, 4).named_parameters())
        for name, param in model.named_parameters():
            assert torch.equal(param, want[name]), (r, name)
    read = [w.weight_transfer_engine.last_update["bytes"] for w in llm.workers]
    tiles = _published_tiles(channel, 1)
    assert read == [_expected_bytes_read(GQA, tensors, r, 4, 2, tiles) for r in range(4)]
    _assert_logits(models, tensors, GQA)
    llm.collective_rpc("shutdown")


def test_wrong_metadata_is_caught(tmp_path):
    """Metadata that does not describe the layers: gate and up swapped in the model's
    packed_modules_mapping gives slices of the right shapes that the forward pass catches;
    a removed output_dim or input_dim is refused before the model is touched, naming the
    parameter."""
    channel = f"disk://{tmp_path}/channel?fsync=false"
    tensors = _random_version(GQA, 5)
    _publish(channel, 1, tensors, 1)
    swapped = [make_worker(VllmStyleLlamaForCausalLM(GQA, tp_rank=r, tp_size=2),
                           WeightbusWorkerExtension) for r in range(2)]
    for w in swapped:
        w.model_runner.model.packed_modules_mapping = {
            "qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["up_proj", "gate_proj"]}
    collective_rpc(swapped, "weightbus_init", (channel,))
    assert collective_rpc(swapped, "weightbus_update", kwargs={"version": 1}) == [1, 1]
    want, noise = _reference(GQA, tensors)
    got = tensor_parallel_forward([w.model_runner.model for w in swapped],
                                  TOKENS % GQA.vocab_size).double()
    assert (got - want).abs().max().item() > 1000 * noise
    collective_rpc(swapped, "weightbus_close")

    # Without the attribute its layer's loader reads: a fused qkv_proj without output_dim has no
    # placement (refused at init: taken whole, it would have no source of its own name and be
    # left stale); an o_proj whose input_dim is gone is taken as replicated and gets the whole
    # [64, 64] tensor for a [64, 32] parameter (refused before any parameter is written).
    cases = [("model.layers.0.self_attn.qkv_proj.weight", "output_dim", "init",
              r'"{}" \(QKVParallelLinear\) has no output_dim'),
             ("model.layers.1.self_attn.o_proj.weight", "input_dim", "update",
              r'"{}" for TP rank 1 of 2 is \[64, 64\].* parameter is \[64, 32\]')]
    for name, attribute, when, message in cases:
        worker = make_worker(VllmStyleLlamaForCausalLM(GQA, tp_rank=1, tp_size=2),
                             WeightbusWorkerExtension)
        model = worker.model_runner.model
        delattr(dict(model.named_parameters())[name], attribute)
        for param in model.parameters():
            param.data.fill_(7.0)
        if when == "init":
            with pytest.raises(weightbus.InvalidArgumentError, match=message.format(name)):
                worker.weightbus_init(channel)
        else:
            worker.weightbus_init(channel)
            with pytest.raises(weightbus.InvalidArgumentError, match=message.format(name)):
                worker.weightbus_update(version=1)
            assert worker.weightbus_version() is None
            worker.weightbus_close()
        assert all(bool((param == 7.0).all()) for param in model.parameters())


def test_readme_tp_snippet_runs():
    """README.md's tensor-parallel stand-in snippet, in a fresh interpreter."""
    code = readme_snippet("**Tensor-parallel replicas.**")
    assert "tensor_parallel_forward" in code and "tp_size=2" in code
    done = run_python(code + "\nprint('snippet ok')\n")
    assert done.returncode == 0 and done.stdout.strip() == "snippet ok", done.stderr


# ---- MoE: vLLM's FusedMoE -------------------------------------------------------------------

# Qwen3-MoE's layout on the GQA model: layer 1 sparse (6 experts of intermediate 32, top 2),
# layer 0 dense. 6 experts over 4 expert-parallel ranks are 2, 2, 1, 1 (linear) or {0, 4},
# {1, 5}, {2}, {3} (round robin); tensor parallel inside the experts splits each expert's 32
# intermediate rows in 2 or 4.
MOE = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=8, num_key_value_heads=2, num_experts=6,
                  num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=2)
EXPERTS = "model.layers.1.mlp.experts."


def _moe_workers(tp, **moe):
    return [make_worker(VllmStyleLlamaForCausalLM(MOE, tp_rank=r, tp_size=tp, **moe),
                        WeightbusWorkerExtension) for r in range(tp)]


def test_moe_layout_follows_fused_moe_metadata():
    """FusedMoE's placements from its groups and the model's expert mapping: the experts split
    inside without expert parallelism, dealt whole with it (over the TP group, or over data
    parallel ranks too); the router replicated; nothing split at TP 1 without DP."""
    w13 = weightbus.Placement.experts_from_each(
        6, "experts.w13_", ["experts.{e}.gate_proj.", "experts.{e}.up_proj."])
    w2 = weightbus.Placement.experts_from_each(6, "experts.w2_", ["experts.{e}.down_proj."])
    tp = tensor_parallel_layout(VllmStyleLlamaForCausalLM(MOE, tp_rank=1, tp_size=4))
    assert tp.placements[EXPERTS + "w13_weight"] == w13.in_groups((1, 0), (4, 1), 0)
    assert tp.placements[EXPERTS + "w2_weight"] == w2.in_groups((1, 0), (4, 1), 1)
    assert tp.placements["model.layers.1.mlp.gate.weight"] == weightbus.Placement.replicate()
    ep = tensor_parallel_layout(VllmStyleLlamaForCausalLM(
        MOE, tp_rank=1, tp_size=2, enable_expert_parallel=True,
        expert_placement_strategy="round_robin"))
    rr = weightbus.Placement.experts_from_each(
        6, "experts.w13_", ["experts.{e}.gate_proj.", "experts.{e}.up_proj."], "round_robin")
    assert ep.placements[EXPERTS + "w13_weight"] == rr.in_groups((2, 1), (1, 0), 0)
    # DP 2 x TP 2 with expert parallelism: this worker (DP rank 1, TP rank 0) is EP rank 2 of 4.
    dp = tensor_parallel_layout(VllmStyleLlamaForCausalLM(
        MOE, tp_rank=0, tp_size=2, dp_rank=1, dp_size=2, enable_expert_parallel=True))
    assert (dp.tp_rank, dp.tp_size) == (0, 2)
    assert dp.placements[EXPERTS + "w2_weight"] == w2.in_groups((4, 2), (1, 0), 1)
    # TP 1 with DP 2: the experts alone are split, so the worker still subscribes to slices.
    alone = tensor_parallel_layout(VllmStyleLlamaForCausalLM(MOE, dp_rank=1, dp_size=2))
    assert (alone.tp_rank, alone.tp_size) == (0, 1)
    assert alone.placements[EXPERTS + "w13_weight"] == w13.in_groups((1, 0), (2, 1), 0)
    assert tensor_parallel_layout(VllmStyleLlamaForCausalLM(MOE)) is None
    # Without an expert mapping the sources are unknown.
    model = VllmStyleLlamaForCausalLM(MOE, tp_rank=0, tp_size=2)
    model.get_expert_mapping = lambda: []
    model.model.get_expert_mapping = lambda: []
    with pytest.raises(weightbus.InvalidArgumentError,
                       match=f'"{EXPERTS}w13_weight" \\(FusedMoE\\): the model declares no '
                             'expert mapping'):
        tensor_parallel_layout(model)


@pytest.mark.parametrize("tp,moe,publishers", [
    (2, {}, 1),
    (4, {}, 2),
    (2, {"enable_expert_parallel": True}, 2),
    (4, {"enable_expert_parallel": True}, 1),
    (4, {"enable_expert_parallel": True, "expert_placement_strategy": "round_robin"}, 2),
], ids=["tp2", "tp4-group2", "ep2-group2", "ep4", "ep4-round-robin-group2"])
def test_moe_workers_receive_their_experts_and_compute_the_reference_logits(tmp_path, tp, moe,
                                                                            publishers):
    """Each worker's FusedMoE parameters equal bit for bit what vLLM's loaders make of the whole
    checkpoint (its experts, its block of each), it reads only the blocks holding them, and the
    TP forward pass on the workers' parameters gives the reference logits. Two versions."""
    channel = f"disk://{tmp_path}/channel?fsync=false&retention=4"
    workers = _moe_workers(tp, **moe)
    models = [w.model_runner.model for w in workers]
    collective_rpc(workers, "weightbus_init", (channel,))
    tensors = _random_version(MOE, 11)
    whole = sum(t.numel() * t.element_size() for t in tensors.values())
    for version, factor in ((1, 1.0), (2, -0.75)):
        published = {k: v * factor for k, v in tensors.items()}
        _publish(channel, version, published, publishers)
        tiles = _published_tiles(channel, version)
        expected_bytes = [_expected_bytes_read(MOE, tensors, r, tp, publishers, tiles, **moe)
                          for r in range(tp)]
        assert collective_rpc(workers, "weightbus_update",
                              kwargs={"version": version, "timeout": 30}) == [version] * tp
        for r, model in enumerate(models):
            want = dict(_loaded_by_vllm(MOE, published, r, tp, **moe).named_parameters())
            for name, param in model.named_parameters():
                assert torch.equal(param, want[name]), (r, name)
        last = collective_rpc(workers, "weightbus_last_update")
        assert [s["bytes"] for s in last] == expected_bytes
        assert all(s["left"] == () for s in last)
        assert max(expected_bytes) < whole
        _assert_logits(models, published, MOE)
    collective_rpc(workers, "weightbus_close")


def test_moe_worker_of_a_data_parallel_replica_receives_its_experts(tmp_path):
    """DP 2 x TP 2 with expert parallelism: the workers of DP rank 1 are EP ranks 2 and 3 of 4
    (FusedMoEParallelConfig flattens TP across DP), and receive those experts only."""
    channel = f"disk://{tmp_path}/channel?fsync=false"
    moe = {"enable_expert_parallel": True, "dp_rank": 1, "dp_size": 2}
    workers = _moe_workers(2, **moe)
    collective_rpc(workers, "weightbus_init", (channel,))
    tensors = _random_version(MOE, 12)
    _publish(channel, 1, tensors, 1)
    assert collective_rpc(workers, "weightbus_update", kwargs={"version": 1}) == [1, 1]
    for r, worker in enumerate(workers):
        model = worker.model_runner.model
        assert model.model.layers[1].mlp.experts.local_num_experts == 1  # experts 4, 5
        want = dict(_loaded_by_vllm(MOE, tensors, r, 2, **moe).named_parameters())
        for name, param in model.named_parameters():
            assert torch.equal(param, want[name]), (r, name)
        assert worker.weightbus_last_update()["bytes"] == \
            _expected_bytes_read(MOE, tensors, r, 2, 1, _published_tiles(channel, 1), **moe)
    collective_rpc(workers, "weightbus_close")


def test_moe_wrong_metadata_is_caught_by_the_logits(tmp_path):
    """Metadata that does not describe the experts gives slices of the right shapes that the
    forward pass catches: gate and up swapped in the model's expert mapping (TP inside the
    experts), and a placement strategy the layer does not follow (its experts are linear,
    its expert_placement_strategy says round robin)."""
    channel = f"disk://{tmp_path}/channel?fsync=false"
    tensors = _random_version(MOE, 13)
    _publish(channel, 1, tensors, 1)
    want, noise = _reference(MOE, tensors)

    def swapped_mapping(model):
        mapping = model.get_expert_mapping()
        swap = {"w1": "w3", "w3": "w1"}
        return lambda: [(p, w, e, swap.get(s, s)) for p, w, e, s in mapping]

    cases = []
    swapped = _moe_workers(2)
    for w in swapped:
        w.model_runner.model.get_expert_mapping = swapped_mapping(w.model_runner.model)
    cases.append(swapped)
    lying = _moe_workers(2, enable_expert_parallel=True)
    for w in lying:
        w.model_runner.model.model.layers[1].mlp.experts.expert_placement_strategy = "round_robin"
    cases.append(lying)
    for workers in cases:
        collective_rpc(workers, "weightbus_init", (channel,))
        assert collective_rpc(workers, "weightbus_update", kwargs={"version": 1}) == [1, 1]
        got = tensor_parallel_forward([w.model_runner.model for w in workers],
                                      TOKENS % MOE.vocab_size).double()
        assert (got - want).abs().max().item() > 1000 * noise
        collective_rpc(workers, "weightbus_close")
    # The control: the same workers with the layers' own metadata are within the tolerance.
    right = _moe_workers(2, enable_expert_parallel=True)
    collective_rpc(right, "weightbus_init", (channel,))
    collective_rpc(right, "weightbus_update", kwargs={"version": 1})
    _assert_logits([w.model_runner.model for w in right], tensors, MOE)
    collective_rpc(right, "weightbus_close")


# ---- Parameters without a checkpoint tensor -------------------------------------------------

def test_parameters_without_a_checkpoint_tensor_are_left_as_they_were(tmp_path):
    """vLLM's load_weights loads the tensors it is given and leaves the other parameters as
    they are (a trainer that publishes only what it trains: here no lm_head and no layer-0
    MLP; an expert layer without its experts). The TP workers do the same: those parameters
    keep version 1's values, the others take version 2's, and weightbus_last_update says which
    were left. A fused parameter with only some of its checkpoint tensors (q and k, no v) is
    NotFoundError before any byte is fetched, and a version with none of the model's tensors
    too; the model keeps the version it had."""
    channel = f"disk://{tmp_path}/channel?fsync=false&retention=8"
    workers = _moe_workers(2, enable_expert_parallel=True)
    models = [w.model_runner.model for w in workers]
    collective_rpc(workers, "weightbus_init", (channel,))
    v1 = _random_version(MOE, 21)
    _publish(channel, 1, v1, 1)
    assert collective_rpc(workers, "weightbus_update", kwargs={"version": 1}) == [1, 1]
    frozen = ("lm_head.", "model.layers.0.mlp.", EXPERTS)
    v2 = {k: v * 2 for k, v in v1.items() if not k.startswith(frozen)}
    _publish(channel, 2, v2, 1)
    assert collective_rpc(workers, "weightbus_update", kwargs={"version": 2}) == [2, 2]
    left = ("model.layers.0.mlp.gate_up_proj.weight", "model.layers.0.mlp.down_proj.weight",
            EXPERTS + "w13_weight", EXPERTS + "w2_weight", "lm_head.weight")
    for r, (worker, model) in enumerate(zip(workers, models)):
        assert sorted(worker.weightbus_last_update()["left"]) == sorted(left)
        old = dict(_loaded_by_vllm(MOE, v1, r, 2, enable_expert_parallel=True)
                   .named_parameters())
        new = dict(_loaded_by_vllm(MOE, {**v1, **v2}, r, 2, enable_expert_parallel=True)
                   .named_parameters())
        for name, param in model.named_parameters():
            assert torch.equal(param, (old if name in left else new)[name]), (r, name)
    _assert_logits(models, {**v1, **v2}, MOE)

    before = {r: {n: p.clone() for n, p in m.named_parameters()} for r, m in enumerate(models)}
    partial = dict(v2)
    del partial["model.layers.1.self_attn.v_proj.weight"]
    _publish(channel, 3, partial, 1)
    with pytest.raises(weightbus.NotFoundError,
                       match=r'"model.layers.1.self_attn.v_proj.weight" is not in the layout, '
                             r'nor is a fused "model.layers.1.self_attn.qkv_proj.weight"'):
        collective_rpc(workers, "weightbus_update", kwargs={"version": 3})
    _publish(channel, 4, {"unrelated.weight": torch.ones(4)}, 1)
    with pytest.raises(weightbus.NotFoundError, match="none of the .* destination tensors has "
                                                      "a source"):
        collective_rpc(workers, "weightbus_update", kwargs={"version": 4})
    assert collective_rpc(workers, "weightbus_version") == [2, 2]
    for r, model in enumerate(models):
        assert all(torch.equal(p, before[r][n]) for n, p in model.named_parameters())
    collective_rpc(workers, "weightbus_close")


def test_vocabulary_is_padded_as_vllm_pads_it_at_every_degree():
    """vLLM's VocabParallelEmbedding pads the vocabulary to a multiple of 64 at every TP degree
    (pad_vocab_size), TP 1 included: a vocabulary of 200 has 256 rows, the last 56 zero, and
    the logits are cut back to 200."""
    config = LlamaConfig(vocab_size=200, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=1, num_attention_heads=8, num_key_value_heads=2)
    tensors = _random_version(config, 31)
    model = _loaded_by_vllm(config, tensors, 0, 1)
    weightbus.vllm.process_weights_after_loading(model)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        param = dict(model.named_parameters())[name]
        assert param.shape == (256, 64)
        assert torch.equal(param[:200], tensors[name]) and not param[200:].any()
    assert model.hf_state_dict().keys() == tensors.keys()
    assert all(torch.equal(t, tensors[k]) for k, t in model.hf_state_dict().items())
    _assert_logits([model], tensors, config)
