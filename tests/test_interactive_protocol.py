"""The kernel <-> rank wire (``interactive/protocol.py``): both sides speak it, nothing else passes.

Every message kind round-trips through a real socket; a real rank loop (in a process of its own)
answers the kernel side's commands; an unknown, misdirected or malformed message is refused with
ProtocolError, a rank of another protocol version with ProtocolVersionError; an idle rank is known
by ``protocol.IDLE_WAIT`` in its stack; and the kernel side never imports the rank loop.
"""

from __future__ import annotations

import ast
import dataclasses
import faulthandler
import os
import pickle
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import cloudpickle
import pytest

from notebook_accel.interactive import protocol
from notebook_accel.interactive.cell_output import CellSink
from notebook_accel.interactive.group import IdleRankStack, mark_idle
from notebook_accel.interactive.links import SocketLinks
from notebook_accel.interactive.protocol import (
    COMMANDS,
    MESSAGES,
    PROTOCOL_VERSION,
    REPLIES,
    Call,
    Display,
    Err,
    Exec,
    Interrupted,
    MessageReader,
    Ok,
    ProtocolError,
    ProtocolVersionError,
    Pull,
    Push,
    Ready,
    encode,
    receive,
    send,
    wait_for_command,
)
from notebook_accel.interactive.startup import accept_ranks
from notebook_accel.launch.doctor import Frame, RankStack, ThreadStack, parse_dump
from notebook_accel.utils._worker_channel import FRAME_HEADER

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[1]
INTERACTIVE = ROOT / "notebook_accel" / "interactive"
# The rank side: the entry point the launcher runs and the loop behind it. Everything else in
# interactive/ is the kernel side, or shared by both (protocol, cells, values, rank_shell, stale...).
RANK_SIDE = {"rank_entry", "rank_loop"}
KERNEL_SIDE = {"session", "group", "commands", "startup", "magics", "jobs", "display", "cell_output"}

SAMPLES = {
    "ready": Ready(rank=3, pid=4242, problem=None),
    "exec": Exec(
        seq=7, source="x = 1\nx", filename="<rank cell 1>", python="x = 1\nx", ipython=True, limit=10
    ),
    "call": Call(seq=8, blob=b"\x80\x05N.", check={"lr": "float:0.1"}, forked=True),
    "push": Push(seq=9, blob=b"\x80\x05}.", tokens={"lr": "float:0.1"}),
    "pull": Pull(seq=10, name="model"),
    "ok": Ok(seq=11, payload={"text": "1", "html": None, "value": b"\x80\x05K\x01.", "digest": None}),
    "err": Err(seq=12, exc_type="ValueError", message="bad", traceback="Traceback ...\nValueError: bad\n"),
    "interrupted": Interrupted(seq=13, traceback="Traceback ...\nKeyboardInterrupt\n"),
    "display": Display(seq=14, data={"text/plain": "<fig>"}, metadata={}),
}


def _frame_of(item: object) -> bytes:
    body = pickle.dumps(item)
    return FRAME_HEADER.pack(len(body)) + body


def _read_all(sock: socket.socket, reader: MessageReader, count: int, one_byte: bool = False) -> list:
    """Return ``count`` messages read the kernel's way (non-blocking reads fed to ``reader``)."""
    got: list = []
    deadline = time.monotonic() + 10
    while len(got) < count and time.monotonic() < deadline:
        try:
            data = sock.recv(1 if one_byte else 1 << 16, socket.MSG_DONTWAIT)
        except BlockingIOError:
            time.sleep(0.001)
            continue
        got += reader.feed(data)
    return got


def test_every_message_kind_has_a_sample_and_a_direction() -> None:
    assert set(SAMPLES) == set(MESSAGES)  # a new kind must be added here, and so round-tripped below
    assert set(MESSAGES.values()) == {Ready, *COMMANDS, *REPLIES}
    assert not set(COMMANDS) & set(REPLIES)
    for kind, cls in MESSAGES.items():
        assert cls.KIND == kind and cls.__dataclass_params__.frozen and not hasattr(SAMPLES[kind], "__dict__")


