"""How engine-host child processes are stopped (no engine needed: small Python children)."""

from __future__ import annotations

import signal
import sys
import time

from engine_host.process import EngineHostProcess


class Child(EngineHostProcess):
    """An EngineHostProcess whose command is a small Python script."""

    def __init__(self, script: str, tmp_path):
        super().__init__(log_path=tmp_path / "child.log")
        self.script = script

    def command(self) -> list[str]:
        return [sys.executable, "-c", self.script]


def wait_for_log(c: Child, text: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and text not in c.log_path.read_text():
        time.sleep(0.05)
    assert text in c.log_path.read_text()


def test_a_child_stops_on_sigint_even_when_started_with_sigint_ignored(tmp_path):
    """A shell's background job starts with SIGINT ignored, and children inherit that; the
    child gets SIGINT back to its default, so Ctrl-C (KeyboardInterrupt) still stops it."""
    script = "import time\nprint('up', flush=True)\ntry:\n    time.sleep(60)\nexcept KeyboardInterrupt:\n    print('interrupted', flush=True)\n"
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        c = Child(script, tmp_path).start()
    finally:
        signal.signal(signal.SIGINT, old)
    wait_for_log(c, "up")
    t = time.monotonic()
    c.stop(timeout_s=20)
    assert time.monotonic() - t < 10
    assert "interrupted" in c.log_path.read_text()


def test_a_child_that_ignores_sigint_gets_sigterm(tmp_path):
    script = (
        "import signal, time\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\nprint('up', flush=True)\ntime.sleep(60)\n"
    )
    c = Child(script, tmp_path).start()
    wait_for_log(c, "up")
    c.stop(timeout_s=0.5)
    assert c.proc.returncode == -signal.SIGTERM
