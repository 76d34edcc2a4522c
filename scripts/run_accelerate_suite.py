"""Run Accelerate 1.15's own test files natively and on notebook_accel; list what passes only natively.

Not part of the CI test run (it needs 1.15's source and tracker libraries, and minutes per file). Given
the unpacked 1.15 sdist (its ``tests/`` and ``src/accelerate/test_utils``), it runs the chosen test files
with pytest twice, from the sdist's directory (its tests open ``tests/test_configs`` relative to it):

- natively: ``--native-python``, an interpreter with the real accelerate 1.15 installed;
- on us: ``--ours-python`` (default: this interpreter) with a ``sitecustomize`` put first on
  ``PYTHONPATH`` that calls ``install_as_accelerate()`` in every Python process the tests start, and
  serves ``accelerate.test_utils`` (1.15's testing helpers and scripts, which we do not ship) from the
  sdist; every other ``accelerate.X`` is ours. ``path_in_accelerate_package("test_utils", ...)``
  points into the sdist, since the scripts it names live there.

Both runs get 1.15's console scripts on ``PATH`` (``accelerate``, ``accelerate-launch``, ...: 1.15's, or
ours under the alias), for tests that run them in a subprocess. It prints per file how many tests pass natively and on us, and each test that passes
natively but not on us with the last line of its failure, and each test that fails on both with more
failure records on us (its subtests). Results are kept as JSON (``--save``) so a second run can reuse
the native half (``--native-results``). Network-only tests fail natively too here (run with
``HF_HUB_OFFLINE=1`` so they fail at once), so they never count against us. The sdist lacks
``tests/test_configs/*.yaml`` and ``tests/test_samples/``: copy them from Accelerate's repository into
the sdist's ``tests/`` to run the tests that read them; without them those tests fail on both.

    python scripts/run_accelerate_suite.py --source /tmp/accsrc/accelerate-1.15.0 \\
        --native-python /tmp/acc115-suite/bin/python --ours-python /tmp/acc115-suite/bin/python \\
        tests/test_cli.py tests/test_tracking.py tests/test_sagemaker.py
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_FILES = ["tests/test_cli.py", "tests/test_tracking.py", "tests/test_sagemaker.py"]

# Runs at start-up of every Python process of the "ours" run (it is first on PYTHONPATH).
SITECUSTOMIZE = '''
import importlib.abc, importlib.machinery, importlib.util, os, sys
from pathlib import Path

_SRC = Path(os.environ["ACCEL_SUITE_SOURCE"]) / "src" / "accelerate"


class _TestingLoader(importlib.machinery.SourceFileLoader):
    """Loads 1.15's test_utils/testing.py, then points its path helper at the sdist for test_utils/."""

    def exec_module(self, module):
        super().exec_module(module)
        original = module.path_in_accelerate_package

        def path_in_accelerate_package(*components):
            if components and components[0] == "test_utils":
                return _SRC.joinpath(*components)
            return original(*components)

        module.path_in_accelerate_package = path_in_accelerate_package


