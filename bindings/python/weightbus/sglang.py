# SPDX-License-Identifier: Apache-2.0
"""SGLang integration: the two ways SGLang updates a running engine's weights.

Written from SGLang's source (sgl-project/sglang): python/sglang/srt/managers/io_struct.py
(UpdateWeightFromDiskReqInput, UpdateWeightsFromTensorReqInput), python/sglang/srt/entrypoints/
engine.py (Engine.update_weights_from_disk / update_weights_from_tensor) and python/sglang/srt/
model_executor/model_runner.py (ModelRunner.update_weights_from_disk / update_weights_from_tensor,
which runs a `--custom-weight-loader` function as `loader(self.model, named_tensors)`).

1. disk:// channels, through `update_weights_from_disk`: every committed version directory is a
   Hugging Face checkpoint directory (docs/FORMAT.md), which SGLang's DefaultModelLoader reads
   (*.safetensors, filtered by model.safetensors.index.json). pin_disk_version finds the newest
   committed version (or a named one) and its directory without receiving anything, and holds
   a read pin on it so that the publisher's retention cannot delete it while SGLang loads:

       with weightbus.sglang.pin_disk_version("disk:///mnt/shared/policy") as pin:
           engine.update_weights_from_disk(model_path=str(pin.path))
       # HTTP server: POST /update_weights_from_disk
       #   {"model_path": str(pin.path), "weight_version": str(pin.version)}

   or in one call: `version, result = weightbus.sglang.update_weights_from_disk(engine, uri)`.
   SGLang then remembers the directory as its model_path; once the pin is released, retention
   may delete it, so do not rely on it afterwards (e.g. for SGLang's rollback of a failed later
   update from disk, which reloads model_path).

2. Every transport, through `update_weights_from_tensor` and a custom weight loader: start
   SGLang with `--custom-weight-loader weightbus.sglang.load_weights` (ServerArgs
   custom_weight_loader=[LOAD_FORMAT]); then

       weightbus.sglang.update_weights_from_tensor(engine, "ucx://trainer:7000/policy", version)

   sends no weights through SGLang: the named tensors carry only the request (channel, exact
   version, options), and load_weights, run by ModelRunner.update_weights_from_tensor in every
   TP worker, receives exactly that version from the channel (Subscriber.receive) and hands it
   to the model's load_weights. Every TP worker receives the full tensors (the model's
   load_weights shards them) and every one loads the same version.

SGLang is not a dependency: both paths are tested against weightbus.testing.sglang, a stand-in
written from the files above (bindings/python/tests/test_sglang.py).
"""
import fcntl
import json
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple
from urllib.parse import urlsplit

from . import _api
from .errors import FailedPreconditionError, InvalidArgumentError, NotFoundError
from .vllm import check_tied_embeddings, ties_word_embeddings

# The custom weight loader's dotted path: SGLang's --custom-weight-loader value and the
# load_format of update_weights_from_tensor (model_runner.py matches one against the other).
LOAD_FORMAT = "weightbus.sglang.load_weights"
# The one named tensor of an update_weights_from_tensor request (see weight_request).
REQUEST_TENSOR = "weightbus.request"

# docs/FORMAT.md, "The disk:// channel".
_LATEST = "LATEST"
_VERSIONS = "versions"
_READERS_LOCK = ".readers.lock"
_MANIFEST = "weightbus.manifest.json"


def _version_dir_name(version: int) -> str:
    return f"v{version:020d}"


def _channel_dir(uri: str) -> Path:
    parts = urlsplit(uri)
    if parts.scheme != "disk":
        raise InvalidArgumentError(
            f"{uri}: update_weights_from_disk needs a disk:// channel (its version directories "
            f"are checkpoint directories); got scheme {parts.scheme!r}. Other transports (and "
            f"delta+disk, whose directories hold encoded versions): update_weights_from_tensor "
            f"with the custom weight loader")
    if not parts.path:
        raise InvalidArgumentError(f"{uri}: no channel directory in the URI")
    return Path(parts.path)


def _held_versions(versions_dir: Path) -> List[int]:
    try:
        names = os.listdir(versions_dir)
    except FileNotFoundError:
        return []
    return sorted(int(n[1:]) for n in names if len(n) == 21 and n[0] == "v" and n[1:].isdigit())


class DiskVersionPin:
    """A committed version of a disk:// channel, pinned against retention: `version` (int) and
    `path` (its directory, a Hugging Face checkpoint directory). While the pin is held the
    publisher's retention skips the directory (it holds flock(LOCK_SH) on the directory's
    .readers.lock, as a subscriber does while reading: docs/FORMAT.md). release() (or leaving
    the `with` block) lets retention delete it. Owns one open file; not shared between
    threads."""

    def __init__(self, uri: str, version: int, path: Path, lock_fd: int):
        self.uri = uri
        self.version = version
        self.path = path
        self._lock_fd: Optional[int] = lock_fd

    @property
    def held(self) -> bool:
        return self._lock_fd is not None

    def release(self) -> None:
        """Drops the pin; further calls do nothing."""
        fd, self._lock_fd = self._lock_fd, None
        if fd is not None:
            os.close(fd)  # closing the descriptor releases its flock

    def __enter__(self) -> "DiskVersionPin":
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def __del__(self):
        self.release()

    def __repr__(self) -> str:
        state = "held" if self.held else "released"
        return f"DiskVersionPin({self.uri!r}, version={self.version}, path={str(self.path)!r}, {state})"


