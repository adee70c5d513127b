# SPDX-License-Identifier: Apache-2.0
"""weightbus.vllm against the vLLM-shaped replica in weightbus.testing.llama, on the real
stories260K weights: the worker extension (worker_extension_cls / collective_rpc); and the
native weight-transfer engine, created by the stand-in's WeightTransferEngineFactory and driven
by the stand-in GPU worker with vLLM's lifecycle (weightbus.testing.worker), on small
random Llamas."""
import os
import shutil
import threading
from pathlib import Path

import pytest
import torch

import llama2c_reference
import weightbus
import weightbus.vllm
from conftest import (SliceWatch, fail_point_reached, fixtures_dir, late_uri, readme_snippet,
                      run_python)
from weightbus.testing.llama import (HfLlamaForCausalLM, LlamaConfig, VllmStyleLlamaForCausalLM,
                                     load_hf_checkpoint)
from weightbus.testing.worker import (LayerwiseReload, StandInGpuWorker, StandInLLM,
                                     StandInWorker, WeightTransferConfig,
                                     WeightTransferEngineFactory, collective_rpc, make_vllm_config,
                                     make_worker, quantize_linear_layers)
from weightbus.vllm import WeightbusWeightTransferEngine, WeightbusWorkerExtension

TOKENS = torch.tensor([[1, 403, 407, 261, 378, 290, 500, 13, 100, 50, 499, 2]])


def _make_workers(config, n):
    return [make_worker(VllmStyleLlamaForCausalLM(config), WeightbusWorkerExtension)
            for _ in range(n)]


def _reference(config, tensors):
    model = HfLlamaForCausalLM(config)
    model.load_state_dict({k: v.float() for k, v in tensors.items()})
    return model


def _scaled(tensors, factor):
    return {k: (v * factor).to(torch.bfloat16) for k, v in tensors.items()}


def test_hf_reference_matches_llama2c(stories_dir):
    """The unfused PyTorch reference on the converted weights computes llama2.c's logits
    (straight from stories260K.bin, interleaved RoPE): the reference the replica is held to."""
    weights = llama2c_reference.read_checkpoint(fixtures_dir() / "stories260K.bin")
    want = llama2c_reference.forward(weights, TOKENS[0].tolist())
    with torch.no_grad():
        got = HfLlamaForCausalLM.from_checkpoint(stories_dir)(TOKENS)[0].double().numpy()
    assert abs(got - want).max() < 1e-4 * abs(want).max()


def test_worker_extension_loads_fuses_and_post_processes(stories_dir, channel):
    config, tensors = load_hf_checkpoint(stories_dir)
    v1 = {k: v.to(torch.bfloat16) for k, v in tensors.items()}
    workers = _make_workers(config, 2)
    assert collective_rpc(workers, "weightbus_init", (channel,)) == [True, True]
    assert collective_rpc(workers, "weightbus_update") == [None, None]  # nothing published yet
    with weightbus.Publisher(channel) as pub:
        pub.publish(1, v1)
        assert collective_rpc(workers, "weightbus_update", kwargs={"min_version": 1,
                                                                    "timeout": 30}) == [1, 1]
        reference = _reference(config, v1)
        with torch.no_grad():
            want = reference(TOKENS)
        for w in workers:
            model = w.model_runner.model
            # Bit-exact: the fused parameters hold exactly the published bytes.
            for name, t in model.hf_state_dict().items():
                assert torch.equal(t.to(torch.bfloat16), v1[name]), name
            torch.testing.assert_close(model(TOKENS), want, rtol=1e-5, atol=1e-5)
            # Greedy generation agrees with the reference recomputed from scratch.
            ids = TOKENS[:, :3]
            for _ in range(12):
                with torch.no_grad():
                    ids = torch.cat([ids, reference(ids)[:, -1].argmax(-1, keepdim=True)], 1)
            assert torch.equal(model.generate(TOKENS[:, :3], 12), ids[:, 3:])
        stats = workers[0].weightbus_last_update()
        assert stats["version"] == 1 and stats["changed"] and stats["applied_unix"] > 0

        # Version 2 differs everywhere; post-load processing must run for it to take effect.
        v2 = _scaled(tensors, 0.5)
        pub.publish(2, v2)
        assert collective_rpc(workers, "weightbus_update") == [2, 2]  # committed: no wait
        with torch.no_grad():
            want2 = _reference(config, v2)(TOKENS)
        torch.testing.assert_close(workers[0].model_runner.model(TOKENS), want2, rtol=1e-5,
                                   atol=1e-5)
        # load_weights alone is not enough: without the post-load step the linear layers
        # still compute with version 2's prepared weights, so version 1 is not in effect.
        stale = workers[1].model_runner.model
        stale.load_weights(weights=list(v1.items()))
        assert not torch.allclose(stale(TOKENS), want, rtol=1e-3, atol=1e-3)
        weightbus.vllm.process_weights_after_loading(stale)
        torch.testing.assert_close(stale(TOKENS), want, rtol=1e-5, atol=1e-5)

        # Nothing newer: the applied version stays; demanding a newer one times out.
        assert collective_rpc(workers, "weightbus_update") == [2, 2]
        with pytest.raises(weightbus.DeadlineExceededError, match="no version >= 5"):
            workers[0].weightbus_update(min_version=5, timeout=0.05)
        # Several new versions: the newest is applied, skipping the rest.
        pub.publish(3, _scaled(tensors, 0.25))
        pub.publish(4, _scaled(tensors, 2.0))
        assert collective_rpc(workers, "weightbus_update", kwargs={"min_version": 3,
                                                                    "timeout": 30}) == [4, 4]
        assert collective_rpc(workers, "weightbus_version") == [4, 4]
    assert collective_rpc(workers, "weightbus_close") == [True, True]


