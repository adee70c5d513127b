# SPDX-License-Identifier: Apache-2.0
"""weightbus.Publisher / Subscriber / Update: dtypes, layouts, zero-copy, binding, errors, GIL."""
import ctypes
import gc
import re
import signal
import subprocess
import sys
import threading
import time
import weakref

import numpy as np
import pytest
import torch

import weightbus
from weightbus import _api, _lib, _tensors
from conftest import SliceWatch, child_env, cli_path, late_uri, run_python, ucx_publisher


def test_version_and_library():
    assert weightbus.__version__ == _lib.lib.wb_version().decode()
    assert weightbus.library_path.endswith(".so") or ".so." in weightbus.library_path
    assert "BF16" in weightbus.DTYPES and "F8_E4M3" in weightbus.DTYPES


def _sample_tensors():
    base = torch.arange(48, dtype=torch.float32).reshape(6, 8)
    return {
        "f32": torch.randn(3, 4),
        "f16": torch.randn(5).half(),
        "bf16": torch.randn(2, 3).to(torch.bfloat16),
        "f64": torch.randn(2, 2, dtype=torch.float64),
        "i8": torch.tensor([-3, -2, -1, 0, 1, 2], dtype=torch.int8),
        "i16": torch.tensor([-300, 300], dtype=torch.int16),
        "i32": torch.tensor([[1, -2], [3, -4]], dtype=torch.int32),
        "i64": torch.tensor([2**40, -(2**40)]),
        "u8": torch.tensor([0, 255], dtype=torch.uint8),
        "bool": torch.tensor([True, False, True]),
        "transposed": base.t(),                   # non-contiguous (strides)
        "sliced": base[2:5, 1:7:2],               # storage offset + strides
        "scalar": torch.tensor(3.5),              # 0-d
        "empty": torch.empty(0, 4),
        "param": torch.nn.Parameter(torch.ones(3)),  # requires grad
        "np_f32": np.arange(6, dtype=np.float32).reshape(2, 3),
        "np_i64_reversed": np.arange(5, dtype=np.int64)[::-1],  # negative stride
        "np_bool": np.array([True, False]),
        "np_bf16_bits": np.array([0x3F80, 0xC000], dtype=np.uint16),  # bf16 1.0, -2.0
    }


def _expected(value):
    if isinstance(value, np.ndarray):
        return torch.from_numpy(np.array(value))  # a writable, contiguous copy
    return value.detach()


def test_roundtrip_every_dtype_and_layout(channel):
    tensors = _sample_tensors()
    readonly = np.arange(4, dtype=np.int32)
    readonly.setflags(write=False)
    tensors["np_readonly"] = readonly
    with weightbus.Publisher(channel) as pub, weightbus.Subscriber(channel) as sub:
        stats = pub.publish(1, tensors, metadata={"step": "1", "ok": "true"},
                            dtypes={"np_bf16_bits": "BF16"})
        assert stats.version == 1 and stats.bytes > 0 and stats.stall > 0
        assert pub.latest_version == 1
        update = sub.wait(1, timeout=30)
    assert update.version == 1
    assert update.names == list(tensors)
    assert update.metadata == {"step": "1", "ok": "true"}
    assert update.dtypes["bool"] == "BOOL" and update.dtypes["np_bool"] == "BOOL"
    assert update.dtypes["np_bf16_bits"] == "BF16" and update.dtypes["bf16"] == "BF16"
    manifest = update.manifest
    assert manifest["version"] == 1
    assert [t["name"] for t in manifest["tensors"]] == list(tensors)
    for name, value in tensors.items():
        got = update[name]
        if name == "np_bf16_bits":
            assert got.dtype == torch.bfloat16
            assert got.tolist() == [1.0, -2.0]
            continue
        want = _expected(value)
        assert got.dtype == want.dtype, name
        assert tuple(got.shape) == tuple(want.shape), name
        assert torch.equal(got, want), name
    assert update.stats.bytes == sum(t["nbytes"] for t in manifest["tensors"])


def test_iterable_of_pairs_and_newest_version(channel):
    with weightbus.Publisher(channel) as pub, weightbus.Subscriber(channel) as sub:
        for v in (1, 2, 3):
            pub.publish(v, [("w", torch.full((2,), float(v)))])
        update = sub.wait(0, timeout=30)  # the newest available, not the first
        assert update.version == 3 and sub.current_version == 3
        assert [(n, t.tolist()) for n, t in update] == [("w", [3.0, 3.0])]


def test_update_is_a_state_dict_for_load_state_dict(channel):
    """An Update is a Mapping of name -> tensor: a real torch module loads it with
    load_state_dict, bit for bit; strict=True refuses a version missing a parameter, strict=False
    reports it. Iterating the Update itself still yields (name, tensor) pairs."""
    from collections.abc import Mapping
    torch.manual_seed(5)
    source = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.LayerNorm(4))
    state = {k: v.detach().clone() for k, v in source.state_dict().items()}
    with weightbus.Publisher(channel) as pub:
        pub.publish(1, state)
        pub.publish(2, {k: v for k, v in state.items() if k != "1.bias"})
    target = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.LayerNorm(4))
    with weightbus.Subscriber(channel) as sub:
        with sub.receive(1) as update:
            assert isinstance(update, Mapping)
            assert update.keys() == list(state) and len(update.values()) == len(state)
            assert update.get("nope") is None and update.get("0.weight") is update["0.weight"]
            assert [name for name, _ in update] == list(state)
            result = target.load_state_dict(update, strict=True)
            assert (result.missing_keys, result.unexpected_keys) == ([], [])
        for name, tensor in target.state_dict().items():
            assert torch.equal(tensor.view(torch.uint8), state[name].view(torch.uint8)), name
        with sub.receive(2) as update:
            with pytest.raises(RuntimeError, match='Missing key\\(s\\) in state_dict: "1.bias"'):
                target.load_state_dict(update, strict=True)
            assert target.load_state_dict(update, strict=False).missing_keys == ["1.bias"]


