"""The control plane against the real engine host (vLLM on CPU, SmolLM2-135M): apply and
rollback change the live engine, concurrent applies land in order, the collector stores
real samples and records a gap while the host is unreachable, and ``control up`` restarts
a crashed engine host with the last applied version and Ctrl-C stops its whole tree. kill -9
of ``control up`` is covered link by link: its children die with it
(``tests/test_reliability.py``), and an engine host's engine core and workers die with it
(``tests/test_draft_engine.py``, its last test).

Run these under ``flock /tmp/specpilot-engine.lock`` on shared machines."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest

from control.alerts import events
from control.apply import ConfigRefused, apply_change, reconcile, rollback
from control.collector import COLLECTOR_STALLED, Collector
from control.samples import gaps, samples
from control.store import Store, add_host, audit_events, get_host
from control.versions import history
from tests.support import TcpRelay, free_port

pytestmark = pytest.mark.engine

MODEL = "SmolLM2-135M-Instruct"
PROMPT = "Copy this list exactly, then copy it again: red apple, green pear, yellow banana, purple plum, red apple,"


@pytest.fixture
def store(tmp_path):
    s = Store.open(f"sqlite:///{tmp_path / 'specpilot.db'}")
    yield s
    s.close()


def wait_for(what: str, check, timeout_s: float = 60.0, every_s: float = 0.25):
    """Poll ``check()`` until it returns something truthy; fail with ``what`` after the deadline."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(every_s)
    pytest.fail(f"timed out after {timeout_s:.0f} s waiting for {what}")


def _load(url: str, stop: threading.Event) -> None:
    # short requests: the first one ends (a sample with an end-to-end latency) within seconds
    with httpx.Client(base_url=url, timeout=120) as c:
        while not stop.is_set():
            c.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 16, "temperature": 0})


