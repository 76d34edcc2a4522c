"""``nodes.reader.ChannelReader``: one thread reads many channels, each in order, and reports each end once."""

from __future__ import annotations

import os
import pickle
import threading
import time

import pytest

from notebook_accel.nodes.channel import ChannelError, new_secret
from notebook_accel.nodes.reader import ChannelReader
from tests.test_nodes_channel import _pair


def _wait(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "not within the time given"
        time.sleep(0.01)


@pytest.fixture
def pairs():
    made = [_pair(*(2 * [new_secret()])) for _ in range(6)]
    yield made
    for kernel, agent in made:
        kernel.close()
        agent.close()


def test_one_thread_reads_every_channel_in_order_and_reports_each_end_once(pairs):
    frames: dict[int, list] = {}
    ends: list[tuple[int, Exception]] = []
    threads, fds = threading.active_count(), len(os.listdir("/proc/self/fd"))
    reader = ChannelReader(
        [(kernel, key) for key, (kernel, _) in enumerate(pairs)],
        on_frame=lambda key, body: frames.setdefault(key, []).append(pickle.loads(body)),
        on_closed=lambda key, error: ends.append((key, error)),
        name="notebook_accel-nodes-test",
    )
    try:
        assert threading.active_count() == threads + 1  # one thread, whatever the number of channels
        assert len(os.listdir("/proc/self/fd")) == fds + 2  # its selector and its wake (an eventfd)
        senders = [
            threading.Thread(target=lambda a=agent, k=key: [a.send((k, i)) for i in range(300)])
            for key, (_, agent) in enumerate(pairs)
        ]
        for sender in senders:
            sender.start()
        for sender in senders:
            sender.join(10)
        _wait(lambda: sum(map(len, frames.values())) == 6 * 300)
        assert all(frames[key] == [(key, i) for i in range(300)] for key in range(6))
        pairs[2][1].close()  # an agent goes away: reported once, the others are still read
        _wait(lambda: len(ends) == 1)
        assert ends[0][0] == 2 and isinstance(ends[0][1], ChannelError) and reader.watched() == 5
        pairs[3][1].send("after")
        _wait(lambda: frames[3][-1] == "after")
        assert len(ends) == 1
    finally:
        reader.close()
    reader.thread.join(10)
    assert not reader.thread.is_alive()
    # Both closed; so are both ends of channel 2 (the agent closed it above, the reader closed its own end).
    assert len(os.listdir("/proc/self/fd")) == fds - 2


def test_a_channel_whose_handler_raises_is_dropped_and_the_others_go_on(pairs):
    seen: list = []
    ends: list = []

    def on_frame(key, body):
        if pickle.loads(body) == "poison":
            raise ValueError(f"channel {key} sent poison")
        seen.append((key, pickle.loads(body)))

    reader = ChannelReader(
        [(kernel, key) for key, (kernel, _) in enumerate(pairs[:2])], on_frame, lambda k, e: ends.append((k, e)),
        "notebook_accel-nodes-test",
    )
    try:
        pairs[0][1].send("poison")
        pairs[0][1].send("never handled")
        _wait(lambda: ends)
        assert ends[0][0] == 0 and isinstance(ends[0][1], ValueError) and "poison" in str(ends[0][1])
        pairs[1][1].send("fine")
        _wait(lambda: (1, "fine") in seen)
        time.sleep(0.1)
        assert (0, "never handled") not in seen and reader.watched() == 1 and len(ends) == 1
    finally:
        reader.close()
        reader.thread.join(10)
