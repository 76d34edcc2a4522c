"""DeepSpeedPlugin: DeepSpeed configuration, validated without needing deepspeed installed.

Re-exported by ``notebook_accel.utils.plugins``; kept apart because the config filling logic
(``"auto"`` values, mismatch reports) is a topic of its own.
"""

from __future__ import annotations

import base64
import binascii
import copy
import json
import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ...utils import imports
from ...utils._validation import choice as _choice
from ...utils._validation import env as _env
from ...utils._validation import positive_int as _positive_int
from ...utils.enums import MIXED_PRECISION_CHOICES
from ...utils.environment import parse_flag_from_env
from ...utils.other import get_module_class_from_name
from .config import config_node

if TYPE_CHECKING:
    import torch

__all__ = ["DeepSpeedPlugin"]

logger = logging.getLogger(__name__)
# =============================================================================================
# DeepSpeed


_OFFLOAD_DEVICES = ("none", "cpu", "nvme")

# plugin attribute -> dotted key in the DeepSpeed config
_DS_MAPPING = {
    "gradient_accumulation_steps": "gradient_accumulation_steps",
    "gradient_clipping": "gradient_clipping",
    "zero_stage": "zero_optimization.stage",
    "offload_optimizer_device": "zero_optimization.offload_optimizer.device",
    "offload_param_device": "zero_optimization.offload_param.device",
    "offload_optimizer_nvme_path": "zero_optimization.offload_optimizer.nvme_path",
    "offload_param_nvme_path": "zero_optimization.offload_param.nvme_path",
    "zero3_save_16bit_model": "zero_optimization.stage3_gather_16bit_weights_on_model_save",
}


def _load_ds_config(source: object) -> dict:
    """Return the DeepSpeed config dict from a dict, a JSON file path or a base64-encoded JSON string."""
    if isinstance(source, dict):
        return json.loads(json.dumps(source))  # deep copy; also rejects non-JSON values early
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as fh:
                try:
                    config = json.load(fh)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"DeepSpeedPlugin: {path} is not valid JSON: {exc}") from None
        else:
            try:
                config = json.loads(base64.urlsafe_b64decode(path).decode("utf-8"))
            except (binascii.Error, UnicodeDecodeError, json.JSONDecodeError, ValueError):
                raise FileNotFoundError(
                    f"DeepSpeedPlugin: hf_ds_config={path!r} is neither an existing JSON file, a dict, nor "
                    "a base64-encoded JSON config"
                ) from None
        if not isinstance(config, dict):
            raise ValueError(
                f"DeepSpeedPlugin: the config in {path!r} must be a JSON object, got {type(config).__name__}"
            )
        return config
    raise TypeError(
        f"DeepSpeedPlugin: hf_ds_config must be a dict or a path to a JSON file, got {type(source).__name__}"
    )


def _config_leaves(config: dict, prefix: str) -> list[tuple[str, dict, str]]:
    """Return (dotted key, the dict holding it, its key there) for every non-dict value under ``config``."""
    leaves: list[tuple[str, dict, str]] = []
    pending = [(prefix, config)]
    while pending:
        path, node = pending.pop()
        for key, value in node.items():
            if isinstance(value, dict):
                pending.append((f"{path}{key}.", value))
            else:
                leaves.append((path + key, node, key))
    return leaves


def _reconcile(
    node: dict, leaf: str, dotted: str, given: dict[str, Any], must_match: bool
) -> tuple[str, str] | None:
    """Put the given value in place of an ``"auto"`` one; say what stays wrong (``("auto" | "differs", text)``)."""
    current = node.get(leaf)
    if current == "auto":
        if dotted not in given:
            return "auto", f"- `{dotted}` is 'auto' in the DeepSpeed config and no value was given for it"
        node[leaf] = given[dotted]
        return None
    if must_match and current is not None and dotted in given and given[dotted] != current:
        return "differs", f"- ds {dotted}={current} vs arg {dotted}={given[dotted]}"
    return None


def _config_error(unfilled: list[str], disagreeing: list[str]) -> str:
    lines = [
        "DeepSpeedPlugin: the DeepSpeed config does not fit the arguments given:",
        *unfilled,
        *disagreeing,
    ]
    if unfilled:
        lines.append("give each 'auto' value in the config, or pass it to the plugin / Accelerator")
    if disagreeing:
        lines.append("make the values that disagree equal, or set them to 'auto' in the config")
    return "\n".join(lines)


