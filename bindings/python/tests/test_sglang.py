# SPDX-License-Identifier: Apache-2.0
"""weightbus.sglang against the SGLang-shaped engine of weightbus.testing.sglang (SGLang's
Engine -> TokenizerManager -> Scheduler -> TpModelWorker -> ModelRunner, one scheduler per TP
rank, written from SGLang's source) with small random Llamas in checkpoint names: the disk path
(pinned version directories and update_weights_from_disk) and the custom weight loader run by
update_weights_from_tensor."""
import os
from pathlib import Path

import pytest
import torch

import weightbus
import weightbus.sglang
from conftest import publish_as_group, readme_snippet, run_python, ucx_publisher
from weightbus.testing.llama import HfLlamaForCausalLM, LlamaConfig, VllmStyleLlamaForCausalLM
from weightbus.testing.sglang import Engine, ServerArgs

SMALL = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2)


def _version(seed):
    torch.manual_seed(seed)
    return {k: v.detach().clone() for k, v in HfLlamaForCausalLM(SMALL).state_dict().items()}


INITIAL = _version(0)  # what every engine starts with (SGLang loads model_path at start-up)


def _engine(ranks=2, custom_loader=False):
    args = ServerArgs(model_path="/initial",
                      custom_weight_loader=[weightbus.sglang.LOAD_FORMAT] if custom_loader else [])
    models = [VllmStyleLlamaForCausalLM(SMALL) for _ in range(ranks)]
    for model in models:
        model.load_weights(INITIAL.items())
    return Engine(models, args)


def _assert_holds(engine, tensors):
    """Every TP rank's model holds `tensors` bit for bit (in checkpoint names)."""
    for scheduler in engine.schedulers:
        held = scheduler.tp_worker.model_runner.model.hf_state_dict()
        assert held.keys() == tensors.keys()
        for name, want in tensors.items():
            assert torch.equal(held[name].view(torch.uint8), want.view(torch.uint8)), name


def _version_dir(channel, version):
    return Path(channel[len("disk://"):].split("?")[0]) / "versions" / f"v{version:020d}"


@pytest.fixture(autouse=True)
def _close_loader_subscribers():
    yield
    weightbus.sglang.close_subscribers()


# ---- disk:// and update_weights_from_disk ----

def _published(channel, versions, **options):
    """Publishes _version(v) as version v for each v; returns {v: tensors}."""
    out = {v: _version(v) for v in versions}
    with weightbus.Publisher(channel, **options) as pub:
        for v, tensors in out.items():
            pub.publish(v, tensors)
    return out


@pytest.mark.parametrize("asked, loaded", [(None, 2), (1, 1)])
def test_disk_update_loads_the_newest_or_the_named_version_directory(channel, asked, loaded):
    """None: the newest committed version's directory; 1: exactly v1's, although v2 exists."""
    published = _published(channel, (1, 2))
    engine = _engine()
    version, (success, message, paused) = weightbus.sglang.update_weights_from_disk(
        engine, channel, version=asked)
    assert (version, success, paused) == (loaded, True, 0), message
    _assert_holds(engine, published[loaded])
    assert engine.tokenizer_manager.model_path == str(_version_dir(channel, loaded))
    assert [s.cache_flushes for s in engine.schedulers] == [1, 1]


def test_pin_keeps_the_directory_from_retention_until_released(channel):
    """retention=1: closing the publisher finishes its retention (disk_publisher.cc), so what
    is left afterwards is decided. The pinned v1 survives two newer versions while v2 (not
    pinned) is deleted; SGLang loads v1 from the pinned directory; once released, the next
    retention deletes v1."""
    v1, v3 = _version(1), _version(3)
    with weightbus.Publisher(channel, retention=1) as pub:
        pub.publish(1, v1)
        pin = weightbus.sglang.pin_disk_version(channel)
        assert (pin.version, pin.path, pin.held) == (1, _version_dir(channel, 1), True)
        pub.publish(2, _version(2))
        pub.publish(3, v3)
    assert pin.path.is_dir()
    assert not _version_dir(channel, 2).exists()
    engine = _engine()
    success, message, _ = engine.update_weights_from_disk(model_path=str(pin.path))
    assert success, message
    _assert_holds(engine, v1)
    pin.release()
    assert not pin.held
    with weightbus.Publisher(channel, retention=1) as pub:
        pub.publish(4, _version(4))
    assert not _version_dir(channel, 1).exists()
    with pytest.raises(weightbus.NotFoundError,
                       match=r"no longer holds version 1 \(it holds \[4\]\)"):
        weightbus.sglang.pin_disk_version(channel, 1)


def test_http_update_with_weight_version(channel):
    """The HTTP body (UpdateWeightFromDiskReqInput) carries weight_version; SGLang labels the
    weights with it on success."""
    v1 = _published(channel, (1,))[1]
    engine = _engine(ranks=1)
    with weightbus.sglang.pin_disk_version(channel) as pin:
        success, message, _ = engine.http_update_weights_from_disk(
            {"model_path": str(pin.path), "weight_version": str(pin.version)})
    assert success, message
    assert engine.tokenizer_manager.weight_version == "1"
    _assert_holds(engine, v1)


