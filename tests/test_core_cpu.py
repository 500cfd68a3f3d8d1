"""A CPU of its own for the engine core's step loop (``--core-cpu``, ``engine_host.cpu_affinity``).

The launcher keeps itself and all it starts off the CPU; the scheduler hook pins the thread
that runs the step loop to it at its first step and publishes it. Real affinity calls on
this machine's CPUs; the launcher runs in a child process whose ``exec`` of ``vllm serve``
is replaced by a report of what it would have started with."""

from __future__ import annotations

import itertools
import os
import threading

import pytest

from engine_host import cpu_affinity, envs, vllm_compat
from engine_host.cpu_affinity import CpuAffinityError

ALLOWED = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
needs_two_cpus = pytest.mark.skipif(len(ALLOWED) < 2, reason="needs two CPUs this process may run on")


def test_a_cpu_the_process_cannot_have_is_refused_with_the_reason():
    def free(cpu: int) -> None:
        return None

    assert cpu_affinity.check_core_cpu(1, {0, 1, 2}, free) == {0, 2}
    assert cpu_affinity.check_core_cpu(7, {0, 1, 2}, free) == {0, 1, 2}  # outside the mask now, but to be had
    with pytest.raises(
        CpuAffinityError, match="cannot be given to the step loop here \\(offline; this process runs on 0-2,5\\)"
    ):
        cpu_affinity.check_core_cpu(4, {0, 1, 2, 5}, lambda cpu: "offline")
    with pytest.raises(CpuAffinityError, match="only CPU"):
        cpu_affinity.check_core_cpu(3, {3}, free)
    with pytest.raises(CpuAffinityError, match=">= 0"):
        cpu_affinity.check_core_cpu(-1, {0, 1}, free)
    # a real trial: a CPU this machine does not have is refused, one it has is not
    assert cpu_affinity.pin_refused(10**6) is not None
    assert cpu_affinity.pin_refused(ALLOWED[0]) is None
    assert cpu_affinity.calling_thread_cpus() == ALLOWED  # the trial ran in a thread of its own


def test_core_cpu_takes_auto_off_or_a_cpu_index():
    assert envs.core_cpu({}) is None and envs.core_cpu({envs.CORE_CPU: " "}) is None
    assert envs.core_cpu({envs.CORE_CPU: " 7 "}) == "7"
    assert cpu_affinity.parse_core_cpu("7") == 7
    assert cpu_affinity.parse_core_cpu(" AUTO ") == "auto" and cpu_affinity.parse_core_cpu("off") == "off"
    for bad in ("seven", "-1", "1.5", ""):
        with pytest.raises(CpuAffinityError, match="auto, off or a CPU index"):
            cpu_affinity.parse_core_cpu(bad)


def test_each_engine_host_on_a_machine_gets_a_cpu_of_its_own(tmp_path):
    def free(cpu: int) -> None:
        return None

    mask = {0, 1, 2, 3}
    first = cpu_affinity.claim_core_cpu("auto", tmp_path, mask, free)
    second = cpu_affinity.claim_core_cpu("auto", tmp_path, mask, free)
    assert first is not None and second is not None
    assert (first.cpu, first.how, second.cpu) == (3, "auto", 2)
    assert os.get_inheritable(first.fd)  # held across the launcher's exec of vllm serve
    assert cpu_affinity.held_by_others(tmp_path) == {2, 3}
    # a CPU asked for by number that another engine host holds is refused, with its pid
    with pytest.raises(CpuAffinityError, match=f"another engine host \\(pid {os.getpid()}\\) holds it"):
        cpu_affinity.claim_core_cpu(3, tmp_path, mask, free)
    # a CPU that cannot be pinned is passed over, and the lowest is left to the rest
    third = cpu_affinity.claim_core_cpu("auto", tmp_path, mask, lambda cpu: "offline" if cpu == 1 else None)
    assert third is None
    os.close(first.fd)  # that engine host ended: its CPU is free again
    assert cpu_affinity.held_by_others(tmp_path) == {2}
    again = cpu_affinity.claim_core_cpu(3, tmp_path, mask, free)
    assert again is not None and (again.cpu, again.how) == (3, "given")
    for c in (second, again):
        os.close(c.fd)
    assert cpu_affinity.claim_core_cpu("off", tmp_path, mask, free) is None
    assert cpu_affinity.claim_core_cpu("auto", tmp_path, {5}, free) is None  # nothing left for the rest


