"""``State``: one rank-state vocabulary for the handle, interactive ranks and the panel, that reads as plain words."""

from __future__ import annotations

import json
import pickle

import pytest

from notebook_accel.interactive.session import RankState
from notebook_accel.launch import State
from notebook_accel.launch.ranks import RankStatus
from notebook_accel.launch.restarts import Attempt

WORDS = ["starting", "running", "idle", "succeeded", "failed", "stopped", "dead", "broken"]


def test_each_state_is_its_lowercase_word_wherever_it_is_printed_or_compared() -> None:
    assert [state.value for state in State] == WORDS
    for state, word in zip(State, WORDS):
        assert state == word and word == state and hash(state) == hash(word)
        assert str(state) == f"{state}" == format(state) == word
        assert f"{state:>10}" == f"{word:>10}"
        assert json.dumps({"state": state}) == json.dumps({"state": word})
        assert pickle.loads(pickle.dumps(state)) is state
        assert State(word) is state
    assert {State.RUNNING: "info"}.get("running") == "info"  # a plain word finds a State key


def test_statuses_hold_states_even_when_built_from_words() -> None:
    status = RankStatus(0, 42, "running", 0.0)
    assert status.state is State.RUNNING and status.state.live
    assert RankState(0, 42, "idle").state is State.IDLE and not State.IDLE.live
    assert Attempt(1, State.FAILED, 0.0, 3.0).line().startswith("attempt 1 failed at ")
    with pytest.raises(ValueError, match="'runing' is not a valid State"):
        RankStatus(0, 42, "runing", 0.0)
