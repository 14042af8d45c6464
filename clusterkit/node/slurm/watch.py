"""The progress watchdog of sbatch.sh (standard library only; docs/sbatch.md, "Hangs").

Shipped the one way node programs are (:mod:`clusterkit.ship`): the batch
script runs ``python -S -u -c BOOTSTRAP slurm.watch ...`` with the sources on stdin.

``slurm.watch watch JOB_ID JOB_DIR DUMP_DIR HANG_S ALLOWANCE_S LAUNCH_PID NODES`` runs
beside the launch step on the batch host. Progress is any write to the job's output
files (``<job dir>/logs``: the Slurm files, torchrun's per-rank logs, the deepspeed
variant's per-rank files) or to a rank's heartbeat (``$CLUSTERKIT_HEARTBEAT_DIR``).
Whether the job hangs is :func:`clusterkit.node.hangrule.judge`, the rule ``launch``'s
watchdog applies: no firing during the start-up allowance (``ALLOWANCE_S`` from the
watch's start, which is the ranks' start) until the first sign of training (a heartbeat
written, or a new log line that reads as a step), then ``HANG_S`` seconds without
progress. When it fires, it collects every rank's stack through ``srun --overlap``
(this same program, ``stacks``, on every node), prints a folded summary naming the
stopped or odd rank, writes ``<job dir>/hang`` with the reason and ends the step
(SIGTERM to its srun, ``LAUNCH_PID``).

``slurm.watch stacks JOB_ID DUMP_DIR`` runs on each node: every process of the job
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
from collections.abc import Callable

from clusterkit.node.contract import (
    ENV_HEARTBEAT_DIR,
    ENV_JOB_ID,
    ENV_STACKS,
    HEARTBEAT_RE,
    STACKS_SUFFIX,
    JobDir,
    encode_bundle,
    rank_file,
)
from clusterkit.node.hangrule import STEP_LINE, Verdict, allowance, judge
from clusterkit.node.provision.buildowner import LIVE
from clusterkit.node.provision.jitops import locks, roots_of

NODE = "clusterkit.node."  # every shipped module's name starts so (node/contract.py's bootstrap)
PROGRAM = "slurm.watch"  # this node program's name (ship.py's PROGRAMS)

POLL_S = 2.0
TAIL_BYTES = 1 << 16  # of a log's new bytes per poll, read for a step line
STACKS_TIMEOUT_S = 60.0
BUILD_TAG = "clusterkit-build "  # a line of ``builds``: one op build running on a node
FAULTHANDLER_WAIT_S = 3.0
HANG_FILE = JobDir.HANG  # <job dir>/hang: the reason the watchdog ended the step
_SHELLS = ("sh", "bash", "dash")
_LABEL = re.compile(r"^ *\d+: ")  # srun --label's task number
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


class Scan:
    """What one poll reads (files only): the newest write under ``dirs`` and whether a
    sign of training appeared since the last poll (a heartbeat written after ``since``,
    or a new line in a log under ``logs`` that reads as a step). Logs as they were at
    the start (a requeued run appends to the same files) are not this run's."""

    def __init__(self, logs: str, heartbeat_dir: str, since: float) -> None:
        self.logs, self.heartbeat_dir, self.since = logs, heartbeat_dir, since
        self.dirs = [d for d in (logs, heartbeat_dir) if d]
        self.offsets = {path: size for path, size in self._logs()}

    def _logs(self) -> list[tuple[str, int]]:
        found = []
        for root, _dirs, files in os.walk(self.logs) if self.logs else ():
            for name in files:
                with contextlib.suppress(OSError):
                    found.append((os.path.join(root, name),
                                  os.stat(os.path.join(root, name)).st_size))
        return found

    def __call__(self, training_seen: bool) -> tuple[float, bool]:
        newest = newest_write(self.dirs)
        if training_seen:
            return newest, True  # nothing more to look for
        return newest, self._heartbeat() or self._step_line()

    def _heartbeat(self) -> bool:
        with contextlib.suppress(OSError):
            for name in os.listdir(self.heartbeat_dir):
                with contextlib.suppress(OSError):
                    if HEARTBEAT_RE.match(name) and os.stat(
                            os.path.join(self.heartbeat_dir, name)).st_mtime > self.since:
                        return True
        return False

    def _step_line(self) -> bool:
        seen = False
        for path, size in self._logs():
            start = self.offsets.get(path, 0)
            if size <= start:
                continue
            with contextlib.suppress(OSError), open(path, "rb") as fh:
                at = max(start, size - TAIL_BYTES)
                fh.seek(at)
                chunk = fh.read(size - at)
                # up to the last whole line: a line still being written is read next time
                end = chunk.rfind(b"\n") + 1
                self.offsets[path] = at + end if end else start
                seen = seen or STEP_LINE.search(chunk[:end].decode("utf-8", "replace")) is not None
        return seen