def test_commands_round_trip_from_the_kernel_side_to_the_rank_side() -> None:
    kernel, rank = socket.socketpair()
    with kernel, rank:
        for kind in ("exec", "call", "push", "pull"):
            send(kernel, SAMPLES[kind])
            assert wait_for_command(rank) == SAMPLES[kind]
        kernel.close()
        assert wait_for_command(rank) is None  # the kernel closed: the rank's loop ends


def test_replies_round_trip_from_the_rank_side_to_the_kernel_sides_incremental_reader() -> None:
    kernel, rank = socket.socketpair()
    with kernel, rank:
        kinds = ["display", "ok", "err", "interrupted"]
        rank.sendall(b"".join(encode(SAMPLES[kind]) for kind in kinds))
        # Fed a byte at a time: a message completes only with its last byte.
        assert _read_all(kernel, MessageReader(), len(kinds), one_byte=True) == [SAMPLES[k] for k in kinds]
        send(rank, SAMPLES["ready"])
        assert receive(kernel, (Ready,)) == SAMPLES["ready"]


def test_a_command_is_stamped_with_its_sequence_number_and_encoded_once_for_every_rank() -> None:
    frame = encode(dataclasses.replace(Exec(source="1", filename="<c>"), seq=41))
    kind, seq, *rest = pickle.loads(frame[FRAME_HEADER.size :])
    assert (kind, seq) == ("exec", 41)
    assert len(rest) == len(dataclasses.fields(Exec)) - 1


@pytest.mark.parametrize(
    ("item", "expected", "match"),
    [
        (("bogus", 1), REPLIES, r"unknown message type 'bogus': protocol version \d+ has ready, exec"),
        (
            ("ok", 1),
            REPLIES,
            r"a 'ok' message came with 1 field\(s\); protocol version \d+ gives it 2 \(seq, payload\)",
        ),
        (("exec", 1, "x", "<c>", None, False, None, False), REPLIES, r"'exec' message is not expected here"),
        ((1, 2, 3), REPLIES, r"not a message of the kernel<->rank protocol: \(1, 2, 3\)"),
        ("ok", REPLIES, r"not a message of the kernel<->rank protocol: 'ok'"),
    ],
)
def test_the_kernel_side_refuses_what_the_protocol_does_not_allow(item, expected, match) -> None:
    with pytest.raises(ProtocolError, match=match):
        MessageReader(expected).feed(_frame_of(item))


def test_the_rank_side_refuses_a_reply_or_an_unknown_command_instead_of_dropping_it() -> None:
    kernel, rank = socket.socketpair()
    with kernel, rank:
        send(kernel, SAMPLES["ok"])
        with pytest.raises(
            ProtocolError, match=r"'ok' message is not expected here \(expected exec, call, push, pull\)"
        ):
            wait_for_command(rank)
        kernel.sendall(_frame_of(("stop", 1)))  # no such command (closing the socket ends a rank)
        with pytest.raises(ProtocolError, match=r"unknown message type 'stop'"):
            wait_for_command(rank)


def test_a_ready_of_another_protocol_version_is_refused_naming_both_versions_and_the_fix() -> None:
    other = PROTOCOL_VERSION + 1
    # Whatever else changed in that version, the version comes first and is read first.
    item = ("ready", other, 5, 4242, None, "a field this version does not know")
    match = (
        rf"rank 5 speaks version {other} of the kernel<->rank protocol and this kernel speaks version "
        rf"{PROTOCOL_VERSION}: .*Install the same notebook_accel version where the ranks run"
    )
    with pytest.raises(ProtocolVersionError, match=match):
        MessageReader((Ready,)).feed(_frame_of(item))