def test_pin_errors(channel, tmp_path):
    with pytest.raises(weightbus.NotFoundError, match="no committed version yet"):
        weightbus.sglang.pin_disk_version(channel)
    with weightbus.Publisher(channel) as pub:
        pub.publish(3, {"w": torch.zeros(2)})
    with pytest.raises(weightbus.NotFoundError,
                       match="version 4 is not committed \\(the newest is 3\\)"):
        weightbus.sglang.pin_disk_version(channel, 4)
    with pytest.raises(weightbus.NotFoundError, match=r"no longer holds version 2 .*\[3\]"):
        weightbus.sglang.pin_disk_version(channel, 2)
    for uri in ("ucx://127.0.0.1:9/x", f"delta+disk://{tmp_path}/d"):
        with pytest.raises(weightbus.InvalidArgumentError, match="needs a disk:// channel"):
            weightbus.sglang.pin_disk_version(uri)
    # A version directory without its readers' lock cannot be pinned: refused, not unpinned.
    lock = _version_dir(channel, 3) / ".readers.lock"
    os.rename(lock, lock.with_name("lock.moved"))
    with pytest.raises(weightbus.FailedPreconditionError, match="has no .readers.lock"):
        weightbus.sglang.pin_disk_version(channel)
    os.rename(lock.with_name("lock.moved"), lock)
    # LATEST naming a missing directory: a corrupt channel, not "gone".
    os.rename(_version_dir(channel, 3), _version_dir(channel, 3).with_name("moved"))
    with pytest.raises(weightbus.FailedPreconditionError, match="LATEST names version 3"):
        weightbus.sglang.pin_disk_version(channel)


def test_disk_update_reports_sglang_failure_for_a_directory_without_weights(tmp_path):
    """SGLang's own failure path, as the adapter passes it on: (False, message), model kept."""
    engine = _engine(ranks=1)
    success, message, _ = engine.update_weights_from_disk(model_path=str(tmp_path))
    assert not success and message.startswith("Failed to get weights iterator")
    _assert_holds(engine, INITIAL)


# ---- update_weights_from_tensor with the custom weight loader ----

def test_custom_loader_loads_exactly_the_named_version_on_every_rank(channel):
    published = _published(channel, (1, 2))
    v1, v2 = published[1], published[2]
    engine = _engine(ranks=2, custom_loader=True)
    assert weightbus.sglang.update_weights_from_tensor(engine, channel, 1) == (True, "Success")
    _assert_holds(engine, v1)
    assert weightbus.sglang.update_weights_from_tensor(engine, channel, 2,
                                                       flush_cache=False) == (True, "Success")
    _assert_holds(engine, v2)
    assert [s.cache_flushes for s in engine.schedulers] == [1, 1]


def test_a_group_version_is_refused_from_disk_and_assembled_by_the_custom_loader(channel):
    """A publisher group's version directory holds one checkpoint of slices per rank, which
    SGLang's update_weights_from_disk cannot load: a clear FailedPreconditionError before the
    engine is called (nothing loaded), while the custom weight loader assembles it."""
    tensors = _version(1)
    names = sorted(tensors)
    halves = [names[: len(names) // 2], names[len(names) // 2:]]
    publish_as_group(channel, 1, [{n: tensors[n] for n in half} for half in halves])
    engine = _engine(ranks=2, custom_loader=True)
    with pytest.raises(weightbus.FailedPreconditionError, match="publisher group"):
        weightbus.sglang.update_weights_from_disk(engine, channel)
    _assert_holds(engine, INITIAL)
    assert weightbus.sglang.update_weights_from_tensor(engine, channel, 1) == (True, "Success")
    _assert_holds(engine, tensors)


def test_custom_loader_errors_leave_the_model_as_it_was(channel):
    """A version the channel no longer holds: NotFoundError out of the loader (SGLang's
    ModelRunner does not catch it), nothing loaded. A request that is not weightbus's:
    InvalidArgumentError."""
    v2 = _published(channel, (1, 2), retention=1)[2]
    engine = _engine(ranks=2, custom_loader=True)
    with pytest.raises(weightbus.NotFoundError, match="version 1"):
        weightbus.sglang.update_weights_from_tensor(engine, channel, 1)
    _assert_holds(engine, INITIAL)
    assert weightbus.sglang.update_weights_from_tensor(engine, channel, 2) == (True, "Success")
    _assert_holds(engine, v2)
    with pytest.raises(weightbus.InvalidArgumentError, match="expects one tensor named"):
        engine.update_weights_from_tensor(named_tensors=[("w", torch.zeros(1))],
                                          load_format=weightbus.sglang.LOAD_FORMAT)
    _assert_holds(engine, v2)


def test_custom_loader_over_ucx():
    """Every transport: the same loader over ucx:// (skipped where ucx:// is not built)."""
    v1 = _version(1)
    with ucx_publisher() as pub:
        pub.publish(1, v1)
        engine = _engine(ranks=2, custom_loader=True)
        assert weightbus.sglang.update_weights_from_tensor(engine, pub.uri, 1) == \
            (True, "Success")
        _assert_holds(engine, v1)
        weightbus.sglang.close_subscribers()


def test_readme_standin_snippet_runs():
    """The README's SGLang section on the stand-in, run as written in a fresh interpreter."""
    code = readme_snippet("The same on the stand-in")
    assert "update_weights_from_disk" in code and "update_weights_from_tensor" in code
    done = run_python(code + "\nprint('snippet ok')\n")
    assert done.returncode == 0 and done.stdout.strip() == "snippet ok", done.stderr