def test_poll_takes_what_is_there_without_waiting(channel):
    with weightbus.Publisher(channel) as pub, weightbus.Subscriber(channel) as sub:
        assert sub.poll(1) is None                    # nothing committed: None, no error
        pub.publish(1, {"w": torch.ones(2)})
        pub.publish(2, {"w": torch.full((2,), 2.0)})
        update = sub.poll(1)
        assert update.version == 2 and update["w"].tolist() == [2.0, 2.0]
        assert sub.poll(sub.current_version + 1) is None
        assert sub.current_version == 2


def test_receive_takes_exactly_the_version_asked_for(tmp_path):
    """Subscriber.receive(v): v's bytes while newer versions exist, v itself again, NotFound
    naming what the channel holds once v is retired, FailedPrecondition below the current
    version, a timeout for a version not committed yet (issue 12, one version per replica)."""
    channel = f"disk://{tmp_path}/channel?fsync=false&retention=2"
    with weightbus.Publisher(channel) as pub:
        for v in (1, 2, 3):
            pub.publish(v, {"w": torch.full((4,), float(v))})
    # The publisher finished its retention pass when it closed: versions 2 and 3 stay.
    with weightbus.Subscriber(channel) as sub:
        with pytest.raises(weightbus.NotFoundError,
                           match=r"version 1 is no longer on the channel \(it holds 2, 3;"):
            sub.receive(1, timeout=30)
        assert sub.current_version is None
        dest = torch.zeros(4)
        sub.bind({"w": dest})
        update = sub.receive(2, timeout=30)
        assert update.version == 2 and sub.current_version == 2
        assert dest.tolist() == [2.0] * 4          # version 2's bytes, not the newest's
        assert sub.receive(2, timeout=30).version == 2  # a reload of the same version
        with pytest.raises(weightbus.FailedPreconditionError, match="holds version 2 already"):
            sub.receive(1, timeout=30)
        with pytest.raises(weightbus.DeadlineExceededError,
                           match="version 4 was not committed by the deadline"):
            sub.receive(4, timeout=0.3)
        assert sub.current_version == 2 and dest.tolist() == [2.0] * 4


def test_receive_waits_for_a_future_version_and_close_cancels_it(channel, monkeypatch):
    """A version not committed yet is waited for in slices (Ctrl-C and close() interrupt it)
    and then received, even when a newer one follows at once."""
    watch = SliceWatch(monkeypatch, function="wb_subscriber_receive_version")
    with weightbus.Publisher(channel) as pub, weightbus.Subscriber(channel) as sub:
        pub.publish(1, {"w": torch.ones(2)})
        got = []
        thread = threading.Thread(target=lambda: got.append(sub.receive(2, timeout=60)))
        thread.start()
        assert watch.not_yet.wait(30), "receive never waited a slice"
        pub.publish(2, {"w": torch.full((2,), 2.0)})
        pub.publish(3, {"w": torch.full((2,), 3.0)})
        thread.join(60)
        assert not thread.is_alive()
        assert got[0].version == 2 and got[0]["w"].tolist() == [2.0, 2.0]
    sub = weightbus.Subscriber(channel)
    watch = SliceWatch(monkeypatch, function="wb_subscriber_receive_version")
    _close_cancels_the_call_in_flight(sub, lambda: sub.receive(9, timeout=60), watch)


def _c_data_pointer(update, index):
    dl = ctypes.POINTER(_lib.DLTensor)()
    weightbus.errors.check(_lib.lib.wb_update_tensor(update._h(), index, None, None,
                                                     ctypes.byref(dl)))
    return dl.contents.data


def test_receive_is_zero_copy_and_outlives_the_update(channel):
    with weightbus.Publisher(channel) as pub:
        pub.publish(1, {"a": torch.arange(16, dtype=torch.float32), "b": torch.ones(3)})
    sub = weightbus.Subscriber(channel)
    update = sub.wait(1, timeout=30)
    a = update["a"]
    assert a.data_ptr() == _c_data_pointer(update, 0)       # a view of the library's buffer
    assert update["a"] is a                                   # one view per tensor
    assert update.numpy("a").ctypes.data == a.data_ptr()     # numpy view of the same bytes
    update.close()
    sub.close()
    del update, sub
    assert a.tolist() == list(range(16))  # the tensor keeps the memory alive


def test_closed_update_and_subscriber_refuse_calls(channel):
    with weightbus.Publisher(channel) as pub:
        pub.publish(1, {"a": torch.zeros(2)})
    sub = weightbus.Subscriber(channel)
    update = sub.wait(1, timeout=30)
    update.close()
    with pytest.raises(ValueError, match="Update is closed"):
        update["a"]
    sub.close()
    with pytest.raises(ValueError, match="Subscriber is closed"):
        sub.wait(0, timeout=0)


def test_publish_reads_caller_memory_in_place():
    t = torch.randn(4, 4)
    arr = np.ones((3, 2), dtype=np.float32)
    outgoing = _tensors.Outgoing(3)
    outgoing.set(0, "t", t)
    outgoing.set(1, "arr", arr)
    outgoing.set(2, "col", t[:, 1])
    assert outgoing.tensors[0].data == t.data_ptr()
    assert outgoing.tensors[1].data == arr.ctypes.data
    assert outgoing.tensors[2].data == t[:, 1].data_ptr()
    assert [outgoing.tensors[2].strides[i] for i in range(1)] == [4]


def test_bind_receives_into_existing_parameters(channel):
    source = torch.nn.Linear(4, 3)
    published = {k: v.detach().clone() for k, v in source.state_dict().items()}
    replica = torch.nn.Linear(4, 3)
    storage = torch.zeros(4, 3)
    strided_dest = storage.t()              # [3, 4] non-contiguous destination
    numpy_dest = np.zeros(3, dtype=np.float32)
    bf16_bits = np.zeros(2, dtype=np.uint16)
    with weightbus.Publisher(channel) as pub, weightbus.Subscriber(channel) as sub:
        sub.bind(dict(replica.named_parameters()))
        sub.bind({"copy": strided_dest, "bias_np": numpy_dest})
        sub.bind({"bits": bf16_bits}, dtypes={"bits": "BF16"})
        pub.publish(1, {**published, "copy": published["weight"],
                        "bias_np": published["bias"],
                        "bits": torch.tensor([1.0, -2.0], dtype=torch.bfloat16)})
        update = sub.wait(1, timeout=30)
    assert torch.equal(replica.weight, published["weight"])
    assert torch.equal(replica.bias, published["bias"])
    assert update["weight"] is replica.weight        # bound names yield the caller's tensor
    assert torch.equal(strided_dest, published["weight"])
    assert np.array_equal(numpy_dest, published["bias"].numpy())
    assert bf16_bits.tolist() == [0x3F80, 0xC000]


