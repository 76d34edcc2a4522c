"""The CUDA figures of ``bench_offload.py``: offloaded forward and generation against the floor, side by side.

Every figure is measured in one run, on the device named in the output:

- the *floor* of each case, measured here: ``max(GPU time with every weight resident, bytes held off the
  GPU / pinned host-to-device bandwidth)``, the bandwidth measured on this machine
  (``notebook_accel.hooks.streaming.measure_pinned_bandwidth``);
- the same case with every weight resident (no offload), with notebook_accel's offload, with
  Accelerate 1.15's (in its own interpreter: ``$ACCELERATE_PYTHON``) and with diffusers' group
  offloading (``apply_group_offloading(module, onload_device, offload_type="leaf_level",
  use_stream=True)``) where diffusers is installed;
- peak GPU memory of our offload beside its resident part plus its lookahead, and whether the
  outputs (forward) or tokens (generation) are identical to the model without offload;
- one GPU training step (bf16; fp16 with its GradScaler): the Accelerator's against a hand-written
  autocast loop, Accelerate's beside it (``bench_train_step.py``).

Cases: ``linear``: 16 x Linear(8192, 8192) bf16 (2.1 GB), every weight on the CPU (``cpu_offload``),
batch 64, one forward. ``generate``: a Llama-shaped model of 0.95 B parameters (bf16, random
weights, saved once as a safetensors checkpoint), loaded by transformers with ``device_map="auto"``
and ``max_memory={0: "1GiB", "cpu": ...}``, 8 greedy tokens; the floor is per token.

``device="cpu"`` runs the same code on the CPU with tiny sizes (``bench_offload.py --cuda-smoke``):
it checks the script, not the figures.
"""

from __future__ import annotations

import gc
import os
import statistics
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

GiB = 2**30


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device: torch.device, repeats: int) -> float:
    """Return the median seconds of ``fn()`` over ``repeats`` runs (after one warm-up), synchronised."""
    fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _peak_reset(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    _sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


def _peak_since(device: torch.device, base: int) -> int:
    return torch.cuda.max_memory_allocated(device) - base if device.type == "cuda" else 0


def _free(*objects: Any) -> None:
    del objects
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _guarded(results: dict, name: str, fn) -> None:
    """Store ``fn()``'s figures under ``name``, or the error (one variant failing keeps the others)."""
    try:
        results[name] = fn()
    except ModuleNotFoundError as exc:
        if exc.name != "diffusers":
            raise
        results[name] = {}  # not installed here: shown as not measured
    except Exception as exc:  # a benchmark variant's failure is a figure too
        results[name] = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-1500:]}


def _pool_figures(figures: dict, model: nn.Module, backend: str) -> dict:
    """Return ``figures`` with our streamer's lookahead and pool peak added, after freeing ``model``."""
    streamer = _streamer(model) if backend != "accelerate" else None
    if streamer is not None:
        figures["lookahead_mb"] = streamer.schedule.budget / 2**20
        figures["pool_peak_mb"] = streamer.schedule.peak_bytes / 2**20
    _free(model)
    return figures


def _streamer(model: nn.Module) -> Any:
    from notebook_accel.hooks.offloaded import find_align_hook

    for module in model.modules():
        hook = find_align_hook(module)
        prefetcher = getattr(hook, "_prefetcher", None)
        if prefetcher is not None and prefetcher.streamer is not None:
            return prefetcher.streamer
    return None


# -- the Linear stack --------------------------------------------------------------------------
def linear_stack(blocks: int, width: int, dtype: torch.dtype) -> nn.Sequential:
    """Return ``blocks`` x Linear(width, width) on the CPU with seeded random weights (fast to build)."""
    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(width, width, dtype=dtype) for _ in range(blocks)])
    model = model.to_empty(device="cpu").eval()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * width**-0.5)
    return model


def _linear_variant(backend: str, variant: str, model: nn.Module, device: torch.device) -> nn.Module:
    if variant == "offload" and backend == "accelerate":
        from accelerate import cpu_offload

        return cpu_offload(model, execution_device=device)
    if variant == "offload":
        from notebook_accel import cpu_offload

        return cpu_offload(model, device)
    if variant == "diffusers":
        from diffusers.hooks import apply_group_offloading

        apply_group_offloading(
            model, onload_device=device, offload_type="leaf_level", use_stream=device.type == "cuda"
        )
        return model
    return model.to(device)


