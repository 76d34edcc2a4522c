"""FP8 mixed-precision recipes: TransformerEngine, MS-AMP and torchao, configured like Accelerate 1.15.

Every field left at ``None`` is read from its ``ACCELERATE_FP8_*`` variable (what ``accelerate config``
writes) and otherwise takes the documented default. Building a recipe needs no engine; using it
(``check_engine()``, ``to_te_recipe()``, ``build_config()``) names the package to install.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from ...utils._validation import choice
from ...utils.environment import str_to_bool
from ...utils.kwargs import KwargsHandler
from ...utils.package_checks import is_msamp_available, is_torchao_available, is_transformer_engine_available

__all__ = ["AORecipeKwargs", "FP8RecipeKwargs", "MSAMPRecipeKwargs", "TERecipeKwargs"]

_FP8_BACKENDS = ("MSAMP", "TE")
_FP8_FORMATS = ("HYBRID", "E4M3", "E5M2")
_OPT_LEVELS = ("O1", "O2")
_AMAX_ALGOS = ("max", "most_recent")


def _from_env(name: str, default: Any, kind: Callable[[str], Any] = str) -> Any:
    """Return ``ACCELERATE_FP8_<NAME>`` converted by ``kind``, or ``default`` when it is unset."""
    value = os.environ.get(f"ACCELERATE_FP8_{name.upper()}")
    return default if value is None else kind(value)


def _flag(text: str) -> bool:
    return str_to_bool(text, to_bool=True)


@dataclass
class TERecipeKwargs(KwargsHandler):
    """The TransformerEngine FP8 recipe (``Accelerator(mixed_precision="fp8", kwargs_handlers=[...])``).

    Defaults: no fp8 autocast in eval, margin 0, interval 1, format "HYBRID" (E4M3 forward, E5M2
    backward), amax history 1024 with "most_recent", no higher-precision GEMMs, no MXFP8 block scaling.
    """

    use_autocast_during_eval: bool | None = None
    """Also run the forward under fp8 autocast in eval mode (default False)."""
    margin: int | None = None
    """Exponent margin when the scaling factor is computed from amax (default 0)."""
    interval: int | None = None
    """Steps between two recomputations of the scaling factors (default 1)."""
    fp8_format: Literal["HYBRID", "E4M3", "E5M2"] = None
    """"HYBRID" (E4M3 forward, E5M2 backward; the default), "E4M3" or "E5M2" everywhere."""
    amax_history_len: int | None = None
    """How many past amax values are kept per tensor (default 1024)."""
    amax_compute_algo: Literal["max", "most_recent"] = None
    """How the amax is drawn from that history: "most_recent" (default) or "max"."""
    override_linear_precision: tuple[bool, bool, bool] = None
    """Run the (forward, dgrad, wgrad) GEMMs in higher precision (default all False)."""
    use_mxfp8_block_scaling: bool | None = None
    """Use TransformerEngine's MXFP8 block scaling recipe (default False)."""

    def __post_init__(self) -> None:
        owner = type(self).__name__
        if self.use_autocast_during_eval is None:
            self.use_autocast_during_eval = _from_env("use_autocast_during_eval", False, _flag)
        if self.margin is None:
            self.margin = _from_env("margin", 0, int)
        if self.interval is None:
            self.interval = _from_env("interval", 1, int)
        self.fp8_format = str(self.fp8_format or _from_env("format", "HYBRID")).upper()
        if self.amax_history_len is None:
            self.amax_history_len = _from_env("amax_history_len", 1024, int)
        self.amax_compute_algo = self.amax_compute_algo or _from_env("amax_compute_algo", "most_recent")
        if self.override_linear_precision is None:
            # setup_fp8_env writes the three flags as ACCELERATE_FP8_OVERRIDE_FPROP / _DGRAD / _WGRAD.
            self.override_linear_precision = tuple(
                _from_env(f"override_{gemm}", False, _flag) for gemm in ("fprop", "dgrad", "wgrad")
            )
        if self.use_mxfp8_block_scaling is None:
            self.use_mxfp8_block_scaling = _from_env("use_mxfp8_block_scaling", False, _flag)
        choice(owner, "fp8_format", self.fp8_format, _FP8_FORMATS)
        choice(owner, "amax_compute_algo", self.amax_compute_algo, _AMAX_ALGOS)
        for name, minimum in (("margin", 0), ("interval", 1), ("amax_history_len", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"{owner}: {name} must be an int >= {minimum}, got {value!r}")
        olp = tuple(self.override_linear_precision)
        if len(olp) != 3 or not all(isinstance(v, bool) for v in olp):
            raise ValueError(
                f"{owner}: override_linear_precision must be three bools (fprop, dgrad, wgrad), "
                f"got {self.override_linear_precision!r}"
            )
        self.override_linear_precision = olp

    def check_engine(self) -> None:
        """Raise ImportError naming the package to install when TransformerEngine is missing."""
        if not is_transformer_engine_available():
            raise ImportError(
                f"{type(self).__name__} runs on TransformerEngine: pip install 'transformer_engine[pytorch]' "
                "(needs an NVIDIA Ada or Hopper GPU)"
            )

    def to_te_recipe(self) -> Any:
        """Return the ``transformer_engine.common.recipe`` object this configuration describes."""
        self.check_engine()
        from transformer_engine.common import recipe

        if self.use_mxfp8_block_scaling:
            return recipe.MXFP8BlockScaling(fp8_format=getattr(recipe.Format, self.fp8_format))
        return recipe.DelayedScaling(
            margin=self.margin,
            interval=self.interval,
            fp8_format=getattr(recipe.Format, self.fp8_format),
            amax_history_len=self.amax_history_len,
            amax_compute_algo=self.amax_compute_algo,
            override_linear_precision=self.override_linear_precision,
        )


@dataclass
class MSAMPRecipeKwargs(KwargsHandler):
    """The MS-AMP FP8 recipe: ``opt_level`` "O1" (fp8 weight gradients and all-reduce) or "O2" (also 8-bit optimizer states)."""

    opt_level: Literal["O1", "O2"] = None
    """"O1" (fp8 weight gradients and all-reduce) or "O2" (also 8-bit optimizer states; the default)."""

    def __post_init__(self) -> None:
        level = str(self.opt_level or _from_env("opt_level", "O2")).upper()
        # The MS-AMP docs write the level with a zero ("02"); read it as the letter O.
        self.opt_level = "O" + level[1:] if level[:1] == "0" else level
        choice(type(self).__name__, "opt_level", self.opt_level, _OPT_LEVELS)

    def check_engine(self) -> None:
        """Raise ImportError naming the package to install when MS-AMP is missing."""
        if not is_msamp_available():
            raise ImportError(
                f"{type(self).__name__} runs on MS-AMP (`msamp`): "
                "see https://azure.github.io/MS-AMP/docs/getting-started/installation"
            )


@dataclass
class AORecipeKwargs(KwargsHandler):
    """The torchao FP8 recipe: a ``Float8LinearConfig`` (built with padding and FSDP2 fp8 all-gather by default).

    ``module_filter_func(module, name) -> bool`` chooses the layers to convert (default: the linear
    layers but the first and the last, ``utils.ao.filter_linear_layers``).
    """

    config: Any = None
    """A torchao ``Float8LinearConfig`` (default: torchao's own)."""
    module_filter_func: Callable | None = None
    """``(module, name) -> bool`` choosing the linear layers to convert (default: all but the first and last)."""
    pad_inner_dim: bool | None = None
    """Pad the inner dimension of the GEMMs to a multiple of 16 (default True)."""
    enable_fsdp_float8_all_gather: bool | None = None
    """Gather FSDP2 shards in float8 (default True)."""

    def __post_init__(self) -> None:
        if self.pad_inner_dim is None:
            self.pad_inner_dim = True
        if self.enable_fsdp_float8_all_gather is None:
            self.enable_fsdp_float8_all_gather = True
        if self.module_filter_func is not None and not callable(self.module_filter_func):
            raise TypeError(
                f"AORecipeKwargs: module_filter_func must be callable (module, name) -> bool, "
                f"got {self.module_filter_func!r}"
            )

    def check_engine(self) -> None:
        """Raise ImportError naming the package to install when torchao is missing."""
        if not is_torchao_available():
            raise ImportError("AORecipeKwargs runs on torchao: pip install torchao")

    def build_config(self) -> Any:
        """Return ``config``, or torchao's ``Float8LinearConfig`` built from this recipe's flags."""
        if self.config is not None:
            return self.config
        self.check_engine()
        from torchao.float8 import Float8LinearConfig

        return Float8LinearConfig(
            pad_inner_dim=self.pad_inner_dim, enable_fsdp_float8_all_gather=self.enable_fsdp_float8_all_gather
        )


@dataclass
class FP8RecipeKwargs(TERecipeKwargs, MSAMPRecipeKwargs):
    """Deprecated (as in Accelerate 1.15): use ``TERecipeKwargs`` or ``MSAMPRecipeKwargs``.

    ``backend`` ("TE" by default, or ``ACCELERATE_FP8_BACKEND``) chooses which recipe the fields describe.
    """

    backend: Literal["MSAMP", "TE"] = None
    """Which engine the recipe is for: "TE" (TransformerEngine) or "MSAMP"."""

    def __post_init__(self) -> None:
        warnings.warn(
            "FP8RecipeKwargs is deprecated (as in Accelerate 1.15, removed in 2.0): use TERecipeKwargs or "
            "MSAMPRecipeKwargs",
            FutureWarning,
            stacklevel=3,
        )
        self.backend = str(self.backend or _from_env("backend", "TE")).upper()
        choice("FP8RecipeKwargs", "backend", self.backend, _FP8_BACKENDS)
        TERecipeKwargs.__post_init__(self)
        MSAMPRecipeKwargs.__post_init__(self)

    def check_engine(self) -> None:
        """Raise ImportError naming the package to install when the chosen backend's engine is missing."""
        if self.backend == "TE":
            TERecipeKwargs.check_engine(self)
        else:
            MSAMPRecipeKwargs.check_engine(self)

    def to_te_recipe(self) -> Any:
        """Return the TransformerEngine recipe (ValueError for the MS-AMP backend)."""
        if self.backend != "TE":
            raise ValueError(f"to_te_recipe() needs backend='TE', this recipe uses backend={self.backend!r}")
        return TERecipeKwargs.to_te_recipe(self)
