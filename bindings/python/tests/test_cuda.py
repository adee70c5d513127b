# SPDX-License-Identifier: Apache-2.0
"""CUDA tensors through the Python binding (docs/TRANSPORTS.md, "Device memory"; CTest
python_cuda, labelled gpu).

Without a GPU (this CI's torch is CPU-only) what runs is the gating: which tensors the binding
hands to the library as they are, and the errors a CUDA tensor meets in a library without CUDA
support (UnimplementedError naming the capability) or on a machine without a usable GPU
(FailedPreconditionError naming the device). With a GPU: CUDA tensors published from and bound to
CUDA parameters, including ones that require grad, strided ones and inference tensors, over
disk:// and ucx://, bit-exact.
"""
import ctypes

import pytest
import torch

import weightbus
from weightbus import _api, _lib
from conftest import ucx_publisher

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


class _CudaLabelled:
    """A DLPack object that claims kDLCUDA for a host tensor's memory: what a mislabelled
    capsule, or a CUDA tensor on a machine without a usable GPU, looks like to the library."""

    def __init__(self, tensor):
        self._tensor = tensor

    def __dlpack__(self, stream=None):
        capsule = torch.utils.dlpack.to_dlpack(self._tensor)
        pointer = _lib.PyCapsule_GetPointer(capsule, b"dltensor")
        _lib.DLManagedTensor.from_address(pointer).dl_tensor.device = _lib.DLDevice(_lib.kDLCUDA, 0)
        return capsule

    def __dlpack_device__(self):
        return (_lib.kDLCUDA, 0)


def _gpu_usable():
    return torch.cuda.is_available()


def _expect_cuda_refusal(info, name):
    """The error a CUDA tensor whose memory is host memory gets: Unimplemented without CUDA
    support, FailedPrecondition without a GPU, InvalidArgument (host memory labelled CUDA) with
    one."""
    message = str(info.value)
    assert f'"{name}"' in message, message
    if not weightbus.supports_cuda_tensors():
        assert isinstance(info.value, weightbus.UnimplementedError), message
        assert "cuda_tensors" in message and "WEIGHTBUS_WITH_CUDA" in message, message
    elif not _gpu_usable():
        assert isinstance(info.value, weightbus.FailedPreconditionError), message
        assert "CUDA device 0" in message, message
    else:
        assert isinstance(info.value, weightbus.InvalidArgumentError), message
        assert "host memory" in message, message


def test_supports_cuda_tensors_is_the_librarys_answer():
    assert weightbus.supports_cuda_tensors() is bool(_lib.lib.wb_supports_cuda_tensors())


def test_host_tensors_are_never_staged_and_name_no_stream():
    cpu = torch.ones(3, requires_grad=True)
    assert not _api._needs_host_staging(cpu)
    assert _api._cuda_devices([cpu, torch.zeros(2)]) == []
    assert _api._caller_stream([cpu]) is None


def test_publish_of_a_cuda_labelled_tensor_is_refused_and_publishes_nothing(channel):
    with weightbus.Publisher(channel) as pub:
        with pytest.raises(weightbus.WeightbusError) as info:
            pub.publish(1, {"host": torch.ones(2), "w": _CudaLabelled(torch.arange(8.0))})
        _expect_cuda_refusal(info, "w")
        assert pub.latest_version is None
        pub.publish(1, {"host": torch.ones(2)})  # the publisher is unharmed
        assert pub.latest_version == 1


def test_bind_of_a_cuda_labelled_destination_is_refused(channel):
    with weightbus.Subscriber(channel) as sub:
        with pytest.raises(weightbus.WeightbusError) as info:
            sub.bind({"w": _CudaLabelled(torch.zeros(8))})
        _expect_cuda_refusal(info, "w")


# ---- with a GPU ----

def _roundtrip(pub, sub, published, destinations, version=1):
    sub.bind(destinations)
    pub.publish(version, published)
    update = sub.wait(version, timeout=60)
    assert update.version == version and sub.current_version == version
    return update