def linear_figures(backend: str, device: torch.device, args: Any) -> dict:
    """Return the Linear-stack figures of ``backend`` (ours also measures the floor and the other variants)."""
    dtype = torch.bfloat16
    torch.manual_seed(1)
    x = torch.randn(args.cuda_batch, args.cuda_width, dtype=dtype).to(device)
    variants = ["offload"] if backend == "accelerate" else ["resident", "offload", "diffusers"]
    out: dict[str, Any] = {}
    for variant in variants:

        def measure(variant: str = variant) -> dict:
            model = linear_stack(args.cuda_blocks, args.cuda_width, dtype)
            nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
            base = _peak_reset(device)
            model = _linear_variant(backend, variant, model, device)
            with torch.no_grad():
                seconds = _timed(lambda: model(x), device, args.cuda_repeats)
                result = model(x).float()
            peak = _peak_since(device, base)
            figures = {"ms": seconds * 1000, "peak_mb": peak / 2**20, "bytes": nbytes,
                       "checksum": float(result.double().sum()), "output": result.cpu()}  # fmt: skip
            return _pool_figures(figures, model, backend)

        _guarded(out, variant, measure)
    return out


# -- generation ---------------------------------------------------------------------------------
def llama_config(layers: int, hidden: int, intermediate: int, vocab: int) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 128), num_key_value_heads=max(1, hidden // 512),
        max_position_embeddings=512, tie_word_embeddings=False,
    )  # fmt: skip


def save_llama(folder: str, args: Any) -> int:
    """Write a random Llama-shaped bf16 checkpoint to ``folder``; return its parameter count."""
    from transformers import LlamaForCausalLM

    config = llama_config(args.llama_layers, args.llama_hidden, args.llama_intermediate, args.llama_vocab)
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # built in bf16 directly: half the memory and time of fp32
    try:
        model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    count = sum(p.numel() for p in model.parameters())
    model.save_pretrained(folder)
    _free(model)
    return count


def _load(folder: str, device_map: Any, max_memory: dict | None = None) -> Any:
    from transformers import LlamaForCausalLM

    kwargs = {"device_map": device_map, "dtype": torch.bfloat16}
    if max_memory is not None:
        kwargs["max_memory"] = dict(max_memory)
    return LlamaForCausalLM.from_pretrained(folder, **kwargs).eval()


def _diffusers_llama(folder: str, device_map: dict, device: torch.device) -> Any:
    """Return the model with the device map's GPU entries moved there and its CPU entries group-offloaded."""
    from diffusers.hooks import apply_group_offloading

    model = _load(folder, None)
    for name, where in device_map.items():
        module = model.get_submodule(name) if name else model
        # Entries without parameters (a rotary embedding's buffers) go to the GPU: nothing to stream.
        if str(where) in ("cpu", "disk") and next(module.parameters(), None) is not None:
            apply_group_offloading(
                module, onload_device=device, offload_type="leaf_level", use_stream=device.type == "cuda"
            )
        else:
            module.to(device)
    return model


def generate_figures(backend: str, device: torch.device, folder: str, args: Any) -> dict:
    """Return the generation figures of ``backend``: seconds, tokens, device map, peak memory per variant."""
    torch.manual_seed(2)
    ids = torch.randint(0, args.llama_vocab, (1, 16)).to(device)
    gpu = 0 if device.type == "cuda" else "cpu"
    budget = (
        {gpu: args.llama_budget, "cpu": "200GiB"}
        if device.type == "cuda"
        else {"cpu": "60KB", "disk": "8GiB"}
    )
    variants = ["offload"] if backend == "accelerate" else ["resident", "offload", "diffusers"]
    out: dict[str, Any] = {}
    state: dict[str, Any] = {}
    for variant in variants:

        def measure(variant: str = variant) -> dict:
            base = _peak_reset(device)
            if variant == "resident":
                model = _load(folder, {"": gpu})
            elif variant == "offload":
                model = _load(folder, "auto", budget)
                state["device_map"] = dict(getattr(model, "hf_device_map", {"": gpu}))
            else:
                model = _diffusers_llama(folder, state["device_map"], device)
            loaded = torch.cuda.memory_allocated(device) - base if device.type == "cuda" else 0

            def generate() -> Any:
                return model.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False)

            peak_base = _peak_reset(device)
            seconds = _timed(generate, device, args.generate_repeats)
            figures = {"s": seconds, "tokens": generate()[0].tolist(), "loaded_mb": loaded / 2**20,
                       "peak_mb": _peak_since(device, peak_base) / 2**20}  # fmt: skip
            device_map = getattr(model, "hf_device_map", None)
            if device_map is not None and variant == "offload":
                figures["device_map"] = {k: str(v) for k, v in device_map.items()}
                figures["offloaded_bytes"] = _offloaded_bytes(model, device_map)
            return _pool_figures(figures, model, backend)

        _guarded(out, variant, measure)
    return out


