"""The progress watchdog of sbatch.sh (standard library only; docs/sbatch.md, "Hangs").

Shipped the one way node programs are (:mod:`clusterkit.node.ship`): the batch
script runs ``python -S -u -c BOOTSTRAP slurmwatch ...`` with the sources on stdin.

``slurmwatch watch JOB_ID JOB_DIR DUMP_DIR HANG_S LAUNCH_PID NODES`` runs beside the
launch step on the batch host. Progress is any write to the job's output files
(``<job dir>/logs``: the Slurm files, torchrun's per-rank logs, the deepspeed
variant's per-rank files) or to a rank's heartbeat (``$CLUSTERKIT_HEARTBEAT_DIR``).
After ``HANG_S`` seconds without any, it collects every rank's stack through
``srun --overlap`` (this same program, ``stacks``, on every node), prints a folded
summary naming the stopped or odd rank, writes ``<job dir>/hang`` with the reason and
ends the step (SIGTERM to its srun, ``LAUNCH_PID``).

``slurmwatch stacks JOB_ID DUMP_DIR`` runs on each node: every process of the job
(``CLUSTERKIT_JOB_ID`` in its environment) that is a rank (``RANK`` set, not a shell)
is dumped with py-spy (beside the interpreter or on PATH), else through the
faulthandler the script registered on SIGWINCH (``$CLUSTERKIT_STACKS``, or
``$CLUSTERKIT_HEARTBEAT_DIR/rank<R>.stacks``). One file per rank:
``DUMP_DIR/rank<R>.txt``, its first line ``# rank R node N state S tool T``.
"""

from __future__ import annotations

import ast
import contextlib
import linecache
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

from clusterkit.node.contract import (
    ENV_HEARTBEAT_DIR,
    ENV_JOB_ID,
    ENV_STACKS,
    STACKS_SUFFIX,
    JobDir,
    encode_bundle,
    rank_file,
)

POLL_S = 2.0
STACKS_TIMEOUT_S = 60.0
FAULTHANDLER_WAIT_S = 3.0
HANG_FILE = JobDir.HANG  # <job dir>/hang: the reason the watchdog ended the step
_SHELLS = ("sh", "bash", "dash")
_FRAME = re.compile(r'^\s+(?:File "[^"]*", line \d+ in (?P<fh>\S+)|(?P<spy>\S+) \([^)]*\))')


def _say(text: str) -> None:
    """To the job's .out and .err files: the watch shows it, the files keep it."""
    for stream in (sys.stdout, sys.stderr):
        stream.write(text + "\n")
        stream.flush()


def newest_write(dirs: list[str]) -> float:
    """The newest mtime of any file under ``dirs`` (0 if none)."""
    newest = 0.0
    for top in dirs:
        for root, _dirs, files in os.walk(top):
            for name in files:
                with contextlib.suppress(OSError):  # gone between listing and stat
                    newest = max(newest, os.stat(os.path.join(root, name)).st_mtime)
    return newest


def _alive(pid: int) -> bool:
    """Running (a zombie, ended but not yet reaped by its parent, is not)."""
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return _state_and_comm(pid)[0] not in ("Z", "X")


def watch(job_id: str, job_dir: str, dump_dir: str, hang_s: float, launch_pid: int,
          nodes: int) -> int:
    dirs = [JobDir(job_dir).logs(), os.environ.get(ENV_HEARTBEAT_DIR, "")]
    dirs = [d for d in dirs if d]
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # scancel --full --signal=USR1 reaches us too
    last = time.time()
    while _alive(launch_pid):
        time.sleep(POLL_S)
        last = max(last, newest_write(dirs))
        idle = time.time() - last
        if idle >= hang_s:
            _hang(job_id, job_dir, dump_dir, hang_s, idle, launch_pid, nodes)
            return 0
    return 0


