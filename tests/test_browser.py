"""The notebooks in a real front end: JupyterLab on 127.0.0.1 driven by headless Chromium through Playwright.

Each notebook is opened, every cell is run from JupyterLab's Run menu, and the panels are checked as a
person would see them: the launch panel has one tab per rank showing that rank's lines, the device-map
explorer shows its bars, the memory estimator its table. Screenshots go to artifacts/screenshots/.

Uses Debian's ``chromium`` (/usr/bin/chromium, or $NOTEBOOK_ACCEL_CHROMIUM) with Playwright's Python
driver; no browser is downloaded. Skips, saying why, where Chromium, Playwright or JupyterLab is missing.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
SCREENSHOTS = ROOT / "artifacts" / "screenshots"
CHROMIUM = os.environ.get("NOTEBOOK_ACCEL_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
# Seconds allowed for a whole notebook to run in the browser (each runs in well under 30 s headless, and
# in under 150 s while other work loads both cores of a 2-core machine). Only a failure waits this long.
RUN_TIMEOUT = 300

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _missing_requirement() -> str | None:
    if not (Path(CHROMIUM).is_file() and os.access(CHROMIUM, os.X_OK)):
        return f"Chromium not found at {CHROMIUM} (apt-get install chromium, or set NOTEBOOK_ACCEL_CHROMIUM)"
    for module, extra in (("playwright", "browser"), ("jupyterlab", "browser"), ("ipywidgets", "panels")):
        try:
            __import__(module)
        except ImportError:
            return f"{module} is not installed (pip install -e '.[{extra}]')"
    return None


_SKIP = _missing_requirement()
if _SKIP:
    pytest.skip(_SKIP, allow_module_level=True)

from playwright.sync_api import Page, expect, sync_playwright  # noqa: E402

from tests._dist import free_port  # noqa: E402


def _wait_for_server(url: str, proc: subprocess.Popen, log: Path, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(
                f"JupyterLab exited with {proc.returncode}:\n{log.read_text(errors='replace')[-4000:]}"
            )
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.3)
    pytest.fail(
        f"JupyterLab did not answer at {url} within {timeout} s:\n{log.read_text(errors='replace')[-4000:]}"
    )


# A notebook of interactive ranks with a launch panel, written next to the copies of notebooks/. Its
# fourth cell runs on both ranks until the test has looked at the panel and created release.flag
# (or for at most 120 s): the panel is seen while the cell runs, however slow the machine.
_INTERACTIVE_CELLS = [
    "%load_ext notebook_accel",
    "%ranks start 2 --panel",
    "%%ranks\nimport torch, torch.distributed as dist\nt = torch.ones(2) * (rank + 1)\ndist.all_reduce(t)\nt",
    "%%ranks\nfor step in range(240):  # until the browser test saw the panel\n"
    "    print(f'step {step} of rank {rank}', flush=True)\n"
    "    if os.path.exists('release.flag'):\n        break\n    time.sleep(0.5)",
    "%ranks stop",
]
INTERACTIVE = "interactive_panel_browser.ipynb"


def _write_interactive_notebook(path: Path) -> None:
    cells = [
        {
            "cell_type": "code",
            "execution_count": None,
            "id": f"c{i}",
            "metadata": {},
            "outputs": [],
            "source": src,
        }
        for i, src in enumerate(["import os, time", *_INTERACTIVE_CELLS])
    ]
    kernelspec = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}
    notebook = {"cells": cells, "metadata": {"kernelspec": kernelspec}, "nbformat": 4, "nbformat_minor": 5}
    path.write_text(json.dumps(notebook, indent=1))


@pytest.fixture(scope="module")
def lab_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Return the folder JupyterLab serves: a copy of notebooks/ and the interactive-ranks notebook."""
    work = tmp_path_factory.mktemp("lab") / "notebooks"
    shutil.copytree(NOTEBOOKS, work, ignore=shutil.ignore_patterns(".ipynb_checkpoints"))
    _write_interactive_notebook(work / INTERACTIVE)
    return work