def test_worker_extension_applies_exactly_the_version_given(stories_dir, tmp_path):
    """weightbus_update(version=v): every worker applies v although newer versions exist (issue
    13, item 3); v held already returns at once; both bounds at once are refused."""
    config, tensors = load_hf_checkpoint(stories_dir)
    channel = f"disk://{tmp_path}/channel?fsync=false&retention=4"
    versions = {1: _scaled(tensors, 0.5), 2: _scaled(tensors, 0.25), 3: _scaled(tensors, 0.5)}
    workers = _make_workers(config, 2)
    assert collective_rpc(workers, "weightbus_init", (channel,)) == [True, True]
    with weightbus.Publisher(channel) as pub:
        for v, sent in versions.items():
            pub.publish(v, sent)
        for v in (1, 2):
            assert collective_rpc(workers, "weightbus_update",
                                  kwargs={"version": v, "timeout": 30}) == [v, v]
            with torch.no_grad():
                want = _reference(config, versions[v])(TOKENS)
            for w in workers:
                torch.testing.assert_close(w.model_runner.model(TOKENS), want, rtol=1e-5,
                                           atol=1e-5)
        assert collective_rpc(workers, "weightbus_update", kwargs={"version": 2}) == [2, 2]
        assert not workers[0].weightbus_last_update()["changed"]
        with pytest.raises(ValueError, match="min_version or version"):
            workers[0].weightbus_update(min_version=3, version=3)
        with pytest.raises(weightbus.FailedPreconditionError, match="holds version 2 already"):
            workers[0].weightbus_update(version=1, timeout=30)
        assert workers[0].weightbus_version() == 2
    assert collective_rpc(workers, "weightbus_close") == [True, True]


def test_worker_extension_requires_init():
    worker = make_worker(None, WeightbusWorkerExtension)
    assert isinstance(worker, StandInWorker)
    with pytest.raises(RuntimeError, match="weightbus_init"):
        worker.weightbus_update()


def test_worker_extension_waits_for_a_trainer_that_starts_later(stories_dir, tmp_path,
                                                                 monkeypatch):
    """Replicas start before the trainer: weightbus_update(min_version=1, timeout) on ucx://
    keeps waiting while nobody serves the channel, and applies the version of a publisher that
    comes up only after a slice of the wait found nothing (issue 10, item 4)."""
    uri = late_uri("ucx", tmp_path)
    config, tensors = load_hf_checkpoint(stories_dir)
    v1 = {k: v.to(torch.bfloat16) for k, v in tensors.items()}
    watch = SliceWatch(monkeypatch)
    worker = _make_workers(config, 1)[0]
    worker.weightbus_init(uri)
    received, errors = threading.Event(), []

    def trainer():
        watch.not_yet.wait()
        try:
            with weightbus.Publisher(uri) as pub:
                pub.publish(1, v1)
                received.wait()   # serve until the replica has it
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    thread = threading.Thread(target=trainer)
    thread.start()
    try:
        assert worker.weightbus_update(min_version=1, timeout=120) == 1
    finally:
        received.set()
        watch.not_yet.set()
        thread.join()
        worker.weightbus_close()
    assert errors == []
    for name, t in worker.model_runner.model.hf_state_dict().items():
        assert torch.equal(t.to(torch.bfloat16), v1[name]), name
    assert watch.statuses[0] != 0 and watch.statuses[-1] == 0, watch.statuses


# ---- tied embeddings (issue 10, item 7) ----

TIED = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                   num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)


def _tied_version(seed):
    torch.manual_seed(seed)
    return {k: v.detach().clone() for k, v in HfLlamaForCausalLM(TIED).state_dict().items()}


def test_tied_embeddings_accept_the_embedding_alone_or_an_identical_copy(channel):
    worker = _make_workers(TIED, 1)[0]
    worker.weightbus_init(channel)
    model = worker.model_runner.model
    with weightbus.Publisher(channel) as pub:
        v1 = _tied_version(1)
        assert "lm_head.weight" not in v1
        pub.publish(1, v1)
        assert worker.weightbus_update(min_version=1, timeout=30) == 1
        # vLLM pads the vocabulary to a multiple of 64: 32 rows, then 32 zero rows.
        assert torch.equal(model.lm_head.weight[:32], v1["model.embed_tokens.weight"])
        assert not model.lm_head.weight[32:].any()
        v2 = _tied_version(2)
        v2["lm_head.weight"] = v2["model.embed_tokens.weight"].clone()
        pub.publish(2, v2)
        assert worker.weightbus_update(min_version=2, timeout=30) == 2
        assert torch.equal(model.lm_head.weight[:32], v2["lm_head.weight"])
    worker.weightbus_close()


def test_tied_embeddings_refuse_an_lm_head_that_differs(channel):
    """A version whose lm_head.weight differs from model.embed_tokens.weight on a replica that
    ties them is refused, naming both tensors, before anything is loaded: the model keeps the
    version it held. Also when lm_head.weight comes without the embedding."""
    worker = _make_workers(TIED, 1)[0]
    worker.weightbus_init(channel)
    model = worker.model_runner.model
    with weightbus.Publisher(channel) as pub:
        v1 = _tied_version(1)
        pub.publish(1, v1)
        assert worker.weightbus_update(min_version=1, timeout=30) == 1
        v2 = _tied_version(2)
        v2["lm_head.weight"] = v2["model.embed_tokens.weight"].clone()
        v2["lm_head.weight"][3, 5] += 1.0
        pub.publish(2, v2)
        with pytest.raises(weightbus.InvalidArgumentError) as info:
            worker.weightbus_update(min_version=2, timeout=30)
        message = str(info.value)
        assert '"lm_head.weight"' in message and '"model.embed_tokens.weight"' in message
        assert "version 2" in message and "[3, 5]" in message and "tie" in message, message
        assert worker.weightbus_version() == 1
        for name, t in model.hf_state_dict().items():
            assert torch.equal(t, v1[name]), name          # nothing of version 2 loaded
        # A differing dtype or shape is named with both sides.
        v3 = _tied_version(3)
        v3["lm_head.weight"] = v3["model.embed_tokens.weight"].to(torch.bfloat16)
        pub.publish(3, v3)
        with pytest.raises(weightbus.InvalidArgumentError, match=r"BF16 \[32, 16\].*F32 "
                           r"\[32, 16\]|F32 \[32, 16\].*BF16 \[32, 16\]"):
            worker.weightbus_update()
        v4 = _tied_version(4)
        v4["lm_head.weight"] = v4.pop("model.embed_tokens.weight")
        pub.publish(4, v4)
        with pytest.raises(weightbus.InvalidArgumentError,
                           match=r'version 4 has "lm_head.weight" but no '
                                 r'"model.embed_tokens.weight"'):
            worker.weightbus_update()
        assert worker.weightbus_version() == 1
        for name, t in model.hf_state_dict().items():
            assert torch.equal(t, v1[name]), name
    worker.weightbus_close()


