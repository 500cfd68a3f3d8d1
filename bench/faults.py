"""``python -m bench faults``: fault injection into a running ``control up``.

Starts ``python -m control up`` (engine host with the default model, collector,
dashboard) on a store of its own, then, for each process and each signal, ``--repeat``
times: applies a new config version (so there is a "last config" to recover), injects
the fault, and measures

* **recovery** (s): from the fault to serving with the last config again: ``/ready``
  answers 200, the engine's config equals the store's version in force, a completion
  succeeds, and the dashboard answers (its health endpoint);
* **orphans**: processes of this run (marked by an environment variable that every
  descendant inherits) left outside the tree of the running ``control up``, counted
  ``--settle`` s after recovery;
* **versions lost / misrecorded**: every version this run recorded must still be in the
  store with its config; after recovery no version may stay ``pending``, and the
  engine's config must be the store's version in force;
* **integrity**: SQLite's ``PRAGMA integrity_check`` on the store.

Processes: ``engine-host`` (the engine host's API process), ``engine-core`` (vLLM's
``VLLM::EngineCore``), ``collector`` (``control up`` itself, which runs the collector:
after SIGKILL/SIGTERM it is started again, as an init system would), ``dashboard``,
``cli-apply`` (a ``python -m control config apply`` killed while it holds the host's
apply lease, 0-30 ms after it took it).
Signals: ``KILL``, ``TERM``, ``STOP`` (held ``--stop-s`` s, then ``CONT``).

Figures (one JSON line per case, and a summary table per process and signal) go to
``--out`` (default ``bench/results/<time>-faults/``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

from engine_host import envs

MARK = envs.FAULT_RUN
PROCESSES = ("engine-host", "engine-core", "collector", "dashboard", "cli-apply")
SIGNALS = ("KILL", "TERM", "STOP")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``python -m bench faults``."""
    p.add_argument("--repeat", type=int, default=10, help="times each process x signal case is run")
    p.add_argument("--processes", default=",".join(PROCESSES), help=f"comma-separated subset of {PROCESSES}")
    p.add_argument("--signals", default=",".join(SIGNALS), help=f"comma-separated subset of {SIGNALS}")
    p.add_argument("--stop-s", type=float, default=5.0, help="how long a SIGSTOP holds before SIGCONT (s)")
    p.add_argument("--settle", type=float, default=5.0, help="seconds after recovery before counting orphans")
    p.add_argument("--timeout", type=float, default=400.0, help="give up on a recovery after this long (s)")
    p.add_argument("--model", default=None, help="model (default: the prepared default model)")
    p.add_argument("--out", default=None, help="results folder")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--resume",
        action="store_true",
        help="keep the cases already in --out's cases.jsonl and run only the rounds still missing",
    )


# --------------------------------------------------------------------------- processes


def _ps() -> dict[int, tuple[int, str, bool]]:
    """All processes: {pid: (ppid, command line, carries this run's mark)}."""
    out = {}
    for d in Path("/proc").glob("[0-9]*"):
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            if fields[0] == "Z":
                continue
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
            try:
                marked = f"{MARK}=".encode() in (d / "environ").read_bytes()
            except OSError:
                marked = False
            out[int(d.name)] = (int(fields[1]), cmd, marked)
        except (OSError, ValueError, IndexError):
            continue
    return out


def _descendants(root: int, ps: dict[int, tuple[int, str, bool]]) -> set[int]:
    kids: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in ps.items():
        kids.setdefault(ppid, []).append(pid)
    out, todo = set(), [root]
    while todo:
        p = todo.pop()
        for c in kids.get(p, []):
            if c not in out:
                out.add(c)
                todo.append(c)
    return out