@pytest.fixture(scope="module")
def lab(lab_dir: Path) -> Iterator[str]:
    """Start JupyterLab on 127.0.0.1 on a copy of notebooks/ (autosave must not touch the repository)."""
    work = lab_dir
    base = work.parent
    settings = base / "settings" / "@jupyterlab" / "notebook-extension"
    settings.mkdir(parents=True)
    # Render every cell (no windowing), so that outputs of cells below the fold are in the DOM.
    (settings / "tracker.jupyterlab-settings").write_text(json.dumps({"windowingMode": "none"}))
    # No "get notified about Jupyter news?" toast over the screenshots (and no request for the news).
    apputils = base / "settings" / "@jupyterlab" / "apputils-extension"
    apputils.mkdir(parents=True)
    (apputils / "notification.jupyterlab-settings").write_text(json.dumps({"fetchNews": "false"}))
    port, token = free_port(), secrets.token_hex(16)
    env = {k: v for k, v in os.environ.items() if not k.startswith("JUPYTER")}
    env.update(
        JUPYTER_CONFIG_DIR=str(base / "config"),
        JUPYTER_DATA_DIR=str(base / "data"),
        JUPYTER_RUNTIME_DIR=str(base / "runtime"),
        JUPYTERLAB_SETTINGS_DIR=str(base / "settings"),
        JUPYTERLAB_WORKSPACES_DIR=str(base / "workspaces"),
    )
    log = base / "jupyterlab.log"
    cmd = [
        sys.executable,
        "-m",
        "jupyterlab",
        "--no-browser",
        "--ServerApp.ip=127.0.0.1",
        f"--ServerApp.port={port}",
        "--ServerApp.port_retries=0",
        f"--IdentityProvider.token={token}",
        f"--ServerApp.root_dir={work}",
        "--ServerApp.open_browser=False",
        "--ServerApp.terminals_enabled=False",
        # CI containers run as root; JupyterLab refuses that without this flag.
        "--allow-root",
        # Nothing may reach the network: no news feed, no extension catalogue.
        "--LabApp.news_url=",
        "--LabApp.extension_manager=readonly",
    ]
    with open(log, "wb") as log_file:
        proc = subprocess.Popen(cmd, cwd=work, env=env, stdout=log_file, stderr=subprocess.STDOUT)
    try:
        _wait_for_server(f"http://127.0.0.1:{port}/api/status?token={token}", proc, log)
        yield f"http://127.0.0.1:{port}/lab/tree/{{name}}?token={token}&reset"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


@pytest.fixture(scope="module")
def browser() -> Iterator:
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            yield chromium
        finally:
            chromium.close()


def _prompts(page: Page) -> list[str]:
    return page.locator(".jp-Notebook .jp-CodeCell .jp-InputPrompt").all_inner_texts()


def _menu(page: Page, menu: str, item: str) -> None:
    # Focus the notebook through its first cell's prompt: a click on the notebook's middle lands, in
    # a short notebook, on the space below the last cell, which adds an empty cell.
    page.locator(".jp-Notebook .jp-Cell .jp-InputPrompt").first.click()
    page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(f"^{menu}$")).click()
    page.locator(".lm-Menu-itemLabel", has_text=re.compile(f"^{re.escape(item)}$")).click()


def _wait_for_kernel(page: Page, timeout: float = 120) -> None:
    """Wait until the notebook's kernel is connected and idle, choosing the preferred kernel if asked.

    The execution indicator reads "idle" before any kernel is connected (its initial state), so the
    status bar's kernel item counts: "Python 3 (ipykernel) | Idle", after "No Kernel | Initializing"
    and "| Connecting". On a loaded machine JupyterLab sometimes asks which kernel to start (its
    kernel list was not loaded in time): the dialog offers the notebook's own kernel, and this
    accepts it, as a person would.
    """
    kernel = page.locator("#jp-main-statusbar .jp-StatusBar-TextItem[title^='Change kernel for']")
    choose = page.locator(".jp-Dialog", has_text="Select Kernel").locator("button.jp-mod-accept")
    deadline = time.monotonic() + timeout
    text = ""
    while time.monotonic() < deadline:
        if choose.count():
            choose.first.click()
        text = " ".join(kernel.all_inner_texts()).strip()
        if text.endswith("| Idle") and not text.startswith("No Kernel"):
            return
        time.sleep(0.3)
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / "no-kernel.png"))
    pytest.fail(
        f"the notebook's kernel was not connected and idle within {timeout} s: {text!r} (no-kernel.png)"
    )


