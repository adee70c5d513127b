# SPDX-License-Identifier: Apache-2.0
"""vLLM integration: replicas that pull versions from a weightbus channel.

Two adapters, for the two ways vLLM lets weights be updated from outside:

1. WeightbusWorkerExtension, for the `worker_extension_cls` hook (vLLM >= 0.8.0, V0 and V1
   engines). vLLM mixes the class into every worker; the trainer-side driver calls its methods
   on all workers through `collective_rpc`:

       llm = LLM(model=..., worker_extension_cls="weightbus.vllm.WeightbusWorkerExtension")
       llm.collective_rpc("weightbus_init", args=("disk:///mnt/shared/policy",))
       ...                                     # between rollouts:
       versions = llm.collective_rpc("weightbus_update")   # one applied version per worker

   weightbus_update receives a version (zero-copy CPU tensors), hands it to the model's
   `load_weights(weights=[(name, tensor), ...])` (which fuses q/k/v and gate/up and shards for
   tensor parallelism, so every worker subscribes and receives the full tensors), runs the
   model's post-load processing (vllm.model_executor.model_loader.utils.
   process_weights_after_loading) and returns the version now applied. It relies on the
   worker attributes `model_runner.model`, `model_config` and `device`, as vLLM's own RLHF
   example (examples/offline_inference/rlhf_utils.py) does.

2. WeightbusWeightTransferEngine, shaped for vLLM's native weight-transfer engine interface
   (vllm/distributed/weight_transfer/base.py: WeightTransferEngine; two-phase in vLLM 0.22,
   with start_weight_update/finish_weight_update from 0.25): init_transfer_engine(init_info),
   start_weight_update(), receive_weights(update_info[, load_weights]) / update_weights(dict),
   finish_weight_update() -> version, shutdown(), and the static trainer_send_weights(iterator,
   trainer_args) that publishes. The constructor accepts both the (config, parallel_config[,
   model]) and the (config, vllm_config, device, model) signatures. Registering it needs
   `WeightTransferEngineFactory.register_engine("weightbus", "weightbus.vllm",
   "WeightbusWeightTransferEngine")` and a WeightTransferConfig that admits the backend name
   (some releases type `backend` as Literal["nccl", ...]).

vLLM is not a dependency: both adapters are tested against
weightbus.testing.llama.VllmStyleLlamaForCausalLM, whose load_weights does what vLLM's Llama
does, inside a stand-in worker (bindings/python/tests/test_vllm.py).
"""
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

from . import _api
from .errors import InvalidArgumentError

# The checkpoint names of the output projection and of the input embedding it may be tied to.
LM_HEAD = "lm_head.weight"
EMBED_TOKENS = "model.embed_tokens.weight"


def process_weights_after_loading(model, model_config=None, device=None) -> None:
    """The post-load step of vLLM's model loader: vLLM's own function when vLLM is installed,
    otherwise the same walk (every module whose quant_method has process_weights_after_loading
    gets it called)."""
    try:
        from vllm.model_executor.model_loader.utils import \
            process_weights_after_loading as vllm_process
    except ImportError:
        vllm_process = None
    if vllm_process is not None and model_config is not None and device is not None:
        vllm_process(model, model_config, device)
        return
    for _, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if method is not None and hasattr(method, "process_weights_after_loading"):
            method.process_weights_after_loading(module)


def ties_word_embeddings(model, model_config=None) -> bool:
    """Whether `model` ties lm_head.weight to model.embed_tokens.weight: its config (vLLM's
    models keep the Hugging Face config as `model.config`), else vLLM's ModelConfig
    (`hf_text_config` / `hf_config`) says tie_word_embeddings, or the two modules share one
    weight tensor (vLLM's lm_head.tie_weights(embed_tokens))."""
    configs = (getattr(model, "config", None), getattr(model_config, "hf_text_config", None),
               getattr(model_config, "hf_config", None))
    for config in configs:
        tie = getattr(config, "tie_word_embeddings", None)
        if tie is not None:
            return bool(tie)
    head = getattr(getattr(model, "lm_head", None), "weight", None)
    embed = getattr(getattr(getattr(model, "model", None), "embed_tokens", None), "weight", None)
    return head is not None and head is embed


