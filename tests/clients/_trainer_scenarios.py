"""transformers Trainer scenarios on the CPU, run in a fresh interpreter; prints one JSON line of results.

``main('ours')`` installs notebook_accel as accelerate first; ``main('real')`` uses the real accelerate.
"""

from __future__ import annotations

import json
import os
import tempfile
import traceback
import warnings

import torch

from tests.clients._tiny import lm_dataset, tiny_gpt2


def _args(out: str, **kwargs):
    from transformers import TrainingArguments

    base = dict(
        output_dir=out,
        use_cpu=True,
        report_to=[],
        seed=0,
        data_seed=0,
        learning_rate=1e-2,
        per_device_train_batch_size=8,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    base.update(kwargs)
    return TrainingArguments(**base)


def _trainer(out: str, model=None, **kwargs):
    from transformers import Trainer

    train = lm_dataset(32)
    return Trainer(
        model=model or tiny_gpt2(),
        args=_args(out, **kwargs),
        train_dataset=train,
        eval_dataset=lm_dataset(8, seed=1),
    )


def _weights(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _max_diff(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def loss_falls(root) -> dict:
    trainer = _trainer(tempfile.mkdtemp(dir=root), max_steps=20)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return {"first": losses[0], "last": losses[-1], "steps": trainer.state.global_step}


def accumulation(root) -> dict:
    a = _trainer(
        tempfile.mkdtemp(dir=root), max_steps=3, per_device_train_batch_size=4, gradient_accumulation_steps=2
    )
    a.train()
    b = _trainer(tempfile.mkdtemp(dir=root), max_steps=3, per_device_train_batch_size=8)
    b.train()
    moved = _max_diff(_weights(b.model), _weights(tiny_gpt2()))
    return {"max_diff": _max_diff(_weights(a.model), _weights(b.model)), "moved": moved}


def resume(root) -> dict:
    from transformers import TrainerCallback

    class CountSteps(TrainerCallback):
        def __init__(self):
            self.steps = []

        def on_step_end(self, args, state, control, **kwargs):
            self.steps.append(state.global_step)

    out = tempfile.mkdtemp(dir=root)
    straight = _trainer(tempfile.mkdtemp(dir=root), max_steps=6)
    straight.train()
    first = _trainer(out, max_steps=6, save_strategy="steps", save_steps=3)
    first.train()
    resumed = _trainer(out, max_steps=6, save_strategy="steps", save_steps=3)
    counter = CountSteps()
    resumed.add_callback(counter)
    resumed.train(resume_from_checkpoint=os.path.join(out, "checkpoint-3"))
    return {
        "global_step": resumed.state.global_step,
        "steps_run_after_resume": counter.steps,
        "max_diff_vs_straight": _max_diff(_weights(resumed.model), _weights(straight.model)),
        "checkpoint_files": sorted(os.listdir(os.path.join(out, "checkpoint-3"))),
    }


def evaluate_predict(root) -> dict:
    trainer = _trainer(tempfile.mkdtemp(dir=root), max_steps=2, per_device_eval_batch_size=4)
    trainer.train()
    metrics = trainer.evaluate()
    data = lm_dataset(8, seed=1)
    prediction = trainer.predict(data)
    with torch.no_grad():
        out = trainer.model.eval()(input_ids=torch.stack([d["input_ids"] for d in data]))
    return {
        "eval_loss": metrics["eval_loss"],
        "pred_shape": list(prediction.predictions.shape),
        "pred_max_diff": float((torch.as_tensor(prediction.predictions) - out.logits).abs().max()),
        "predict_loss": prediction.metrics["test_loss"],
    }


def auto_batch(root) -> dict:
    """Return the batch size Trainer settles on when batches above 4 raise an out-of-memory error."""
    model = tiny_gpt2()
    original = model.forward
    tried = []

    def forward(*args, **kwargs):
        size = kwargs["input_ids"].shape[0]
        tried.append(size)
        if size > 4:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")
        return original(*args, **kwargs)

    model.forward = forward
    # remove_unused_columns=False: the wrapper's (*args, **kwargs) signature would hide the real columns.
    trainer = _trainer(
        tempfile.mkdtemp(dir=root),
        model=model,
        max_steps=2,
        per_device_train_batch_size=16,
        auto_find_batch_size=True,
        remove_unused_columns=False,
    )
    trainer.train()
    return {
        "tried": sorted(set(tried), reverse=True),
        "final": trainer._train_batch_size,
        "steps": trainer.state.global_step,
    }


def main(mode: str = "ours") -> None:
    warnings.simplefilter("ignore")
    if mode == "ours":
        import notebook_accel

        notebook_accel.install_as_accelerate()
    import accelerate

    root = tempfile.mkdtemp()
    results: dict = {"accelerate": accelerate.__name__}
    for fn in (loss_falls, accumulation, resume, evaluate_predict, auto_batch):
        try:
            results[fn.__name__] = fn(root)
        except Exception:
            results[fn.__name__] = {"error": traceback.format_exc()}
    print(json.dumps(results))
