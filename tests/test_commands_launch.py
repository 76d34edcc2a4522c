"""accelerate.commands.launch: the `accelerate launch` command runs a script in one process or through torchrun."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from notebook_accel.commands.launch import clean_option, launch_command, launch_command_parser
from notebook_accel.utils.config_file import write_basic_config
from notebook_accel.utils.imports import is_deepspeed_available, is_torch_xla_available
from notebook_accel.utils.network import get_free_port

SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    from notebook_accel import PartialState

    state = PartialState()
    out = {"rank": state.process_index, "world": state.num_processes, "type": state.distributed_type.value,
           "precision": os.environ.get("ACCELERATE_MIXED_PRECISION"), "argv": sys.argv[1:]}
    with open(os.path.join(sys.argv[1], f"rank_{state.process_index}.json"), "w") as f:
        json.dump(out, f)
    """
)


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "train.py"
    path.write_text(SCRIPT)
    return path


def _launch(*argv: str) -> None:
    launch_command(launch_command_parser().parse_args(list(argv)))


def _ranks(folder) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(folder.glob("rank_*.json"))]


@pytest.mark.parametrize(
    "option, expected",
    [("--num-processes", "num_processes"), ("--num_processes", "num_processes"), ("--a-b-c", "a_b_c"),
     ("-m", None), ("x-y", None)],
)  # fmt: skip
def test_clean_option_matches_accelerate(option, expected):
    assert clean_option(option) == expected


def test_options_take_dashes_or_underscores():
    parser = launch_command_parser()
    a = parser.parse_args(["--num-processes", "2", "--mixed_precision", "bf16", "s.py", "--lr", "1"])
    assert (a.num_processes, a.mixed_precision, a.training_script, a.training_script_args) == (
        2,
        "bf16",
        "s.py",
        ["--lr", "1"],
    )


def test_one_process(tmp_path, script):
    _launch("--cpu", "--mixed_precision", "bf16", str(script), str(tmp_path), "--flag")
    assert _ranks(tmp_path) == [
        {"rank": 0, "world": 1, "type": "NO", "precision": "bf16", "argv": [str(tmp_path), "--flag"]}
    ]


@pytest.mark.timeout(240)
def test_two_processes_through_torchrun_with_the_config_file(tmp_path, script):
    config = tmp_path / "config.yaml"
    write_basic_config("fp16", str(config))
    port = str(get_free_port())
    _launch("--config_file", str(config), "--cpu", "--num_processes", "2", "--main_process_port", port, str(script),
            str(tmp_path))  # fmt: skip
    got = _ranks(tmp_path)
    assert [(r["rank"], r["world"], r["type"], r["precision"]) for r in got] == [
        (0, 2, "MULTI_CPU", "fp16"),
        (1, 2, "MULTI_CPU", "fp16"),
    ]


# A stand-in for Open MPI's mpirun on one host: answers --version, then starts each rank with the
# variables Open MPI gives its ranks and waits for them all.
FAKE_MPIRUN = textwrap.dedent(
    """\
    #!/bin/sh
    if [ "$1" = "--version" ]; then echo "mpirun (Open MPI) 4.1.2"; exit 0; fi
    echo "$@" > "$(dirname "$0")/mpirun_args"
    n=$6; shift 8
    i=0; pids=""
    while [ $i -lt $n ]; do
        OMPI_COMM_WORLD_RANK=$i OMPI_COMM_WORLD_SIZE=$n OMPI_COMM_WORLD_LOCAL_RANK=$i \\
            OMPI_COMM_WORLD_LOCAL_SIZE=$n "$@" & pids="$pids $!"; i=$((i+1))
    done
    status=0; for p in $pids; do wait $p || status=1; done; exit $status
    """
)


def test_mpirun_hostfile_launches_every_rank_through_mpirun(tmp_path, monkeypatch):
    """``--mpirun_hostfile``: mpirun (found on PATH, its kind asked) gets the command and starts each rank.

    The ranks see the launch variables (``MASTER_ADDR``/``MASTER_PORT``...) and the MPI launcher's own;
    forming the process group from MPI's variables is left to the script's state, as in 1.15.
    """
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "mpirun").write_text(FAKE_MPIRUN)
    (bin_dir / "mpirun").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    rank_script = tmp_path / "rank.py"
    rank_script.write_text(
        "import json, os, sys\n"
        "rank = os.environ['OMPI_COMM_WORLD_RANK']\n"
        "keys = ('MASTER_ADDR', 'MASTER_PORT', 'ACCELERATE_USE_CPU', 'OMPI_COMM_WORLD_SIZE')\n"
        "json.dump({k: os.environ.get(k) for k in keys}, open(os.path.join(sys.argv[1], f'rank_{rank}.json'), 'w'))\n"
    )
    out = tmp_path / "out"
    out.mkdir()
    port = str(get_free_port())
    _launch("--cpu", "--num_processes", "2", "--main_process_port", port, "--mpirun_hostfile", str(tmp_path / "hosts"),
            str(rank_script), str(out))  # fmt: skip
    assert (bin_dir / "mpirun_args").read_text().split()[:9] == [
        "--hostfile",
        str(tmp_path / "hosts"),
        "--npernode",
        "2",
        "-n",
        "2",
        "--bind-to",
        "socket",
        sys.executable,
    ]
    expected = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": port,
        "ACCELERATE_USE_CPU": "True",
        "OMPI_COMM_WORLD_SIZE": "2",
    }
    assert _ranks(out) == [expected, expected]


def test_a_failing_script_raises(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("raise SystemExit(3)")
    with pytest.raises(subprocess.CalledProcessError, match="returned non-zero exit status 3"):
        _launch("--cpu", str(bad))


@pytest.mark.parametrize(
    "argv, exc, match",
    [
        (["--num_processes", "3", "--num_machines", "2"], ValueError, "must divide evenly by num_machines=2"),
        (
            ["--machine_rank", "2", "--num_machines", "2", "--num_processes", "2"],
            ValueError,
            "machine_rank=2",
        ),
        (["--use_deepspeed", "--zero_stage", "5"], ValueError, "--zero_stage 5 is not a ZeRO stage"),
    ],
)
def test_bad_options_raise(tmp_path, script, argv, exc, match):
    with pytest.raises(exc, match=match):
        _launch(*argv, str(script))


@pytest.mark.skipif(is_deepspeed_available(), reason="deepspeed is installed")
def test_deepspeed_names_what_to_install(script):
    with pytest.raises(ImportError, match="pip install deepspeed"):
        _launch("--use_deepspeed", str(script))


@pytest.mark.skipif(is_torch_xla_available(), reason="torch_xla is installed")
def test_tpu_names_what_to_install(script):
    with pytest.raises(ImportError, match="pip install torch_xla"):
        _launch("--tpu", str(script))
