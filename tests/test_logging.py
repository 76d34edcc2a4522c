"""get_logger: level handling, main-process-only logging and in-order logging across 2 real processes."""

from __future__ import annotations

import logging

import pytest

import notebook_accel.logging as ours
from notebook_accel.logging import MultiProcessAdapter, get_logger
from notebook_accel.utils.environment import patch_environment
from tests._dist import run_distributed


def _capture(name: str) -> tuple[logging.Logger, list[logging.LogRecord]]:
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger(name)
    logger.addHandler(handler)
    logger.propagate = False
    return logger, records


def test_get_logger_levels_and_env_fallback() -> None:
    adapter = get_logger("na.test.levels", log_level="debug")
    assert isinstance(adapter, MultiProcessAdapter) and adapter.logger.level == logging.DEBUG
    with patch_environment(ACCELERATE_LOG_LEVEL="ERROR"):
        assert get_logger("na.test.env").logger.level == logging.ERROR
    assert get_logger("na.test.none").logger.level == logging.NOTSET
    root_level = logging.getLogger().level
    get_logger("na.test.root", log_level="CRITICAL")
    assert logging.getLogger().level == root_level  # the root logger is never configured
    with pytest.raises(ValueError, match=r"log_level='LOUD' is not a logging level"):
        get_logger("na.test.bad", log_level="LOUD")


def test_main_process_only_uses_env_rank_without_state() -> None:
    _, records = _capture("na.test.rank")
    adapter = get_logger("na.test.rank", log_level="INFO")
    with patch_environment(RANK="1"):
        adapter.info("hidden on rank 1")
        adapter.info("shown on rank 1", main_process_only=False)
    adapter.info("rank 0 %s", "args")
    adapter.debug("below level")
    assert [r.getMessage() for r in records] == ["[RANK 1] shown on rank 1", "[RANK 0] rank 0 args"]


def test_an_existing_state_decides_the_rank_over_the_environment() -> None:
    from notebook_accel.state import PartialState

    _, records = _capture("na.test.state_rank")
    adapter = get_logger("na.test.state_rank", log_level="INFO")
    assert PartialState().process_index == 0
    with patch_environment(RANK="1"):  # e.g. left over in the kernel's environment
        adapter.info("main process per the state")
    assert [r.getMessage() for r in records] == ["[RANK 0] main process per the state"]
    with patch_environment(RANK="one"):
        PartialState._reset_state()
        with pytest.raises(ValueError, match=r"environment variable RANK='one' is not an integer"):
            adapter.info("no state: RANK is read")


def test_caller_location_is_the_user_line() -> None:
    _, records = _capture("na.test.caller")
    adapter = get_logger("na.test.caller", log_level="INFO")
    adapter.info("here")
    adapter.log(logging.WARNING, "direct")
    adapter.warning_once("once")
    adapter.warning_once("once")
    assert [r.funcName for r in records] == ["test_caller_location_is_the_user_line"] * 3
    assert [r.getMessage() for r in records] == ["[RANK 0] here", "[RANK 0] direct", "[RANK 0] once"]


def _log_from_helper(adapter: MultiProcessAdapter, level: int) -> None:
    adapter.info("from helper", stacklevel=level)


def test_stacklevel_counts_as_in_accelerate() -> None:
    # Accelerate 1.15: 2 (the default) is the line calling .info, 3 its caller, 1 the adapter itself.
    _, records = _capture("na.test.stacklevel")
    adapter = get_logger("na.test.stacklevel", log_level="INFO")
    _log_from_helper(adapter, 2)
    _log_from_helper(adapter, 3)
    _log_from_helper(adapter, 1)
    assert [r.funcName for r in records[:2]] == [
        "_log_from_helper",
        "test_stacklevel_counts_as_in_accelerate",
    ]
    assert records[1].pathname == __file__
    assert records[2].pathname == ours.__file__


def test_in_order_single_process() -> None:
    _, records = _capture("na.test.single")
    get_logger("na.test.single", log_level="INFO").info("alone", in_order=True)
    assert [r.getMessage() for r in records] == ["[RANK 0] alone"]


def _worker(path: str):
    import time

    from notebook_accel.state import PartialState

    logger = logging.getLogger("na.test.dist")
    handler = logging.FileHandler(path)  # append mode, flushed after every record
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(handler)
    logger.propagate = False
    adapter = get_logger("na.test.dist", log_level="INFO")
    state = PartialState()
    adapter.info(f"main-only from {state.process_index}")
    adapter.info(f"everyone from {state.process_index}", main_process_only=False)
    state.wait_for_everyone()
    if state.process_index == 0:
        time.sleep(0.3)  # without ordering, rank 1 would now log first
    adapter.info(f"ordered {state.process_index}", in_order=True)
    adapter.info(f"ordered again {state.process_index}", main_process_only=False, in_order=True)
    handler.close()
    return state.process_index


def test_main_process_only_and_in_order_across_two_processes(tmp_path) -> None:
    path = tmp_path / "log.txt"
    assert run_distributed(_worker, nprocs=2, args=(str(path),)) == [0, 1]
    lines = path.read_text().splitlines()
    assert sorted(lines[:3]) == [
        "[RANK 0] everyone from 0",
        "[RANK 0] main-only from 0",
        "[RANK 1] everyone from 1",
    ]  # no "main-only from 1"
    assert lines[3:] == [f"[RANK {r}] ordered {a}{r}" for a in ("", "again ") for r in (0, 1)]


def test_fsdp_utils_serves_the_multi_process_logger() -> None:
    # Accelerate 1.15 code does ``from accelerate.utils.fsdp_utils import get_logger``: it must log
    # main-process-only with the rank prefix, not be a plain logging.getLogger.
    from notebook_accel.utils import fsdp_utils

    _, records = _capture("na.test.fsdp_utils")
    adapter = fsdp_utils.get_logger("na.test.fsdp_utils", log_level="INFO")
    with patch_environment(RANK="1"):
        adapter.info("hidden on rank 1")
        adapter.info("shown", main_process_only=False)
    assert [r.getMessage() for r in records] == ["[RANK 1] shown"]
    assert "get_logger" in fsdp_utils.__all__ and "get_logger" in dir(fsdp_utils)