def check_tied_embeddings(update, uri: Optional[str] = None) -> None:
    """For a replica that ties lm_head.weight to model.embed_tokens.weight (so its
    load_weights skips lm_head.weight, as vLLM's do): raises InvalidArgumentError, naming both
    tensors, when the received `update` (a weightbus.Update) has an lm_head.weight the model
    would silently ignore: one without model.embed_tokens.weight, or one whose dtype, shape or
    bytes differ from it. The embedding alone, or an identical copy (bit for bit), is
    accepted. Call it before anything is loaded: when it raises, the model is untouched.
    Messages start with `uri` (the channel) when given."""
    if LM_HEAD not in update:
        return
    where = f"{uri}: " if uri else ""
    tie = ("this replica ties lm_head.weight to model.embed_tokens.weight "
           "(tie_word_embeddings) and would ignore lm_head.weight, computing with the embedding")
    if EMBED_TOKENS not in update:
        raise InvalidArgumentError(
            f'{where}version {update.version} has "{LM_HEAD}" but no "{EMBED_TOKENS}": '
            f"{tie}; publish the embedding (alone, or with an identical lm_head.weight)")
    head, embed = update[LM_HEAD], update[EMBED_TOKENS]
    sides = [(update.dtypes[LM_HEAD], list(head.shape)),
             (update.dtypes[EMBED_TOKENS], list(embed.shape))]
    if sides[0] != sides[1]:
        raise InvalidArgumentError(
            f'{where}version {update.version}: "{LM_HEAD}" is {sides[0][0]} {sides[0][1]} but '
            f'"{EMBED_TOKENS}" is {sides[1][0]} {sides[1][1]}: {tie}; publish identical '
            f"tensors or the embedding alone")
    count = head.numel()
    if count == 0:
        return
    import torch
    head_flat, embed_flat = head.reshape(-1), embed.reshape(-1)
    # Bit for bit (NaN == NaN, -0.0 != 0.0): each element as its bytes.
    differ = (head_flat.view(torch.uint8).reshape(count, -1) !=
              embed_flat.view(torch.uint8).reshape(count, -1)).any(dim=1)
    if bool(differ.any()):
        flat = int(differ.nonzero()[0])
        index, rest = [], flat
        for size in reversed(head.shape):
            rest, i = divmod(rest, size)
            index.insert(0, i)
        raise InvalidArgumentError(
            f'{where}version {update.version}: "{LM_HEAD}" differs from "{EMBED_TOKENS}" '
            f"(first at element {index}: {head_flat[flat].item()!r} vs "
            f"{embed_flat[flat].item()!r}): {tie}; publish identical tensors or the embedding "
            f"alone")


def _synchronize(device) -> None:
    if device is not None and getattr(device, "type", None) == "cuda":
        import torch
        torch.cuda.synchronize(device)


@dataclass
class AppliedVersion:
    """What one weightbus_update did on one worker."""
    version: Optional[int]    # the version now in the model (None: none yet)
    changed: bool             # whether this call applied a new version
    receive_s: float = 0.0    # waiting for and receiving the version
    load_s: float = 0.0       # load_weights + post-load processing
    applied_unix: float = 0.0  # time.time() when the model held the version


class WeightbusWorkerExtension:
    """Mixin for vLLM workers (worker_extension_cls); see the module docstring. The host class
    provides `model_runner.model` (with load_weights), and optionally `model_config` and
    `device`."""

    def weightbus_init(self, uri: str, options: Optional[Dict[str, Any]] = None) -> bool:
        """Subscribes this worker to the channel at `uri` (settings in `options`)."""
        self.weightbus_close()
        self._weightbus_subscriber = _api.Subscriber(uri, **(options or {}))
        self._weightbus_version: Optional[int] = None
        self._weightbus_last: Optional[AppliedVersion] = None
        return True

    def weightbus_update(self, min_version: Optional[int] = None,
                         timeout: Optional[float] = 60.0) -> Optional[int]:
        """Applies the newest version on the channel if it is newer than the one the model
        holds, and returns the version the model now holds (None before the first).

        Without min_version (or with one the model already holds) this never waits for a
        version to appear (Subscriber.poll): it applies what is there now, which is what a
        replica does between rollouts. With min_version above the applied version it blocks up
        to `timeout` seconds (None: forever) for a version >= min_version, also while no
        publisher is there yet (Subscriber.wait: replicas may start before the trainer), and
        raises weightbus.DeadlineExceededError (or UnavailableError when the publisher was never
        reachable) once the whole timeout has passed. `timeout` also bounds the receive.
        A model that ties lm_head.weight to model.embed_tokens.weight refuses a version whose
        lm_head.weight differs (check_tied_embeddings: InvalidArgumentError, nothing loaded,
        the applied version stays)."""
        subscriber = self._weightbus_require()
        current = self._weightbus_version
        floor = 0 if current is None else current + 1
        must_advance = min_version is not None and (current is None or current < min_version)
        start = time.perf_counter()
        if must_advance:
            update = subscriber.wait(max(floor, min_version), timeout)
        else:
            update = subscriber.poll(floor, timeout)
            if update is None:
                self._weightbus_last = AppliedVersion(current, False,
                                                      receive_s=time.perf_counter() - start)
                return current
        received = time.perf_counter()
        with update:
            self._weightbus_load(update)
        _synchronize(getattr(self, "device", None))
        done = time.perf_counter()
        self._weightbus_version = update.version
        self._weightbus_last = AppliedVersion(update.version, True, received - start,
                                              done - received, time.time())
        return update.version

    def weightbus_version(self) -> Optional[int]:
        """The version the model holds (None before the first update)."""
        return getattr(self, "_weightbus_version", None)

    def weightbus_last_update(self) -> Optional[Dict[str, Any]]:
        """Figures of the last weightbus_update call (a dict, so it crosses collective_rpc)."""
        last = getattr(self, "_weightbus_last", None)
        return None if last is None else dict(last.__dict__)

    def weightbus_close(self) -> bool:
        subscriber = getattr(self, "_weightbus_subscriber", None)
        if subscriber is not None:
            subscriber.close()
        self._weightbus_subscriber = None
        return True

    # ---- internals ----
    def _weightbus_require(self):
        subscriber = getattr(self, "_weightbus_subscriber", None)
        if subscriber is None:
            raise RuntimeError("weightbus_init(uri) must be called (through collective_rpc) "
                               "before weightbus_update")
        return subscriber

    def _weightbus_load(self, update) -> None:
        model = self.model_runner.model
        if ties_word_embeddings(model, getattr(self, "model_config", None)):
            check_tied_embeddings(update, self._weightbus_subscriber.uri)
        model.load_weights(weights=list(update))
        process_weights_after_loading(model, getattr(self, "model_config", None),
                                      getattr(self, "device", None))