@needs_two_cpus
def test_pinning_takes_the_calling_thread_only():
    cpu = ALLOWED[-1]
    seen: dict[str, object] = {}

    def worker() -> None:
        seen["pinned"] = cpu_affinity.pin_calling_thread(cpu)
        seen["cpus"] = cpu_affinity.calling_thread_cpus()

    _in_thread(worker)
    assert seen == {"pinned": True, "cpus": [cpu]}
    assert cpu_affinity.calling_thread_cpus() == ALLOWED  # this thread keeps its mask
    assert not cpu_affinity.pin_calling_thread(10**6)  # a CPU that does not exist: logged, not raised


def _in_thread(fn) -> None:
    """Run ``fn`` in a thread of its own (affinity calls on thread 0 change that thread only), to its end."""
    t = threading.Thread(target=fn)
    t.start()
    t.join()


def _restore_all_threads() -> None:
    """Give every thread of this process its mask back (a keeper under test moved them)."""
    for tid in cpu_affinity.task_ids(os.getpid()):
        try:
            os.sched_setaffinity(tid, ALLOWED)
        except OSError:
            pass


_launches = itertools.count()


class _Exec(Exception):
    """Raised in place of the launcher's ``exec`` of ``vllm serve``."""


def _launch(
    tmp_path,
    monkeypatch,
    build: str,
    *argv: str,
    env: dict[str, str] | None = None,
    mask: set[int] | None = None,
    held: set[int] = frozenset(),
) -> dict:
    """Run the launcher's ``main`` in a thread of its own (its CPU mask changes that thread
    only) up to its ``exec``; returns its exit status, or the CPUs and environment that
    ``vllm serve`` would have started with. ``mask``: the CPUs the launching thread runs on
    (as a benchmark script that keeps its engine hosts off the step loops' CPUs starts them);
    ``held``: CPUs that other engine hosts' step loops hold meanwhile."""
    from engine_host import launcher

    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text("{}")
    monkeypatch.setenv("SPECPILOT_HOME", str(tmp_path / "home"))
    monkeypatch.delenv(envs.CORE_CPU, raising=False)
    for k, v in (env or {}).items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(launcher, "is_cpu_build", lambda: build == "cpu")
    locks = tmp_path / f"locks-{next(_launches)}"  # each launch as on a machine of its own
    monkeypatch.setattr(cpu_affinity, "lock_dir", lambda: locks)
    others = [cpu_affinity.claim_core_cpu(c, locks, refused=lambda c: None) for c in held]

    def report(path, cmd, child_env):
        raise _Exec({"cpus": sorted(os.sched_getaffinity(0)), "core_cpu": child_env.get(envs.CORE_CPU)})

    monkeypatch.setattr(launcher.os, "execvpe", report)
    out: dict = {}

    def run() -> None:
        if mask is not None:
            os.sched_setaffinity(0, mask)
        try:
            out["rc"] = launcher.main(["--model", str(model), "--k-max", "0", *argv])
        except _Exec as e:
            out.update(e.args[0])

    _in_thread(run)
    for c in others:
        assert c is not None
        os.close(c.fd)
    return out