def pin_disk_version(uri: str, version: Optional[int] = None) -> DiskVersionPin:
    """Pins a committed version of the disk:// channel at `uri` without receiving it: the newest
    one (version None; read from LATEST, the commit point) or exactly `version`. Never waits.

    Follows the subscriber's protocol of docs/FORMAT.md: open versions/vN, take LOCK_SH on its
    .readers.lock, then check that versions/vN is still that directory (retention renames a
    directory before deleting it); with version None a version retired meanwhile makes it read
    LATEST again.

    Errors: InvalidArgumentError for a URI that is not disk:// (delta+disk included);
    NotFoundError when the channel has no committed version yet, or no longer (or not yet)
    holds `version`, naming the versions it holds; FailedPreconditionError when LATEST names a
    version whose directory is missing, or the directory lacks .readers.lock or the manifest
    (a corrupt channel)."""
    if version is not None:
        version = _api._version(version, "version")
    channel = _channel_dir(uri)
    versions_dir = channel / _VERSIONS
    for _ in range(100):  # each retry means retention retired the newest version meanwhile
        try:
            latest = int((channel / _LATEST).read_text().strip())
        except FileNotFoundError:
            raise NotFoundError(f"{uri}: no committed version yet ({channel / _LATEST} does not "
                                f"exist)") from None
        wanted = latest if version is None else version
        path = versions_dir / _version_dir_name(wanted)
        if wanted > latest:
            raise NotFoundError(f"{uri}: version {wanted} is not committed (the newest is "
                                f"{latest})")
        try:
            dir_fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except FileNotFoundError:
            if version is None and int((channel / _LATEST).read_text().strip()) != latest:
                continue
            if version is None:
                raise FailedPreconditionError(
                    f"{uri}: LATEST names version {latest} but {path} does not exist (a "
                    f"corrupt channel)") from None
            raise NotFoundError(f"{uri}: the channel no longer holds version {version} (it "
                                f"holds {_held_versions(versions_dir)})") from None
        try:
            try:
                lock_fd = os.open(_READERS_LOCK, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC,
                                  dir_fd=dir_fd)
            except FileNotFoundError:
                raise FailedPreconditionError(
                    f"{uri}: {path} has no {_READERS_LOCK} (not a weightbus version "
                    f"directory, or a corrupt one)") from None
            try:
                fcntl.flock(lock_fd, fcntl.LOCK_SH)
                held = os.fstat(dir_fd)
                try:
                    now = os.stat(path, follow_symlinks=False)
                    same = (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino)
                except FileNotFoundError:
                    same = False
                if same and not os.path.exists(os.path.join(path, _MANIFEST)):
                    raise FailedPreconditionError(f"{uri}: {path} has no {_MANIFEST}")
            except BaseException:
                os.close(lock_fd)
                raise
        finally:
            os.close(dir_fd)
        if same:
            return DiskVersionPin(uri, wanted, path, lock_fd)
        os.close(lock_fd)  # retired between open and lock
        if version is not None:
            raise NotFoundError(f"{uri}: the channel no longer holds version {version} (it "
                                f"holds {_held_versions(versions_dir)})")
    raise FailedPreconditionError(f"{uri}: the newest version kept being retired while it "
                                  f"was being pinned (100 tries)")


def update_weights_from_disk(engine, uri: str, version: Optional[int] = None,
                             **kwargs) -> Tuple[int, Any]:
    """One update of an SGLang `Engine` (or anything with its update_weights_from_disk) from the
    disk:// channel at `uri`: pins the newest committed version (or exactly `version`:
    pin_disk_version), calls engine.update_weights_from_disk(model_path=<its directory>,
    **kwargs) while the pin is held, then releases it. Returns (the version, what the engine
    returned: SGLang's Engine returns (success, message, num_paused_requests) and does not
    raise when the load fails, so check success). Errors: those of pin_disk_version, and
    FailedPreconditionError (nothing loaded) for a version a publisher group wrote: its
    directory holds one checkpoint of slices per rank (rank-R/, docs/FORMAT.md "Publisher
    groups"), not one SGLang can load; the custom weight loader
    (update_weights_from_tensor) assembles those."""
    with pin_disk_version(uri, version) as pin:
        if (pin.path / "rank-00000").is_dir():
            raise FailedPreconditionError(
                f"{uri}: version {pin.version} was published by a publisher group: {pin.path} "
                f"holds one checkpoint of slices per rank (rank-R/), not one checkpoint for "
                f"update_weights_from_disk; use update_weights_from_tensor (the custom weight "
                f"loader assembles the ranks' slices)")
        result = engine.update_weights_from_disk(model_path=str(pin.path), **kwargs)
    return pin.version, result


