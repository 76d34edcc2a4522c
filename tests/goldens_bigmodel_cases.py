"""Utilities and big-model behaviours, run under Accelerate 1.15 and under us, one process, no launch.

``CASES[name](A)`` takes the library's top-level module (``accelerate`` or ``notebook_accel``) and returns
plain JSON: messages (first line: ours may add a hint on the next), warnings, log records, device maps.
``scripts/record_bigmodel_goldens.py`` records them under 1.15 into ``tests/data/goldens/bigmodel.json``;
``tests/test_goldens_bigmodel.py`` compares. This file imports neither library.
"""

from __future__ import annotations

import collections
import importlib
import json
import logging
import os
import platform
import re
import tempfile
import warnings
from collections.abc import Callable
from typing import Any
from unittest import mock

import torch
from torch import nn

from tests.goldens_shared import registrar

CASES: dict[str, Callable[[Any], Any]] = {}


_case = registrar(CASES)


def _mod(A: Any, path: str) -> Any:
    return importlib.import_module(f"{A.__name__}.{path}")


class _Records(logging.Handler):
    """Collects the records of every logger (root handler) while in use."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def __enter__(self) -> _Records:
        root = logging.getLogger()
        self._level = root.level
        root.addHandler(self)
        root.setLevel(logging.DEBUG)
        return self

    def __exit__(self, *exc: Any) -> None:
        root = logging.getLogger()
        root.removeHandler(self)
        root.setLevel(self._level)

    def messages(self, level: int = logging.DEBUG, contains: str = "") -> list[str]:
        # Accelerate's logger adapter prefixes "[RANK 0] ": not part of the message compared.
        out = [re.sub(r"^\[RANK \d+\] ", "", r.getMessage()) for r in self.records if r.levelno >= level]
        return [m for m in out if contains in m]


def _outcome(fn: Callable[[], Any]) -> dict:
    """Return the result or error (type, first line) of ``fn`` with its warnings (category, first line)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            out: dict = {"result": fn()}
        except Exception as exc:  # noqa: BLE001 - the error is the fact compared
            out = {"error": [type(exc).__name__, str(exc).splitlines()[0] if str(exc) else ""]}
    out["warnings"] = [
        [w.category.__name__, str(w.message).splitlines()[0]]
        for w in caught
        if not issubclass(w.category, (ResourceWarning, DeprecationWarning, FutureWarning))
    ]
    return out


class ModelForTest(nn.Module):
    """Accelerate's test model: linear1 (64 bytes), batchnorm (72), linear2 (100)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear1 = nn.Linear(3, 4)
        self.batchnorm = nn.BatchNorm1d(4)
        self.linear2 = nn.Linear(4, 5)


class Big(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.a = nn.Linear(n, n)


def _buffers(extra: bool = False) -> nn.Module:
    model = ModelForTest()
    model.linear1.register_buffer("test_buffer1", torch.zeros(10, 2))
    model.batchnorm.register_buffer("test_buffer2", torch.zeros(10, 3))
    model.linear2.register_buffer("test_buffer3", torch.zeros(10, 3))
    if extra:
        model.linear3 = nn.Linear(4, 5)
        model.linear3.register_buffer("test_buffer4", torch.zeros(10, 2))
    return model


def _seq3() -> nn.Module:
    return nn.Sequential(ModelForTest(), ModelForTest(), ModelForTest())


def _big_small() -> nn.Module:
    return nn.Sequential(Big(10), nn.Linear(2, 2), Big(3))


# (name, model, infer_auto_device_map keyword arguments)
DEVICE_MAP_RUNS: list[tuple[str, Callable[[], nn.Module], dict]] = [
    ("plain_two_gpus", ModelForTest, {"max_memory": {0: 200, 1: 200}}),
    ("seq3_split", _seq3, {"max_memory": {0: 500, 1: 500}}),
    ("seq3_no_split", _seq3, {"max_memory": {0: 500, 1: 500}, "no_split_module_classes": ["ModelForTest"]}),
    ("buffers_one_gpu", _buffers, {"max_memory": {0: 400, "cpu": "1GB"}}),
    (
        "buffers_one_gpu_offload_buffers",
        _buffers,
        {"max_memory": {0: 400, "cpu": "1GB"}, "offload_buffers": True},
    ),
    ("buffers_one_gpu_540", _buffers, {"max_memory": {0: 540, "cpu": "1GB"}}),
    # 1.15's test_infer_auto_device_map_with_buffer_check_and_multi_devices: no warning on the first
    ("buffers_two_gpus_400_400", lambda: _buffers(True), {"max_memory": {0: 400, 1: 400, "cpu": "1GB"}}),
    ("buffers_two_gpus_400_390", lambda: _buffers(True), {"max_memory": {0: 400, 1: 390, "cpu": "1GB"}}),
    ("buffers_two_gpus_400_200", lambda: _buffers(True), {"max_memory": {0: 400, 1: 200, "cpu": "1GB"}}),
    ("buffers_two_gpus_400_490", lambda: _buffers(True), {"max_memory": {0: 400, 1: 490, "cpu": "1GB"}}),
    ("buffers_two_gpus_400_510", lambda: _buffers(True), {"max_memory": {0: 400, 1: 510, "cpu": "1GB"}}),
    ("buffers_three_gpus", lambda: _buffers(True), {"max_memory": {0: 300, 1: 330, 2: 300, "cpu": "1GB"}}),
    ("gpu_fits_nothing", ModelForTest, {"max_memory": {0: 90, "cpu": 1000}}),
    (
        "gpu_fits_nothing_fallback",
        ModelForTest,
        {"max_memory": {0: 90, "cpu": 1000}, "fallback_allocation": True},
    ),
    ("zero_gpu", ModelForTest, {"max_memory": {0: 0, "cpu": 1000}}),
    (
        "second_gpu_fits_nothing",
        lambda: nn.Sequential(ModelForTest(), ModelForTest()),
        {"max_memory": {0: 300, 1: 50, "cpu": 10000}},
    ),  # fmt: skip
    ("nothing_fits_anywhere", ModelForTest, {"max_memory": {0: 10, "cpu": 10}}),
    ("cpu_fits_nothing", _seq3, {"max_memory": {"cpu": 50}, "no_split_module_classes": ["ModelForTest"]}),
    (
        "no_split_fallback",
        _seq3,
        {
            "max_memory": {0: 300, "cpu": 10000},
            "no_split_module_classes": ["ModelForTest"],
            "fallback_allocation": True,
        },
    ),  # fmt: skip
    ("big_small_500", _big_small, {"max_memory": {0: 500, "cpu": 10000}, "no_split_module_classes": ["Big"]}),
    ("big_small_470", _big_small, {"max_memory": {0: 470, "cpu": 10000}, "no_split_module_classes": ["Big"]}),
    (
        "big_small_470_fallback",
        _big_small,
        {
            "max_memory": {0: 470, "cpu": 10000},
            "no_split_module_classes": ["Big"],
            "fallback_allocation": True,
        },
    ),  # fmt: skip
]


@_case
def case_infer_auto_device_map(A):
    """Each run's device map (as sorted pairs: the order is not compared), buffer warnings and INFO records."""
    modeling = _mod(A, "utils.modeling")
    out = {}
    for name, build, kwargs in DEVICE_MAP_RUNS:
        torch.manual_seed(0)
        with _Records() as records:
            outcome = _outcome(lambda b=build, kw=kwargs: sorted([k, str(v)] for k, v in modeling.infer_auto_device_map(b(), **kw).items()))  # fmt: skip
        outcome["info"] = records.messages(logging.INFO, "insufficient memory")
        out[name] = outcome
    return out


