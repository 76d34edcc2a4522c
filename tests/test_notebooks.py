"""The example notebooks are well-formed, self-contained tests; scripts/run_quickstart.py reports failures.

The notebooks themselves are executed by nbval (``--nbval-lax`` in pyproject's addopts, collected
from ``notebooks/``): every cell must run, and the cells marked ``# NBVAL_CHECK_OUTPUT`` must print
what the stored notebook shows, after tests/nbval_sanitize.cfg. This file checks what nbval does not.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
EXPECTED = {
    "quickstart.ipynb",
    "big_model_inference.ipynb",
    "memory_estimation.ipynb",
    "handling_failures.ipynb",
    "transformers.ipynb",
    "sharded_training.ipynb",
    "interactive_ranks.ipynb",
    "several_machines.ipynb",
}
# Run on the namespace cluster by tests/test_interactive_cluster.py (nbval skips it: notebooks/conftest.py);
# its stored outputs come from that run where one was made.
CLUSTER_ONLY = {"several_machines.ipynb"}
RUNNER = ROOT / "scripts" / "run_quickstart.py"

# Anything that would fetch a model or data at run time; the notebooks must work offline.
_NETWORK = re.compile(
    r"from_pretrained|hf_hub_download|snapshot_download|urlretrieve|requests\.|urlopen|wget |curl "
)
# from_pretrained reads a local folder when the notebook turned the Hub off before anything else ran.
_HUB_OFF = 'os.environ["HF_HUB_OFFLINE"] = "1"'


def _downloads(cell_source: str, hub_off: bool) -> bool:
    """Return whether a code cell may fetch something at run time."""
    found = {m.group(0) for m in _NETWORK.finditer(cell_source)}
    if hub_off:
        found.discard("from_pretrained")
    return bool(found)


def test_the_documented_notebooks_exist() -> None:
    assert {p.name for p in NOTEBOOKS} >= EXPECTED


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_valid_and_self_contained(path: Path) -> None:
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    # "python3" is the kernel of whatever environment runs it (nbval --nbval-current-env, Binder, Colab).
    assert nb.metadata.kernelspec.name == "python3"
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    assert code, f"{path.name} has no code cell"
    assert nb.cells[0].cell_type == "markdown" and nb.cells[0].source.startswith("# "), "starts with a title"
    hub_off = _HUB_OFF in code[0].source
    for cell in code:
        assert not _downloads(cell.source, hub_off), f"{path.name} downloads at run time:\n{cell.source}"
        assert "NBVAL_SKIP" not in cell.source, f"{path.name} skips a cell; every cell must run"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_stored_outputs_come_from_one_clean_run(path: Path) -> None:
    """The committed outputs (what GitHub and Binder show, and what nbval compares) are error-free."""
    nb = nbformat.read(path, as_version=4)
    if path.name in CLUSTER_ONLY and all(
        c.execution_count is None for c in nb.cells if c.cell_type == "code"
    ):
        pytest.skip(f"{path.name} is stored unexecuted: it runs on the namespace cluster only")
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    counts = [cell.execution_count for cell in code]
    assert counts == list(range(1, len(code) + 1)), (
        f"{path.name}: re-run top to bottom before saving: {counts}"
    )
    # A cell tagged raises-exception shows a deliberate error (nbval checks that it raises).
    errors = [
        o
        for cell in code
        if "raises-exception" not in cell.metadata.get("tags", [])
        for o in cell.outputs
        if o.output_type == "error"
    ]
    assert not errors, f"{path.name} was saved with an error output: {errors[0].get('ename')}"
    checked = [cell for cell in code if "# NBVAL_CHECK_OUTPUT" in cell.source]
    assert checked, f"{path.name} checks no output (mark stable cells with # NBVAL_CHECK_OUTPUT)"
    assert all(cell.outputs for cell in checked), f"{path.name}: a checked cell has no stored output"
    # Widget state is large and run-specific; the static HTML snapshot is what stays readable.
    assert "widgets" not in nb.metadata, f"{path.name}: save without widget state"


def _tiny_notebook(tmp_path: Path, source: str) -> Path:
    nb = nbformat.v4.new_notebook(
        cells=[nbformat.v4.new_code_cell("x = 6 * 7\nprint(x)"), nbformat.v4.new_code_cell(source)]
    )
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    path = tmp_path / "tiny.ipynb"
    nbformat.write(nb, path)
    return path


def _run_runner(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(RUNNER), *args], capture_output=True, text=True, timeout=180, cwd=ROOT
    )


_PANEL_CELL = """
from IPython.display import display
print('second cell', x + 1)
# What a panel's display() emits: the live widget plus its static HTML snapshot.
display({
    "application/vnd.jupyter.widget-view+json": {"model_id": "0" * 32, "version_major": 2, "version_minor": 0},
    "text/html": "<b>panel snapshot</b>",
    "text/plain": "Panel(...)",
}, raw=True)
"""


def test_runner_writes_executed_notebook_and_html(tmp_path: Path) -> None:
    notebook = _tiny_notebook(tmp_path, _PANEL_CELL)
    out = tmp_path / "out"
    proc = _run_runner("--notebook", str(notebook), "--output-dir", str(out))
    assert proc.returncode == 0, proc.stderr
    executed = nbformat.read(out / "tiny.executed.ipynb", as_version=4)
    assert executed.cells[1].outputs[0].text == "second cell 43\n"
    html = (out / "tiny.html").read_text(encoding="utf-8")
    assert "second cell 43" in html
    # The HTML copy is self-contained: panels appear as their snapshot, not as a widget needing a CDN.
    assert "<b>panel snapshot</b>" in html
    assert 'type="application/vnd.jupyter.widget-view+json"' not in html
    assert str(out / "tiny.executed.ipynb") in proc.stdout and str(out / "tiny.html") in proc.stdout


def test_runner_exits_non_zero_on_a_cell_error(tmp_path: Path) -> None:
    notebook = _tiny_notebook(tmp_path, "raise ValueError('broken cell')")
    out = tmp_path / "out"
    proc = _run_runner("--notebook", str(notebook), "--output-dir", str(out))
    assert proc.returncode == 1
    assert "broken cell" in proc.stderr and "FAILED" in proc.stderr
    # The executed copy is still written: it is the record of what went wrong.
    executed = nbformat.read(out / "tiny.executed.ipynb", as_version=4)
    assert executed.cells[1].outputs[0].output_type == "error"


def test_runner_names_a_missing_notebook(tmp_path: Path) -> None:
    proc = _run_runner("--notebook", str(tmp_path / "nope.ipynb"), "--output-dir", str(tmp_path))
    assert proc.returncode == 2
    assert "nope.ipynb" in proc.stderr and "not found" in proc.stderr


def test_from_pretrained_needs_the_hub_turned_off_first() -> None:
    assert _downloads("m = AutoModel.from_pretrained('gpt2')", hub_off=False)
    assert not _downloads("m = AutoModel.from_pretrained(folder)", hub_off=True)
    assert _downloads("m = AutoModel.from_pretrained(folder); hf_hub_download('x')", hub_off=True)
