"""Sphinx extension: the ``public-api`` directive, autodoc for every name of a lazy facade.

``notebook_accel`` and ``notebook_accel.utils`` re-export names defined in small topic modules,
listed in the facade's ``_TABLE`` (name -> defining module). The directive walks that table, so the
reference can never drift from the code, and documents each name under its public path
(``notebook_accel.utils.gather``), grouped by topic module. Names that the facade takes from another
documented facade are listed with a link instead of being documented twice.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect

from docutils import nodes
from docutils.parsers.rst import directives
from docutils.statemachine import StringList
from sphinx.util import logging
from sphinx.util.docutils import SphinxDirective

_log = logging.getLogger(__name__)


def _kind(obj: object) -> str:
    if inspect.isclass(obj):
        return "exception" if issubclass(obj, BaseException) else "class"
    if callable(obj):
        return "function"
    return "data"


class PublicApi(SphinxDirective):
    """Generate ``auto<kind>`` directives for a facade's names, one rubric per defining module."""

    required_arguments = 1
    option_spec = {"link-from": directives.unchanged}

    def run(self) -> list[nodes.Node]:
        facade = self.arguments[0]
        module = importlib.import_module(facade)
        table: dict[str, str] = module._TABLE
        # Table modules equal to this option are other facades: link to them, do not re-document.
        link_from = self.options.get("link-from")
        groups: dict[str, list[str]] = {}
        for name, source in table.items():
            groups.setdefault(source, []).append(name)
        lines: list[str] = []
        for source, names in groups.items():
            absolute = importlib.util.resolve_name(source, facade)
            if link_from and absolute == link_from:
                refs = ", ".join(f":py:obj:`{name} <{absolute}.{name}>`" for name in names)
                lines += [f".. rubric:: Re-exported from ``{absolute}``", "", refs, ""]
                continue
            lines += [f".. rubric:: From ``{absolute}``", ""]
            for name in names:
                try:
                    obj = getattr(module, name)
                except Exception as exc:  # noqa: BLE001 - any import error of a topic module is reported
                    # A warning, so that `sphinx-build -W` fails and names the broken public name.
                    _log.warning(
                        "public name %s.%s cannot be imported: %s: %s",
                        facade,
                        name,
                        type(exc).__name__,
                        exc,
                        location=self.get_location(),
                    )
                    continue
                if inspect.ismodule(obj):
                    # A subpackage served by the facade has a page of its own: link to it.
                    lines += [f"Subpackage :py:mod:`{facade}.{name} <{obj.__name__}>`.", ""]
                    continue
                lines += [f".. auto{_kind(obj)}:: {facade}.{name}", ""]
        container = nodes.container()
        self.state.nested_parse(
            StringList(lines, source=self.get_source_info()[0]), self.content_offset, container
        )
        return container.children


def setup(app):  # noqa: ANN001 - Sphinx's extension entry point
    app.add_directive("public-api", PublicApi)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