@_case
def case_cp_comm_strategy_invalid(A):
    config = _mod(A, "parallelism_config")
    return _outcome(lambda: config.TorchContextParallelConfig(cp_comm_strategy="ring"))


@_case
def case_device_mesh_flatten_arguments(A):
    """Return the mesh built and the (type, names) of every sub-mesh flattened, with torch's mesh faked."""
    import torch.distributed as dist
    import torch.distributed.device_mesh as device_mesh

    config = _mod(A, "parallelism_config")
    calls: list = []

    class Sub:
        def __init__(self, key: Any) -> None:
            self.key = key

        def _flatten(self, name: str) -> Sub:
            calls.append(["flatten", type(self.key).__name__, list(self.key), name])
            return self

    class Mesh:
        def __init__(self, device: str, shape: Any, mesh_dim_names: Any = None) -> None:
            calls.append(["init", device, list(shape), list(mesh_dim_names)])

        def __getitem__(self, key: Any) -> Sub:
            return Sub(key)

    out = {}
    with (
        mock.patch.object(device_mesh, "init_device_mesh", Mesh),
        mock.patch.object(dist, "is_initialized", lambda: True),
        mock.patch.object(dist, "get_world_size", lambda *a, **k: 8),
    ):
        for sizes in (
            {"dp_replicate_size": 2, "dp_shard_size": 4},
            {"dp_shard_size": 8},
            {"dp_shard_size": 4, "cp_size": 2},
        ):
            calls.clear()
            config.ParallelismConfig(**sizes).build_device_mesh("cpu")
            out[json.dumps(sizes, sort_keys=True)] = list(calls)
    return out


@_case
def case_old_kernel_warning_record(A):
    """Return, per release, whether the record's own msg holds the version, its args, and 1.15's first sentence."""
    if A.__name__ == "accelerate":
        A.PartialState(cpu=True)  # its logger refuses to log before a state exists
    other = _mod(A, "utils.other")
    out = {}
    for release, shown in (
        ("4.19.0-1-amd64", "4.19.0"),
        ("4.19.112+", "4.19.112"),
        ("5.4.0-generic", "5.4.0"),
    ):
        uname = platform.uname_result("Linux", "host", release, "#1", "x86_64")
        with _Records() as records, mock.patch("platform.uname", return_value=uname):
            other.check_os_kernel()
        (record,) = [r for r in records.records if "kernel" in str(r.msg)]
        msg = re.sub(r"^\[RANK \d+\] ", "", str(record.msg))
        out[release] = {"version_in_msg": shown in msg, "args": list(record.args or ()),
                        "start": msg[: msg.index("higher") + len("higher")]}  # fmt: skip
    return out