class Watch:
    """The watch's state, no I/O: the ranks' start, the newest progress since, whether
    training was seen; :meth:`poll` asks the one rule (node/hangrule.py)."""

    def __init__(self, started_at: float, hang_s: float, allowance_s: float) -> None:
        self.started_at, self.hang_s, self.allowance_s = started_at, hang_s, allowance_s
        self.last: float | None = None  # newest progress after the start (None: none yet)
        self.training = False

    def poll(self, now: float, newest_write: float, training: bool) -> Verdict:
        if newest_write > self.started_at:  # older writes are an earlier run's
            self.last = max(self.last or 0.0, newest_write)
        self.training = self.training or training
        return judge(now, self.started_at, self.last, self.training, self.hang_s,
                     self.allowance_s)


def run_watch(state: Watch, scan: Callable[[bool], tuple[float, bool]],
              alive: Callable[[], bool], clock: Callable[[], float] = time.time,
              sleep: Callable[[float], None] = time.sleep,
              building: Callable[[], list[str]] = list) -> Verdict | None:
    """Poll until the step ends (None) or the rule says it hangs (its verdict). The
    clock is the files' (wall clock): progress is their modification times.

    Before the first sign of training, a verdict is first checked against ``building``
    (the DeepSpeed/torch op builds running for the job's ranks, one line each): a build
    in progress is progress, said once per build, so the start-up allowance never ends a
    build (a CUDA op compiles for minutes on a loaded node, printing nothing)."""
    said: set[str] = set()
    while alive():
        sleep(POLL_S)
        newest, training = scan(state.training)
        verdict = state.poll(clock(), newest, training)
        if verdict.hung and not state.training:
            builds = building()
            if builds:
                for line in builds:
                    if line not in said:
                        _say(f"clusterkit: {line}: the watchdog waits for the build")
                        said.add(line)
                state.last = clock()
                continue
        if verdict.hung:
            return verdict
    return None


def watch(job_id: str, job_dir: str, dump_dir: str, hang_s: float, launch_pid: int,
          nodes: int, allowance_s: float | None = None) -> int:
    """Started right after the launch step: its start is the ranks' start."""
    started = time.time()
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # scancel --full --signal=USR1 reaches us too
    state = Watch(started, hang_s, allowance(hang_s) if allowance_s is None else allowance_s)
    scan = Scan(JobDir(job_dir).logs(), os.environ.get(ENV_HEARTBEAT_DIR, ""), started)
    verdict = run_watch(state, scan, lambda: _alive(launch_pid),
                        building=lambda: _on_every_node(["builds", job_id], nodes, BUILD_TAG,
                                                        timeout=30.0))
    if verdict is not None:
        _hang(job_id, job_dir, dump_dir, verdict.reason, launch_pid, nodes)
    return 0