@needs_two_cpus
def test_the_launcher_keeps_vllm_serve_off_the_step_loops_cpu(tmp_path, monkeypatch, capsys):
    cpu = ALLOWED[-1]
    rest = [c for c in ALLOWED if c != cpu]
    assert _launch(tmp_path, monkeypatch, "gpu", "--core-cpu", str(cpu)) == {"cpus": rest, "core_cpu": str(cpu)}
    assert f"step loop    on CPU {cpu} (given)" in capsys.readouterr().out
    # the environment variable does the same (benchmark scripts set it per engine host)
    assert _launch(tmp_path, monkeypatch, "gpu", env={envs.CORE_CPU: str(cpu)}) == {"cpus": rest, "core_cpu": str(cpu)}
    # a launcher started off that CPU may still give it to the step loop
    got = _launch(tmp_path, monkeypatch, "gpu", "--core-cpu", str(cpu), mask=set(rest))
    assert got == {"cpus": rest, "core_cpu": str(cpu)}
    # the GPU build's default: auto, the highest-numbered CPU
    assert _launch(tmp_path, monkeypatch, "gpu") == {"cpus": rest, "core_cpu": str(cpu)}
    assert f"step loop    on CPU {cpu} (auto)" in capsys.readouterr().out
    # off, and the CPU build's default: vllm serve gets every CPU and the engine core pins nothing
    assert _launch(tmp_path, monkeypatch, "gpu", "--core-cpu", "off") == {"cpus": ALLOWED, "core_cpu": "off"}
    assert _launch(tmp_path, monkeypatch, "cpu") == {"cpus": ALLOWED, "core_cpu": "off"}
    # another engine host's step loop holds a CPU: this one's keeps off it, pinned or not
    if len(ALLOWED) >= 3:
        low = ALLOWED[0]
        got = _launch(tmp_path, monkeypatch, "gpu", held={cpu})
        assert got == {"cpus": [c for c in rest if c != ALLOWED[-2]], "core_cpu": str(ALLOWED[-2])}
        got = _launch(tmp_path, monkeypatch, "gpu", "--core-cpu", "off", held={low})
        assert got == {"cpus": [c for c in ALLOWED if c != low], "core_cpu": "off"}
    else:  # two CPUs: never all of them kept off
        got = _launch(tmp_path, monkeypatch, "gpu", "--core-cpu", "off", held={cpu})
        assert got == {"cpus": rest, "core_cpu": "off"}
        got = _launch(tmp_path, monkeypatch, "gpu", held={cpu})  # no CPU free for auto: not pinned
        assert got == {"cpus": rest, "core_cpu": "off"}
        assert "not pinned (no CPU free for it)" in capsys.readouterr().out
    # the flag wins over the environment
    got = _launch(tmp_path, monkeypatch, "gpu", "--core-cpu", "off", env={envs.CORE_CPU: str(cpu)})
    assert got == {"cpus": ALLOWED, "core_cpu": "off"}
    assert cpu_affinity.calling_thread_cpus() == ALLOWED


def test_the_launcher_refuses_a_cpu_it_cannot_give_and_starts_nothing(tmp_path, monkeypatch, capsys):
    assert _launch(tmp_path, monkeypatch, "gpu", "--core-cpu", str(10**6)) == {"rc": 2}
    assert "cannot be given to the step loop here" in capsys.readouterr().err
    assert _launch(tmp_path, monkeypatch, "cpu", "--core-cpu", "0") == {"rc": 2}
    assert "GPU build" in capsys.readouterr().err
    assert _launch(tmp_path, monkeypatch, "gpu", env={envs.CORE_CPU: "first"}) == {"rc": 2}
    assert "auto, off or a CPU index" in capsys.readouterr().err
    assert not (tmp_path / "home" / "run").exists()  # no channel made


@needs_two_cpus
def test_the_hook_pins_its_step_loop_at_the_first_step_and_publishes_it(tmp_path, monkeypatch):
    from bench.hook_cost import standin_hook

    cpu = ALLOWED[-1]
    monkeypatch.setenv(envs.CORE_CPU, str(cpu))
    seen: dict[str, object] = {}

    def engine_core() -> None:  # the engine core's main thread: builds the scheduler, then runs steps
        hook, channel = standin_hook("fixed:0", 1, str(tmp_path))
        try:
            seen["before"] = cpu_affinity.calling_thread_cpus()
            hook._publish(0.0)
            seen["state_before"] = channel.read_state()
            hook.has_requests()
            hook.schedule()
            seen["after"] = cpu_affinity.calling_thread_cpus()
            hook._publish(1.0)
            seen["state_after"] = channel.read_state()
            seen["keeper"] = hook._cpu_keeper
        finally:
            channel.close()

    _in_thread(engine_core)
    keeper = seen["keeper"]
    try:
        assert isinstance(keeper, cpu_affinity.CoreCpuKeeper)  # keeps the process's other threads off the CPU
        keeper.stop()
        assert keeper.cpu == cpu and os.getpid() in keeper.pids and keeper.step_tid != threading.get_native_id()
        assert cpu not in cpu_affinity.calling_thread_cpus()  # this thread (the process's main) was moved off it
    finally:
        _restore_all_threads()
    assert seen["before"] == ALLOWED and seen["after"] == [cpu]
    before, after = seen["state_before"], seen["state_after"]
    assert isinstance(before, dict) and isinstance(after, dict)
    assert before["core_cpu"] is None and after["core_cpu"] == cpu and after["core_thread_cpus"] == [cpu]
    assert cpu_affinity.calling_thread_cpus() == ALLOWED