def _run_all(page: Page, name: str, during: Callable[[Page], None] | None = None) -> None:
    """Clear the stored outputs, run every cell through the Run menu and wait until each ran; fail on a cell error.

    ``during(page)`` is called between polls while cells run (to look at live panels).
    """
    page.locator(".jp-Notebook .jp-CodeCell").first.wait_for(timeout=60_000)
    _wait_for_kernel(page)
    # The notebooks are stored with outputs and execution counts: every prompt reads "[n]" before
    # anything ran. Cleared, a number in a prompt can only come from this run.
    _menu(page, "Edit", "Clear Outputs of All Cells")
    deadline = time.monotonic() + 60
    while any(re.search(r"\d", p) for p in _prompts(page)):
        if time.monotonic() > deadline:
            pytest.fail(
                f"{name}: the prompts kept their numbers after clearing the outputs: {_prompts(page)}"
            )
        time.sleep(0.2)
    _menu(page, "Run", "Run All Cells")
    asked = time.monotonic()
    deadline = asked + RUN_TIMEOUT
    started = False
    while time.monotonic() < deadline:
        prompts = [p.strip() for p in _prompts(page)]
        busy = any("*" in p for p in prompts)
        started = started or busy or any(re.search(r"\[\d+\]", p) for p in prompts)
        if started and not busy:
            break
        if not started and time.monotonic() - asked > 20:
            # On a loaded machine the command was sometimes lost: 180 s later every prompt still
            # read "[ ]" and the kernel was idle. Queued cells would show "[*]" at once, so asking
            # again cannot run the notebook twice.
            _wait_for_kernel(page)
            _menu(page, "Run", "Run All Cells")
            asked = time.monotonic()
        if during is not None:
            during(page)
        time.sleep(0.5)
    else:
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(SCREENSHOTS / f"{Path(name).stem}-timed-out.png"))
        pytest.fail(f"{name}: cells still running after {RUN_TIMEOUT} s: {_prompts(page)}")
    not_run = [i for i, p in enumerate(_prompts(page)) if not re.search(r"\[\d+\]", p)]
    if not_run:
        errors = page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']")
        text = "\n".join(errors.all_inner_texts())[-4000:]
        pytest.fail(f"{name}: code cells {not_run} did not run (an earlier cell failed):\n{text}")


def _open_and_run(browser, lab: str, name: str, during=None, init_script: str = "") -> Page:  # noqa: ANN001
    # 1280 px: a common laptop width, where the panels must fit without horizontal overflow.
    page = browser.new_page(viewport={"width": 1280, "height": 1000})
    page.set_default_timeout(30_000)
    if init_script:
        page.add_init_script(init_script)
    page.goto(lab.format(name=name), wait_until="domcontentloaded")
    _run_all(page, name, during)
    return page


def _screenshot(page: Page, name: str, panel=None) -> Path:  # noqa: ANN001 - playwright Locator
    """Save the window (and the panel alone, when given) under artifacts/screenshots/."""
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    path = SCREENSHOTS / f"{Path(name).stem}.png"
    if panel is not None:
        panel.scroll_into_view_if_needed()
        panel.screenshot(path=str(SCREENSHOTS / f"{Path(name).stem}-panel.png"))
    page.screenshot(path=str(path))
    return path


def _panel_of(locator):  # noqa: ANN001, ANN202 - playwright Locator
    """Return the output area holding ``locator`` (the whole panel)."""
    return locator.locator("xpath=ancestor::div[contains(@class, 'jp-OutputArea-output')][1]")


