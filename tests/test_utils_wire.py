"""The helpers every wire shares (``utils/_wire.py``): exact reads and pickling by value for the other side."""

from __future__ import annotations

import pickle
import socket
import threading

import pytest

from notebook_accel.launch.procs import by_value
from notebook_accel.launch.worker import WorkerSpec
from notebook_accel.nodes.channel import Channel, ChannelError
from notebook_accel.utils._wire import ConnectionClosed, dumps_by_value, read_exactly


def test_read_exactly_gathers_a_message_sent_in_pieces() -> None:
    a, b = socket.socketpair()
    with a, b:
        data = bytes(range(256)) * 5000  # over one recv's chunk, and sent in odd pieces

        def writer() -> None:
            for i in range(0, len(data), 777):
                a.sendall(data[i : i + 777])

        thread = threading.Thread(target=writer)
        thread.start()
        assert read_exactly(b, len(data)) == data
        thread.join()


def test_read_exactly_says_how_much_came_before_the_peer_closed() -> None:
    a, b = socket.socketpair()
    with b:
        a.sendall(b"abc")
        a.close()
        with pytest.raises(ConnectionClosed, match="the connection closed after 3 of 10 bytes") as caught:
            read_exactly(b, 10)
    assert (caught.value.got, caught.value.wanted) == (3, 10)
    assert isinstance(caught.value, ConnectionError)


def test_the_nodes_channel_reports_a_short_read_as_its_own_error() -> None:
    kernel, agent = socket.socketpair()
    channel = Channel(kernel, send_key=b"k" * 32, recv_key=b"a" * 32)
    agent.sendall(b"\x00\x00")  # half a frame header, then the agent is gone
    agent.close()
    # The channel reads a frame's header and signature together (4 + 32 bytes).
    with pytest.raises(ChannelError, match=r"receiving failed: the connection closed after 2 of 36 bytes"):
        channel.recv()
    assert channel.closed


def test_dumps_by_value_pickles_main_functions_by_value() -> None:
    def double(x: int) -> int:
        return 2 * x

    assert pickle.loads(dumps_by_value(double, what="f", to="the ranks", fix="-"))(4) == 8


def test_an_unpicklable_value_names_what_where_why_and_the_fix() -> None:
    lock = threading.Lock()
    match = r"the lock cannot be pickled to send to the ranks \(TypeError: cannot pickle '_thread.lock' object\); push plain data"
    with pytest.raises(TypeError, match=match) as caught:
        dumps_by_value({"lock": lock}, what="the lock", to="the ranks", fix="push plain data")
    assert isinstance(caught.value.__cause__, TypeError)


def test_reduce_pickles_chosen_objects_its_own_way() -> None:
    class Secret:
        pass

    def as_text(obj: object):  # noqa: ANN202 - a reducer's return
        return (str, ("hidden",)) if isinstance(obj, Secret) else NotImplemented

    blob = dumps_by_value([1, Secret()], what="v", to="the kernel", fix="-", reduce=as_text)
    assert pickle.loads(blob) == [1, "hidden"]


def _spec(function, args) -> WorkerSpec:  # noqa: ANN001
    return WorkerSpec(
        rank=3,
        local_rank=3,
        env={},
        num_threads=1,
        backend="gloo",
        dry_run_port=None,
        function=function,
        args=args,
    )


def test_a_spawned_ranks_function_travels_by_value_or_the_error_names_it_and_the_rank() -> None:
    def train(x: int) -> int:
        return x

    spec = by_value(_spec(train, (1,)))
    assert spec.function is None and pickle.loads(spec.payload)[0](5) == 5
    with pytest.raises(
        TypeError, match=r"the function '.*train' and its arguments cannot be pickled to send to rank 3"
    ):
        by_value(_spec(train, (threading.Lock(),)))

