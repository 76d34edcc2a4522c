"""IPython in ``%%ranks`` cells, from a real ipykernel: magics, ``!``, ``await``, rich display(), no input()."""

from __future__ import annotations

import time

import pytest

from tests.launcher_helpers import printed_by, printed_lines
from tests.test_launcher_kernel import Kernel, interactive_kernel

pytestmark = pytest.mark.timeout(240)

ENSURE = """
%load_ext notebook_accel
import notebook_accel
from notebook_accel import interactive
if interactive.current() is None or not interactive.current().alive:
    if interactive.current() is not None:
        interactive.current().stop()
    notebook_accel.start_ranks(2)
"""


@pytest.fixture(scope="module")
def kernel():
    yield from interactive_kernel(ENSURE)


def _cell(kernel: Kernel, code: str, timeout: float = 90) -> tuple[str, list[dict], str | None]:
    """Return (stdout and stderr, every display bundle, the error's traceback or None) of one cell."""
    out: list[str] = []
    shown: list[dict] = []
    error = None
    for msg in kernel.cell(code, timeout):
        kind, content = msg["msg_type"], msg["content"]
        if kind == "stream":
            out.append(content["text"])
        elif kind in ("display_data", "execute_result"):
            shown.append({"data": content["data"], "metadata": content.get("metadata", {})})
        elif kind == "error":
            error = "\n".join(content["traceback"])
    return "".join(out), shown, error


def _ok(kernel: Kernel, code: str, timeout: float = 90) -> tuple[str, list[dict]]:
    out, shown, error = _cell(kernel, code, timeout)
    assert error is None, error
    return out, shown


def _ranks_printing(out: str, part: str) -> list[int]:
    """Return the ranks (sorted, one per copy) whose printed lines contain ``part``."""
    return sorted(r for ranks, text in printed_lines(out) if part in text for r in ranks)


def test_line_and_cell_magics_run_on_every_rank(kernel: Kernel) -> None:
    out, _ = _ok(kernel, "%%ranks\n%time x = 40 + rank\ny = x + 2")
    # each rank's own timing, shown once for both when the two happen to be equal
    assert _ranks_printing(out, "Wall time") == _ranks_printing(out, "CPU times") == [0, 1]
    out, shown = _ok(kernel, "%%ranks\n%timeit -n1 -r1 sum(range(10))\ny")
    assert _ranks_printing(out, "1 loop each") == [0, 1]
    assert "[rank 0] 42\n[rank 1] 43" in shown[-1]["data"]["text/plain"]
    out, _ = _ok(kernel, "%%ranks\n%%time\nz = rank * 2")
    assert _ranks_printing(out, "Wall time") == [0, 1]
    out, shown = _ok(kernel, "%%ranks\nimport os\n%cd /tmp\n%pwd")
    assert "[all 2 ranks] '/tmp'" in shown[-1]["data"]["text/plain"]
    out, shown = _ok(kernel, "%%ranks\n%env NA_RANK_VAR=set\nos.environ['NA_RANK_VAR']")
    assert "[all 2 ranks] 'set'" in shown[-1]["data"]["text/plain"]


def test_shell_commands_and_their_output(kernel: Kernel) -> None:
    out, shown = _ok(kernel, "%%ranks\n!echo from-the-shell-$((40 + 2))\nlisted = !echo hi-$PWD\nlisted")
    assert sorted(printed_by(out, "from-the-shell-42")) == [0, 1]
    assert "['hi-" in shown[-1]["data"]["text/plain"]


def test_top_level_await(kernel: Kernel) -> None:
    out, shown = _ok(
        kernel, "%%ranks\nimport asyncio\nawait asyncio.sleep(0)\nawait asyncio.sleep(0, result=rank)"
    )
    assert "[rank 0] 0\n[rank 1] 1" in shown[-1]["data"]["text/plain"]


def test_display_html_arrives_as_html_under_the_rank_label(kernel: Kernel) -> None:
    out, shown = _ok(
        kernel,
        "%%ranks\nfrom IPython.display import HTML, Markdown, display\n"
        "print('before', flush=True)\ndisplay(HTML(f'<b>html of rank {rank}</b>'))\n"
        "display(Markdown(f'*md {rank}*'))",
    )
    html = [s for s in shown if "text/html" in s["data"]]
    assert len(html) == 2, shown
    by_rank = {s["metadata"]["notebook-accel"]["rank"]: s["data"]["text/html"] for s in html}
    assert by_rank[0] == "<div><b>[rank 0]</b></div><b>html of rank 0</b>"
    assert by_rank[1] == "<div><b>[rank 1]</b></div><b>html of rank 1</b>"
    markdown = [s["data"]["text/markdown"] for s in shown if "text/markdown" in s["data"]]
    assert sorted(markdown) == ["**[rank 0]**\n\n*md 0*", "**[rank 1]**\n\n*md 1*"]