# ---------------------------------------------------------------------------------------------
# Native weight-transfer engine interface
# ---------------------------------------------------------------------------------------------

try:  # vLLM's base class when vLLM is installed; a plain class otherwise.
    from vllm.distributed.weight_transfer.base import WeightTransferEngine as _EngineBase
except Exception:  # ImportError, or an import-time failure of a partial installation
    _EngineBase = object


@dataclass
class WeightbusInitInfo:
    """init_info of WeightbusWeightTransferEngine: the channel and its settings."""
    uri: str
    options: Dict[str, Any] = field(default_factory=dict)


@dataclass
class WeightbusUpdateInfo:
    """update_info: the version to apply, exactly (None: the newest above the applied one), and
    how long to wait for it. is_checkpoint_format: the tensors are in checkpoint (Hugging Face) names
    and layout, to go through the model's load_weights (always true for weightbus)."""
    version: Optional[int] = None
    timeout: Optional[float] = 60.0
    is_checkpoint_format: bool = True


class WeightbusWeightTransferEngine(_EngineBase):
    """A weight-transfer engine that receives from a weightbus channel (see the module
    docstring for the vLLM versions it is shaped for)."""

    init_info_cls = WeightbusInitInfo
    update_info_cls = WeightbusUpdateInfo

    def __init__(self, config: Any = None, *args: Any, **kwargs: Any) -> None:
        # (config, parallel_config[, model]) or (config, vllm_config, device, model).
        self.config = config
        self.vllm_config = kwargs.pop("vllm_config", None)
        self.parallel_config = kwargs.pop("parallel_config", None)
        self.device = kwargs.pop("device", None)
        self.model = kwargs.pop("model", None)
        if kwargs:
            raise TypeError(f"unexpected arguments {sorted(kwargs)}")
        if len(args) == 3:
            self.vllm_config, self.device, self.model = args
        elif len(args) in (1, 2):
            self.parallel_config = args[0]
            if len(args) == 2:
                self.model = args[1]
        elif args:
            raise TypeError(f"expected 1 to 4 positional arguments, got {1 + len(args)}")
        if self.vllm_config is not None:
            self.parallel_config = getattr(self.vllm_config, "parallel_config", None)
        self.model_config = getattr(self.vllm_config, "model_config", None)
        self._subscriber: Optional[_api.Subscriber] = None
        self._version: Optional[int] = None
        self._session: Optional[Dict[str, Any]] = None

    # -- vLLM's helpers, for when the base class is not vLLM's --
    def parse_init_info(self, init_dict: Dict[str, Any]) -> WeightbusInitInfo:
        try:
            return self.init_info_cls(**init_dict)
        except TypeError as e:
            raise ValueError(f"Invalid init_info for {type(self).__name__}: {e}") from e

    def parse_update_info(self, update_dict: Dict[str, Any]) -> WeightbusUpdateInfo:
        try:
            return self.update_info_cls(**update_dict)
        except TypeError as e:
            raise ValueError(f"Invalid update_info for {type(self).__name__}: {e}") from e

    # -- the interface --
    def init_transfer_engine(self, init_info: WeightbusInitInfo) -> None:
        if isinstance(init_info, dict):
            init_info = self.parse_init_info(init_info)
        self.shutdown()
        self._subscriber = _api.Subscriber(init_info.uri, **init_info.options)

    def start_weight_update(self) -> None:
        if self._session is not None:
            raise RuntimeError("a weightbus weight update is already in progress")
        self._session = {"version": None, "layerwise": False}
        if self.model is not None and self.model_config is not None:
            try:
                from vllm.model_executor.model_loader.reload import initialize_layerwise_reload
            except ImportError:
                initialize_layerwise_reload = None
            if initialize_layerwise_reload is not None:
                initialize_layerwise_reload(self.model)
                self._session["layerwise"] = True

    def receive_weights(self, update_info: WeightbusUpdateInfo,
                        load_weights: Optional[Callable[[List[Tuple[str, Any]]], None]] = None
                        ) -> None:
        """Receives the version update_info asks for and loads it: through `load_weights` when
        vLLM passes one (older interface), else the engine's model.load_weights. With
        update_info.version, exactly that version (Subscriber.receive: also when newer ones
        exist, so every TP worker given the same number loads the same weights; NotFoundError
        when the channel no longer holds it, FailedPreconditionError below the version this
        worker received last); without, the newest above the applied one (Subscriber.wait).
        Waits the whole timeout, also before the publisher exists. With a
        model (or vllm_config) that ties lm_head.weight to model.embed_tokens.weight, a version
        whose lm_head.weight differs is refused first (check_tied_embeddings)."""
        if isinstance(update_info, dict):
            update_info = self.parse_update_info(update_info)
        if self._subscriber is None:
            raise RuntimeError("init_transfer_engine must be called before receive_weights")
        implicit = self._session is None  # older interface: no start/finish around it
        if implicit:
            self.start_weight_update()
        if update_info.version is not None:
            # Exactly the version asked for, as every TP worker of the replica is asked for the
            # same one (README, "One version per tensor-parallel group").
            received = self._subscriber.receive(update_info.version, update_info.timeout)
        else:
            floor = 0 if self._version is None else self._version + 1
            received = self._subscriber.wait(floor, update_info.timeout)
        with received as update:
            if ties_word_embeddings(self.model, self.model_config):
                check_tied_embeddings(update, self._subscriber.uri)
            weights = list(update)
            if load_weights is not None:
                load_weights(weights)
            elif self.model is not None:
                self.model.load_weights(weights=weights)
            else:
                raise RuntimeError("no model to load into and no load_weights callable given")
            self._session["version"] = update.version
        if implicit:
            self.finish_weight_update()

    def update_weights(self, update_info: Dict[str, Any]) -> None:
        self.receive_weights(self.parse_update_info(update_info))
        _synchronize(self.device)

    def finish_weight_update(self) -> Optional[int]:
        """Runs the post-load processing and returns the version the model now holds."""
        if self._session is None:
            raise RuntimeError("no weightbus weight update is in progress")
        session, self._session = self._session, None
        if session["version"] is None:
            raise RuntimeError("finish_weight_update: no version was received since "
                               "start_weight_update")
        if session["layerwise"]:
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload
            finalize_layerwise_reload(self.model, self.model_config)
        elif self.model is not None:
            process_weights_after_loading(self.model, self.model_config, self.device)
        _synchronize(self.device)
        self._version = session["version"]
        return self._version

    @property
    def applied_version(self) -> Optional[int]:
        return self._version

    def shutdown(self) -> None:
        if self._subscriber is not None:
            self._subscriber.close()
            self._subscriber = None

    @staticmethod
    def trainer_send_weights(iterator: Iterable[Tuple[str, Any]],
                             trainer_args: Dict[str, Any]) -> Any:
        """Trainer side: publishes (name, tensor) pairs as one version. trainer_args:
        "version" (required), and "publisher" (an open weightbus.Publisher) or "uri" (+
        "options"); optional "metadata" and "timeout". Returns the PublishStats."""
        version = trainer_args["version"]
        publisher = trainer_args.get("publisher")
        owned = publisher is None
        if owned:
            publisher = _api.Publisher(trainer_args["uri"], **trainer_args.get("options", {}))
        try:
            return publisher.publish(version, list(iterator), trainer_args.get("metadata"),
                                     timeout=trainer_args.get("timeout", 60.0))
        finally:
            if owned:
                publisher.close()
