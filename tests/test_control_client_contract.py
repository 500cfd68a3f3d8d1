"""The control client checks the engine host's answers against the contract
(``engine_host.schema``), over real HTTP to the stand-in engine host."""

from __future__ import annotations

import pytest

from control.client import EngineClient, EngineError
from engine_host.schema import ControlState
from tests.support import FakeEngineHost


def test_state_and_apply_answers_follow_the_contract():
    with FakeEngineHost() as fake, EngineClient(fake.url, fake.token) as client:
        st = client.state()
        ControlState.model_validate(st)
        assert st["speculation"]["k_next"] == st["config"]["speculation"]["k"]
        answer = client.put_config({"speculation": {"mode": "fixed", "k": 3}})
        assert answer["k_next"] == 3 and answer["config_version"] == 2
        assert client.state()["speculation"]["k_next"] == 3


def test_an_answer_off_the_contract_is_a_clear_error(monkeypatch):
    with FakeEngineHost() as fake, EngineClient(fake.url, fake.token) as client:
        good = fake._state
        monkeypatch.setattr(fake, "_state", lambda: {**good(), "speculation": {"mode": "fixed"}})
        with pytest.raises(EngineError, match="contract.*speculation"):
            client.state()
