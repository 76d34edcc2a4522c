"""``FullyShardedDataParallelPlugin``: the FSDP configuration, for torch's FSDP1 and FSDP2 (``fully_shard``).

One dataclass serves both versions because Accelerate scripts pass one plugin and pick the version with
``fsdp_version``. ``__post_init__`` resolves every unset field once (argument, then the ``FSDP_*``
variable that ``accelerate launch`` exports, then the version's default) into the objects torch takes,
and rejects a setting the chosen version cannot honour with a ValueError naming the field and the fix.
The wrapping itself lives in ``notebook_accel.integrations.fsdp.wrap``; this module only describes it.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import re
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from ..._lazy import LazyModule
from ...utils._validation import choice as _choice
from ...utils._validation import env as _env
from ...utils.environment import parse_flag_from_env, str_to_bool
from ...utils.other import get_module_class_from_name

__all__ = [
    "FullyShardedDataParallelPlugin",
    "check_same_settings",
    "get_module_class_from_name",
    "settings_differences",
]

# torch.distributed.fsdp (with DTensor and sympy, seconds of import) loads when a plugin is built.
fsdp = LazyModule("torch.distributed.fsdp")

logger = logging.getLogger(__name__)

_OWNER = "FullyShardedDataParallelPlugin"
_SHARDING = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2")
# FSDP2 has no strategies: resharding after forward is the one switch left (FULL_SHARD vs SHARD_GRAD_OP).
_RESHARDS = {"FULL_SHARD": True, "HYBRID_SHARD": True, "SHARD_GRAD_OP": False, "HYBRID_SHARD_ZERO2": False}
_PREFETCH = ("BACKWARD_PRE", "BACKWARD_POST", "NO_PREFETCH")
_STATE_DICT_TYPES = ("FULL_STATE_DICT", "LOCAL_STATE_DICT", "SHARDED_STATE_DICT")
# How a state-dict type gathers when the user gives no configs: the model's and the optimizer's config
# classes (in torch.distributed.fsdp) and the options both get. Full state dicts land on rank 0 only.
_GATHER_DEFAULTS = {
    "FULL_STATE_DICT": (
        "FullStateDictConfig",
        "FullOptimStateDictConfig",
        {"offload_to_cpu": True, "rank0_only": True},
    ),
    "SHARDED_STATE_DICT": ("ShardedStateDictConfig", "ShardedOptimStateDictConfig", {"offload_to_cpu": True}),
}
_WRAP_POLICIES = ("TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP")
_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "fp16": torch.float16, "float16": torch.float16,
           "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}  # fmt: skip
_PRECISIONS = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32, "no": torch.float32}
# The dtype fields of each version's mixed-precision object.
_MP_KEYS = {
    1: ("param_dtype", "reduce_dtype", "buffer_dtype"),
    2: ("param_dtype", "reduce_dtype", "output_dtype"),
}


def _enum_by_name(name: str, value: Any, choices: tuple, enum_cls: Any) -> Any:
    """Map a member, its name (case-insensitive) or its 1-based index in ``choices`` to ``enum_cls``."""
    if isinstance(value, enum_cls):
        return value
    if isinstance(value, str) and value.isdigit():
        value = int(value)
    if isinstance(value, int) and not isinstance(value, bool):
        if not 1 <= value <= len(choices):
            raise ValueError(
                f"{_OWNER}: {name}={value!r} is out of range; use 1..{len(choices)} or one of {list(choices)}"
            )
        value = choices[value - 1]
    return enum_cls[_choice(_OWNER, name, str(value).upper(), choices)]


def _flag(value: Any, var: str, default: bool) -> bool:
    """Return ``value`` when set, else the boolean environment variable ``var`` (or ``default``)."""
    return parse_flag_from_env(var, default) if value is None else bool(value)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, functools.partial) and isinstance(b, functools.partial):
        return a.func is b.func and _same(a.args, b.args) and _same(a.keywords, b.keywords)
    try:
        return bool(a == b)
    except Exception:  # values without a plain truth value (tensors): only the same object is equal
        return a is b


def settings_differences(old: Any, new: Any) -> list[str]:
    """Return ``"field: old!r != new!r"`` for each setting of two dataclass configs that differs (``[]``: equal).

    An FSDP plugin is compared as built (before preparing a model resolved fields in place); other
    dataclasses (``ParallelismConfig``) on their fields. Configs of different classes differ as a whole.
    """
    if type(old) is not type(new):
        return [f"type: {type(old).__name__} != {type(new).__name__}"]

    def settings(config: Any) -> dict[str, Any]:
        built = getattr(config, "_as_built", None)
        return (
            built
            if built is not None
            else {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
        )

    before, after = settings(old), settings(new)
    return [
        f"{name}: {before[name]!r} != {after[name]!r}"
        for name in before
        if not _same(before[name], after[name])
    ]


def check_same_settings(state: Any, **given: Any) -> None:
    """Return nothing when each config in ``given`` (``fsdp_plugin=``, ``parallelism_config=``) matches ``state``'s.

    The process state is shared by every Accelerator of the process. A re-run notebook cell builds an
    equal plugin or ``ParallelismConfig``: accepted, and the state takes the new object, so later edits
    to it apply. A different one raises ValueError naming each differing field with both values, since
    training on with the state's old one would be silent.
    """
    for name, config in given.items():
        current = getattr(state, name, None)
        if config is None or current is config:
            continue
        if current is None:
            detail = "without it"
        else:
            differences = settings_differences(current, config)
            if not differences:
                setattr(state, name, config)
                continue
            detail = f"with a different one ({'; '.join(differences)})"
        raise ValueError(
            f"{name} was given, but this process's AcceleratorState was already set up {detail}: pass the "
            "same settings, or call AcceleratorState._reset_state() (or restart the kernel) before this Accelerator"
        )


@dataclass
class FullyShardedDataParallelPlugin:
    """Configure PyTorch Fully Sharded Data Parallel, version 1 (``FullyShardedDataParallel``) or 2 (``fully_shard``).

    Unset fields read ``FSDP_VERSION``, ``FSDP_RESHARD_AFTER_FORWARD`` / ``FSDP_SHARDING_STRATEGY``,
    ``FSDP_BACKWARD_PREFETCH``, ``FSDP_OFFLOAD_PARAMS``, ``FSDP_STATE_DICT_TYPE``, ``FSDP_AUTO_WRAP_POLICY``,
    ``FSDP_TRANSFORMER_CLS_TO_WRAP``, ``FSDP_MIN_NUM_PARAMS``, ``FSDP_USE_ORIG_PARAMS``,
    ``FSDP_SYNC_MODULE_STATES``, ``FSDP_FORWARD_PREFETCH``, ``FSDP_ACTIVATION_CHECKPOINTING``,
    ``FSDP_CPU_RAM_EFFICIENT_LOADING`` and ``FSDP_IGNORED_MODULES``. Example:
    ``FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
    transformer_cls_names_to_wrap=["Block"])``.
    """

    fsdp_version: int = None
    """1 (``FullyShardedDataParallel``, the default) or 2 (``fully_shard`` on a device mesh)."""
    sharding_strategy: Any = None
    """FSDP1 only, deprecated spelling of ``reshard_after_forward``: FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, ..."""
    reshard_after_forward: Any = None
    """FSDP1: a ShardingStrategy (name, 1-based int or enum; default FULL_SHARD). FSDP2: a bool (default True)."""
    backward_prefetch: Any = None
    """FSDP1: BACKWARD_PRE, BACKWARD_POST or NO_PREFETCH (None). Ignored by FSDP2, which always prefetches."""
    mixed_precision_policy: Any = None
    """A torch policy object, a dict of its dtype fields, or "fp16" / "bf16" / "fp32" for all of them."""
    auto_wrap_policy: Callable | str | None = None
    """"transformer_based_wrap", "size_based_wrap", "no_wrap" (default) or a torch wrap-policy callable."""
    cpu_offload: Any = None
    """Offload parameters to CPU: a bool, an FSDP1 ``CPUOffload`` or an FSDP2 ``OffloadPolicy``."""
    ignored_modules: Iterable[torch.nn.Module] | str | None = None
    """Modules left unsharded, or a regex matched (fullmatch) against module names."""
    state_dict_type: Any = None
    """FULL_STATE_DICT (FSDP1 default), SHARDED_STATE_DICT (FSDP2 default) or LOCAL_STATE_DICT (FSDP1 only)."""
    state_dict_config: Any = None
    """torch's state-dict config (default derived from ``state_dict_type``)."""
    optim_state_dict_config: Any = None
    """torch's optimizer state-dict config (default derived from ``state_dict_type``)."""
    limit_all_gathers: bool = True
    """FSDP1: throttle in-flight all-gathers."""
    use_orig_params: bool | None = None
    """FSDP1: let the optimizer see the original parameters (default False). FSDP2 always does."""
    param_init_fn: Callable[[torch.nn.Module], None] | None = None
    """Materialise modules created on the meta device (FSDP1)."""
    sync_module_states: bool | None = None
    """FSDP1: broadcast rank 0's weights at wrap time (default False; forced on by cpu_ram_efficient_loading)."""
    forward_prefetch: bool = None
    """FSDP1: prefetch the next all-gather in forward (static graphs only). FSDP2 rejects it."""
    activation_checkpointing: bool = None
    """Recompute the wrapped layers' activations in backward instead of keeping them."""
    activation_checkpointing_offload: bool = None
    """Offload the kept activations to CPU (needs activation_checkpointing)."""
    cpu_ram_efficient_loading: bool = None
    """Only rank 0 holds the loaded weights; the others start empty and receive them when wrapped."""
    transformer_cls_names_to_wrap: list[str] | None = None
    """Layer class names that transformer_based_wrap shards (default: the model's ``_no_split_modules``)."""
    min_num_params: int | None = None
    """Parameter count from which size_based_wrap shards a module (default 0)."""

    def __post_init__(self) -> None:
        self._resolve_version()
        self._resolve_sharding()
        self._resolve_prefetch()
        self._resolve_offload()
        self._resolve_flags()
        self.set_state_dict_type(self.state_dict_type)
        self._resolve_wrap_policy()
        self.validate_mixed_precision_policy()
        # What this plugin was built to do: preparing a model resolves fields in place (a policy name
        # becomes a callable, the Accelerator's mixed precision fills the policy), so a plugin built
        # again from the same arguments (a re-run notebook cell) is compared on these.
        self._as_built = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    # ------------------------------------------------------------------------------ resolution steps
    def _resolve_version(self) -> None:
        version = _env("FSDP_VERSION", "1") if self.fsdp_version is None else self.fsdp_version
        if str(version).strip() not in ("1", "2") or isinstance(version, bool):
            raise ValueError(f"{_OWNER}: fsdp_version={version!r} is not valid; use 1 or 2")
        self.fsdp_version = int(str(version).strip())

    def _resolve_sharding(self) -> None:
        given, field_name = self.reshard_after_forward, "reshard_after_forward"
        if self.sharding_strategy is not None:
            if self.fsdp_version == 2:
                raise ValueError(
                    f"{_OWNER}: sharding_strategy={self.sharding_strategy!r} does not exist in FSDP2; set "
                    "reshard_after_forward=True (like FULL_SHARD) or False (like SHARD_GRAD_OP)"
                )
            if given is not None:
                raise ValueError(f"{_OWNER}: set reshard_after_forward or sharding_strategy, not both")
            warnings.warn(
                f"{_OWNER}: sharding_strategy is deprecated; use reshard_after_forward",
                FutureWarning,
                stacklevel=4,
            )
            given, field_name = self.sharding_strategy, "sharding_strategy"
        if given is None:
            default = "FULL_SHARD" if self.fsdp_version == 1 else "true"
            given = _env("FSDP_RESHARD_AFTER_FORWARD", _env("FSDP_SHARDING_STRATEGY", default))
        if self.fsdp_version == 1:
            if isinstance(given, bool):
                raise ValueError(
                    f"{_OWNER}: reshard_after_forward={given!r} is an FSDP2 setting; with fsdp_version=1 give a "
                    f"sharding strategy, one of {list(_SHARDING)}"
                )
            strategy = _enum_by_name(field_name, given, _SHARDING, fsdp.ShardingStrategy)
            self.reshard_after_forward = self.sharding_strategy = strategy
            return
        self.reshard_after_forward = self._reshard_flag(given)

    @staticmethod
    def _reshard_flag(value: Any) -> bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.upper() in _RESHARDS:  # a launcher config written for FSDP1
            return _RESHARDS[value.upper()]
        try:
            return bool(str_to_bool(str(value)))
        except ValueError:
            raise ValueError(
                f"{_OWNER}: reshard_after_forward={value!r} is not valid with fsdp_version=2; use True or False"
            ) from None

    def _resolve_prefetch(self) -> None:
        value = self.backward_prefetch
        if value is None:
            value = _env("FSDP_BACKWARD_PREFETCH", "NO_PREFETCH")
        if isinstance(value, fsdp.BackwardPrefetch):
            name = value.name
        else:
            if isinstance(value, int) or (isinstance(value, str) and value.isdigit()):
                index = int(value)
                value = _PREFETCH[index - 1] if 1 <= index <= len(_PREFETCH) else value
            name = _choice(_OWNER, "backward_prefetch", str(value).upper(), _PREFETCH)
        if self.fsdp_version == 2 and name != "NO_PREFETCH":
            logger.warning(
                "%s: backward_prefetch does not apply to FSDP2 (it always prefetches); ignored", _OWNER
            )
            name = "NO_PREFETCH"
        self.backward_prefetch = None if name == "NO_PREFETCH" else fsdp.BackwardPrefetch[name]

    def _resolve_offload(self) -> None:
        if self.cpu_offload is None:
            self.cpu_offload = parse_flag_from_env("FSDP_OFFLOAD_PARAMS", False)
        self.set_cpu_offload()
        self.validate_cpu_offload()

    def _resolve_flags(self) -> None:
        v1 = self.fsdp_version == 1
        self.activation_checkpointing = _flag(
            self.activation_checkpointing, "FSDP_ACTIVATION_CHECKPOINTING", False
        )
        self.activation_checkpointing_offload = _flag(
            self.activation_checkpointing_offload, "FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD", False
        )
        if self.activation_checkpointing_offload and not self.activation_checkpointing:
            raise ValueError(
                f"{_OWNER}: activation_checkpointing_offload=True needs activation_checkpointing=True"
            )
        self.cpu_ram_efficient_loading = _flag(
            self.cpu_ram_efficient_loading, "FSDP_CPU_RAM_EFFICIENT_LOADING", False
        )
        if self.forward_prefetch and not v1:
            raise ValueError(f"{_OWNER}: forward_prefetch is an FSDP1 option; drop it or use fsdp_version=1")
        for name in ("use_orig_params", "sync_module_states"):
            if not v1 and getattr(self, name) is not None:
                logger.warning("%s: %s does not apply to FSDP2; ignored", _OWNER, name)
                setattr(self, name, None)
        if not v1:
            self.forward_prefetch = None
            return
        self.use_orig_params = _flag(self.use_orig_params, "FSDP_USE_ORIG_PARAMS", False)
        self.forward_prefetch = _flag(self.forward_prefetch, "FSDP_FORWARD_PREFETCH", False)
        self.sync_module_states = _flag(self.sync_module_states, "FSDP_SYNC_MODULE_STATES", False)
        if self.cpu_ram_efficient_loading and not self.sync_module_states:
            # Ranks other than 0 hold empty weights: only a broadcast at wrap time makes them right.
            logger.info("%s: cpu_ram_efficient_loading turns sync_module_states on", _OWNER)
            self.sync_module_states = True
        if self.ignored_modules is None and os.environ.get("FSDP_IGNORED_MODULES"):
            self.ignored_modules = os.environ["FSDP_IGNORED_MODULES"]

    def _resolve_wrap_policy(self) -> None:
        if self.auto_wrap_policy is None:
            self.auto_wrap_policy = _env("FSDP_AUTO_WRAP_POLICY", "NO_WRAP")
        if isinstance(self.auto_wrap_policy, str):
            self.auto_wrap_policy = _choice(
                _OWNER, "auto_wrap_policy", self.auto_wrap_policy.upper(), _WRAP_POLICIES
            )
        elif not callable(self.auto_wrap_policy):
            raise TypeError(
                f"{_OWNER}: auto_wrap_policy must be a policy name or a callable, got {self.auto_wrap_policy!r}"
            )
        if self.transformer_cls_names_to_wrap is None and os.environ.get("FSDP_TRANSFORMER_CLS_TO_WRAP"):
            self.transformer_cls_names_to_wrap = os.environ["FSDP_TRANSFORMER_CLS_TO_WRAP"]
        if isinstance(self.transformer_cls_names_to_wrap, str):
            self.transformer_cls_names_to_wrap = [
                name.strip() for name in self.transformer_cls_names_to_wrap.split(",") if name.strip()
            ]
        if self.min_num_params is None:
            self.min_num_params = int(_env("FSDP_MIN_NUM_PARAMS", "0"))
        if self.min_num_params < 0:
            raise ValueError(f"{_OWNER}: min_num_params must be >= 0, got {self.min_num_params!r}")

    # ------------------------------------------------------------------------------ public setters
    def set_state_dict_type(self, state_dict_type: Any = None) -> None:
        """Set ``state_dict_type`` (default: the version's) and derive the matching state-dict configs."""
        if state_dict_type is None:
            default = "FULL_STATE_DICT" if self.fsdp_version == 1 else "SHARDED_STATE_DICT"
            state_dict_type = _env("FSDP_STATE_DICT_TYPE", default)
        kind = _enum_by_name("state_dict_type", state_dict_type, _STATE_DICT_TYPES, fsdp.StateDictType)
        if self.fsdp_version == 2 and kind == fsdp.StateDictType.LOCAL_STATE_DICT:
            raise ValueError(
                f"{_OWNER}: FSDP2 has no LOCAL_STATE_DICT; use SHARDED_STATE_DICT or FULL_STATE_DICT"
            )
        self.state_dict_type = kind
        defaults = _GATHER_DEFAULTS.get(kind.name)
        if defaults is None:  # LOCAL_STATE_DICT: each rank saves its own flat shard, nothing to configure
            return
        model_config, optim_config, options = defaults
        for field, config_name in (
            ("state_dict_config", model_config),
            ("optim_state_dict_config", optim_config),
        ):
            if getattr(self, field) is None:  # a config the user gave stays
                setattr(self, field, getattr(fsdp, config_name)(**options))

    def set_cpu_offload(self) -> None:
        """Turn a bool ``cpu_offload`` into the version's object (``CPUOffload`` / ``CPUOffloadPolicy``)."""
        if isinstance(self.cpu_offload, bool):
            if self.fsdp_version == 1:
                self.cpu_offload = fsdp.CPUOffload(offload_params=self.cpu_offload)
            else:
                self.cpu_offload = fsdp.CPUOffloadPolicy() if self.cpu_offload else fsdp.OffloadPolicy()

    def validate_cpu_offload(self) -> None:
        """Raise TypeError when ``cpu_offload`` is not the object the chosen FSDP version takes."""
        expected = fsdp.CPUOffload if self.fsdp_version == 1 else fsdp.OffloadPolicy
        if not isinstance(self.cpu_offload, expected):
            raise TypeError(
                f"{_OWNER}: cpu_offload must be a bool or a {expected.__name__} with fsdp_version="
                f"{self.fsdp_version}, got {self.cpu_offload!r}"
            )

    @property
    def cpu_offload_enabled(self) -> bool:
        """Return whether parameters are offloaded to CPU (either version's object)."""
        if self.fsdp_version == 1:
            return bool(self.cpu_offload.offload_params)
        return isinstance(self.cpu_offload, fsdp.CPUOffloadPolicy)

    def validate_mixed_precision_policy(self) -> None:
        """Turn a str / dict ``mixed_precision_policy`` into the version's torch object, or raise naming it."""
        policy = self.mixed_precision_policy
        if policy is None:
            return
        if isinstance(policy, str):
            if policy not in _PRECISIONS or policy == "no":
                raise ValueError(
                    f"{_OWNER}: mixed_precision_policy={policy!r} is not valid; use one of fp16, bf16, fp32 "
                    "(fp8 training goes through Accelerator(mixed_precision='fp8'))"
                )
            policy = dict.fromkeys(_MP_KEYS[self.fsdp_version], policy)
        if isinstance(policy, dict):
            self.mixed_precision_policy = self._policy_from_dict(policy)
            return
        expected = fsdp.MixedPrecision if self.fsdp_version == 1 else fsdp.MixedPrecisionPolicy
        if not isinstance(policy, expected):
            raise TypeError(
                f"{_OWNER}: mixed_precision_policy must be a dict, a str or a {expected.__name__} with "
                f"fsdp_version={self.fsdp_version}, got {policy!r}"
            )

    def _policy_from_dict(self, spec: dict) -> Any:
        kwargs = dict(spec)
        for key in _MP_KEYS[self.fsdp_version]:
            value = kwargs.get(key)
            if isinstance(value, str):
                if value not in _DTYPES:
                    raise ValueError(
                        f"{_OWNER}: mixed_precision_policy[{key!r}]={value!r} is not a dtype; "
                        f"choose one of {list(_DTYPES)}"
                    )
                kwargs[key] = _DTYPES[value]
        cls = fsdp.MixedPrecision if self.fsdp_version == 1 else fsdp.MixedPrecisionPolicy
        try:
            return cls(**kwargs)
        except TypeError as exc:
            raise TypeError(
                f"{_OWNER}: bad mixed_precision_policy {spec!r} for fsdp_version={self.fsdp_version} "
                f"(keys: {list(_MP_KEYS[self.fsdp_version])}): {exc}"
            ) from None

    def set_mixed_precision(
        self, mixed_precision: str, buffer_autocast: bool = False, override: bool = False
    ) -> None:
        """Set the mixed-precision policy for "fp16" / "bf16" / "fp32" (unless one is set and not ``override``)."""
        dtype = _PRECISIONS.get(str(mixed_precision))
        if dtype is None:
            raise ValueError(f"{_OWNER}: unknown mixed_precision {mixed_precision!r}; use fp16, bf16 or fp32")
        if self.mixed_precision_policy is not None and not override:
            return
        if self.fsdp_version == 1:
            buffer_dtype = dtype if buffer_autocast else torch.float32
            self.mixed_precision_policy = fsdp.MixedPrecision(
                param_dtype=dtype, reduce_dtype=dtype, buffer_dtype=buffer_dtype
            )
        else:
            # Outputs come back in fp32 so losses are computed at full precision, like autocast's wrapper.
            self.mixed_precision_policy = fsdp.MixedPrecisionPolicy(
                param_dtype=dtype, reduce_dtype=dtype, output_dtype=torch.float32
            )

    # ------------------------------------------------------------------------------ wrap policy
    get_module_class_from_name = staticmethod(get_module_class_from_name)

    def layer_classes(self, model: torch.nn.Module) -> set[type]:
        """Return the layer classes transformer_based_wrap shards in ``model`` (raise naming a missing one)."""
        names = self.transformer_cls_names_to_wrap or list(getattr(model, "_no_split_modules", None) or [])
        if not names:
            raise ValueError(
                f"{_OWNER}: TRANSFORMER_BASED_WRAP needs layer class names; set transformer_cls_names_to_wrap "
                "(or FSDP_TRANSFORMER_CLS_TO_WRAP)"
            )
        classes = set()
        for name in names:
            cls = self.get_module_class_from_name(model, name.strip())
            if cls is None:
                available = sorted({m.__class__.__name__ for m in model.modules()})
                raise ValueError(
                    f"{_OWNER}: no layer class {name!r} in the model; classes present: {available}"
                )
            classes.add(cls)
        return classes

    def set_auto_wrap_policy(self, model: torch.nn.Module) -> None:
        """Turn a policy name into the callable torch's wrap policies take, resolving class names in ``model``."""
        from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy, transformer_auto_wrap_policy

        if self.auto_wrap_policy == "TRANSFORMER_BASED_WRAP":
            self.auto_wrap_policy = functools.partial(
                transformer_auto_wrap_policy, transformer_layer_cls=self.layer_classes(model)
            )
        elif self.auto_wrap_policy == "SIZE_BASED_WRAP":
            self.auto_wrap_policy = functools.partial(
                size_based_auto_wrap_policy, min_num_params=self.min_num_params
            )
        elif self.auto_wrap_policy == "NO_WRAP":
            self.auto_wrap_policy = None

    def ignored_module_list(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        """Return the modules of ``model`` that ``ignored_modules`` names (a regex is matched on module names)."""
        if self.ignored_modules is None:
            return []
        if isinstance(self.ignored_modules, str):
            pattern = re.compile(self.ignored_modules)
            return [module for name, module in model.named_modules() if pattern.fullmatch(name)]
        return list(self.ignored_modules)

    def to_fsdp_kwargs(self) -> dict[str, Any]:
        """Return the keyword arguments for FSDP1's ``FullyShardedDataParallel(module, **kwargs)``."""
        if self.fsdp_version != 1:
            raise ValueError(f"{_OWNER}: to_fsdp_kwargs() is for fsdp_version=1; this plugin is version 2")
        policy = self.auto_wrap_policy
        return {
            "sharding_strategy": self.sharding_strategy,
            "cpu_offload": self.cpu_offload,
            "auto_wrap_policy": None if isinstance(policy, str) else policy,
            "mixed_precision": self.mixed_precision_policy,
            "backward_prefetch": self.backward_prefetch,
            "ignored_modules": self.ignored_modules if not isinstance(self.ignored_modules, str) else None,
            "param_init_fn": self.param_init_fn,
            "sync_module_states": self.sync_module_states,
            "forward_prefetch": self.forward_prefetch,
            "limit_all_gathers": self.limit_all_gathers,
            "use_orig_params": self.use_orig_params,
        }