def _no_widget_errors(page: Page, name: str) -> None:
    # JupyterLab shows this text in place of a widget whose model or view failed to load.
    broken = page.get_by_text(re.compile(r"Error displaying widget|Failed to load model class"))
    assert broken.count() == 0, f"{name}: a widget failed to render: {broken.all_inner_texts()}"


class _Opened:
    """A notebook run in the browser: its ``page``, and the ``panel`` a test found (screenshot alone too)."""

    def __init__(self, page: Page) -> None:
        self.page = page
        self.panel = None


@contextlib.contextmanager
def _opened(browser, lab: str, name: str, **run: Any) -> Iterator[_Opened]:  # noqa: ANN001
    """Run notebook ``name`` in a new page and check no widget failed; after the test, screenshot and close it."""
    opened = _Opened(_open_and_run(browser, lab, name, **run))
    try:
        _no_widget_errors(opened.page, name)
        yield opened
    finally:
        _screenshot(opened.page, name, opened.panel)
        opened.page.close()


# Installed in the page before JupyterLab loads: on every change of the page, it looks at the last
# output holding a progress bar (the dashboard's launch panel) and notes, while a rank's row reads
# "running", CPU % and memory numbers in every running row, rank 0's bar label and a chart image.
# The browser sees every state the kernel sent, however late: nothing depends on the test's polls
# falling inside the few seconds the dashboard's launch runs, on a machine whatever its load.
_DASHBOARD_WATCH_JS = """
window.__dashboard = {usage: null, bar: null, chart: null};
const lookAtDashboard = () => {
  const seen = window.__dashboard;
  const panels = [...document.querySelectorAll('.jp-OutputArea-output')]
    .filter(o => o.querySelector('.widget-hprogress'));
  const panel = panels[panels.length - 1];
  const table = panel && panel.querySelector('table');
  if (!table) return;
  const rows = [...table.querySelectorAll('tbody tr')]
    .map(r => [...r.cells].map(c => c.textContent.trim()));
  const running = rows.filter(r => r.length > 6 && r[2] === 'running');
  if (!running.length) return;
  if (running.every(r => /^\\d+$/.test(r[4]) && /^[\\d.]+ (KiB|MiB|GiB)$/.test(r[5]))) seen.usage = running;
  for (const bar of panel.querySelectorAll('.widget-hprogress')) {
    const label = bar.parentElement.textContent;
    if (/\\[rank 0\\] epoch \\d+: +\\d+%/.test(label)) seen.bar = label;
  }
  const chart = panel.querySelector('img.widget-image');
  if (chart && chart.getAttribute('src') && chart.style.display !== 'none') seen.chart = chart.getAttribute('src');
};
document.addEventListener('DOMContentLoaded', () => {
  new MutationObserver(lookAtDashboard).observe(document.body, {
    subtree: true, childList: true, characterData: true, attributes: true, attributeFilter: ['src', 'style'],
  });
});
"""


def _dashboard_seen(page: Page) -> dict:
    return page.evaluate("() => window.__dashboard")


_STATUS_ROWS_JS = (
    "t => [...t.querySelectorAll('tbody tr')].map(r => [...r.cells].map(c => c.innerText.trim()))"
)


def _watch_dashboard(shot: dict) -> Callable[[Page], None]:
    """Return a ``during`` callback saving quickstart-dashboard-running.png once the page saw the dashboard run."""

    def look(page: Page) -> None:
        if shot.get("taken"):
            return
        seen = _dashboard_seen(page)
        if seen["usage"] and seen["bar"] and seen["chart"]:
            panel = page.locator(".jp-OutputArea-output", has=page.locator(".widget-hprogress")).last
            SCREENSHOTS.mkdir(parents=True, exist_ok=True)
            panel.screenshot(path=str(SCREENSHOTS / "quickstart-dashboard-running.png"))
            shot["taken"] = True

    return look