def test_weight_transfer_engine_refuses_an_untied_lm_head_too(channel):
    llm = _engine_llm(TIED)
    llm.init_weight_transfer_engine({"init_info": {"uri": channel}})
    v1 = _tied_version(1)
    v1["lm_head.weight"] = torch.zeros_like(v1["model.embed_tokens.weight"])
    with weightbus.Publisher(channel) as pub:
        pub.publish(1, v1)
    llm.start_weight_update()
    with pytest.raises(weightbus.InvalidArgumentError, match='"lm_head.weight".*differs'):
        llm.update_weights({"update_info": {"timeout": 30}})
    assert llm.collective_rpc(weightbus.vllm.received_version) == [None]
    llm.start_weight_update()  # the failed round left nothing open
    llm.finish_weight_update()


# ---- the native engine on vLLM's lifecycle (issue 13): weightbus.testing.worker mirrors vLLM's
# base class, factory and GPU worker; the engine is created by the factory, as vLLM does ----

SMALL = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2)
DRAFT = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                    num_attention_heads=2, num_key_value_heads=1)


def _version(config, seed):
    torch.manual_seed(seed)
    return {k: v.detach().clone() for k, v in HfLlamaForCausalLM(config).state_dict().items()}


def _engine_llm(config, ranks=1, draft=None):
    """A StandInLLM of `ranks` StandInGpuWorkers whose engine WeightTransferEngineFactory
    creates from WeightTransferConfig(backend="weightbus")."""
    if "weightbus" not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine("weightbus", "weightbus.vllm",
                                                    "WeightbusWeightTransferEngine")
    return StandInLLM([
        StandInGpuWorker(VllmStyleLlamaForCausalLM(config), make_vllm_config(),
                         WeightTransferConfig(backend="weightbus"), rank=rank,
                         draft_model=None if draft is None else VllmStyleLlamaForCausalLM(draft))
        for rank in range(ranks)])


def _holds(model, tensors):
    state = model.hf_state_dict()
    return all(torch.equal(state[k].to(v.dtype), v) for k, v in tensors.items())


@pytest.fixture
def layerwise(monkeypatch):
    reload = LayerwiseReload()
    monkeypatch.setattr(WeightbusWeightTransferEngine, "layerwise", reload)
    return reload


def test_engine_rounds_on_vllms_lifecycle(channel, layerwise):
    """Two TP workers, rounds in a row through vLLM's worker: the engine runs the base class's
    __init__ (reset_weight_update_target after every finish works), loads exactly the published
    bytes, finalizes the layerwise reload, and sync_weights labels vLLM's weight version with
    the version every worker received."""
    llm = _engine_llm(SMALL, ranks=2)
    llm.init_weight_transfer_engine({"init_info": {"uri": channel}})
    engines = [w.weight_transfer_engine for w in llm.workers]
    assert all(isinstance(e, WeightbusWeightTransferEngine) for e in engines)
    with pytest.raises(ValueError, match="Invalid update_info for WeightbusWeightTransferEngine"):
        engines[0].parse_update_info({"bogus": 1})
    with pytest.raises(ValueError, match="Invalid init_info for WeightbusWeightTransferEngine"):
        llm.init_weight_transfer_engine({"init_info": {"url": channel}})
    with weightbus.Publisher(channel) as pub:
        for version in (1, 2, 3):
            tensors = _version(SMALL, version)
            pub.publish(version, tensors)
            llm.start_weight_update()
            llm.update_weights({"update_info": {"version": version, "timeout": 30}})
            assert llm.collective_rpc(weightbus.vllm.received_version) == [version, version]
            llm.finish_weight_update(weight_version=str(version))
            assert llm.get_weight_version() == str(version)
            for w in llm.workers:
                assert _holds(w.model_runner.model, tensors)
                assert w.weight_transfer_engine.model is w.model_runner.model
                assert not w._weight_update_active
            assert [e.applied_version for e in engines] == [version, version]
        assert layerwise.reloading == [] and layerwise.finalized == 6
        assert [w.model_runner.lora_resets for w in llm.workers] == [3, 3]
        # Per-worker update dicts (a list, one per rank) and the labelling driver.
        pub.publish(4, _version(SMALL, 4))
        assert weightbus.vllm.sync_weights(llm, [{"timeout": 30}, {"timeout": 30}]) == 4
        assert llm.get_weight_version() == "4"
    llm.collective_rpc("shutdown")


def test_engine_loads_exactly_the_version_given(channel, layerwise):
    """update_info.version is the version loaded, not a floor (issue 13, item 3): two TP
    workers told version 1 both load version 1's bytes although version 2 exists; told 2, both
    load 2 although 3 exists. A version below the one received is refused (one rank: the
    stand-in LLM stops at the first rank that raises), and the next round is clean."""
    llm = _engine_llm(SMALL, ranks=2)
    llm.init_weight_transfer_engine({"init_info": {"uri": channel}})
    versions = {v: _version(SMALL, v) for v in (1, 2, 3)}
    with weightbus.Publisher(channel) as pub:
        pub.publish(1, versions[1])
        pub.publish(2, versions[2])
        for v in (1, 2):
            if v == 2:
                pub.publish(3, versions[3])
            llm.start_weight_update()
            llm.update_weights({"update_info": {"version": v, "timeout": 30}})
            assert llm.collective_rpc(weightbus.vllm.received_version) == [v, v]
            llm.finish_weight_update(weight_version=str(v))
            for w in llm.workers:
                assert _holds(w.model_runner.model, versions[v])
        llm.collective_rpc("shutdown")
        # A version below the one received: refused, the session aborted, the next round clean.
        single = _engine_llm(SMALL)
        single.init_weight_transfer_engine({"init_info": {"uri": channel}})
        assert weightbus.vllm.sync_weights(single, {"version": 2, "timeout": 30}) == 2
        single.start_weight_update()
        with pytest.raises(weightbus.FailedPreconditionError, match="holds version 2 already"):
            single.update_weights({"update_info": {"version": 1, "timeout": 30}})
        assert _holds(single.workers[0].model_runner.model, versions[2])
        assert weightbus.vllm.sync_weights(single, {"version": 3, "timeout": 30}) == 3
        assert _holds(single.workers[0].model_runner.model, versions[3])
        single.collective_rpc("shutdown")