def _offloaded_bytes(model: nn.Module, device_map: dict) -> int:
    """Return the bytes of the weights the device map keeps off the GPU (streamed at each forward)."""
    total = 0
    for name, where in device_map.items():
        if str(where) in ("cpu", "disk"):
            module = model.get_submodule(name) if name else model
            total += sum(p.numel() * p.element_size() for p in module.parameters())
    return total


def cuda_figures(backend: str, args: Any, folder: str, device: torch.device) -> dict:
    """Return every figure of ``backend`` measured on ``device`` (see the module docstring)."""
    from bench_train_step import measure_all

    out: dict[str, Any] = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
    if backend != "accelerate" and device.type == "cuda":
        from notebook_accel.hooks.streaming import measure_pinned_bandwidth

        out["pinned_bandwidth"] = measure_pinned_bandwidth(device)
    elif backend != "accelerate":
        out["pinned_bandwidth"] = 10e9  # a stand-in: the smoke run on the CPU checks the script only
    out["linear"] = linear_figures(backend, device, args)
    out["generate"] = generate_figures(backend, device, folder, args)
    steps = 50 if device.type == "cuda" else 5
    _guarded(out, "train", lambda: measure_all(backend, device.type, steps, args.train_rounds))
    return out


def _strip(figures: Any) -> Any:
    """Return ``figures`` without tensors (for JSON)."""
    if isinstance(figures, dict):
        return {k: _strip(v) for k, v in figures.items() if not isinstance(v, torch.Tensor)}
    return figures


def strip_for_json(figures: dict) -> dict:
    """Return the figures as JSON-serialisable data (outputs dropped; checksums stay)."""
    return _strip(figures)


def print_report(ours: dict, theirs: dict, args: Any) -> None:
    """Print the CUDA section: device, floors, each variant's ratio to its floor, memory, identity."""
    print(f"\n== CUDA: {ours['device']} (torch {torch.__version__}, CUDA {torch.version.cuda})")
    bandwidth = ours["pinned_bandwidth"]
    print(f"pinned host-to-device bandwidth, measured now: {bandwidth / 1e9:.1f} GB/s")
    _print_linear(ours["linear"], theirs.get("linear", {}), bandwidth, args)
    _print_generate(ours["generate"], theirs.get("generate", {}), bandwidth)
    if "train" in ours:
        from bench_train_step import print_table

        train = ours["train"]
        if "error" in train:
            print(f"training step: {train['error']}")
        else:
            print()
            print_table(train, theirs.get("train", {}), ours["device"])


def _row(name: str, figures: dict | None, ms: float | None, floor_ms: float, extra: str = "") -> None:
    """Print one variant: its milliseconds and their ratio to the floor (or why it has none)."""
    if not figures:
        print(f"  {name:36s} not measured (not installed, or no Accelerate interpreter)")
    elif "error" in figures:
        print(f"  {name:36s} failed: {figures['error'][:150]}")
    else:
        print(f"  {name:36s} {ms:10.2f} ms {ms / floor_ms:6.2f}x floor  {extra}")


def _print_linear(ours: dict, theirs: dict, bandwidth: float, args: Any) -> None:
    resident = ours.get("resident", {})
    if "error" in resident or "ms" not in resident:
        print(f"linear stack: the resident run failed: {resident.get('error')}")
        return
    nbytes = resident["bytes"]
    compute, transfer = resident["ms"] / 1000, nbytes / bandwidth
    floor = max(compute, transfer)
    print(
        f"\n{args.cuda_blocks} x Linear({args.cuda_width}, {args.cuda_width}) bf16 ({nbytes / 1e9:.2f} GB), "
        f"batch {args.cuda_batch}, one forward; floor {floor * 1000:.1f} ms = max(compute resident "
        f"{compute * 1000:.2f} ms, {nbytes / 1e9:.2f} GB / {bandwidth / 1e9:.1f} GB/s = {transfer * 1000:.1f} ms)"
    )
    expected = resident.get("output")

    def measured(figures: dict) -> tuple[float, str]:
        extra = f"peak +{figures['peak_mb']:.0f} MB; output {_same(expected, figures, resident)}"
        if "lookahead_mb" in figures:
            extra += (
                f"; lookahead {figures['lookahead_mb']:.0f} MB (pool peak {figures['pool_peak_mb']:.0f} MB)"
            )
        return figures["ms"], extra

    _print_variants(_variants(ours, theirs, "cpu_offload"), "ms", measured, floor * 1000)
    print("  goal: notebook_accel <= 1.15x floor, ahead of diffusers; peak <= resident part (0) + lookahead")