def test_threads_are_moved_off_the_step_loops_cpus_and_never_left_without_one():
    masks = {1: {0, 1, 2, 3}, 2: {3}, 3: {0, 1}, 4: {2}}

    def put(tid: int, cpus: set[int]) -> None:
        if tid == 5:
            raise ProcessLookupError("ended")
        masks[tid] = set(cpus)

    def get(tid: int) -> set[int]:
        if tid == 5:
            raise ProcessLookupError("ended")
        return set(masks[tid])

    # CPU 3 is this engine host's step loop's, CPU 2 another engine host's (claimed after this one started)
    moved = cpu_affinity.keep_threads_off([1, 2, 3, 4, 5], {2, 3}, {0, 1, 2}, get, put)
    assert moved == 3
    # a thread with CPUs to spare keeps those; one born of the pinned step loop (only CPU 3) and
    # one left with nothing get the launcher's mask less the step loops' CPUs; a thread already
    # clear is untouched; a thread that ended is passed over
    assert masks == {1: {0, 1}, 2: {0, 1}, 3: {0, 1}, 4: {0, 1}}
    # nothing left anywhere: a thread keeps its mask
    masks[6] = {3}
    assert cpu_affinity.keep_threads_off([6], {0, 1, 2, 3}, {0, 1, 2, 3}, get, put) == 0 and masks[6] == {3}


@needs_two_cpus
def test_the_keeper_moves_a_thread_born_of_the_pinned_step_loop_off_its_cpu(tmp_path):
    cpu, rest = ALLOWED[-1], set(ALLOWED[:-1])
    born = threading.Event()
    done = threading.Event()
    seen: dict[str, object] = {}

    def child() -> None:  # inherits the step loop's one CPU
        seen["child_tid"] = threading.get_native_id()
        seen["child_before"] = cpu_affinity.calling_thread_cpus()
        born.set()
        done.wait(30)
        seen["child_after"] = cpu_affinity.calling_thread_cpus()

    def step_loop() -> None:
        assert cpu_affinity.pin_calling_thread(cpu)
        seen["step_tid"] = threading.get_native_id()
        t = threading.Thread(target=child)
        t.start()
        born.wait(30)
        keeper = cpu_affinity.CoreCpuKeeper(
            cpu, threading.get_native_id(), [os.getpid()], set(ALLOWED), folder=tmp_path
        )
        seen["moved"] = keeper.keep_off_once()
        seen["step_after"] = cpu_affinity.calling_thread_cpus()
        done.set()
        t.join()

    _in_thread(step_loop)
    try:
        assert seen["child_before"] == [cpu]
        assert seen["child_after"] == sorted(rest) and seen["step_after"] == [cpu]
        assert isinstance(seen["moved"], int) and seen["moved"] >= 2  # the child and this thread
        assert cpu_affinity.calling_thread_cpus() == sorted(rest)  # this thread's mask less the CPU
    finally:
        _restore_all_threads()


