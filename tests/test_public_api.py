"""The public surface: every name of API.md at every listed path, with the seeds' parameter lists."""

from __future__ import annotations

import importlib
import inspect
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SPEC = json.loads((ROOT / "tests" / "data" / "api_spec.json").read_text(encoding="utf-8"))
SHARED = ROOT.parent / "shared"
# Accelerate 1.15's recorded surface wins where the seeds' older parameter lists differ (API.md).
SURFACE = json.loads((ROOT / "tests" / "data" / "accelerate_surface.json").read_text(encoding="utf-8"))

NAME_PATHS = [(name, path) for name, paths in sorted(SPEC["names"].items()) for path in paths]


@pytest.mark.parametrize(("name", "path"), NAME_PATHS, ids=[f"{p}.{n}" for n, p in NAME_PATHS])
def test_name_is_importable(name: str, path: str) -> None:
    module = importlib.import_module(path)
    assert hasattr(module, name), f"{path} has no attribute {name!r}"
    assert name in getattr(module, "__all__", [name]), f"{name} missing from {path}.__all__"


def _resolve(qualified: str):
    """Map ``accelerate.a.b.C.meth`` to our object."""
    parts = qualified.split(".")[1:]
    if parts[:3] == ["commands", "config", "default"]:
        parts = ["utils", *parts[3:]]
    for i in range(len(parts), 0, -1):
        mod_name = ".".join(["notebook_accel", *parts[: i - 1]])
        try:
            obj = importlib.import_module(mod_name)
        except ImportError:
            continue
        try:
            for attr in parts[i - 1 :]:
                obj = getattr(obj, attr)
            return obj
        except AttributeError:
            continue
    raise AssertionError(f"{qualified} does not resolve under notebook_accel")


def _param_names(obj) -> list[str]:
    target = obj.__init__ if inspect.isclass(obj) else obj
    sig = inspect.signature(target)
    out = []
    for p in sig.parameters.values():
        if p.name in ("self", "cls"):
            continue
        prefix = {inspect.Parameter.VAR_POSITIONAL: "*", inspect.Parameter.VAR_KEYWORD: "**"}.get(p.kind, "")
        out.append(prefix + p.name)
    return out


def _surface_params(qualified: str) -> list[str] | None:
    """Return Accelerate 1.15's parameter names for ``accelerate.<module>.<Name>[.<method>]``, if recorded."""
    parts = qualified.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        module = SURFACE["modules"].get(".".join(parts[:cut]))
        if module is None:
            continue
        entry = module["names"].get(parts[cut])
        for method in parts[cut + 1 :]:
            entry = (entry or {}).get("methods", {}).get(method)
        if entry is None or "parameters" not in entry:
            return None
        prefix = {"var_positional": "*", "var_keyword": "**"}
        return [
            prefix.get(p["kind"], "") + p["name"]
            for p in entry["parameters"]
            if p["name"] not in ("self", "cls")
        ]
    return None


def _expected_params(qualified: str, documented: list[str]) -> list[str]:
    recorded = _surface_params(qualified)
    return documented if recorded is None else recorded


SIGS = sorted(SPEC["signatures"].items())


@pytest.mark.parametrize(("qualified", "documented"), SIGS, ids=[q for q, _ in SIGS])
def test_documented_parameters_in_order(qualified: str, documented: list[str]) -> None:
    obj = _resolve(qualified)
    actual = _param_names(obj)
    documented = _expected_params(qualified, documented)
    if documented == ["*hooks"] or documented[-1:] == ["**kwargs"]:
        assert actual == documented, f"{qualified}: {actual} != {documented}"
        return
    assert actual[: len(documented)] == documented, (
        f"{qualified}: parameters {actual} do not start with the documented {documented}"
    )


@pytest.mark.skipif(not (SHARED / "API.md").exists(), reason="../shared is not beside this checkout")
def test_committed_spec_is_current(tmp_path) -> None:
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        extract = importlib.import_module("extract_api_spec")
    finally:
        sys.path.pop(0)
    names = extract.parse_api_md((SHARED / "API.md").read_text(encoding="utf-8"))
    sigs = extract.parse_signatures(SHARED / "seeds")
    assert names == SPEC["names"], "tests/data/api_spec.json is stale: run scripts/extract_api_spec.py"
    assert sigs == SPEC["signatures"], "tests/data/api_spec.json is stale: run scripts/extract_api_spec.py"