class Run:
    """One ``control up`` under test, with its store and the versions this run recorded."""

    def __init__(self, args: argparse.Namespace, out: Path):
        from engine_host.model import prepare_default_model
        from engine_host.process import free_port

        self.args, self.out = args, out
        self.model = args.model or str(prepare_default_model(quiet=True))
        self.port, self.dport = free_port(), free_port()
        self.home = out / "home"
        self.db_path = out / "faults.db"
        self.db = f"sqlite:///{self.db_path}"
        self.mark = uuid.uuid4().hex
        self.env = {**os.environ, "SPECPILOT_HOME": str(self.home), MARK: self.mark, "PYTHONUNBUFFERED": "1"}
        self.env.pop("SPECPILOT_CONTROL_TOKEN", None)
        self.up: subprocess.Popen | None = None
        self.ledger: dict[int, dict[str, Any]] = {}
        self.k = 0
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = open(out / "control-up.log", "ab")
        self.store = None

    # -------------------------------------------------------------- lifecycle

    def start_up(self) -> None:
        cmd = [
            sys.executable,
            "-m",
            "control",
            "--db",
            self.db,
            "up",
            "--port",
            str(self.port),
            "--dashboard-port",
            str(self.dport),
            "--model",
            self.model,
            "--engine-arg=--warmup=quick",
            "--engine-arg=--max-model-len=512",
            "--engine-arg=--k-max=4",
            "--engine-arg=--max-num-seqs=4",
        ]
        from control.up import die_with_parent

        self.up = subprocess.Popen(
            cmd,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=self.env,
            start_new_session=True,
            preexec_fn=die_with_parent(os.getpid()),
        )

    def token(self) -> str:
        return (self.home / "control_token").read_text().strip()

    def open_store(self):
        from control.store import Store

        if self.store is None:
            self.store = Store.open(self.db)
        return self.store

    def stop(self) -> None:
        if self.up is not None and self.up.poll() is None:
            os.killpg(self.up.pid, signal.SIGINT)
            try:
                self.up.wait(timeout=90)
            except subprocess.TimeoutExpired:
                os.killpg(self.up.pid, signal.SIGKILL)
                self.up.wait()
        for pid, (_, _, marked) in _ps().items():  # whatever is left of this run
            if marked and pid != os.getpid():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        if self.store is not None:
            self.store.close()
        self._log.close()

    # -------------------------------------------------------------- state

    def serving_with_last_config(self) -> bool:
        """Ready, config = the store's version in force, a completion works, dashboard up."""
        from control.versions import version_in_force

        try:
            if httpx.get(self.url + "/ready", timeout=2).status_code != 200:
                return False
            if httpx.get(f"http://127.0.0.1:{self.dport}/_stcore/health", timeout=2).status_code != 200:
                return False
            state = httpx.get(
                self.url + "/control/state", timeout=5, headers={"Authorization": f"Bearer {self.token()}"}
            ).json()
            v = version_in_force(self.open_store(), "local")
            if v is None or state.get("config") != v.config:
                return False
            r = httpx.post(
                self.url + "/v1/completions",
                timeout=30,
                json={"model": self._served_model(), "prompt": "Hello", "max_tokens": 2},
            )
            return r.status_code == 200
        except (httpx.HTTPError, OSError, ValueError):
            return False

    def _served_model(self) -> str:
        return httpx.get(self.url + "/v1/models", timeout=5).json()["data"][0]["id"]

    def wait_serving(self, t0: float) -> float | None:
        while time.monotonic() - t0 < self.args.timeout:
            if self.serving_with_last_config():
                return time.monotonic() - t0
            time.sleep(0.25)
        return None

    def apply_next(self) -> Any:
        """Apply the next K (1..4) in-process; record the version in the ledger."""
        from control.apply import apply_change
        from control.client import EngineClient

        self.k = self.k % 4 + 1
        with EngineClient(self.url, token=self.token(), timeout_s=30) as c:
            res = apply_change(
                self.open_store(),
                "local",
                {"speculation": {"mode": "fixed", "k": self.k}},
                reason="fault-injection run: a config to recover",
                client=c,
            )
        self.ledger[res.version] = {"config": res.config, "status": res.status}
        return res

    def versions_check(self) -> tuple[int, int]:
        """(lost, misrecorded) against the ledger and the engine."""
        from control.versions import PENDING, history, version_in_force

        store = self.open_store()
        rows = {v.version: v for v in history(store, "local")}
        lost = sum(
            1
            for n, v in self.ledger.items()
            if n not in rows
            or rows[n].config != v["config"]
            or (v["status"] == "applied" and rows[n].status != "applied")
        )
        mis = sum(1 for v in rows.values() if v.status == PENDING)
        numbers = sorted(rows)
        mis += sum(1 for a, b in zip(numbers, numbers[1:]) if b != a + 1)  # a hole in the numbering
        try:
            state = httpx.get(
                self.url + "/control/state", timeout=5, headers={"Authorization": f"Bearer {self.token()}"}
            ).json()
            if state.get("config") != version_in_force(store, "local").config:
                mis += 1
        except (httpx.HTTPError, ValueError):
            mis += 1
        return lost, mis

    def wait_for_lease_of(self, proc: subprocess.Popen, timeout_s: float = 30.0) -> bool:
        """Wait until ``proc`` holds the host's apply lease (True), or has exited (False)."""
        deadline = time.monotonic() + timeout_s
        with sqlite3.connect(self.db_path, timeout=30) as c:
            while time.monotonic() < deadline and proc.poll() is None:
                row = c.execute("SELECT apply_lock_info FROM hosts WHERE name = 'local'").fetchone()
                info = json.loads(row[0]) if row and row[0] else None  # JSON null once the lease is given back
                if isinstance(info, dict) and info.get("pid") == proc.pid:
                    return True
                time.sleep(0.002)
        return False

    def integrity(self) -> str:
        with sqlite3.connect(self.db_path, timeout=30) as c:
            return ",".join(r[0] for r in c.execute("PRAGMA integrity_check"))

    def orphans(self) -> list[str]:
        ps = _ps()
        tree = _descendants(self.up.pid, ps) | {self.up.pid} if self.up and self.up.poll() is None else set()
        return [
            f"{pid} {cmd[:80]}"
            for pid, (_, cmd, marked) in ps.items()
            if marked and pid not in tree and pid != os.getpid()
        ]

    # -------------------------------------------------------------- targets

    def target(self, process: str) -> int | None:
        ps = _ps()
        if process == "collector":
            return self.up.pid
        tree = _descendants(self.up.pid, ps)
        if process == "engine-host":
            found = [
                p
                for p in tree
                if ps[p][0] == self.up.pid and {"engine_host", "engine_host.serve"} & set(ps[p][1].split())
            ]
        elif process == "engine-core":
            found = [p for p in tree if ps[p][1].startswith("VLLM::EngineCore")]
        elif process == "dashboard":
            found = [
                p for p in tree if ps[p][0] == self.up.pid and ("streamlit" in ps[p][1] or "dashboard" in ps[p][1])
            ]
        else:
            raise ValueError(process)
        return found[0] if found else None


