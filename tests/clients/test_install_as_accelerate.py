"""install_as_accelerate(): `import accelerate` and its submodules, and its metadata, resolve to notebook_accel.

Each test runs in a fresh interpreter (tests/clients/_subproc.py): the alias changes sys.meta_path and
sys.modules for the whole process.
"""

from __future__ import annotations

import importlib.util
import json

import pytest

from tests.clients._subproc import last_line, run_python

REAL_INSTALLED = importlib.util.find_spec("accelerate") is not None


def test_accelerate_paths_are_the_same_module_objects():
    out = run_python(
        """
        import importlib, importlib.metadata, importlib.util, json, sys, warnings
        import notebook_accel
        warnings.simplefilter("ignore")
        notebook_accel.install_as_accelerate()
        import accelerate
        import accelerate.utils.modeling
        from accelerate.utils import get_max_memory
        from accelerate.state import PartialState
        import accelerate.commands.config as cfg
        print(json.dumps({
            "top": accelerate is notebook_accel,
            "sub": accelerate.utils.modeling is sys.modules["notebook_accel.utils.modeling"],
            "name": get_max_memory.__module__,
            "state": PartialState is notebook_accel.state.PartialState,
            "commands": cfg is sys.modules["notebook_accel.commands.config"],
            "spec_kept": accelerate.utils.modeling.__spec__.name,
            "find_spec": importlib.util.find_spec("accelerate") is not None,
            "version": importlib.metadata.version("accelerate"),
            "summary": importlib.metadata.metadata("accelerate")["Summary"],
            "installed": notebook_accel._alias.is_installed_as_accelerate(),
        }))
        """
    )
    got = json.loads(last_line(out))
    assert got["top"] and got["sub"] and got["state"] and got["commands"] and got["find_spec"]
    assert got["name"].startswith("notebook_accel.")
    assert got["spec_kept"] == "notebook_accel.utils.modeling"
    assert got["version"] == "1.15.0"
    assert "notebook_accel" in got["summary"]
    assert got["installed"] is True


def test_missing_submodule_is_a_module_not_found_error():
    out = run_python(
        """
        import warnings
        import notebook_accel
        warnings.simplefilter("ignore")
        notebook_accel.install_as_accelerate()
        try:
            import accelerate.no_such_module
        except ModuleNotFoundError as err:
            print("MNFE", err.name)
        """
    )
    assert last_line(out) == "MNFE accelerate.no_such_module"


@pytest.mark.skipif(
    not REAL_INSTALLED, reason="needs the real accelerate installed (the clients extra pulls it)"
)
def test_refuses_when_the_real_accelerate_is_already_imported():
    out = run_python(
        """
        import accelerate  # the real one
        import notebook_accel
        try:
            notebook_accel.install_as_accelerate()
        except RuntimeError as err:
            print("REFUSED", "already imported" in str(err), "restart the kernel" in str(err))
        print("real still there", accelerate.__name__)
        """
    )
    assert "REFUSED True True" in out
    assert last_line(out) == "real still there accelerate"


@pytest.mark.skipif(
    not REAL_INSTALLED, reason="needs the real accelerate installed (the clients extra pulls it)"
)
def test_warns_when_the_real_accelerate_is_installed_and_uninstall_restores_it():
    out = run_python(
        """
        import importlib.metadata, json, os, sys, warnings
        import notebook_accel
        from notebook_accel._alias import AccelerateShadowedWarning
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            notebook_accel.install_as_accelerate()
            notebook_accel.install_as_accelerate()  # a second call is a no-op (no second warning)
        shadow = [str(w.message) for w in caught if w.category is AccelerateShadowedWarning]
        import accelerate
        during = (accelerate.__name__, os.environ.get("NOTEBOOK_ACCEL_AS_ACCELERATE"))
        notebook_accel.uninstall_as_accelerate()
        import accelerate as real
        print(json.dumps({
            "warnings": shadow,
            "during": during,
            "after": real.__name__,
            "after_file": real.__file__,
            "summary": importlib.metadata.metadata("accelerate")["Summary"],
            "env": os.environ.get("NOTEBOOK_ACCEL_AS_ACCELERATE"),
            "leftover": sorted(k for k, m in sys.modules.items()
                               if k.startswith("accelerate") and m.__name__.startswith("notebook_accel")),
        }))
        """
    )
    got = json.loads(last_line(out))
    assert len(got["warnings"]) == 1 and "is installed" in got["warnings"][0]
    assert "uninstall_as_accelerate" in got["warnings"][0]
    assert got["during"] == ["notebook_accel", "1"]
    assert got["after"] == "accelerate" and "site-packages" in got["after_file"]
    assert "notebook_accel" not in (got["summary"] or "")
    assert got["env"] is None and got["leftover"] == []


@pytest.mark.parametrize("start_method", ["fork", "spawn", "forkserver"])
def test_launcher_workers_see_the_alias(tmp_path, start_method):
    # A script (not -c): spawned workers pickle the function by value, and its global `accelerate`
    # by reference, which they can only resolve after installing the alias again.
    script = tmp_path / "alias_workers.py"
    script.write_text(
        f"""
import importlib.metadata, json, warnings
import notebook_accel
warnings.simplefilter("ignore")
notebook_accel.install_as_accelerate()
import accelerate

def probe():
    import accelerate.utils as au
    state = accelerate.PartialState()
    return [accelerate.__name__, au.__name__, importlib.metadata.version("accelerate"), state.process_index]

if __name__ == "__main__":
    got = notebook_accel.notebook_launcher(probe, num_processes=2, start_method={start_method!r})
    print(json.dumps(got))
"""
    )
    out = run_python(f"import runpy; runpy.run_path({str(script)!r}, run_name='__main__')", cwd=tmp_path)
    got = json.loads(last_line(out))
    assert got == [
        ["notebook_accel", "notebook_accel.utils", "1.15.0", 0],
        ["notebook_accel", "notebook_accel.utils", "1.15.0", 1],
    ]
