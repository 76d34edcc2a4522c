"""Per-call overhead of a hooked forward, against the plain module call, side by side with Accelerate.

1,000 small modules (``nn.Identity`` on a 1-element tensor, so the hook's own cost dominates) are
called in a loop; the overhead is (hooked - plain) / calls. Measured for:

- ``ModelHook()``: a hook that overrides nothing;
- ``no-op pre+post``: a hook whose ``pre_forward`` / ``post_forward`` return their inputs (what a
  real hook pays for the protocol);
- ``AlignDevicesHook(cpu)``: the device hook with inputs already in place, with no telemetry
  subscriber and with one (the subscriber's events cost; without one the hooks only test a flag).

Timings are CPU time of the calling thread (``time.thread_time``), minimum over interleaved rounds,
so other load on a shared machine barely moves them. Accelerate is measured by re-running this
script with ``$ACCELERATE_PYTHON`` (or ``.venv-accelerate/bin/python`` in the checkout) when it exists.

    python benchmarks/bench_hooks.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import time
import timeit

import torch
from _worker import run_script_as_accelerate
from torch import nn


def run(backend: str, n_modules: int, number: int, repeat: int) -> dict[str, float]:
    """Return {variant: overhead per hooked call in microseconds}."""
    if backend == "accelerate":
        from accelerate.hooks import AlignDevicesHook, ModelHook, add_hook_to_module, remove_hook_from_module
    else:
        from notebook_accel.hooks import (
            AlignDevicesHook,
            ModelHook,
            add_hook_to_module,
            remove_hook_from_module,
        )

    class NoOp(ModelHook):
        def pre_forward(self, module, *args, **kwargs):
            return args, kwargs

        def post_forward(self, module, output):
            return output

    torch.set_num_threads(1)
    x = torch.zeros(1)

    def hooked(factory) -> list[nn.Module]:
        modules = [nn.Identity() for _ in range(n_modules)]
        if factory is not None:
            for m in modules:
                add_hook_to_module(m, factory())
        return modules

    variants = {
        "plain call (us)": hooked(None),
        "ModelHook()": hooked(ModelHook),
        "no-op pre+post": hooked(NoOp),
        "AlignDevicesHook(cpu)": hooked(lambda: AlignDevicesHook(execution_device="cpu")),
    }
    # Interleaved rounds, minimum per variant: robust to other load on a shared machine.
    best = dict.fromkeys(variants, float("inf"))
    subscribed = float("inf")
    for _ in range(repeat):
        for name, modules in variants.items():
            best[name] = min(best[name], _time_loop(modules, x, number))
        if backend == "notebook_accel":
            from notebook_accel import telemetry

            with telemetry.subscribe(lambda event: None):
                subscribed = min(subscribed, _time_loop(variants["AlignDevicesHook(cpu)"], x, number))
    plain = best["plain call (us)"]
    out = {name: (value if name == "plain call (us)" else value - plain) for name, value in best.items()}
    if backend == "notebook_accel":
        from notebook_accel.hooks import events

        out["AlignDevicesHook(cpu), 1 subscriber"] = subscribed - plain

        def flag() -> bool:  # the test the hooks make on every call, on the module they read it from
            return events._ACTIVE

        out["telemetry flag test (us)"] = min(timeit.repeat(flag, number=100_000, repeat=5)) / 100_000 * 1e6
    for modules in variants.values():
        for m in modules:
            remove_hook_from_module(m)
    return out


def _time_loop(modules: list[nn.Module], x: torch.Tensor, number: int) -> float:
    """Return the mean time of one module call over ``number`` passes of ``modules``, in microseconds."""

    def loop() -> None:
        for m in modules:
            m(x)

    # CPU time of this thread: insensitive to being descheduled on a shared machine.
    return timeit.timeit(loop, number=number, timer=time.thread_time) / number / len(modules) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--modules", type=int, default=1000)
    parser.add_argument("--backend", choices=["notebook_accel", "accelerate"], default="notebook_accel")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    number, repeat = (3, 5) if args.quick else (5, 30)
    ours = run(args.backend, args.modules, number, repeat)
    if args.json:
        print(json.dumps(ours))
        return
    quick = ["--quick"] if args.quick else []
    theirs = run_script_as_accelerate(__file__, "--modules", str(args.modules), *quick)
    print(f"{args.modules} hooked nn.Identity modules; overhead per hooked call, microseconds")
    print(f"{'variant':40s} {'notebook_accel':>15s} {'Accelerate':>11s}")
    for name, value in ours.items():
        other = theirs.get(name)
        print(f"{name:40s} {value:15.3f} {'' if other is None else f'{other:11.3f}'}")


if __name__ == "__main__":
    main()
