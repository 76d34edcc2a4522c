"""One device, mixed precision: an Accelerator training step against a hand-written autocast loop.

The same small MLP, batch and optimizer step through both loops, one step of each in turn, so load
from other programs hits both alike; the figure is the median of per-round ratios (Accelerator /
hand-written), target <= 1.03. ``bf16``: autocast to bfloat16; ``fp16``: autocast to float16 with a
GradScaler (``accelerator.backward`` scales, ``optimizer.step`` unscales and steps through it).
On CUDA each round is timed with a synchronisation at its end only, so the figure is what a
training loop pays; on the CPU (no fp16 GradScaler figure there before torch 2.3) it is the Python
overhead of the prepared model, optimizer and scaler.

Accelerate 1.15 is measured the same way in its own interpreter (``$ACCELERATE_PYTHON``, see
benchmarks/README.md); ``bench_offload.py``'s CUDA section prints these figures too.

    python benchmarks/bench_train_step.py [--device cpu|cuda] [--steps 50] [--rounds 15] [--width 256]

On the CPU, ``--width 16`` makes the step small enough that the Python overhead is what is measured.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from _worker import add_backend_arguments, run_script_as_accelerate

WIDTH, BATCH = 256, 64


def _model(device: str, width: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, width), torch.nn.ReLU(),
        torch.nn.Linear(width, 1),
    ).to(device)  # fmt: skip


def _accelerator(backend: str, precision: str, device: str):
    if backend == "accelerate":
        from accelerate import Accelerator
        from accelerate.state import AcceleratorState
    else:
        from notebook_accel import Accelerator
        from notebook_accel.state import AcceleratorState
    AcceleratorState._reset_state(True)  # one process measures bf16, then fp16
    return Accelerator(mixed_precision=precision, cpu=device == "cpu")


def _prepared_step(acc, model, opt, x, y) -> None:
    loss = torch.nn.functional.mse_loss(model(x).float(), y)
    acc.backward(loss)
    opt.step()
    opt.zero_grad()


def _hand_step(model, opt, scaler, dtype, device, x, y) -> None:
    with torch.autocast(device_type=device, dtype=dtype):
        out = model(x)
    loss = torch.nn.functional.mse_loss(out.float(), y)
    if scaler is None:
        loss.backward()
        opt.step()
    else:
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    opt.zero_grad()


def measure(
    backend: str, precision: str, device: str, steps: int, rounds: int, width: int = WIDTH
) -> dict[str, float]:
    """Return ``{"ratio": median of per-round Accelerator/hand-written, "best ratio": best/best, "prepared ms", "hand ms"}``."""
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    acc = _accelerator(backend, precision, device)
    model = _model(device, width)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, opt = acc.prepare(model, opt)
    hand_model = _model(device, width)
    hand_opt = torch.optim.AdamW(hand_model.parameters(), lr=1e-4)
    scaler = torch.amp.GradScaler(device) if precision == "fp16" else None
    x = torch.randn(BATCH, width, device=device)
    y = torch.randn(BATCH, 1, device=device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    # CUDA: wall time (what the loop pays, GPU included); CPU: this thread's CPU time, which other
    # programs on a shared machine barely move.
    clock = time.perf_counter if device == "cuda" else time.thread_time

    def prepared() -> float:
        start = clock()
        for _ in range(steps):
            _prepared_step(acc, model, opt, x, y)
        sync()
        return clock() - start

    def hand() -> float:
        start = clock()
        for _ in range(steps):
            _hand_step(hand_model, hand_opt, scaler, dtype, device, x, y)
        sync()
        return clock() - start

    prepared(), hand()  # warm-up
    ratios, ours, theirs = [], [], []
    for r in range(rounds):
        a, b = (prepared(), hand()) if r % 2 else tuple(reversed((hand(), prepared())))
        ratios.append(a / b)
        ours.append(a / steps)
        theirs.append(b / steps)
    return {
        "ratio": statistics.median(ratios),
        "best ratio": min(ours) / min(theirs),
        "prepared ms": statistics.median(ours) * 1000,
        "hand ms": statistics.median(theirs) * 1000,
    }


def measure_all(
    backend: str, device: str, steps: int, rounds: int, width: int = WIDTH
) -> dict[str, dict[str, float]]:
    """Return :func:`measure` for bf16 and for fp16 (fp16 on the CPU only where torch has its GradScaler)."""
    out = {"bf16": measure(backend, "bf16", device, steps, rounds, width)}
    if device == "cuda" or hasattr(torch.amp, "GradScaler"):
        out["fp16"] = measure(backend, "fp16", device, steps, rounds, width)
    return out


def print_table(ours: dict, theirs: dict, device: str) -> None:
    """Print the training-step table: per precision, both step times and ratios."""
    print(f"training step on {device}: Accelerator / hand-written autocast loop (target <= 1.03x)")
    print("  (median of per-round ratios; in brackets: best round of each, divided)")
    print(f"{'precision':10s} {'hand ms':>9s} {'ours ms':>9s} {'ours':>17s} {'Accelerate':>17s}")
    for precision, mine in ours.items():
        other = theirs.get(precision)
        other_s = "" if other is None else f"{other['ratio']:7.3f}x ({other['best ratio']:.3f}x)"
        print(
            f"{precision:10s} {mine['hand ms']:9.3f} {mine['prepared ms']:9.3f} "
            f"{mine['ratio']:7.3f}x ({mine['best ratio']:.3f}x) {other_s}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu"
    )
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--width", type=int, default=WIDTH, help="hidden width of the MLP")
    add_backend_arguments(parser)
    args = parser.parse_args()
    if args.device == "cpu":
        torch.set_num_threads(1)
    ours = measure_all(args.backend, args.device, args.steps, args.rounds, args.width)
    if args.json:
        print(json.dumps(ours))
        return
    theirs = run_script_as_accelerate(
        __file__, "--device", args.device, "--steps", str(args.steps), "--rounds", str(args.rounds),
        "--width", str(args.width),
    )  # fmt: skip
    print_table(ours, theirs, args.device)


if __name__ == "__main__":
    main()