class _TestUtilsFinder(importlib.abc.MetaPathFinder):
    """Serves accelerate.test_utils(.X) from the 1.15 sdist; ahead of the alias on sys.meta_path."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "accelerate.test_utils" and not fullname.startswith("accelerate.test_utils."):
            return None
        rel = Path(*fullname.split(".")[1:])
        package = _SRC / rel / "__init__.py"
        if package.is_file():
            return importlib.util.spec_from_file_location(
                fullname, package, submodule_search_locations=[str(package.parent)])
        module = (_SRC / rel).with_suffix(".py")
        if not module.is_file():
            return None
        loader = _TestingLoader(fullname, str(module)) if fullname.endswith(".testing") else None
        return importlib.util.spec_from_file_location(fullname, module, loader=loader)


from notebook_accel import install_as_accelerate

install_as_accelerate(warn=False)
sys.meta_path.insert(0, _TestUtilsFinder())
'''

# 1.15's console scripts, and what answers each of them on us: {command: (1.15's module, ours)}.
COMMANDS = {
    "accelerate": ("accelerate.commands.accelerate_cli", "notebook_accel.commands.cli"),
    "accelerate-config": ("accelerate.commands.config", "notebook_accel.commands.config"),
    "accelerate-estimate-memory": ("accelerate.commands.estimate", "notebook_accel.commands.estimate"),
    "accelerate-launch": ("accelerate.commands.launch", "notebook_accel.commands.launch"),
    "accelerate-merge-weights": ("accelerate.commands.merge", "notebook_accel.commands.merge"),
}


def _write_env(workdir: Path, python: str, ours: bool) -> dict[str, str]:
    """Return the environment of one run, after writing its console scripts (and sitecustomize)."""
    bindir = workdir / "bin"
    bindir.mkdir()
    for command, modules in COMMANDS.items():
        shim = bindir / command
        shim.write_text(f"#!{python}\nimport sys\nfrom {modules[ours]} import main\n"
                        f"sys.argv[0] = {command!r}\nsys.exit(main())\n")  # fmt: skip
        shim.chmod(0o755)
    env = dict(os.environ)
    env["PATH"] = f"{bindir}{os.pathsep}{env.get('PATH', '')}"
    env.pop("PYTHONPATH", None)
    if ours:
        site = workdir / "site"
        site.mkdir()
        (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
        env["PYTHONPATH"] = f"{site}{os.pathsep}{ROOT}"
    return env


def _outcome(case: ET.Element) -> str:
    """Return "passed", "skipped: <reason>" or "failed xN: <last line of the first>" for one test case.

    N counts the failure and error records of the case: a test with failing subtests has one per subtest.
    """
    failures = case.findall("failure") + case.findall("error")
    nodes = failures or case.findall("skipped")
    if not nodes:
        return "passed"
    message = nodes[0].get("message") or ""
    if not message or message.startswith("[truncated"):  # pytest cuts long messages; the text is whole
        message = nodes[0].text or message
    text = message.strip().splitlines()
    last = text[-1][:200] if text else ""
    return f"failed x{len(failures)}: {last}" if failures else f"skipped: {last}"


def _outcomes(junit: Path) -> dict[str, dict[str, str]]:
    """Return {file: {test id: outcome (see ``_outcome``)}} from a JUnit XML (xunit1: it names the file)."""
    results: dict[str, dict[str, str]] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        classname, file = case.get("classname", ""), case.get("file", "")
        module = file[: -len(".py")].replace("/", ".")
        cls = classname[len(module) + 1 :] if classname.startswith(module + ".") else ""
        test_id = f"{cls}::{case.get('name')}" if cls else str(case.get("name"))
        outcome = _outcome(case)
        # A test recorded twice (rerun, or a teardown error after its pass) passes only if every record does.
        previous = results.setdefault(file, {}).get(test_id, "passed")
        results[file][test_id] = outcome if previous == "passed" else previous
    return results


def _failures(outcome: str) -> int:
    return int(outcome.split(":")[0][len("failed x") :]) if outcome.startswith("failed x") else 0


def run_files(source: Path, python: str, files: list[str], *, ours: bool, timeout: int) -> dict:
    """Return the per-test outcomes of ``files`` run with ``python`` (natively, or on us when ``ours``)."""
    with tempfile.TemporaryDirectory(prefix="accel-suite-") as tmp:
        workdir = Path(tmp)
        env = _write_env(workdir, python, ours)
        env["ACCEL_SUITE_SOURCE"] = str(source)
        junit = workdir / "junit.xml"
        probe = [python, "-c", "import accelerate; print(accelerate.__name__)"]
        who = subprocess.run(probe, env=env, capture_output=True, text=True).stdout.strip()
        if who != ("notebook_accel" if ours else "accelerate"):
            raise RuntimeError(
                f"`import accelerate` gives {who!r} under {python} (ours={ours}); see the docstring"
            )
        cmd = [
            python,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "-q",
            "-o",
            "junit_family=xunit1",
            "--continue-on-collection-errors",
            f"--junitxml={junit}",
            f"--timeout={timeout}",
            "--rootdir",
            str(source),
            *files,
        ]
        label = "ours" if ours else "1.15"
        print(f"[{label}] {' '.join(cmd)}", flush=True)
        # Its own session: a test library that signals its process group must not reach this script.
        proc = subprocess.run(
            cmd, cwd=source, env=env, capture_output=True, text=True, start_new_session=True
        )
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-3:]
        print(f"[{label}] exit {proc.returncode}: {' | '.join(tail)}", flush=True)
        if not junit.is_file():
            raise RuntimeError(f"pytest wrote no JUnit XML for {files} ({label}); its output: {tail}")
        return _outcomes(junit)


def report(native: dict, ours: dict) -> list[str]:
    """Return the report lines: per file, passes natively / on us, and what passes only natively."""
    lines, only_native, more_failures = [], [], []
    for file in sorted(set(native) | set(ours)):
        n, o = native.get(file, {}), ours.get(file, {})
        passed_n = {t for t, r in n.items() if r == "passed"}
        passed_o = {t for t, r in o.items() if r == "passed"}
        lines.append(
            f"{file}: passes on 1.15 {len(passed_n)} / on us {len(passed_n & passed_o)}"
            f" (of {len(n)} collected; {len(passed_o - passed_n)} pass only on us)"
        )
        only_native += [f"  {file}::{t}: {o.get(t, 'not collected')}" for t in sorted(passed_n - passed_o)]
        more_failures += [
            f"  {file}::{t}: 1.15 {n[t]} | us {o[t]}"
            for t in sorted(set(n) & set(o))
            if 0 < _failures(n[t]) < _failures(o[t])
        ]
    if only_native:
        lines += ["", "passes on 1.15, not on us:", *only_native]
    if more_failures:
        lines += ["", "fails on both, more failure records (subtests) on us:", *more_failures]
    return lines


def main(argv: list[str] | None = None) -> int:
    """Run the suite as the module docstring says; exit 1 when a test passes on 1.15 but not on us."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="*", default=DEFAULT_FILES, help="test files, relative to --source")
    parser.add_argument("--source", type=Path, required=True, help="the unpacked accelerate-1.15.0 sdist")
    parser.add_argument("--native-python", help="a Python with the real accelerate 1.15 installed")
    parser.add_argument("--native-results", type=Path, help="reuse the native outcomes saved by --save")
    parser.add_argument("--ours-python", default=sys.executable, help="a Python where notebook_accel imports")
    parser.add_argument("--timeout", type=int, default=300, help="pytest-timeout per test, seconds")
    parser.add_argument("--save", type=Path, help="write {'native': ..., 'ours': ...} as JSON here")
    args = parser.parse_args(argv)
    source = args.source.resolve()
    if args.native_results:
        native = json.loads(args.native_results.read_text())["native"]
        native = {f: r for f, r in native.items() if f in args.files}
    elif args.native_python:
        native = run_files(source, args.native_python, args.files, ours=False, timeout=args.timeout)
    else:
        parser.error("give --native-python (to run 1.15) or --native-results (a file saved by --save)")
    ours = run_files(source, args.ours_python, args.files, ours=True, timeout=args.timeout)
    if args.save:
        args.save.write_text(json.dumps({"native": native, "ours": ours}, indent=1, sort_keys=True))
    lines = report(native, ours)
    print("\n".join(lines))
    return 1 if any(line.startswith("  ") for line in lines) else 0


if __name__ == "__main__":
    sys.exit(main())