# --------------------------------------------------------------------------- cases


def run_case(run: Run, process: str, sig: str, rnd: random.Random) -> dict[str, Any]:
    """Inject one fault and measure what it left."""
    case: dict[str, Any] = {"process": process, "signal": sig}
    pre = run.apply_next()
    case["version_before"] = pre.version
    signum = getattr(signal, f"SIG{sig}")
    if process == "cli-apply":
        k = run.k % 4 + 1
        cli = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "control",
                "--db",
                run.db,
                "config",
                "apply",
                "--host",
                "local",
                "--k",
                str(k),
                "--mode",
                "fixed",
                "--reason",
                "fault-injection: killed apply",
            ],
            env={**run.env, "SPECPILOT_CONTROL_TOKEN": run.token()},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        case["hit_mid_apply"] = run.wait_for_lease_of(cli)  # between taking the lease and giving it back
        time.sleep(rnd.uniform(0.0, 0.03))  # state read, validation, recording, the PUT, the outcome
        t0 = time.monotonic()
        os.kill(cli.pid, signum)
        if sig == "STOP":
            time.sleep(run.args.stop_s)
            os.kill(cli.pid, signal.SIGCONT)
        try:
            cli.wait(timeout=90)
        except subprocess.TimeoutExpired:
            cli.kill()
            cli.wait()
        case["cli_exit"] = cli.returncode
        # recovery: the next apply goes through (not blocked by the killed one's lease)
        res = run.apply_next()
        case["next_apply_ok"] = res.ok
        case["recovery_s"] = round(time.monotonic() - t0, 2) if res.ok else None
    else:
        pid = run.target(process)
        if pid is None:
            case["error"] = f"no {process} process found"
            return case
        t0 = time.monotonic()
        os.kill(pid, signum)
        if sig == "STOP":
            time.sleep(run.args.stop_s)
            os.kill(pid, signal.SIGCONT)
        if process == "collector" and sig in ("KILL", "TERM"):
            try:
                run.up.wait(timeout=90)
            except subprocess.TimeoutExpired:
                case["error"] = "control up did not exit"
            run.start_up()  # started again, as an init system would
        rec = run.wait_serving(t0)
        case["recovery_s"] = round(rec, 2) if rec is not None else None
    time.sleep(run.args.settle)
    case["orphans"] = run.orphans()
    case["lost"], case["misrecorded"] = run.versions_check()
    case["integrity"] = run.integrity()
    return case