def test_apply_and_rollback_change_the_live_engine(store, engine_host, control, restore_config, monkeypatch):
    monkeypatch.setenv("SPECPILOT_CONTROL_TOKEN", engine_host.token)
    add_host(store, "local", engine_host.url)
    assert reconcile(store, "local").imported == 1
    start = history(store, "local")[0].config

    res = apply_change(
        store,
        "local",
        {"speculation": {"mode": "fixed", "k": 4}, "batch": {"max_num_seqs": 2}},
        reason="copy-heavy traffic",
    )
    assert res.ok, res.message
    state = control.get("/control/state").json()
    assert state["config"] == res.config and state["config_version"] == res.engine_version
    assert state["batch"]["max_num_seqs"] == 2

    with pytest.raises(ConfigRefused, match="K_max"):
        apply_change(store, "local", {"speculation": {"k": 99}}, reason="too deep")
    assert [v.version for v in history(store, "local")] == [2, 1]

    back = rollback(store, "local", 1, reason="back to the start-up config")
    assert back.ok and back.version == 3
    assert control.get("/control/state").json()["config"] == start

    def operator(k: int) -> None:
        for i in range(3):
            apply_change(
                store,
                "local",
                {"speculation": {"k": k}, "batch": {"max_num_seqs": 1 + i}},
                reason=f"operator {k}, change {i}",
            )

    threads = [threading.Thread(target=operator, args=(k,)) for k in (2, 6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    versions = sorted(history(store, "local"), key=lambda v: v.version)
    assert [v.version for v in versions] == list(range(1, 10))
    assert all(v.status == "applied" for v in versions)
    engine_versions = [v.engine_version for v in versions[1:]]
    assert engine_versions == sorted(engine_versions)  # the engine received them in the recorded order
    assert control.get("/control/state").json()["config"] == versions[-1].config


def test_collector_stores_real_samples_and_records_a_gap_while_unreachable(
    store, engine_host, restore_config, monkeypatch
):
    monkeypatch.setenv("SPECPILOT_CONTROL_TOKEN", engine_host.token)
    relay = TcpRelay(engine_host.port).start()
    add_host(store, "local", relay.url)
    collector = Collector(store, interval_s=1.0, hosts_refresh_s=0.5).start()
    stop = threading.Event()
    load = threading.Thread(target=_load, args=(engine_host.url, stop))
    try:
        load.start()
        busy = wait_for(
            "samples with generated tokens",
            lambda: [
                r
                for r in samples(store, "local", 0, time.time() + 10)
                if r["output_tokens"] > 0 and r["ttft_p50_ms"] and r["e2e_p99_ms"]
            ],
        )  # a request started and one ended
        stop.set()  # the request in flight ends during the outage below (it goes to the engine, not the relay)
        r = busy[-1]
        assert r["output_tokens_per_s"] > 0 and r["itl_p50_ms"] > 0 and r["e2e_p99_ms"] >= r["ttft_p50_ms"]
        assert 0.0 <= r["kv_cache_usage"] <= 1.0 and r["running_max"] >= 0
        assert r["k"] == 0 and r["mode"] == "fixed" and r["max_num_seqs"] == 8
        assert [v.source for v in history(store, "local")] == ["import"]

        relay.cut()  # the host is unreachable from the control plane
        wait_for("an open gap", lambda: [g for g in gaps(store, "local") if g.ended_at is None], 20)
        failed = apply_change(store, "local", {"speculation": {"k": 2}}, reason="during the outage")
        assert failed.status == "failed" and "unreachable" in failed.message
        wait_for("the host_down alert", lambda: events(store, host="local", open_only=True), 20)
        n_down = len(samples(store, "local", 0, time.time() + 10))
        time.sleep(2)
        assert len(samples(store, "local", 0, time.time() + 10)) == n_down  # nothing invented while down

        relay.restore()
        wait_for("the gap to close", lambda: all(g.ended_at for g in gaps(store, "local")), 20)
        wait_for("the host_down alert to close", lambda: not events(store, host="local", open_only=True), 20)
        load.join()
        retry = apply_change(store, "local", {"speculation": {"k": 2}}, reason="retry")
        assert retry.ok
        # a starved machine may also record a stall gap while the load runs; the outage is the one
        (gap,) = [g for g in gaps(store, "local") if g.reason != COLLECTOR_STALLED]
        assert "unreachable" in gap.reason and gap.ended_at - gap.started_at >= 2
    finally:
        stop.set()
        if load.is_alive():  # a check above failed: its last request ends before the next test
            load.join(timeout=120)
        collector.stop()
        relay.cut()


def _start_up(default_model, tmp_path, port: int, *engine_args: str, dashboard_port: int | None = None, **popen_kwargs):
    """``python -m control up`` (no dashboard unless ``dashboard_port``) in its own process
    group, output piped."""
    import subprocess
    import sys

    env = {**os.environ, "SPECPILOT_HOME": str(tmp_path / "home"), "PYTHONUNBUFFERED": "1"}
    env.pop("SPECPILOT_CONTROL_TOKEN", None)
    dash = ["--dashboard-port", str(dashboard_port)] if dashboard_port else ["--no-dashboard"]
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "control",
            "--db",
            f"sqlite:///{tmp_path / 'up.db'}",
            "up",
            "--port",
            str(port),
            "--model",
            default_model,
            *dash,
            *(f"--engine-arg={a}" for a in engine_args),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
        **popen_kwargs,
    )


def _read_until(proc, marker: str) -> str:
    """Output lines up to and including the first one containing ``marker``."""
    lines: list[str] = []
    while True:
        line = proc.stdout.readline()
        assert line, "".join(lines)  # the process ended first
        lines.append(line)
        if marker in line:
            return "".join(lines)


def _kill_group(proc) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _engine_host_running(port: int) -> bool:
    """True while an engine host process for ``port`` exists (``python -m engine_host``
    or the ``engine_host.serve`` it turns into)."""
    from pathlib import Path

    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        if {b"engine_host", b"engine_host.serve"} & set(args) and str(port).encode() in args:
            return True
    return False


def test_up_stops_on_ctrl_c_during_start_up_even_with_sigint_inherited_as_ignored(default_model, tmp_path):
    """A job started in the background by a non-interactive shell inherits SIGINT as
    ignored; Ctrl-C (SIGINT to the group) must still stop the engine host it started."""
    port = free_port()
    proc = _start_up(
        default_model, tmp_path, port, "--warmup=quick", preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)
    )
    try:
        _read_until(proc, "engine host: ")  # the engine host is starting, not ready yet
        assert _engine_host_running(port)
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=60) == 0
        assert "SpecPilot: stopped" in proc.stdout.read()
        assert not _engine_host_running(port)
    finally:
        _kill_group(proc)


def _children(pid: int) -> dict[int, str]:
    """Live child processes of ``pid``: {pid: command line}."""
    from pathlib import Path

    out = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == pid and fields[0] != "Z":
                out[int(stat.parent.name)] = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, ValueError, IndexError):
            continue
    return out