def test_a_matplotlib_figure_arrives_as_png(kernel: Kernel) -> None:
    out, shown = _ok(
        kernel,
        "%%ranks 1\nimport matplotlib.pyplot as plt\nfig, ax = plt.subplots()\nax.plot([0, rank])\n"
        "display(fig)\nplt.close(fig)",
    )
    images = [s for s in shown if "image/png" in s["data"]]
    assert len(images) == 1, (out, shown)
    assert images[0]["metadata"]["notebook-accel"] == {"rank": 1}
    assert images[0]["data"]["image/png"].startswith("iVBOR")  # base64 of the PNG signature
    assert images[0]["data"]["text/html"].startswith("<div><b>[rank 1]</b></div><img src=")
    # Drawn without display(): shown at the end of the cell, as in Jupyter (once, then closed).
    out, shown = _ok(kernel, "%%ranks\nimport matplotlib.pyplot as plt\nplt.plot([rank, 1 - rank]);")
    images = sorted(s["metadata"]["notebook-accel"]["rank"] for s in shown if "image/png" in s["data"])
    assert images == [0, 1], (out, shown)
    out, shown = _ok(kernel, "%%ranks\nx = 1")
    assert not [s for s in shown if "image/png" in s["data"]]


def test_input_on_a_rank_raises_at_once_naming_push(kernel: Kernel) -> None:
    started = time.monotonic()
    out, shown, error = _cell(kernel, "%%ranks 0\nname = input('your name? ')", timeout=60)
    assert time.monotonic() - started < 30
    assert error is not None and "NoInputOnRanksError" in error and "%ranks push" in error, error
    out, shown, error = _cell(kernel, "%%ranks 0\nimport getpass\ngetpass.getpass()", timeout=60)
    assert error is not None and "getpass() cannot read on a rank" in error
    out, shown = _ok(kernel, "%%ranks\nrank + 10")  # the ranks are fine
    assert "[rank 0] 10\n[rank 1] 11" in shown[-1]["data"]["text/plain"]


# -- without a kernel ---------------------------------------------------------------------------


def test_plain_python_is_left_alone_and_ipython_syntax_is_transformed() -> None:
    from notebook_accel.interactive.rank_shell import prepare_cell

    assert prepare_cell("x = 1\nx % 2") == ("x = 1\nx % 2", False)
    assert prepare_cell("await thing()") == ("await thing()", False)  # compiled with top-level await
    python, transformed = prepare_cell("%time x = 1\nfiles = !ls\n!echo hi")
    assert transformed and "get_ipython().run_line_magic('time', 'x = 1')" in python
    assert "get_ipython().getoutput('ls')" in python and "get_ipython().system('echo hi')" in python
    with pytest.raises(SyntaxError):
        prepare_cell("x = = 1")


def test_without_ipython_a_magic_says_it_needs_ipython(monkeypatch) -> None:
    import sys

    from notebook_accel.interactive.rank_shell import prepare_cell, rank_shell

    monkeypatch.setitem(sys.modules, "IPython.core.inputtransformer2", None)  # import fails
    monkeypatch.setitem(sys.modules, "IPython.core.interactiveshell", None)
    with pytest.raises(SyntaxError) as info:
        prepare_cell("%time x = 1")
    assert "magics (%time), shell commands (!ls) and other IPython syntax need IPython" in "".join(
        getattr(info.value, "__notes__", [])
    )
    with pytest.raises(ImportError, match=r"need IPython \(pip install ipython\).*\(on the ranks too\)"):
        rank_shell({})


def test_bad_value_limit_is_refused_before_any_rank_starts() -> None:
    import notebook_accel

    with pytest.raises(ValueError, match=r"value_limit='lots' is not a size; write it like '500KB'"):
        notebook_accel.start_ranks(2, value_limit="lots")
    with pytest.raises(ValueError, match=r"value_limit=-1 must be 0 or more bytes"):
        notebook_accel.start_ranks(2, value_limit=-1)
    assert notebook_accel.interactive.current() is None