def _hang(job_id: str, job_dir: str, dump_dir: str, hang_s: float, idle: float,
          launch_pid: int, nodes: int) -> None:
    _say(f"clusterkit: no progress on any rank for {idle:.0f} s (--hang-timeout {hang_s:g}): "
         f"collecting every rank's stack into {dump_dir}")
    os.makedirs(dump_dir, exist_ok=True)
    with open("/proc/self/cmdline", "rb") as fh:  # this program as it was started: the same
        words = [w.decode() for w in fh.read().split(b"\0") if w]  # python -S -u -c BOOTSTRAP
    me = words[:words.index("slurmwatch") + 1] if "slurmwatch" in words else words
    argv = ["srun", "--overlap", f"--nodes={nodes}", f"--ntasks={nodes}",
            "--ntasks-per-node=1", "--input=all", *me, "stacks", job_id, dump_dir]
    try:
        subprocess.run(argv, input=_bundle(), stdout=subprocess.DEVNULL,
                       timeout=STACKS_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        _say(f"clusterkit: stack collection did not finish: {exc}")
    lines, culprit = summary(dump_dir)
    for line in lines:
        _say(line)
    reason = (f"no progress for {idle:.0f} s (--hang-timeout {hang_s:g})"
              + (f"; {culprit}" if culprit else ""))
    if not _alive(launch_pid):  # it ended by itself meanwhile: its own status stands
        _say("clusterkit: the step ended while its stacks were collected")
        return
    with open(os.path.join(job_dir, HANG_FILE), "w", encoding="utf-8") as fh:
        fh.write(reason + "\n")
    _say(f"clusterkit: ending the step: {reason}")
    with contextlib.suppress(ProcessLookupError):
        os.kill(launch_pid, signal.SIGTERM)


def _bundle() -> bytes:
    """This program's bundle for the same program on the other nodes: the header and the
    source of every node module it runs with, dependencies first (the node contract
    before this module, which imports it). Started by the node bootstrap, each module's
    ``__file__`` is ``<clusterkit.node.NAME>`` with its source in linecache, registered in
    the order it was sent; run as files (tests), the node modules this one imports."""
    if __file__.startswith("<"):
        shipped = [(name, str(getattr(m, "__file__", "") or "")) for name, m in
                   list(sys.modules.items()) if name.startswith("clusterkit.node.")]
        parts = [(name, "".join(linecache.getlines(path))) for name, path in shipped
                 if path.startswith("<")]
    else:
        with open(__file__, encoding="utf-8") as fh:
            own = fh.read()
        deps = [str(n.module) for n in ast.walk(ast.parse(own)) if isinstance(n, ast.ImportFrom)
                and str(n.module).startswith("clusterkit.node.")]
        parts = []
        for name in deps:
            with open(os.path.join(os.path.dirname(__file__), name.rsplit(".", 1)[1] + ".py"),
                      encoding="utf-8") as fh:
                parts.append((name, fh.read()))
        parts.append((__name__, own))
    return encode_bundle([(name.rsplit(".", 1)[1], text.encode("utf-8"))
                          for name, text in parts])


def _frames(text: str) -> list[str]:
    """Function names of the first thread's frames as the dump lists them."""
    out = []
    for raw in text.splitlines():
        m = _FRAME.match(raw)
        if m:
            out.append(m.group("fh") or m.group("spy"))
        elif out and not raw.strip():
            break
    return out


def summary(dump_dir: str) -> tuple[list[str], str]:
    """Folded lines (ranks with the same innermost frame and state) and the culprit."""
    groups: dict[tuple[str, bool], list[tuple[int, str]]] = {}
    for name in sorted(os.listdir(dump_dir)) if os.path.isdir(dump_dir) else []:
        m = re.fullmatch(r"rank(\d+)\.txt", name)
        if not m:
            continue
        with open(os.path.join(dump_dir, name), encoding="utf-8", errors="replace") as fh:
            head, _, body = fh.read().partition("\n")
        fields = dict(re.findall(r"(\w+) (\S+)", head.lstrip("# ")))
        frames = _frames(body)
        sig = (f"in {frames[0]}" if frames else "no Python stack") + \
            (f" \u2190 {frames[-2]}" if len(frames) > 2 else "")
        stopped = fields.get("state", "").startswith(("T", "t"))
        groups.setdefault((sig, stopped), []).append((int(m.group(1)), fields.get("node", "?")))
    biggest = max((len(v) for v in groups.values()), default=0)
    lines, culprit = [], ""
    for (sig, stopped), members in sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[1])):
        ranks = sorted(r for r, _ in members)
        where = ",".join(sorted({n for _, n in members}))
        odd = stopped or (len(groups) > 1 and len(members) < biggest)
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {_ranges(ranks)}"
        lines.append(f"  {who} ({where}{', stopped' if stopped else ''}): {sig}"
                     + ("   <- odd one out" if odd else ""))
        if odd and (stopped or not culprit):
            culprit = f"{who} on {where} {'is stopped (SIGSTOP?)' if stopped else 'differs'}"
    if not lines:
        lines.append("  no stack came back (no rank process found on any node)")
    return lines, culprit


