"""The notebooks in a real front end: JupyterLab on 127.0.0.1 driven by headless Chromium through Playwright.

Each notebook is opened, every cell is run from JupyterLab's Run menu, and the panels are checked as a
person would see them: the launch panel has one tab per rank showing that rank's lines, the device-map
explorer shows its bars, the memory estimator its table. Screenshots go to artifacts/screenshots/.

Uses Debian's ``chromium`` (/usr/bin/chromium, or $NOTEBOOK_ACCEL_CHROMIUM) with Playwright's Python
driver; no browser is downloaded. Skips, saying why, where Chromium, Playwright or JupyterLab is missing.
"""

from __future__ import annotations

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
# Seconds allowed for a whole notebook to run in the browser (each runs in well under 30 s headless).
RUN_TIMEOUT = 180

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

from playwright.sync_api import Page, sync_playwright  # noqa: E402

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


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Start JupyterLab on 127.0.0.1 on a copy of notebooks/ (autosave must not touch the repository)."""
    base = tmp_path_factory.mktemp("lab")
    work = base / "notebooks"
    shutil.copytree(NOTEBOOKS, work, ignore=shutil.ignore_patterns(".ipynb_checkpoints"))
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


def _run_all(page: Page, name: str, during: Callable[[Page], None] | None = None) -> None:
    """Run every cell through the Run menu and wait until the kernel is done; fail on a cell error.

    ``during(page)`` is called between polls while cells run (to look at live panels).
    """
    page.locator(".jp-Notebook .jp-CodeCell").first.wait_for(timeout=60_000)
    # The kernel must be up before "Run All" (otherwise the command is queued behind its start).
    page.locator(".jp-Notebook-ExecutionIndicator[data-status='idle']").first.wait_for(timeout=90_000)

    def run_all() -> float:
        page.locator(".jp-Notebook").first.click()
        page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(r"^Run$")).click()
        page.locator(".lm-Menu-itemLabel", has_text=re.compile(r"^Run All Cells$")).click()
        return time.monotonic()

    asked = run_all()
    deadline = time.monotonic() + RUN_TIMEOUT
    started = False
    while time.monotonic() < deadline:
        prompts = [p.strip() for p in _prompts(page)]
        busy = any("*" in p for p in prompts)
        started = started or busy or all(re.search(r"\[\d+\]", p) for p in prompts)
        if started and not busy:
            break
        if not started and time.monotonic() - asked > 20:
            # On a loaded machine the command was sometimes lost: 180 s later every prompt still
            # read "[ ]" and the kernel was idle. Queued cells would show "[*]" at once, so asking
            # again cannot run the notebook twice.
            asked = run_all()
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


def _open_and_run(browser, lab: str, name: str, during=None) -> Page:  # noqa: ANN001 - playwright Browser
    # 1280 px: a common laptop width, where the panels must fit without horizontal overflow.
    page = browser.new_page(viewport={"width": 1280, "height": 1000})
    page.set_default_timeout(30_000)
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


_STATUS_ROWS_JS = (
    "t => [...t.querySelectorAll('tbody tr')].map(r => [...r.cells].map(c => c.innerText.trim()))"
)


def _watch_dashboard(seen: dict) -> Callable[[Page], None]:
    """Return a ``during`` callback noting, while the dashboard launch runs, a bar, a chart and usage numbers."""

    def look(page: Page) -> None:
        if seen.get("all"):
            return
        panel = page.locator(".jp-OutputArea-output", has=page.locator(".widget-hprogress")).last
        try:
            if panel.count() == 0:
                return
            rows = panel.locator("table").first.evaluate(_STATUS_ROWS_JS, timeout=2000)
            running = [r for r in rows if len(r) > 6 and r[2] == "running"]
            if not running:
                return
            # CPU % is a number and memory a size in every running rank's row.
            if all(
                re.fullmatch(r"\d+", r[4]) and re.fullmatch(r"[\d.]+ (KiB|MiB|GiB)", r[5]) for r in running
            ):
                seen["usage"] = running
            label = panel.locator(".widget-hprogress").first.locator("xpath=..").inner_text(timeout=2000)
            if re.search(r"\[rank 0\] epoch \d+: +\d+%", label):
                seen["bar"] = label
            chart = panel.locator(".widget-image").first
            if chart.count() and chart.evaluate("img => img.naturalWidth", timeout=2000) > 20:
                seen["chart"] = True
        except Exception as exc:  # the output re-rendered between two calls: look again next poll
            seen.setdefault("errors", []).append(repr(exc)[:200])
            return
        if {"usage", "bar", "chart"} <= set(seen):
            seen["all"] = True
            SCREENSHOTS.mkdir(parents=True, exist_ok=True)
            panel.screenshot(path=str(SCREENSHOTS / "quickstart-dashboard-running.png"))

    return look


def test_quickstart_launch_panel_has_one_tab_per_rank(browser, lab: str) -> None:  # noqa: ANN001
    name = "quickstart.ipynb"
    seen: dict = {}
    page = _open_and_run(browser, lab, name, during=_watch_dashboard(seen))
    panel = None
    try:
        _no_widget_errors(page, name)
        tab_widget = page.locator(".jupyter-widget-tab, .widget-tab").first
        tab_widget.wait_for(state="visible")
        panel = _panel_of(tab_widget)
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
            content.wait_for(state="visible")
            text = content.inner_text()
            assert re.search(r"epoch 0: 4 batches", text), (
                f"tab rank {rank} lacks its training lines: {text[:500]!r}"
            )
            # A rank's tab shows its own lines only: rank 1 never prints the main-process summary.
            if rank == 1:
                assert "averaged over ranks" not in text, f"rank 1's tab shows rank 0's lines: {text[:500]!r}"
        states = panel.locator("table").first.inner_text()
        assert states.count("succeeded") >= 2, (
            f"the status table does not show both ranks succeeded: {states!r}"
        )
        # The training dashboard, seen while it ran: a live bar, a metric chart, CPU % and memory numbers.
        assert seen.get("all"), f"the running dashboard did not show a bar, a chart and usage numbers: {seen}"
    finally:
        _screenshot(page, name, panel)
        page.close()


def test_big_model_inference_device_map_bars_visible(browser, lab: str) -> None:  # noqa: ANN001
    name = "big_model_inference.ipynb"
    page = _open_and_run(browser, lab, name)
    panel = None
    try:
        _no_widget_errors(page, name)
        # The device-map explorer: its sliders, then one stacked bar per device drawn as a PNG.
        explorer = _panel_of(page.locator(".widget-slider", has_text="cpu").first)
        panel = explorer
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
    finally:
        _screenshot(page, name, panel)
        page.close()


def test_memory_estimation_table_visible(browser, lab: str) -> None:  # noqa: ANN001
    name = "memory_estimation.ipynb"
    page = _open_and_run(browser, lab, name)
    panel = None
    try:
        _no_widget_errors(page, name)
        table = page.locator(".jp-OutputArea-output .widget-html table", has_text="float16").first
        table.wait_for(state="visible")
        panel = _panel_of(table)
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
    finally:
        _screenshot(page, name, panel)
        page.close()


def test_handling_failures_runs_in_the_browser(browser, lab: str) -> None:  # noqa: ANN001
    name = "handling_failures.ipynb"
    page = _open_and_run(browser, lab, name)
    try:
        text = "\n".join(page.locator(".jp-OutputArea-output").all_inner_texts())
        assert "root cause: rank 1 ValueError" in text, "the failing rank's error is not shown"
        assert "interrupted" in text and "['rank 0 done', 'rank 1 done']" in text
    finally:
        _screenshot(page, name)
        page.close()
