"""Sphinx configuration: the user guide (Markdown, MyST) and the API reference (autodoc)."""

from __future__ import annotations

import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
# Import the package from this checkout even when it is not installed (e.g. a docs-only build).
sys.path.insert(0, str(_ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import notebook_accel  # noqa: E402

project = "notebook_accel"
author = "notebook_accel contributors"
release = notebook_accel.__version__
version = release

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
    "myst_parser",
    "_public_names",
]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]

myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

# Docstrings follow Google style ("Args:", "Returns:") as in STYLE.md; plain reST works too.
napoleon_google_docstring = True
napoleon_numpy_docstring = True
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
# No "Bases:" line: the bases are often private helpers (``_ProcessControl``) that mean nothing to a user.
autodoc_default_options = {"members": True}
# Heavy optional engines are never needed to document their configuration classes.
autodoc_mock_imports = ["deepspeed", "torch_xla", "bitsandbytes", "transformer_engine", "msamp", "megatron"]

# Type annotations name torch and typing objects that have no page here; with nitpicky off an
# unresolved cross-reference is simply rendered as text, not a warning.
nitpicky = False
# Only warnings about things outside this repository are silenced: none so far. Every other warning,
# including docstring markup errors, fails the build (tests/test_docs.py runs sphinx-build -W).
suppress_warnings: list[str] = []

html_theme = "alabaster"
html_title = "notebook_accel"
html_static_path: list[str] = []


def _no_inline_attribute_type(app, what, name, obj, options, lines):  # noqa: ANN001, ARG001
    """Keep napoleon from reading "text (cuda:0, ...)" in a property's first line as "type: description".

    This code base's docstrings never use the inline "type: description" form for attributes; their
    first line says what is returned and may hold a colon. A leading blank line makes napoleon see
    no inline type.
    """
    if what in ("attribute", "property", "data") and lines and ":" in lines[0]:
        lines.insert(0, "")


def setup(app):  # noqa: ANN001, ANN201 - Sphinx's configuration entry point
    # Before napoleon's own handler (priority 500).
    app.connect("autodoc-process-docstring", _no_inline_attribute_type, priority=400)