def test_quickstart_launch_panel_has_one_tab_per_rank(browser, lab: str) -> None:  # noqa: ANN001
    name = "quickstart.ipynb"
    shot: dict = {}
    with _opened(
        browser, lab, name, during=_watch_dashboard(shot), init_script=_DASHBOARD_WATCH_JS
    ) as opened:
        page = opened.page
        tab_widget = page.locator(".jupyter-widget-tab, .widget-tab").first
        tab_widget.wait_for(state="visible")
        panel = opened.panel = _panel_of(tab_widget)
        tabs = tab_widget.locator(".lm-TabBar-tab")
        titles = [t.strip() for t in tabs.all_inner_texts()]
        rank_tabs = {
            int(m.group(1)): i for i, t in enumerate(titles) if (m := re.fullmatch(r"rank (\d+)", t))
        }
        assert sorted(rank_tabs) == [0, 1], f"expected one tab per rank (rank 0, rank 1), got tabs {titles}"
        for rank, index in sorted(rank_tabs.items()):
            tabs.nth(index).click()
            # Only the selected tab's page is visible; it holds that rank's lines.
            content = tab_widget.locator(".widget-tab-contents > :not(.lm-mod-hidden)").first
            expect(content).to_contain_text(re.compile(r"epoch 0: 4 batches"))
            # A rank's tab shows its own lines only: rank 1 never prints the main-process summary.
            if rank == 1:
                expect(content).not_to_contain_text("averaged over ranks")
        # Both ranks' rows read "succeeded" (the panel's last update may still be on its way).
        expect(panel.locator("table").first.locator("tbody tr", has_text="succeeded")).to_have_count(2)
        # The training dashboard, seen while it ran: a live bar, a metric chart, CPU % and memory numbers.
        seen = _dashboard_seen(page)
        assert seen["usage"] and seen["bar"] and seen["chart"], (
            f"the running dashboard did not show a bar, a chart and usage numbers: {seen}"
        )
        # The chart's last image is a drawn PNG, not an empty or broken one.
        chart = page.locator(".jp-OutputArea-output", has=page.locator(".widget-hprogress")).last
        chart = chart.locator("img.widget-image").first
        expect(chart).to_be_visible()
        page.wait_for_function("img => img.complete && img.naturalWidth > 20", arg=chart.element_handle())


def test_big_model_inference_device_map_bars_visible(browser, lab: str) -> None:  # noqa: ANN001
    name = "big_model_inference.ipynb"
    with _opened(browser, lab, name) as opened:
        page = opened.page
        # The device-map explorer: its sliders, then one stacked bar per device drawn as a PNG.
        explorer = _panel_of(page.locator(".widget-slider", has_text="cpu").first)
        opened.panel = explorer
        bars = explorer.locator(".widget-image").first
        bars.wait_for(state="visible")
        bars.scroll_into_view_if_needed()
        size = bars.evaluate(
            "img => [img.naturalWidth, img.naturalHeight, img.clientWidth, img.clientHeight]"
        )
        assert min(size) > 20, f"the device-map bars are not drawn: image sizes {size}"
        usage = explorer.locator(".widget-html table").first
        usage.wait_for(state="visible")
        text = explorer.inner_text()
        assert "disk" in text and "cpu" in text, (
            f"the explorer does not show the cpu and disk devices: {text[:800]!r}"
        )
        # The offload monitor, further down, rendered too.
        assert page.get_by_text("OffloadMonitor").count() >= 1


