"""Values of interactive ranks, from a real ipykernel: equal means equal, big values stay, stale globals warn."""

from __future__ import annotations

import pytest

from notebook_accel.interactive.stale import fingerprint, global_tokens, stale_message
from notebook_accel.interactive.values import digest, parse_size, value_payload
from tests.test_interactive_ipython import _cell, _ok
from tests.test_launcher_kernel import Kernel, interactive_kernel

pytestmark = pytest.mark.timeout(240)

SETUP = """
%load_ext notebook_accel
import torch, notebook_accel
from notebook_accel import interactive
lr = 0.1
def rate():
    return lr
def uses_rate():
    return rate() * 10
ranks = notebook_accel.start_ranks(2)
"""


@pytest.fixture(scope="module")
def kernel():
    yield from interactive_kernel(SETUP)


def _shown(kernel: Kernel, code: str) -> str:
    out, shown = _ok(kernel, code)
    results = [s for s in shown if "text/plain" in s["data"]]
    assert results, (out, shown)
    return results[-1]["data"]["text/plain"]


def test_tensors_differing_in_one_element_are_not_shown_as_one(kernel: Kernel) -> None:
    text = _shown(kernel, "%%ranks\nt = torch.zeros(10_000)\nif rank == 1:\n    t[5000] = 1e-9\nt")
    assert text == (
        "[rank 0] tensor([0., 0., 0.,  ..., 0., 0., 0.])\n[rank 1] tensor([0., 0., 0.,  ..., 0., 0., 0.])\n"
        "(ranks 0 and 1 print alike but their values differ)"
    )
    assert (
        _shown(kernel, "%%ranks\nt = torch.zeros(10_000)\nt")
        == "[all 2 ranks] tensor([0., 0., 0.,  ..., 0., 0., 0.])"
    )
    # Same contents, another dtype: not equal either.
    text = _shown(
        kernel, "%%ranks\ntorch.zeros(3, dtype=torch.float64 if rank else torch.float32).sum().item()"
    )
    assert text == "[all 2 ranks] 0.0"  # plain floats: equal
    text = _shown(
        kernel, "%%ranks\ntorch.zeros(3, dtype=torch.float64 if rank else torch.float32).numpy().sum() * 0"
    )
    assert "[all 2 ranks]" not in text
    # Modules by their weights: the same layer seeded alike is equal, seeded apart it differs.
    same = _shown(kernel, "%%ranks\ntorch.manual_seed(0)\ntorch.nn.Linear(64, 64)")
    assert same == "[all 2 ranks] Linear(in_features=64, out_features=64, bias=True)"
    apart = _shown(kernel, "%%ranks\ntorch.manual_seed(rank)\ntorch.nn.Linear(64, 64)")
    assert apart.endswith("(ranks 0 and 1 print alike but their values differ)")


def test_a_value_over_the_limit_stays_on_its_rank_until_pulled(kernel: Kernel) -> None:
    text = _shown(kernel, "%%ranks\nbig = torch.arange(600_000) * (rank + 1)\nbig")
    assert text.startswith("[rank 0] tensor([     0,      1,")
    out, _ = _ok(
        kernel,
        "shown = _\nprint('SHIPPED', [r.shipped for r in shown.results], [r._value for r in shown.results])\n"
        "try:\n    shown.values\nexcept interactive.ValueOnRankError as e:\n    print('STAYED', e)\n"
        "print('PULLED', [v[1].item() for v in ranks.pull('_')], ranks.pull('_')[0].device)",
    )
    # The kernel got the display only: no value object.
    assert "SHIPPED [False, False] [None, None]" in out
    assert "STAYED the values of rank(s) [0, 1] stayed on the ranks" in out
    assert "ranks.pull('_', on=[0, 1]) (%ranks pull _ --on 0,1)" in out and "%ranks value-limit 500MB" in out
    assert "PULLED [1, 2] cpu" in out
    # Raised, the same cell's values come.
    assert (
        _shown(kernel, "%ranks value-limit 10MB")
        == "'cell values up to 10.0 MB (pickled) come to the kernel'"
    )
    out, _ = _ok(kernel, "%%ranks\nbig")
    out, _ = _ok(kernel, "print('CAME', [int(v[1]) for v in _.values])\n%ranks value-limit 1MB")
    assert "CAME [1, 2]" in out
    # ranks.run asks for the values: they come whatever their size.
    out, _ = _ok(kernel, "print('RUN', [int(v[1]) for v in ranks.run('big')])")
    assert "RUN [1, 2]" in out


