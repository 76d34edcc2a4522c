"""The package's shape, checked from the source (AST only, nothing is imported).

What is enforced (docs/architecture.md explains why):

- no import cycle among our own modules (imports inside functions and under ``TYPE_CHECKING``
  count: they are how cycles hide);
- imports point downwards (the direction rules in ``_ALLOWED`` below), and so do lazy references: a
  string naming one of our modules (a facade's ``attach``/``_add`` table entry, a ``LazyModule`` or
  ``forward`` target, a ``sys.modules[...]`` look-up) is read as an edge too; the upward ones are listed,
  each with its reason, in ``UPWARD_ALLOWED``;
- imports of our own modules sit at the top of the file, never inside a function;
- the headless core never imports ipywidgets, matplotlib or IPython when a module is imported;
- no function longer than 80 lines;
- no private sibling mixin files (``_accelerator_*.py``, ``_state_*.py``, ``_hooks_*.py``).

``KNOWN_VIOLATIONS`` lists what today's code still breaks, each with the area that owns the fix.
It may only shrink: the test fails on a violation that is not listed, and on a listed one that no
longer exists (whoever fixes it deletes its line).
"""

from __future__ import annotations

import ast
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# (folder on disk, dotted name it is installed as); widgets/ is installed as notebook_accel.widgets.
SOURCE_ROOTS = ((ROOT / "notebook_accel", "notebook_accel"), (ROOT / "widgets", "notebook_accel.widgets"))
MAX_FUNCTION_LINES = 80
GUI_LIBRARIES = ("ipywidgets", "matplotlib", "IPython")
MIXIN_PREFIXES = ("_accelerator_", "_state_", "_hooks_")

# Areas, from the bottom up. A module belongs to the first area whose prefix matches its name.
_AREAS: tuple[tuple[str, tuple[str, ...]], ...] = (
    # The base: the lazy-loading machinery and install_as_accelerate, both importing nothing of ours.
    ("base", ("notebook_accel._lazy", "notebook_accel._alias")),
    ("utils", ("notebook_accel.utils",)),
    ("state", ("notebook_accel.state", "notebook_accel._state_")),
    ("launch", ("notebook_accel.launch",)),
    # Several machines: the Nodes spec, the placement engines, the agent and its channel, over launch.
    ("nodes", ("notebook_accel.nodes",)),
    # The telemetry bus is the hooks' events module; prefetching serves the offloading hooks.
    (
        "hooks",
        (
            "notebook_accel.hooks",
            "notebook_accel._hooks_",
            "notebook_accel.telemetry",
            "notebook_accel.prefetch",
        ),
    ),
    ("big_modeling", ("notebook_accel.big_modeling",)),
    # Pipeline-parallel inference (prepare_pippy): reads the process state, builds on utils.
    ("inference", ("notebook_accel.inference",)),
    # The engines (DeepSpeed, Megatron-LM, FSDP, bitsandbytes, fp8, XLA): above the training loop's
    # wrappers they extend and big_modeling (quantized loading), below the accelerator that uses them.
    ("integrations", ("notebook_accel.integrations",)),
    ("accelerator", ("notebook_accel.accelerator", "notebook_accel._accelerator_")),
    ("launchers", ("notebook_accel.launchers",)),
    # Interactive ranks: a persistent group built on the launcher (and its magics, IPython lazily).
    ("interactive", ("notebook_accel.interactive",)),
    ("widgets", ("notebook_accel.widgets",)),
)
_EVERYTHING = frozenset(name for name, _ in _AREAS) | {"training", "facade"}
# Which areas each area may import. Areas not listed ("training": data_loader, optimizer, scheduler,
# checkpointing, tracking, logging) may import utils, state and each other.
_ALLOWED: dict[str, frozenset[str]] = {
    "base": frozenset(),
    "utils": frozenset({"base", "utils"}),
    "state": frozenset({"base", "utils", "state"}),
    "launch": frozenset({"base", "utils", "launch"}),
    "hooks": frozenset({"base", "utils", "hooks"}),
    "big_modeling": frozenset({"base", "utils", "state", "hooks", "big_modeling"}),
    "inference": frozenset({"base", "utils", "state", "inference"}),
    "training": frozenset({"base", "utils", "state", "training"}),
    "integrations": frozenset(
        {"base", "utils", "state", "hooks", "big_modeling", "training", "integrations"}
    ),
    "accelerator": _EVERYTHING
    - {"hooks", "big_modeling", "launch", "nodes", "launchers", "widgets", "facade"},
    "nodes": frozenset({"base", "utils", "launch", "nodes"}),
    "launchers": frozenset({"base", "utils", "state", "launch", "nodes", "launchers"}),
    "interactive": frozenset({"base", "utils", "state", "launch", "nodes", "launchers", "interactive"}),
    "widgets": _EVERYTHING - {"facade"},
    "facade": _EVERYTHING - {"widgets"},
}


