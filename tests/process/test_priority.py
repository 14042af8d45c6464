"""The replica copy's priority (issue 31 item 6): node/replicas/priority.py lowers the calling
thread only, and falls back without an error where a step is not allowed."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from clusterkit.node.replicas import priority
from tests.paths import REPO


def _in_thread(fn: Callable[[], Any]) -> tuple[Any, int]:
    """fn's result in a new thread, and that thread's native id."""
    out: dict[str, Any] = {}
    go, done = threading.Event(), threading.Event()

    def run() -> None:
        out["tid"] = threading.get_native_id()
        out["words"] = fn()
        out["policy"] = os.sched_getscheduler(out["tid"])
        out["cgroup"] = Path(f"/proc/self/task/{out['tid']}/cgroup").read_text()
        out["ionice"] = (subprocess.run(["ionice", "-p", str(out["tid"])], capture_output=True,
                                        text=True, check=False).stdout
                         if shutil.which("ionice") else "")
        go.set()
        done.wait(10)

    t = threading.Thread(target=run)
    t.start()
    go.wait(10)
    res = dict(out)
    done.set()
    t.join()
    return res, res["tid"]


def test_the_calling_thread_gets_sched_idle_and_the_others_keep_theirs(tmp_path: Path) -> None:
    before = os.sched_getscheduler(0)
    res, _ = _in_thread(lambda: priority.lower_this_thread(str(tmp_path)))
    assert res["policy"] == os.SCHED_IDLE
    assert "CPU: SCHED_IDLE" in res["words"]
    assert os.sched_getscheduler(0) == before == os.SCHED_OTHER  # this thread untouched
    if res["ionice"]:
        assert "idle" in res["ionice"]
        assert "I/O: idle class" in res["words"]
    # No cpu cgroup (node/replicas/priority.py says why): the thread stays in its process's groups.
    assert "clusterkit-copy" not in res["cgroup"] and "cgroup" not in res["words"], res


def test_every_step_refused_gives_a_line_not_an_error(monkeypatch: pytest.MonkeyPatch,
                                                      tmp_path: Path) -> None:
    def refuse(*_a: Any, **_k: Any) -> Any:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "sched_setscheduler", refuse)
    monkeypatch.setattr(os, "setpriority", refuse)
    monkeypatch.setattr(priority, "SYS_IOPRIO_SET", {})
    monkeypatch.setattr(shutil, "which", lambda *_a, **_k: None)
    res, _ = _in_thread(lambda: priority.lower_this_thread())
    assert res["policy"] == os.SCHED_OTHER
    assert res["words"].startswith("CPU: normal (neither SCHED_IDLE nor nice allowed); ")
    assert res["words"].endswith("I/O: normal (idle class refused)")


def test_an_unprivileged_user_gets_what_it_may_without_an_error(tmp_path: Path) -> None:
    """As nobody: SCHED_IDLE and the idle I/O class are allowed."""
    if os.geteuid() != 0:
        pytest.skip("needs root to run a check as nobody")
    code = (f"import threading,os,sys;sys.path.insert(0,{str(REPO)!r});"
            "from clusterkit.node.replicas import priority as p;r={};"
            "t=threading.Thread(target=lambda:r.update(w=p.lower_this_thread(),"
            "s=os.sched_getscheduler(0)));t.start();t.join();"
            "print(r['s']==os.SCHED_IDLE);print(r['w'])")
    python = shutil.which("python3", path="/usr/bin:/bin") or sys.executable
    done = subprocess.run([python, "-S", "-c", code], capture_output=True, text=True,
                          user="nobody", cwd="/", timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    first, words = done.stdout.splitlines()[:2]
    assert first == "True", words
    assert "CPU: SCHED_IDLE" in words
