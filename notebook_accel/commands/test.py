"""``accelerate test``: launch a short check script with the config file's settings."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

__all__ = ["test_command", "test_command_parser"]

SUCCESS = "Test is a success! You are ready for your distributed training!"

# The script launched: each check raises AssertionError naming what disagreed, so a failure fails the
# launch. (Kept as text, written to a temporary file: it is a user's script, not a module of ours.)
SELFTEST_SCRIPT = '''"""notebook_accel self-test: ranks, collectives, seeding and a data-parallel step agree."""

import torch

from notebook_accel import Accelerator
from notebook_accel.utils import broadcast, gather, reduce, set_seed


def main() -> None:
    """Return None after checking ranks, collectives, seeding and a data-parallel step across processes."""
    accelerator = Accelerator()
    state = accelerator.state
    n, rank = state.num_processes, state.process_index
    accelerator.print(
        f"**Initialization**\\nDistributed environment: {state.distributed_type}, {n} process(es)"
    )
    ranks = gather(torch.tensor([rank])).tolist()
    assert ranks == list(range(n)), f"gather of the ranks gave {ranks}, expected {list(range(n))}"
    total = reduce(torch.tensor(float(rank + 1)), reduction="sum").item()
    assert total == n * (n + 1) / 2, f"reduce(sum) gave {total}, expected {n * (n + 1) / 2}"
    value = broadcast(torch.tensor([float(rank)]), from_process=0).item()
    assert value == 0.0, f"broadcast from rank 0 gave {value}"
    set_seed(42)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.utils.data.TensorDataset(torch.randn(16, 4), torch.randn(16, 1))
    loader = torch.utils.data.DataLoader(data, batch_size=4)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for x, y in loader:
        loss = torch.nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    weights = gather(accelerator.unwrap_model(model).weight.detach().reshape(1, -1))
    assert torch.allclose(weights, weights[0].expand_as(weights)), (
        "the processes' weights differ after training"
    )
    accelerator.print("**Training**\\nAll processes hold the same weights.")
    accelerator.wait_for_everyone()
    # The DDP model's reducer holds the process group: release it (and the other prepared objects) while the
    # group is alive, so end_training's destroy stops gloo's threads here and not in interpreter teardown,
    # where torch can abort ("terminate called without an active exception") on a loaded machine.
    del model, optimizer, loader
    accelerator.free_memory()
    accelerator.end_training()


if __name__ == "__main__":
    main()
'''


def test_command_parser(subparsers=None):
    """Return the ``test`` parser (a subparser of ``subparsers`` when given); its ``func`` is ``test_command``."""
    description = "Run a short distributed check with the settings of a config file."
    if subparsers is not None:
        parser = subparsers.add_parser("test", description=description)
    else:
        parser = argparse.ArgumentParser("Accelerate test command", description=description)
    parser.add_argument("--config_file", "--config-file", default=None,
                        help="The config file to launch with (default: the default one).")  # fmt: skip
    parser.set_defaults(func=test_command)
    return parser


def test_command(args):
    """Return None after the check script ran under ``launch`` with ``args.config_file``; prints the verdict.

    A failing check raises ``subprocess.CalledProcessError`` (its output shows which check).
    """
    if args.config_file is not None and not os.path.isfile(args.config_file):
        raise FileNotFoundError(f"--config_file {args.config_file!r} does not exist: write one with "
                                "`notebook-accel config default --config_file PATH`.")  # fmt: skip
    cmd = [sys.executable, "-m", "notebook_accel.commands", "launch"]
    if args.config_file is not None:
        cmd += ["--config_file", args.config_file]
    with tempfile.TemporaryDirectory(prefix="notebook_accel_test_") as folder:
        script = os.path.join(folder, "test_script.py")
        with open(script, "w", encoding="utf-8") as handle:
            handle.write(SELFTEST_SCRIPT)
        result = subprocess.run([*cmd, script], env=os.environ.copy())
    if result.returncode != 0:
        raise subprocess.CalledProcessError(result.returncode, cmd)
    print(SUCCESS)


def main():
    """Return None after ``test`` for the command line in ``sys.argv``."""
    return test_command(test_command_parser().parse_args())