def _upward_entries(
    source: str, targets: tuple[str, ...], reason: str, kind: str = "lazy"
) -> dict[tuple[str, str, str], str]:
    """Return allowlist entries ``(kind, source, target) -> reason`` for modules named without the prefix."""
    return {
        (kind, f"notebook_accel.{source}".rstrip("."), f"notebook_accel.{t}".rstrip(".")): reason
        for t in targets
    }


_ENGINES_SERVED_BY_UTILS = (
    "integrations.deepspeed.config",
    "integrations.deepspeed.plugin",
    "integrations.fp8.ao",
    "integrations.fp8.recipes",
    "integrations.fp8.transformer_engine",
    "integrations.fsdp.checkpoints",
    "integrations.fsdp.fsdp2",
    "integrations.fsdp.plugin",
    "integrations.megatron.config",
    "integrations.megatron.lm",
    "integrations.megatron.plugin",
    "integrations.quantization.bnb",
    "integrations.quantization.quantize",
    "integrations.xla",
)
# The one allowlist of references that point up the layers: (module, module it names) -> why. A lazy
# reference resolves at first use (a facade's table entry, a LazyModule or forward() target, a
# sys.modules look-up), so it costs the lower module nothing at import; each is here because
# Accelerate serves the name at that path (the path is given), for the two real imports because the
# function needs the process state, or (launch.runner -> widgets) because panel=True shows a widget. The
# test fails on an upward reference not listed here, and on an entry nothing uses any more (delete it).
UPWARD_ALLOWED: dict[tuple[str, str, str], str] = {
    # real imports: the collectives and the process helpers read the rank and world size
    **_upward_entries(
        "utils.operations", ("state",), "gather/reduce/broadcast read the process state", kind="import"
    ),
    **_upward_entries(
        "utils.other", ("state",), "wait_for_everyone, save read the process state", kind="import"
    ),
    # lazy references, each an Accelerate path
    **_upward_entries("utils", _ENGINES_SERVED_BY_UTILS, "accelerate.utils serves the engines' names"),
    **_upward_entries(
        "utils",
        ("hooks.offloaded",),
        "accelerate.utils.has_offloaded_params / align_module_device / get_state_dict_offloaded_model",
    ),
    **_upward_entries(
        "utils",
        ("parallelism_config",),
        "accelerate.utils.{ParallelismConfig,TorchTensorParallelConfig,TorchContextParallelConfig,"
        "DeepSpeedSequenceParallelConfig}",
    ),
    **_upward_entries(
        "utils.dataclasses",
        ("parallelism_config",),
        "accelerate.utils.dataclasses.{TorchTensorParallelConfig,TorchContextParallelConfig,"
        "DeepSpeedSequenceParallelConfig}",
    ),
    **_upward_entries("utils.deepspeed", ("integrations.deepspeed.config",), "accelerate.utils.deepspeed"),
    **_upward_entries("utils.megatron_lm", ("integrations.megatron.lm",), "accelerate.utils.megatron_lm"),
    **_upward_entries("utils.fsdp_utils", ("integrations.fsdp.checkpoints",), "accelerate.utils.fsdp_utils"),
    **_upward_entries("utils.bnb", ("integrations.quantization.bnb",), "accelerate.utils.bnb"),
    **_upward_entries(
        "utils.transformer_engine",
        ("integrations.fp8.transformer_engine",),
        "accelerate.utils.transformer_engine",
    ),
    **_upward_entries("utils.ao", ("integrations.fp8.ao",), "accelerate.utils.ao"),
    **_upward_entries("utils.torch_xla", ("integrations.xla",), "accelerate.utils.torch_xla"),
    **_upward_entries(
        "utils.dataclasses",
        (
            "integrations.deepspeed.plugin",
            "integrations.fp8.recipes",
            "integrations.fsdp.plugin",
            "integrations.megatron.config",
            "integrations.megatron.plugin",
        ),
        "accelerate.utils.dataclasses holds every configuration class, the engines' included",
    ),
    **_upward_entries(
        "utils.modeling",
        ("hooks.offloaded", "state"),
        "accelerate.utils.modeling.{has_offloaded_params,AcceleratorState}",
    ),
    **_upward_entries(
        "utils.other",
        ("integrations.fp8.transformer_engine", "logging"),
        "accelerate.utils.other.{convert_model,get_logger}",
    ),
    **_upward_entries("utils.random", ("state",), "accelerate.utils.random.AcceleratorState"),
    **_upward_entries("utils.tqdm", ("state",), "accelerate.utils.tqdm.PartialState"),
    **_upward_entries(
        "utils.launch",
        ("commands.launch_env",),
        "accelerate.utils.launch.{prepare_multi_gpu_env,prepare_deepspeed_cmd_env,SageMakerConfig,...}",
    ),
    **_upward_entries("hooks", ("state",), "accelerate.hooks.PartialState"),
    **_upward_entries("accelerator", ("hooks.offloaded",), "accelerate.accelerator.has_offloaded_params"),
    **_upward_entries("local_sgd", ("accelerator",), "accelerate.local_sgd.Accelerator"),
    **_upward_entries(
        "launch.runner",
        ("widgets",),
        "panel=True shows widgets.LaunchPanel; the core loads no GUI library until then (ipywidgets is optional)",
    ),
    **_upward_entries(
        "_alias",
        ("",),
        "install_as_accelerate: `import accelerate` gives this whole package",
    ),
    # sys.modules look-ups: read a state that exists, never import or build it
    **_upward_entries(
        "utils.environment",
        ("state",),
        "sys.modules: the rank of an existing PartialState for log lines and seeds, before any state exists",
    ),
    **_upward_entries(
        "launch.worker", ("state",), "sys.modules: a forked worker forgets the singletons it inherited"
    ),
}

