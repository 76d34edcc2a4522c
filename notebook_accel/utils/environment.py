"""Environment variables: the names Accelerate reads, parsing helpers and temporary patching."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import os
import re
import sys
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from .._lazy import attach

__all__ = [
    "ACCELERATE_DEBUG_MODE",
    "CPUInformation",
    "are_libraries_initialized",
    "clear_environment",
    "convert_dict_to_env_variables",
    "get_cpu_distributed_information",
    "get_int_from_env",
    "parse_choice_from_env",
    "parse_flag_from_env",
    "patch_environment",
    "purge_accelerate_environment",
    "str_to_bool",
]

logger = logging.getLogger(__name__)

# Device facts (GPU names, driver, NUMA affinity, the current device type) ask the device checks,
# which read this module's flags: they live in utils.device_info and are served here lazily.
_DEVICE_INFO = dict.fromkeys(
    (
        "check_cuda_fp8_capability",
        "check_cuda_p2p_ib_support",
        "get_current_device_type",
        "get_driver_version",
        "get_gpu_info",
        "override_numa_affinity",
        "set_numa_affinity",
    ),
    "notebook_accel.utils.device_info",
)
__all__ += sorted(_DEVICE_INFO)
__getattr__, __dir__ = attach(__name__, _DEVICE_INFO)

# The variable that turns on debug mode (shape checks before collectives); its value is a flag.
ACCELERATE_DEBUG_MODE = "ACCELERATE_DEBUG_MODE"

_TRUE = ("y", "yes", "t", "true", "on", "1")
_FALSE = ("n", "no", "f", "false", "off", "0")


def str_to_bool(value: str, to_bool: bool = False) -> int | bool:
    """Return 1 (or True) for a truthy string, 0 (or False) for a falsy one.

    Truthy: y, yes, t, true, on, 1. Falsy: n, no, f, false, off, 0 (case-insensitive).
    """
    lowered = str(value).strip().lower()
    if lowered in _TRUE:
        return True if to_bool else 1
    if lowered in _FALSE:
        return False if to_bool else 0
    raise ValueError(f"invalid truth value {value!r}: use one of {_TRUE + _FALSE}")


def parse_flag_from_env(key: str, default: bool = False) -> bool:
    """Return the boolean value of environment variable ``key`` (``default`` when unset)."""
    value = os.environ.get(key)
    if value is None or value == "":
        return default
    try:
        return bool(str_to_bool(value))
    except ValueError:
        raise ValueError(
            f"environment variable {key}={value!r} is not a flag: use one of {_TRUE + _FALSE}"
        ) from None


def get_int_from_env(env_keys: Iterable[str], default: int) -> int:
    """Return the first non-negative integer among the variables ``env_keys``, else ``default``."""
    for key in env_keys:
        raw = os.environ.get(key)
        if raw is None or raw == "":
            continue
        try:
            value = int(raw)
        except ValueError:
            raise ValueError(f"environment variable {key}={raw!r} is not an integer") from None
        if value >= 0:
            return value
    return default


def _process_index() -> int:
    """Return this process's global rank: from PartialState once it exists, else from ``RANK`` (0 if unset).

    Never builds the state (logging and seeding must work before it exists), and never imports it.
    """
    state_cls = getattr(sys.modules.get("notebook_accel.state"), "PartialState", None)
    if state_cls is not None and state_cls._shared_state:
        return state_cls().process_index
    raw = os.environ.get("RANK", "0")
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable RANK={raw!r} is not an integer") from None


@contextmanager
def patch_environment(**kwargs) -> Iterator[None]:
    """Set each keyword as an environment variable (key upper-cased, value ``str()``) inside the block.

    On exit every patched variable gets its previous value back (or is removed when it did not
    exist), also when the block raises.
    """
    previous: dict[str, str | None] = {}
    for key, value in kwargs.items():
        name = key.upper()
        if name not in previous:
            previous[name] = os.environ.get(name)
        os.environ[name] = str(value)
    try:
        yield
    finally:
        for name, old in previous.items():
            if old is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = old


@contextmanager
def clear_environment() -> Iterator[None]:
    """Empty ``os.environ`` inside the block and restore it exactly on exit (also on error)."""
    snapshot = os.environ.copy()
    os.environ.clear()
    try:
        yield
    finally:
        _restore_environ(snapshot)


def _restore_environ(snapshot: dict[str, str]) -> None:
    """Make ``os.environ`` equal ``snapshot``: drop the names set since, put back the changed ones."""
    for name in set(os.environ) - set(snapshot):
        del os.environ[name]
    os.environ.update(snapshot)


def parse_choice_from_env(key: str, default: str = "no") -> str:
    """Return environment variable ``key`` as a string (``default`` when unset)."""
    return os.environ.get(key, str(default))


def are_libraries_initialized(*library_names: str) -> list[str]:
    """Return those of ``library_names`` that are already imported in this process."""
    return [name for name in library_names if name in sys.modules]


# A variable name, and a value without characters a shell line would break on.
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_FORBIDDEN_VALUE = re.compile(r"[\s;<>|&`$\\\"']")


def convert_dict_to_env_variables(current_env: dict) -> list[str]:
    """Return ``["KEY=value\\n", ...]`` for the entries safe to write to an env file, warning about the rest.

    Skipped: names that are not identifiers, empty values, values with whitespace or shell characters.
    """
    lines = []
    for key, value in current_env.items():
        text = str(value)
        if _ENV_NAME.match(str(key)) and text and not _FORBIDDEN_VALUE.search(text):
            lines.append(f"{key}={text}\n")
        else:
            logger.warning(
                "Skipping %s=%s: an invalid name, an empty value or forbidden characters", key, text
            )
    return lines


@dataclasses.dataclass
class CPUInformation:
    """Where this process sits in a CPU distributed job: global and local rank and sizes."""

    rank: int = dataclasses.field(default=0, metadata={"help": "The rank of the current process."})
    world_size: int = dataclasses.field(default=1, metadata={"help": "The total number of processes."})
    local_rank: int = dataclasses.field(default=0, metadata={"help": "The rank of the process on its node."})
    local_world_size: int = dataclasses.field(default=1, metadata={"help": "The processes on this node."})


def get_cpu_distributed_information() -> CPUInformation:
    """Return this process's ranks and sizes from the launcher's variables (torchrun, MPI, Intel MPI, MVAPICH)."""
    keys = {
        "rank": ["RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK", "MV2_COMM_WORLD_RANK"],
        "world_size": ["WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE"],
        "local_rank": [
            "LOCAL_RANK",
            "MPI_LOCALRANKID",
            "OMPI_COMM_WORLD_LOCAL_RANK",
            "MV2_COMM_WORLD_LOCAL_RANK",
        ],
        "local_world_size": [
            "LOCAL_WORLD_SIZE",
            "MPI_LOCALNRANKS",
            "OMPI_COMM_WORLD_LOCAL_SIZE",
            "MV2_COMM_WORLD_LOCAL_SIZE",
        ],
    }
    defaults = {"rank": 0, "world_size": 1, "local_rank": 0, "local_world_size": 1}
    return CPUInformation(**{name: get_int_from_env(env, defaults[name]) for name, env in keys.items()})


def _purged(function: Callable) -> Callable:
    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        before = {k: v for k, v in os.environ.items() if k.startswith("ACCELERATE_")}
        try:
            return function(*args, **kwargs)
        finally:
            for key in [k for k in os.environ if k.startswith("ACCELERATE_")]:
                if key not in before:
                    del os.environ[key]
            os.environ.update(before)

    return wrapper


def purge_accelerate_environment(func_or_cls: Any) -> Any:
    """Return ``func_or_cls`` made to undo the ``ACCELERATE_*`` variables it sets or changes.

    On a function: each call restores them when it returns. On a class (unittest or pytest): every
    ``test*`` method does, in subclasses too.
    """
    if not inspect.isclass(func_or_cls):
        if not callable(func_or_cls):
            raise TypeError(
                f"purge_accelerate_environment decorates a function or a class, got {func_or_cls!r}"
            )
        return _purged(func_or_cls)
    cls = func_or_cls
    _purge_tests(cls)
    previous = cls.__dict__.get("__init_subclass__")

    @classmethod
    def __init_subclass__(sub, **kwargs: Any) -> None:  # noqa: N807
        if previous is not None:
            previous.__func__(sub, **kwargs)
        else:
            super(cls, sub).__init_subclass__(**kwargs)
        _purge_tests(sub)

    cls.__init_subclass__ = __init_subclass__
    return cls


def _purge_tests(cls: type) -> None:
    for name, attr in list(vars(cls).items()):
        if name.startswith("test") and inspect.isfunction(attr) and not getattr(attr, "_purges_env", False):
            wrapped = _purged(attr)
            wrapped._purges_env = True
            setattr(cls, name, wrapped)


def detect_platform() -> str:
    """Return ``"colab"``, ``"kaggle"`` or ``"local"`` from the environment of this process."""
    if "google.colab" in sys.modules or any(k.startswith("COLAB_") for k in os.environ):
        return "colab"
    if "KAGGLE_KERNEL_RUN_TYPE" in os.environ or "KAGGLE_URL_BASE" in os.environ:
        return "kaggle"
    return "local"