def test_engine_update_without_version_loads_the_newest_or_returns_at_once(channel, layerwise):
    """update_weights({}): the newest committed version above the applied one, skipping older
    ones; with none newer it returns at once (a 5 s receive bound is not a wait) and finish
    keeps the applied version (issue 13, item 8)."""
    llm = _engine_llm(SMALL)
    llm.init_weight_transfer_engine({"init_info": {"uri": channel}})
    model = llm.workers[0].model_runner.model
    with weightbus.Publisher(channel) as pub:
        pub.publish(1, _version(SMALL, 1))
        newest = _version(SMALL, 2)
        pub.publish(2, newest)
        assert weightbus.vllm.sync_weights(llm, {}) == 2
        assert _holds(model, newest) and llm.get_weight_version() == "2"
        llm.start_weight_update()
        llm.update_weights({"update_info": {"timeout": 5}})
        assert llm.collective_rpc(weightbus.vllm.received_version) == [None]
        llm.finish_weight_update()
        assert llm.workers[0].weight_transfer_engine.applied_version == 2
        assert _holds(model, newest) and layerwise.reloading == []
        assert weightbus.vllm.sync_weights(llm, {}) == 2  # nothing newer: the label stays
        assert llm.get_weight_version() == "2"


def _corrupt(channel, version):
    """Flips the last byte (tensor data) of a committed disk:// version's data file."""
    root = channel[len("disk://"):].split("?")[0]
    data = sorted(Path(root, "versions").glob(
        f"v{version:020d}/*.safetensors"))
    assert data, f"no data file of version {version} under {root}"
    with open(data[0], "r+b") as f:
        f.seek(-1, 2)
        last = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([last[0] ^ 0xFF]))


def test_engine_failed_receive_then_a_clean_round(channel, layerwise, monkeypatch):
    """A receive that fails (a fail point, a timeout, a corrupted version) aborts the engine's
    session cleanly, as vLLM's disk engine does: the layerwise reload is finalized (the model is
    not left half-reloaded), the model keeps the version it held, vLLM's worker resets the
    target, and the next round is clean (issue 13, items 1 and 2)."""
    monkeypatch.setenv("WEIGHTBUS_FAILPOINTS", "core.before_fetch=error")
    llm = _engine_llm(SMALL)
    llm.init_weight_transfer_engine({"init_info": {"uri": channel}})
    monkeypatch.delenv("WEIGHTBUS_FAILPOINTS")
    worker = llm.workers[0]
    model = worker.model_runner.model
    v1 = _version(SMALL, 1)
    with weightbus.Publisher(channel) as pub:
        pub.publish(1, v1)
        llm.start_weight_update()
        with pytest.raises(weightbus.WeightbusError, match="core.before_fetch"):
            llm.update_weights({"update_info": {"version": 1, "timeout": 30}})
        assert layerwise.reloading == [] and not worker._weight_update_active
        assert weightbus.vllm.sync_weights(llm, {"version": 1, "timeout": 30}) == 1
        assert _holds(model, v1)

        # A version that never comes: DeadlineExceeded, then a clean round.
        llm.start_weight_update()
        with pytest.raises(weightbus.DeadlineExceededError):
            llm.update_weights({"update_info": {"version": 9, "timeout": 0.05}})
        assert layerwise.reloading == [] and _holds(model, v1)
        v2 = _version(SMALL, 2)
        pub.publish(2, v2)
        assert weightbus.vllm.sync_weights(llm, {"version": 2, "timeout": 30}) == 2
        assert _holds(model, v2)

        # A corrupted version: DataLoss, nothing of it loaded, then a clean round.
        pub.publish(3, _version(SMALL, 3))
        _corrupt(channel, 3)
        llm.start_weight_update()
        with pytest.raises(weightbus.DataLossError):
            llm.update_weights({"update_info": {"version": 3, "timeout": 30}})
        assert layerwise.reloading == [] and _holds(model, v2)
        assert worker.weight_transfer_engine.applied_version == 2
        v4 = _version(SMALL, 4)
        pub.publish(4, v4)
        assert weightbus.vllm.sync_weights(llm, {"version": 4, "timeout": 30}) == 4
        assert _holds(model, v4) and llm.get_weight_version() == "4"
        # Two receives in one session are refused (one version per session), and the
        # session is aborted as every failed update is.
        pub.publish(5, _version(SMALL, 5))
        llm.start_weight_update()
        llm.update_weights({"update_info": {"version": 5, "timeout": 30}})
        with pytest.raises(RuntimeError, match="one version per update session"):
            llm.update_weights({"update_info": {"timeout": 30}})
        assert layerwise.reloading == [] and not worker._weight_update_active


def test_engine_refuses_a_draft_update_without_a_draft_channel(channel, tmp_path, layerwise):
    """A draft (speculative/MTP) session is refused, clearly, unless init_info names a draft
    channel: the target model's tensors must never load into the draft model (issue 13,
    item 7). With draft_uri, the draft round loads the draft channel into the draft model and
    the next target round loads the target again."""
    llm = _engine_llm(SMALL, draft=DRAFT)
    worker = llm.workers[0]
    llm.init_weight_transfer_engine({"init_info": {"uri": channel}})
    with pytest.raises(RuntimeError, match="does not support draft model weight updates"):
        llm.start_draft_weight_update()
    assert worker.weight_transfer_engine.model is worker.model_runner.model
    # The engine refuses it too when a caller retargets it at the draft model by itself.
    engine = worker.weight_transfer_engine
    engine.set_weight_update_target(worker.model_runner.get_draft_model(), None)
    with pytest.raises(RuntimeError, match="draft_uri"):
        engine.start_weight_update()
    engine.reset_weight_update_target()

    draft_channel = f"disk://{tmp_path}/draft?fsync=false"
    llm.init_weight_transfer_engine({"init_info": {"uri": channel, "draft_uri": draft_channel}})
    target, draft = _version(SMALL, 1), _version(DRAFT, 2)
    with weightbus.Publisher(channel) as pub, weightbus.Publisher(draft_channel) as draft_pub:
        pub.publish(1, target)
        draft_pub.publish(7, draft)
        assert weightbus.vllm.sync_weights(llm, {"timeout": 30}) == 1
        assert weightbus.vllm.sync_weights(llm, {"timeout": 30}, draft=True) == 7
        assert _holds(worker.model_runner.get_draft_model(), draft)
        assert _holds(worker.model_runner.model, target)
        assert llm.get_weight_version() == "1"  # the label is the target model's
        assert worker.model_runner.lora_resets == 1
        assert engine.model is worker.model_runner.model
        assert layerwise.reloading == []