def test_bind_mismatch_raises_and_writes_nothing(channel):
    dest = torch.full((3, 2), 7.0)
    with weightbus.Publisher(channel) as pub, weightbus.Subscriber(channel) as sub:
        pub.publish(1, {"w": torch.zeros(2, 3)})
        sub.bind({"w": dest})
        with pytest.raises(weightbus.InvalidArgumentError) as info:
            sub.wait(1, timeout=30)
        assert "is F32 [2, 3] but its bound destination is F32 [3, 2]" in str(info.value)
        assert isinstance(info.value, ValueError) and not info.value.retryable
        assert torch.equal(dest, torch.full((3, 2), 7.0))
        sub.unbind("w")
        assert sub.wait(1, timeout=30)["w"].shape == (2, 3)
        with pytest.raises(ValueError, match="read-only"):
            ro = np.zeros(2)
            ro.setflags(write=False)
            sub.bind({"ro": ro})


def test_errors_are_typed_and_carry_the_message(channel, tmp_path):
    with pytest.raises(weightbus.InvalidArgumentError, match="retentionn") as info:
        weightbus.Publisher(channel, retentionn=3)
    assert info.value.status == 100 and info.value.status_name == "WB_INVALID_ARGUMENT"
    with pytest.raises(weightbus.UnimplementedError, match="disk") as info:
        weightbus.Subscriber("nope:///x")
    assert isinstance(info.value, NotImplementedError)
    with weightbus.Publisher(channel, retention=2, fsync=False) as pub:
        with pytest.raises(weightbus.FailedPreconditionError,
                           match="another publisher holds the channel"):
            weightbus.Publisher(channel)
        pub.publish(5, {"x": torch.zeros(1)})
        assert not pub.last_stats.unchanged
        assert pub.publish(5, {"x": torch.zeros(1)}).unchanged  # a retry: nothing written
        with pytest.raises(weightbus.FailedPreconditionError,
                           match="cannot publish version 5: the channel already has version 5 "
                                 "with other content: tensor \"x\""):
            pub.publish(5, {"x": torch.ones(1)})
        with pytest.raises(weightbus.InvalidArgumentError, match='"x": dtype override F32'):
            pub.publish(6, {"x": np.zeros(2, np.uint8)}, dtypes={"x": "F32"})
        with pytest.raises(TypeError, match="no safetensors element type"):
            pub.publish(6, {"x": torch.zeros(2, dtype=torch.complex128)})
        with pytest.raises(ValueError, match="dtypes names tensors that are not published"):
            pub.publish(6, {"x": torch.zeros(1)}, dtypes={"y": "BF16"})
    with weightbus.Subscriber(channel) as sub:
        with pytest.raises(weightbus.DeadlineExceededError, match="no version >= 9") as info:
            sub.wait(9, timeout=0.05)
        assert info.value.retryable and isinstance(info.value, TimeoutError)
    assert set(weightbus.errors.ERRORS) == {1, 2, 3, 4, 100, 101, 102, 103, 104, 105, 106, 107,
                                            108, 200, 201}
    for status, cls in weightbus.errors.ERRORS.items():
        assert _lib.lib.wb_status_string(status).decode().startswith(cls.status_name)
        assert cls.retryable == (1 <= status <= 99)


def test_blocking_wait_releases_the_gil(channel):
    """A thread blocks in wait(); this thread must still run Python (and publish what the
    other waits for). If wait() held the GIL, the publish could only start after the wait
    timed out, and the waiter would get DeadlineExceededError."""
    results = {}
    entered = threading.Event()
    sub = weightbus.Subscriber(channel)

    def waiter():
        entered.set()
        try:
            results["version"] = sub.wait(1, timeout=60).version
        except weightbus.WeightbusError as e:  # pragma: no cover - the failure being tested
            results["error"] = e

    thread = threading.Thread(target=waiter)
    thread.start()
    entered.wait()
    with weightbus.Publisher(channel) as pub:
        pub.publish(1, {"x": torch.ones(4)})
    thread.join(timeout=120)
    assert results == {"version": 1}
    sub.close()


def test_ctrl_c_interrupts_a_long_wait(channel):
    """SIGINT while wait() blocks raises KeyboardInterrupt at once, not after the timeout; the
    subscriber is still usable afterwards, and a timeout says how long it waited in all."""
    sub = weightbus.Subscriber(channel)
    timer = threading.Timer(0.3, lambda: signal.pthread_kill(threading.main_thread().ident,
                                                             signal.SIGINT))
    start = time.monotonic()
    timer.start()
    with pytest.raises(KeyboardInterrupt):
        sub.wait(1, timeout=60)
    assert time.monotonic() - start < 30  # the wait's own timeout is 60 s
    with pytest.raises(weightbus.DeadlineExceededError, match=r"waited 0.35 s in all"):
        sub.wait(1, timeout=0.35)
    with weightbus.Publisher(channel) as pub:
        pub.publish(1, {"x": torch.ones(4)})
    assert sub.wait(1, timeout=30).version == 1
    sub.close()