def _variants(ours: dict, theirs: dict, how: str) -> list[tuple[str, dict | None]]:
    """Return the rows of a case, in the order printed: no offload, ours, Accelerate's, diffusers'."""
    return [
        ("no offload (all resident)", ours.get("resident")),
        (f"notebook_accel {how}", ours.get("offload")),
        (f"Accelerate 1.15 {how}", theirs.get("offload")),
        ("diffusers group offload (leaf)", ours.get("diffusers")),
    ]


def _print_variants(
    variants: list[tuple[str, dict | None]],
    key: str,
    measured: Callable[[dict], tuple[float, str]],
    floor_ms: float,
) -> None:
    """Print a row per variant; ``measured(figures)`` gives the milliseconds and notes of one that has ``key``."""
    for name, figures in variants:
        ms, extra = measured(figures) if figures and key in figures else (None, "")
        _row(name, figures, ms, floor_ms, extra)


def _same(expected: Any, figures: dict, resident: dict) -> str:
    """Return how an output compares with the resident model's: identical, or the largest difference."""
    output = figures.get("output")
    if expected is not None and output is not None:
        if torch.equal(expected, output):
            return "identical"
        return f"differs (max |diff| {float((expected - output).abs().max()):.3g})"
    same = figures.get("checksum") == resident.get("checksum")
    return "identical checksum" if same else "checksum differs"


def _print_generate(ours: dict, theirs: dict, bandwidth: float) -> None:
    resident, offload = ours.get("resident", {}), ours.get("offload", {})
    if "s" not in resident or "s" not in offload:
        print(f"\ngeneration failed: {resident.get('error') or offload.get('error')}")
        return
    streamed = offload.get("offloaded_bytes", 0)
    forwards = 8  # the prompt's forward gives the first token, then one forward per token
    compute, transfer = resident["s"], forwards * streamed / bandwidth
    floor = max(compute, transfer) / 8
    device_map = offload.get("device_map", {})
    on_gpu = sum(1 for v in device_map.values() if v not in ("cpu", "disk"))
    print(
        f"\nLlama-shaped model, device_map='auto' ({on_gpu} entries on the GPU, {len(device_map) - on_gpu} off it, "
        f"{streamed / 1e9:.2f} GB streamed per forward), 8 greedy tokens; floor per token {floor * 1000:.1f} ms = "
        f"max(resident {compute / 8 * 1000:.1f} ms, {streamed / 1e9:.2f} GB / {bandwidth / 1e9:.1f} GB/s = "
        f"{transfer / 8 * 1000:.1f} ms)"
    )
    want = resident.get("tokens")

    def measured(figures: dict) -> tuple[float, str]:
        same = "same tokens" if figures.get("tokens") == want else "OTHER TOKENS"
        extra = f"loaded {figures['loaded_mb']:.0f} MB, peak +{figures['peak_mb']:.0f} MB; {same}"
        if "lookahead_mb" in figures:
            extra += f"; lookahead {figures['lookahead_mb']:.0f} MB"
        return figures["s"] / 8 * 1000, extra

    _print_variants(_variants(ours, theirs, "device_map='auto'"), "s", measured, floor * 1000)
    print("  goal: notebook_accel <= 1.25x floor per token, ahead of diffusers; same tokens")


def llama_folder(args: Any) -> str:
    """Return a folder holding the benchmark's Llama checkpoint (written once, kept in the temp folder)."""
    import tempfile

    name = f"bench-llama-{args.llama_layers}x{args.llama_hidden}x{args.llama_intermediate}x{args.llama_vocab}"
    folder = os.path.join(tempfile.gettempdir(), name)
    if not os.path.isfile(os.path.join(folder, "config.json")):
        count = save_llama(folder, args)
        print(f"(wrote a random Llama-shaped checkpoint of {count / 1e9:.2f} B parameters to {folder})")
    return folder