def _rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.parametrize("prefetch", [False, True])
def test_engine_hundred_rounds_with_flat_memory(channel, layerwise, prefetch):
    """100 rounds in a row through vLLM's lifecycle, each a new version: resident memory after
    round 100 is within one version's size of what it was after round 10 (a version kept per
    round would add 90 of them). With prefetch too (one staged version at most)."""
    llm = _engine_llm(SMALL)
    llm.init_weight_transfer_engine({"init_info": {"uri": channel, "prefetch": prefetch}})
    versions = [_version(SMALL, seed) for seed in range(2)]
    size = sum(t.numel() * t.element_size() for t in versions[0].values())
    rss = {}
    with weightbus.Publisher(channel, retention=2) as pub:
        for version in range(1, 101):
            pub.publish(version, versions[version % 2])
            assert weightbus.vllm.sync_weights(llm, {"version": version, "timeout": 30}) == version
            if prefetch:  # the round took the prefetched version (waited for, if in flight)
                assert llm.collective_rpc(weightbus.vllm.last_update)[0]["prefetched"], version
            if version in (10, 100):
                rss[version] = _rss_bytes()
    assert _holds(llm.workers[0].model_runner.model, versions[0])
    llm.collective_rpc("shutdown")
    growth = rss[100] - rss[10]
    print(f"version {size} bytes; RSS after round 10 {rss[10]}, after 100 {rss[100]}, "
          f"growth {growth}")
    assert growth < size, (growth, size)


@pytest.mark.parametrize("marker, uses", [("The same round without vLLM", "sync_weights"),
                                           ("The worker-extension round without vLLM",
                                            "update_replica")])
def test_readme_standin_snippet_runs(marker, uses):
    """The README's vLLM section: the native-engine and the worker-extension rounds on the
    stand-ins, run as written in a fresh interpreter."""
    code = readme_snippet(marker)
    assert uses in code
    done = run_python(code + "\nprint('snippet ok')\n")
    assert done.returncode == 0 and done.stdout.strip() == "snippet ok", done.stderr


# A `vllm` package for the README's vLLM snippets: LLM builds two stand-in TP workers (the GPU
# worker with its weight-transfer engine, or a worker with the extension mixed in), running the
# entry point's register_plugin as vLLM's load_general_plugins would; a trainer has published
# versions 1..18 of the stand-in Llama the workers hold.
_FAKE_VLLM = """
import sys, tempfile, types, importlib
import torch, weightbus, weightbus.vllm
from weightbus.testing import worker as _w
from weightbus.testing.llama import HfLlamaForCausalLM, LlamaConfig, VllmStyleLlamaForCausalLM
CONFIG = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                     num_attention_heads=2, num_key_value_heads=1)
CHANNEL = tempfile.mkdtemp() + "/policy"

class LLM(_w.StandInLLM):
    def __init__(self, model, weight_transfer_config=None, worker_extension_cls=None):
        weightbus.vllm.register_plugin()
        if worker_extension_cls is not None:
            module, name = worker_extension_cls.rsplit(".", 1)
            cls = getattr(importlib.import_module(module), name)
            workers = [_w.make_worker(VllmStyleLlamaForCausalLM(CONFIG), cls) for _ in range(2)]
        else:
            workers = [_w.StandInGpuWorker(VllmStyleLlamaForCausalLM(CONFIG),
                                           _w.make_vllm_config(), weight_transfer_config,
                                           rank=rank) for rank in range(2)]
        super().__init__(workers)

vllm = types.ModuleType("vllm")
vllm.LLM = LLM
config = types.ModuleType("vllm.config")
config.WeightTransferConfig = _w.WeightTransferConfig
vllm.config = config
sys.modules.update({"vllm": vllm, "vllm.config": config})
PUBLISHED = {}
with weightbus.Publisher("disk://" + CHANNEL + "?fsync=false") as pub:
    for v in range(1, 19):
        torch.manual_seed(v)
        PUBLISHED[v] = HfLlamaForCausalLM(CONFIG).state_dict()
        pub.publish(v, PUBLISHED[v])
"""


@pytest.mark.parametrize("marker, check", [
    ("in every process that creates", "assert version == 18\n"
     "assert llm.collective_rpc(weightbus.vllm.last_update)[0]['version'] == 18\n"),
    ("prefetches as the native engine does", "assert versions == [18, 18] and version == 18\n"
     "assert llm.prefix_cache_resets == 0\n")])
def test_readme_vllm_snippet_runs(marker, check):
    """The README's vLLM snippets themselves (`from vllm import LLM`, the native engine and the
    worker extension), run as written in a fresh interpreter against a `vllm` module built from
    the stand-ins, the channel path swapped for a temporary one."""
    code = readme_snippet(marker)
    assert "from vllm import LLM" in code or "LLM(model=" in code
    code = code.replace("/mnt/shared/policy", "\" + CHANNEL + \"")
    if "from vllm import LLM" not in code:
        code = "from vllm import LLM\nimport weightbus.vllm\n" + code
    program = _FAKE_VLLM + code + "\n" + check + "\nprint('snippet ok')\n"
    done = run_python(program)
    assert done.returncode == 0 and done.stdout.strip() == "snippet ok", done.stderr


