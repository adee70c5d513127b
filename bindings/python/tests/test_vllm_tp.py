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
packed_modules_mapping by the logits, a removed output_dim before any parameter is written."""
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


def _loaded_by_vllm(config, tensors, tp_rank, tp_size, dtype=torch.float32):
    """Rank `tp_rank`'s parameters as vLLM's weight loaders fill them from the whole
    checkpoint (load_weights: every loader narrows to the rank's slice)."""
    model = VllmStyleLlamaForCausalLM(config, dtype, tp_rank, tp_size)
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


def _expected_bytes_read(config, tensors, tp_rank, tp_size, publishers, tiles):
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
                       _loaded_by_vllm(config, index, tp_rank, tp_size, torch.float64)
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

    # Without the attribute its layer's loader reads, a parameter is taken as replicated: a
    # fused qkv_proj then has no source of its own name (refused before any byte is fetched);
    # an o_proj whose input_dim is gone gets the whole [64, 64] tensor for a [64, 32]
    # parameter (refused before any parameter is written).
    cases = [("model.layers.0.self_attn.qkv_proj.weight", "output_dim", weightbus.NotFoundError,
              r'"{}" \(Replicate at TP rank 1 of 2\).*nothing was fetched'),
             ("model.layers.1.self_attn.o_proj.weight", "input_dim",
              weightbus.InvalidArgumentError,
              r'"{}" for TP rank 1 of 2 is \[64, 64\].* parameter is \[64, 32\]')]
    for name, attribute, error, message in cases:
        worker = make_worker(VllmStyleLlamaForCausalLM(GQA, tp_rank=1, tp_size=2),
                             WeightbusWorkerExtension)
        model = worker.model_runner.model
        delattr(dict(model.named_parameters())[name], attribute)
        for param in model.parameters():
            param.data.fill_(7.0)
        worker.weightbus_init(channel)
        with pytest.raises(error, match=message.format(name)):
            worker.weightbus_update(version=1)
        assert worker.weightbus_version() is None
        assert all(bool((param == 7.0).all()) for param in model.parameters())
        worker.weightbus_close()


def test_readme_tp_snippet_runs():
    """README.md's tensor-parallel stand-in snippet, in a fresh interpreter."""
    code = readme_snippet("**Tensor-parallel replicas.**")
    assert "tensor_parallel_forward" in code and "tp_size=2" in code
    done = run_python(code + "\nprint('snippet ok')\n")
    assert done.returncode == 0 and done.stdout.strip() == "snippet ok", done.stderr
