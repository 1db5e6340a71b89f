"""CPU threading: configure_cpu_threads in fresh interpreters, where torch is not yet imported.

Each case runs in a subprocess because OpenMP reads its environment once per process, at
`import torch`; no test asserts a timing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from llmplug.platforms.cpu_threads import ACTIVE_SPIN_COUNT, OWNED_ENV, available_cpu_count, threads_per_process

THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", OWNED_ENV)


def _run(
    call: str, env: dict[str, str] | None = None, import_torch_first: bool = False, torch_after: bool = True
) -> dict:
    """Run `configure_cpu_threads(<call>)` in a fresh interpreter, then import torch; return what is in effect.

    torch_after=False skips the import (and reports torch_threads None) where only the environment matters.
    """
    code = f"""
        import json, logging, os, sys
        logging.basicConfig(level=logging.WARNING)
        {"import torch" if import_torch_first else ""}
        from llmplug.platforms.cpu_threads import available_cpu_count, configure_cpu_threads
        result = configure_cpu_threads({call})
        {"import torch" if torch_after else ""}
        threads = {"torch.get_num_threads()" if torch_after else None}
        env = {{name: os.environ.get(name) for name in {THREAD_ENV!r}}}
        print(json.dumps({{"result": result, "env": env, "torch_threads": threads, "cpus": available_cpu_count()}}))
    """
    clean = {key: value for key, value in os.environ.items() if key not in THREAD_ENV}
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env={**clean, **(env or {})}, timeout=60)
    assert done.returncode == 0, done.stderr
    return {**json.loads(done.stdout.strip().splitlines()[-1]), "stderr": done.stderr}


def test_one_process_gets_every_core_and_the_active_wait_policy():
    out = _run("")
    cpus = out["cpus"]
    assert out["env"]["OMP_NUM_THREADS"] == out["env"]["MKL_NUM_THREADS"] == str(cpus)
    assert out["env"]["OMP_WAIT_POLICY"] == "ACTIVE" and out["env"]["GOMP_SPINCOUNT"] == str(ACTIVE_SPIN_COUNT)
    assert out["torch_threads"] == cpus
    assert out["result"]["num_threads"] == cpus and out["result"]["torch_was_imported"] is False


def test_an_idle_active_process_stops_spinning():
    """After its last matmul, an ACTIVE process's OpenMP threads sleep instead of holding a core."""
    code = """
        import time
        from llmplug.platforms.cpu_threads import configure_cpu_threads
        configure_cpu_threads(num_threads=2)
        import torch
        a = torch.randn(64, 256)
        for _ in range(50):
            a @ a.T
        time.sleep(0.3)  # the bounded spin ends here
        start = time.process_time(); time.sleep(1.0); print(time.process_time() - start)
    """
    clean = {key: value for key, value in os.environ.items() if key not in THREAD_ENV}
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env=clean, timeout=60)
    assert done.returncode == 0, done.stderr
    assert float(done.stdout.split()[-1]) < 0.2  # an unbounded ACTIVE spin burns most of a core meanwhile


def test_processes_sharing_the_cores_split_them_and_wait_passively():
    out = _run("num_processes_sharing=2")
    expected = max(1, out["cpus"] // 2)
    assert out["env"]["OMP_WAIT_POLICY"] == "PASSIVE"
    assert out["env"]["OMP_NUM_THREADS"] == str(expected) and out["torch_threads"] == expected


def test_more_threads_than_cores_wait_passively():
    out = _run("num_threads=available_cpu_count() + 1", torch_after=False)
    assert out["env"]["OMP_WAIT_POLICY"] == "PASSIVE"
    assert out["env"]["OMP_NUM_THREADS"] == str(out["cpus"] + 1)  # torch itself caps its team at the cores


def test_an_explicit_thread_count_is_used():
    out = _run("num_threads=1")
    assert out["env"]["OMP_NUM_THREADS"] == "1" and out["torch_threads"] == 1
    assert out["env"]["OMP_WAIT_POLICY"] == "ACTIVE"


def test_values_the_user_set_in_the_environment_are_never_overridden():
    out = _run("num_threads=2", env={"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"})
    assert out["env"]["OMP_NUM_THREADS"] == "1" and out["env"]["OMP_WAIT_POLICY"] == "PASSIVE"
    assert out["env"]["MKL_NUM_THREADS"] == "1"  # follows the user's thread count
    assert out["torch_threads"] == 1
    assert sorted(out["result"]["user_set"]) == ["OMP_NUM_THREADS", "OMP_WAIT_POLICY"]


def test_a_worker_replaces_values_llmplug_set_in_the_process_it_inherited_them_from():
    inherited = {"OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": "2", "OMP_WAIT_POLICY": "ACTIVE",
                 OWNED_ENV: "MKL_NUM_THREADS,OMP_NUM_THREADS,OMP_WAIT_POLICY"}
    out = _run("num_threads=1, num_processes_sharing=2", env=inherited, torch_after=False)
    assert out["env"]["OMP_NUM_THREADS"] == "1" and out["env"]["OMP_WAIT_POLICY"] == "PASSIVE"
    assert out["result"]["user_set"] == []


def test_after_torch_is_imported_the_thread_count_still_applies_and_the_policy_is_reported_lost():
    out = _run("num_threads=1", import_torch_first=True)
    assert out["torch_threads"] == 1 and out["result"]["torch_was_imported"] is True
    assert "OMP_WAIT_POLICY=ACTIVE cannot take effect" in out["stderr"]


def test_available_cpus_follow_the_affinity_mask():
    assert 1 <= available_cpu_count() <= len(os.sched_getaffinity(0))
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two CPUs to restrict the mask")
    code = """
        import os
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
        from llmplug.platforms.cpu_threads import available_cpu_count, threads_per_process
        print(available_cpu_count(), threads_per_process(4))
    """
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["1", "1"]


def test_threads_per_process_is_at_least_one():
    assert threads_per_process(1) == available_cpu_count()
    assert threads_per_process(10_000) == 1
