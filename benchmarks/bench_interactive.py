"""Interactive ranks in a real kernel: time from start to the first cell result, and an empty cell's cost.

    .venv/bin/python benchmarks/bench_interactive.py
    .venv/bin/python benchmarks/bench_interactive.py --nbdistributed-python /work/wt/venv-nbd/bin/python

Each variant runs in its own ipykernel (started through jupyter_client, history off), 2 CPU ranks:

- ``%ranks`` magic: ``%ranks start 2`` then a ``%%ranks`` cell returning ``rank``; empty ``%%ranks`` cells.
- Python API: ``start_ranks(2)`` then ``ranks.run("rank")``; ``ranks.run("pass")``.
- nbdistributed (where its venv is given): ``%dist_init -n 2`` then ``%%distributed`` cells. Its first
  cells can time out while its workers settle; "start -> first result" runs the cell until one returns
  the ranks' values, which is what a user waits for.

"start -> first result" is timed inside the kernel (``time.perf_counter`` around the calls), median of
``--cycles`` start/stop cycles. "empty cell" is the median of ``-n`` empty cells timed inside the kernel
(the magic's or the API's own cost); "round trip" times the same empty cell from the client, execute
request to the kernel going idle, interleaved with a plain ``pass`` cell of the same kernel (Jupyter's own
floor, "pass cell").
"200 MB value" (``--big-mb``): a fresh kernel, 2 ranks each holding a 200 MB tensor (``torch.zeros``), then
the cell ``%%ranks`` / ``big`` whose last value it is: seconds in the kernel and how much the kernel's peak
memory (``ru_maxrss``) grew, with the default value limit (the ranks send its text and a digest of its
contents) and with no limit (``%ranks value-limit none``: the whole value comes, as before the limit).
nbdistributed is never installed in the project's venv: give the python of a separate venv, e.g.
``python3 -m venv /work/wt/venv-nbd && /work/wt/venv-nbd/bin/pip install torch nbdistributed ipykernel``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import textwrap
import time
from pathlib import Path

# Timed inside the kernel; each snippet prints one "JSON ..." line. {n}: empty cells, {k}: cycles.
_SETUP = "import json, statistics, time\nip = get_ipython()\n"


def _timed_start(started: str, check: str, empty: str, before: str = "") -> str:
    """Return a variant's "start" snippet: the seconds from starting 2 ranks to their first value, then ``{n}`` + 1
    empty cells' seconds, printed as one "JSON ..." line.

    Code, each: ``before`` the clock starts, ``started`` (start the ranks, get a first value), ``check`` (of that
    value, off the clock), ``empty`` (one empty cell).
    """
    lines = [
        textwrap.dedent(before).strip(),
        "t0 = time.perf_counter()",
        textwrap.dedent(started).strip(),
        "first = time.perf_counter() - t0",
        textwrap.dedent(check).strip(),
        "times = []",
        "for _ in range({n} + 1):",
        "    t0 = time.perf_counter()",
        textwrap.indent(textwrap.dedent(empty).strip(), "    "),
        "    times.append(time.perf_counter() - t0)",
        'print("JSON", json.dumps({{"first": first, "empty": times[1:]}}))',
    ]
    return "\n".join(line for line in lines if line) + "\n"


_MAGIC = {
    "load": "%load_ext notebook_accel",
    "start": _timed_start(
        started="""
            ip.run_line_magic("ranks", "start 2")
            shown = ip.run_cell_magic("ranks", "", "rank")
            """,
        check="assert shown.values == [0, 1], shown",
        empty='ip.run_cell_magic("ranks", "", "pass")',
    ),
    "empty_cell": "%%ranks\npass",
    "stop": "%ranks stop",
}

_API = {
    "load": "from notebook_accel.interactive import start_ranks",
    "start": _timed_start(
        started="""
            ranks = start_ranks(2)
            values = ranks.run("rank")
            """,
        check="assert values == [0, 1], values",
        empty='ranks.run("pass")',
    ),
    "empty_cell": "_ = ranks.run('pass')",
    "stop": "ranks.stop()",
}

# nbdistributed switches every later cell to its workers (a cell starting with % stays in the kernel),
# so the timing cells begin with %dist_mode --disable.
_NBD = {
    "load": "%load_ext nbdistributed",
    "start": _timed_start(
        before="""
            %dist_mode --disable
            from IPython.utils.capture import capture_output
            def _first_values():
                for _ in range(20):
                    with capture_output() as cap:
                        ip.run_cell_magic("distributed", "", "rank")
                    if "Rank 0" in cap.stdout and "Rank 1" in cap.stdout and "Error" not in cap.stdout:
                        return
                raise RuntimeError("no cell returned the ranks' values: " + cap.stdout[-500:])
            """,
        started="""
            with capture_output():
                ip.run_line_magic("dist_init", "-n 2")
            ip.run_line_magic("dist_mode", "--disable")
            _first_values()
            """,
        check="",
        empty="""
            with capture_output():
                ip.run_cell_magic("distributed", "", "pass")
            """,
    ),
    "empty_cell": "%%distributed\npass",
    "stop": "%dist_shutdown",
}


class _Kernel:
    """An ipykernel of ``python`` (its venv's bin first on PATH, as when that venv is active)."""

    def __init__(self, python: str) -> None:
        import jupyter_client
        from jupyter_client.kernelspec import KernelSpecManager

        self._specs = tempfile.TemporaryDirectory()
        spec_dir = Path(self._specs.name) / "bench"
        spec_dir.mkdir()
        argv = [
            python,
            "-m",
            "ipykernel_launcher",
            "-f",
            "{connection_file}",
            "--HistoryManager.enabled=False",
        ]
        (spec_dir / "kernel.json").write_text(
            json.dumps({"argv": argv, "display_name": "bench", "language": "python"})
        )
        self.km = jupyter_client.KernelManager(
            kernel_name="bench", kernel_spec_manager=KernelSpecManager(kernel_dirs=[self._specs.name])
        )
        path = os.path.dirname(python) + os.pathsep + os.environ.get("PATH", "")
        self.km.start_kernel(env={**os.environ, "PATH": path})
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=120)

    def cell(self, code: str, timeout: float = 300) -> str:
        """Run ``code``; return its stdout (RuntimeError with the traceback if the cell failed)."""
        out: list[str] = []
        errors: list[str] = []

        def hook(msg: dict) -> None:
            if msg["msg_type"] == "stream" and msg["content"]["name"] == "stdout":
                out.append(msg["content"]["text"])
            elif msg["msg_type"] == "error":
                errors.append("\n".join(msg["content"]["traceback"]))

        reply = self.kc.execute_interactive(textwrap.dedent(code), timeout=timeout, output_hook=hook)
        if reply["content"]["status"] != "ok":
            raise RuntimeError(f"cell failed:\n{code}\n{''.join(errors)}")
        return "".join(out)

    def round_trips(self, code: str, n: int) -> tuple[list[float], list[float]]:
        """Return client-side seconds of ``n`` runs of ``code`` and of a plain ``pass`` cell, interleaved.

        Interleaved so that load from other programs on the machine hits both alike; one warm-up each.
        """
        times: list[float] = []
        floor: list[float] = []
        for _ in range(n + 1):
            for source, into in ((code, times), ("pass", floor)):
                start = time.perf_counter()
                self.cell(source)
                into.append(time.perf_counter() - start)
        return times[1:], floor[1:]

    def close(self) -> None:
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=True)
        self._specs.cleanup()