def test_cuda_tensors_go_through_host_memory(channel, monkeypatch):
    """The host-staging path used for CUDA tensors, exercised with CPU tensors standing in
    (no GPU here); with a GPU, test_cuda_roundtrip covers the real thing."""
    monkeypatch.setattr(_api, "_needs_host_staging", lambda t: _tensors.is_torch_tensor(t))
    dest = torch.zeros(2, 3)
    with weightbus.Publisher(channel) as pub, weightbus.Subscriber(channel) as sub:
        sub.bind({"w": dest})
        assert "w" in sub._staged and sub._staged["w"][1] is not dest
        pub.publish(1, {"w": torch.arange(6.0).reshape(2, 3)})
        update = sub.wait(1, timeout=30)
    assert dest.tolist() == [[0, 1, 2], [3, 4, 5]]
    assert update["w"] is dest


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_roundtrip(channel):
    source = torch.randn(4, 4, device="cuda")
    dest = torch.zeros(4, 4, device="cuda")
    with weightbus.Publisher(channel) as pub, weightbus.Subscriber(channel) as sub:
        sub.bind({"w": dest})
        pub.publish(1, {"w": source})
        sub.wait(1, timeout=30)
    assert torch.equal(dest, source)


class _DLPackOnly:
    """An object that speaks only the DLPack protocol."""

    def __init__(self, tensor):
        self._tensor = tensor

    def __dlpack__(self, stream=None):
        return torch.utils.dlpack.to_dlpack(self._tensor)

    def __dlpack_device__(self):
        return (1, 0)


def test_any_dlpack_object_can_be_published(channel):
    value = torch.arange(6, dtype=torch.int16).reshape(3, 2).t()
    with weightbus.Publisher(channel) as pub, weightbus.Subscriber(channel) as sub:
        pub.publish(1, {"d": _DLPackOnly(value)})
        assert torch.equal(sub.wait(1, timeout=30)["d"], value)


def test_options_and_closed_objects(channel):
    pub = weightbus.Publisher(channel, retention=1)
    pub.publish(1, {"x": torch.zeros(1)})
    pub.close()
    pub.close()  # idempotent
    with pytest.raises(ValueError, match="Publisher is closed"):
        pub.publish(2, {"x": torch.zeros(1)})
    with pytest.raises(ValueError, match="timeout must be"):
        weightbus.Subscriber(channel).wait(0, timeout=-1)


# ---- metadata: strings only (issue 10, item 9) ----

@pytest.mark.parametrize("metadata, key", [
    ({"step": 1}, "'step'"),
    ({"ok": True}, "'ok'"),
    ({"none": None}, "'none'"),
    ({"nested": {"a": 1}}, "'nested'"),
    ({"raw": b"\x00\xff"}, "'raw'"),
    ({"fine": "x", 7: "seven"}, "7"),
    ({b"bytes-key": "x"}, "b'bytes-key'"),
])
def test_metadata_must_be_strings(channel, metadata, key):
    """Non-string metadata values or keys are refused with a TypeError naming the key, and
    nothing is published; string metadata arrives exactly as given."""
    with weightbus.Publisher(channel) as pub:
        with pytest.raises(TypeError, match=r"metadata.*" + re.escape(key)) as info:
            pub.publish(1, {"w": torch.ones(2)}, metadata=metadata)
        assert "str" in str(info.value)
        assert pub.latest_version is None
        pub.publish(1, {"w": torch.ones(2)}, metadata={"step": "1", "note": "ünï {\"json\": 1}"})
    with weightbus.Subscriber(channel) as sub:
        assert sub.wait(1, timeout=30).metadata == {"step": "1", "note": "ünï {\"json\": 1}"}


@pytest.mark.parametrize("metadata, what", [
    ({"k": "a\x00b"}, "value of 'k' contains a NUL"),
    ({"k\x00x": "v"}, "key of 'k\\x00x' contains a NUL"),
    ({"k": "\udc80"}, "value of 'k' is not valid UTF-8"),
])
def test_metadata_that_c_strings_cannot_carry_is_refused(channel, metadata, what):
    """A NUL would cut the C string short and a lone surrogate is not UTF-8: ValueError naming
    the key, nothing published (they used to arrive truncated)."""
    with weightbus.Publisher(channel) as pub:
        with pytest.raises(ValueError, match=re.escape(what)):
            pub.publish(1, {"w": torch.ones(2)}, metadata=metadata)
        assert pub.latest_version is None


