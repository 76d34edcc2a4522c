"""Background cells (``%%ranks --bg``) in a real ipykernel: the notebook stays free, output lands in its cell.

Every iopub message is kept by the msg_id of the cell it belongs to (its parent header), so a test
can tell in which cell's output area Jupyter would show a line: a background job's lines must land
in the cell that started it, even while other cells run. Jobs that must be seen running wait for a
file the test creates, so nothing depends on how fast the shared machine is.
"""

from __future__ import annotations

import collections
import queue
import time

import pytest

from tests.launcher_helpers import StartedKernel, printed_by, printed_lines

pytestmark = pytest.mark.timeout(240)


class Recorder:
    """A kernel whose iopub messages are all kept, by the msg_id of their cell (``parent_header``)."""

    def __init__(self) -> None:
        self.kernel = StartedKernel()
        self.kc = self.kernel.kc
        self.by_parent: dict[str, list[dict]] = collections.defaultdict(list)

    def _pump(self, timeout: float) -> dict | None:
        try:
            msg = self.kc.get_iopub_msg(timeout=timeout)
        except queue.Empty:
            return None
        self.by_parent[msg["parent_header"].get("msg_id")].append(msg)
        return msg

    def run(self, code: str, timeout: float = 120, interrupt_after: float | None = None) -> str:
        """Return the msg_id of ``code`` run as one cell, once the kernel went idle after it."""
        msg_id = self.kc.execute(code)
        deadline = time.monotonic() + timeout
        busy_at = None
        while time.monotonic() < deadline:
            msg = self._pump(0.1)
            if (
                interrupt_after is not None
                and busy_at is not None
                and time.monotonic() - busy_at > interrupt_after
            ):
                self.kernel.km.interrupt_kernel()
                interrupt_after = None
            if msg is None or msg["parent_header"].get("msg_id") != msg_id or msg["msg_type"] != "status":
                continue
            if msg["content"]["execution_state"] == "busy":
                busy_at = time.monotonic()
            elif msg["content"]["execution_state"] == "idle":
                break
        else:
            raise AssertionError(f"the cell did not end within {timeout} s: {code!r}")
        reply = self.kc.get_shell_msg(timeout=timeout)
        while reply["parent_header"].get("msg_id") != msg_id:
            reply = self.kc.get_shell_msg(timeout=timeout)
        return msg_id

    def pump_until(self, cond, timeout: float = 120) -> None:  # noqa: ANN001
        deadline = time.monotonic() + timeout
        while not cond():
            if time.monotonic() > deadline:
                raise AssertionError(f"condition not met in time; messages: {dict(self.by_parent)}")
            self._pump(0.1)

    def stream(self, msg_id: str) -> str:
        return "".join(m["content"]["text"] for m in self.by_parent[msg_id] if m["msg_type"] == "stream")

    def shown(self, msg_id: str) -> list[str]:
        kinds = ("execute_result", "display_data")
        return [
            m["content"]["data"].get("text/plain", "")
            for m in self.by_parent[msg_id]
            if m["msg_type"] in kinds
        ]

    def error(self, msg_id: str) -> tuple[str, str] | None:
        errors = [m["content"] for m in self.by_parent[msg_id] if m["msg_type"] == "error"]
        return (errors[0]["ename"], "\n".join(errors[0]["traceback"])) if errors else None

    def ok(self, code: str, **kw) -> str:  # noqa: ANN003
        msg_id = self.run(code, **kw)
        assert self.error(msg_id) is None, self.error(msg_id)
        return msg_id


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):  # noqa: ANN001
    folder = tmp_path_factory.mktemp("flags")
    k = Recorder()
    try:
        k.ok(f"import os, time\nflags = {str(folder)!r}\n%load_ext notebook_accel\n%ranks start 2")
        yield k
        k.run("%ranks stop")
    finally:
        k.kernel.close()


