"""GPUs for the interactive ranks: ``gpus=`` / ``--gpus`` checked, the start method once CUDA is initialised.

On a CPU machine the checks and the spawn choice run for real (CUDA "initialised" is simulated as in
tests/test_launch_events.py); the tests marked ``cuda`` run the ranks on devices.
"""

from __future__ import annotations

import logging
import sys
import types

import pytest
import torch

from notebook_accel.interactive import Ranks, current, start_ranks
from notebook_accel.interactive import gpus as gpus_module
from notebook_accel.interactive import session as session_module
from notebook_accel.interactive.gpus import SPAWN_NOTE, check_gpus, choose_start_method, parse_gpus
from notebook_accel.interactive.magics import RanksUsageError, _parsers

pytestmark = pytest.mark.timeout(180)


def test_parse_gpus() -> None:
    assert parse_gpus("0,1") == [0, 1] and parse_gpus(" 2 , 3 ") == [2, 3]
    with pytest.raises(ValueError, match=r"--gpus '0,x': 'x' is not a device index; .* --gpus 0,1"):
        parse_gpus("0,x")
    with pytest.raises(ValueError, match=r"'-1' is not a device index"):
        parse_gpus("-1")


def test_the_start_magic_takes_gpus_and_names_a_bad_one() -> None:
    assert _parsers()["start"].parse_args(["2", "--gpus", "0,1"]).gpus == [0, 1]
    assert _parsers()["start"].parse_args(["2"]).gpus is None
    assert _parsers()["start"].parse_args(["2"]).start_method is None  # fork, or spawn after CUDA
    with pytest.raises(RanksUsageError, match=r"--gpus 'a': 'a' is not a device index"):
        _parsers()["start"].parse_args(["2", "--gpus", "a"])


@pytest.mark.parametrize(
    ("gpus", "n", "count", "error", "message"),
    [
        ("0,1", 2, 2, TypeError, r"gpus='0,1' must be a list of device indices"),
        ([0, -1], 2, 2, ValueError, r"-1 is not a device index"),
        ([0, True], 2, 2, ValueError, r"True is not a device index"),
        ([], 2, 2, ValueError, r"gpus=\[\] names no device"),
        ([1, 1], 2, 2, ValueError, r"names a device twice"),
        ([0, 1, 2], 2, 4, ValueError, r"names 3 device\(s\) for 2 rank\(s\); give one per rank"),
        ([0], 2, 4, ValueError, r"names 1 device\(s\) for 2 rank\(s\)"),
        ([0, 1], 2, 0, ValueError, r"no CUDA device is visible on this machine; leave gpus out"),
        (
            [0, 3],
            2,
            2,
            ValueError,
            r"device\(s\) \[3\] do not exist; this machine shows 2 CUDA device\(s\), 0..1",
        ),
    ],
)
def test_bad_gpus_are_refused_with_the_way_out(gpus, n, count, error, message) -> None:
    with pytest.raises(error, match=message):
        check_gpus(gpus, n, count)


def test_good_gpus() -> None:
    assert check_gpus([1, 0], 2, 2) == (1, 0)
    assert check_gpus([3], None, 4) == (3,)
    assert check_gpus(None, 2, 0) is None


def test_start_ranks_refuses_gpus_before_starting_anything() -> None:
    with pytest.raises(ValueError, match=r"names a device twice"):
        start_ranks(2, gpus=[0, 0])
    with pytest.raises(ValueError, match=r"no CUDA device is visible"):  # this machine has none
        Ranks(2, gpus=[0, 1])
    assert current() is None or current().alive


@pytest.mark.parametrize(
    ("asked", "uses_cuda", "initialised", "expected"),
    [
        (None, True, True, ("spawn", SPAWN_NOTE)),
        (None, True, False, ("fork", None)),
        (None, False, True, ("fork", None)),  # CPU ranks never touch the kernel's CUDA context
        ("fork", True, True, ("fork", None)),  # asked for: kept, and the launcher's error names spawn
        ("forkserver", True, True, ("forkserver", None)),
    ],
)
def test_start_method_choice(asked, uses_cuda, initialised, expected) -> None:
    assert choose_start_method(asked, uses_cuda, initialised) == expected


def test_the_spawn_note_says_what_it_costs() -> None:
    assert (
        "NOT inherited" in SPAWN_NOTE
        and "%ranks push" in SPAWN_NOTE
        and "spawn instead of fork" in SPAWN_NOTE
    )


def test_cuda_initialised_reads_torch_without_initialising(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(is_initialized=lambda: True))
    monkeypatch.setitem(sys.modules, "torch", fake)
    assert gpus_module.cuda_initialised()
    fake.cuda.is_initialized = lambda: False
    assert not gpus_module.cuda_initialised()


def test_ranks_start_and_restart_with_spawn_once_cuda_is_initialised(monkeypatch, caplog) -> None:
    running = current()
    if running is not None:
        running.stop()
    sys.modules["__main__"].only_in_the_kernel = 1
    # CUDA initialised in this process, on a machine whose ranks would use it.
    monkeypatch.setattr(session_module, "cuda_initialised", lambda: True)
    monkeypatch.setattr(session_module, "cuda_device_count", lambda: 1)
    try:
        with caplog.at_level(logging.WARNING, logger="notebook_accel.interactive.session"):
            ranks = start_ranks(2)
        try:
            assert ranks._options["start_method"] == "spawn"
            assert SPAWN_NOTE in caplog.text
            assert ranks.run("'only_in_the_kernel' in globals(), rank") == [(False, 0), (False, 1)]
            caplog.clear()
            with caplog.at_level(logging.WARNING, logger="notebook_accel.interactive.session"):
                ranks.restart()
            assert SPAWN_NOTE in caplog.text and ranks.run("rank") == [0, 1]
            assert ranks.run("device") == [torch.device("cpu")] * 2  # the plan is CPU here
        finally:
            ranks.stop()
    finally:
        del sys.modules["__main__"].only_in_the_kernel


needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA device, and a session of its own: NOTEBOOK_ACCEL_TEST_CUDA=1 python -m pytest -m cuda",
)


@pytest.mark.cuda
@needs_cuda
def test_each_rank_uses_its_own_gpu() -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    with start_ranks(2, gpus=[1, 0]) as ranks:
        assert ranks.run("str(device), torch.cuda.current_device()") == [("cuda:0", 0), ("cuda:1", 1)]
        uuids = ranks.run("torch.cuda.get_device_properties(device).uuid")
        assert (
            uuids[0] == torch.cuda.get_device_properties(1).uuid
            and uuids[1] == torch.cuda.get_device_properties(0).uuid
        )


@pytest.mark.cuda
@needs_cuda
def test_one_gpu_session_keeps_cuda_tensors_and_survives_an_out_of_memory() -> None:
    with start_ranks(1, gpus=[0]) as ranks:
        ranks.run("import torch\nx = torch.ones(1024, device=device)")
        assert ranks.run("x.sum().item(), x.device.type") == [(1024.0, "cuda")]
        with pytest.raises(Exception, match="OutOfMemoryError|out of memory"):
            ranks.run("y = torch.empty(1 << 50, dtype=torch.uint8, device=device)")
        assert ranks.alive and ranks.run("x.sum().item()") == [1024.0]