@needs_two_cpus
def test_an_unpinned_engine_host_on_a_gpu_keeps_off_a_cpu_claimed_after_it_started(tmp_path, monkeypatch):
    from bench.hook_cost import standin_hook

    held = ALLOWED[-1]
    monkeypatch.setenv(envs.CORE_CPU, "off")
    monkeypatch.setattr(vllm_compat, "is_cpu_build", lambda: False)
    monkeypatch.setattr(cpu_affinity, "lock_dir", lambda: tmp_path / "locks")
    seen: dict[str, object] = {}

    def engine_core() -> None:
        hook, channel = standin_hook("fixed:0", 1, str(tmp_path))
        try:
            # another engine host claims its CPU after this one's launcher set its mask
            seen["other"] = cpu_affinity.claim_core_cpu(held, tmp_path / "locks", refused=lambda c: None)
            hook.has_requests()
            hook.schedule()
            seen["keeper"] = hook._cpu_keeper
            seen["core_cpu"] = hook._core_cpu
        finally:
            channel.close()

    _in_thread(engine_core)
    keeper, other = seen["keeper"], seen["other"]
    try:
        assert isinstance(keeper, cpu_affinity.CoreCpuKeeper) and keeper.cpu is None and seen["core_cpu"] is None
        keeper.stop()
        assert keeper.moved >= 1
        assert held not in cpu_affinity.calling_thread_cpus()  # this process's threads were moved off it
    finally:
        _restore_all_threads()
        if isinstance(other, cpu_affinity.CoreCpuClaim):
            os.close(other.fd)
    # the CPU build's vLLM binds its own compute threads: an unpinned engine host there moves nothing
    monkeypatch.setattr(vllm_compat, "is_cpu_build", lambda: True)
    hook, channel = standin_hook("fixed:0", 1, str(tmp_path / "cpu"))
    try:
        hook.has_requests()
        hook.schedule()
        assert hook._cpu_keeper is None
    finally:
        channel.close()


@needs_two_cpus
def test_the_keeper_moves_the_threads_of_descendant_processes_too(tmp_path):
    import subprocess
    import sys

    held = ALLOWED[-1]
    other = cpu_affinity.claim_core_cpu(held, tmp_path, refused=lambda c: None)  # another engine host's step loop
    # a worker process of this engine host, started before that CPU was claimed
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert cpu_affinity.process_tree(os.getpid())[0] == os.getpid()
        assert child.pid in cpu_affinity.process_tree(os.getpid())
        assert held in os.sched_getaffinity(child.pid)
        keeper = cpu_affinity.CoreCpuKeeper(None, None, [os.getpid()], set(ALLOWED), folder=tmp_path)
        assert keeper.keep_off_once() >= 2  # this process's thread(s) and the child's
        assert held not in os.sched_getaffinity(child.pid)
        assert keeper.keep_off_once() == 0  # nothing left to move
    finally:
        child.kill()
        child.wait()
        _restore_all_threads()
        assert other is not None
        os.close(other.fd)
    assert cpu_affinity.process_tree(child.pid) == [child.pid]  # an ended process: itself only


@needs_two_cpus
def test_the_keeper_lists_the_descendant_processes_again_only_every_few_passes(tmp_path, monkeypatch):
    """Listing the process tree reads every process of the host: a pass reuses the last list,
    and a process started since is found at the latest TREE_EVERY passes later."""
    import subprocess
    import sys

    held = ALLOWED[-1]
    other = cpu_affinity.claim_core_cpu(held, tmp_path, refused=lambda c: None)
    listed: list[int] = []
    real_tree = cpu_affinity.process_tree

    def counting_tree(pid: int) -> list[int]:
        listed.append(pid)
        return real_tree(pid)

    monkeypatch.setattr(cpu_affinity, "process_tree", counting_tree)
    keeper = cpu_affinity.CoreCpuKeeper(None, None, [os.getpid()], set(ALLOWED), folder=tmp_path)
    child = None
    try:
        keeper.keep_off_once()
        assert listed == [os.getpid()]
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        os.sched_setaffinity(child.pid, set(ALLOWED))  # (it inherits this thread's mask, already moved off)
        for _ in range(keeper.TREE_EVERY - 1):
            keeper.keep_off_once()
        assert listed == [os.getpid()] and held in os.sched_getaffinity(child.pid)  # the list of the first pass
        keeper.keep_off_once()  # the TREE_EVERY-th pass after the first lists them again
        assert len(listed) == 2 and held not in os.sched_getaffinity(child.pid)
        child.kill()
        child.wait()
        keeper.keep_off_once()  # a process listed has ended: listed again at once
        assert len(listed) == 3
    finally:
        if child is not None and child.poll() is None:
            child.kill()
            child.wait()
        _restore_all_threads()
        assert other is not None
        os.close(other.fd)
