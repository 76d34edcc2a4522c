"""Execute notebooks/quickstart.ipynb headless in a real kernel and save the executed copy and HTML.

This is the README's main job. The notebook runs on CPU in a fresh IPython kernel started from this
interpreter's environment (nothing is downloaded); the executed notebook and an HTML rendering land in
``artifacts/`` (or ``--output-dir``). Exits non-zero, naming the failing cell, when a cell raises.

    .venv/bin/python scripts/run_quickstart.py [--notebook PATH] [--output-dir DIR] [--timeout SECONDS]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--notebook", type=Path, default=_ROOT / "notebooks" / "quickstart.ipynb", help="notebook to execute"
    )
    parser.add_argument(
        "--output-dir", type=Path, default=_ROOT / "artifacts", help="where the executed notebook and HTML go"
    )
    parser.add_argument("--timeout", type=int, default=300, help="seconds allowed for each cell")
    return parser.parse_args(argv)


def _write_atomic(path: Path, text: str) -> None:
    # A reader (a browser, CI's artefact upload) never sees a half-written file.
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def _static_html(nb) -> str:  # noqa: ANN001 - a NotebookNode
    """Return the notebook as self-contained HTML, panels shown as their static snapshots.

    With widget state, nbconvert renders widgets with JavaScript fetched from a CDN; without it, it
    falls back to each output's ``text/html`` (the panels' snapshot), which needs nothing from outside.
    """
    import copy

    from nbconvert import HTMLExporter

    static = copy.deepcopy(nb)
    static.metadata.pop("widgets", None)
    for cell in static.cells:
        for output in cell.get("outputs", []):
            data = output.get("data", {})
            if "text/html" in data:
                data.pop("application/vnd.jupyter.widget-view+json", None)
    body, _ = HTMLExporter().from_notebook_node(static)
    return body


def main(argv: list[str] | None = None) -> int:
    """Return the process exit status: 0 when every cell ran, 1 on a cell error, 2 on bad arguments."""
    args = _parse_args(argv)
    # Imported here so that `--help` works even before the test extra is installed.
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    notebook_path = args.notebook.resolve()
    if not notebook_path.is_file():
        print(f"error: notebook {str(notebook_path)!r} not found (pass --notebook PATH)", file=sys.stderr)
        return 2
    out_dir = args.output_dir.resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = notebook_path.stem
    executed_path = out_dir / f"{stem}.executed.ipynb"
    html_path = out_dir / f"{stem}.html"

    nb = nbformat.read(notebook_path, as_version=4)
    # "python3" resolves to the kernel of this very interpreter (ipykernel's native spec), so the
    # notebook sees the package exactly as installed here.
    client = NotebookClient(
        nb,
        timeout=args.timeout,
        kernel_name="python3",
        # Nothing to save in the kernel once the last cell ran; a graceful shutdown can hang on a
        # loaded machine and leave the kernel behind, an immediate one cannot.
        shutdown_kernel="immediate",
        resources={"metadata": {"path": str(notebook_path.parent)}},
    )
    started = time.perf_counter()
    print(f"executing {notebook_path} ...", flush=True)
    failure: CellExecutionError | None = None
    try:
        client.execute()
    except CellExecutionError as exc:
        failure = exc
    elapsed = time.perf_counter() - started

    # Save what ran even on failure: the executed notebook is the best record of what went wrong.
    _write_atomic(executed_path, nbformat.writes(nb))
    _write_atomic(html_path, _static_html(nb))
    print(f"executed notebook: {executed_path}")
    print(f"HTML copy:         {html_path}")
    if failure is not None:
        print(f"FAILED after {elapsed:.1f} s: a cell raised\n{failure}", file=sys.stderr)
        return 1
    n_code = sum(1 for cell in nb.cells if cell.cell_type == "code")
    print(f"OK: {n_code} code cells ran in {elapsed:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