class _RecordingExtension(WeightbusWorkerExtension):
    """A user's worker extension overriding the applied-version hook: records the version and
    whether the model already held all of it when the hook ran."""

    expected: dict = {}

    def weightbus_on_applied(self, applied):
        self.applied_calls = getattr(self, "applied_calls", [])
        whole = _holds(self.model_runner.model, self.expected[applied.version])
        self.applied_calls.append((applied.version, applied.changed, whole))


def test_applied_version_hooks_run_once_after_the_whole_version(channel):
    """The worker hook runs once per newly applied version in each worker, with the whole
    version already in the model; update_replica resets the prefix cache and calls on_applied
    once per engine, only when something new was applied, and resets each worker's LoRA
    state once per new version (vLLM's model runner has reset_lora_state)."""
    versions = {v: _version(SMALL, v) for v in (1, 2)}
    _RecordingExtension.expected = versions
    workers = [make_worker(VllmStyleLlamaForCausalLM(SMALL), _RecordingExtension)
               for _ in range(2)]
    llm = StandInLLM(workers)
    llm.collective_rpc("weightbus_init", (channel,))
    seen = []
    resets = seen.append
    assert weightbus.vllm.update_replica(llm, on_applied=resets) is None  # nothing yet
    with weightbus.Publisher(channel) as pub:
        pub.publish(1, versions[1])
        pub.publish(2, versions[2])
        assert weightbus.vllm.update_replica(llm, version=1, on_applied=resets) == 1
        assert weightbus.vllm.update_replica(llm, version=1, on_applied=resets) == 1
        assert weightbus.vllm.update_replica(llm, on_applied=resets) == 2
        assert weightbus.vllm.update_replica(llm, on_applied=resets) == 2
    assert seen == [1, 2] and llm.prefix_cache_resets == 2
    for w in workers:
        assert w.applied_calls == [(1, True, True), (2, True, True)]
        assert w.model_runner.lora_resets == 2
    assert weightbus.vllm.update_replica(llm, reset_prefix_cache=False) == 2
    llm.collective_rpc("weightbus_close")
    llm.collective_rpc("weightbus_init", (channel,))
    assert weightbus.vllm.update_replica(llm, reset_prefix_cache=False,
                                         on_applied=resets) == 2
    assert seen == [1, 2, 2] and llm.prefix_cache_resets == 2
    llm.collective_rpc("weightbus_close")


def test_sync_weights_on_applied_once_per_new_version(channel, layerwise):
    llm = _engine_llm(SMALL, ranks=2)
    llm.init_weight_transfer_engine({"init_info": {"uri": channel}})
    with weightbus.Publisher(channel) as pub:
        pub.publish(1, _version(SMALL, 1))
        seen = []
        assert weightbus.vllm.sync_weights(llm, on_applied=seen.append) == 1
        assert weightbus.vllm.sync_weights(llm, on_applied=seen.append) == 1  # nothing newer
        assert llm.prefix_cache_resets == 1 and seen == [1]
        pub.publish(2, _version(SMALL, 2))
        assert weightbus.vllm.sync_weights(llm, reset_prefix_cache=False) == 2
    assert llm.prefix_cache_resets == 1
    llm.collective_rpc("shutdown")


# ---- prefetch then apply (issue 13, item 9) ----

def _remove_version(channel, version):
    """Deletes a committed disk:// version's directory: a full receive of it is then
    impossible, so a round that still applies it took the prefetched copy."""
    root = channel[len("disk://"):].split("?")[0]
    directory = Path(root, "versions", f"v{version:020d}")
    assert directory.is_dir(), directory
    shutil.rmtree(directory)


def test_engine_prefetch_then_apply(channel, layerwise, tmp_path, monkeypatch):
    """With "prefetch": each TP worker receives the version in the background as soon as it is
    committed, while the engine keeps serving (both models compute a forward pass while the
    prefetches are held inside their receives at a pause fail point); the round then only
    applies it: it succeeds although the version's files are gone, and both workers hold its
    bytes."""
    pause = tmp_path / "pause"
    pause.mkdir()
    monkeypatch.setenv("WEIGHTBUS_FAILPOINTS", f"core.before_fetch=pause:{pause}")
    llm = _engine_llm(SMALL, ranks=2)
    llm.init_weight_transfer_engine({"init_info": {"uri": channel, "prefetch": True}})
    monkeypatch.delenv("WEIGHTBUS_FAILPOINTS")
    assert weightbus.vllm.prefetched_versions(llm) == [None, None]  # nothing published
    v0, v1 = _version(SMALL, 0), _version(SMALL, 1)
    for w in llm.workers:  # what the engine serves with
        w.model_runner.model.load_weights(weights=list(v0.items()))
        weightbus.vllm.process_weights_after_loading(w.model_runner.model)
    ids = torch.tensor([[1, 5, 9, 13]])
    with weightbus.Publisher(channel) as pub:
        pub.publish(1, v1)
        try:
            assert fail_point_reached(pause, "core.before_fetch")
            with torch.no_grad():
                want = _reference(SMALL, v0)(ids)
            for w in llm.workers:
                torch.testing.assert_close(w.model_runner.model(ids), want, rtol=1e-5,
                                           atol=1e-5)
        finally:
            (pause / "core.before_fetch.release").touch()
        assert weightbus.vllm.prefetched_versions(llm, timeout=30) == [1, 1]
        _remove_version(channel, 1)
        assert weightbus.vllm.sync_weights(llm, {"version": 1, "timeout": 30}) == 1
    for w in llm.workers:
        assert _holds(w.model_runner.model, v1)
        figures = w.weight_transfer_engine.last_update
        assert figures["prefetched"] and figures["version"] == 1 and figures["changed"]
    assert llm.get_weight_version() == "1" and layerwise.reloading == []
    llm.collective_rpc("shutdown")


