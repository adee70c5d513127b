# SPDX-License-Identifier: Apache-2.0
"""The vLLM trainer side (weightbus.vllm.WeightbusTrainerEngine) against the stand-ins written
from vLLM's source: weightbus.testing.trainer (WeightSource, TrainerInitInfo,
TrainerWeightTransferEngine, WeightTransferTrainerFactory) driving weightbus.testing.worker's
StandInLLM of StandInGpuWorkers running the native engine. The source yields one tensor at a
time and checks that the engine never holds two of them."""
import gc
import weakref

import pytest
import torch

import weightbus
from weightbus import vllm as wbv
from weightbus.testing.llama import HfLlamaForCausalLM, LlamaConfig, VllmStyleLlamaForCausalLM
from weightbus.testing.trainer import (ModuleSource, StandInWeightSyncClient, WeightSource,
                                       WeightTransferTrainerFactory)
from weightbus.testing.worker import (StandInGpuWorker, StandInLLM, WeightTransferConfig,
                                      WeightTransferEngineFactory, make_vllm_config)

CONFIG = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2)


def _llm(ranks=2):
    if "weightbus" not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine("weightbus", "weightbus.vllm",
                                                    "WeightbusWeightTransferEngine")
    return StandInLLM([StandInGpuWorker(VllmStyleLlamaForCausalLM(CONFIG), make_vllm_config(),
                                        WeightTransferConfig(backend="weightbus"), rank=rank)
                       for rank in range(ranks)])


class OneAtATime(WeightSource):
    """Yields fresh copies of a state dict's tensors, one per step, and records how many of the
    yielded tensors were still alive when the next one was produced (the engine must have let
    go of each: at most the one just yielded lives)."""

    def __init__(self, state):
        self.state = state
        self.most_alive = 0
        self.passes = 0

    def metadata(self):
        return []

    def __iter__(self):
        self.passes += 1
        alive = []
        for name, tensor in self.state.items():
            gc.collect()
            alive = [r for r in alive if r() is not None]
            self.most_alive = max(self.most_alive, len(alive))
            fresh = tensor.clone()
            alive.append(weakref.ref(fresh))
            yield name, fresh
            del fresh


def _holds(model, state):
    have = model.hf_state_dict()
    return all(torch.equal(have[name], tensor) for name, tensor in state.items())


def test_trainer_engine_streams_each_round_and_every_worker_loads_it(tmp_path):
    wbv.register_trainer_engine()
    wbv.register_trainer_engine()  # a second registration keeps the first
    llm = _llm(ranks=2)
    client = StandInWeightSyncClient(llm)
    trainer = HfLlamaForCausalLM(CONFIG)
    source = OneAtATime(trainer.state_dict())
    uri = f"disk://{tmp_path}/channel"
    engine = WeightTransferTrainerFactory.trainer_init(
        wbv.WeightbusTrainerInitInfo(uri + "?fsync=false", options={"stream_bucket": "64KiB"},
                                     rank=0),
        client=client, source=source)
    assert isinstance(engine, wbv.WeightbusTrainerEngine) and engine.is_sender
    assert client.calls == [("init_weight_transfer_engine", {"uri": uri, "options": {}})]
    for round_ in (1, 2, 3):
        with torch.no_grad():
            for p in trainer.parameters():
                p.add_(0.01 * round_)
        source.state = trainer.state_dict()
        engine.send_weights()
        assert engine.last_version == round_
        assert client.calls[-3:] == [
            ("start_weight_update", None),
            ("update_weights", {"version": round_, "timeout": 600.0}),
            ("finish_weight_update", str(round_))]
        assert llm.get_weight_version() == str(round_)
        for worker in llm.workers:
            assert _holds(worker.model_runner.model, source.state)
    assert source.passes == 3
    assert source.most_alive <= 1  # never two of the source's tensors alive at once
    with weightbus.Subscriber(uri) as sub:
        update = sub.receive(3, timeout=30)
        assert update.metadata == {"weight_version": "3"}
    engine.shutdown()


def test_non_sender_ranks_iterate_the_source_and_touch_nothing(tmp_path):
    class Refuse:
        def __getattr__(self, name):
            raise AssertionError(f"a non-sender rank called client.{name}")

    source = OneAtATime({"w": torch.ones(4)})
    engine = wbv.WeightbusTrainerEngine.trainer_init(
        wbv.WeightbusTrainerInitInfo(f"disk://{tmp_path}/channel", rank=1), client=Refuse(),
        source=source)
    assert not engine.is_sender and engine.publisher is None
    engine.send_weights()
    assert source.passes == 1
    assert not (tmp_path / "channel").exists()


def test_a_source_that_fails_midway_publishes_nothing_and_asks_no_update(tmp_path):
    class Broken(WeightSource):
        def metadata(self):
            return []

        def __iter__(self):
            yield "a", torch.ones(3)
            raise RuntimeError("gather failed on layer 1")

    llm = _llm(ranks=1)
    client = StandInWeightSyncClient(llm)
    uri = f"disk://{tmp_path}/channel?fsync=false"
    engine = wbv.WeightbusTrainerEngine.trainer_init(
        wbv.WeightbusTrainerInitInfo(uri, rank=0), client=client, source=Broken())
    with pytest.raises(RuntimeError, match="gather failed"):
        engine.send_weights()
    assert [c for c, _ in client.calls] == ["init_weight_transfer_engine"]
    assert engine.publisher.latest_version is None
    with weightbus.Subscriber(uri) as sub:
        assert sub.poll(0) is None
    # The next round with a working source publishes version 1 and updates the workers.
    trainer = HfLlamaForCausalLM(CONFIG)
    engine.source = ModuleSource(trainer)
    engine.send_weights()
    assert engine.last_version == 1
    assert _holds(llm.workers[0].model_runner.model, trainer.state_dict())
    engine.shutdown()


def test_trainer_init_refuses_a_missing_source_or_uri(tmp_path):
    with pytest.raises(ValueError, match="needs a WeightSource"):
        wbv.WeightbusTrainerEngine.trainer_init(
            wbv.WeightbusTrainerInitInfo(f"disk://{tmp_path}/c", rank=0), client=None)
    with pytest.raises(ValueError, match="uri is empty"):
        wbv.WeightbusTrainerEngine.trainer_init(wbv.WeightbusTrainerInitInfo("", rank=0),
                                                client=None, source=ModuleSource(torch.nn.Linear(2, 2)))
    assert wbv.WeightbusTrainerInitInfo.backend == "weightbus"