def measure(python: str, variant: dict, n: int, cycles: int) -> dict:
    """Return the figures of one variant: first-result times, in-kernel and client empty cells."""
    kernel = _Kernel(python)
    try:
        kernel.cell(_SETUP)
        kernel.cell(variant["load"])
        firsts, empties, trips, floor = [], [], [], []
        for cycle in range(cycles):
            out = kernel.cell(variant["start"].format(n=n))
            line = [ln for ln in out.splitlines() if ln.startswith("JSON ")]
            if not line:
                raise RuntimeError(f"no timing line in:\n{out[-2000:]}")
            figures = json.loads(line[-1][5:])
            firsts.append(figures["first"])
            empties += figures["empty"]
            if cycle == 0:
                trips, floor = kernel.round_trips(variant["empty_cell"], n)
            kernel.cell(variant["stop"])
        return {"first": firsts, "empty": empties, "trip": trips, "floor": floor}
    finally:
        kernel.close()


_BIG = """
    import resource, torch
    def _peak_mb():
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    ip.run_line_magic("load_ext", "notebook_accel")
    ip.run_line_magic("ranks", "start 2")
    ip.run_cell_magic("ranks", "", "big = torch.zeros({numel}); None")
    figures = {{}}
    for limit in ("1MB", "none"):
        ip.run_line_magic("ranks", f"value-limit {{limit}}")
        before = _peak_mb()
        t0 = time.perf_counter()
        shown = ip.run_cell_magic("ranks", "", "big")
        figures[limit] = (time.perf_counter() - t0, _peak_mb() - before)
        assert "[all 2 ranks] tensor([0., 0., 0.,  ..., 0., 0., 0.])" in repr(shown), repr(shown)
        del shown
    ip.run_line_magic("ranks", "stop")
    print("JSON", json.dumps(figures))
    """