# violation -> engineer/area that owns the fix ("lead": not assigned). May only shrink: delete the line
# of what you fix (the test fails until you do).
KNOWN_VIOLATIONS: dict[str, str] = {}


def area_of(module: str) -> str:
    """Return the area (layer) a module of ours belongs to."""
    if module == "notebook_accel":
        return "facade"
    for area, prefixes in _AREAS:
        for prefix in prefixes:
            # "_state_" names a family of files; "notebook_accel.state" a module or a package.
            if (
                module.startswith(prefix)
                if prefix.endswith("_")
                else module == prefix or module.startswith(prefix + ".")
            ):
                return area
    return "training"


@dataclass(frozen=True)
class Import:
    """One import of one of our modules: who, what, where."""

    source: str
    target: str
    function: str | None  # qualified name of the enclosing function, None at module/class level
    line: int
    # "import": an import statement. "lazy": a string naming one of our modules, absolute or relative
    # to the file's package, resolved at run time: a lazy table entry (``attach``/``_add``), a
    # ``LazyModule``/``forward`` target, or a ``sys.modules[...]`` look-up. Lazy references count for the
    # direction rules, not for cycles or the top-of-file rule (nothing is imported when the file is).
    kind: str = "import"


@dataclass
class Scan:
    """Everything the checks need, read once from the source files."""

    modules: dict[str, Path] = field(default_factory=dict)
    imports: list[Import] = field(default_factory=list)
    gui_imports: list[tuple[str, str, int]] = field(default_factory=list)
    long_functions: list[tuple[str, int]] = field(default_factory=list)
    mixin_files: list[str] = field(default_factory=list)