@needs_gpu
@pytest.mark.parametrize("bind_mode", ["staged", "direct"])
def test_cuda_parameters_that_require_grad_round_trip(tmp_path, bind_mode):
    """A trainer's CUDA parameters (requires_grad) published as they are; a replica's CUDA
    parameters (requires_grad) bound and written by the library; they stay leaves that require
    grad, and the library stages nothing in Python."""
    torch.manual_seed(0)
    trainer = torch.nn.Linear(256, 128).cuda()
    replica = torch.nn.Linear(256, 128).cuda()
    uri = f"disk://{tmp_path}/ch?fsync=false"
    with weightbus.Publisher(uri) as pub, weightbus.Subscriber(uri, bind_mode=bind_mode) as sub:
        update = _roundtrip(pub, sub, dict(trainer.named_parameters()),
                            dict(replica.named_parameters()))
        assert sub._staged == {}
        assert update["weight"] is replica.weight
    for name, param in replica.named_parameters():
        assert torch.equal(param.detach(), getattr(trainer, name).detach()), name
        assert param.requires_grad and param.is_leaf and param.grad_fn is None


@needs_gpu
def test_strided_and_inference_cuda_tensors_round_trip(tmp_path):
    base = torch.randn(64, 48, device="cuda")
    published = {"t": base.t(), "s": base[::2, 1::3], "bf": base.to(torch.bfloat16)}
    with torch.inference_mode():
        bf_dest = torch.zeros(64, 48, dtype=torch.bfloat16, device="cuda")
    t_dest = torch.zeros(64, 48, device="cuda").t()  # a strided (transposed) destination
    s_dest = torch.zeros(32, 16, device="cuda")
    uri = f"disk://{tmp_path}/ch?fsync=false"
    with weightbus.Publisher(uri) as pub, weightbus.Subscriber(uri) as sub:
        _roundtrip(pub, sub, published, {"t": t_dest, "s": s_dest, "bf": bf_dest})
    assert torch.equal(t_dest, published["t"])
    assert torch.equal(s_dest, published["s"])
    assert torch.equal(bf_dest, published["bf"])


@needs_gpu
def test_publish_reads_after_the_current_streams_work(tmp_path):
    """Work queued on the current torch stream (here a side stream) before publish is complete
    in what is published: the library waits for that stream."""
    x = torch.zeros(16 << 20, device="cuda")
    side = torch.cuda.Stream()
    uri = f"disk://{tmp_path}/ch?fsync=false"
    with weightbus.Publisher(uri) as pub, weightbus.Subscriber(uri) as sub:
        with torch.cuda.stream(side):
            x.add_(7.0)  # queued, likely still running when publish starts
            pub.publish(1, {"x": x})
        got = sub.wait(1, timeout=60)["x"]
    assert bool((got == 7.0).all())


@needs_gpu
def test_ucx_cuda_tensors_into_cuda_destinations():
    source = torch.randn(1 << 20, device="cuda")
    dest = torch.zeros(1 << 20, device="cuda")
    with ucx_publisher() as pub, weightbus.Subscriber(pub.uri, bind_mode="direct") as sub:
        _roundtrip(pub, sub, {"w": source}, {"w": dest})
    assert torch.equal(dest, source)


@needs_gpu
def test_stream_add_of_cuda_tensors_commits_bit_exact(tmp_path):
    tensors = {f"w{i}": torch.randn(1000 + i, device="cuda") for i in range(4)}
    uri = f"disk://{tmp_path}/ch?fsync=false"
    with weightbus.Publisher(uri) as pub, weightbus.Subscriber(uri) as sub:
        with pub.begin_publish(1) as stream:
            for name, t in tensors.items():
                stream.add(name, t)
            stream.commit(timeout=60)
        update = sub.wait(1, timeout=60)
        for name, t in tensors.items():
            assert torch.equal(update[name], t.cpu()), name