def measure_big(python: str, megabytes: int) -> dict:
    """Return {limit: (seconds, kernel peak growth MB)} of a cell whose value is a ``megabytes`` tensor per rank."""
    kernel = _Kernel(python)
    try:
        kernel.cell(_SETUP)
        out = kernel.cell(_BIG.format(numel=megabytes * 1_000_000 // 4))
        line = [ln for ln in out.splitlines() if ln.startswith("JSON ")]
        if not line:
            raise RuntimeError(f"no timing line in:\n{out[-2000:]}")
        return json.loads(line[-1][5:])
    finally:
        kernel.close()


def _ms(values: list[float]) -> str:
    return f"{statistics.median(values) * 1e3:9.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=100, help="empty cells per variant (default 100)")
    parser.add_argument("--cycles", type=int, default=5, help="start/stop cycles per variant (default 5)")
    parser.add_argument("--nbdistributed-python", default=None, help="python of a venv with nbdistributed")
    parser.add_argument("--big-mb", type=int, default=200, help="MB of the big value per rank (0: skip it)")
    args = parser.parse_args()
    rows: list[tuple[str, dict | str]] = [
        ("notebook_accel %ranks magic", measure(sys.executable, _MAGIC, args.n, args.cycles)),
        ("notebook_accel Python API", measure(sys.executable, _API, args.n, args.cycles)),
    ]
    nbd = args.nbdistributed_python
    if nbd is None:
        rows.append(("nbdistributed", "skipped: no --nbdistributed-python given"))
    elif not Path(nbd).exists():
        rows.append(("nbdistributed", f"skipped: {nbd} does not exist"))
    else:
        # Its cells cost ~0.1 s each: fewer of them, same statistics.
        try:
            rows.append(("nbdistributed", measure(nbd, _NBD, min(args.n, 30), min(args.cycles, 3))))
        except RuntimeError as err:
            rows.append(("nbdistributed", f"failed: {str(err).strip().splitlines()[-1]}"))
    print(f"2 CPU ranks, {os.cpu_count()} CPU cores; medians; in-kernel times unless said")
    print(
        f"{'variant':30} {'start->first s':>14} {'empty cell ms':>13} {'round trip ms':>13} {'pass cell ms':>12}"
    )
    for name, res in rows:
        if isinstance(res, str):
            print(f"{name:30} {res}")
            continue
        first = statistics.median(res["first"])
        print(
            f"{name:30} {first:14.3f} {_ms(res['empty']):>13} {_ms(res['trip']):>13} {_ms(res['floor']):>12}"
        )
    figures = {name: res for name, res in rows if not isinstance(res, str)}
    ours, theirs = figures.get("notebook_accel %ranks magic"), figures.get("nbdistributed")
    if ours and theirs:
        ratios = {
            k: statistics.median(theirs[k]) / statistics.median(ours[k]) for k in ("first", "empty", "trip")
        }
        print(
            f"nbdistributed / %ranks magic: start->first x{ratios['first']:.1f}, empty cell x{ratios['empty']:.0f}, "
            f"round trip x{ratios['trip']:.1f}"
        )
    if args.big_mb:
        big = measure_big(sys.executable, args.big_mb)
        for limit, label in (("1MB", "default value limit (1 MB)"), ("none", "no value limit")):
            seconds, grew = big[limit]
            print(
                f"a {args.big_mb} MB tensor per rank as a cell's value, {label}: {seconds:.3f} s, "
                f"kernel peak memory +{grew:.0f} MB"
            )
    print("start->first: start 2 ranks and get a cell's value back; empty cell: `pass` on both ranks")
    print("round trip: the empty cell from the client (execute -> idle); pass cell: a plain cell, the floor")


if __name__ == "__main__":
    main()
