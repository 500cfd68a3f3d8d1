"""Canary rollout across stand-in engine hosts (real config validation, real HTTP, the
real collector daemon writing the store the guards read): a failed guard rolls the
canary back and leaves the others untouched; a passing rollout brings every host to the
new version in order; a killed rollout is resumed, or rolled back, on restart."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from control import rollout
from control.apply import apply_change, reconcile
from control.collector import Collector
from control.models import Rollout
from control.rollout import RolloutError, parse_guard
from control.store import Store, add_host
from control.versions import history
from tests.support import FakeEngineHost

ROOT = Path(__file__).resolve().parent.parent
HOSTS = ("a", "b", "c")


# --------------------------------------------------------------------------- guards


def test_guards_parse_without_eval():
    g = parse_guard("ttft_p99_ms <= 1.1 * baseline")
    assert (g.figure, g.op, g.factor, g.threshold) == ("ttft_p99_ms", "<=", 1.1, None)
    assert parse_guard("output_tokens_per_s>=baseline*0.95").factor == 0.95
    assert parse_guard("acceptance_rate >= 0.5").threshold == 0.5
    assert parse_guard("k < baseline").factor == 1.0
    assert g.check(100.0, 95.0)[0] and not g.check(120.0, 100.0)[0]
    assert not g.check(None, 100.0)[0]  # no data fails
    for bad in (
        "__import__('os').system('id')",
        "ttft_p99_ms <= 1.1 * baseline or 1",
        "nope <= baseline",
        "ttft_p99_ms == baseline",
        "",
    ):
        with pytest.raises(RolloutError):
            parse_guard(bad)


# --------------------------------------------------------------------------- fleet of stand-ins


class Fleet:
    """Three stand-in hosts whose TTFT depends on their live K (K=4 is slow when ``bad``),
    fed with requests every 0.1 s, collected into the store every second."""

    def __init__(self, tmp_path: Path, bad: bool):
        self.url = f"sqlite:///{tmp_path / 'specpilot.db'}"
        self.store = Store.open(self.url)
        self.fakes = {h: FakeEngineHost(token="secret-token").start() for h in HOSTS}
        for h, f in self.fakes.items():
            add_host(self.store, h, f.url)
            reconcile(self.store, h)
        self.bad = bad
        self.stop = threading.Event()
        self.feeder = threading.Thread(target=self._feed, daemon=True)
        self.collector = Collector(self.store, interval_s=1.0, hosts_refresh_s=0.5)

    def _feed(self) -> None:
        while not self.stop.wait(0.1):
            for f in self.fakes.values():
                slow = self.bad and f.config["speculation"]["k"] == 4
                f.metrics.serve(requests=1, output_tokens=20, ttft_s=0.4 if slow else 0.05, itl_s=0.02)

    def __enter__(self) -> Fleet:
        self.feeder.start()
        self.collector.start()
        time.sleep(4)  # a few samples of every host
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.collector.stop()
        for f in self.fakes.values():
            f.stop()
        self.store.close()

    def k(self, host: str) -> int:
        return self.fakes[host].config["speculation"]["k"]


@pytest.fixture(autouse=True)
def _token(monkeypatch):
    monkeypatch.setenv("SPECPILOT_CONTROL_TOKEN", "secret-token")
    monkeypatch.delenv("SPECPILOT_METRICS_SOURCE", raising=False)


GUARDS = ["ttft_p99_ms <= 1.1 * baseline", "output_tokens_per_s >= 0.9 * baseline"]
CHANGE = {"speculation": {"mode": "fixed", "k": 4}}


def test_a_failed_guard_rolls_the_canary_back_and_leaves_the_others(tmp_path):
    with Fleet(tmp_path, bad=True) as fleet:
        puts_before = {h: len(f.puts) for h, f in fleet.fakes.items()}
        rid = rollout.create(
            fleet.store, hosts=["a", "b", "c"], canary="b", patch=CHANGE, watch_s=4, guards=GUARDS, reason="try K=4"
        )
        r = rollout.run(fleet.store, rid)
        assert r.status == rollout.ROLLED_BACK and "ttft_p99_ms" in r.message
        assert fleet.k("b") == 0  # back where it was
        assert fleet.k("a") == 0 and fleet.k("c") == 0
        assert len(fleet.fakes["a"].puts) == puts_before["a"] and len(fleet.fakes["c"].puts) == puts_before["c"]
        assert [(s["host"], s["action"], s["outcome"]) for s in r.steps] == [
            ("b", "apply", "applied"),
            ("b", "watch", "failed"),
            ("b", "rollback", "applied"),
        ]
        versions = history(fleet.store, "b")
        assert [v.source for v in versions[:2]] == ["rollback", "apply"]
        assert versions[0].rollback_of == 1 and all(v.status == "applied" for v in versions[:2])
        assert len(history(fleet.store, "a")) == 1 and len(history(fleet.store, "c")) == 1


def test_a_passing_rollout_brings_every_host_to_the_new_version_in_order(tmp_path):
    with Fleet(tmp_path, bad=False) as fleet:
        rid = rollout.create(
            fleet.store,
            hosts=["a", "b", "c"],
            canary="c",
            patch=CHANGE,
            watch_s=4,
            guards=GUARDS,
            reason="K=4 everywhere",
        )
        r = rollout.run(fleet.store, rid)
        assert r.status == rollout.SUCCEEDED, r.message
        assert [fleet.k(h) for h in HOSTS] == [4, 4, 4]
        applies = [s for s in r.steps if s["action"] == "apply"]
        assert [s["host"] for s in applies] == ["c", "a", "b"]
        assert all(s["outcome"] == "applied" and s["version"] == 2 for s in applies)
        applied_at = {h: history(fleet.store, h)[0].finished_at for h in HOSTS}
        assert applied_at["c"] < applied_at["a"] < applied_at["b"]
        watch = next(s for s in r.steps if s["action"] == "watch")
        assert watch["outcome"] == "passed" and watch["canary"]["ttft_p99_ms"] is not None


def test_bad_rollouts_are_refused_before_anything_changes(tmp_path):
    store = Store.open(f"sqlite:///{tmp_path / 'specpilot.db'}")
    with FakeEngineHost(token="secret-token") as f:
        add_host(store, "a", f.url)
        for kwargs, match in (
            ({"canary": "z"}, "not one of the hosts"),
            ({"guards": ["x <= 1"]}, "unknown figure"),
            ({"watch_s": 0}, "at least 1 s"),
            ({"patch": {"speculation": {"k": -1}}}, "invalid"),
            ({"baseline": "others"}, "baseline"),
        ):
            args = {
                "hosts": ["a"],
                "canary": "a",
                "patch": CHANGE,
                "watch_s": 5,
                "guards": GUARDS,
                "reason": "r",
                **kwargs,
            }
            with pytest.raises(RolloutError, match=match):
                rollout.create(store, **args)
        assert f.puts == [] and rollout.list_rollouts(store) == []
    store.close()


def _cli(fleet: Fleet, *args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SPECPILOT_CONTROL_TOKEN": "secret-token"}
    return subprocess.Popen(
        [sys.executable, "-m", "control", "--db", fleet.url, "config", "rollout", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def _wait_phase(store: Store, phase: str, timeout_s: float = 60.0) -> Rollout:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        rows = rollout.list_rollouts(store)
        if rows and rows[0].phase == phase:
            return rows[0]
        time.sleep(0.1)
    pytest.fail(f"no rollout reached phase {phase} in {timeout_s:.0f} s")


def test_a_rollout_killed_in_its_watch_is_resumed_on_restart(tmp_path):
    with Fleet(tmp_path, bad=False) as fleet:
        proc = _cli(
            fleet,
            "--hosts",
            "a,b,c",
            "--canary",
            "a",
            "--watch",
            "5",
            "--guard",
            GUARDS[0],
            "--guard",
            GUARDS[1],
            "--k",
            "4",
            "--mode",
            "fixed",
            "--reason",
            "K=4, killed midway",
        )
        try:
            _wait_phase(fleet.store, "watch")
            time.sleep(1.0)
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        r = rollout.list_rollouts(fleet.store)[0]
        assert r.status == rollout.RUNNING and fleet.k("a") == 4 and fleet.k("b") == 0
        with pytest.raises(RolloutError, match="another process"):  # not yet abandoned: no double runner
            rollout.run(fleet.store, r.id)
        time.sleep(rollout.STALE_S)
        out = subprocess.run(
            [sys.executable, "-m", "control", "--db", fleet.url, "config", "rollout", "--resume"],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stdout + out.stderr
        assert "resumed its watch" in out.stdout
        r = rollout.get(fleet.store, r.id)
        assert r.status == rollout.SUCCEEDED
        assert [fleet.k(h) for h in HOSTS] == [4, 4, 4]
        assert [s["host"] for s in r.steps if s["action"] == "apply"] == ["a", "b", "c"]


def test_a_rollout_killed_while_changing_the_canary_is_rolled_back_on_restart(tmp_path):
    with Fleet(tmp_path, bad=False) as fleet:
        rid = rollout.create(
            fleet.store, hosts=["a", "b"], canary="a", patch=CHANGE, watch_s=5, guards=GUARDS, reason="died mid-apply"
        )
        # what a process killed just after its PUT leaves behind: the canary changed, phase still "canary"
        with fleet.store.writer() as s:
            row = s.get(Rollout, rid)
            row.canary_base_version, row.owner, row.heartbeat_at = 1, "dead", time.time() - 60
        assert apply_change(fleet.store, "a", CHANGE, reason="rollout apply").ok
        done = rollout.resume(fleet.store)
        assert len(done) == 1 and done[0][1].startswith("rolled back")
        r = done[0][0]
        assert r.status == rollout.ROLLED_BACK and fleet.k("a") == 0 and fleet.k("b") == 0
        assert history(fleet.store, "a")[0].rollback_of == 1


def test_the_dashboard_starts_a_rollout_for_operators_only_and_shows_its_status(tmp_path, monkeypatch):
    from control.auth import User, add_user

    monkeypatch.setenv("SPECPILOT_USERS_FILE", str(tmp_path / "users.toml"))
    add_user("olga", "operator", "operator-password")
    from control.views import common
    from control.views import fleet as fleet_views

    with Fleet(tmp_path, bad=False) as fleet:
        args = dict(hosts=["a", "b"], canary="a", patch=CHANGE, watch_s=3, guards=GUARDS, reason="from the dashboard")
        with pytest.raises(common.PermissionDenied):
            fleet_views.start_rollout(fleet.store, User("vera", "viewer"), **args)
        with pytest.raises(common.ViewError, match="not a guard"):
            fleet_views.start_rollout(fleet.store, User("olga", "operator"), **{**args, "guards": ["ttft_p99_ms ~ 3"]})
        assert fleet_views.rollouts_frame(fleet.store).empty
        rid = fleet_views.start_rollout(fleet.store, User("olga", "operator"), **args)
        deadline = time.monotonic() + 60
        while rollout.get(fleet.store, rid).status == rollout.RUNNING and time.monotonic() < deadline:
            time.sleep(0.2)
        df = fleet_views.rollouts_frame(fleet.store)
        assert df.iloc[0]["id"] == rid and df.iloc[0]["status"] == "succeeded"
        assert history(fleet.store, "b")[0].author == "olga"
