"""Forward time of an offloaded model against the same model in plain memory, side by side with Accelerate.

Model: 24 blocks of Linear(2048, 2048) + ReLU (403 MB in float32), batch 16. Figures are ratios
to the plain model in the same process: the median over repeats of variant/plain for two forwards
run back to back, so they compare across machines and resist other load. Variants for notebook_accel:

- ``disk_offload``: weights memory-mapped from the offload folder and used in place (zero copy);
  the prefetcher faults the next block's pages in;
- ``disk_offload copy+prefetch``: the same, but each load copies the weights out of the mapping
  (``zero_copy=False``), with the copy of block i+1 on the prefetch thread while block i computes
  (``cpu_copies=True``: not the default on CPU, where it measures slower than copying in line);
- ``disk_offload copy, no prefetch``: the copy done in the forward's thread (what Accelerate does);
- ``dispatch half cpu / half disk``: ``dispatch_model`` with blocks 0-11 on the CPU, 12-23 on disk.

With CUDA, a second section measures the streaming offload against the floor the hardware allows,
beside Accelerate 1.15, diffusers' group offloading and no offload (``_offload_cuda.py`` says what
each figure is): a stack of 16 Linear(8192, 8192) in bf16, greedy generation of a 0.94 B Llama-shaped
model with a 1 GiB GPU budget, and a training step against a hand-written autocast loop.

Accelerate is measured by re-running this script with ``$ACCELERATE_PYTHON`` (or ``.venv-accelerate/bin/python`` in the checkout) when that interpreter exists.

    python benchmarks/bench_offload.py [--quick] [--blocks 24] [--batch 16] [--no-cuda | --cuda-only]
    python benchmarks/bench_offload.py --cuda-smoke   # the CUDA section's code on the CPU, tiny sizes
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch
from _offload_cuda import cuda_figures, llama_folder, print_report, strip_for_json
from _worker import add_backend_arguments, run_script_as_accelerate
from torch import nn


def build(blocks: int, width: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(blocks)]).eval()


def timed(model: nn.Module, x: torch.Tensor, sync) -> float:
    start = time.perf_counter()
    with torch.no_grad():
        model(x)
    sync()
    return time.perf_counter() - start


def run(backend: str, blocks: int, width: int, batch: int, repeats: int) -> dict[str, float]:
    """Return {variant: median ratio to the plain model} for ``backend``."""
    if backend == "accelerate":
        import accelerate as lib
        from accelerate.hooks import remove_hook_from_submodules
    else:
        import notebook_accel as lib
        from notebook_accel.hooks import remove_hook_from_submodules

    plain = build(blocks, width)
    x = torch.randn(batch, width)
    with torch.no_grad():
        expected = plain(x)
    tmp = tempfile.mkdtemp(prefix="bench-offload-")
    variants: dict[str, nn.Module] = {}
    variants["disk_offload"] = lib.disk_offload(build(blocks, width), os.path.join(tmp, "disk"))
    half = {str(i): ("cpu" if i < blocks // 2 else "disk") for i in range(blocks)}
    variants["dispatch half cpu / half disk"] = lib.dispatch_model(
        build(blocks, width), half, offload_dir=os.path.join(tmp, "half")
    )
    if backend == "notebook_accel":
        from notebook_accel.hooks.offloaded import find_align_hook

        def copying(model: nn.Module) -> nn.Module:
            for module in model.modules():
                hook = find_align_hook(module)
                if hook is not None:
                    hook.zero_copy = False
                    if hook._prefetcher is not None:
                        hook._prefetcher.cpu_copies = True
            return model

        variants["disk_offload copy+prefetch"] = copying(
            lib.disk_offload(build(blocks, width), os.path.join(tmp, "disk"))
        )
        variants["disk_offload copy, no prefetch"] = copying(
            lib.disk_offload(build(blocks, width), os.path.join(tmp, "disk"), prefetch=False)
        )
        variants["dispatch half, copy+prefetch"] = copying(
            lib.dispatch_model(build(blocks, width), half, offload_dir=os.path.join(tmp, "half"))
        )
    for name, model in variants.items():
        with torch.no_grad():
            if not torch.allclose(model(x), expected, atol=1e-5):
                raise RuntimeError(f"{backend} {name}: output differs from the plain model")

    def sync() -> None:
        return None

    for _ in range(2):  # warm-up: page cache, allocator, learnt order
        for model in [plain, *variants.values()]:
            timed(model, x, sync)
    out = _paired_ratios(plain, variants, x, sync, repeats)
    for model in variants.values():
        remove_hook_from_submodules(model)
    return out


def _paired_ratios(
    plain: nn.Module, variants: dict[str, nn.Module], x: torch.Tensor, sync, repeats: int
) -> dict:
    """Return the plain time (ms) and, per variant, the median of variant/plain ratios of adjacent runs.

    Each ratio compares two forwards run back to back (in alternating order), so load from other
    processes on a shared machine, which drifts over seconds, mostly cancels out.
    """
    plain_times: list[float] = []
    ratios: dict[str, list[float]] = {name: [] for name in variants}
    for i in range(repeats):
        for name, model in variants.items():
            if i % 2:
                t_variant, t_plain = timed(model, x, sync), timed(plain, x, sync)
            else:
                t_plain, t_variant = timed(plain, x, sync), timed(model, x, sync)
            plain_times.append(t_plain)
            ratios[name].append(t_variant / t_plain)
    out = {"plain (ms)": statistics.median(plain_times) * 1000}
    out.update({name: statistics.median(values) for name, values in ratios.items()})
    return out


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer blocks and repeats")
    parser.add_argument("--blocks", type=int, default=24)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    add_backend_arguments(parser)
    cuda = parser.add_argument_group("CUDA section (_offload_cuda.py)")
    cuda.add_argument("--no-cuda", action="store_true", help="skip the CUDA section")
    cuda.add_argument("--cuda-only", action="store_true", help="only the CUDA section")
    cuda.add_argument(
        "--cuda-smoke", action="store_true", help="run the CUDA section's code on the CPU, tiny sizes"
    )
    cuda.add_argument("--cuda-blocks", type=int, default=16)
    cuda.add_argument("--cuda-width", type=int, default=8192)
    cuda.add_argument("--cuda-batch", type=int, default=64)
    cuda.add_argument("--cuda-repeats", type=int, default=10)
    cuda.add_argument("--llama-layers", type=int, default=16)
    cuda.add_argument("--llama-hidden", type=int, default=2048)
    cuda.add_argument("--llama-intermediate", type=int, default=6144)
    cuda.add_argument("--llama-vocab", type=int, default=42000)
    cuda.add_argument("--llama-budget", default="1GiB", help="max_memory of GPU 0 for device_map='auto'")
    cuda.add_argument(
        "--llama-dir", default=None, help="the checkpoint folder (default: written once to /tmp)"
    )
    cuda.add_argument("--generate-repeats", type=int, default=3)
    cuda.add_argument("--train-rounds", type=int, default=10)
    args = parser.parse_args()
    if args.quick:
        args.blocks, args.repeats = 8, 5
        args.cuda_repeats, args.generate_repeats, args.train_rounds = 5, 2, 5
    if args.cuda_smoke:
        args.cuda_only = True
        args.cuda_blocks, args.cuda_width, args.cuda_batch, args.cuda_repeats = 3, 64, 4, 2
        args.llama_layers, args.llama_hidden, args.llama_intermediate, args.llama_vocab = 2, 64, 128, 128
        args.generate_repeats, args.train_rounds = 1, 2
    return args


_CUDA_SIZE_OPTIONS = ("cuda_blocks", "cuda_width", "cuda_batch", "cuda_repeats", "llama_layers", "llama_hidden",
                      "llama_intermediate", "llama_vocab", "llama_budget", "generate_repeats", "train_rounds")  # fmt: skip


def cuda_section(args: argparse.Namespace) -> None:
    """Measure and print the CUDA section (ours here, Accelerate's in its own interpreter)."""
    device = torch.device("cpu") if args.cuda_smoke else torch.device("cuda", 0)
    if args.backend == "notebook_accel":
        import notebook_accel

        notebook_accel.install_as_accelerate()  # transformers' `accelerate` is this package, in this process
    folder = args.llama_dir or llama_folder(args)
    ours = cuda_figures(args.backend, args, folder, device)
    if args.json:
        print(json.dumps(strip_for_json(ours)))
        return
    passed = [f"--{name.replace('_', '-')}={getattr(args, name)}" for name in _CUDA_SIZE_OPTIONS]
    smoke = ["--cuda-smoke"] if args.cuda_smoke else []
    theirs = run_script_as_accelerate(__file__, "--cuda-only", "--llama-dir", folder, *passed, *smoke)
    print_report(ours, theirs, args)


def main() -> None:
    args = _arguments()
    if args.threads:
        torch.set_num_threads(args.threads)
    if not args.cuda_only:
        cpu_section(args)
    if args.cuda_only or (torch.cuda.is_available() and not args.no_cuda):
        cuda_section(args)


def cpu_section(args: argparse.Namespace) -> None:
    """Measure and print the CPU section (ratios to the plain model, Accelerate beside them)."""
    ours = run(args.backend, args.blocks, args.width, args.batch, args.repeats)
    if args.json:
        print(json.dumps(ours))
        return
    extra = ["--threads", str(args.threads)] if args.threads else []
    theirs = run_script_as_accelerate(__file__, "--no-cuda", "--blocks", str(args.blocks), "--width", str(args.width),
                                      "--batch", str(args.batch), "--repeats", str(args.repeats), *extra)  # fmt: skip
    print(
        f"{args.blocks} x Linear({args.width}) + ReLU, batch {args.batch}, torch threads {torch.get_num_threads()}"
    )
    print(f"{'variant (ratio to plain)':38s} {'notebook_accel':>15s} {'Accelerate':>12s}")
    for name, value in ours.items():
        other = theirs.get(name)
        fmt = "{:15.1f}" if "(ms)" in name else "{:14.2f}x"
        other_s = "" if other is None else (f"{other:12.1f}" if "(ms)" in name else f"{other:11.2f}x")
        print(f"{name:38s} {fmt.format(value)} {other_s}")


if __name__ == "__main__":
    main()
