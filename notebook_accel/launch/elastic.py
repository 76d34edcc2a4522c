"""Multi-node launches (``num_nodes > 1``), and ``rdzv_backend="c10d"`` on one node, through
torch.distributed.elastic, the engine of torchrun.

Every machine calls ``notebook_launcher(..., num_nodes=N, node_rank=i)``; ``elastic_launch`` runs the
rendezvous (static: node ranks given, endpoint ``master_addr:use_port``; c10d: ranks assigned by the
rendezvous at ``rdzv_endpoint``) and the local workers. What differs from a single-node launch:
output is tailed by elastic from per-rank log files (prefix from ``log_line_prefix_template``,
default ``[rank N] ``) straight to this process's stdout/stderr, so ``sinks`` and a handle
(``block=False``) are not available; the returned list holds this node's ranks only, in local-rank
order; failures come from elastic's error files, converted into ``LaunchError``.

As on one node: a clean ``sys.exit(0)`` is a success that returns None (torch's worker treats exit
code 0 so), and a rank killed by a signal carries its last stderr lines (read back from elastic's
log file) and, for fatal signals, the Python stack ``faulthandler`` printed (torch elastic enables
it in every worker). Not available here: a handle, so no ``stacks()`` of live ranks, no stop or
timeout (with where each rank was) and no hang report; elastic runs the workers to the end in its
own agent, which this process does not reach while ``elastic_launch`` runs.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import tempfile
from typing import Any

from .errors import LaunchError, RankFailure, death_notes, order_failures, signal_name
from .plan import LaunchPlan
from .worker import _reset_state, threads_per_worker, to_cpu

__all__ = ["launch_elastic"]


def _elastic_entry(function, args, env: dict[str, str], num_threads: int) -> Any:
    """Run in each elastic worker: our environment on top of torchrun's, fresh singletons."""
    import torch

    os.environ.update(env)
    torch.set_num_threads(num_threads)
    _reset_state()
    return to_cpu(function(*args))


def _template(user_template: str | None) -> str:
    if user_template is None:
        return "[rank ${rank}] "
    # Accept format-style fields too; elastic only substitutes ${...}.
    return re.sub(r"(?<!\$)\{(rank|local_rank|role_name)\}", r"${\1}", user_template)


def _stderr_tail(log_base: str, local_rank: int, limit: int = 300) -> list[str]:
    """Return the last lines elastic logged for ``local_rank``'s stderr in this run (its latest attempt)."""
    # DefaultLogsSpecs writes <base>/<run_id>_<random>/attempt_<n>/<local_rank>/stderr.log
    paths = glob.glob(os.path.join(glob.escape(log_base), "*", "attempt_*", str(local_rank), "stderr.log"))
    if not paths:
        return []
    try:
        with open(max(paths, key=os.path.getmtime), encoding="utf-8", errors="replace") as f:
            return f.read().splitlines()[-limit:]
    except OSError:
        return []


def _failure_of(rank: int, failure, log_base: str = "") -> RankFailure:
    message, tb, exc_type = str(getattr(failure, "message", "")), "", "ChildFailedError"
    error_file = getattr(failure, "error_file", "")
    if error_file and os.path.isfile(error_file):
        try:
            with open(error_file, encoding="utf-8") as f:
                data = json.load(f)
            body = data.get("message", data)
            if isinstance(body, dict):
                message = str(body.get("message", message))
                tb = str(body.get("extraInfo", {}).get("py_callstack", ""))
        except (OSError, ValueError):
            pass
    if isinstance(getattr(failure, "message", None), dict):
        body = failure.message
        message = str(body.get("message", message))
        tb = tb or str(body.get("extraInfo", {}).get("py_callstack", ""))
    head = message.strip().splitlines()[-1] if message.strip() else ""
    if ": " in head:
        exc_type, _, message = head.partition(": ")
    code = getattr(failure, "exitcode", None)
    sig = signal_name(-code) if isinstance(code, int) and code < 0 else None
    if sig and not tb:
        exc_type, message = "Signal", f"killed by {sig}"
        notes = death_notes(_stderr_tail(log_base, getattr(failure, "local_rank", rank))) if log_base else ""
        tb = f"Last stderr lines of rank {rank}:\n{notes}" if notes else ""
    return RankFailure(
        rank,
        getattr(failure, "pid", None),
        exc_type,
        message,
        tb,
        exitcode=code,
        signal=sig,
        time=float(getattr(failure, "timestamp", 0)),
    )


def launch_elastic(
    function,
    args: tuple,
    plan: LaunchPlan,
    *,
    rdzv_backend: str,
    rdzv_endpoint: str,
    rdzv_conf: dict | None,
    rdzv_id: str,
    max_restarts: int,
    monitor_interval: float,
    log_line_prefix_template: str | None,
    log_dir: str | os.PathLike | None,
) -> list[Any]:
    """Return this node's per-rank values after an elastic launch; raise LaunchError on failure."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    conf = dict(rdzv_conf or {})
    endpoint = rdzv_endpoint or f"{plan.master_addr}:{plan.master_port}"
    if rdzv_backend == "static":
        conf["rank"] = plan.node_rank
    elif not rdzv_endpoint and plan.num_nodes > 1:
        raise ValueError(
            f"rdzv_backend={rdzv_backend!r} needs rdzv_endpoint='host:port' (the same on every node)"
        )
    own_dir = log_dir is None
    base = tempfile.mkdtemp(prefix="notebook_accel-elastic-") if own_dir else os.fspath(log_dir)
    try:
        config = LaunchConfig(
            min_nodes=plan.num_nodes,
            max_nodes=plan.num_nodes,
            nproc_per_node=plan.num_processes,
            run_id=rdzv_id,
            role="default",
            rdzv_endpoint=endpoint,
            rdzv_backend=rdzv_backend,
            rdzv_configs=conf,
            max_restarts=max_restarts,
            monitor_interval=monitor_interval,
            start_method=plan.start_method,
            log_line_prefix_template=_template(log_line_prefix_template),
            logs_specs=DefaultLogsSpecs(log_dir=base, redirects=Std.ALL, tee=Std.ALL),
        )
        threads = threads_per_worker(plan.num_processes)
        try:
            values = elastic_launch(config, entrypoint=_elastic_entry)(function, args, plan.env, threads)
        except ChildFailedError as exc:
            # Root cause first, by the same rule as single-node launches (collateral failures last).
            raise LaunchError(
                order_failures([_failure_of(rank, f, base) for rank, f in sorted(exc.failures.items())])
            ) from None
    finally:
        if own_dir:
            shutil.rmtree(base, ignore_errors=True)
    return [values[rank] for rank in sorted(values)]