def test_up_supervises_the_engine_host_restarts_it_with_the_last_version_and_stops_on_ctrl_c(
    default_model, tmp_path, monkeypatch
):
    """``control up`` with its dashboard: it prints where everything is and the token once,
    registers the engine host and collects its samples. kill -9 of the engine host: the
    dashboard and the collector keep running, host-down opens within 5 s and a gap is
    recorded, the engine host restarts and gets the last applied version back (K and
    max_num_seqs), the restart is audited, the gap closes, a registered price survives and
    a supervised restart is not drift. Ctrl-C then stops the whole tree with exit 0."""
    from control.drift import open_drift
    from control.versions import version_in_force

    port, dport = free_port(), free_port()
    db = f"sqlite:///{tmp_path / 'up.db'}"
    store = Store.open(db)
    add_host(store, "local", f"http://127.0.0.1:{port}", usd_per_hour=2.5, gpu_kind="H100")
    proc = _start_up(
        default_model, tmp_path, port, "--warmup=off", "--max-model-len=512", "--k-max=4", dashboard_port=dport
    )  # no start-up warm-up: ready as soon as vLLM serves, at the first start and at the restart
    try:
        out = _read_until(proc, "Ctrl-C stops everything")
        assert "engine host: " in out and "SpecPilot is up" in out, out
        assert f"http://127.0.0.1:{port}/v1" in out
        token = (tmp_path / "home" / "control_token").read_text().strip()
        assert token in out  # shown once, on first start
        host = get_host(store, "local")
        assert (host.usd_per_hour, host.gpu_kind) == (2.5, "H100")  # a restart of control up kept the price
        wait_for("first contact", lambda: history(store, "local"), 60)
        assert [v.source for v in history(store, "local")] == ["import"]
        wait_for("collected samples", lambda: samples(store, "local", 0, time.time() + 10), 60)
        monkeypatch.setenv("SPECPILOT_CONTROL_TOKEN", token)
        applied = apply_change(
            store,
            "local",
            {"speculation": {"mode": "fixed", "k": 3}, "batch": {"max_num_seqs": 2}},
            reason="tuned for this workload",
        )
        assert applied.ok
        wait_for("the dashboard", lambda: _get_ok(f"http://127.0.0.1:{dport}/_stcore/health"), 120)
        (engine_pid,) = [
            p for p, cmd in _children(proc.pid).items() if {"engine_host", "engine_host.serve"} & set(cmd.split())
        ]
        dashboard_pids = {p for p, cmd in _children(proc.pid).items() if "streamlit" in cmd or "dashboard" in cmd}

        os.kill(engine_pid, signal.SIGKILL)  # a crash, not a clean stop
        t_kill = time.time()
        down = wait_for(
            "host-down",
            lambda: [e for e in events(store, host="local", open_only=True) if e["rule"] == "host_down"],
            15,
            every_s=0.1,
        )
        assert down[0]["started_at"] - t_kill < 5.0 and time.time() - t_kill < 6.0
        assert proc.poll() is None and _get_ok(f"http://127.0.0.1:{dport}/_stcore/health")
        assert dashboard_pids <= set(_children(proc.pid))  # the same dashboard, still up
        assert gaps(store, "local")  # the outage is recorded
        wait_for(
            "the restart in the audit trail",
            lambda: [e for e in audit_events(store, host="local") if e.action == "engine_host.restart"],
            30,
        )
        top = wait_for(
            "the re-apply",
            lambda: [v for v in history(store, "local", limit=1) if v.source == "reapply" and v.status == "applied"],
            400,
        )[0]
        assert top.rollback_of == applied.version and "restarted" in top.reason
        assert top.config["speculation"]["k"] == 3 and top.config["batch"]["max_num_seqs"] == 2
        assert version_in_force(store, "local").version == top.version
        assert any(e.action == "engine.restart" for e in audit_events(store, host="local"))
        state = httpx.get(
            f"http://127.0.0.1:{port}/control/state", headers={"Authorization": f"Bearer {token}"}, timeout=30
        ).json()
        assert state["config"]["speculation"]["k"] == 3 and state["batch"]["max_num_seqs"] == 2
        wait_for("host-down to close", lambda: not events(store, host="local", open_only=True), 30)
        wait_for("the gap to close", lambda: all(g.ended_at for g in gaps(store, "local")), 30)
        assert open_drift(store, "local") is None  # a supervised restart is not drift

        assert len(_children(proc.pid)) == 2
        tree = _tree(proc.pid)  # engine host, its engine core and workers, dashboard
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=90) == 0
        assert "SpecPilot: stopped" in proc.stdout.read()
        wait_for("the whole tree to stop with control up", lambda: not any(_alive(p) for p in tree), 60)
        assert not _engine_host_running(port)
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
    finally:
        store.close()
        _kill_group(proc)


def _tree(pid: int) -> set[int]:
    """``pid``'s live descendants."""
    out, todo = set(), [pid]
    while todo:
        kids = set(_children(todo.pop())) - out
        out |= kids
        todo += list(kids)
    return out


def _get_ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
