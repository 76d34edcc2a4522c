"""Live progress bars in a real ipykernel cell, without a panel: one updatable output, final lines printed."""

from __future__ import annotations

import textwrap

import pytest

from tests.launcher_helpers import StartedKernel, printed_by, printed_lines

pytest.importorskip("jupyter_client")
pytest.importorskip("ipykernel")

pytestmark = pytest.mark.timeout(180)

_CELL = """
from notebook_accel import notebook_launcher

def loop():
    import time
    from tqdm.auto import tqdm  # first imported in the worker: tqdm.notebook, as in a real notebook
    for i in tqdm(range(200), desc="cellbar", mininterval=0.01):
        time.sleep(0.005)
        if i == 100:
            print("half way", flush=True)
    return 1

print(notebook_launcher(loop, num_processes=2))
"""


def test_bars_live_in_the_cell_and_leave_one_line_each() -> None:
    kernel = StartedKernel()
    try:
        messages = list(kernel.cell(textwrap.dedent(_CELL), timeout=120))
    finally:
        kernel.close()
    errors = [m["content"] for m in messages if m["msg_type"] == "error"]
    assert not errors, errors
    shown = [m["content"] for m in messages if m["msg_type"] == "display_data"]
    updates = [m["content"] for m in messages if m["msg_type"] == "update_display_data"]
    # One output shows the main process's bar and is redrawn in place.
    assert len(shown) == 1, shown
    display_id = shown[0]["transient"]["display_id"]
    assert shown[0]["data"]["text/plain"].startswith("[rank 0] cellbar:")
    assert "<progress" in shown[0]["data"]["text/html"]
    assert updates and all(u["transient"]["display_id"] == display_id for u in updates)
    assert all("[rank 1]" not in u["data"]["text/plain"] for u in updates)  # main process only
    assert updates[-1]["data"]["text/plain"] == ""  # every bar closed: the live output is empty
    streams = {"stdout": "", "stderr": ""}
    for m in messages:
        if m["msg_type"] == "stream":
            streams[m["content"]["name"]] += m["content"]["text"]
    assert sorted(printed_by(streams["stdout"], "half way")) == [0, 1]
    assert "[1, 1]" in streams["stdout"]
    # Each rank's bar leaves one line, its final state; no redraws, no widget traffic from the workers.
    bars = [(ranks, text) for ranks, text in printed_lines(streams["stderr"]) if "cellbar" in text]
    assert sorted(r for ranks, _ in bars for r in ranks) == [0, 1], streams["stderr"]
    assert all("200/200" in text for _, text in bars), streams["stderr"]
    assert "comm_open" not in streams["stderr"]