def test_starting_ranks_refuses_a_rank_of_another_protocol_version(tmp_path) -> None:
    address = str(tmp_path / "ranks.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(address)
    listener.listen(4)

    def rank_of_another_version() -> None:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.connect(address)
            sock.sendall(_frame_of(("ready", PROTOCOL_VERSION + 1, 0, os.getpid(), None)))
            sock.recv(1)  # until the kernel side closes it

    thread = threading.Thread(target=rank_of_another_version, daemon=True)
    thread.start()
    handle = SimpleNamespace(num_processes=1, done=False, error=None)
    sink = CellSink(printing=False, prefix_template=None, num_processes=1)
    with (
        listener,
        pytest.raises(ProtocolVersionError, match=rf"rank 0 speaks version {PROTOCOL_VERSION + 1}"),
    ):
        accept_ranks(SocketLinks(listener), handle, sink)  # type: ignore[arg-type]
    thread.join(5)
    assert not thread.is_alive()  # its connection was closed, not left open


# ----------------------------------------------------------------------------- a real rank loop

_RANK = """
import sys
from notebook_accel.interactive.rank_entry import rank_main
rank_main(sys.argv[1])
"""


@pytest.fixture
def rank_process(tmp_path):
    """Yield (the kernel side's socket to a real rank loop, its process); the rank is one process of one."""
    address = str(tmp_path / "ranks.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(address)
    listener.listen(1)
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    proc = subprocess.Popen(
        [sys.executable, "-c", _RANK, address], env=env, stderr=subprocess.PIPE, cwd=tempfile.gettempdir()
    )
    listener.settimeout(90)
    try:
        sock = listener.accept()[0]
    finally:
        listener.close()
    try:
        yield sock, proc
    finally:
        sock.close()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stderr.close()


def test_a_real_rank_loop_and_the_kernel_side_speak_the_same_protocol(rank_process) -> None:
    sock, proc = rank_process
    ready = receive(sock, (Ready,))
    assert isinstance(ready, Ready) and (ready.rank, ready.pid, ready.problem) == (0, proc.pid, None)
    reader = MessageReader()

    def ask(command):
        send(sock, command)
        (reply,) = _read_all(sock, reader, 1)
        assert reply.seq == command.seq
        return reply

    reply = ask(Exec(seq=1, source="x = 20\nx + 1", filename="<rank cell 1>", compare=True))
    assert isinstance(reply, Ok) and pickle.loads(reply.payload["value"]) == 21 and reply.payload["digest"]
    reply = ask(Push(seq=2, blob=cloudpickle.dumps({"y": 5}), tokens={}))
    assert reply == Ok(seq=2, payload={})
    blob = cloudpickle.dumps((lambda a: a * 2, (4,), {}))
    reply = ask(Call(seq=3, blob=blob, check={}))
    assert isinstance(reply, Ok) and pickle.loads(reply.payload["value"]) == 8
    reply = ask(Pull(seq=4, name="y"))
    assert isinstance(reply, Ok) and pickle.loads(reply.payload["value"]) == 5
    reply = ask(Exec(seq=5, source="1 / 0", filename="<rank cell 2>"))
    assert isinstance(reply, Err) and reply.exc_type == "ZeroDivisionError" and "1 / 0" in reply.traceback
    reply = ask(Exec(seq=6, source="raise KeyboardInterrupt", filename="<rank cell 3>"))
    assert isinstance(reply, Interrupted) and "KeyboardInterrupt" in reply.traceback
    sock.close()  # the kernel closes: the loop ends, the rank exits cleanly
    assert proc.wait(20) == 0


def test_a_real_rank_refuses_an_unknown_command_and_ends_saying_why(rank_process) -> None:
    sock, proc = rank_process
    assert isinstance(receive(sock, (Ready,)), Ready)
    sock.sendall(_frame_of(("shutdown", 1)))
    assert proc.wait(30) != 0
    assert "ProtocolError: unknown message type 'shutdown'" in proc.stderr.read().decode()


# ----------------------------------------------------------------------------- an idle rank's stack


def _thread_stack(thread: threading.Thread) -> ThreadStack:
    with tempfile.TemporaryFile("w+") as dump:
        faulthandler.dump_traceback(dump, all_threads=True)
        dump.seek(0)
        threads = parse_dump(dump.read())
    (mine,) = [t for t in threads if int(t.ident, 16) == thread.ident]
    return mine


def _blocked_in(target) -> ThreadStack:
    """Return the stack of a thread running ``target(sock)`` while it waits to read ``sock``."""
    kernel, rank = socket.socketpair()
    thread = threading.Thread(target=target, args=(rank,), daemon=True)
    thread.start()
    time.sleep(0.2)  # blocked in its read by now
    stack = _thread_stack(thread)
    kernel.close()
    thread.join(5)
    rank.close()
    return stack


def test_a_rank_waiting_in_wait_for_command_is_idle_and_one_reading_elsewhere_is_not() -> None:
    idle = _blocked_in(wait_for_command)
    busy = _blocked_in(lambda sock: sock.recv(1))
    assert protocol.IDLE_WAIT == protocol.StackMark("notebook_accel.interactive.protocol", "wait_for_command")
    assert protocol.IDLE_WAIT.in_frames(idle.frames) and not protocol.IDLE_WAIT.in_frames(busy.frames)
    stacks = {r: RankStack(r, 100 + r, (t,), "dump") for r, t in enumerate((idle, busy))}
    marked = mark_idle(stacks)
    assert isinstance(marked[0], IdleRankStack) and marked[0].summary() == "idle, waiting for a command"
    assert not isinstance(marked[1], IdleRankStack)


def test_the_idle_wait_is_known_by_its_module_not_by_its_name_alone() -> None:
    elsewhere = (Frame("/home/u/my_loop.py", 3, "wait_for_command"),)
    here = (Frame(str(INTERACTIVE / "protocol.py"), 3, "wait_for_command"),)
    assert not protocol.IDLE_WAIT.in_frames(elsewhere) and protocol.IDLE_WAIT.in_frames(here)


# ----------------------------------------------------------------------------- the two sides' imports


def _imports(module: str) -> set[str]:
    """Return the interactive modules ``module`` imports (relative imports within the package)."""
    tree = ast.parse((INTERACTIVE / f"{module}.py").read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            found |= {node.module} if node.module else {alias.name for alias in node.names}
        elif (
            isinstance(node, ast.ImportFrom)
            and node.module
            and node.module.startswith("notebook_accel.interactive")
        ):
            found.add(node.module.rsplit(".", 1)[-1])
    return found


def test_the_kernel_side_and_the_rank_side_share_only_the_protocol_and_common_modules() -> None:
    modules = {path.stem for path in INTERACTIVE.glob("*.py")} - {"__init__"}
    assert RANK_SIDE | KERNEL_SIDE <= modules
    for module in modules - RANK_SIDE - {"startup"}:
        assert not _imports(module) & RANK_SIDE, f"{module} imports the rank loop"
    # The kernel names the rank's entry point in one place, the launch of the ranks.
    assert _imports("startup") & RANK_SIDE == {"rank_entry"}
    for module in RANK_SIDE:
        assert not _imports(module) & KERNEL_SIDE, f"{module} imports the kernel side"
        assert "protocol" in _imports(module) or module == "rank_entry"


def test_frames_that_ranks_sent_alike_are_decoded_once_per_exchange():
    from notebook_accel.interactive.group import Group, _Wait

    wait = _Wait(3, [0, 1, 2, 3])
    empty = {"text": None, "html": None, "value": None, "digest": None}
    same = protocol.encode(protocol.Ok(seq=3, payload=empty))
    other = protocol.encode(protocol.Ok(seq=3, payload={**empty, "text": "1"}))
    readers = [protocol.MessageReader() for _ in range(4)]
    first = Group._read(wait, readers[0], same)
    assert Group._read(wait, readers[1], bytes(same)) is first  # equal bytes, another object: decoded once
    assert Group._read(wait, readers[2], other)[0].payload["text"] == "1"
    # A frame cut in two is read by its own rank's reader, never served from what another rank sent.
    assert Group._read(wait, readers[3], same[:5]) == []
    assert Group._read(wait, readers[3], same[5:])[0] == first[0]
    assert same[:5] not in wait.decoded and readers[3].pending == 0
    assert Group._read(_Wait(4, [0]), protocol.MessageReader(), same) is not first  # one exchange's frames only