def test_memory_estimation_table_visible(browser, lab: str) -> None:  # noqa: ANN001
    name = "memory_estimation.ipynb"
    with _opened(browser, lab, name) as opened:
        page = opened.page
        table = page.locator(".jp-OutputArea-output .widget-html table", has_text="float16").first
        table.wait_for(state="visible")
        panel = opened.panel = _panel_of(table)
        text = table.inner_text()
        assert "float32" in text and "int8" in text, f"the memory table lacks dtypes: {text[:500]!r}"
        assert re.search(r"\d+(\.\d+)? GiB", text), f"the memory table shows no sizes: {text[:500]!r}"
        # Two verdicts per row: loading/inference, and beside it the training step's.
        assert "loading / inference" in text and "training step" in text, f"verdict columns: {text[:500]!r}"
        # The training table (items per dtype) lies inside the panel: nothing runs off its right edge.
        items = panel.locator(".widget-html table", has_text="training item").first
        items.wait_for(state="visible")
        box, outer = items.bounding_box(), panel.bounding_box()
        assert box["x"] + box["width"] <= outer["x"] + outer["width"] + 1, (
            f"the training table overflows the panel at 1280 px: table {box}, panel {outer}"
        )
        overflow = panel.evaluate("el => el.scrollWidth - el.clientWidth")
        assert overflow <= 1, f"the memory estimator overflows its output area by {overflow} px"


def test_handling_failures_runs_in_the_browser(browser, lab: str) -> None:  # noqa: ANN001
    name = "handling_failures.ipynb"
    with _opened(browser, lab, name) as opened:
        page = opened.page
        text = "\n".join(page.locator(".jp-OutputArea-output").all_inner_texts())
        assert "root cause: rank 1 ValueError" in text, "the failing rank's error is not shown"
        assert "interrupted" in text and "['rank 0 done', 'rank 1 done']" in text


def test_interactive_ranks_panel_while_a_cell_runs(browser, lab: str, lab_dir: Path) -> None:  # noqa: ANN001
    """``%ranks start 2 --panel``, then a ``%%ranks`` cell: the panel shows both ranks running that cell."""
    flag = lab_dir / "release.flag"
    flag.unlink(missing_ok=True)
    seen: dict = {}

    def look(page: Page) -> None:
        if seen.get("rows"):
            return
        panel = _panel_of(page.locator(".jupyter-widget-tab, .widget-tab").first)
        try:
            if panel.count() == 0:
                return
            rows = panel.locator("table").first.evaluate(_STATUS_ROWS_JS, timeout=2000)
            running = [r for r in rows if r[2] == "running" and r[3].startswith("for step in range(240)")]
            text = panel.locator(".widget-tab-contents").first.inner_text(timeout=2000)
        except Exception as exc:  # the output re-rendered between two calls: look again next poll
            seen.setdefault("errors", []).append(repr(exc)[:200])
            return
        if len(running) == 2 and "step 1 of rank 1" in text:
            SCREENSHOTS.mkdir(parents=True, exist_ok=True)
            panel.scroll_into_view_if_needed()
            panel.screenshot(path=str(SCREENSHOTS / "interactive-ranks-running-panel.png"))
            page.screenshot(path=str(SCREENSHOTS / "interactive-ranks-running.png"))
            seen["rows"] = rows
            flag.write_text("seen\n")  # the cell on the ranks ends at its next step

    try:
        with _opened(browser, lab, INTERACTIVE, during=look) as opened:
            page = opened.page
            assert seen.get("rows"), f"the panel never showed both ranks running the cell: {seen}"
            tab_widget = page.locator(".jupyter-widget-tab, .widget-tab").first
            panel = opened.panel = _panel_of(tab_widget)
            # The all-reduce cell's value, equal on both ranks, is shown once.
            outputs = "\n".join(page.locator(".jp-OutputArea-output").all_inner_texts())
            assert "tensor([3., 3.])" in outputs, outputs[-2000:]
            # After %ranks stop: the panel says stopped, each rank's row too, and its buttons are greyed out.
            expect(panel.locator(".widget-button", has_text=re.compile(r"^\s*stopped\s*$"))).to_have_count(1)
            expect(panel.locator("table").first.locator("tbody tr", has_text="stopped")).to_have_count(2)
            expect(panel.locator(".widget-button", has_text="Stacks")).to_be_disabled()
            titles = [t.strip() for t in tab_widget.locator(".lm-TabBar-tab").all_inner_texts()]
            assert titles == ["all ranks", "rank 0", "rank 1"], titles
    finally:
        flag.unlink(missing_ok=True)
