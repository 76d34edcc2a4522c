"""The documentation builds with warnings as errors: user guide (MyST) and API reference (autodoc)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"

pytest.importorskip("sphinx", reason="the docs build needs the `docs` extra: pip install -e '.[docs]'")
pytest.importorskip("myst_parser", reason="the docs build needs the `docs` extra: pip install -e '.[docs]'")


@pytest.fixture(scope="module")
def built_html(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("docs_html")
    # A separate process: autodoc imports every public module, and the build must not leak state
    # (singletons, imported panels) into the rest of the test session.
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "sphinx",
            "-W",
            "--keep-going",
            "-q",
            "-b",
            "html",
            "-d",
            str(out / ".doctrees"),
            str(DOCS),
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    if proc.returncode != 0:
        pytest.fail(
            f"sphinx-build -W failed (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}", pytrace=False
        )
    return out


def test_docs_build_without_warnings(built_html: Path) -> None:
    assert (built_html / "index.html").is_file()


@pytest.mark.parametrize(
    "page",
    [
        "launching",
        "interactive",
        "state_and_ops",
        "big_models",
        "panels",
        "hosted",
        "several-machines",
        "multi_node",
        "migrating",
        "notebooks",
    ],
)
def test_user_guide_page_is_built(built_html: Path, page: str) -> None:
    html = (built_html / "guide" / f"{page}.html").read_text(encoding="utf-8")
    assert "<h1>" in html


@pytest.mark.parametrize(
    ("page", "names"),
    [
        ("top_level", ["notebook_launcher", "PartialState", "Accelerator", "load_checkpoint_and_dispatch"]),
        ("utils", ["gather", "infer_auto_device_map", "shard_checkpoint", "set_seed"]),
        ("hooks", ["AlignDevicesHook", "add_hook_to_module"]),
        ("launch", ["LaunchHandle", "LaunchError"]),
        (
            "interactive",
            ["start_ranks", "Ranks", "RankError", "RanksMagic", "load_ipython_extension", "CellDisplay"],
        ),
        (
            "widgets",
            # A panel's members include its model's (DeviceMapExplorer's come from DeviceMapModel) and the view's.
            [
                "MemoryEstimator",
                "DeviceMapExplorer",
                "OffloadMonitor",
                "LaunchPanel",
                "DeviceMapExplorer.set_budget",
                "DeviceMapExplorer.streaming_budget",
                "DeviceMapExplorer.display",
            ],
        ),
    ],
)
def test_api_reference_documents_public_names(built_html: Path, page: str, names: list[str]) -> None:
    html = (built_html / "api" / f"{page}.html").read_text(encoding="utf-8")
    # autodoc renders each documented object with an anchor id equal to its full dotted path.
    missing = [name for name in names if f'.{name}"' not in html]
    assert not missing, f"api/{page}.html documents none of {missing}"


def test_every_guide_page_is_in_the_toctree() -> None:
    index = (DOCS / "index.md").read_text(encoding="utf-8")
    pages = sorted(p.stem for p in (DOCS / "guide").glob("*.md"))
    assert pages, "docs/guide/ has no page"
    assert [p for p in pages if f"guide/{p}" not in index] == []


def test_notebook_table_lists_every_notebook() -> None:
    table = (DOCS / "guide" / "notebooks.md").read_text(encoding="utf-8")
    notebooks = sorted(p.name for p in (ROOT / "notebooks").glob("*.ipynb"))
    assert [n for n in notebooks if f"`{n}`" not in table] == []
