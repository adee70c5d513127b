# SPDX-License-Identifier: Apache-2.0
"""weightbus.vllm against the vLLM-shaped replica in weightbus.testing.llama, on the real
stories260K weights: the worker extension (worker_extension_cls / collective_rpc) and the
weight-transfer engine adapter."""
import threading

import pytest
import torch

import llama2c_reference
import weightbus
import weightbus.vllm
from conftest import SliceWatch, fixtures_dir, late_uri
from weightbus.testing.llama import (HfLlamaForCausalLM, LlamaConfig, VllmStyleLlamaForCausalLM,
                                     load_hf_checkpoint)
from weightbus.testing.worker import StandInWorker, collective_rpc, make_worker
from weightbus.vllm import (WeightbusInitInfo, WeightbusUpdateInfo, WeightbusWeightTransferEngine,
                            WeightbusWorkerExtension)

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


def test_worker_extension_requires_init():
    worker = make_worker(None, WeightbusWorkerExtension)
    assert isinstance(worker, StandInWorker)
    with pytest.raises(RuntimeError, match="weightbus_init"):
        worker.weightbus_update()


def test_weight_transfer_engine_four_phase(stories_dir, channel):
    """The recent interface: (config, vllm_config, device, model); init, start, update, finish
    with version; trainer_send_weights publishes."""
    config, tensors = load_hf_checkpoint(stories_dir)
    replica = VllmStyleLlamaForCausalLM(config)
    engine = WeightbusWeightTransferEngine(None, None, torch.device("cpu"), replica)
    engine.init_transfer_engine(engine.parse_init_info({"uri": channel}))
    sent = {k: v.to(torch.bfloat16) for k, v in tensors.items()}
    stats = WeightbusWeightTransferEngine.trainer_send_weights(
        iter(sent.items()), {"uri": channel, "version": 7, "metadata": {"step": "7"}})
    assert stats.version == 7
    engine.start_weight_update()
    with pytest.raises(RuntimeError, match="already in progress"):
        engine.start_weight_update()
    engine.update_weights({"version": 7, "timeout": 30})
    assert engine.finish_weight_update() == 7 and engine.applied_version == 7
    with torch.no_grad():
        want = _reference(config, sent)(TOKENS)
    torch.testing.assert_close(replica(TOKENS), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="Invalid update_info"):
        engine.parse_update_info({"bogus": 1})
    with pytest.raises(RuntimeError, match="no weightbus weight update is in progress"):
        engine.finish_weight_update()
    engine.shutdown()


def test_weight_transfer_engine_loads_exactly_the_version_given(stories_dir, tmp_path):
    """update_info.version is the version loaded, not a floor (issue 13, item 3): two TP-style
    workers told version 1 both load version 1 although version 2 exists, and their logits are
    version 1's; a version below the one received is refused."""
    config, tensors = load_hf_checkpoint(stories_dir)
    channel = f"disk://{tmp_path}/channel?fsync=false&retention=4"
    versions = {1: _scaled(tensors, 0.5), 2: _scaled(tensors, 0.25)}  # exact in bf16
    with weightbus.Publisher(channel) as pub:
        for v, sent in versions.items():
            pub.publish(v, sent)
    replicas = [VllmStyleLlamaForCausalLM(config) for _ in range(2)]
    engines = [WeightbusWeightTransferEngine(None, None, torch.device("cpu"), r) for r in replicas]
    for engine in engines:
        engine.init_transfer_engine({"uri": channel})
    for v in (1, 2):
        with torch.no_grad():
            want = _reference(config, versions[v])(TOKENS)
        for engine, replica in zip(engines, replicas):
            engine.start_weight_update()
            engine.update_weights({"version": v, "timeout": 30})
            assert engine.finish_weight_update() == v
            torch.testing.assert_close(replica(TOKENS), want, rtol=1e-5, atol=1e-5)
    engine = engines[0]
    engine.start_weight_update()
    with pytest.raises(weightbus.FailedPreconditionError, match="holds version 2 already"):
        engine.update_weights({"version": 1, "timeout": 30})
    for e in engines:
        e.shutdown()


def test_weight_transfer_engine_two_phase_with_load_weights(stories_dir, channel):
    """The earlier interface: (config, parallel_config); receive_weights(update_info,
    load_weights) with no start/finish around it."""
    config, tensors = load_hf_checkpoint(stories_dir)
    replica = VllmStyleLlamaForCausalLM(config)
    engine = WeightbusWeightTransferEngine(None, None)
    engine.init_transfer_engine(WeightbusInitInfo(uri=channel, options={"retention": 2}))
    with weightbus.Publisher(channel) as pub:
        pub.publish(1, tensors)
    loaded = []

    def load_weights(weights):
        loaded.extend(name for name, _ in weights)
        replica.load_weights(weights)

    engine.receive_weights(WeightbusUpdateInfo(timeout=30), load_weights)
    assert engine.applied_version == 1 and loaded == list(tensors)
    engine.shutdown()


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
        assert torch.equal(model.lm_head.weight, v1["model.embed_tokens.weight"])
        v2 = _tied_version(2)
        v2["lm_head.weight"] = v2["model.embed_tokens.weight"].clone()
        pub.publish(2, v2)
        assert worker.weightbus_update(min_version=2, timeout=30) == 2
        assert torch.equal(model.lm_head.weight, v2["lm_head.weight"])
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
    replica = VllmStyleLlamaForCausalLM(TIED)
    engine = WeightbusWeightTransferEngine(None, None, torch.device("cpu"), replica)
    engine.init_transfer_engine({"uri": channel})
    v1 = _tied_version(1)
    v1["lm_head.weight"] = torch.zeros_like(v1["model.embed_tokens.weight"])
    WeightbusWeightTransferEngine.trainer_send_weights(iter(v1.items()),
                                                       {"uri": channel, "version": 1})
    with pytest.raises(weightbus.InvalidArgumentError, match='"lm_head.weight".*differs'):
        engine.receive_weights(WeightbusUpdateInfo(timeout=30))
    assert engine.applied_version is None
    engine.shutdown()