def summarise(cases: list[dict[str, Any]], startup_s: float) -> str:
    lines = [
        f"start-up to serving: {startup_s:.1f} s; target recovery <= {startup_s + 5:.1f} s",
        "process      signal  n  orphans  lost  misrec  integrity  recovery s (median / max)  over target",
    ]
    keys = sorted({(c["process"], c["signal"]) for c in cases}, key=lambda k: (PROCESSES.index(k[0]), k[1]))
    for p, s in keys:
        cs = [c for c in cases if (c["process"], c["signal"]) == (p, s)]
        rec = sorted(c["recovery_s"] for c in cs if c.get("recovery_s") is not None)
        failed = sum(1 for c in cs if c.get("recovery_s") is None)
        med = rec[len(rec) // 2] if rec else None
        over = sum(1 for r in rec if r > startup_s + 5) + failed
        integ = "ok" if all(c.get("integrity") == "ok" for c in cs) else "FAILED"
        lines.append(
            f"{p:<12} {s:<6} {len(cs):>2}  {sum(len(c.get('orphans', [])) for c in cs):>7}  "
            f"{sum(c.get('lost', 0) for c in cs):>4}  {sum(c.get('misrecorded', 0) for c in cs):>6}  "
            f"{integ:>9}  {(f'{med:.1f} / {rec[-1]:.1f}' if rec else '-'):>26}  {over:>11}"
        )
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    """Entry point of ``python -m bench faults``."""
    out = Path(args.out or f"bench/results/{time.strftime('%Y%m%d-%H%M%S')}-faults")
    out.mkdir(parents=True, exist_ok=True)
    processes = [p for p in args.processes.split(",") if p]
    signals_ = [s for s in args.signals.split(",") if s]
    bad = [p for p in processes if p not in PROCESSES] + [s for s in signals_ if s not in SIGNALS]
    if bad:
        print(f"error: unknown process or signal {bad}; processes {PROCESSES}, signals {SIGNALS}", file=sys.stderr)
        return 2
    rnd = random.Random(args.seed)

    def on_term(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt  # so that the clean-up below runs

    signal.signal(signal.SIGTERM, on_term)
    run = Run(args, out)
    cases: list[dict[str, Any]] = []
    try:
        t0 = time.monotonic()
        run.start_up()
        while not (run.home / "control_token").exists() and time.monotonic() - t0 < args.timeout:
            time.sleep(0.5)
        from control.store import UnknownHost, get_host

        while time.monotonic() - t0 < args.timeout:
            try:
                get_host(run.open_store(), "local")
                break
            except UnknownHost:
                time.sleep(0.5)
        startup = run.wait_serving(t0)
        if startup is None:
            print(f"error: control up did not come up; see {out / 'control-up.log'}", file=sys.stderr)
            return 1
        print(f"control up serving after {startup:.1f} s (engine host, collector, dashboard)", flush=True)
        try:
            _rounds(run, args, processes, signals_, rnd, cases, out)
        except KeyboardInterrupt:
            print(f"interrupted after {len(cases)} cases", flush=True)
        table = summarise(cases, startup)
        print(table)
        (out / "summary.txt").write_text(table + "\n")
        return 0
    finally:
        run.stop()


def _rounds(
    run: Run,
    args: argparse.Namespace,
    processes: list[str],
    signals_: list[str],
    rnd: random.Random,
    cases: list[dict[str, Any]],
    out: Path,
) -> None:
    done: set[tuple[int, str, str]] = set()
    if args.resume and (out / "cases.jsonl").exists():
        for line in (out / "cases.jsonl").read_text().splitlines():
            c = json.loads(line)
            cases.append(c)
            done.add((c["round"], c["process"], c["signal"]))
        print(f"resuming: {len(done)} cases kept from {out / 'cases.jsonl'}", flush=True)
    with open(out / "cases.jsonl", "a") as f:
        for i in range(args.repeat):
            for p in processes:
                for s in signals_:
                    if (i, p, s) in done:
                        continue
                    try:
                        c = run_case(run, p, s, rnd)
                    except Exception as exc:  # the run goes on; the case says what broke
                        c = {"process": p, "signal": s, "error": f"{type(exc).__name__}: {exc}"}
                    c["round"] = i
                    cases.append(c)
                    f.write(json.dumps(c) + "\n")
                    f.flush()
                    print(
                        f"round {i} {p:<12} {s:<4} recovery {c.get('recovery_s')} s, orphans "
                        f"{len(c.get('orphans', []))}, lost {c.get('lost')}, misrecorded "
                        f"{c.get('misrecorded')}, integrity {c.get('integrity')}"
                        + (f" ({c['error']})" if c.get("error") else ""),
                        flush=True,
                    )