def _ranges(ranks: list[int]) -> str:
    """``0-2,5`` for [0, 1, 2, 5]."""
    runs: list[list[int]] = []
    for r in ranks:
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)


# ------------------------------------------------------------------ stacks (each node)

def _environ(pid: int) -> dict[str, str]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as fh:
            raw = fh.read()
    except OSError:
        return {}
    pairs = (item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, v in pairs}


def _state_and_comm(pid: int) -> tuple[str, str]:
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as fh:
            stat = fh.read()
    except OSError:
        return "", ""
    comm = stat[stat.find("(") + 1:stat.rfind(")")]
    return stat[stat.rfind(")") + 2:].split(" ", 1)[0], comm


def ranks_of(job_id: str) -> dict[int, int]:
    """rank -> pid of this node's ranks of the job (the rank itself, not its shell)."""
    found: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        env = _environ(int(entry))
        if env.get(ENV_JOB_ID) != job_id or not env.get("RANK", "").isdigit():
            continue
        _state, comm = _state_and_comm(int(entry))
        if comm in _SHELLS or comm == "srun":
            continue
        found.setdefault(int(env["RANK"]), int(entry))
    return found


def _py_spy(pid: int) -> str | None:
    exe = os.path.realpath(f"/proc/{pid}/exe")
    beside = os.path.join(os.path.dirname(exe), "py-spy")
    tool = beside if os.access(beside, os.X_OK) else shutil.which("py-spy")
    if tool is None:
        return None
    try:
        # --nonblocking: read the stack without pausing it (works on a stopped rank too).
        proc = subprocess.run([tool, "dump", "--nonblocking", "--pid", str(pid)],
                              capture_output=True, text=True,
                              timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout if proc.returncode == 0 and proc.stdout.strip() else None


def _faulthandler(pid: int, rank: int, env: dict[str, str]) -> str:
    path = rank_file(env, ENV_STACKS, rank, STACKS_SUFFIX)
    if path is None:
        return f"(no py-spy, and the rank set no {ENV_STACKS} for a faulthandler dump)"
    try:
        before = os.path.getsize(path)
    except OSError:
        before = 0
    os.kill(pid, signal.SIGWINCH)
    time.sleep(FAULTHANDLER_WAIT_S)
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            fh.seek(before)
            text = fh.read()
    except OSError:
        text = ""
    return text or f"(no faulthandler dump in {path}: the script registers none on SIGWINCH)"


def stacks(job_id: str, dump_dir: str) -> int:
    node = socket.gethostname()
    os.makedirs(dump_dir, exist_ok=True)
    for rank, pid in sorted(ranks_of(job_id).items()):
        state, _comm = _state_and_comm(pid)
        text = _py_spy(pid)
        tool = "py-spy"
        if text is None:
            text, tool = _faulthandler(pid, rank, _environ(pid)), "faulthandler"
        with open(os.path.join(dump_dir, f"rank{rank}.txt"), "w", encoding="utf-8") as fh:
            fh.write(f"# rank {rank} node {node} state {state or '?'} tool {tool} pid {pid}\n")
            fh.write(text)
    return 0


def main(argv: list[str]) -> int:
    if argv[:1] == ["watch"] and len(argv) == 7:
        job_id, job_dir, dump_dir, hang, pid, nodes = argv[1:]
        return watch(job_id, job_dir, dump_dir, float(hang), int(pid), int(nodes))
    if argv[:1] == ["stacks"] and len(argv) == 3:
        return stacks(argv[1], argv[2])
    sys.stderr.write("usage: slurmwatch watch JOB_ID JOB_DIR DUMP_DIR HANG_S LAUNCH_PID NODES "
                     "| stacks JOB_ID DUMP_DIR\n")
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
