"""get_max_memory with the budgets clients pass: ints, floats, unit strings; the caller's strings converted in place.

Expected numbers are what Accelerate 1.15's get_max_memory returns for the same input (recorded with
/work/.venv-accelerate), e.g. {0: "10GiB", "cpu": "700KB"} -> {0: 10737418240, "cpu": 700000}.
"""

from __future__ import annotations

import math

import pytest

from notebook_accel.utils import get_max_memory


def test_strings_are_converted_in_the_callers_dict():
    budget = {"disk": "1GB", "cpu": "700KB", 0: "10GiB"}
    got = get_max_memory(budget)
    assert budget == {"disk": 10**9, "cpu": 700_000, 0: 10 * 2**30}
    assert got == {0: 10 * 2**30, "cpu": 700_000, "disk": 10**9}
    assert list(got) == [0, "cpu", "disk"] and got is not budget


@pytest.mark.parametrize(
    "value, expected",
    [
        ("5Mb", 625_000),
        ("5kib", 5120),
        ("5KIB", 5120),
        ("5Gib", 5 * 2**30),
        ("5 kb", 625),
        ("1.5GB", 1_500_000_000),
        ("5 GB", 5 * 10**9),
        (1000, 1000),
    ],
)
def test_units_match_accelerate(value, expected):
    assert get_max_memory({"cpu": value}) == {"cpu": expected}


def test_floats_are_accepted_and_left_as_given():
    budget = {"cpu": 1000.7, "disk": 1e9}
    assert get_max_memory(budget) == {"cpu": 1000, "disk": 10**9}
    assert budget == {"cpu": 1000.7, "disk": 1e9}  # only strings are rewritten


def test_device_order_gpus_mps_cpu_disk():
    got = get_max_memory({"disk": 1, "cpu": 2, "mps": 3, 1: 4, 0: 5})
    assert list(got) == [0, 1, "mps", "cpu", "disk"]


@pytest.mark.parametrize(
    "value, exc, match",
    [
        ("10XB", ValueError, r"max_memory\['cpu'\]: Memory size '10XB' is not in a valid format: .*'10GiB'"),
        ("-5GB", ValueError, r"max_memory\['cpu'\]: Memory size '-5GB' is not in a valid format"),
        (-5, ValueError, r"max_memory\['cpu'\]: Memory size must not be negative, got -5"),
        (-1.5, ValueError, r"max_memory\['cpu'\] = -1.5 is not a usable budget: .*'10GiB'"),
        (math.nan, ValueError, r"max_memory\['cpu'\] = nan is not a usable budget"),
        (None, TypeError, r"max_memory\['cpu'\]: Memory size must be an int or a string like '10GiB'"),
        ([1], TypeError, r"max_memory\['cpu'\]: .*not list"),
    ],
)
def test_bad_budgets_raise_and_leave_the_dict_alone(value, exc, match):
    budget = {0: "1GB", "cpu": value}
    with pytest.raises(exc, match=match):
        get_max_memory(budget)
    assert budget[0] == "1GB"


def test_unknown_device_raises_value_error():
    with pytest.raises(ValueError, match=r"Device 'xpu:0' is not recognized in max_memory: use GPU indices"):
        get_max_memory({"xpu:0": "1GB"})


def test_not_a_dict_raises_type_error():
    with pytest.raises(TypeError, match="max_memory must be a dict like"):
        get_max_memory("10GB")