def test_bad_value_limits_say_how_to_write_one(kernel: Kernel) -> None:
    status, out, err, ename = kernel.run("%ranks value-limit lots")
    # IPython shows a UsageError on stderr, with no error message: the reply names it.
    assert status == "error" and "UsageError" in err and "`%ranks value-limit 50MB`" in err, err
    out, shown, error = _cell(kernel, "ranks.value_limit = -5")
    assert error is not None and "must be 0 or more bytes" in error


def test_a_function_reading_a_global_the_kernel_changed_warns_to_push_it(kernel: Kernel) -> None:
    _ok(kernel, "ranks.run('pass')")
    status, out, err, _ = kernel.run("lr = 0.5\nprint('GOT', ranks.run(uses_rate))")
    assert status == "ok", err
    assert "GOT [1.0, 1.0]" in out  # the ranks' own copy, from the fork
    assert "StaleGlobalWarning" in err and "read lr, which the kernel changed" in err
    assert "%ranks push lr" in err
    status, out, err, _ = kernel.run("%ranks push lr\nprint('GOT', ranks.run(uses_rate))")
    assert status == "ok" and "GOT [5.0, 5.0]" in out and "StaleGlobalWarning" not in err, err
    # A rank that set the name itself keeps its value, without a warning: that is its own.
    status, out, err, _ = kernel.run("%%ranks\nlr = 2.0")
    status, out, err, _ = kernel.run("lr = 0.7\nprint('GOT', ranks.run(rate))")
    assert "GOT [2.0, 2.0]" in out and "StaleGlobalWarning" not in err, err
    # A global made after the fork travels with the function once; changed later, it warns too.
    status, out, err, _ = kernel.run(
        "later = 1\ndef read_later():\n    return later\nprint('GOT', ranks.run(read_later))"
    )
    assert "GOT [1, 1]" in out and "StaleGlobalWarning" not in err, err
    status, out, err, _ = kernel.run("later = 2\nprint('GOT', ranks.run(read_later))")
    assert "GOT [1, 1]" in out and "read later, which the kernel changed" in err, err


def test_digests_and_payloads_without_ranks() -> None:
    import torch

    a = torch.zeros(1000)
    b = a.clone()
    b[999] = 1
    assert digest(a) == digest(a.clone()) != digest(b)
    assert digest(a) != digest(a.double())
    assert digest(a.reshape(10, 100)) != digest(a)
    assert digest({"w": a}) == digest({"w": a.clone()}) and digest([a]) != digest([b])
    assert digest(lambda: 0) is not None
    payload = value_payload(torch.zeros(1000), limit=100, compare=True)
    assert payload["stayed"] and payload["value"] is None and payload["size"] == 4000
    assert value_payload(7, limit=100)["value"] is not None
    assert parse_size("50MB") == 50_000_000 and parse_size("2KiB") == 2048 and parse_size(None) is None
    with pytest.raises(ValueError, match=r"value_limit='ten' is not a size; write it like '500KB'"):
        parse_size("ten")
    with pytest.raises(TypeError, match=r"value_limit=\[1\] is not a size"):
        parse_size([1])


def test_stale_fingerprints_and_message_without_ranks() -> None:
    assert fingerprint(0.1) == fingerprint(float("0.1")) and fingerprint([1]) != fingerprint([1])
    assert stale_message(len, {0: [], 1: []}) is None
    message = stale_message(len, {0: ["lr"], 1: ["lr", "cfg"]})
    assert "push what changed, %ranks push cfg lr" in message and "lr on rank(s) [0, 1]" in message
    assert global_tokens(len) == {}