def test_engine_prefetch_keeps_exact_versions(channel, layerwise):
    """A staged version other than the one asked for is dropped and the asked-for one received
    in full (the engine applies exactly the version it is told); for {} the staged version is
    applied unless a newer one was committed since; a version below the applied one is refused
    although the prefetch subscriber never held it."""
    versions = {v: _version(SMALL, v) for v in (1, 2, 3, 4)}
    llm = _engine_llm(SMALL)
    model = llm.workers[0].model_runner.model
    last = lambda: llm.workers[0].weight_transfer_engine.last_update  # noqa: E731
    with weightbus.Publisher(channel) as pub:
        pub.publish(1, versions[1])
        pub.publish(2, versions[2])
        llm.init_weight_transfer_engine({"init_info": {"uri": channel, "prefetch": True}})
        assert weightbus.vllm.prefetched_versions(llm, timeout=30) == [2]   # the newest
        assert weightbus.vllm.sync_weights(llm, {"version": 1, "timeout": 30}) == 1
        assert _holds(model, versions[1]) and not last()["prefetched"]
        assert weightbus.vllm.prefetched_versions(llm, timeout=30) == [2]   # prefetched again
        assert weightbus.vllm.sync_weights(llm, {"version": 2, "timeout": 30}) == 2
        assert _holds(model, versions[2]) and last()["prefetched"]
        pub.publish(3, versions[3])
        assert weightbus.vllm.prefetched_versions(llm, timeout=30) == [3]
        pub.publish(4, versions[4])
        assert weightbus.vllm.sync_weights(llm, {"timeout": 30}) == 4       # newer than staged
        assert _holds(model, versions[4]) and not last()["prefetched"]
        llm.start_weight_update()
        with pytest.raises(weightbus.FailedPreconditionError, match="holds version 4 already"):
            llm.update_weights({"update_info": {"version": 3, "timeout": 30}})
        assert _holds(model, versions[4]) and layerwise.reloading == []
        # {} with nothing newer: the prefetch's wait is cancelled, nothing is applied, and
        # the prefetch started after the round stages the next version.
        assert weightbus.vllm.sync_weights(llm, {"timeout": 30}) == 4
        pub.publish(5, versions[1])
        assert weightbus.vllm.prefetched_versions(llm, timeout=30) == [5]
        assert weightbus.vllm.sync_weights(llm, {"timeout": 30}) == 5
        assert _holds(model, versions[1]) and last()["prefetched"]
    llm.collective_rpc("shutdown")


def test_engine_failed_prefetch_falls_back_to_a_full_receive(channel, layerwise, monkeypatch):
    """A prefetch that fails (its subscriber's second fetch hits an error fail point) only makes
    that round a full receive, on the engine's own subscriber; the next prefetch runs on a
    fresh subscriber and the round after applies it."""
    monkeypatch.setenv("WEIGHTBUS_FAILPOINTS", "core.before_fetch=error@2")
    llm = _engine_llm(SMALL)
    llm.init_weight_transfer_engine({"init_info": {"uri": channel, "prefetch": True}})
    monkeypatch.delenv("WEIGHTBUS_FAILPOINTS")
    engine = llm.workers[0].weight_transfer_engine
    model = llm.workers[0].model_runner.model
    versions = {v: _version(SMALL, v) for v in (1, 2, 3)}
    with weightbus.Publisher(channel) as pub:
        pub.publish(1, versions[1])
        assert weightbus.vllm.sync_weights(llm, {"version": 1, "timeout": 30}) == 1
        assert engine.last_update["prefetched"]                  # the prefetch's 1st fetch
        pub.publish(2, versions[2])
        assert engine.wait_prefetched(timeout=30) is None        # its 2nd fetch failed
        assert weightbus.vllm.sync_weights(llm, {"version": 2, "timeout": 30}) == 2
        assert _holds(model, versions[2]) and not engine.last_update["prefetched"]
        pub.publish(3, versions[3])
        assert engine.wait_prefetched(timeout=30) == 3
        assert weightbus.vllm.sync_weights(llm, {"version": 3, "timeout": 30}) == 3
        assert _holds(model, versions[3]) and engine.last_update["prefetched"]
    assert layerwise.reloading == []
    llm.collective_rpc("shutdown")


def test_worker_extension_prefetches_while_the_worker_serves(channel, tmp_path, monkeypatch):
    """weightbus_init(prefetch=True): the receive runs in a background thread while the worker
    keeps computing (a forward pass completes while the prefetch is held inside its receive at
    a pause fail point); weightbus_update then only applies it (the version's files are gone
    by then), for min_version and for exactly `version`."""
    pause = tmp_path / "pause"
    pause.mkdir()
    monkeypatch.setenv("WEIGHTBUS_FAILPOINTS", f"core.before_fetch=pause:{pause}")
    worker = _make_workers(SMALL, 1)[0]
    worker.weightbus_init(channel, prefetch=True)
    monkeypatch.delenv("WEIGHTBUS_FAILPOINTS")
    model = worker.model_runner.model
    v0 = _version(SMALL, 0)
    model.load_weights(weights=list(v0.items()))        # what the engine serves with
    weightbus.vllm.process_weights_after_loading(model)
    versions = {v: _version(SMALL, v) for v in (1, 2)}
    ids = torch.tensor([[1, 5, 9, 13]])
    with weightbus.Publisher(channel) as pub:
        pub.publish(1, versions[1])
        try:
            assert fail_point_reached(pause, "core.before_fetch")
            assert worker.weightbus_prefetched(timeout=0) is None   # held inside the receive
            with torch.no_grad():
                want = _reference(SMALL, v0)(ids)
            torch.testing.assert_close(model(ids), want, rtol=1e-5, atol=1e-5)  # still serving
        finally:
            (pause / "core.before_fetch.release").touch()
        assert worker.weightbus_prefetched(timeout=30) == 1
        _remove_version(channel, 1)
        assert worker.weightbus_update(min_version=1, timeout=30) == 1
        assert _holds(model, versions[1]) and worker.weightbus_last_update()["prefetched"]
        pub.publish(2, versions[2])
        assert worker.weightbus_prefetched(timeout=30) == 2
        _remove_version(channel, 2)
        assert worker.weightbus_update(version=2, timeout=30) == 2
        assert _holds(model, versions[2]) and worker.weightbus_last_update()["prefetched"]
        assert worker.model_runner.lora_resets == 2
    worker.weightbus_close()


# ---- layerwise reload (issue 13, item 10) ----

def _quantized_model(config, tensors):
    """A vLLM-style Llama whose linear layers are int8 after processing (Int8LinearMethod,
    like vLLM's online FP8), loaded with `tensors` as vLLM loads at start-up."""
    model = quantize_linear_layers(VllmStyleLlamaForCausalLM(config))
    model.load_weights(weights=list(tensors.items()))
    weightbus.vllm.process_weights_after_loading(model)
    return model


