"""An engine host of its own (real vLLM engine): nothing of it outlives a kill -9 of its API
process, and the OpenAI API key never appears on a command line."""

from __future__ import annotations

import os
import signal

import httpx
import psutil
import pytest

pytestmark = pytest.mark.engine

API_KEY = "sk-lifecycle-7f3a9c"


def test_kill_9_of_the_api_process_leaves_no_engine_core_or_worker(default_model, tmp_path, artifacts_dir):
    from engine_host.process import EngineHostProcess

    eh = EngineHostProcess(
        model=default_model,
        extra_args=[
            "--enforce-eager",
            "--k-max",
            "2",
            "--max-num-seqs",
            "4",
            "--max-model-len",
            "512",
            "--warmup",
            "off",
        ],
        env={"SPECPILOT_HOME": str(tmp_path), "SPECPILOT_API_KEY": API_KEY},
        log_path=artifacts_dir / "engine-host-kill9.log",
    )
    eh.start()
    children: list[psutil.Process] = []
    try:
        eh.wait_ready(timeout_s=float(os.environ.get("SPECPILOT_TEST_READY_TIMEOUT", "400")))
        api = psutil.Process(eh.proc.pid)  # the launcher execs vLLM's server: same PID
        children = api.children(recursive=True)
        names = " ".join(p.name() + " " + " ".join(p.cmdline()) for p in children)
        assert "EngineCore" in names, names

        # the key works, and no process of the engine host shows it on its command line
        models = eh.url + "/v1/models"
        assert httpx.get(models, timeout=10).status_code == 401
        assert httpx.get(models, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=10).status_code == 200
        for p in [api, *children]:
            assert API_KEY not in " ".join(p.cmdline()), p.cmdline()

        os.kill(api.pid, signal.SIGKILL)  # only the API process, not its group
        eh.proc.wait(timeout=10)
        gone, alive = psutil.wait_procs(children, timeout=15)
        assert not alive, [(p.pid, p.name()) for p in alive]
    finally:
        for p in children:  # never leave them behind, whatever the outcome
            try:
                p.kill()
            except psutil.Error:
                pass
        eh.stop(timeout_s=5)