# ---- update_weights_from_tensor with the custom weight loader ----

@dataclass
class WeightRequest:
    """What load_weights is asked to load: exactly `version` from the channel `uri`, opened
    with Subscriber `options`; `timeout` seconds (None: forever) for the version to be
    committed and received."""
    uri: str
    version: int
    options: Dict[str, Any] = field(default_factory=dict)
    timeout: Optional[float] = 60.0


def weight_request(uri: str, version: int, options: Optional[Dict[str, Any]] = None,
                   timeout: Optional[float] = 60.0):
    """The `named_tensors` of an update_weights_from_tensor call that makes every TP worker's
    load_weights load exactly `version` from `uri`: [(REQUEST_TENSOR, uint8 tensor of the
    request as UTF-8 JSON)]. SGLang serializes named tensors for each TP rank and moves them to
    the worker's device (model_runner.py, _unwrap_tensor); a few hundred bytes do not
    matter."""
    import torch
    request = WeightRequest(uri, _api._version(version, "version"), dict(options or {}),
                            timeout)
    payload = json.dumps(request.__dict__, sort_keys=True).encode()
    return [(REQUEST_TENSOR, torch.frombuffer(bytearray(payload), dtype=torch.uint8))]


def update_weights_from_tensor(engine, uri: str, version: int,
                               options: Optional[Dict[str, Any]] = None,
                               timeout: Optional[float] = 60.0, **kwargs) -> Any:
    """engine.update_weights_from_tensor(named_tensors=weight_request(...),
    load_format=LOAD_FORMAT, **kwargs) (e.g. flush_cache=False): every TP worker loads exactly
    `version` from `uri` (load_weights). The engine must have been started with
    --custom-weight-loader weightbus.sglang.load_weights. Returns what the engine returns
    (SGLang's Engine: (success, message); a loader error comes back as success False with its
    message, which names the channel and version)."""
    return engine.update_weights_from_tensor(
        named_tensors=weight_request(uri, version, options, timeout),
        load_format=LOAD_FORMAT, **kwargs)


_subscribers: Dict[Tuple[str, str], _api.Subscriber] = {}
_subscribers_lock = threading.Lock()


def parse_weight_request(named_tensors) -> WeightRequest:
    """The WeightRequest in `named_tensors` (weight_request's output, after SGLang's transport:
    the tensor may be on any device). InvalidArgumentError when it is not one."""
    named = list(named_tensors)
    if len(named) != 1 or named[0][0] != REQUEST_TENSOR:
        raise InvalidArgumentError(
            f"{LOAD_FORMAT} expects one tensor named {REQUEST_TENSOR!r} (made by "
            f"weightbus.sglang.weight_request), got {[name for name, _ in named][:5]}")
    try:
        data = json.loads(bytes(named[0][1].cpu().numpy().tobytes()).decode())
        return WeightRequest(**data)
    except (ValueError, TypeError) as e:
        raise InvalidArgumentError(f"{LOAD_FORMAT}: {REQUEST_TENSOR!r} is not a weightbus "
                                   f"request: {e}") from None


def _subscriber(request: WeightRequest) -> _api.Subscriber:
    key = (request.uri, json.dumps(request.options, sort_keys=True))
    with _subscribers_lock:
        subscriber = _subscribers.get(key)
        if subscriber is None:
            subscriber = _api.Subscriber(request.uri, **request.options)
            _subscribers[key] = subscriber
        return subscriber


def load_weights(model, named_tensors) -> None:
    """SGLang's custom weight loader (`--custom-weight-loader weightbus.sglang.load_weights`),
    run by ModelRunner.update_weights_from_tensor as `load_weights(self.model, named_tensors)`
    in every TP worker. Receives exactly the version the request names (weight_request) from its
    channel and hands the tensors (CPU, zero-copy views of the received version) to
    model.load_weights. One Subscriber per channel and options per process, kept open between
    updates.

    Errors (raised; SGLang reports them as success False): InvalidArgumentError for a bad
    request or a tied lm_head.weight that differs from the embedding (nothing loaded);
    NotFoundError when the channel no longer holds the version; FailedPreconditionError below
    the version this process received last from the channel; DeadlineExceededError when it is
    not committed within the request's timeout. Thread-safety: SGLang calls it from the
    worker's one scheduler thread."""
    request = parse_weight_request(named_tensors)
    subscriber = _subscriber(request)
    with subscriber.receive(request.version, request.timeout) as update:
        if ties_word_embeddings(model, getattr(model, "config", None)):
            check_tied_embeddings(update, request.uri)
        model.load_weights(list(update))


def close_subscribers() -> None:
    """Closes the Subscribers load_weights opened in this process (e.g. before the engine shuts
    down); the next load_weights opens them again."""
    with _subscribers_lock:
        subscribers = list(_subscribers.values())
        _subscribers.clear()
    for subscriber in subscribers:
        subscriber.close()