def _me() -> list[str]:
    """This program as it was started (python -S -u -c BOOTSTRAP slurm.watch): the same
    command runs it on every node."""
    with open("/proc/self/cmdline", "rb") as fh:
        words = [w.decode() for w in fh.read().split(b"\0") if w]
    return words[:words.index(PROGRAM) + 1] if PROGRAM in words else words


def _on_every_node(args: list[str], nodes: int, tag: str = "",
                   timeout: float = STACKS_TIMEOUT_S) -> list[str]:
    """``slurm.watch ARGS`` on every node of the job (an overlapping step, one task per
    node, this program's bundle on stdin); the output lines starting with ``tag``."""
    argv = ["srun", "--overlap", f"--nodes={nodes}", f"--ntasks={nodes}",
            "--ntasks-per-node=1", "--input=all", *_me(), *args]
    try:
        proc = subprocess.run(argv, input=_bundle(), capture_output=True,
                              timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        if not tag:
            _say(f"clusterkit: stack collection did not finish: {exc}")
        return []
    # The script exports SLURM_LABELIO=1 (srun --label): each line comes as "0: text".
    lines = (_LABEL.sub("", ln, count=1) for ln in proc.stdout.decode("utf-8", "replace")
             .splitlines())
    return [ln[len(tag):].strip() for ln in lines if tag and ln.startswith(tag)]


def _hang(job_id: str, job_dir: str, dump_dir: str, why: str, launch_pid: int,
          nodes: int) -> None:
    _say(f"clusterkit: {why}: collecting every rank's stack into {dump_dir}")
    os.makedirs(dump_dir, exist_ok=True)
    _on_every_node(["stacks", job_id, dump_dir], nodes)
    lines, culprit = summary(dump_dir)
    for line in lines:
        _say(line)
    reason = why + (f"; {culprit}" if culprit else "")
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
    ``__file__`` is ``<clusterkit.node.NAME>`` (``NAME`` dotted) with its source in linecache, registered in
    the order it was sent; run as files (tests), the node modules this one imports."""
    if __file__.startswith("<"):
        shipped = [(name, str(getattr(m, "__file__", "") or "")) for name, m in
                   list(sys.modules.items()) if name.startswith(NODE)]
        parts = [(name, "".join(linecache.getlines(path))) for name, path in shipped
                 if path.startswith("<")]
    else:
        with open(__file__, encoding="utf-8") as fh:
            own = fh.read()
        deps = [str(n.module) for n in ast.walk(ast.parse(own)) if isinstance(n, ast.ImportFrom)
                and str(n.module).startswith(NODE)]
        node_dir = os.path.dirname(os.path.dirname(__file__))  # clusterkit/node/
        parts = []
        for name in deps:
            with open(os.path.join(node_dir, *name[len(NODE):].split(".")) + ".py",
                      encoding="utf-8") as fh:
                parts.append((name, fh.read()))
        parts.append((__name__, own))
    return encode_bundle([(name[len(NODE):], text.encode("utf-8")) for name, text in parts])


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
        where = _where(members)
        odd = stopped or (len(groups) > 1 and len(members) < biggest)
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {_ranges(ranks)}"
        lines.append(f"  {who} ({where}{', stopped' if stopped else ''}): {sig}"
                     + ("   <- odd one out" if odd else ""))
        if odd and (stopped or not culprit):
            culprit = f"{who} on {where} {'is stopped (SIGSTOP?)' if stopped else 'differs'}"
    if not lines:
        lines.append("  no stack came back (no rank process found on any node)")
    return lines, culprit


def _where(members: list[tuple[int, str]]) -> str:
    """The nodes of a group of ranks, each with its own ranks when there are several:
    ``node2`` or ``node1 0-1, node2 2-3, node4 7``."""
    by_node: dict[str, list[int]] = {}
    for rank, node in sorted(members):
        by_node.setdefault(node, []).append(rank)
    if len(by_node) == 1:
        return next(iter(by_node))
    return ", ".join(f"{node} {_ranges(r)}" for node, r in
                     sorted(by_node.items(), key=lambda kv: kv[1][0]))


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


NODE_NAME = "SLURMD_NODENAME"  # Slurm's name of the node a task runs on (srun(1))


def node_name(env: dict[str, str] | None = None) -> str:
    """The node as Slurm names it (``SLURMD_NODENAME`` of the task, the name in the job's
    node list), else the host name."""
    env = dict(os.environ) if env is None else env
    return env.get(NODE_NAME) or socket.gethostname()


def ranks_of(job_id: str) -> dict[int, int]:
    """rank -> pid of this node's ranks of the job (the rank itself, not its shell). A
    process whose Slurm node is another one is not this node's, even where this /proc
    shows it (a PID namespace shared between nodes: containers, a test bed): each rank
    is dumped by its own node, under its own node's name."""
    found: dict[int, int] = {}
    here = os.environ.get(NODE_NAME)
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        env = _environ(int(entry))
        if env.get(ENV_JOB_ID) != job_id or not env.get("RANK", "").isdigit():
            continue
        if here and env.get(NODE_NAME, here) != here:
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
    os.makedirs(dump_dir, exist_ok=True)
    for rank, pid in sorted(ranks_of(job_id).items()):
        state, _comm = _state_and_comm(pid)
        env = _environ(pid)
        text = _py_spy(pid)
        tool = "py-spy"
        if text is None:
            text, tool = _faulthandler(pid, rank, env), "faulthandler"
        # "x": a rank another node already dumped stays that node's (never overwritten).
        with contextlib.suppress(FileExistsError), \
                open(os.path.join(dump_dir, f"rank{rank}.txt"), "x", encoding="utf-8") as fh:
            fh.write(f"# rank {rank} node {node_name(env)} state {state or '?'} tool {tool} "
                     f"pid {pid}\n")
            fh.write(text)
    return 0


def builds(job_id: str) -> int:
    """One :data:`BUILD_TAG` line per op build running where this node's ranks build
    (their extension dirs): a lock a process here holds, or one whose owner record says
    a build on a node sharing the directory runs (node/provision/jitops.locks)."""
    ranks = ranks_of(job_id)
    by_pid = {pid: rank for rank, pid in ranks.items()}
    roots = sorted({root for pid in ranks.values() for root in roots_of(_environ(pid))})
    node = node_name()
    for lk in locks(roots):
        if lk["state"] not in LIVE:
            continue
        # The same words at every ask while the build runs: the watch says each once.
        who = [f"rank {by_pid[p]}" for p in lk["holders"] if p in by_pid]
        op = os.path.basename(os.path.dirname(lk["path"]))
        if lk["holders"]:
            pids = ", ".join(map(str, lk["holders"]))
            where = (f"by {', '.join(who)} " if who else "") + f"on {node} (pid {pids}"
        else:
            where = f"on {lk.get('host')} (its owner record, seen from {node}"
        sys.stdout.write(f"{BUILD_TAG}DeepSpeed/torch op {op} is being built {where}; "
                         f"{lk['path']})\n")
    sys.stdout.flush()
    return 0


def main(argv: list[str]) -> int:
    if argv[:1] == ["watch"] and len(argv) == 8:
        job_id, job_dir, dump_dir, hang, allow, pid, nodes = argv[1:]
        return watch(job_id, job_dir, dump_dir, float(hang), int(pid), int(nodes),
                     allowance_s=float(allow))
    if argv[:1] == ["stacks"] and len(argv) == 3:
        return stacks(argv[1], argv[2])
    if argv[:1] == ["builds"] and len(argv) == 2:
        return builds(argv[1])
    sys.stderr.write("usage: slurm.watch watch JOB_ID JOB_DIR DUMP_DIR HANG_S ALLOWANCE_S "
                     "LAUNCH_PID NODES | stacks JOB_ID DUMP_DIR | builds JOB_ID\n")
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