def test_complex64_round_trips_and_sub_byte_tensors_are_listed(channel, tmp_path):
    """torch.complex64 publishes as C64 and comes back bit-exact; a version holding an F4 tensor
    (published from a safetensors file by the CLI) is received: its tensors are listed with
    their dtypes, the F4 one raises UnimplementedError when read but has its TensorInfo, the
    others are readable."""
    import json
    import struct
    c = torch.randn(3, 2, dtype=torch.complex64)
    with weightbus.Publisher(channel) as pub:
        pub.publish(1, {"c": c})
    with weightbus.Subscriber(channel) as sub:
        update = sub.wait(1, timeout=30)
        assert update.dtypes["c"] == "C64"
        assert torch.equal(update["c"], c)

    data_f4, data_u8 = bytes(range(8)), bytes([7, 9])
    header = json.dumps({"w4": {"dtype": "F4", "shape": [16], "data_offsets": [0, 8]},
                         "b": {"dtype": "U8", "shape": [2], "data_offsets": [8, 10]}}).encode()
    header += b" " * (-len(header) % 8)
    model = tmp_path / "f4"
    model.mkdir()
    (model / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header +
                                              data_f4 + data_u8)
    uri = f"disk://{tmp_path}/f4ch?fsync=false"
    done = subprocess.run([str(cli_path()), "publish", uri, "--from", str(model), "--version",
                           "1"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    with weightbus.Subscriber(uri) as sub:
        update = sub.wait(1, timeout=30)
        assert update.names == ["w4", "b"]
        assert update.dtypes == {"w4": "F4", "b": "U8"}
        assert update["b"].tolist() == [7, 9]
        with pytest.raises(weightbus.UnimplementedError, match="w4"):
            update["w4"]
        # Its manifest entry is readable all the same (wb_update_tensor_info).
        info = update.tensor_info("w4")
        assert (info.dtype, info.shape, info.nbytes, info.shard) == ("F4", (16,), 8, None)


def test_metadata_must_be_a_mapping(channel):
    with weightbus.Publisher(channel) as pub:
        with pytest.raises(TypeError, match="metadata must be a mapping"):
            pub.publish(1, {"w": torch.ones(2)}, metadata=[("step", "1")])
        assert pub.latest_version is None


# ---- host staging (the CUDA path, run with CPU tensors): issue 10, item 8 ----

def _force_staging(monkeypatch):
    monkeypatch.setattr(_api, "_needs_host_staging", lambda t: _tensors.is_torch_tensor(t))


def test_staged_copy_into_parameters_that_require_grad(channel, monkeypatch):
    """README's own `sub.bind(dict(model.named_parameters()))` through the staging path:
    parameters that require grad are written (under no_grad) and keep requiring grad."""
    _force_staging(monkeypatch)
    source, replica = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
    with weightbus.Publisher(channel) as pub, weightbus.Subscriber(channel) as sub:
        sub.bind(dict(replica.named_parameters()))
        assert set(sub._staged) == {"weight", "bias"}
        pub.publish(1, {k: v.detach() for k, v in source.named_parameters()})
        update = sub.wait(1, timeout=30)
        assert update.version == 1 and sub.current_version == 1
    for name, param in replica.named_parameters():
        assert torch.equal(param.detach(), getattr(source, name).detach()), name
        assert param.requires_grad and param.grad_fn is None and param.is_leaf


def test_staged_copy_into_inference_mode_tensors(channel, monkeypatch):
    """Inference tensors (created under torch.inference_mode, as an inference server may hold
    its weights) are written under inference mode."""
    _force_staging(monkeypatch)
    with torch.inference_mode():
        dest = torch.zeros(2, 3)
    with weightbus.Publisher(channel) as pub, weightbus.Subscriber(channel) as sub:
        sub.bind({"w": dest})
        pub.publish(1, {"w": torch.arange(6.0).reshape(2, 3)})
        assert sub.wait(1, timeout=30).version == 1 and sub.current_version == 1
    assert dest.tolist() == [[0, 1, 2], [3, 4, 5]]


class _CopyFailsOnce(torch.Tensor):
    """A destination whose next copy_ raises (the fault injected into the staging copy)."""
    failures = 0

    def copy_(self, *args, **kwargs):
        if type(self).failures > 0:
            type(self).failures -= 1
            raise RuntimeError("injected: this destination refuses the copy")
        return super().copy_(*args, **kwargs)


def test_staging_failure_keeps_the_previous_version_current(channel, monkeypatch):
    """A staging copy that fails after the first destination was written: the wait raises
    naming the tensor and both versions, current_version stays at the previous version, and
    poll(current_version + 1) delivers the version again and applies it to every destination."""
    _force_staging(monkeypatch)
    first = torch.nn.Parameter(torch.zeros(3))          # requires grad
    second = torch.zeros(2).as_subclass(_CopyFailsOnce)

    def version(v):
        return {"first": torch.full((3,), float(v)), "second": torch.full((2,), 10.0 * v)}

    with weightbus.Publisher(channel) as pub, weightbus.Subscriber(channel) as sub:
        sub.bind({"first": first, "second": second})
        assert list(sub._staged) == ["first", "second"]
        pub.publish(1, version(1))
        assert sub.wait(1, timeout=30).version == 1 and sub.current_version == 1
        pub.publish(2, version(2))
        _CopyFailsOnce.failures = 1
        with pytest.raises(weightbus.InvalidArgumentError) as info:
            sub.wait(2, timeout=30)
        message = str(info.value)
        assert 'tensor "second" of version 2' in message, message
        assert "injected: this destination refuses the copy" in message, message
        assert "version 1 stays current" in message, message
        assert isinstance(info.value.__cause__, RuntimeError)
        assert sub.current_version == 1                  # not advanced past the model
        # Documented: destinations before the failing one already hold the new version.
        assert first.tolist() == [2.0] * 3 and second.tolist() == [10.0] * 2
        update = sub.poll(sub.current_version + 1)
        assert update is not None and update.version == 2
        assert sub.current_version == 2
        assert first.tolist() == [2.0] * 3 and second.tolist() == [20.0] * 2
        assert update["second"] is second
        assert sub.poll(sub.current_version + 1) is None  # nothing newer


# ---- waits wait their whole timeout for a publisher that is not there yet: item 4 ----

LATE_PUBLISHER = r'''
import sys, torch, weightbus
with weightbus.Publisher(sys.argv[1]) as pub:
    pub.publish(1, {"w": torch.arange(6, dtype=torch.float32)})
    print("published", flush=True)
    sys.stdin.readline()  # keeps serving (ucx) until the test has received
'''


@pytest.mark.parametrize("transport", ["ucx", "disk"])
def test_wait_waits_for_a_publisher_that_starts_later(transport, tmp_path, monkeypatch):
    """A replica started before its trainer: wait() keeps waiting while the publisher is not
    there (slices ending in Unavailable or DeadlineExceeded are "not yet"), and receives the
    version of a publisher process started only after a slice of the wait found nothing."""
    uri = late_uri(transport, tmp_path)
    watch = SliceWatch(monkeypatch)
    sub = weightbus.Subscriber(uri)
    children = []

    def start_publisher():
        watch.not_yet.wait()
        children.append(subprocess.Popen(
            [sys.executable, "-c", LATE_PUBLISHER, uri], env=child_env(), stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))

    starter = threading.Thread(target=start_publisher)
    starter.start()
    try:
        update = sub.wait(1, timeout=120)
        assert update.version == 1 and update["w"].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
        assert sub.current_version == 1
    finally:
        watch.not_yet.set()
        starter.join()
        out, err = children[0].communicate("\n", timeout=120)
        sub.close()
    assert children[0].returncode == 0, err
    assert out == "published\n"
    not_yet = {weightbus.UnavailableError.status, weightbus.DeadlineExceededError.status}
    assert watch.statuses[0] in not_yet and watch.statuses[-1] == 0, watch.statuses


def test_wait_without_a_publisher_raises_its_last_error_after_the_whole_timeout(tmp_path):
    """No publisher at all: the wait lasts its whole timeout (not one slice), then raises the
    last slice's error with the library's message and how long it waited in all."""
    uri = late_uri("ucx", tmp_path)
    with weightbus.Subscriber(uri) as sub:
        start = time.monotonic()
        with pytest.raises((weightbus.UnavailableError, weightbus.DeadlineExceededError)) as info:
            sub.wait(1, timeout=0.5)
        assert time.monotonic() - start >= 0.5
        message = str(info.value)
        assert uri.split("//")[1].split("/")[0] in message, message   # names the peer
        assert message.endswith("(waited 0.5 s in all)"), message
        assert info.value.retryable


def _close_cancels_the_call_in_flight(handle, call, watch):
    """Runs `call` in another thread; once one of its slices came back without success
    (`watch`, a SliceWatch), closes `handle` here, and checks that the call raised
    CancelledError and that close() returned only once it had left the library."""
    outcome = []

    def caller():
        try:
            call()
            outcome.append(None)
        except BaseException as e:  # noqa: B902 - the test inspects whatever was raised
            outcome.append(e)

    thread = threading.Thread(target=caller)
    thread.start()
    assert watch.not_yet.wait(30), "the call never ran a slice"
    handle.close()
    thread.join(30)
    assert not thread.is_alive()
    assert isinstance(outcome[0], weightbus.CancelledError), outcome


def test_close_from_another_thread_cancels_a_wait_in_flight(channel, monkeypatch):
    """close() while another thread waits: the wait raises CancelledError, close() returns
    once the wait has left the library, and the handle is destroyed only then (issue 10,
    item 1: this segfaulted)."""
    watch = SliceWatch(monkeypatch)
    sub = weightbus.Subscriber(channel)
    _close_cancels_the_call_in_flight(sub, lambda: sub.wait(min_version=5, timeout=60), watch)
    with pytest.raises(ValueError, match="Subscriber is closed"):
        sub.wait(timeout=0)


def test_close_during_publish_and_cancel_from_c():
    """Cancel through the C API makes later calls fail with CancelledError; close() after it
    destroys the handle."""
    pub = weightbus.Publisher("disk:///tmp/wb-never-created-" + str(time.time_ns()))
    assert _lib.lib.wb_publisher_cancel(pub._h()) == 0
    with pytest.raises(weightbus.CancelledError, match="being closed"):
        pub.publish(1, {"w": torch.zeros(4)})
    pub.close()


def test_inherited_handles_fail_in_a_forked_child(channel):
    """A subscriber and publisher inherited across os.fork() refuse every call in the child
    with FailedPreconditionError at once (this hung past its timeout); the parent's keep
    working (issue 10, item 2)."""
    code = f"""
import os, sys, torch, weightbus
pub = weightbus.Publisher({channel!r})
sub = weightbus.Subscriber({channel!r})
pub.publish(1, {{"w": torch.arange(6.0)}})
assert sub.wait(1, timeout=30).version == 1
pid = os.fork()
if pid == 0:
    code = 0
    for call in (lambda: sub.wait(2, timeout=3), lambda: sub.poll(), lambda: sub.current_version,
                 lambda: pub.publish(2, {{"w": torch.zeros(6)}}, timeout=3)):
        try:
            call()
            code = 1
        except weightbus.FailedPreconditionError as e:
            if "fork" not in str(e):
                code = 2
        except BaseException as e:
            print("child:", type(e).__name__, e, file=sys.stderr)
            code = 3
    sub.close()
    pub.close()
    os._exit(code)
_, status = os.waitpid(pid, 0)
assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
pub.publish(2, {{"w": torch.ones(6)}})
update = sub.wait(2, timeout=30)
assert torch.equal(update["w"], torch.ones(6))
print("parent ok")
"""
    result = run_python(code)
    assert result.returncode == 0, result.stderr
    assert "parent ok" in result.stdout


# ---- what the C++ API has, through the C API (issue 11) ----

def test_transports_and_settings_are_the_registry_the_cli_prints():
    """weightbus.transports() and settings() list what `weightbus --version` and `weightbus
    settings` print from the C++ registry: the same schemes, and each setting's env variable
    and doc line."""
    schemes = weightbus.transports()
    assert schemes == sorted(schemes) and "disk" in schemes
    version = subprocess.run([str(cli_path()), "--version"], capture_output=True, text=True,
                             check=True, timeout=60).stdout.split("\n")
    assert [line for line in version[1:] if line] == schemes
    settings = weightbus.settings()
    assert settings[0].scope == "core"
    printed = subprocess.run([str(cli_path()), "settings"], capture_output=True, text=True,
                             check=True, timeout=60).stdout
    rows = [line for line in printed.splitlines() if line and not line.startswith("#")]
    assert len(rows) == len(settings)
    for row, s in zip(rows, settings):
        assert row.split()[:2] == [s.scope, s.name], (row, s)
        assert s.env in row and row.endswith(s.doc), (row, s)
    retention = next(s for s in settings if (s.scope, s.name) == ("disk", "retention"))
    assert retention == weightbus.SettingInfo("disk", "retention", "int >= 1 versions", "3",
                                              "WEIGHTBUS_DISK_RETENTION", retention.doc)
    assert {s.scope for s in settings} <= {"core", *schemes}


def test_uri_is_the_handles_own(channel):
    with weightbus.Publisher(channel) as pub, weightbus.Subscriber(channel) as sub:
        assert pub.uri == channel and sub.uri == channel


def test_shards_round_trip_and_are_checked(channel):
    """Publisher.publish(shards=...) records shards in the manifest; Update.tensor_info reads
    them back with dtype, shape, nbytes and the XXH3 checksum the manifest holds."""
    a = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    b = np.arange(4, dtype=np.int32)
    with weightbus.Publisher(channel) as pub, weightbus.Subscriber(channel) as sub:
        pub.publish(1, {"a": a, "b": b, "c": torch.zeros(2, 2)},
                    shards={"a": weightbus.Shard((4, 6), (2, 3)), "c": ([2, 4], [0, 2])})
        update = sub.wait(1, timeout=30)
        info = update.tensor_info("a")
        assert info == weightbus.TensorInfo("a", "F32", (2, 3), 24, info.xxh3,
                                            weightbus.Shard((4, 6), (2, 3)))
        assert info.xxh3 == int(update.manifest["tensors"][0]["xxh3"], 16)
        assert update.tensor_info("b") == weightbus.TensorInfo(
            "b", "I32", (4,), 16, int(update.manifest["tensors"][1]["xxh3"], 16), None)
        assert update.tensor_info("c").shard == weightbus.Shard((2, 4), (0, 2))
        with pytest.raises(KeyError, match="no tensor named 'nope'"):
            update.tensor_info("nope")
        with pytest.raises(weightbus.InvalidArgumentError,
                           match=r'tensor "a": slice of shape \[2, 3\] at offsets \[3, 3\] does '
                                 r'not fit in global shape \[4, 6\] \(dimension 0\)'):
            pub.publish(2, {"a": a}, shards={"a": ((4, 6), (3, 3))})
        with pytest.raises(weightbus.InvalidArgumentError, match="must have the rank of shape"):
            pub.publish(2, {"a": a}, shards={"a": ((6,), (0,))})
        with pytest.raises(ValueError, match=r"shards names tensors that are not published: "
                                             r"\['z'\]"):
            pub.publish(2, {"a": a}, shards={"z": ((4, 6), (0, 0))})
        with pytest.raises(TypeError, match="must be a weightbus.Shard or a pair"):
            pub.publish(2, {"a": a}, shards={"a": 7})
        with pytest.raises(ValueError, match="differ in length"):
            pub.publish(2, {"a": a}, shards={"a": ((4, 6), (0,))})
        assert pub.latest_version == 1  # nothing of the refused calls was published


def test_stats_report_what_a_layer_encoded(tmp_path):
    """encode/decode, wire_bytes and encoding: a plain transport carries the tensor bytes; the
    delta layer reports its encoded size (64 KiB of zeros compress), its encode/decode time and
    which encoding it chose and why."""
    zeros = {"zeros": torch.zeros(16384, dtype=torch.int32)}
    plain = f"disk://{tmp_path}/plain?fsync=false"
    with weightbus.Publisher(plain) as pub, weightbus.Subscriber(plain) as sub:
        ps = pub.publish(1, zeros)
        assert ps.wire_bytes == ps.bytes == 65536 and ps.encode == 0 and ps.encoding == ""
        us = sub.wait(1, timeout=30).stats
        assert us.wire_bytes == us.bytes == 65536 and us.decode == 0 and us.encoding == ""
    if "delta" not in weightbus.transports():
        pytest.skip("the delta layer is not built")
    layered = f"delta+disk://{tmp_path}/delta?fsync=false"
    with weightbus.Publisher(layered) as pub, weightbus.Subscriber(layered) as sub:
        ps = pub.publish(1, zeros)
        assert ps.bytes == 65536 and 0 < ps.wire_bytes < ps.bytes
        assert 0 < ps.encode <= ps.transport
        assert ps.encoding == "keyframe: the channel holds no version yet"  # which, and why
        update = sub.wait(1, timeout=30)
        assert update.stats.wire_bytes == ps.wire_bytes and update.stats.bytes == 65536
        assert update.stats.encoding == "keyframe 1"
        assert 0 < update.stats.decode <= update.stats.fetch
        assert torch.equal(update["zeros"], zeros["zeros"])


def test_wait_for_receivers_where_the_transport_cannot_tell(channel):
    with weightbus.Publisher(channel) as pub:
        pub.publish(1, {"w": torch.zeros(2)})
        with pytest.raises(weightbus.UnimplementedError,
                           match="cannot tell which subscribers received version 1"):
            pub.wait_for_receivers(1, 1, timeout=1)
        with pytest.raises(weightbus.InvalidArgumentError,
                           match="needs a count of at least 1, got 0"):
            pub.wait_for_receivers(1, 0)
        with pytest.raises(ValueError, match="count must be an int below 2\\*\\*31"):
            pub.wait_for_receivers(1, 2**31)


def test_wait_for_receivers_over_ucx(monkeypatch):
    """The publisher learns which subscribers hold a version: a wait before anybody received it
    lasts its whole timeout (in slices) and names how many had it; after a subscriber received
    it, the wait returns, also once that subscriber is gone."""
    with ucx_publisher() as pub:
        pub.publish(1, {"w": torch.arange(8, dtype=torch.float32)})
        start = time.monotonic()
        with pytest.raises(weightbus.DeadlineExceededError) as info:
            pub.wait_for_receivers(1, 1, timeout=0.3)
        assert time.monotonic() - start >= 0.3
        assert "0 of the 1 subscribers waited for had received version 1" in str(info.value)
        assert str(info.value).endswith("(waited 0.3 s in all)")
        with weightbus.Subscriber(pub.uri) as sub:
            assert sub.wait(1, timeout=30)["w"].tolist() == list(range(8))
            pub.wait_for_receivers(1, 1, timeout=30)
        pub.wait_for_receivers(1, 1, timeout=30)
        with pytest.raises(weightbus.DeadlineExceededError, match="1 of the 2 subscribers"):
            pub.wait_for_receivers(1, 2, timeout=0)

        # close() from another thread ends a wait in flight with CancelledError.
        watch = SliceWatch(monkeypatch, function="wb_publisher_wait_for_receivers")
        _close_cancels_the_call_in_flight(
            pub, lambda: pub.wait_for_receivers(1, 1000, timeout=None), watch)


def test_version_numbers_outside_uint64_are_refused_not_wrapped(channel):
    """A version is a uint64 in the C API: 2**64 must not become 0 (nor -1 become 2**64-1)."""
    tensors = {"w": np.arange(4, dtype=np.float32)}
    with weightbus.Publisher(channel) as pub, weightbus.Subscriber(channel) as sub:
        for bad in (2**64, 2**64 + 3, -1):
            with pytest.raises(ValueError, match="0..2\\*\\*64-1"):
                pub.publish(bad, tensors)
            with pytest.raises(ValueError, match="0..2\\*\\*64-1"):
                sub.receive(bad, timeout=0)
            with pytest.raises(ValueError, match="0..2\\*\\*64-1"):
                sub.wait(bad, timeout=0)
            with pytest.raises(ValueError, match="0..2\\*\\*64-1"):
                sub.poll(bad)
        for bad in (1.5, None, True):
            with pytest.raises(TypeError, match="must be an int"):
                pub.publish(bad, tensors)
            with pytest.raises(TypeError, match="must be an int"):
                sub.receive(bad, timeout=0)
        assert pub.latest_version is None  # nothing was published
        pub.publish(2**64 - 1, tensors)
        assert sub.receive(2**64 - 1, timeout=10).version == 2**64 - 1


def test_publish_works_while_another_thread_is_still_importing_torch(channel, monkeypatch):
    """While a thread imports torch, sys.modules["torch"] is a module without Tensor yet; a
    numpy publish on another thread must not trip over it (it raised AttributeError)."""
    partly_imported = type(sys)("torch")
    monkeypatch.setitem(sys.modules, "torch", partly_imported)
    with weightbus.Publisher(channel) as pub, weightbus.Subscriber(channel) as sub:
        pub.publish(1, {"w": np.arange(6, dtype=np.float32)})
        monkeypatch.setitem(sys.modules, "torch", torch)
        update = sub.receive(1, timeout=10)
        assert update["w"].tolist() == list(range(6))


def test_placements_give_each_tp_worker_its_slices(channel):
    """Subscriber(placements=..., tp_rank=, tp_size=): every worker of a TP group of 2 receives
    its slices: q_proj cut on its rows, o_proj on its columns, a norm whole, and the fused
    gate_up_proj listed by name; a degree that does not divide and a rank outside the group
    are refused naming them."""
    q = torch.arange(48, dtype=torch.float32).reshape(8, 6)
    o = torch.arange(48, dtype=torch.float32).reshape(6, 8) + 100
    gate = torch.arange(24, dtype=torch.float32).reshape(4, 6) + 200
    up = torch.arange(24, dtype=torch.float32).reshape(4, 6) + 300
    norm = torch.ones(6)
    rules = {"*.q_proj.weight": weightbus.Placement.shard(0),
             "*.o_proj.weight": weightbus.Placement.shard(1),
             "*.gate_up_proj.weight": weightbus.Placement.gate_up()}
    with weightbus.Publisher(channel) as pub:
        pub.publish(1, {"l.q_proj.weight": q, "l.o_proj.weight": o, "l.gate_proj.weight": gate,
                        "l.up_proj.weight": up, "l.norm.weight": norm})
        for r in range(2):
            with weightbus.Subscriber(channel, placements=rules, tp_rank=r, tp_size=2) as sub:
                update = sub.receive(1, timeout=30)
                assert torch.equal(update["l.q_proj.weight"], q[4 * r:4 * (r + 1)])
                assert torch.equal(update["l.o_proj.weight"], o[:, 4 * r:4 * (r + 1)])
                assert torch.equal(update["l.norm.weight"], norm)
                assert update.tensor_info("l.o_proj.weight").shape == (6, 4)
            with weightbus.Subscriber(channel, placements=rules, tp_rank=r, tp_size=2,
                                      tensors=["l.gate_up_proj.weight"]) as sub:
                update = sub.receive(1, timeout=30)
                want = torch.cat([gate[2 * r:2 * (r + 1)], up[2 * r:2 * (r + 1)]])
                assert torch.equal(update["l.gate_up_proj.weight"], want)
        with weightbus.Subscriber(channel, placements=rules, tp_rank=0, tp_size=3) as sub:
            with pytest.raises(weightbus.InvalidArgumentError,
                               match=r'tensor "l.q_proj.weight" .*TP degree 3 does not divide '
                                     r'dimension 0 of size 8'):
                sub.receive(1, timeout=30)
            assert sub.current_version is None
        with pytest.raises(weightbus.InvalidArgumentError,
                           match="TP rank 2 of a group of size 2"):
            weightbus.Subscriber(channel, placements=rules, tp_rank=2, tp_size=2)


def test_allocate_host_memory_is_published_in_place_over_ucx():
    """Publisher.allocate_host: zero-filled, 4096-byte aligned, writable memory for a trainer's
    weights; tensors viewing it, published zero-copy, arrive bit-exact; the memory outlives the
    publisher while a tensor uses it."""
    with ucx_publisher(publish_mode="zero_copy", lease="30s") as pub:
        with pytest.raises(ValueError, match="nbytes must be an int from 1"):
            pub.allocate_host(0)
        mem = pub.allocate_host(3 * 4096 + 100)
        assert len(mem) == 3 * 4096 + 100 and not memoryview(mem).readonly
        flat = torch.frombuffer(mem, dtype=torch.uint8)
        with memoryview(mem) as view:  # a view made and released frees nothing
            assert view.nbytes == len(mem)
        alive = weakref.ref(mem)
        assert flat.data_ptr() % 4096 == 0
        assert not flat.any()
        w = flat[:8192].view(torch.float32).view(32, 64)
        b = flat[8192:8592].view(torch.float32)
        w.copy_(torch.randn(32, 64))
        b.copy_(torch.arange(100, dtype=torch.float32))
        published = {"w": w.clone(), "b": b.clone()}
        with weightbus.Subscriber(pub.uri) as sub:
            assert sub.poll(1) is None  # connected: the zero-copy publish waits for it
            errors = []
            thread = threading.Thread(target=lambda: _record(errors, pub.publish, 1,
                                                             {"w": w, "b": b}, timeout=30))
            thread.start()
            update = sub.wait(1, timeout=30)
            thread.join()
            assert errors == []
            assert torch.equal(update["w"], published["w"])
            assert torch.equal(update["b"], published["b"])
            del update
    del mem, flat
    gc.collect()
    assert alive() is not None  # the tensors viewing it hold it
    w.add_(1)  # the publisher is closed; the memory lives on with the tensors viewing it
    assert torch.equal(w, published["w"] + 1)
    del w, b
    gc.collect()
    assert alive() is None  # freed with the last tensor


def _record(errors, fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - reported by the test's thread
        errors.append(e)
