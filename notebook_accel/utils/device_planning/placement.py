"""A device map checked against its model, once per load, and the facts the loaders read from it.

``load_checkpoint_and_dispatch`` checks its device map here once and hands the resulting
:class:`DevicePlacement` to ``load_checkpoint_in_model`` and ``dispatch_model``, which accept it
in place of the dict and skip the check. Each of them called alone checks a plain dict itself.
What a placement answers: the device of any tensor or module name (longest matching prefix), the
modules sent to a device, and whether an offload folder is needed ("disk" entries). The error for
a missing folder is written here only.
"""

from __future__ import annotations

import difflib
import warnings
import weakref
from collections.abc import Iterable
from typing import Union

from torch import nn

from .devices import DISK, Device, check_map_device, device_key

__all__ = ["DeviceLookup", "DevicePlacement", "check_device_map", "require_offload_folder"]

DeviceMap = dict[str, Device]


class DeviceLookup:
    """Callable giving the device-map value of a tensor or module name: its longest prefix in the map.

    Names not covered by any entry give None. Answers are memoised per lookup object, prefixes
    included, so a whole state dict is resolved in about one dictionary probe per name.
    """

    def __init__(self, device_map: DeviceMap) -> None:
        self._map = device_map
        self._memo: dict[str, Device | None] = {}

    def __call__(self, name: str) -> Device | None:
        """Return the device of ``name`` (None when no entry covers it)."""
        probe, trail = name, []
        while True:
            if probe in self._memo:
                found = self._memo[probe]
                break
            if probe in self._map:
                found = self._map[probe]
                break
            trail.append(probe)
            cut = probe.rfind(".")
            if cut == -1:
                found = self._map.get("")
                break
            probe = probe[:cut]
        for seen in trail:
            self._memo[seen] = found
        return found


def _model_names(model: nn.Module) -> tuple[set[str], list[str]]:
    """Return every module/tensor name of ``model`` and its state-dict keys."""
    names = {name for name, _ in model.named_modules(remove_duplicate=False)}
    names.update(name for name, _ in model.named_parameters(remove_duplicate=False))
    names.update(name for name, _ in model.named_buffers(remove_duplicate=False))
    return names, list(model.state_dict(keep_vars=True).keys())


def _closest_names(key: str, names: set[str]) -> list[str]:
    """Return up to a few existing names resembling the unknown ``key`` (for the error message)."""
    close = difflib.get_close_matches(key, sorted(names), n=3, cutoff=0.5)
    if close:
        return close
    # Short names ("O" for "0") share too few characters for difflib: offer the names that stand at
    # the same level as the unknown one instead.
    parent = key.rpartition(".")[0]
    siblings = (n for n in names if n and n.rpartition(".")[0] == parent)
    return sorted(siblings, key=lambda n: (len(n), n))[:8]


def _uncovered(state_keys: Iterable[str], covered: set[str]) -> list[str]:
    """Return the state-dict keys no entry of ``covered`` (names or their prefixes) places."""
    missing = []
    for key in state_keys:
        probe = key
        while probe not in covered:
            cut = probe.rfind(".")
            if cut == -1:
                missing.append(key)
                break
            probe = probe[:cut]
    return missing


def check_device_map(model: nn.Module, device_map: DeviceMap) -> None:
    """Raise ``ValueError`` when ``device_map`` leaves a parameter or buffer of ``model`` unplaced.

    Devices are not checked against this machine here (a map may be planned for another one);
    ``DevicePlacement.check``, which the loaders use, does that.

    Keys naming nothing in the model (no module, parameter or buffer) are ignored with one UserWarning
    listing them, 1.15's text followed by the closest existing names; uncovered tensors are all listed.
    """
    if not isinstance(device_map, dict):
        raise TypeError(
            f"device_map must be a dict of module name -> device, not {type(device_map).__name__}."
        )
    names, state_keys = _model_names(model)
    unknown = [key for key in device_map if key != "" and key not in names]
    if unknown:
        hints = []
        for key in unknown:
            close = _closest_names(key, names)
            if close:
                hints.append(f"{key!r}: {', '.join(repr(c) for c in close)}")
        closest = f"\nClosest names: {'; '.join(hints)}." if hints else ""
        warnings.warn(
            f"The following device_map keys do not match any submodules in the model: {unknown}{closest}",
            UserWarning,
            stacklevel=2,
        )
    if "" in device_map:
        return
    missing = _uncovered(state_keys, set(device_map))
    if missing:
        raise ValueError(
            "The device_map provided does not give any device for the following parameters: "
            + ", ".join(missing)
        )


def require_offload_folder(
    disk_modules: list[str], folder: object, argument: str, alternative: str = ""
) -> None:
    """Raise ``ValueError`` when modules go to "disk" and ``folder`` is None; ``argument`` names the parameter to pass."""
    if not disk_modules or folder is not None:
        return
    also = f" or `{alternative}`" if alternative else ""
    raise ValueError(
        f"The device_map sends {disk_modules[:5]} to 'disk' but no offload folder was given: pass `{argument}` "
        f"(a folder for the offloaded weights, or the one already holding them or an index pointing into a "
        f"safetensors checkpoint){also}."
    )


class DevicePlacement:
    """A device map checked against one model (``check_device_map`` passed), with what loaders ask of it.

    Build it with :meth:`check`; it keeps its own copy of the map and a weak reference to the
    model, and is accepted wherever a device-map dict is (``load_checkpoint_in_model``,
    ``dispatch_model``) for that same model without a second check.
    """

    def __init__(self, model: nn.Module, device_map: DeviceMap) -> None:
        self._model = weakref.ref(model)
        self.device_map: DeviceMap = dict(device_map)
        self.keys: dict[str, Union[int, str]] = {name: device_key(d) for name, d in self.device_map.items()}
        self.device_of = DeviceLookup(self.device_map)

    @classmethod
    def check(cls, model: nn.Module, device_map: DeviceMap | DevicePlacement) -> DevicePlacement:
        """Return the placement of ``device_map`` on ``model``, checking it (names and this machine's devices) unless it already is one for ``model``."""
        if isinstance(device_map, DevicePlacement):
            if device_map.is_for(model):
                return device_map
            device_map = device_map.device_map
        if isinstance(device_map, dict):
            for key, value in device_map.items():
                check_map_device(key, value)  # before any tensor moves: 3.5 or "cuda:7" never reach torch
        check_device_map(model, device_map)
        return cls(model, device_map)

    def is_for(self, model: nn.Module) -> bool:
        """Return whether this placement was checked against ``model`` (the same object)."""
        return self._model() is model

    def modules_on(self, key: Union[int, str]) -> list[str]:
        """Return the names sent to device-map key ``key`` (``"cpu"``, ``"disk"``, ``0``...), in map order."""
        return [name for name, k in self.keys.items() if k == key]

    @property
    def disk_modules(self) -> list[str]:
        """Return the names sent to "disk"."""
        return self.modules_on(DISK)

    @property
    def devices(self) -> set[Union[int, str]]:
        """Return the distinct device-map keys used."""
        return set(self.keys.values())

    def __repr__(self) -> str:
        return f"DevicePlacement({self.device_map!r})"