def test_a_bg_cell_returns_at_once_and_its_output_lands_in_its_own_cell(kernel: Recorder) -> None:
    bg = kernel.ok(
        "%%ranks --bg\nprint('job started', flush=True)\n"
        "while not os.path.exists(os.path.join(flags, 'one')): time.sleep(0.02)\n"
        "print('job finished', flush=True)\nrank * 10"
    )
    # The cell ended while its job waits for a file no one has written yet: it did not block.
    (out,) = kernel.shown(bg)
    assert out.startswith("<Job ") and " running " in out and "(every rank)>" in out, out
    kernel.pump_until(lambda: sorted(printed_by(kernel.stream(bg), "job started")) == [0, 1])

    # A kernel cell runs meanwhile, and prints into its own cell only.
    plain = kernel.ok("print('kernel cell', 6 * 7)\nprint('job running:', not _.done())")
    assert kernel.stream(plain) == "kernel cell 42\njob running: True\n"

    # A foreground %%ranks cell is refused with a message naming the job (not queued).
    refused = kernel.run("%%ranks\nrank")
    ename, text = kernel.error(refused)
    assert ename == "JobRunningError", text
    assert (
        "job " in text
        and "is running on the ranks in the background" in text
        and "refused, not queued" in text
    )
    assert "Traceback" not in text  # a message, not the magic's frames

    table = kernel.ok("%ranks jobs")
    assert " running " in kernel.shown(table)[0]

    kernel.ok("open(os.path.join(flags, 'one'), 'w').close()")
    waited = kernel.ok("%ranks wait")
    assert kernel.shown(waited) == ["[rank 0] 0\n[rank 1] 10"]
    kernel.pump_until(lambda: "] done in " in kernel.stream(bg))
    # Every line of the job, its end line included, is in the job's cell and nowhere else.
    assert sorted(printed_by(kernel.stream(bg), "job finished")) == [0, 1]
    others = [kernel.stream(m) for m in (plain, refused, table, waited)]
    assert not any("job finished" in text or "job started" in text for text in others), others

    after = kernel.ok("%%ranks\nrank + 1")
    assert kernel.shown(after) == ["[rank 0] 1\n[rank 1] 2"]


def test_wait_raises_the_error_of_a_failed_job(kernel: Recorder) -> None:
    bg = kernel.ok("%%ranks --bg\nkept = rank + 3\n1 / (rank - 1)")
    waited = kernel.run("%ranks wait")
    ename, text = kernel.error(waited)
    assert ename == "RankError" and "ZeroDivisionError" in text and "namespaces intact" in text, text
    kernel.pump_until(lambda: "] failed after " in kernel.stream(bg))
    assert kernel.shown(kernel.ok("%%ranks\nkept")) == ["[rank 0] 3\n[rank 1] 4"]


def test_stop_while_waiting_stops_the_job_and_the_namespaces_stay(kernel: Recorder) -> None:
    bg = kernel.ok(
        "%%ranks --bg\nkept = rank + 7\nprint('looping', flush=True)\nwhile True: time.sleep(0.05)"
    )
    kernel.pump_until(lambda: sorted(printed_by(kernel.stream(bg), "looping")) == [0, 1])
    waited = kernel.run("%ranks wait", interrupt_after=0.5)  # the Stop button while %ranks wait waits
    ename, text = kernel.error(waited)
    assert ename == "KeyboardInterrupt" and "namespaces intact" in text, text
    kernel.pump_until(lambda: "] stopped after " in kernel.stream(bg))
    assert kernel.shown(kernel.ok("%%ranks\nkept")) == ["[rank 0] 7\n[rank 1] 8"]


def test_a_jobs_progress_bars_are_drawn_in_its_own_cell(kernel: Recorder) -> None:
    bg = kernel.ok(
        "%%ranks --bg\nfrom tqdm.auto import tqdm\nfor i in tqdm(range(30), desc='steps'):\n    time.sleep(0.05)"
    )
    plain = kernel.ok("print('meanwhile')")
    kernel.ok("%ranks wait")
    kernel.pump_until(lambda: "] done in " in kernel.stream(bg))
    kinds = ("display_data", "update_display_data")
    bars = [
        (parent, m["content"]["data"].get("text/plain", ""))
        for parent, messages in kernel.by_parent.items()
        for m in messages
        if m["msg_type"] in kinds and "steps:" in m["content"]["data"].get("text/plain", "")
    ]
    assert bars and {parent for parent, _ in bars} == {bg}, bars  # redrawn live, in the job's cell only
    finals = [ranks for ranks, text in printed_lines(kernel.stream(bg)) if text.startswith("steps: 100%")]
    assert 0 in sum(finals, []) and "steps" not in kernel.stream(plain)
