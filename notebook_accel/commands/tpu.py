"""``accelerate tpu-config``: run shell commands on every worker of a TPU pod through ``gcloud``.

The pod's name and zone, and the commands, come from the options or else from the config file
(``tpu_name``, ``tpu_zone``, ``command_file``, ``commands``). The commands run in ``/usr/share`` on
every worker, after ``pip install`` of Accelerate when asked. ``--debug`` prints the ``gcloud`` command
line instead of running it (tests/test_cli_options.py holds that line to 1.15's).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess

from .config.config_args import default_config_file, load_config_from_file

__all__ = ["tpu_command_launcher", "tpu_command_parser", "tpu_ssh_command"]

_DESCRIPTION = "Run commands on every worker of a TPU pod (gcloud compute tpus tpu-vm ssh)."
# What ``pip install`` gets for ``--accelerate_version``: the newest release, the main branch, or a pin.
_INSTALL_SPEC = {"latest": "accelerate -U", "dev": "git+https://github.com/huggingface/accelerate.git"}


def tpu_command_parser(subparsers=None):
    """Return the ``tpu-config`` parser (a subparser of ``subparsers`` when given); ``func`` is the launcher."""
    if subparsers is None:
        parser = argparse.ArgumentParser("Accelerate tpu-config command", description=_DESCRIPTION)
    else:
        parser = subparsers.add_parser("tpu-config", description=_DESCRIPTION)
    where = parser.add_argument_group(
        "Config Arguments", "Which pod; the config file fills what is not given."
    )
    where.add_argument(
        "--config_file", type=str, default=None, help="Config file (default: the default one)."
    )
    where.add_argument("--tpu_name", default=None, help="Name of the TPU pod.")
    where.add_argument("--tpu_zone", default=None, help="Google Cloud zone of the pod.")
    what = parser.add_argument_group("TPU Arguments", "What runs on the workers.")
    what.add_argument("--use_alpha", action="store_true", help="Use `gcloud alpha` instead of `gcloud`.")
    what.add_argument("--command_file", default=None, help="File with one shell command per line.")
    what.add_argument("--command", action="append", nargs="+", help="Shell command(s) to run (repeatable).")
    what.add_argument("--install_accelerate", action="store_true", help="pip install Accelerate first.")
    what.add_argument("--accelerate_version", default="latest",
                      help="With --install_accelerate: 'latest', 'dev' (main branch) or a version.")  # fmt: skip
    what.add_argument("--debug", action="store_true", help="Print the gcloud command instead of running it.")
    parser.set_defaults(func=tpu_command_launcher)
    return parser


def _fill_from_config(args: argparse.Namespace) -> None:
    """Set the pod and the commands from the config file where the options left them out."""
    path = args.config_file or (default_config_file if os.path.isfile(default_config_file) else None)
    if path is None:
        return
    config = load_config_from_file(path)
    args.tpu_name = args.tpu_name or getattr(config, "tpu_name", None)
    args.tpu_zone = args.tpu_zone or getattr(config, "tpu_zone", None)
    if not args.command_file and not args.command:
        args.command_file = getattr(config, "command_file", None)
        commands = getattr(config, "commands", None)
        args.command = [list(commands)] if commands else None


def _user_commands(args: argparse.Namespace) -> list[str]:
    """Return the commands to run: the command file's lines (it wins), else every ``--command`` given."""
    if args.command_file:
        with open(args.command_file, encoding="utf-8") as handle:
            return [line.rstrip("\n") for line in handle]
    return [item for group in args.command or [] for item in group]


def tpu_ssh_command(args: argparse.Namespace) -> list[str]:
    """Return the ``gcloud ... tpu-vm ssh`` command line for ``args`` (config file already applied).

    ValueError names the missing option when there is no pod name or zone, or nothing to run.
    """
    for option in ("tpu_name", "tpu_zone"):
        if not getattr(args, option):
            raise ValueError(
                f"tpu-config needs --{option} (or `{option}` in the config file): which pod to reach."
            )
    commands = _user_commands(args)
    if not commands:
        raise ValueError(
            "tpu-config has nothing to run: pass --command '<shell command>' (repeatable) or --command_file FILE, "
            "or list `commands` in the config file."
        )
    if args.install_accelerate:
        spec = _INSTALL_SPEC.get(args.accelerate_version, f"accelerate=={args.accelerate_version}")
        commands = [f"pip install {spec}", *commands]
    remote = "; ".join(["cd /usr/share", *commands])
    head = ["gcloud", "alpha"] if args.use_alpha else ["gcloud"]
    return [*head, "compute", "tpus", "tpu-vm", "ssh", args.tpu_name, "--zone", args.tpu_zone,
            "--command", remote, "--worker", "all"]  # fmt: skip


def tpu_command_launcher(args: argparse.Namespace) -> None:
    """Return None after running the commands on the pod (``--debug``: after printing the gcloud command).

    Prints 1.15's "Successfully setup pod." after gcloud succeeded. FileNotFoundError names gcloud when it is
    not on PATH; CalledProcessError when gcloud fails.
    """
    _fill_from_config(args)
    cmd = tpu_ssh_command(args)
    if args.debug:
        print(f"Running {' '.join(cmd)}")  # the command's output, as 1.15 prints it
        return
    if shutil.which(cmd[0]) is None:
        raise FileNotFoundError(
            "tpu-config runs `gcloud`, which is not on PATH: install the Google Cloud CLI "
            "(https://cloud.google.com/sdk/docs/install) and log in, or pass --debug to print the command."
        )
    subprocess.run(cmd, check=True)  # 1.15 reports success even when gcloud fails; we raise
    print("Successfully setup pod.")
