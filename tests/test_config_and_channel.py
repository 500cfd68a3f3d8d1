"""Unit tests of the live config validation and the shared-memory control channel."""

from __future__ import annotations

import threading

import pytest

from engine_host.channel import ACK_APPLIED, CONFIG_BYTES, Channel, ChannelError
from engine_host.config import (
    ConfigError,
    EngineLimits,
    LiveConfig,
    RestartRequired,
    apply_patch,
    diff_configs,
    min_batched_tokens,
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


# --- one validation for every field (issue 18: items 4, 9, 10) ---------------------------


@pytest.mark.parametrize(
    "patch,loc",
    [
        ({"speculation": {"threshold": {"interval_s": float("inf")}}}, ["speculation", "threshold", "interval_s"]),
        ({"speculation": {"adaptive": {"margin": float("nan")}}}, ["speculation", "adaptive", "margin"]),
        (
            {"warmup": {"heartbeats": [{"name": "h", "interval_s": float("inf")}]}},
            ["warmup", "heartbeats", "0", "interval_s"],
        ),
        (
            {"warmup": {"heartbeats": [{"name": "h", "interval_s": 5, "idle_s": float("inf")}]}},
            ["warmup", "heartbeats", "0", "idle_s"],
        ),
        ({"speculation": {"k": "4"}}, ["speculation", "k"]),
        ({"speculation": {"k": True}}, ["speculation", "k"]),
        ({"speculation": {"k": 4.0}}, ["speculation", "k"]),
        ({"batch": {"max_num_seqs": "8"}}, ["batch", "max_num_seqs"]),
        (
            {"warmup": {"heartbeats": [{"name": "h", "interval_s": 5, "enabled": "yes"}]}},
            ["warmup", "heartbeats", "0", "enabled"],
        ),
        ({"speculation": {"mode": "batch_table", "table": [[1, 4, 50]]}}, ["speculation", "table", "0"]),
        ({"speculation": {"mode": "batch_table", "table": [[1, 4, "2"]]}}, ["speculation", "table"]),
        ({"speculation": {"threshold": {"k_high": 100}}}, ["speculation", "threshold", "k_high"]),
        (
            {"speculation": {"mode": "threshold", "threshold": {"k_low": 9, "k_high": 9}}},
            ["speculation", "threshold", "k_low"],
        ),
        ({"batch": {"max_num_batched_tokens": 1}}, ["batch", "max_num_batched_tokens"]),
        ({"batch": {"max_num_batched_tokens": 255}}, ["batch", "max_num_batched_tokens"]),
        ({"engine": {"k_max": "8"}}, ["engine", "k_max"]),
    ],
)
def test_every_field_is_strict_finite_and_bounded(patch, loc):
    with pytest.raises(ConfigError) as exc:
        apply_patch(LiveConfig(), patch, LIMITS)
    assert exc.value.status == 422
    assert any(list(map(str, e["loc"]))[: len(loc)] == loc for e in exc.value.errors), exc.value.errors


def test_json_rows_of_a_batch_table_and_the_floor_itself_are_accepted():
    new = apply_patch(LiveConfig(), {"speculation": {"mode": "batch_table", "table": [[1, 4, 8], [5, 16, 2]]}}, LIMITS)
    assert new.speculation.table == [(1, 4, 8), (5, 16, 2)]
    # floor: max_num_seqs x (1 + K_max) = 16 x 9 = 144 -> at least 256
    assert min_batched_tokens(LIMITS) == 256
    assert (
        apply_patch(LiveConfig(), {"batch": {"max_num_batched_tokens": 256}}, LIMITS).batch.max_num_batched_tokens
        == 256
    )
    big = LIMITS.model_copy(update={"max_num_seqs": 64})  # 64 x 9 = 576
    assert min_batched_tokens(big) == 576 and min_batched_tokens(big, max_num_seqs=8) == 256
    with pytest.raises(ConfigError):
        apply_patch(LiveConfig(), {"batch": {"max_num_batched_tokens": 300}}, big)
    apply_patch(LiveConfig(), {"batch": {"max_num_seqs": 8, "max_num_batched_tokens": 300}}, big)
    # never above the start-up value: an engine started with a small ceiling keeps it usable
    small = LIMITS.model_copy(update={"max_num_batched_tokens": 128})
    assert min_batched_tokens(small) == 128
    apply_patch(LiveConfig(), {"batch": {"max_num_batched_tokens": 128}}, small)


def test_default_threshold_bounds_do_not_block_an_engine_with_a_small_k_max():
    k4 = LIMITS.model_copy(update={"k_max": 4})
    apply_patch(LiveConfig(), {"speculation": {"mode": "fixed", "k": 3}}, k4)  # default k_high 8 is clamped
    # the threshold policy itself, with its default bounds (2..8): they are clamped to K_max
    cfg = apply_patch(LiveConfig(), {"speculation": {"mode": "threshold"}}, k4)
    assert cfg.speculation.mode == "threshold"
    apply_patch(LiveConfig(), {"speculation": {"mode": "threshold", "threshold": {"k_high": 4}}}, k4)
    with pytest.raises(ConfigError) as err:  # a bound the operator set above K_max is refused
        apply_patch(LiveConfig(), {"speculation": {"mode": "threshold", "threshold": {"k_high": 6}}}, k4)
    assert "k_high=6 is above K_max" in str(err.value.errors)


# --- the channel: any config that validates fits; fresh per start; command lock ----------


def _big_config() -> dict:
    hb = [{"name": f"hb{i}", "interval_s": 3600.0, "enabled": False, "prompts": ["word " * 820]} for i in range(4)]
    return LiveConfig.model_validate({"warmup": {"heartbeats": hb}}).model_dump(mode="json")


def test_a_config_over_16_kib_fits_the_channel(tmp_path):
    ch = Channel(tmp_path / "c.chan", create=True)
    cfg = _big_config()
    ch.write_config(2, cfg)
    assert ch.read_config()[1]["config"] == cfg
    ch.write_state({"config": cfg, "k_current": 0})
    assert ch.read_state()["config"] == cfg
    with pytest.raises(ChannelError):  # still bounded, with the limit named
        ch.write_config(3, {"x": "y" * (CONFIG_BYTES + 1)})


def test_each_engine_start_gets_a_fresh_channel_file(tmp_path):
    path = tmp_path / "engine-8000.chan"
    stale = Channel(path, create=True)  # what an orphaned engine core kept mapped
    stale.write_config(7, {"speculation": {"k": 7}})
    fresh = Channel(path, create=True)
    assert fresh.inode() != stale.inode()
    assert fresh.read_config() == (0, None)
    fresh.write_config(1, {"speculation": {"k": 1}})
    assert stale.read_config()[1]["version"] == 7  # the stale mapping never sees the new engine's commands
    assert not list(tmp_path.glob("*.tmp"))


def test_command_lock_excludes_the_other_side_and_ack_names_the_command(tmp_path):
    api = Channel(tmp_path / "c.chan", create=True)
    core = Channel(tmp_path / "c.chan")
    assert api.try_lock()
    assert not core.try_lock()  # the core skips this step and tries again at the next
    api.write_config(2, {"speculation": {"k": 2}})
    seq = api.config_seq()
    api.unlock()
    assert core.try_lock() and not api.try_lock()
    core.write_ack(seq, ACK_APPLIED)
    core.unlock()
    assert api.read_ack() == (seq, ACK_APPLIED)


# --- the contract: the fake's state has the real build_state's shape ----------------------


def test_fake_engine_state_has_every_key_of_the_real_state(tmp_path, monkeypatch):
    from engine_host import plugin
    from engine_host.schema import ControlState
    from tests.support import FakeEngineHost

    ch = Channel(tmp_path / "c.chan", create=True)
    limits = {
        "model": "m",
        "k_max": 8,
        "max_num_seqs": 8,
        "max_num_batched_tokens": 2048,
        "max_model_len": 1024,
        "speculative_method": "ngram",
        "draft_model": None,
    }
    ch.write_state(
        {
            "core_pid": 2,
            "core_started_at": 1.0,
            "published_at": 2.0,
            "limits": limits,
            "config_version": 1,
            "config": LiveConfig().model_dump(mode="json"),
            "k_current": 0,
            "k_next": 0,
            "caps_in_force": {"max_num_seqs": 8, "max_num_batched_tokens": 2048},
            "controller": {},
            "running": 0,
            "waiting": 0,
        }
    )
    monkeypatch.setattr(plugin.HOST, "channel", ch)
    real = ControlState.model_validate(plugin.build_state()).model_dump(mode="json")
    fake = FakeEngineHost(limits=limits)._state()

    def keys(d, prefix=""):
        out = set()
        for k, v in d.items():
            out.add(prefix + k)
            if isinstance(v, dict) and k not in ("config", "controller", "limits", "warmup", "overhead"):
                out |= keys(v, prefix + k + ".")
        return out

    assert keys(fake) == keys(real)


def test_the_hook_reads_the_config_in_has_requests_only_while_idle():
    """vLLM's engine core asks ``has_requests`` several times per step; with requests the
    scheduler hook leaves the config to ``schedule()`` (which follows), and while idle it reads
    it there, so a config published to an idle engine is still taken without traffic."""
    from engine_host.scheduler import _SpecPilotHook

    class _Base:
        busy = True

        def has_requests(self) -> bool:
            return self.busy

    class _Hook(_SpecPilotHook, _Base):
        pass

    h = object.__new__(_Hook)
    polls: list[int] = []
    h._poll_config = lambda: polls.append(1)  # type: ignore[method-assign]
    h._overhead_s = 0.0
    h._overhead_cpu_s = 0.0
    h._step_index = h._published_step = 0  # nothing ran since the last publish
    h._trace = None  # no step trace to write out while idle
    assert h.has_requests() is True
    assert polls == []
    h.busy = False
    assert h.has_requests() is False
    assert polls == [1]
