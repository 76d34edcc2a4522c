"""``notebook_launcher`` and ``debug_launcher``: run a function on several processes from a notebook.

The workers are forked from the calling process (a Jupyter kernel), so a function defined in a cell,
closures included, runs as is. Each worker gets the torchrun environment (RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), so ``PartialState()`` / ``Accelerator()``
or a plain ``torch.distributed.init_process_group()`` inside the function form the process group.
"""

from __future__ import annotations

import itertools
import logging
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from .launch.cell_bars import CellBars
from .launch.handle import LaunchHandle
from .launch.output import LogDirSink, OutputLine, PrintSink, format_prefix
from .launch.plan import LaunchPlan, check_cuda_not_initialised, resolve_plan
from .launch.ports import DEFAULT_PORT, host_store

__all__ = ["debug_launcher", "notebook_launcher"]

logger = logging.getLogger(__name__)

_run_counter = itertools.count()
_PROGRESS_BARS = ("auto", "main", "all", "text")


def _in_kernel() -> bool:
    """Return True when called in a Jupyter kernel (IPython is imported only if the caller did)."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    return shell is not None and hasattr(shell, "kernel")


def _resolve_bars(progress_bars: str, panel: bool) -> tuple[bool, set[int] | None]:
    """Return (whether workers send bar events, the ranks shown live: None for all) for ``progress_bars``."""
    if progress_bars not in _PROGRESS_BARS:
        raise ValueError(
            f"progress_bars={progress_bars!r} is not one of {list(_PROGRESS_BARS)}: 'main' shows the main "
            "process's bars live, 'all' every rank's, 'text' lets tqdm write its usual text"
        )
    mode = progress_bars
    if mode == "auto":
        # A plain script keeps tqdm's own text; a notebook (or a panel) gets live bars.
        mode = "main" if panel or _in_kernel() else "text"
    if mode == "text":
        return False, None
    return True, ({0} if mode == "main" else None)


def _run_id(rdzv_id: str) -> str:
    if rdzv_id and rdzv_id != "none":
        return str(rdzv_id)
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{next(_run_counter)}"


def _build_sinks(
    plan: LaunchPlan,
    sinks: Sequence[Callable[[OutputLine], None]] | None,
    template: str | None,
    panel: bool = False,
) -> list[Callable[[OutputLine], None]]:
    if sinks is None:
        if panel:
            # The panel shows every line; printing them too would fill whichever cell runs meanwhile.
            return []
        return [
            PrintSink(prefix_template=template, num_processes=plan.num_processes, node_rank=plan.node_rank)
        ]
    sinks = list(sinks)
    for sink in sinks:
        if not callable(sink):
            raise TypeError(f"sinks must be callables taking an OutputLine; got {sink!r}")
    return sinks


def _announce(sinks: Sequence[Callable[[OutputLine], None]], text: str) -> None:
    for sink in sinks:
        announce = getattr(sink, "announce", None)
        if announce is not None:
            announce(text)


def _show_panel(handle: LaunchHandle) -> None:
    try:
        from notebook_accel.widgets import LaunchPanel
    except ImportError as exc:
        raise ImportError(
            "panel=True needs the launch panel (notebook_accel.widgets.LaunchPanel) and ipywidgets: "
            f"pip install 'notebook-accel[panels]' ({exc})"
        ) from exc
    LaunchPanel(handle).display()


def notebook_launcher(
    function: Callable,
    args: tuple = (),
    num_processes: int | None = None,
    mixed_precision: str = "no",
    use_port: str = "29500",
    master_addr: str = "127.0.0.1",
    node_rank: int = 0,
    num_nodes: int = 1,
    rdzv_backend: str = "static",
    rdzv_endpoint: str = "",
    rdzv_conf: dict | None = None,
    rdzv_id: str = "none",
    max_restarts: int = 0,
    monitor_interval: float = 0.1,
    log_line_prefix_template: str | None = None,
    *,
    block: bool = True,
    panel: bool = False,
    start_method: str = "fork",
    log_dir: str | os.PathLike | None = None,
    sinks: Sequence[Callable[[OutputLine], None]] | None = None,
    timeout: float | None = None,
    progress_bars: str = "auto",
) -> list[Any] | LaunchHandle:
    """Return each rank's return value (a list indexed by rank) after running ``function(*args)`` on every process.

    Args:
        function: what every process runs; defined anywhere, a notebook cell included.
        args: positional arguments passed to ``function`` in every process.
        num_processes: processes on this machine. None: one per CUDA device, or 1 (in the calling
            process) on a CPU-only machine. 1 runs ``function`` in the calling process.
        mixed_precision: "no", "fp16", "bf16" or "fp8"; exported as ACCELERATE_MIXED_PRECISION.
        use_port: rendezvous port on ``master_addr``. The default one is replaced by a free port
            when taken; a port chosen explicitly that is taken raises RuntimeError.
        master_addr: address of the rank-0 node.
        node_rank, num_nodes: this machine's rank and the number of machines; ``num_nodes > 1``
            runs through torch.distributed.elastic (see ``notebook_accel.launch.elastic``).
        rdzv_backend, rdzv_endpoint, rdzv_conf, rdzv_id, max_restarts, monitor_interval: elastic
            rendezvous settings, used when ``num_nodes > 1`` (as in torchrun).
        log_line_prefix_template: prefix of each output line, e.g. "[{rank}]: " (``${rank}``,
            ``{local_rank}``, ``{role_name}`` work too); default "[rank N] ".
        block: False returns a ``LaunchHandle`` at once (status, live output, wait/result/stop).
        panel: show the live launch panel (``notebook_accel.widgets.LaunchPanel``). With the
            default ``sinks=None`` the lines then show in the panel only, not printed in the cell.
        start_method: "fork" (default; CUDA must not be initialised in the caller), "spawn" or
            "forkserver" (the function and its arguments are sent by value with cloudpickle).
        log_dir: also write ``<log_dir>/<run_id>/rank_<N>/stdout.log`` and ``stderr.log``.
        sinks: callables receiving every ``OutputLine``; None prints to the calling cell with a
            rank prefix (nothing when ``panel=True``), [] prints nothing. An explicit list is used
            as given, with or without a panel (``[notebook_accel.launch.PrintSink()]`` prints
            next to a panel).
        timeout: seconds after which the workers are stopped and LaunchError is raised.
        progress_bars: how the workers' tqdm bars show. "main": one live bar per bar of the main
            process (in the panel, or in the cell), "all": live bars of every rank, "text": tqdm
            writes its text as in a terminal. In "main" and "all" a rank's output keeps only each
            bar's final state (one line), and ``print`` output is unchanged. "auto" (default):
            "main" in a Jupyter kernel or with ``panel=True``, "text" in a plain script.

    Raises:
        LaunchError: a rank raised or died; the root cause's rank, pid, type and traceback first.
        KeyboardInterrupt: re-raised after every worker was stopped.
        ValueError / RuntimeError: bad arguments, a taken explicit port, CUDA initialised before a fork.
    """
    if not callable(function):
        raise TypeError(f"function must be callable; got {function!r}")
    if not isinstance(args, (tuple, list)):
        raise TypeError(f"args must be a tuple of positional arguments; got {type(args).__name__}")
    if timeout is not None and not timeout > 0:
        raise ValueError(f"timeout={timeout!r} must be a positive number of seconds or None")
    bar_events = _resolve_bars(progress_bars, panel)
    return _launch(
        function, tuple(args), num_processes, mixed_precision, use_port, master_addr, node_rank, num_nodes,
        rdzv_backend, rdzv_endpoint, rdzv_conf, rdzv_id, max_restarts, monitor_interval,
        log_line_prefix_template, block, panel, start_method, log_dir, sinks, timeout, force_cpu=False,
        bar_events=bar_events,
    )  # fmt: skip


def _launch(
    function, args, num_processes, mixed_precision, use_port, master_addr, node_rank, num_nodes,
    rdzv_backend, rdzv_endpoint, rdzv_conf, rdzv_id, max_restarts, monitor_interval,
    log_line_prefix_template, block, panel, start_method, log_dir, sinks, timeout, *, force_cpu,
    bar_events=(False, None),
):  # fmt: skip
    format_prefix(log_line_prefix_template, 0, 0)  # a bad template fails here, not in the reader thread
    plan = resolve_plan(
        num_processes, mixed_precision, use_port, master_addr, node_rank, num_nodes, rdzv_backend,
        start_method, force_cpu=force_cpu,
    )  # fmt: skip
    if plan.backend == "xla":
        from .launch.xla import launch_xla

        _announce(_build_sinks(plan, sinks, log_line_prefix_template), plan.describe())
        return launch_xla(function, args, plan)
    if plan.num_nodes > 1:
        from .launch.elastic import launch_elastic

        if not block:
            raise ValueError(
                "block=False is not available with num_nodes > 1 (torch elastic runs to the end)"
            )
        _announce(_build_sinks(plan, sinks, log_line_prefix_template), plan.describe())
        return launch_elastic(
            function, args, plan, rdzv_backend=rdzv_backend, rdzv_endpoint=rdzv_endpoint, rdzv_conf=rdzv_conf,
            rdzv_id=rdzv_id, max_restarts=max_restarts, monitor_interval=monitor_interval,
            log_line_prefix_template=log_line_prefix_template, log_dir=log_dir,
        )  # fmt: skip
    if plan.in_process and block:
        _announce(_build_sinks(plan, sinks, log_line_prefix_template), plan.describe())
        return [function(*args)]
    if plan.in_process:  # a handle needs a separate process, even for one rank
        plan = _with_workers(plan)
    plan, stores = _host_stores(plan, explicit_port=str(use_port) != DEFAULT_PORT)
    run_id = _run_id(rdzv_id)
    out_sinks = _build_sinks(plan, sinks, log_line_prefix_template, panel=panel)
    log_sink = None
    log_files: dict[int, dict[str, str]] = {}
    if log_dir is not None:
        base = plan.node_rank * plan.num_processes
        log_sink = LogDirSink(log_dir, run_id, range(base, base + plan.num_processes))
        out_sinks.append(log_sink)
        log_files = {
            r: {s: str(log_sink.path(r, s)) for s in ("stdout", "stderr")}
            for r in range(base, base + plan.num_processes)
        }
    _announce(out_sinks, plan.describe())

    def release() -> None:
        # Last references to the stores: their servers stop and the ports are free again.
        stores.clear()
        if log_sink is not None:
            log_sink.close()

    handle = LaunchHandle(
        plan, function, args, sinks=out_sinks, timeout=timeout, run_id=run_id, log_files=log_files,
        on_finish=release, bar_events=bar_events[0], live_bar_ranks=bar_events[1],
    )  # fmt: skip
    if bar_events[0] and not panel and _in_kernel():
        CellBars(handle)  # the bars live in the calling cell, above the printed lines that follow
    try:
        handle._start(threaded=not block)
    except BaseException:
        release()
        raise
    if panel:
        try:
            _show_panel(handle)
        except BaseException:
            handle.kill()
            handle._supervise() if block else handle.wait()
            raise
    if not block:
        return handle
    handle._run_here()
    return handle.result()


def _with_workers(plan: LaunchPlan) -> LaunchPlan:
    check_cuda_not_initialised(plan.start_method)
    dist_type = "MULTI_GPU" if plan.device_type == "cuda" else "MULTI_CPU"
    return replace(plan, in_process=False, distributed_type=dist_type)


def _loopback(addr: str) -> bool:
    return addr in ("localhost", "::1") or addr.startswith("127.")


def _host_stores(plan: LaunchPlan, explicit_port: bool) -> tuple[LaunchPlan, list]:
    """Return the plan with the ports of the TCPStore(s) this process now hosts, and the stores.

    The workers connect to them as clients (TORCHELASTIC_USE_AGENT_STORE, as under torchrun), so the
    port is held from before the first fork to the end of the launch: nothing can take it meanwhile.
    """
    store = host_store(plan.master_port, fallback=not explicit_port)
    stores = [store]
    dry_run_port = None
    if plan.debug:  # a separate store, so the dry run's keys never meet the real group's
        try:
            stores.append(host_store(0, fallback=True))
        except BaseException:
            stores.clear()
            raise
        dry_run_port = stores[1].port
    env = {**plan.env, "TORCHELASTIC_USE_AGENT_STORE": "True"}
    if (
        _loopback(plan.master_addr)
        and sys.platform.startswith("linux")
        and "GLOO_SOCKET_IFNAME" not in os.environ
    ):
        # Every peer is on this machine: gloo needs no host-name lookup (which in containers often
        # resolves to an address the peers cannot reach) and connects over loopback.
        env["GLOO_SOCKET_IFNAME"] = "lo"
    return replace(plan, master_port=store.port, dry_run_port=dry_run_port, env=env), stores


def debug_launcher(function: Callable, args: tuple = (), num_processes: int = 2) -> list[Any]:
    """Return each rank's return value after running ``function(*args)`` on ``num_processes`` CPU processes.

    Meant for tests of distributed code on a machine without accelerators: the workers use gloo on
    the CPU (ACCELERATE_USE_CPU=1) even where CUDA devices exist.
    """
    if not callable(function):
        raise TypeError(f"function must be callable; got {function!r}")
    return _launch(
        function, tuple(args), num_processes, "no", "29500", "127.0.0.1", 0, 1, "static", "", None, "none", 0,
        0.1, None, True, False, "fork", None, None, None, force_cpu=True,
    )  # fmt: skip