def _module_name(path: Path, folder: Path, dotted: str) -> str:
    parts = list(path.relative_to(folder).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([dotted, *parts])


def discover(roots=SOURCE_ROOTS) -> dict[str, Path]:
    """Return dotted module name -> file for every .py file under the source roots."""
    found: dict[str, Path] = {}
    for folder, dotted in roots:
        for path in sorted(folder.rglob("*.py")):
            found[_module_name(path, folder, dotted)] = path
    return found


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    package = module.split(".") if is_package else module.split(".")[:-1]
    base = package[: len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _own(name: str, modules: dict[str, Path]) -> str | None:
    """Return the longest prefix of ``name`` that is one of our modules, or None."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return None


_RELATIVE_NAME = re.compile(r"(\.+)([A-Za-z_][\w.]*)")


def _docstrings(tree: ast.Module) -> set[int]:
    """Return the ids of the docstring nodes of a module, its classes and functions."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


class _Visitor(ast.NodeVisitor):
    def __init__(self, module: str, is_package: bool, scan: Scan, docstrings: set[int] = frozenset()) -> None:
        self.module, self.is_package, self.scan = module, is_package, scan
        self.docstrings = docstrings
        self.scope: list[str] = []
        self.functions: list[str] = []
        self.type_checking = 0

    def _enter(self, node, is_function: bool) -> None:
        self.scope.append(node.name)
        if is_function:
            qualname = ".".join(self.scope)
            self.functions.append(qualname)
            length = node.end_lineno - node.lineno + 1
            if length > MAX_FUNCTION_LINES:
                self.scan.long_functions.append((f"{self.module}.{qualname}", length))
        self.generic_visit(node)
        if is_function:
            self.functions.pop()
        self.scope.pop()

    def visit_FunctionDef(self, node):  # noqa: N802 - ast API
        self._enter(node, True)

    visit_AsyncFunctionDef = visit_FunctionDef  # noqa: N815

    def visit_ClassDef(self, node):  # noqa: N802
        self._enter(node, False)

    def visit_If(self, node):  # noqa: N802
        test = node.test
        guarded = (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
            isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
        )
        self.type_checking += guarded
        for child in node.body:
            self.visit(child)
        self.type_checking -= guarded
        for child in node.orelse:
            self.visit(child)

    def _record(self, name: str, line: int) -> None:
        function = self.functions[-1] if self.functions else None
        top = name.split(".")[0]
        if top in GUI_LIBRARIES and function is None and not self.type_checking:
            if not self.module.startswith("notebook_accel.widgets"):
                self.scan.gui_imports.append((self.module, top, line))
        target = _own(name, self.scan.modules)
        if target is not None and target != self.module:
            self.scan.imports.append(Import(self.module, target, function, line))

    def visit_Constant(self, node):  # noqa: N802
        if not isinstance(node.value, str) or id(node) in self.docstrings:
            return
        name = node.value
        relative = _RELATIVE_NAME.fullmatch(name)
        if relative:
            level, rest = len(relative.group(1)), relative.group(2)
            name = _resolve(self.module, self.is_package, ast.ImportFrom(module=rest, names=[], level=level))
        if name in self.scan.modules and name != self.module:
            function = self.functions[-1] if self.functions else None
            self.scan.imports.append(Import(self.module, name, function, node.lineno, kind="lazy"))

    def visit_Import(self, node):  # noqa: N802
        for alias in node.names:
            self._record(alias.name, node.lineno)

    def visit_ImportFrom(self, node):  # noqa: N802
        base = _resolve(self.module, self.is_package, node)
        for alias in node.names:
            # `from pkg import sub` imports the submodule when there is one, else a name of pkg.
            full = f"{base}.{alias.name}"
            self._record(full if full in self.scan.modules else base, node.lineno)


def scan(roots=SOURCE_ROOTS) -> Scan:
    """Return the imports, long functions and mixin files of every module under ``roots``."""
    result = Scan(modules=discover(roots))
    top = roots[0][0].parent
    for module, path in result.modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        _Visitor(module, path.name == "__init__.py", result, _docstrings(tree)).visit(tree)
        package = module.rsplit(".", 1)[0]
        if package == "notebook_accel" and path.name.startswith(MIXIN_PREFIXES):
            result.mixin_files.append(path.relative_to(top).as_posix())
    return result


def cycles(imports: list[Import]) -> list[list[str]]:
    """Return the strongly connected groups (>1 module) of the import graph, each sorted (Tarjan)."""
    graph: dict[str, set[str]] = {}
    for imp in imports:
        if imp.kind != "import":
            continue  # a lazy reference imports nothing when its file is imported
        graph.setdefault(imp.source, set()).add(imp.target)
        graph.setdefault(imp.target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(groups)


def _upward(imp: Import) -> str | None:
    source_area, target_area = area_of(imp.source), area_of(imp.target)
    if target_area in _ALLOWED[source_area]:
        return None
    if (imp.kind, imp.source, imp.target) in UPWARD_ALLOWED:
        return None
    what = "upward import" if imp.kind == "import" else "upward lazy reference"
    return f"{what}: {imp.source} -> {imp.target} ({source_area} may not import {target_area})"


def violations(result: Scan) -> dict[str, dict[str, str]]:
    """Return {kind: {violation: detail}} for every rule this module enforces."""
    found: dict[str, dict[str, str]] = {
        "cycles": {},
        "upward imports": {},
        "in-function imports": {},
        "gui imports": {},
        "long functions": {},
        "mixin files": {},
    }
    for group in cycles(result.imports):
        found["cycles"][f"import cycle: {' <-> '.join(group)}"] = ""
    for imp in result.imports:
        message = _upward(imp)
        if message:
            found["upward imports"].setdefault(message, f"line {imp.line}")
        if imp.kind == "import" and imp.function is not None:
            key = f"in-function import: {imp.source}.{imp.function} -> {imp.target}"
            found["in-function imports"].setdefault(key, f"line {imp.line}")
    for module, library, line in result.gui_imports:
        found["gui imports"][f"gui import at module level: {module} -> {library}"] = f"line {line}"
    for name, length in result.long_functions:
        found["long functions"][f"long function: {name}"] = f"{length} lines"
    for path in result.mixin_files:
        found["mixin files"][f"private mixin file: {path}"] = ""
    return found


def _flat(found: dict[str, dict[str, str]]) -> dict[str, str]:
    return {key: detail for group in found.values() for key, detail in group.items()}


def summary(found: dict[str, dict[str, str]]) -> str:
    """Return one line counting the violations of each kind."""
    return " / ".join(f"{kind}: {len(group)}" for kind, group in found.items())


def check(found: dict[str, dict[str, str]], known: dict[str, str]) -> list[str]:
    """Return the problems: violations not in ``known`` and entries of ``known`` that are fixed."""
    flat = _flat(found)
    problems = [
        f"NEW  {key} ({flat[key]})" if flat[key] else f"NEW  {key}" for key in flat if key not in known
    ]
    problems += [
        f"FIXED (delete it from KNOWN_VIOLATIONS) {key}  [{owner}]"
        for key, owner in known.items()
        if key not in flat
    ]
    return sorted(problems)


def test_architecture_rules() -> None:
    found = violations(scan())
    print("architecture:", summary(found))
    problems = check(found, KNOWN_VIOLATIONS)
    assert not problems, "architecture rules:\n" + "\n".join(problems)


def test_every_upward_allowance_is_used() -> None:
    # An allowance that nothing needs any more is deleted, so the list only ever names what exists.
    used = {(imp.kind, imp.source, imp.target) for imp in scan().imports}
    assert sorted(set(UPWARD_ALLOWED) - used) == []


def test_known_violations_name_an_owner() -> None:
    owners = {
        "struct-core",
        "struct-hooks",
        "reliability",
        "surface",
        "goldens",
        "dashboard",
        "engines",
        "lead",
    }
    assert {owner for owner in KNOWN_VIOLATIONS.values()} <= owners


# --- the checker itself, on a small made-up package ---------------------------------------------


def _write(folder: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = folder / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def _found(tmp_path: Path, files: dict[str, str]) -> dict[str, str]:
    base = {"notebook_accel/__init__.py": "", "notebook_accel/utils/__init__.py": ""}
    _write(tmp_path, {**base, **files})
    return _flat(violations(scan(((tmp_path / "notebook_accel", "notebook_accel"),))))


def test_checker_sees_a_cycle_closed_inside_a_function(tmp_path: Path) -> None:
    found = _found(
        tmp_path,
        {
            "notebook_accel/utils/a.py": "from . import b\n",
            "notebook_accel/utils/b.py": "def f():\n    from .a import x\n",
        },
    )
    assert "import cycle: notebook_accel.utils.a <-> notebook_accel.utils.b" in found
    assert "in-function import: notebook_accel.utils.b.f -> notebook_accel.utils.a" in found


def test_checker_sees_upward_imports(tmp_path: Path) -> None:
    found = _found(
        tmp_path,
        {
            "notebook_accel/state.py": "",
            "notebook_accel/accelerator.py": "from .hooks import h\n",
            "notebook_accel/hooks.py": "from notebook_accel.state import s\n",
            "notebook_accel/utils/operations.py": "from ..state import s\n",
            "notebook_accel/utils/memory.py": "from ..state import s\n",
        },
    )
    assert (
        "upward import: notebook_accel.accelerator -> notebook_accel.hooks (accelerator may not import hooks)"
        in found
    )
    assert "upward import: notebook_accel.hooks -> notebook_accel.state (hooks may not import state)" in found
    assert (
        "upward import: notebook_accel.utils.memory -> notebook_accel.state (utils may not import state)"
        in found
    )
    # operations may read the state.
    assert not any(key.startswith("upward import: notebook_accel.utils.operations") for key in found)


def test_checker_sees_upward_lazy_references(tmp_path: Path) -> None:
    # Each form a facade uses to name a module it loads later, from a utils module that may not import
    # them: an attach() table, an _add() entry (relative), a LazyModule target and a sys.modules look-up.
    found = _found(
        tmp_path,
        {
            "notebook_accel/state.py": "",
            "notebook_accel/integrations/__init__.py": "",
            "notebook_accel/integrations/engine.py": "",
            "notebook_accel/utils/table.py": (
                '"""notebook_accel.state (a docstring is no reference)."""\n'
                "_TABLE = {'Engine': 'notebook_accel.integrations.engine'}\n"
                "__getattr__, __dir__ = attach(__name__, _TABLE)\n"
            ),
            "notebook_accel/utils/__init__.py": "_add('..integrations.engine', 'Engine')\n_add('.table', 'x')\n",
            "notebook_accel/utils/proxy.py": "engine = LazyModule('notebook_accel.integrations.engine')\n",
            "notebook_accel/utils/peek.py": "import sys\n\ndef rank():\n    return sys.modules.get('notebook_accel.state')\n",
        },
    )
    upward = "(utils may not import integrations)"
    assert (
        f"upward lazy reference: notebook_accel.utils.table -> notebook_accel.integrations.engine {upward}"
        in found
    )
    assert (
        f"upward lazy reference: notebook_accel.utils -> notebook_accel.integrations.engine {upward}" in found
    )
    assert (
        f"upward lazy reference: notebook_accel.utils.proxy -> notebook_accel.integrations.engine {upward}"
        in found
    )
    assert (
        "upward lazy reference: notebook_accel.utils.peek -> notebook_accel.state (utils may not import state)"
        in found
    )
    # A docstring naming a module, a same-layer entry and a look-up inside a function are no violation of
    # their own (the look-up counts for the direction only), and lazy references close no cycle.
    assert "upward lazy reference: notebook_accel.utils.table -> notebook_accel.state" not in str(found)
    assert not any(key.startswith(("in-function import", "import cycle")) for key in found)


def test_listed_upward_references_pass_and_unlisted_ones_fail(tmp_path: Path, monkeypatch) -> None:
    files = {
        "notebook_accel/integrations/__init__.py": "",
        "notebook_accel/integrations/engine.py": "",
        "notebook_accel/utils/face.py": "forward(__name__, 'notebook_accel.integrations.engine')\n",
    }
    key = "upward lazy reference: notebook_accel.utils.face -> notebook_accel.integrations.engine"
    assert any(found.startswith(key) for found in _found(tmp_path, files))
    allowed = {
        ("lazy", "notebook_accel.utils.face", "notebook_accel.integrations.engine"): "accelerate.utils.face"
    }
    monkeypatch.setattr(sys.modules[__name__], "UPWARD_ALLOWED", allowed)
    assert not any(found.startswith(key) for found in _found(tmp_path, files))


def test_checker_sees_long_functions_gui_imports_and_mixins(tmp_path: Path) -> None:
    # 1 line of `def` + the body: 81 lines is one too many, 80 is the most allowed.
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    short = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES - 1))
    found = _found(
        tmp_path,
        {
            "notebook_accel/utils/long.py": f"def too_long():\n{body}\n\ndef fits():\n{short}\n",
            "notebook_accel/_state_bits.py": "import ipywidgets\n\ndef f():\n    import matplotlib\n",
        },
    )
    assert found["long function: notebook_accel.utils.long.too_long"] == f"{MAX_FUNCTION_LINES + 1} lines"
    assert "long function: notebook_accel.utils.long.fits" not in found
    assert "gui import at module level: notebook_accel._state_bits -> ipywidgets" in found
    assert not any("matplotlib" in key for key in found)
    assert "private mixin file: notebook_accel/_state_bits.py" in found


def test_checker_reports_new_and_fixed_entries() -> None:
    found = {"cycles": {"import cycle: a <-> b": ""}, "long functions": {}}
    problems = check(found, {"long function: gone": "lead"})
    assert problems == [
        "FIXED (delete it from KNOWN_VIOLATIONS) long function: gone  [lead]",
        "NEW  import cycle: a <-> b",
    ]


@pytest.mark.parametrize(
    ("module", "area"),
    [
        ("notebook_accel._lazy", "base"),
        ("notebook_accel._alias", "base"),
        ("notebook_accel.utils.operations", "utils"),
        ("notebook_accel.state.world", "state"),
        ("notebook_accel._state_gradient", "state"),
        ("notebook_accel.launchers", "launchers"),
        ("notebook_accel.launch.plan", "launch"),
        ("notebook_accel.telemetry", "hooks"),
        ("notebook_accel.prefetch", "hooks"),
        ("notebook_accel.accelerator.core", "accelerator"),
        ("notebook_accel.data_loader", "training"),
        ("notebook_accel", "facade"),
    ],
)
def test_area_of(module: str, area: str) -> None:
    assert area_of(module) == area


# The supervision core (issue 33): small modules and short functions where launches, interactive ranks,
# nodes and panels meet. A function's size counts its code lines: its docstring, blank lines and
# comment-only lines aside.
CORE_PATHS = ("notebook_accel/launch", "notebook_accel/interactive", "notebook_accel/nodes",
              "notebook_accel/launchers.py", "widgets")
CORE_MAX_MODULE_LINES = 450
CORE_MAX_FUNCTION_CODE_LINES = 60


def code_lines(function: ast.FunctionDef | ast.AsyncFunctionDef, source_lines: list[str]) -> int:
    """Return how many lines of a function's body are code (not its docstring, a blank or a comment)."""
    body = function.body
    first = body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        if len(body) == 1:
            return 0
        first = body[1]
    lines = source_lines[first.lineno - 1 : function.end_lineno]
    return sum(1 for line in lines if line.strip() and not line.strip().startswith("#"))


def core_size_problems(root: Path) -> list[str]:
    """Return each core module over the line limit and each core function over the code-line limit."""
    problems = []
    for entry in CORE_PATHS:
        path = root / entry
        files = sorted(path.rglob("*.py")) if path.is_dir() else [path] if path.exists() else []
        for file in files:
            source = file.read_text(encoding="utf-8")
            lines = source.splitlines()
            name = file.relative_to(root).as_posix()
            if len(lines) > CORE_MAX_MODULE_LINES:
                problems.append(f"{name}: {len(lines)} lines (at most {CORE_MAX_MODULE_LINES})")
            for node in ast.walk(ast.parse(source)):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    count = code_lines(node, lines)
                    if count > CORE_MAX_FUNCTION_CODE_LINES:
                        problems.append(
                            f"{name}: {node.name} has {count} code lines (at most {CORE_MAX_FUNCTION_CODE_LINES})"
                        )
    return problems


def test_core_modules_and_functions_stay_small() -> None:
    problems = core_size_problems(ROOT)
    assert not problems, "split these (docs/architecture.md, 'Sizes'):\n" + "\n".join(problems)


def test_core_size_check_sees_long_modules_and_functions(tmp_path: Path) -> None:
    doc = '    """A docstring\n    over two lines."""\n'
    code = "\n".join(f"    x{i} = {i}  # counted" for i in range(CORE_MAX_FUNCTION_CODE_LINES))
    fits = f"def fits():\n{doc}{code}\n    # a comment\n\n"
    too_long = f"def too_long():\n{code}\n    y = 1\n"
    (tmp_path / "notebook_accel/launch").mkdir(parents=True)
    (tmp_path / "notebook_accel/launch/small.py").write_text(fits + too_long, encoding="utf-8")
    (tmp_path / "widgets").mkdir()
    (tmp_path / "widgets/big.py").write_text("x = 1\n" * (CORE_MAX_MODULE_LINES + 1), encoding="utf-8")
    (tmp_path / "notebook_accel/utils").mkdir()
    (tmp_path / "notebook_accel/utils/big.py").write_text("x = 1\n" * 600, encoding="utf-8")  # not core
    assert core_size_problems(tmp_path) == [
        f"notebook_accel/launch/small.py: too_long has {CORE_MAX_FUNCTION_CODE_LINES + 1} code lines (at most 60)",
        f"widgets/big.py: {CORE_MAX_MODULE_LINES + 1} lines (at most 450)",
    ]
