# SPDX-License-Identifier: Apache-2.0
"""Publisher, Subscriber and Update over the C API."""
import contextlib
import ctypes
import json
import math
import os
import threading
import time
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

from . import _lib, _tensors
from ._lib import lib, new_params
from .errors import (ERRORS, CancelledError, DeadlineExceededError, FailedPreconditionError,
                     InvalidArgumentError, UnavailableError, check)

TensorsArg = Union[Mapping, Iterable[Tuple[str, Any]]]


# Subscriber.wait waits in slices of this many seconds, so that Ctrl-C interrupts it promptly.
_WAIT_SLICE = 0.1
# Statuses of a slice that found no version yet: retried until the wait's own deadline.
_NOT_YET = (DeadlineExceededError.status, UnavailableError.status)


def _timeout_ms(timeout: Optional[float]) -> int:
    """Seconds (None: forever) -> the C API's milliseconds (rounded up, so a positive timeout
    never becomes 0)."""
    if timeout is None:
        return _lib.WB_TIMEOUT_INFINITE
    if timeout < 0:
        raise ValueError(f"timeout must be >= 0 seconds or None, got {timeout}")
    return int(math.ceil(timeout * 1000))


def _version(value, what: str) -> int:
    """Checks a version number (a uint64 in the C API): an int (not a bool) in 0..2**64-1.
    Raises TypeError for another type, ValueError out of range (never wraps around)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must be an int, got {type(value).__name__} {value!r}")
    if not 0 <= value <= 2**64 - 1:
        raise ValueError(f"{what} must be in 0..2**64-1, got {value}")
    return value


def _items(tensors: TensorsArg):
    items = list(tensors.items()) if isinstance(tensors, Mapping) else list(tensors)
    for item in items:
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
            raise TypeError("tensors must be a dict {name: tensor} or an iterable of "
                            f"(name, tensor) pairs; got an element {item!r:.80}")
    return items


def _option_text(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _options_array(options: Mapping):
    """A wb_option_t array (and what keeps its strings alive)."""
    encoded = [(str(k).encode(), _option_text(v).encode()) for k, v in options.items()]
    array = (_lib.wb_option_t * max(len(encoded), 1))(*[_lib.wb_option_t(k, v)
                                                         for k, v in encoded])
    return array, len(encoded), encoded


def _metadata_array(metadata: Optional[Mapping]):
    """A wb_option_t array of publish metadata (and what keeps its strings alive). Keys and
    values must be str: anything else is a TypeError naming the key, never str(v) (which would
    turn None into "None" and bytes into "b'...'"); encode structured values yourself, e.g.
    with json.dumps, and decode them on the way out."""
    if metadata is None:
        return _options_array({})
    if not isinstance(metadata, Mapping):
        raise TypeError(f"metadata must be a mapping of str to str, got "
                        f"{type(metadata).__name__}")
    for key, value in metadata.items():
        if not isinstance(key, str):
            raise TypeError(f"metadata key {key!r} is {type(key).__name__}; metadata keys and "
                            "values must be str")
        if not isinstance(value, str):
            raise TypeError(f"metadata {key!r} is {type(value).__name__} ({value!r:.60}); "
                            "metadata values must be str (encode others yourself, e.g. "
                            "json.dumps)")
        # The C API carries NUL-terminated UTF-8: a NUL would silently cut the text short.
        for what, text in (("key", key), ("value", value)):
            if "\0" in text:
                raise ValueError(f"metadata {what} of {key!r} contains a NUL character, which "
                                 "metadata cannot carry")
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as e:
                raise ValueError(f"metadata {what} of {key!r} is not valid UTF-8 text: "
                                 f"{e.reason} at {e.start}") from None
    return _options_array(metadata)


def _open_params(options: Mapping):
    params = new_params(_lib.wb_open_params_t)
    array, count, keep = _options_array(options)
    params.options = ctypes.cast(array, ctypes.POINTER(_lib.wb_option_t))
    params.num_options = count
    return params, (array, keep)


def _needs_host_staging(tensor) -> bool:
    """True for tensors the library cannot take as they are: torch tensors on a device other
    than the CPU, except CUDA tensors where the library has CUDA support
    (supports_cuda_tensors(): it reads and writes them itself, docs/TRANSPORTS.md "Device
    memory"). These go through host memory in this module instead."""
    if not _tensors.is_torch_tensor(tensor) or tensor.device.type == "cpu":
        return False
    return not (tensor.device.type == "cuda" and supports_cuda_tensors())


def _cuda_devices(tensors) -> list:
    """The CUDA devices of the torch tensors among `tensors` that the library takes as they
    are, in order of first appearance."""
    devices = []
    for t in tensors:
        if (_tensors.is_torch_tensor(t) and t.device.type == "cuda" and
                not _needs_host_staging(t) and t.device not in devices):
            devices.append(t.device)
    return devices


def _caller_stream(tensors):
    """For a publish of `tensors`: the cudaStream_t the library waits for before reading their
    CUDA memory (the current torch stream of the first CUDA tensor's device), after this
    synchronizes the current streams of any other devices (the C call takes one stream); None
    without CUDA tensors."""
    devices = _cuda_devices(tensors)
    if not devices:
        return None
    import torch
    for device in devices[1:]:
        torch.cuda.current_stream(device).synchronize()
    return torch.cuda.current_stream(devices[0]).cuda_stream


@dataclass(frozen=True)
class PublishStats:
    """Figures of the last successful publish (wb_publish_stats_t): durations in seconds, sizes
    in bytes."""
    version: int
    bytes: int            # tensor bytes published
    stall: float          # wall time publish() blocked the caller
    pack: float           # packing non-contiguous tensors
    checksum_wait: float  # waiting for checksums after the transport was done
    transport: float      # the transport's part (disk: write, fsync, commit)
    unchanged: bool = False  # a retry of the latest version with the same bytes: nothing written
    encode: float = 0.0   # part of `transport` a layer (delta) spent encoding; 0 without one
    wire_bytes: int = 0   # bytes the transport carried: `bytes`, or what a layer encoded them to;
                          # 0 when a layer does not report it
    encoding: str = ""    # a layer's choice for this version and why ("delta: delta against
                          # version 7", "plain: sent plainly: ..."); "" without a layer

    @classmethod
    def _from_c(cls, s) -> "PublishStats":
        return cls(s.version, s.bytes, s.stall_ns / 1e9, s.pack_ns / 1e9,
                   s.checksum_wait_ns / 1e9, s.transport_ns / 1e9,
                   bool(s.flags & _lib.WB_PUBLISH_UNCHANGED), s.encode_ns / 1e9, s.wire_bytes,
                   (s.encoding or b"").decode("utf-8", "replace"))


@dataclass(frozen=True)
class UpdateStats:
    """Timing of one received version (wb_update_stats_t): durations in seconds, sizes in
    bytes, ready_unix_ns in nanoseconds on CLOCK_REALTIME."""
    bytes: int            # tensor bytes received
    wait: float           # until a new enough version was found
    allocate: float       # mapping library buffers (0 when recycled)
    fetch: float          # receiving the bytes (checksums overlap with it)
    verify_wait: float    # waiting for checksums after the last byte arrived
    copy_out: float       # copying staged bytes into bound destinations
    ready_unix_ns: int    # when the version was complete and verified
    decode: float = 0.0   # part of `fetch` a layer (delta) spent decoding; 0 without one
    wire_bytes: int = 0   # bytes received: `bytes`, or their encoded size under a layer; 0 when
                          # a layer does not report it
    encoding: str = ""    # how a layer reconstructed it ("delta 8 on this subscriber's copy of
                          # version 7"); "" without a layer

    @classmethod
    def _from_c(cls, s) -> "UpdateStats":
        return cls(s.bytes, s.wait_ns / 1e9, s.allocate_ns / 1e9, s.fetch_ns / 1e9,
                   s.verify_wait_ns / 1e9, s.copy_out_ns / 1e9, s.ready_unix_ns,
                   s.decode_ns / 1e9, s.wire_bytes, (s.encoding or b"").decode("utf-8", "replace"))


@dataclass(frozen=True)
class Shard:
    """This rank's slice of a larger (tensor-parallel or FSDP-sharded) tensor (wb_shard_t): the
    slice is the published tensor itself and starts at `offsets` (elements, one per dimension)
    inside a tensor of `global_shape`. Recorded in the manifest so that a consumer can
    reassemble or re-shard. Checked at publish: same rank as the tensor, 0 <= offsets[d] and
    offsets[d] + shape[d] <= global_shape[d] (else InvalidArgumentError naming the tensor)."""
    global_shape: Tuple[int, ...]
    offsets: Tuple[int, ...]

    @classmethod
    def from_dtensor(cls, tensor) -> "Shard":
        """The Shard of this rank's local tensor of a torch DTensor
        (torch.distributed.tensor.DTensor, torch >= 2.4; torch.distributed._tensor before):
        publish `tensor.to_local()` (contiguous) with it. global_shape is the DTensor's shape;
        offsets follow its placements on this rank's mesh coordinate
        (tensor.device_mesh.get_coordinate()), one mesh dimension after another, with
        DTensor's own split of a Shard(d) over k ranks: torch.chunk's, blocks of
        ceil(n / k) elements, so the last ranks' shards may be smaller or empty (an empty
        shard starts where the blocks before it end). Replicate leaves the offsets as they are
        (every rank of that mesh dimension owns the same slice; the group accepts the
        duplicates when their checksums agree).

            # FSDP2: fully_shard(model) makes every parameter a DTensor with Shard(0) on the
            # data-parallel mesh; FSDP2 + TP (2-D mesh) gives (Shard(0), Shard(d)).
            local = {n: p.to_local() for n, p in model.state_dict().items()}
            shards = {n: weightbus.Shard.from_dtensor(p) for n, p in model.state_dict().items()}
            pub.publish(step, local, shards=shards)

        Raises TypeError for a tensor that is not a DTensor, ValueError for a rank outside
        the tensor's mesh, a Partial placement (pending sums: redistribute to Shard or
        Replicate first), a _StridedShard (FSDP2 + TP's strided layout: the local tensor is not
        one rectangle of the global tensor), or a local tensor whose shape differs from the one
        its placements give (each naming the shapes and placements)."""
        mesh = getattr(tensor, "device_mesh", None)
        placements = getattr(tensor, "placements", None)
        if mesh is None or placements is None or not hasattr(tensor, "to_local"):
            raise TypeError(f"Shard.from_dtensor takes a torch DTensor, not "
                            f"{type(tensor).__name__}")
        coordinate = mesh.get_coordinate()
        if coordinate is None:
            raise ValueError(f"this rank is not in the DTensor's mesh {mesh}: it holds no shard")
        global_shape = tuple(int(n) for n in tensor.shape)
        sizes, offsets = list(global_shape), [0] * len(global_shape)
        for mesh_dim, placement in enumerate(placements):
            kind = type(placement).__name__
            if placement.is_replicate():
                continue
            if placement.is_partial() or kind == "_StridedShard" or not placement.is_shard():
                raise ValueError(
                    f"DTensor of shape {list(global_shape)} with placements {tuple(placements)}: "
                    f"{placement} on mesh dimension {mesh_dim} is not a rectangular slice "
                    f"(Shard(d) and Replicate() are); redistribute it first")
            dim, ranks = placement.dim % len(global_shape), mesh.size(mesh_dim)
            chunk = -(-sizes[dim] // ranks)  # ceil: torch.chunk's block
            start = min(chunk * coordinate[mesh_dim], sizes[dim])
            offsets[dim] += start
            sizes[dim] = min(sizes[dim], start + chunk) - start
        local = tuple(int(n) for n in tensor.to_local().shape)
        if local != tuple(sizes):
            raise ValueError(
                f"DTensor of shape {list(global_shape)} with placements {tuple(placements)} at "
                f"mesh coordinate {list(coordinate)}: the local tensor is {list(local)}, not "
                f"the {sizes} its placements give")
        return cls(global_shape, tuple(offsets))


@dataclass(frozen=True)
class Placement:
    """The slice of a tensor one worker of a tensor-parallel (TP) group receives
    (wb_placement_rule_t; docs/RESHARDING.md, "Subscribing with placements"). Build one with
    the constructors: Placement.shard(0) column-parallel (vLLM output_dim=0), shard(1)
    row-parallel (input_dim=1), replicate(), qkv(num_heads, num_kv_heads, head_size),
    gate_up(), merged(fused, parts), experts(order), experts_from_each(num_experts, fused,
    parts), and in_groups(...) on an experts placement (vLLM's FusedMoE groups)."""
    kind: int = 0                     # wb_placement_kind_t (_lib.PLACEMENT_KINDS)
    dim: int = 0
    num_heads: int = 0
    num_kv_heads: int = 0
    head_size: int = 0
    fused: str = ""
    parts: Tuple[str, ...] = ()
    expert_order: int = 0             # 0 linear, 1 round robin
    # Experts (wb_placement_experts_t): one source per expert and part when num_experts > 0;
    # the expert-parallel group (ep_size 0: the TP group) and tensor parallelism inside each
    # expert (expert_tp_size 0 or 1: whole) on dimension expert_tp_dim of an expert's part.
    num_experts: int = 0
    ep_size: int = 0
    ep_rank: int = 0
    expert_tp_size: int = 0
    expert_tp_rank: int = 0
    expert_tp_dim: int = 0

    @staticmethod
    def replicate() -> "Placement":
        return Placement()

    @staticmethod
    def shard(dim: int) -> "Placement":
        return Placement(kind=_lib.PLACEMENT_KINDS["SHARD"], dim=dim)

    @staticmethod
    def qkv(num_heads: int, num_kv_heads: int, head_size: int, fused: str = "qkv_proj",
            parts: Sequence[str] = ("q_proj", "k_proj", "v_proj")) -> "Placement":
        return Placement(kind=_lib.PLACEMENT_KINDS["QKV"], num_heads=num_heads, num_kv_heads=num_kv_heads,
                         head_size=head_size, fused=fused, parts=tuple(parts))

    @staticmethod
    def merged(fused: str, parts: Sequence[str]) -> "Placement":
        return Placement(kind=_lib.PLACEMENT_KINDS["MERGED"], fused=fused, parts=tuple(parts))

    @staticmethod
    def gate_up() -> "Placement":
        return Placement.merged("gate_up_proj", ("gate_proj", "up_proj"))

    @staticmethod
    def experts(order: str = "linear", fused: str = "",
                parts: Sequence[str] = ()) -> "Placement":
        if order not in ("linear", "round_robin"):
            raise ValueError(f"expert order {order!r} is not 'linear' or 'round_robin'")
        return Placement(kind=_lib.PLACEMENT_KINDS["EXPERTS"], fused=fused, parts=tuple(parts),
                         expert_order=int(order == "round_robin"))

    @staticmethod
    def experts_from_each(num_experts: int, fused: str, parts: Sequence[str],
                          order: str = "linear") -> "Placement":
        """Experts stored one tensor per expert (Hugging Face checkpoints): each part names its
        source by replacing the last `fused` in the destination's name, "{e}" standing for the
        expert number, as vLLM's FusedMoE.make_expert_params_mapping maps
        "experts.{e}.gate_proj." to "experts.w13_": rank r receives [E_r, rows, ...], each local
        expert's parts one after another (w13_weight: gate rows, then up rows)."""
        if num_experts < 1:
            raise ValueError(f"num_experts must be >= 1, got {num_experts}")
        if not parts or any("{e}" not in part for part in parts):
            raise ValueError(f"every part needs '{{e}}' for the expert number: {list(parts)}")
        return replace(Placement.experts(order, fused, parts), num_experts=num_experts)

    def in_groups(self, ep: Tuple[int, int], expert_tp: Tuple[int, int],
                  dim: int) -> "Placement":
        """This experts placement with its groups given as (size, rank) pairs, as vLLM's
        FusedMoE has them (ep_size/ep_rank, tp_size/tp_rank of its FusedMoEParallelConfig):
        experts dealt over `ep` (size 0: the subscriber's TP group), and dimension `dim` of each
        expert's part (vLLM's SHARD_ID_TO_SHARDED_DIM: 0 for gate and up, 1 for down) split over
        `expert_tp` (size 0 or 1: experts whole)."""
        if self.kind != _lib.PLACEMENT_KINDS["EXPERTS"]:
            raise ValueError("in_groups applies to an experts placement")
        return replace(self, ep_size=ep[0], ep_rank=ep[1], expert_tp_size=expert_tp[0],
                       expert_tp_rank=expert_tp[1], expert_tp_dim=dim)


def _placements_struct(placements, tp_rank: int, tp_size: int, tensors,
                       skip_absent: bool = False):
    """wb_placements_t for (pattern, Placement) pairs or a {pattern: Placement} dict, and what
    must stay alive while it is used."""
    items = list(placements.items()) if isinstance(placements, Mapping) else list(placements)
    keep = []
    rules = (_lib.wb_placement_rule_t * max(len(items), 1))()
    experts = (_lib.wb_placement_experts_t * max(len(items), 1))()
    for i, (pattern, p) in enumerate(items):
        if not isinstance(p, Placement):
            raise TypeError(f"placement for {pattern!r} is {type(p).__name__}, not a "
                            "weightbus.Placement")
        parts = (ctypes.c_char_p * max(len(p.parts), 1))(*[x.encode() for x in p.parts])
        keep.append(parts)
        rules[i] = _lib.wb_placement_rule_t(pattern.encode(), p.kind, p.dim, p.num_heads,
                                            p.num_kv_heads, p.head_size, p.fused.encode(),
                                            ctypes.cast(parts, ctypes.POINTER(ctypes.c_char_p)),
                                            len(p.parts), p.expert_order)
        experts[i] = _lib.wb_placement_experts_t(p.num_experts, p.ep_size, p.ep_rank,
                                                 p.expert_tp_size, p.expert_tp_rank,
                                                 p.expert_tp_dim)
    names = list(tensors or [])
    names_array = (ctypes.c_char_p * max(len(names), 1))(*[n.encode() for n in names])
    keep += [rules, experts, names_array]
    value = new_params(_lib.wb_placements_t)
    value.rules = ctypes.cast(rules, ctypes.POINTER(_lib.wb_placement_rule_t))
    value.num_rules = len(items)
    value.tp_size = tp_size
    value.tp_rank = tp_rank
    value.tensors = ctypes.cast(names_array, ctypes.POINTER(ctypes.c_char_p))
    value.num_tensors = len(names)
    value.experts = ctypes.cast(experts, ctypes.POINTER(_lib.wb_placement_experts_t))
    value.skip_absent = int(bool(skip_absent))
    return value, keep


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a version as its manifest describes it (wb_tensor_info_t)."""
    name: str
    dtype: str                # safetensors name, e.g. "BF16"
    shape: Tuple[int, ...]    # elements; () for a scalar
    nbytes: int               # bytes of the contiguous row-major tensor
    xxh3: int                 # XXH3-64 (seed 0) of those bytes, as verified on receipt
    shard: Optional[Shard]    # set when the publisher described the tensor as a shard


@dataclass(frozen=True)
class SettingInfo:
    """A setting as the library's settings registry declares it (wb_setting_info_t)."""
    scope: str          # "core" or a transport or layer scheme, e.g. "disk"
    name: str           # the key of URI queries and of Publisher/Subscriber options
    type: str           # "bool", "int", "bytes", "duration", "string" or "enum(a|b)", then
                        # the range and unit if declared: "int 1..64 versions"
    default_value: str  # as text
    env: str            # the environment variable, e.g. "WEIGHTBUS_DISK_RETENTION"
    doc: str            # one line


def _count(fn) -> int:
    count = ctypes.c_size_t()
    check(fn(ctypes.byref(count)))
    return count.value


def transports() -> List[str]:
    """The URI schemes of the transports and layers compiled into the loaded library, sorted
    (e.g. ["delta", "disk", "ucx"]; a layer is used stacked: "delta+disk://..."). Thread-safe;
    the same on every call."""
    out = []
    for i in range(_count(lib.wb_transport_count)):
        scheme = ctypes.c_char_p()
        check(lib.wb_transport_scheme(i, ctypes.byref(scheme)))
        out.append(scheme.value.decode())
    return out


def settings() -> List[SettingInfo]:
    """Every setting of the core (first) and of each compiled transport and layer, as the CLI's
    `weightbus settings` lists them. Thread-safe; the same on every call."""
    out = []
    for i in range(_count(lib.wb_setting_count)):
        info = new_params(_lib.wb_setting_info_t)
        check(lib.wb_setting_info(i, ctypes.byref(info)))
        out.append(SettingInfo(*(getattr(info, field).decode("utf-8") for field in (
            "scope", "name", "type", "default_value", "env", "doc"))))
    return out


def _shape(pointer, ndim: int) -> Tuple[int, ...]:
    return tuple(pointer[d] for d in range(ndim)) if ndim else ()


def _handle_uri(fn, handle) -> str:
    text = ctypes.c_char_p()
    check(fn(handle, ctypes.byref(text)))
    return text.value.decode("utf-8")


def _shards_array(shards: Mapping, items):
    """A wb_shard_t* array, one per published tensor (NULL: whole), and what keeps it alive.
    `shards` maps names to Shard or (global_shape, offsets)."""
    names = [name for name, _ in items]
    unknown = set(shards) - set(names)
    if unknown:
        raise ValueError(f"shards names tensors that are not published: {sorted(unknown)}")
    array = (ctypes.POINTER(_lib.wb_shard_t) * max(len(items), 1))()
    keep = [array]
    for i, name in enumerate(names):
        if name not in shards:
            continue
        shard = shards[name]
        if not isinstance(shard, Shard):
            try:
                global_shape, offsets = shard
            except (TypeError, ValueError):
                raise TypeError(f"shards[{name!r}] must be a weightbus.Shard or a pair "
                                f"(global_shape, offsets), got {shard!r:.80}") from None
            shard = Shard(tuple(global_shape), tuple(offsets))
        if len(shard.global_shape) != len(shard.offsets):
            raise ValueError(f"shards[{name!r}]: global_shape {list(shard.global_shape)} and "
                             f"offsets {list(shard.offsets)} differ in length")
        ndim = len(shard.global_shape)
        global_shape = (ctypes.c_int64 * max(ndim, 1))(*shard.global_shape)
        offsets = (ctypes.c_int64 * max(ndim, 1))(*shard.offsets)
        entry = _lib.wb_shard_t(ndim, global_shape, offsets)
        keep += [global_shape, offsets, entry]
        array[i] = ctypes.pointer(entry)
    return array, keep


class _Handle:
    """Owns one C handle; closes it once (close(), `with`, or garbage collection).

    close() may come from another thread while calls on the handle are in flight: it marks the
    handle closing (calls that start later raise CancelledError, or ValueError once it is
    closed), cancels the calls in flight through the C API where the handle type has a cancel
    (a wait for a version then raises CancelledError promptly), waits for them to return, and
    only then destroys the C handle, so no call ever uses a freed handle."""

    _destroy = None
    _cancel = None

    def __init__(self):
        self._handle = None
        self._pid = os.getpid()  # a handle belongs to the process that opened it
        self._state = threading.Condition(threading.Lock())
        self._calls = 0         # calls inside the C library on this handle
        self._closing = False

    def _check_process(self):
        # Before any lock: another thread of the parent may have held it at fork() time.
        if os.getpid() != self._pid:
            raise FailedPreconditionError(
                f"{type(self).__name__} was opened by process {self._pid} and this is process "
                f"{os.getpid()}, a forked child: a handle cannot be used across fork(); open a "
                "new one in the child")

    def _h(self):
        self._check_process()
        if self._handle is None:
            raise ValueError(f"{type(self).__name__} is closed")
        return self._handle

    @contextlib.contextmanager
    def _use(self):
        """The C handle, counted as in use until the block ends."""
        self._check_process()
        with self._state:
            if self._closing and self._handle is not None:
                raise CancelledError(f"{type(self).__name__} is being closed")
            handle = self._h()
            self._calls += 1
        try:
            yield handle
        finally:
            with self._state:
                self._calls -= 1
                if self._calls == 0:
                    self._state.notify_all()

    def _call(self, fn, *args):
        with self._use() as handle:
            return fn(handle, *args)

    def close(self) -> None:
        if os.getpid() != self._pid:
            self._handle = None  # the parent's: nothing of it is freed here
            return
        with self._state:
            handle = self._handle
            if handle is None or self._closing:
                return
            self._closing = True
            if self._calls and type(self)._cancel is not None and lib is not None:
                type(self)._cancel(handle)
            while self._calls:
                self._state.wait()
            self._handle = None
        if lib is not None:
            type(self)._destroy(handle)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown
            pass


class Publisher(_Handle):
    """Publishes versions of named tensors to one channel.

        with weightbus.Publisher("disk:///mnt/ch", retention=3) as pub:
            pub.publish(step, model.state_dict(), metadata={"step": str(step)})

    Options are settings by name (`weightbus settings` lists them); values may be str, int,
    float or bool (metadata, unlike options, is str only). Only one live publisher may hold a
    channel, or one per rank of a publisher group: with rank=R, world_size=N (N > 1, disk://)
    every rank publishes the slices it owns (`shards` of publish: an FSDP2 DTensor's local
    shard is its `to_local()` with global_shape = the DTensor's shape and offsets from its
    placement; a Megatron TP slice likewise) and the version commits once every rank's part is
    there, all or nothing; subscribers receive every tensor whole (docs/TRANSPORTS.md,
    "Publisher groups").
    """

    _destroy = staticmethod(lambda h: lib.wb_publisher_destroy(h))
    _cancel = staticmethod(lambda h: lib.wb_publisher_cancel(h))

    def __init__(self, uri: str, **options):
        super().__init__()
        params, keep = _open_params(options)
        handle = ctypes.c_void_p()
        check(lib.wb_publisher_create(uri.encode(), ctypes.byref(params), ctypes.byref(handle)))
        self._handle = handle
        self._uri = _handle_uri(lib.wb_publisher_uri, handle)

    @property
    def uri(self) -> str:
        """The URI the publisher was opened with, as given."""
        return self._uri

    def publish(self, version: int, tensors: TensorsArg,
                metadata: Optional[Mapping[str, str]] = None,
                dtypes: Optional[Mapping[str, str]] = None,
                timeout: Optional[float] = 60.0,
                shards: Optional[Mapping[str, Union[Shard, Tuple[Sequence[int],
                                                                 Sequence[int]]]]] = None
                ) -> PublishStats:
        """Publishes `tensors` ({name: tensor} or (name, tensor) pairs: torch tensors, numpy
        arrays or DLPack objects, any strides) as `version`, all or nothing. `version` must be
        above every version on the channel. The bytes are read during the call only (zero-copy:
        contiguous tensors are read in place, strided ones packed by the library). CUDA tensors
        (any strides, also parameters that require grad) are read by the library after the work
        queued on the current torch stream of their device (supports_cuda_tensors(); a build
        without CUDA support gets them copied to host memory here first): in place by a
        transport that moves GPU memory, through pinned host memory by the others. `metadata` is
        a mapping of str to str stored in the
        manifest as given (Update.metadata returns it); a key or value that is not a str raises
        TypeError naming the key, before anything is published (no str() conversion: encode
        numbers or structures yourself, e.g. str(step) or json.dumps). `dtypes` overrides
        element types by name, e.g. {"w": "BF16"} for a uint16 numpy array of bf16 bits.
        `shards` describes tensors that are this rank's slice of a larger one, by name: a Shard
        or a pair (global_shape, offsets) in elements; the others are published whole
        (Update.tensor_info(name).shard reads it back). Blocks up to `timeout` seconds (None:
        forever) with the GIL released. Returns the publish's figures."""
        _version(version, "version")
        meta_array, meta_count, meta_keep = _metadata_array(metadata)
        items = _items(tensors)
        dtypes = dict(dtypes or {})
        unknown = set(dtypes) - {name for name, _ in items}
        if unknown:
            raise ValueError(f"dtypes names tensors that are not published: {sorted(unknown)}")
        outgoing = _tensors.Outgoing(len(items))
        names = (ctypes.c_char_p * max(len(items), 1))()
        for i, (name, obj) in enumerate(items):
            if _needs_host_staging(obj):
                obj = obj.detach().to("cpu")
            names[i] = name.encode()
            outgoing.set(i, name, obj, dtypes.get(name))
        params = new_params(_lib.wb_publish_params_t)
        params.cuda_stream = _caller_stream([obj for _, obj in items])
        params.metadata = ctypes.cast(meta_array, ctypes.POINTER(_lib.wb_option_t))
        params.num_metadata = meta_count
        params.dtypes = ctypes.cast(outgoing.overrides, ctypes.POINTER(ctypes.c_int))
        shard_keep = None
        if shards:
            shard_array, shard_keep = _shards_array(shards, items)
            params.shards = ctypes.cast(shard_array,
                                        ctypes.POINTER(ctypes.POINTER(_lib.wb_shard_t)))
        check(self._call(lib.wb_publisher_publish, version, names, outgoing.tensors, len(items),
                                       ctypes.byref(params), _timeout_ms(timeout)))
        del meta_keep, outgoing, shard_keep
        return self.last_stats

    def wait_for_receivers(self, version: int, count: int,
                           timeout: Optional[float] = 60.0) -> None:
        """Waits up to `timeout` seconds (None: forever), with the GIL released, until at least
        `count` distinct subscribers have received and verified `version` (or a newer one),
        e.g. to keep a one-shot publisher serving until its replicas have the weights. A
        subscriber counts once however often it reconnects; one that received the version and
        left still counts. Raises DeadlineExceededError (naming how many had it, and how long
        the wait lasted), InvalidArgumentError for count < 1, UnimplementedError where the
        transport cannot tell (disk://), CancelledError when close() comes from another thread.
        Waits in slices, so Ctrl-C (KeyboardInterrupt) interrupts it within a slice."""
        _version(version, "version")
        if not isinstance(count, int) or count > 2**31 - 1:
            raise ValueError(f"count must be an int below 2**31, got {count!r}")
        _timeout_ms(timeout)  # validates
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            wait = _WAIT_SLICE if remaining is None else min(_WAIT_SLICE, remaining)
            status = self._call(lib.wb_publisher_wait_for_receivers, version, count,
                                _timeout_ms(wait))
            if status == DeadlineExceededError.status:
                if deadline is None or time.monotonic() < deadline:
                    continue  # not yet; Python runs pending signal handlers here
                message = lib.wb_last_error_message().decode("utf-8", "replace")
                raise DeadlineExceededError(f"{message} (waited {timeout} s in all)")
            check(status)
            return

    def begin_publish(self, version: int,
                      metadata: Optional[Mapping[str, str]] = None) -> "PublishStream":
        """Begins publishing `version` tensor by tensor: add() each tensor as it is produced
        (it may be freed as soon as add returns), then commit() or abort(). All or nothing, as
        publish(): nothing is visible to any subscriber before commit() returns; abort(),
        close(), leaving a `with` block without commit(), a failed commit or the process dying
        leaves no trace. Memory: the `stream_bucket` setting (host staging, 64 MiB by default)
        plus a spool file of the version's size in `stream_spill_dir` (unlinked), not the
        model. `metadata` as for publish(). Raises FailedPreconditionError when the channel
        has a higher version or this publisher already has an open stream (naming its
        version), InvalidArgumentError for bad metadata."""
        _version(version, "version")
        meta_array, meta_count, meta_keep = _metadata_array(metadata)
        params = new_params(_lib.wb_publish_params_t)
        params.metadata = ctypes.cast(meta_array, ctypes.POINTER(_lib.wb_option_t))
        params.num_metadata = meta_count
        handle = ctypes.c_void_p()
        check(self._call(lib.wb_publisher_begin_publish, version, ctypes.byref(params),
                         ctypes.byref(handle)))
        del meta_keep
        return PublishStream(self, version, handle)

    def allocate_host(self, nbytes: int) -> "ctypes.Array[ctypes.c_ubyte]":
        """`nbytes` bytes of zero-filled, 4096-byte aligned, writable host memory that this
        publisher's transport serves fastest when the tensors it publishes lie in it: on ucx://
        with publish_mode=zero_copy, memory UCX allocated, which subscribers on the same host map
        and copy at memory speed. Returned as a ctypes array of c_ubyte (len() == nbytes; it
        exports the buffer protocol, format "<B"). Keep a trainer's host copy of the weights in
        it, e.g. `flat = torch.frombuffer(mem, dtype=torch.uint8)`, then
        `flat[a:b].view(torch.bfloat16).view(shape)` per tensor (one allocation for all of
        them), or `numpy.frombuffer(mem, dtype=numpy.uint8)`.

        Lifetime: freed when the array is garbage-collected, which every tensor or array made
        from it (or from a memoryview of it) delays while it lives; before or after the
        publisher closes. A memoryview of it that you release() stops holding it, so make
        tensors from the array itself. Memory still alive at interpreter exit is left to the
        process's end; in a child forked after the allocation, freeing it releases nothing of
        the parent's. It must not change while a publish reads it. Raises ValueError for
        nbytes < 1 or > 2**62, ResourceExhaustedError when the memory cannot be had."""
        if not isinstance(nbytes, int) or nbytes < 1 or nbytes > 2**62:
            raise ValueError(f"nbytes must be an int from 1 to 2**62, got {nbytes!r}")
        memory, data = ctypes.c_void_p(), ctypes.c_void_p()
        check(self._call(lib.wb_publisher_allocate_host, nbytes, ctypes.byref(memory),
                         ctypes.byref(data)))
        array = (ctypes.c_ubyte * nbytes).from_address(data.value)
        # Freed with the array: torch and numpy buffers made from it hold it.
        weakref.finalize(array, lib.wb_host_memory_free, memory).atexit = False
        return array

    @property
    def latest_version(self) -> Optional[int]:
        """The newest version on the channel (published by anyone), or None."""
        has, version = ctypes.c_bool(), ctypes.c_uint64()
        check(self._call(lib.wb_publisher_latest_version, ctypes.byref(has),
                                              ctypes.byref(version)))
        return version.value if has.value else None

    @property
    def last_stats(self) -> PublishStats:
        s = new_params(_lib.wb_publish_stats_t)
        check(self._call(lib.wb_publisher_last_stats, ctypes.byref(s)))
        return PublishStats._from_c(s)


def supports_cuda_tensors() -> bool:
    """Whether this build of libweightbus takes CUDA tensors itself (built with CUDA): publish()
    and PublishStream.add read them, bind() makes them destinations the library writes
    (docs/TRANSPORTS.md, "Device memory"); without it this module copies them through host
    memory."""
    return bool(lib.wb_supports_cuda_tensors())


class PublishStream(_Handle):
    """One version published tensor by tensor (Publisher.begin_publish).

        with pub.begin_publish(step, metadata={"step": str(step)}) as stream:
            for name, tensor in trainer_weights():   # gathered one at a time
                stream.add(name, tensor)              # copied: free it right after
            stream.commit(timeout=600)

    add() copies a host tensor (torch, numpy or DLPack; any strides) before it returns. A CUDA
    torch tensor is copied asynchronously into pinned host memory on the tensor's current
    torch stream (supports_cuda_tensors(); otherwise synchronously to host first): add returns
    once the copy is queued, and this object keeps the tensor alive until the next call, so
    the copy overlaps producing the next tensor. Leaving the `with` block without commit()
    aborts. Not thread-safe: one thread drives a stream. Errors name the tensor and the
    version: InvalidArgumentError for a tensor publish() would refuse or a name already added
    (the stream stays open), FailedPreconditionError after commit or abort, CancelledError
    once the publisher is closed, InternalError/ResourceExhaustedError from the spool (the
    version is dropped)."""

    _destroy = staticmethod(lambda h: lib.wb_publish_stream_destroy(h))

    def __init__(self, publisher: "Publisher", version: int, handle):
        super().__init__()
        self._publisher = publisher  # kept open while the stream lives
        self._version = version
        self._handle = handle
        self._in_flight = None  # the CUDA tensor whose copy may still be running
        self._tensors = 0
        self._bytes = 0

    @property
    def version(self) -> int:
        return self._version

    @property
    def tensor_count(self) -> int:
        """Tensors added so far."""
        return self._tensors

    @property
    def bytes(self) -> int:
        """Bytes added so far, as their DLPack element types count them."""
        return self._bytes

    def add(self, name: str, tensor, *, dtype: Optional[str] = None,
            shard: Optional[Union[Shard, Tuple[Sequence[int], Sequence[int]]]] = None) -> None:
        """Adds `tensor` as `name` (the version's next tensor). `dtype` overrides its element
        type (as publish's `dtypes`), `shard` describes it as this rank's slice of a larger
        tensor (as publish's `shards`). Blocks with the GIL released while a host tensor is
        copied (and while the spool's bucket is written, when it is full)."""
        if not isinstance(name, str):
            raise TypeError(f"tensor names must be str, got {type(name).__name__}")
        obj, cuda_stream = tensor, None
        if _cuda_devices([obj]):  # the library copies it to pinned memory itself
            import torch
            obj = obj.detach()
            if not obj.is_contiguous():
                obj = obj.contiguous()
            cuda_stream = torch.cuda.current_stream(obj.device).cuda_stream
        elif _needs_host_staging(obj):
            obj = obj.detach().to("cpu")
        outgoing = _tensors.Outgoing(1)
        outgoing.set(0, name, obj, dtype)
        params = new_params(_lib.wb_stream_add_params_t)
        params.dtype = outgoing.overrides[0]
        params.cuda_stream = cuda_stream
        shard_keep = None
        if shard is not None:
            shard_array, shard_keep = _shards_array({name: shard}, [(name, obj)])
            params.shard = shard_array[0]
        check(self._call(lib.wb_publish_stream_add, name.encode(), ctypes.byref(outgoing.tensors[0]),
                         ctypes.byref(params)))
        # The previous CUDA tensor's copy is complete once this call returned (the C contract).
        self._in_flight = obj if cuda_stream is not None else None
        self._tensors += 1
        dl = outgoing.tensors[0]
        self._bytes += math.prod(dl.shape[d] for d in range(dl.ndim)) * dl.dtype.bits // 8
        del outgoing, shard_keep

    def commit(self, timeout: Optional[float] = 60.0) -> PublishStats:
        """Publishes the tensors added as the version, all or nothing, blocking up to `timeout`
        seconds (None: forever) with the GIL released; afterwards the stream is finished either
        way. Raises as Publisher.publish (FailedPreconditionError when another publish took
        the version or a higher one meanwhile). Returns the publish's figures."""
        try:
            check(self._call(lib.wb_publish_stream_commit, _timeout_ms(timeout)))
        finally:
            self._in_flight = None
        return self._publisher.last_stats

    def abort(self) -> None:
        """Drops the version; nothing of it is visible. No effect after commit or abort."""
        check(self._call(lib.wb_publish_stream_abort))
        self._in_flight = None

    def close(self) -> None:
        """Aborts unless committed and frees the stream."""
        super().close()
        self._in_flight = None

    def __repr__(self) -> str:
        return (f"PublishStream(version={self._version}, tensors={self._tensors}, "
                f"bytes={self._bytes})")


class Update(_Handle):
    """One received, verified version (immutable).

    Iterating yields (name, torch.Tensor) in publish order: zero-copy views of library memory
    (valid for as long as the tensor object lives, even after close()), or the caller's own
    tensors for names bound with Subscriber.bind. Do not write into the library's views.

    Also a read-only mapping of name -> torch.Tensor (collections.abc.Mapping: keys(), values(),
    items(), get(), [name], `in`, len()), so torch takes it as a state dict:
    `model.load_state_dict(update, strict=True)` copies every tensor into the model's
    parameters (torch raises for missing or unexpected names with strict=True). Unlike a dict,
    iterating the Update itself yields (name, tensor) pairs, for load_weights(list(update));
    keys() yields the names.
    """

    _destroy = staticmethod(lambda h: lib.wb_update_destroy(h))

    def __init__(self, handle, bound: Dict[str, Any]):
        """Takes ownership of `handle` only if it returns (the caller destroys it otherwise)."""
        super().__init__()
        self._bound = bound
        value = ctypes.c_uint64()
        check(lib.wb_update_version(handle, ctypes.byref(value)))
        self.version: int = value.value
        count = ctypes.c_size_t()
        check(lib.wb_update_num_tensors(handle, ctypes.byref(count)))
        self.names = []
        self.dtypes: Dict[str, str] = {}
        for i in range(count.value):
            name, dtype = ctypes.c_char_p(), ctypes.c_int()
            check(lib.wb_update_tensor(handle, i, ctypes.byref(name), ctypes.byref(dtype), None))
            decoded = name.value.decode("utf-8")
            self.names.append(decoded)
            self.dtypes[decoded] = _lib.DTYPE_NAMES[dtype.value]
        self._index = {name: i for i, name in enumerate(self.names)}
        self._torch: Dict[str, Any] = {}
        self._manifest = None
        s = new_params(_lib.wb_update_stats_t)
        check(lib.wb_update_stats(handle, ctypes.byref(s)))
        self.stats = UpdateStats._from_c(s)
        self._infos: Dict[str, TensorInfo] = {}
        self._handle = handle

    def tensor_info(self, name: str) -> TensorInfo:
        """The manifest's description of tensor `name`: dtype, shape, nbytes, XXH3 checksum and
        shard (None unless the publisher described one). Raises KeyError for an unknown name,
        ValueError once the update is closed."""
        if name not in self._infos:
            if name not in self._index:
                raise KeyError(f"version {self.version} has no tensor named {name!r}")
            info = new_params(_lib.wb_tensor_info_t)
            check(self._call(lib.wb_update_tensor_info, self._index[name], ctypes.byref(info)))
            shard = None
            if info.has_shard:
                shard = Shard(_shape(info.shard_global_shape, info.ndim),
                              _shape(info.shard_offsets, info.ndim))
            self._infos[name] = TensorInfo(info.name.decode("utf-8"),
                                           _lib.DTYPE_NAMES[info.dtype],
                                           _shape(info.shape, info.ndim), info.nbytes,
                                           info.xxh3, shard)
        return self._infos[name]

    @property
    def manifest(self) -> Dict[str, Any]:
        """The manifest (docs/FORMAT.md, "weightbus.manifest/1") as a dict: tensors with dtype,
        shape, nbytes and xxh3, publisher identity, timestamps, metadata."""
        if self._manifest is None:
            text, length = ctypes.c_char_p(), ctypes.c_size_t()
            check(self._call(lib.wb_update_manifest_json, ctypes.byref(text),
                                              ctypes.byref(length)))
            self._manifest = json.loads(text.value.decode("utf-8"))
        return self._manifest

    @property
    def metadata(self) -> Dict[str, str]:
        """The publisher's metadata (str keys and str values, as published), a new dict."""
        return dict(self.manifest.get("metadata", {}))

    def __len__(self) -> int:
        return len(self.names)

    def __contains__(self, name) -> bool:
        return name in self._index

    def __getitem__(self, name: str):
        """The tensor `name` as a torch.Tensor (bound names: the caller's tensor)."""
        if name in self._bound:
            return self._bound[name]
        if name not in self._torch:
            if name not in self._index:
                raise KeyError(f"version {self.version} has no tensor named {name!r}")
            self._torch[name] = self._call(_tensors.export_torch, self._index[name],
                                                      self.dtypes[name])
        return self._torch[name]

    def __iter__(self) -> Iterator[Tuple[str, Any]]:
        for name in self.names:
            yield name, self[name]

    def keys(self) -> List[str]:
        """The tensor names in publish order (a new list)."""
        return list(self.names)

    def values(self) -> List[Any]:
        """The tensors (as [name]) in publish order."""
        return [self[name] for name in self.names]

    def items(self) -> List[Tuple[str, Any]]:
        """(name, tensor) pairs in publish order."""
        return list(iter(self))

    def get(self, name: str, default: Any = None) -> Any:
        """The tensor `name`, or `default` when the version has none of that name."""
        return self[name] if name in self._index else default

    def numpy(self, name: str):
        """The tensor `name` as a zero-copy numpy array (BF16 as uint16 bits)."""
        if name not in self._index:
            raise KeyError(f"version {self.version} has no tensor named {name!r}")
        return self._call(_tensors.export_numpy, self._index[name], self.dtypes[name])

    def arrays(self) -> Iterator[Tuple[str, Any]]:
        for name in self.names:
            yield name, self.numpy(name)

    def __repr__(self) -> str:
        return f"<weightbus.Update version={self.version} tensors={len(self.names)}>"


# A Mapping by registration, not inheritance: Mapping's own __iter__ (names) and keys view
# would contradict the (name, tensor) iteration that load_weights(list(update)) relies on.
Mapping.register(Update)


class Subscriber(_Handle):
    """Receives versions from one channel.

        sub = weightbus.Subscriber("disk:///mnt/ch")
        sub.bind(dict(model.named_parameters()))     # optional: receive in place
        update = sub.wait(min_version=1, timeout=30)
        for name, tensor in update: ...

    Options are settings by name, as for Publisher. The channel need not exist yet.

    One worker of a tensor-parallel group receives only its slices (docs/RESHARDING.md,
    "Subscribing with placements"): `placements` maps name patterns (fnmatch globs, first match
    wins; other tensors whole) to a Placement, with this worker's `tp_rank` of `tp_size`;
    `tensors` lists the destinations when fused ones (qkv_proj, gate_up_proj) are wanted.

        sub = weightbus.Subscriber("disk:///mnt/ch", tp_rank=r, tp_size=2, placements={
            "*.q_proj.weight": weightbus.Placement.shard(0),
            "*.o_proj.weight": weightbus.Placement.shard(1)})

    `skip_absent=True` leaves a destination none of whose sources a version has out of that
    update (vLLM's load_weights leaves a parameter the checkpoint does not name as it is)
    instead of failing it with NotFoundError; one with only some of its sources, or a version
    with a source for none of the destinations, is still NotFoundError.

    Errors: InvalidArgumentError for a rank outside [0, tp_size); on receive, before any byte
    is fetched, InvalidArgumentError naming the tensor and degree when tp_size does not divide
    a dimension or head count.
    """

    _destroy = staticmethod(lambda h: lib.wb_subscriber_destroy(h))
    _cancel = staticmethod(lambda h: lib.wb_subscriber_cancel(h))

    def __init__(self, uri: str, *, placements=None, tp_rank: int = 0, tp_size: int = 1,
                 tensors: Optional[Sequence[str]] = None, skip_absent: bool = False,
                 **options):
        super().__init__()
        params, keep = _open_params(options)
        handle = ctypes.c_void_p()
        if placements is None and tp_size == 1 and tensors is None and not skip_absent:
            check(lib.wb_subscriber_create(uri.encode(), ctypes.byref(params),
                                           ctypes.byref(handle)))
        else:
            tp, tp_keep = _placements_struct(placements or {}, tp_rank, tp_size, tensors,
                                             skip_absent)
            check(lib.wb_subscriber_create_tp(uri.encode(), ctypes.byref(params),
                                              ctypes.byref(tp), ctypes.byref(handle)))
            del tp_keep
        self._handle = handle
        self._uri = _handle_uri(lib.wb_subscriber_uri, handle)
        self._bound: Dict[str, Any] = {}   # name -> what the library writes into
        self._staged: Dict[str, Tuple[Any, Any]] = {}  # name -> (caller's tensor, host copy)
        self._current: Optional[int] = None  # see current_version

    @property
    def uri(self) -> str:
        """The URI the subscriber was opened with, as given."""
        return self._uri

    def bind(self, tensors: TensorsArg, dtypes: Optional[Mapping[str, str]] = None) -> None:
        """Makes later updates write each named tensor straight into the given tensor (torch
        CPU tensors, e.g. parameters, and writable numpy arrays, any strides) instead of library
        memory. With the default bind_mode=staged, bytes are verified before a destination is
        touched. A CUDA tensor (any strides; also a parameter that requires grad or an
        inference tensor: the library writes its memory, autograd is not involved) is written
        by the library itself where it has CUDA support (supports_cuda_tensors()): in place or
        through device staging by a transport that moves GPU memory, else copied from verified
        host memory; each wait/poll first synchronizes the current torch streams of the bound
        tensors' devices (work reading them must be done) and returns once every copy is
        complete. Without CUDA support a CUDA tensor is bound through a host buffer that each
        wait/poll copies into it after verification, under torch.no_grad() or
        torch.inference_mode(); current_version advances only once every such copy is done
        (see current_version for a copy that fails). The tensors must keep their dtype, shape
        and memory while bound. A destination that no longer matches the published tensor
        fails the wait (InvalidArgumentError, nothing written)."""
        dtypes = dict(dtypes or {})
        for name, obj in _items(tensors):
            if _tensors.is_numpy_array(obj) and not obj.flags.writeable:
                raise ValueError(f"array {name!r} is read-only and cannot be a destination")
            target = obj
            if _needs_host_staging(obj):
                import torch
                obj = torch.empty_strided(tuple(obj.shape), tuple(obj.stride()), dtype=obj.dtype,
                                          device="cpu", pin_memory=torch.cuda.is_available())
            outgoing = _tensors.Outgoing(1)
            outgoing.set(0, name, obj, dtypes.get(name))
            params = new_params(_lib.wb_bind_params_t)
            params.dtype = outgoing.overrides[0]
            check(self._call(lib.wb_subscriber_bind, name.encode(), outgoing.tensors,
                                         ctypes.byref(params)))
            self._bound[name] = target
            if target is not obj:
                self._staged[name] = (target, obj)
            else:
                self._staged.pop(name, None)

    def unbind(self, name: Optional[str] = None) -> None:
        """Removes the binding of `name`, or every binding when `name` is None."""
        if name is None:
            check(self._call(lib.wb_subscriber_unbind_all))
            self._bound.clear()
            self._staged.clear()
        else:
            check(self._call(lib.wb_subscriber_unbind, name.encode()))
            self._bound.pop(name, None)
            self._staged.pop(name, None)

    def wait(self, min_version: int = 0, timeout: Optional[float] = 60.0) -> Update:
        """Waits up to `timeout` seconds (None: forever), with the GIL released, for a version
        >= max(min_version, current_version), receives and verifies it (the newest when several
        are available) and returns it. Raises DeadlineExceededError (retryable) on timeout,
        InvalidArgumentError for a bound tensor that does not match, DataLossError for a
        corrupted version; the previous version stays current on every error.

        The wait lasts its whole timeout also while no publisher is there yet (a replica
        started before its trainer): a ucx:// rendezvous that refuses the connection, or a disk
        channel directory that does not exist yet, is "not yet", retried until the deadline.
        When the deadline passes, the last such error is raised (UnavailableError or
        DeadlineExceededError, both retryable) with the library's message and how long the
        wait lasted in all. Ctrl-C (KeyboardInterrupt) interrupts the wait within a slice."""
        return self._sliced(lib.wb_subscriber_wait_then_receive, min_version, timeout,
                            "Subscriber.wait")

    def receive(self, version: int, timeout: Optional[float] = 60.0) -> Update:
        """Receives exactly `version`, never another: if the channel holds it (also when newer
        versions exist) it is opened, received and verified; if it is not committed yet, this
        waits up to `timeout` seconds (None: forever), with the GIL released and Ctrl-C
        interrupting it as for wait(). Every tensor-parallel worker of one replica calls it with
        the version the engine picked once for the group, so that the replica never mixes two
        versions (README, "One version per tensor-parallel group"). `version` equal to
        current_version receives it again (a reload).

        Raises NotFoundError (a LookupError) when the channel no longer holds `version` (the
        message names the versions it holds: pick a newer one for every worker, or keep more
        versions with disk retention / ucx staging_slots); FailedPreconditionError for a
        version below current_version (versions handed over never decrease: open a new
        Subscriber to go back); DeadlineExceededError when it was not committed in time; the
        rest as wait(). The previous version stays current on every error."""
        return self._sliced(lib.wb_subscriber_receive_version, version, timeout,
                            "Subscriber.receive")

    def _sliced(self, function, version: int, timeout: Optional[float], what: str) -> Update:
        """Calls `function(handle, version, find_ms, receive_ms, &update)` (a two-bound wait of
        the C API) in slices of _WAIT_SLICE seconds so that Ctrl-C interrupts it within a slice;
        a version found late in a slice still gets the whole remaining time to be received. A
        slice cut short while the publisher is not reachable reports Unavailable (or
        DeadlineExceeded): both mean "not yet" until the overall deadline."""
        _version(version, "min_version" if function is lib.wb_subscriber_wait_then_receive
                 else "version")
        _timeout_ms(timeout)  # validates
        deadline = None if timeout is None else time.monotonic() + timeout
        handle = ctypes.c_void_p()
        self._sync_bound_devices()
        first_slice = True
        while True:
            if self._closing and not first_slice:  # closed by another thread between slices
                raise CancelledError(f"{what}: the subscriber was closed while waiting")
            first_slice = False
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            find = _WAIT_SLICE if remaining is None else min(_WAIT_SLICE, remaining)
            status = self._call(function, version, _timeout_ms(find), _timeout_ms(remaining),
                                ctypes.byref(handle))
            if status in _NOT_YET and not handle.value:
                message = lib.wb_last_error_message().decode("utf-8", "replace")
                if deadline is None or time.monotonic() < deadline:
                    continue  # nothing yet; Python runs pending signal handlers here
                raise ERRORS[status](f"{message} (waited {timeout} s in all)")
            check(status)
            return self._received(handle)

    def poll(self, min_version: int = 0,
             receive_timeout: Optional[float] = 60.0) -> Optional[Update]:
        """Does not wait for a version to appear: if a version >= max(min_version,
        current_version) is available now, receives it (the newest; up to `receive_timeout`
        seconds, GIL released) and returns it, else returns None. Pass current_version + 1 to
        ask for a newer one, as a replica does between rollouts."""
        _version(min_version, "min_version")
        handle = ctypes.c_void_p()
        self._sync_bound_devices()
        check(self._call(lib.wb_subscriber_poll, min_version, _timeout_ms(receive_timeout),
                                     ctypes.byref(handle)))
        return self._received(handle) if handle.value else None

    def _sync_bound_devices(self) -> None:
        """Before a receive: waits for the work queued on the current torch streams of the
        devices of bound CUDA tensors that the library writes itself (the library writes them
        on its own streams, so work still reading the previous weights must be done)."""
        devices = _cuda_devices(self._bound.values())
        if devices:
            import torch
            for device in devices:
                torch.cuda.current_stream(device).synchronize()

    def _received(self, handle) -> Update:
        """Wraps a received handle in an Update, copies host staging buffers into their
        (CUDA) destinations, and only then makes the version current (self._current)."""
        try:
            update = Update(handle, dict(self._bound))
        except BaseException:
            lib.wb_update_destroy(handle)
            raise
        if self._staged:
            try:
                self._copy_out_staged(update)
            except BaseException:
                update.close()
                raise
        self._current = update.version
        return update

    def _copy_out_staged(self, update: Update) -> None:
        """Copies each staged tensor of `update` from its host buffer into the caller's tensor:
        under torch.no_grad() (parameters that require grad are leaves autograd must not see
        written), or torch.inference_mode() for inference tensors. A copy that fails raises
        InvalidArgumentError naming the tensor and both versions, chained to the cause; the
        destinations copied before it hold the new version already, the others the old one."""
        import torch
        try:
            for name, (target, host) in self._staged.items():
                if name not in update:
                    continue
                mode = torch.inference_mode() if target.is_inference() else torch.no_grad()
                with mode:
                    target.copy_(host, non_blocking=target.device.type == "cuda")
        except Exception as e:
            current = "none" if self._current is None else str(self._current)
            raise InvalidArgumentError(
                f"{self.uri}: copying tensor \"{name}\" of version {update.version} from its "
                f"host staging buffer into the bound {target.device.type} tensor failed: "
                f"{type(e).__name__}: {e}; version {current} stays current (bound tensors "
                f"copied before \"{name}\" hold version {update.version} already); the next "
                f"wait or poll delivers version {update.version} again") from e
        finally:
            if torch.cuda.is_available():
                torch.cuda.synchronize()  # the host buffers are rewritten by the next wait

    @property
    def current_version(self) -> Optional[int]:
        """The version of the last update handed over, or None: the version every bound
        destination holds. It advances only when wait()/poll() return, after the bytes of every
        bound tensor are in place, host-staged (CUDA) ones included, so it never runs ahead of
        the model.

        Tracked by this object, not read from the C library: the library makes a version
        current once it has verified it into its buffers, before the copies from host staging
        buffers into CUDA destinations that this layer does. When such a copy fails, the
        library already holds the version but this property still reports the previous one;
        since wait and poll return a version >= max(min_version, the library's current
        version), and the version the library holds qualifies, the next
        wait(current_version + 1) or poll(current_version + 1) delivers that version again
        and copies it into every destination. Raises ValueError once the subscriber is
        closed."""
        self._h()
        return self._current