@dataclass
class DeepSpeedPlugin:
    """Configure DeepSpeed: either a full DeepSpeed config (``hf_ds_config``) or the common fields.

    Unset fields read ``ACCELERATE_GRADIENT_ACCUMULATION_STEPS``, ``ACCELERATE_GRADIENT_CLIPPING``,
    ``ACCELERATE_DEEPSPEED_ZERO_STAGE`` (default 2), ``ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE``,
    ``ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE``, ``ACCELERATE_DEEPSPEED_OFFLOAD_*_NVME_PATH``,
    ``ACCELERATE_DEEPSPEED_ZERO3_INIT``, ``ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL`` and
    ``ACCELERATE_DEEPSPEED_CONFIG_FILE``. Building the plugin needs no deepspeed; preparing a model does
    (``require_deepspeed()`` raises ImportError naming it).
    """

    hf_ds_config: Any = None
    """DeepSpeed config: a dict, a path to a JSON file, or a base64-encoded JSON string."""
    gradient_accumulation_steps: int = None
    """Micro-batches per optimizer step (``ACCELERATE_GRADIENT_ACCUMULATION_STEPS``, else 1)."""
    gradient_clipping: float = None
    """Gradient norm DeepSpeed clips to (``ACCELERATE_GRADIENT_CLIPPING``; none by default)."""
    zero_stage: int = None
    """ZeRO stage: 0, 1, 2 or 3."""
    is_train_batch_min: str = True
    """With several batch sizes, whether the smallest one is the training batch size."""
    offload_optimizer_device: bool = None
    """Where optimizer states go: "none", "cpu" or "nvme" (ZeRO 2 and 3)."""
    offload_param_device: bool = None
    """Where parameters go: "none", "cpu" or "nvme" (ZeRO 3 only)."""
    offload_optimizer_nvme_path: str = None
    """Folder of the optimizer state when ``offload_optimizer_device`` is "nvme"."""
    offload_param_nvme_path: str = None
    """Folder of the parameters when ``offload_param_device`` is "nvme"."""
    zero3_init_flag: bool = None
    """Build the model directly partitioned (``deepspeed.zero.Init``); ZeRO 3 only."""
    zero3_save_16bit_model: bool = None
    """Gather 16-bit weights when saving a ZeRO-3 model."""
    transformer_moe_cls_names: str = None
    """Comma-separated MoE layer class names (ZeRO 3 leaf modules)."""
    enable_msamp: bool = None
    """Train in FP8 with the MS-AMP backend (``ACCELERATE_FP8_BACKEND=MSAMP`` when unset)."""
    msamp_opt_level: str | None = None
    """MS-AMP optimisation level, "O1" or "O2" (default "O1"); only with ``enable_msamp``."""

    def __post_init__(self) -> None:
        owner = "DeepSpeedPlugin"
        if self.hf_ds_config is None:
            path = _env("ACCELERATE_DEEPSPEED_CONFIG_FILE", "none")
            self.hf_ds_config = None if path == "none" else path
        if self.gradient_accumulation_steps is None:
            gas = _env("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "auto")
            self.gradient_accumulation_steps = int(gas) if gas.isdigit() else gas
        if self.gradient_accumulation_steps != "auto":
            _positive_int(owner, "gradient_accumulation_steps", self.gradient_accumulation_steps)
        if self.gradient_clipping is None:
            clip = _env("ACCELERATE_GRADIENT_CLIPPING", "none")
            self.gradient_clipping = None if clip == "none" else ("auto" if clip == "auto" else float(clip))
        if self.gradient_clipping not in (None, "auto") and not (
            isinstance(self.gradient_clipping, (int, float)) and self.gradient_clipping > 0
        ):
            raise ValueError(
                f"{owner}: gradient_clipping must be a positive number, got {self.gradient_clipping!r}"
            )
        if self.zero_stage is None:
            self.zero_stage = _env("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2")
        if isinstance(self.zero_stage, str) and self.zero_stage.isdigit():
            self.zero_stage = int(self.zero_stage)
        _choice(owner, "zero_stage", self.zero_stage, (0, 1, 2, 3))
        for name in ("offload_optimizer_device", "offload_param_device"):
            value = getattr(self, name)
            if value is None:
                value = _env(f"ACCELERATE_DEEPSPEED_{name.upper()}", "none")
            setattr(self, name, _choice(owner, name, str(value).lower(), _OFFLOAD_DEVICES))
        for name in ("offload_optimizer_nvme_path", "offload_param_nvme_path"):
            if getattr(self, name) is None:
                setattr(self, name, _env(f"ACCELERATE_DEEPSPEED_{name.upper()}", "none"))
        if self.zero3_save_16bit_model is None:
            self.zero3_save_16bit_model = parse_flag_from_env(
                "ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL", False
            )
        if self.zero3_init_flag is None:
            self.zero3_init_flag = parse_flag_from_env("ACCELERATE_DEEPSPEED_ZERO3_INIT", False)
        self._resolve_msamp(owner)

        if self.hf_ds_config is None:
            self.deepspeed_config = self._build_config()
        else:
            self.deepspeed_config = _load_ds_config(self.hf_ds_config)
            given = {
                key: getattr(self, attr)
                for attr, key in _DS_MAPPING.items()
                if getattr(self, attr) is not None
            }
            for key in given:
                self.fill_match(key, must_match=False, **given)
            self._read_back()
        self._validate_config()
        if self.zero3_init_flag and self.zero_stage != 3:
            logger.warning("DeepSpeedPlugin: zero3_init_flag only applies to ZeRO stage 3; turning it off")
            self.zero3_init_flag = False
        self._selected = False

    # -- config building -----------------------------------------------------------------------
    def _build_config(self) -> dict:
        zero: dict[str, Any] = {
            "stage": self.zero_stage,
            "offload_optimizer": {"device": self.offload_optimizer_device},
            "offload_param": {"device": self.offload_param_device},
            "stage3_gather_16bit_weights_on_model_save": self.zero3_save_16bit_model,
        }
        if self.offload_optimizer_device == "nvme":
            zero["offload_optimizer"]["nvme_path"] = self.offload_optimizer_nvme_path
        if self.offload_param_device == "nvme":
            zero["offload_param"]["nvme_path"] = self.offload_param_nvme_path
        config: dict[str, Any] = {
            "train_batch_size": "auto",
            "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": self.gradient_accumulation_steps,
            "zero_optimization": zero,
        }
        if self.gradient_clipping is not None:
            config["gradient_clipping"] = self.gradient_clipping
        return config

    def _read_back(self) -> None:
        # A user config is the source of truth: mirror its concrete values onto the attributes.
        for attr, key in _DS_MAPPING.items():
            node, leaf = self._find_config_node(key)
            if node is not None and leaf in node and node[leaf] != "auto":
                value = node[leaf]
                setattr(
                    self,
                    attr,
                    value.lower() if attr.endswith("_device") and isinstance(value, str) else value,
                )

    def _resolve_msamp(self, owner: str) -> None:
        if self.enable_msamp is None:
            self.enable_msamp = _env("ACCELERATE_FP8_BACKEND", "").upper() == "MSAMP"
        if self.msamp_opt_level is None:
            self.msamp_opt_level = _env("ACCELERATE_FP8_OPT_LEVEL", "O1")
        level = str(self.msamp_opt_level).upper()
        self.msamp_opt_level = "O" + level[1:] if level[:1] == "0" else level
        _choice(owner, "msamp_opt_level", self.msamp_opt_level, ("O1", "O2"))

    def _validate_config(self) -> None:
        owner = "DeepSpeedPlugin"
        zero = self.deepspeed_config.get("zero_optimization", {})
        stage = zero.get("stage", 0)
        if stage != "auto":
            _choice(owner, "zero_optimization.stage", stage, (0, 1, 2, 3))
        for part in ("offload_optimizer", "offload_param"):
            node = zero.get(part) or {}
            device = str(node.get("device", "none")).lower()
            _choice(owner, f"zero_optimization.{part}.device", device, _OFFLOAD_DEVICES)
            if device == "nvme" and node.get("nvme_path") in (None, "none"):
                raise ValueError(
                    f"{owner}: {part} to 'nvme' needs a path: set {part}_nvme_path (or "
                    f"zero_optimization.{part}.nvme_path in the config)"
                )
        param_device = str((zero.get("offload_param") or {}).get("device", "none")).lower()
        if param_device != "none" and stage not in (3, "auto"):
            raise ValueError(
                f"{owner}: offload_param_device={param_device!r} needs ZeRO stage 3 (zero_stage={stage!r}); "
                "use zero_stage=3 or offload_optimizer_device instead"
            )

    def _find_config_node(self, ds_key_long: str) -> tuple[dict | None, str]:
        return config_node(self.deepspeed_config, ds_key_long)

    def get_value(self, ds_key_long: str, default: Any = None) -> Any:
        """Return the value at dotted key ``ds_key_long`` of the DeepSpeed config (``default`` if absent)."""
        node, leaf = self._find_config_node(ds_key_long)
        return default if node is None else node.get(leaf, default)

    def fill_match(
        self, ds_key_long: str, mismatches: list[str] | None = None, must_match: bool = True, **kwargs
    ) -> None:
        """Fill an ``"auto"`` config value from ``kwargs``; with ``must_match`` record values that disagree."""
        node, leaf = self._find_config_node(ds_key_long)
        if node is None:
            return
        problem = _reconcile(node, leaf, ds_key_long, kwargs, must_match)
        if problem is None:
            return
        kind, text = problem
        if kind == "auto":
            raise ValueError(_config_error([text], []))
        if mismatches is not None:
            mismatches.append(text)

    def deepspeed_config_process(
        self,
        prefix: str = "",
        mismatches: list[str] | None = None,
        config: dict | None = None,
        must_match: bool = True,
        **kwargs,
    ) -> None:
        """Fill the config's ``"auto"`` values from ``kwargs`` (dotted keys); raise on mismatching values."""
        unfilled: list[str] = []
        disagreeing = [] if mismatches is None else mismatches
        root = self.deepspeed_config if config is None else config
        for dotted, node, leaf in _config_leaves(root, prefix):
            problem = _reconcile(node, leaf, dotted, kwargs, must_match)
            if problem is not None:
                (unfilled if problem[0] == "auto" else disagreeing).append(problem[1])
        # A caller that hands in its own prefix collects the disagreements and reports them itself.
        if unfilled or (disagreeing and not prefix):
            raise ValueError(_config_error(unfilled, disagreeing if not prefix else []))

    def set_mixed_precision(self, mixed_precision: str) -> None:
        """Enable "fp16" / "bf16" (or neither for "no") in the DeepSpeed config, refusing a contradiction."""
        _choice("DeepSpeedPlugin", "mixed_precision", mixed_precision, MIXED_PRECISION_CHOICES)
        config = self.deepspeed_config
        if mixed_precision in ("fp16", "bf16"):
            other = "bf16" if mixed_precision == "fp16" else "fp16"
            if (config.get(other) or {}).get("enabled") is True:
                raise ValueError(
                    f"DeepSpeedPlugin: mixed_precision={mixed_precision!r} but the DeepSpeed config enables {other}; "
                    "remove one of them"
                )
            config.setdefault(mixed_precision, {"enabled": True})
        for dtype in ("fp16", "bf16"):
            config.setdefault(dtype, {"enabled": False})
        flags = {"fp16.enabled": mixed_precision == "fp16", "bf16.enabled": mixed_precision == "bf16"}
        for key in flags:
            self.fill_match(key, must_match=False, **flags)

    def is_auto(self, ds_key_long: str) -> bool:
        """Return whether the config value at dotted key ``ds_key_long`` is ``"auto"`` (False when absent)."""
        return self.get_value(ds_key_long) == "auto"

    def is_zero3_init_enabled(self) -> bool:
        """Return whether models are built directly partitioned: ``zero3_init_flag`` under ZeRO stage 3."""
        return bool(self.zero3_init_flag) and self.is_zero3

    # -- several plugins: AcceleratorState selects the active one ------------------------------------
    @property
    def selected(self) -> bool:
        """Return whether this plugin is the active one of ``AcceleratorState().deepspeed_plugins``."""
        return self._selected

    @selected.setter
    def selected(self, value: bool) -> None:
        # AcceleratorState.select_deepspeed_plugin flips this flag on every registered plugin.
        if value:
            self.select(_from_accelerator_state=True)
        else:
            self._selected = False

    def select(self, _from_accelerator_state: bool = False) -> None:
        """Return None; mark this plugin active and point transformers' DeepSpeed weakref at its config.

        Only ``AcceleratorState().select_deepspeed_plugin(name)`` may call it, so that exactly one plugin
        is active: called directly it raises ValueError naming that method.
        """
        if not _from_accelerator_state:
            raise ValueError(
                "A `DeepSpeedPlugin` object must be enabled through the state, which deselects the others: "
                "call `AcceleratorState().select_deepspeed_plugin(name)`"
            )
        # transformers reads the weakref to build models partitioned: only ZeRO-3 init needs it. Without
        # deepspeed, configuring stays possible (prepare() raises ImportError naming it).
        if self.is_zero3_init_enabled() and imports.is_deepspeed_available():
            self.set_deepspeed_weakref()
        self._selected = True

    def set_deepspeed_weakref(self) -> None:
        """Return None; register this config with transformers so ``from_pretrained`` builds ZeRO-3 models partitioned.

        transformers keeps a weak reference to the last ``HfDeepSpeedConfig`` created; the plugin holds it
        in ``self.dschf``. Without transformers this is a no-op, unless ZeRO-3 init is on (then ImportError);
        transformers' config object itself needs deepspeed (ImportError naming it).
        """
        if not imports.is_transformers_available():
            if self.is_zero3_init_enabled():
                raise ImportError(
                    "DeepSpeedPlugin: zero3_init_flag=True builds transformers models partitioned and needs "
                    "transformers: pip install transformers (or set zero3_init_flag=False)"
                )
            return
        self.require_deepspeed()
        from transformers.integrations import HfDeepSpeedConfig

        config = copy.deepcopy(self.deepspeed_config)
        # DeepSpeed's own config parser refuses "auto": placeholders until the dataloaders fix the sizes.
        for key in ("gradient_accumulation_steps", "train_micro_batch_size_per_gpu"):
            if config.get(key, "auto") == "auto":
                config[key] = 1
        if config.get("train_batch_size") == "auto":
            del config["train_batch_size"]
        self.dschf = HfDeepSpeedConfig(config)

    def set_moe_leaf_modules(self, model: torch.nn.Module) -> None:
        """Return None; mark ``model``'s ``transformer_moe_cls_names`` classes as ZeRO-3 leaf modules (no-op if unset).

        DeepSpeed then gathers each MoE block's parameters as a whole instead of hooking its experts one by
        one. A class name absent from ``model`` raises ValueError; a missing (or pre-0.14) deepspeed ImportError.
        """
        if self.transformer_moe_cls_names is None:
            return
        names = [name.strip() for name in str(self.transformer_moe_cls_names).split(",") if name.strip()]
        classes = [get_module_class_from_name(model, name) for name in names]
        missing = [name for name, cls in zip(names, classes) if cls is None]
        if missing:
            raise ValueError(
                f"DeepSpeedPlugin: transformer_moe_cls_names names {missing} but the model has no module of "
                f"that class; use class names of its MoE blocks (e.g. 'MixtralSparseMoeBlock')"
            )
        self.require_deepspeed()
        try:
            from deepspeed.utils import set_z3_leaf_modules
        except ImportError as err:
            raise ImportError(
                "DeepSpeedPlugin.set_moe_leaf_modules needs deepspeed>=0.14.0 (set_z3_leaf_modules): "
                "pip install -U deepspeed"
            ) from err
        set_z3_leaf_modules(model, classes)

    @property
    def is_zero3(self) -> bool:
        """Return whether the configuration uses ZeRO stage 3."""
        return self.get_value("zero_optimization.stage") == 3

    @staticmethod
    def require_deepspeed() -> None:
        """Raise ImportError naming ``deepspeed`` when it is not installed."""
        if not imports.is_deepspeed_available():
            raise ImportError("DeepSpeedPlugin requires `deepspeed` to prepare models: pip install deepspeed")

    def zero3_init_context_manager(self, enable: bool = False):
        """Return ``deepspeed.zero.Init(config)`` when ``enable`` and ZeRO 3 init is on, else a null context."""
        import contextlib

        if not (enable and self.zero3_init_flag and self.is_zero3):
            return contextlib.nullcontext()
        self.require_deepspeed()
        import deepspeed

        return deepspeed.zero.Init(config_dict_or_path=self.deepspeed_config)