def _same_state(model, reference):
    a, b = dict(model.named_parameters()), dict(reference.named_parameters())
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("path", ["engine", "worker_extension"])
def test_layerwise_reload_of_a_quantized_model(channel, monkeypatch, path):
    """A model whose parameters are int8 after loading (kernel format): through layerwise
    reload (the stand-in written from vLLM's layerwise.py), an update leaves exactly the
    kernel tensors a fresh start-up load of that version makes, in the same storage (CUDA
    graphs captured on them stay valid). Without it (load_weights + process, the fallback
    where vLLM has no layerwise reload) the checkpoint floats are cast into the int8 kernel
    tensors and the model is wrong: the reason layerwise reload is used where vLLM has it."""
    reload = LayerwiseReload()
    v0, v1, v2 = (_version(SMALL, seed) for seed in (0, 1, 2))
    model = _quantized_model(SMALL, v0)
    storage = {name: p.data_ptr() for name, p in model.named_parameters()}
    assert model.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.int8
    if path == "engine":
        monkeypatch.setattr(WeightbusWeightTransferEngine, "layerwise", reload)
        if "weightbus" not in WeightTransferEngineFactory._registry:
            WeightTransferEngineFactory.register_engine("weightbus", "weightbus.vllm",
                                                        "WeightbusWeightTransferEngine")
        llm = StandInLLM([StandInGpuWorker(model, make_vllm_config(),
                                           WeightTransferConfig(backend="weightbus"))])
        llm.init_weight_transfer_engine({"init_info": {"uri": channel}})
        update = lambda v: weightbus.vllm.sync_weights(llm, {"version": v,  # noqa: E731
                                                             "timeout": 30})
        unset = lambda: monkeypatch.setattr(WeightbusWeightTransferEngine,  # noqa: E731
                                            "layerwise", None)
    else:
        monkeypatch.setattr(WeightbusWorkerExtension, "weightbus_layerwise", reload)
        worker = make_worker(model, WeightbusWorkerExtension)
        worker.weightbus_init(channel)
        update = lambda v: worker.weightbus_update(version=v, timeout=30)  # noqa: E731
        unset = lambda: monkeypatch.setattr(WeightbusWorkerExtension,  # noqa: E731
                                            "weightbus_layerwise", None)
    ids = torch.tensor([[1, 5, 9, 13, 2]])
    with weightbus.Publisher(channel) as pub:
        pub.publish(1, v1)
        pub.publish(2, v2)
        assert update(1) == 1
        fresh = _quantized_model(SMALL, v1)
        assert _same_state(model, fresh)
        assert {name: p.data_ptr() for name, p in model.named_parameters()} == storage
        torch.testing.assert_close(model(ids), fresh(ids), rtol=0, atol=0)
        assert reload.reloading == [] and reload.finalized == 1
        unset()  # vLLM is not installed here: the plain load_weights + process fallback
        assert update(2) == 2
        fresh = _quantized_model(SMALL, v2)
        assert not _same_state(model, fresh)
        assert not torch.allclose(model(ids), fresh(ids), rtol=1e-2, atol=1e-2)


def test_the_default_timeout_scales_with_the_model_bytes():
    """Issue 13: a fixed 60 s does not fit a 140 GB model at 2 GB/s. "auto" (the default of
    both adapters) is 60 s plus the model's bytes at 0.5 GB/s; numbers and None pass through."""
    assert _default_update_info_timeout() == weightbus.vllm.AUTO_TIMEOUT
    # A 140 GB bf16 model without memory: parameters on the meta device.
    big = torch.nn.Linear(1, 1, bias=False, device="meta")
    big.weight = torch.nn.Parameter(torch.empty(70_000_000_000, dtype=torch.bfloat16,
                                                device="meta"))
    big_bytes = 140_000_000_000
    assert weightbus.vllm.model_bytes(big) == big_bytes
    assert weightbus.vllm.resolve_timeout("auto", big) == pytest.approx(60.0 + 280.0)
    assert weightbus.vllm.resolve_timeout("auto", big) > big_bytes / 2e9  # the figure
    assert weightbus.vllm.resolve_timeout("auto", None) == 60.0
    assert weightbus.vllm.resolve_timeout(5.0, big) == 5.0
    assert weightbus.vllm.resolve_timeout(None, big) is None
    with pytest.raises(ValueError, match="timeout must be seconds"):
        weightbus.vllm.resolve_timeout("soon", big)
    with pytest.raises(ValueError, match="must not be negative"):
        weightbus.vllm.resolve_timeout(-1.0, big)


def _default_update_info_timeout():
    return weightbus.vllm.WeightbusUpdateInfo().timeout


def test_a_round_failing_on_one_tp_worker_leaves_every_worker_ready_for_the_next(channel):
    """vLLM runs an RPC on every worker even when one fails (MultiprocExecutor.collective_rpc);
    a round whose update fails on worker 0 but succeeds on worker 1 must not leave worker 1's
    session open (every later start_weight_update would be refused): sync_weights finishes the
    workers that succeeded, and the next round, naming the version, brings both to it."""
    llm = _engine_llm(SMALL, ranks=2)
    llm.init_weight_transfer_engine({"init_info": {"uri": channel}})
    v1 = _version(SMALL, 1)
    with weightbus.Publisher(channel) as pub:
        pub.publish(1, v1)
        # Per-worker update_info: worker 0 asks for a version that never comes.
        with pytest.raises(weightbus.DeadlineExceededError):
            weightbus.vllm.sync_weights(llm, [{"version": 9, "timeout": 0.05},
                                              {"version": 1, "timeout": 30}])
        assert [w._weight_update_active for w in llm.workers] == [False, False]
        assert [w.weight_transfer_engine.applied_version for w in llm.workers] == [None, 1]
        v2 = _version(SMALL, 2)
        pub.publish(2, v2)
        assert weightbus.vllm.sync_weights(llm, {"version": 2, "timeout": 30}) == 2
        assert all(_holds(w.model_runner.model, v2) for w in llm.workers)
        assert llm.get_weight_version() == "2"
