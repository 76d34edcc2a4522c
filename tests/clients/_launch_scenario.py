"""transformers Trainer inside notebook_launcher with 2 CPU processes; run in a fresh interpreter, prints JSON.

``main('ours')``: install_as_accelerate() first, so the Trainer runs on notebook_accel in every rank.
``main('real')``: the Trainer uses the real accelerate; our launcher and LaunchPanel drive it.
"""

from __future__ import annotations

import json
import warnings

TRAIN_SOURCE = '''
def train_ranks():
    """Return this rank's view of a 4-step DDP Trainer run: who ran it, and the final weights."""
    import tempfile
    import torch
    import accelerate
    from transformers import Trainer, TrainingArguments
    from tests.clients._tiny import lm_dataset, tiny_gpt2

    args = TrainingArguments(
        output_dir=tempfile.mkdtemp(), use_cpu=True, report_to=[], seed=0, data_seed=0, learning_rate=1e-2,
        per_device_train_batch_size=4, max_steps=4, logging_steps=1, save_strategy="no",
        dataloader_num_workers=0,
    )
    trainer = Trainer(model=tiny_gpt2(), args=args, train_dataset=lm_dataset(32))
    trainer.train()
    flat = torch.cat([p.detach().flatten() for p in trainer.model.parameters()])
    init = torch.cat([p.detach().flatten() for p in tiny_gpt2().parameters()])
    print(f"rank {args.process_index} trained {trainer.state.global_step} steps")
    return {
        "rank": args.process_index, "world_size": args.world_size, "accelerate": accelerate.__name__,
        "distributed": str(trainer.accelerator.distributed_type), "weights": flat,
        "moved": float((flat - init).abs().max()),
    }
'''


def summarize(results: list) -> dict:
    """Return the per-rank facts and the largest weight difference between the ranks."""
    return {
        "ranks": [{k: v for k, v in r.items() if k != "weights"} for r in results],
        "rank_weight_diff": float((results[0]["weights"] - results[1]["weights"]).abs().max()),
    }


def main(mode: str = "ours") -> None:
    warnings.simplefilter("ignore")
    import notebook_accel

    if mode == "ours":
        notebook_accel.install_as_accelerate()
    namespace: dict = {}
    exec(compile(TRAIN_SOURCE, "<train>", "exec"), namespace)
    handle = notebook_accel.notebook_launcher(
        namespace["train_ranks"], num_processes=2, block=False, sinks=[]
    )
    from notebook_accel.widgets import LaunchPanel

    panel = LaunchPanel(handle)
    results = handle.result(timeout=240)
    out = summarize(results)
    out.update(
        panel_state=panel.state,
        panel_has_loss=any("'loss'" in line for line in panel.merged_lines()),
        panel_rows=[row["state"] for row in panel.rows()],
    )
    panel.close()
    print(json.dumps(out))
