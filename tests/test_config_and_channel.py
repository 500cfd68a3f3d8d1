"""Unit tests of the live config validation and the shared-memory control channel."""

from __future__ import annotations

import threading

import pytest

from engine_host.channel import Channel, ChannelError
from engine_host.config import (
    ConfigError,
    EngineLimits,
    LiveConfig,
    RestartRequired,
    apply_patch,
    diff_configs,
)

LIMITS = EngineLimits(model="m", k_max=8, max_num_seqs=16, max_num_batched_tokens=2048, max_model_len=2048)


def test_patch_merges_subset_and_keeps_the_rest():
    cur = LiveConfig.model_validate({"speculation": {"mode": "fixed", "k": 2}, "batch": {"max_num_seqs": 8}})
    new = apply_patch(cur, {"speculation": {"k": 5}}, LIMITS)
    assert new.speculation.k == 5 and new.speculation.mode == "fixed" and new.batch.max_num_seqs == 8
    assert cur.speculation.k == 2  # unchanged
    assert diff_configs(cur.model_dump(), new.model_dump()) == [{"field": "speculation.k", "old": 2, "new": 5}]


@pytest.mark.parametrize(
    "patch,loc",
    [
        ({"speculation": {"k": 9}}, ["speculation", "k"]),
        ({"speculation": {"k": -1}}, ["speculation", "k"]),
        ({"speculation": {"mode": "adaptive", "k_min": 5, "k_max": 3}}, ["speculation"]),
        ({"speculation": {"k_max": 12}}, ["speculation", "k_max"]),
        ({"batch": {"max_num_seqs": 17}}, ["batch", "max_num_seqs"]),
        ({"batch": {"max_num_seqs": 0}}, ["batch", "max_num_seqs"]),
        ({"batch": {"max_num_batched_tokens": 4096}}, ["batch", "max_num_batched_tokens"]),
        ({"speculation": {"mode": "batch_table"}}, ["speculation"]),
        ({"speculation": {"mode": "batch_table", "table": [[2, 4, 1]]}}, ["speculation"]),
        ({"speculation": {"mode": "batch_table", "table": [[1, 4, 1], [3, 8, 2]]}}, ["speculation"]),
        ({"nope": 1}, ["nope"]),
        ({"speculation": {"k": "many"}}, ["speculation", "k"]),
    ],
)
def test_invalid_patches_name_the_field(patch, loc):
    with pytest.raises(ConfigError) as exc:
        apply_patch(LiveConfig(), patch, LIMITS)
    assert exc.value.status == 422
    assert any(list(map(str, e["loc"]))[: len(loc)] == loc for e in exc.value.errors), exc.value.errors


def test_restart_only_settings_are_409():
    with pytest.raises(RestartRequired) as exc:
        apply_patch(LiveConfig(), {"engine": {"max_num_seqs": 32}}, LIMITS)
    assert exc.value.status == 409 and "restart" in str(exc.value)
    # naming the current start-up value is fine
    apply_patch(LiveConfig(), {"engine": {"k_max": 8}}, LIMITS)
    no_spec = LIMITS.model_copy(update={"k_max": 0})
    with pytest.raises(RestartRequired):
        apply_patch(LiveConfig(), {"speculation": {"mode": "fixed", "k": 0}}, no_spec)
    apply_patch(LiveConfig(), {"speculation": {"mode": "off"}}, no_spec)


def test_channel_roundtrip_and_sequence(tmp_path):
    ch = Channel(tmp_path / "c.chan", create=True)
    assert ch.read_config() == (0, None) and ch.read_state() is None
    ch.write_config(3, {"speculation": {"k": 4}})
    seq, payload = ch.read_config()
    assert seq == 2 and payload["version"] == 3 and payload["config"]["speculation"]["k"] == 4
    other = Channel(tmp_path / "c.chan")  # a second process maps the same file
    assert other.config_seq() == 2
    other.write_state({"k_current": 4})
    assert ch.read_state() == {"k_current": 4}
    with pytest.raises(ChannelError):
        ch.write_state({"x": "y" * (9 * 1024 * 1024)})
    assert ch.read_state() == {"k_current": 4}
    with pytest.raises(ChannelError):
        Channel(tmp_path / "missing.chan")


def test_channel_readers_never_see_torn_writes(tmp_path):
    ch = Channel(tmp_path / "c.chan", create=True)
    reader = Channel(tmp_path / "c.chan")
    stop = threading.Event()
    bad = []

    def write():
        i = 0
        while not stop.is_set():
            i += 1
            ch.write_state({"i": i, "pad": "x" * (i % 5000)})

    t = threading.Thread(target=write)
    t.start()
    try:
        for _ in range(3000):
            st = reader.read_state()
            if st is not None and len(st["pad"]) != st["i"] % 5000:
                bad.append(st["i"])
    finally:
        stop.set()
        t.join()
    assert not bad
