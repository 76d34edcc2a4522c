"""load_checkpoint_and_dispatch of a sharded safetensors checkpoint: notebook_accel vs Accelerate, same run.

    .venv/bin/python benchmarks/bench_loading.py [--quick] [--size-mb 1024]

Writes a GPT-like sharded safetensors checkpoint once (``$TMPDIR/na_bench_ckpt_<size>``, page cache warmed),
then in a fresh subprocess per case and implementation:

* ``cpu``: ``device_map={"": "cpu"}``; load time, throughput (checkpoint bytes / load time), peak RSS of the
  process over the checkpoint size, then the time to read every weight once (a sum over all parameters, so
  memory-mapped weights are paged in and the comparison stays fair).
* ``disk``: ``device_map="auto"`` with ``max_memory={"cpu": <a third of the checkpoint>}``, rest to disk;
  load time and the bytes written to the offload folder.

Accelerate runs from ``$ACCELERATE_PYTHON`` (or ``.venv-accelerate/bin/python`` in the checkout) when it exists.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

from _worker import ACCELERATE_PYTHON, HERE, WorkerFailed, run_worker, worker_source

_WORKER = worker_source(
    "",
    "init_empty_weights, load_checkpoint_and_dispatch",
    r"""
import json, os, resource, shutil, tempfile, time
from _models import GPT
impl, case, ckpt, n_blocks, d, vocab, ckpt_bytes = sys.argv[1:8]
n_blocks, d, vocab, ckpt_bytes = int(n_blocks), int(d), int(vocab), int(ckpt_bytes)
with init_empty_weights():
    model = GPT(n_blocks, d, vocab, tie=False)
def rss_now():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
def rss_peak():
    # VmHWM belongs to this process image; ru_maxrss would carry the parent's high-water mark across exec.
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
base = rss_now()
offload = tempfile.mkdtemp(prefix="na-bench-offload-")
t = time.perf_counter()
if case == "cpu":
    model = load_checkpoint_and_dispatch(model, ckpt, device_map={"": "cpu"})
else:
    model = load_checkpoint_and_dispatch(model, ckpt, device_map="auto", max_memory={"cpu": ckpt_bytes // 3},
                                         no_split_module_classes=["Block"], offload_folder=offload)
load = time.perf_counter() - t
peak_load = rss_peak()
written = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(offload) for f in fs if f.endswith(".dat"))
touch = None
if case == "cpu":
    t = time.perf_counter()
    total = 0.0
    with torch.no_grad():
        for p in model.parameters():
            total += float(p.float().sum()) if p.dtype != torch.float32 else float(p.sum())
    touch = time.perf_counter() - t
peak = rss_peak()
shutil.rmtree(offload, ignore_errors=True)
print("RESULT" + json.dumps({"load": load, "touch": touch, "peak_load": peak_load, "peak": peak, "base": base,
                             "written": written}))
""",
)


def _make_checkpoint(size_mb: int) -> tuple[str, int, tuple[int, int, int]]:
    import torch

    sys.path.insert(0, HERE)
    from _models import GPT
    from safetensors.torch import save_file

    from notebook_accel.utils import shard_checkpoint

    d, vocab = 1024, 8192
    per_block = 12 * d * d * 4
    n_blocks = max(2, (size_mb * 2**20 - 2 * vocab * d * 4) // per_block)
    folder = os.path.join(tempfile.gettempdir(), f"na_bench_ckpt_untied_{size_mb}")
    index_path = os.path.join(folder, "model.safetensors.index.json")
    if not os.path.exists(index_path):
        os.makedirs(folder, exist_ok=True)
        torch.manual_seed(0)
        model = GPT(n_blocks, d, vocab, tie=False)
        state = model.state_dict()
        shards, index = shard_checkpoint(
            state, max_shard_size=max(size_mb // 5, 1) * 2**20, weights_name="model.safetensors"
        )
        for name, shard in shards.items():
            save_file(
                {k: v.contiguous() for k, v in shard.items()},
                os.path.join(folder, name),
                metadata={"format": "pt"},
            )
        with open(index_path + ".tmp", "w") as f:
            json.dump(index, f)
        os.replace(index_path + ".tmp", index_path)
        del model, state, shards
    total = 0
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        if name.endswith(".safetensors"):
            total += os.path.getsize(path)
            with open(path, "rb") as f:  # warm the page cache: both sides read cached files
                while f.read(1 << 24):
                    pass
    return folder, total, (n_blocks, d, vocab)


def _run(python: str, impl: str, case: str, ckpt: str, shape: tuple[int, int, int], nbytes: int) -> dict:
    try:
        return run_worker(python, _WORKER, impl, case, ckpt, *map(str, shape), str(nbytes))
    except WorkerFailed as exc:
        stderr = exc.stderr.strip()
        return {"error": stderr.splitlines()[-1] if stderr else f"rc={exc.returncode}"}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="a 256 MB checkpoint, one run per case")
    parser.add_argument("--size-mb", type=int, default=1024, help="checkpoint size in MiB (default 1024)")
    parser.add_argument("--repeat", type=int, default=3, help="runs per case; the fastest is kept")
    args = parser.parse_args()
    size = 256 if args.quick else args.size_mb
    repeat = 1 if args.quick else args.repeat
    ckpt, nbytes, shape = _make_checkpoint(size)
    impls = [("notebook_accel", sys.executable)]
    if os.path.exists(ACCELERATE_PYTHON):
        impls.append(("accelerate", ACCELERATE_PYTHON))
    print(
        f"checkpoint: {ckpt} ({nbytes / 1e9:.2f} GB, {len([f for f in os.listdir(ckpt) if f.endswith('.safetensors')])} shards)"
    )
    results: dict[tuple[str, str], dict] = {}
    for case in ("cpu", "disk"):
        for impl, python in impls:
            runs = [_run(python, impl, case, ckpt, shape, nbytes) for _ in range(repeat)]
            good = [r for r in runs if "error" not in r]
            results[(case, impl)] = min(good, key=lambda r: r["load"]) if good else runs[0]
    gb = nbytes / 1e9
    print(
        f"{'case':<6}{'impl':<16}{'load s':>9}{'GB/s':>9}{'base MB':>9}{'load peak/ckpt':>16}{'(over base)':>12}"
        f"{'+read all s':>13}{'final peak/ckpt':>17}{'written MB':>12}"
    )
    for (case, impl), r in results.items():
        if "error" in r:
            print(f"{case:<6}{impl:<16} failed: {r['error']}")
            continue
        touch = "" if r["touch"] is None else f"{r['touch']:.2f}"
        print(
            f"{case:<6}{impl:<16}{r['load']:>9.3f}{gb / r['load']:>9.1f}{r['base'] / 2**20:>9.0f}"
            f"{r['peak_load'] / nbytes:>16.2f}{(r['peak_load'] - r['base']) / nbytes:>12.2f}{touch:>13}"
            f"{r['peak'] / nbytes:>17.2f}{r['written'] / 1e6:>12.1f}"
        )
    for case in ("cpu", "disk"):
        ours, theirs = results.get((case, "notebook_accel")), results.get((case, "accelerate"))
        if ours and theirs and "error" not in ours and "error" not in theirs:
            line = f"{case}: load {theirs['load'] / ours['load']:.1f}x faster"
            if case == "cpu":
                line += (
                    f"; load + read every weight {(theirs['load'] + theirs['touch']) / (ours['load'] + ours['touch']):.2f}x"
                    f"; peak RSS {ours['peak'] / nbytes:.2f}x vs {theirs['peak'] / nbytes:.2f}x the checkpoint"
                )
            print(line)


if __name__ == "__main__":
    main()