@_case
def case_concatenate_non_tensor_leaves(A):
    operations = _mod(A, "utils.operations")
    structures = {
        "strings": ["a", "b"],
        "a_string": "ab",
        "lists_of_strings": [["a", "b"], ["c", "d"]],
        "dicts_of_strings": [{"x": "a"}, {"x": "b"}],
        "dicts_mixed": [{"x": torch.ones(1), "s": "a"}, {"x": torch.zeros(1), "s": "b"}],
        "lists_mixed": [[torch.ones(1), "a"], [torch.zeros(1), "b"]],
        "ints": [1, 2],
        "nones": [None, None],
        "strings_of_other_lengths": [["a"], ["b", "c"]],
        "bytes": [b"a", b"b"],
        "empty_lists": [[], []],
    }
    return {
        name: _outcome(lambda data=data: repr(operations.concatenate(data)))
        for name, data in structures.items()
    }


@_case
def case_save_shared_tensors_safetensors(A):
    """Return, per state dict with tensors sharing memory, the names saved and the warnings logged."""
    from safetensors.torch import load_file

    if A.__name__ == "accelerate":
        A.PartialState(cpu=True)
    utils = _mod(A, "utils")
    base = torch.arange(6.0)
    linear = nn.Linear(2, 2)
    dicts = {
        "tied_pair": {"a": base, "b": base, "d": torch.ones(2)},
        "tied_three": {"z": base, "b": base, "a": base},
        "tied_linear": {"w1": linear.weight, "w2": linear.weight, "b": linear.bias},
    }
    out = {}
    with tempfile.TemporaryDirectory() as folder:
        for name, state in dicts.items():
            path = os.path.join(folder, name + ".safetensors")
            with _Records() as records:
                result = _outcome(
                    lambda s=state, p=path: utils.save(collections.OrderedDict(s), p, safe_serialization=True)
                )
            result["saved"] = sorted(load_file(path)) if "error" not in result else None
            result["logged"] = records.messages(logging.WARNING, "Removed shared tensor")
            out[name] = result
    return out


class _Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.register_buffer("ib", torch.zeros(1))
        self.p = nn.Parameter(torch.ones(1))


class _Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(4, 4)
        self.inner = _Inner()
        self.register_buffer("buf", torch.zeros(3))
        self.seq = nn.Sequential(nn.Linear(1, 1))


@_case
def case_check_device_map_unknown_keys(A):
    """Maps whose extra keys name nothing in the model (1.15 also warns about parameter/buffer keys: not here)."""
    modeling = _mod(A, "utils.modeling")
    maps = {
        "everything_and_unknown": {"": "cpu", "zzz": "cpu"},
        "modules_and_unknown": {
            "": "cpu",
            "l1": "cpu",
            "inner": "cpu",
            "seq": "cpu",
            "l": "cpu",
            "seq.1": "cpu",
            "l1.nope": "cpu",
        },  # fmt: skip
        "unknown_and_uncovered": {"l1": "cpu", "zzz": "cpu"},
        "uncovered_buffer": {"l1": "cpu", "inner": "cpu", "seq": "cpu"},
    }
    return {name: _outcome(lambda m=m: modeling.check_device_map(_Outer(), m)) for name, m in maps.items()}


@_case
def case_load_checkpoint_flat_index(A):
    """Load a sharded safetensors checkpoint whose index is weight name -> shard file (no "weight_map")."""
    from safetensors.torch import save_file

    modeling = _mod(A, "utils.modeling")
    torch.manual_seed(0)
    source = ModelForTest()
    state = {k: v.contiguous() for k, v in source.state_dict().items()}
    with tempfile.TemporaryDirectory() as folder:
        shards = {"a.safetensors": [k for k in state if k.startswith("linear1")]}
        shards["b.safetensors"] = [k for k in state if k not in shards["a.safetensors"]]
        for shard, keys in shards.items():
            save_file({k: state[k] for k in keys}, os.path.join(folder, shard), metadata={"format": "pt"})
        index = os.path.join(folder, "model.safetensors.index.json")
        with open(index, "w", encoding="utf-8") as handle:
            json.dump({k: shard for shard, keys in shards.items() for k in keys}, handle)
        target = ModelForTest()
        for tensor in target.state_dict().values():
            tensor.zero_()
        result = _outcome(lambda: modeling.load_checkpoint_in_model(target, index))
    result["equal"] = {k: torch.equal(v, state[k]) for k, v in target.state_dict().items()}
    return result


@_case
def case_set_module_tensor_wrong_shape(A):
    modeling = _mod(A, "utils.modeling")
    return {
        name: _outcome(
            lambda n=name, v=value: modeling.set_module_tensor_to_device(ModelForTest(), n, "cpu", value=v)
        )
        for name, value in (
            ("linear1.weight", torch.ones(3, 3)),
            ("linear2.bias", torch.ones(2)),
            ("batchnorm.running_mean", torch.ones(5)),
        )  # fmt: skip
    }