# Run after some imports in a fresh interpreter: no notebook stack loaded, no CUDA context created.
_STAYS_LIGHT = (
    "heavy = [m for m in ('ipywidgets', 'matplotlib', 'IPython') if m in sys.modules]\n"
    "assert not heavy, heavy\n"
    "import torch\n"
    "assert not torch.cuda.is_initialized()\n"
    "print('ok')\n"
)


def _assert_stays_light(imports: str) -> None:
    out = subprocess.run(
        [sys.executable, "-c", imports + _STAYS_LIGHT], capture_output=True, text=True, cwd="/"
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


def test_import_is_light() -> None:
    """`import notebook_accel` loads no notebook stack and never initialises CUDA."""
    _assert_stays_light("import sys, notebook_accel, notebook_accel.utils\n")


def test_full_surface_loads_without_notebook_stack() -> None:
    """Touching every public core name, and the %ranks magics' module (before `%load_ext`), still loads
    no notebook stack and no CUDA context."""
    _assert_stays_light(
        "import sys, json, importlib, notebook_accel.interactive.magics\n"
        f"spec = json.load(open({str(ROOT / 'tests' / 'data' / 'api_spec.json')!r}))\n"
        "for name, paths in spec['names'].items():\n"
        "    for p in paths:\n"
        "        getattr(importlib.import_module(p), name)\n"
    )


def test_facade_packages_pickle_by_reference() -> None:
    # utils is a _Facade (its public tqdm shadows the submodule): a function closing over it, or the
    # package itself, must reach a spawned worker as a reference to the same module.
    import pickle

    import cloudpickle

    import notebook_accel.utils as utils
    import notebook_accel.utils.tqdm  # noqa: F401  (a module callable as its function)

    tqdm_module = sys.modules["notebook_accel.utils.tqdm"]
    assert type(utils).__name__ == "_Facade"
    assert type(tqdm_module).__name__ == "_CallableModule"
    for module in (utils, tqdm_module):
        assert pickle.loads(pickle.dumps(module)) is module
        assert pickle.loads(cloudpickle.dumps(lambda m=module: m))() is module
    assert pickle.loads(cloudpickle.dumps(lambda: utils.set_seed))() is utils.set_seed


# The submodules Accelerate 1.15's package has as attributes right after `import accelerate` (its
# __init__ imports them), recorded with `sorted(k for k, v in vars(accelerate).items() if
# isinstance(v, types.ModuleType))`.
ACCELERATE_PACKAGE_SUBMODULES = (
    "accelerator", "big_modeling", "checkpointing", "commands", "data_loader", "hooks", "inference",
    "launchers", "logging", "optimizer", "parallelism_config", "scheduler", "state", "tracking", "utils",
)


def test_subpackages_are_attributes_after_import_and_load_when_read() -> None:
    """`import notebook_accel as accelerate; accelerate.utils.set_seed(0)` works, and `import` loads none."""
    probe = (
        "import json, sys\n"
        "import notebook_accel as accelerate\n"
        "before = sorted(m for m in sys.modules if m.startswith('notebook_accel.'))\n"
        f"names = {ACCELERATE_PACKAGE_SUBMODULES!r}\n"
        "listed = [n for n in names if n in dir(accelerate)]\n"
        "read = {n: getattr(accelerate, n).__name__ for n in names}\n"
        "accelerate.utils.set_seed(0)\n"
        "print(json.dumps([before, listed, read]))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    before, listed, read = json.loads(out.stdout.strip().splitlines()[-1])
    assert before == ["notebook_accel._lazy"]
    assert listed == list(ACCELERATE_PACKAGE_SUBMODULES)
    assert read == {n: f"notebook_accel.{n}" for n in ACCELERATE_PACKAGE_SUBMODULES}
    import notebook_accel

    with pytest.raises(AttributeError, match="has no attribute 'not_a_submodule'"):
        notebook_accel.not_a_submodule  # noqa: B018
