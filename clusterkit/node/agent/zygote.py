"""Node program: the per-node fork server ("zygote") of a native launch (issue 15).

Each rank's own ``import torch`` is the floor of a launch's start-up (seconds of
CPU per rank; on a small node the ranks' imports queue for the cores). The agent
starts this program as soon as it knows the job, while the gate and the
rendezvous go on; it imports torch (and, for the bundled workload, what its ranks
import) once, then on the agent's word forks one process per local rank. Each
rank sets its own environment, argv, ``sys.path[0]`` and cwd and runs the program
as ``python -u script.py args`` / ``python -u -m module args`` would.

Why forking after ``import torch`` is safe, and when it is not: ``import torch``
starts no thread and does not initialise CUDA (it is lazy) when the OpenMP thread
count is set (the agent sets ``OMP_NUM_THREADS`` in our environment, the same
value every rank gets; OpenBLAS starts its pool at load time otherwise), and fork
copies a single-threaded process whole. Before forking we check exactly that: one
thread (``/proc/self/task``), ``torch.cuda.is_initialized()`` false, and no open
``/dev/nvidia*`` file (the CUDA driver is not fork-safe once initialised, and an
import may probe the GPUs). Any failure -- an import error, a thread, a GPU
handle -- is reported as ``unfit`` and the agent starts the ranks with a plain
exec instead, saying so in one line.

Wire (all lines JSON): the agent writes the source (``<nbytes>\\n<source>``, read
by :data:`BOOT`), then a config line ``{"argv", "cwd", "imports", "status_fd",
"grace_s", "title"}``; we answer on ``status_fd`` ``{"ev": "ready"|"unfit", ...}``. Then
it writes ``{"ranks": [{"lr", "fd", "env", "title"}, ...]}``; we fork, report
``{"ev": "forked", "lr", "pid"}`` for each and ``{"ev": "exit", "lr", "code"}``
(``code`` as ``subprocess`` gives it: negative for a signal) as each ends, and
exit once all have. Teardown: SIGTERM (the agent's sweep, or our parent-death
signal when the agent dies) or EOF on stdin makes us SIGTERM the ranks, SIGKILL
them after ``grace_s``; each rank dies with us (its parent-death signal).

Process titles (issue 25): a forked rank would show in ``ps``/``top``/``nvidia-smi``
as the zygote's own command line (``python3 -u -c import sys r=...``). Each process
rewrites its argv area instead (:func:`set_title`, as the setproctitle package does):
a rank shows ``python3 train.py ARGS [clusterkit rank R/W job J]``, the zygote
``[clusterkit fork server job J node N]``. The agent starts us with a padding
argument, so the area holds the longest title.

Standard library only, Python >= 3.8; runs outside the agent's bootstrap (its
own interpreter, the job's Python), so it imports no other clusterkit module.

One file because: the agent sends this module's source alone (:data:`BOOT` reads
one ``<nbytes>\\n<source>``) to the job's own interpreter, outside the node bootstrap
that loads the other node modules; a second module would need a loader of its own
in that boot line.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import re
import signal
import sys
import threading
import time
from typing import Any

# How the agent runs us: ``<python> -u -c BOOT`` with our source first on stdin.
# dont_inherit: nothing of BOOT's compile flags reaches our code.
BOOT = ("import sys\n"
        "r=sys.stdin.buffer;n=int(r.readline());s=r.read(n).decode('utf-8')\n"
        "g={'__name__':'clusterkit_zygote','__builtins__':__builtins__}\n"
        "exec(compile(s,'<clusterkit.node.agent.zygote>','exec',dont_inherit=True),g)\n"
        "sys.exit(g['main'](sys.argv[1:]))\n")
SELF = "<clusterkit.node.agent.zygote>"
# A variable of the zygote's environment whose bytes each rank overwrites with its
# own variables, so that /proc/<pid>/environ shows them (show_in_proc_environ).
SLOT, SLOT_BYTES = "CLUSTERKIT_RANK_SLOT", 2048
PR_SET_PDEATHSIG, PR_SET_NAME = 1, 15
POLL_S = 0.05
# The agent always sends its grace; this is the fallback, node/protocol.py's
# DEFAULT_GRACE_S spelled again because the zygote imports nothing of clusterkit
# (tests/process/test_zygote.py holds the two equal).
DEFAULT_GRACE_S = 3.0
# The longest process title (bytes): the agent's padding argument is at most this long
# (Linux takes one argument of up to 128 KiB).
TITLE_MAX = 8192
COMM_MAX = 15  # /proc/<pid>/comm: 16 bytes with its NUL
SERVER_COMM = "ck-forkserver"


# ----------------------------------------------------------------- the rank program


def parse_argv(argv: list[str], cwd: str | None = None) -> tuple[str, str, list[str]] | None:
    """``[python, -u, script|-m module, args...]`` -> (kind, target, args); None: not ours.

    Only what the native plan runs; anything else (other interpreter flags, ``-c``, a
    directory or zip as the script) is left to a plain exec."""
    if len(argv) < 3 or argv[1] != "-u":
        return None
    if argv[2] == "-m":
        return ("module", argv[3], argv[4:]) if len(argv) >= 4 else None
    if argv[2].startswith("-") or not os.path.isfile(os.path.join(cwd or "", argv[2])):
        return None
    return "script", argv[2], argv[3:]


# A script that names none of these would only wait for the zygote's imports.
_USES = re.compile(rb"\b(torch|deepspeed|accelerate|transformers|lightning)\b")
SCAN_BYTES = 4 << 20


def worth_it(kind: str, target: str, cwd: str | None = None) -> bool:
    """Does the program import what the zygote preloads? A script is read for the
    names (a script that imports torch only through its own modules loses the
    head start, not correctness); ``-m`` modules are assumed to."""
    if kind == "module":
        return True
    try:
        with open(os.path.join(cwd or "", target), "rb") as fh:
            return _USES.search(fh.read(SCAN_BYTES)) is not None
    except OSError:
        return False


def path0(kind: str, target: str) -> str:
    """What ``python`` puts first on sys.path: the script's directory (symlinks
    resolved), or the cwd for ``-m``."""
    if kind == "module":
        return os.getcwd()
    return os.path.dirname(os.path.realpath(target))


def _main_file(script: str) -> str:
    # Python >= 3.9 makes __main__.__file__ absolute by prefixing the cwd as is (no
    # normalisation: cwd "/" and "tmp/x.py" give "//tmp/x.py"); 3.8 kept it as typed.
    if sys.version_info < (3, 9) or os.path.isabs(script):
        return script
    return os.getcwd() + os.sep + script


def _fresh_main() -> Any:
    """A new, empty ``__main__`` (BOOT's own globals must not leak into the program)."""
    import builtins
    import types

    mod = types.ModuleType("__main__")
    mod.__builtins__ = builtins  # type: ignore[attr-defined]
    sys.modules["__main__"] = mod
    return mod


def _trim(tb: Any) -> Any:
    """The traceback from the program's first frame on (ours and runpy's left out),
    so an error reads as it does under ``python script.py``."""
    import runpy

    skip = {SELF, getattr(runpy, "__file__", "")}
    while tb is not None and tb.tb_next is not None and tb.tb_frame.f_code.co_filename in skip:
        tb = tb.tb_next
    return tb


def run_program(kind: str, target: str, args: list[str]) -> None:
    """Run the program in this process as the interpreter would; never returns.

    Ends with SystemExit, which unwinds to BOOT's ``sys.exit``: the interpreter then
    finalises as after any script (threads joined, atexit run, streams flushed)."""
    if not getattr(sys.flags, "safe_path", False):
        sys.path[0] = path0(kind, target)
    try:
        if kind == "module":
            import runpy

            _fresh_main()
            sys.argv = ["-m", *args]  # runpy puts the module's file in argv[0], as -m does
            runpy._run_module_as_main(target, alter_argv=True)  # type: ignore[attr-defined]
        else:
            from importlib.machinery import SourceFileLoader

            sys.argv = [target, *args]
            mod = _fresh_main()
            file = _main_file(target)
            mod.__file__ = file
            mod.__loader__ = SourceFileLoader("__main__", file)
            mod.__package__ = None
            mod.__spec__ = None
            with open(target, "rb") as fh:
                code = compile(fh.read(), file, "exec", dont_inherit=True)
            exec(code, mod.__dict__)
    except SystemExit:
        raise
    except KeyboardInterrupt as exc:
        _report(exc)
        # As the interpreter does: finalise, then die of SIGINT (exit status -2).
        import atexit

        atexit._run_exitfuncs()
        _flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        raise SystemExit(130) from None
    except BaseException as exc:  # the uncaught error of the program
        _report(exc)
        raise SystemExit(1) from None
    raise SystemExit(0)


def _report(exc: BaseException) -> None:
    """Print an uncaught error as the interpreter would (through sys.excepthook)."""
    tb = _trim(exc.__traceback__)
    # The hook prints the exception's own __traceback__ when it has one: trim that.
    sys.excepthook(type(exc), exc.with_traceback(tb), tb)


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError, AttributeError):
            stream.flush()


# ----------------------------------------------------------------- process titles


def rank_title(argv: list[str], rank: int, world_size: int, job_id: str) -> str:
    """What ``ps -eo args`` shows for a forked rank: ``python3 train.py ARGS [clusterkit
    rank R/W job J]`` (``grep train.py`` finds every rank).

    Short names for the interpreter and the script (and no ``-u``, ours): ``ps`` cuts
    its lines at 80 columns when its output is not a terminal, and a venv's path and a
    script's directory would push the script's name past that."""
    rest = argv[2:] if argv[1:2] == ["-u"] else argv[1:]
    if rest and rest[0] != "-m":
        rest = [os.path.basename(rest[0]), *rest[1:]]
    tag = f" [clusterkit rank {rank}/{world_size} job {job_id}]"
    command = " ".join([os.path.basename(argv[0]), *rest])
    room = TITLE_MAX - len(tag.encode()) - 4
    if len(command.encode()) > room:  # the tag (the rank) must stay visible
        command = command.encode()[:room].decode("utf-8", "ignore") + "..."
    return command + tag


def server_title(job_id: str, node: str) -> str:
    """The zygote's own title: no program name in it, so ``grep train.py`` finds ranks only."""
    return f"[clusterkit fork server job {job_id} node {node}]"


def comm_name(kind: str, target: str) -> str:
    """The short name ``top`` and ``ps -e`` show: the script's file name, or the module's
    last part (the kernel keeps 15 bytes)."""
    name = target.rsplit(".", 1)[-1] if kind == "module" else os.path.basename(target)
    return name.encode()[:COMM_MAX].decode("utf-8", "ignore") or "python"


def set_title(title: str, comm: str | None = None) -> bool:
    """Show ``title`` as this process's command line (``/proc/self/cmdline``) and ``comm``
    as its name (``/proc/self/comm``). Linux only; False where it cannot (then the
    process shows what it showed before, nothing else changes).

    Python has copied its argv long before (sys.argv, sys.orig_argv): the area the
    kernel reads ``cmdline`` from is free to overwrite. The title ends with a NUL and
    the area's last byte is not one: the kernel then reads the area as one title (up to
    that NUL, as for setproctitle), so no run of empty arguments follows it."""
    ok = True
    if comm:
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            ok = libc.prctl(PR_SET_NAME, ctypes.c_char_p(comm.encode()[:COMM_MAX]), 0, 0, 0) == 0
        except (OSError, AttributeError):
            ok = False
    try:
        with open("/proc/self/stat", "rb") as fh:
            fields = fh.read().rsplit(b")", 1)[1].split()
        start, end = int(fields[45]), int(fields[46])  # arg_start, arg_end (Linux >= 3.5)
        if end - start < 3:
            return False
        text = title.encode()[:end - start - 2]
        block = (text + b"\0").ljust(end - start - 1, b"\0") + b" "
        with open("/proc/self/mem", "r+b", buffering=0) as mem:
            mem.seek(start)
            mem.write(block)
        return ok
    except (OSError, ValueError, IndexError):
        return False


# ----------------------------------------------------------------- process plumbing


def _pdeathsig(sig: int) -> None:
    """Ask the kernel for ``sig`` when our parent dies (Linux; a no-op elsewhere)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


def _gpu_handles() -> list[str]:
    out = []
    try:
        for fd in os.listdir("/proc/self/fd"):
            try:
                target = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                continue
            if target.startswith("/dev/nvidia") or target.startswith("/dev/dri"):
                out.append(target)
    except OSError:
        pass
    return sorted(set(out))


def unfit_reason() -> str | None:
    """Why forking this process now would not give clean ranks (None: it would)."""
    n = _threads()
    if n > 1:
        return f"{n} threads after the imports: fork would lose them"
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    if cuda is not None and getattr(cuda, "is_initialized", lambda: False)():
        return "CUDA initialised by the imports"
    gpus = _gpu_handles()
    if gpus:
        return f"GPU device files open after the imports ({', '.join(gpus[:3])})"
    return None


def _status(fd: int, ev: str, **data: Any) -> bool:
    line = (json.dumps({"ev": ev, **data}) + "\n").encode()
    try:
        os.write(fd, line)  # < PIPE_BUF: one atomic write
        return True
    except OSError:
        return False  # the agent is gone; the teardown follows


def _exit_code(status: int) -> int:
    if os.WIFSIGNALED(status):
        return -os.WTERMSIG(status)
    return os.WEXITSTATUS(status)


def _become_rank(spec: dict[str, Any], all_fds: list[int], status_fd: int,
                 kind: str, target: str, args: list[str], cwd: str | None) -> None:
    """In the forked child: turn into rank ``spec['lr']`` and run the program."""
    try:
        _pdeathsig(signal.SIGKILL)  # the zygote gone (killed): so are we
        os.setsid()  # its own group, as the exec path's start_new_session
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        fd = int(spec["fd"])
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        for other in {*all_fds, status_fd, null}:
            if other > 2:
                os.close(other)
        env = spec["env"]
        own = {k: v for k, v in env.items() if os.environ.get(k) != v and k != SLOT}
        os.environ.clear()
        os.environ.update(env)
        show_in_proc_environ(own)
        if spec.get("title"):
            set_title(str(spec["title"]), comm_name(kind, target))
        if cwd:
            os.chdir(cwd)
        _threads_rule(env)
    except BaseException as exc:  # never run the zygote's loop as a rank
        sys.stderr.write(f"clusterkit zygote: rank set-up failed: {exc!r}\n")
        os._exit(126)
    run_program(kind, target, args)


def show_in_proc_environ(own: dict[str, str]) -> bool:
    """Write this rank's own variables (RANK, LOCAL_RANK, ...) over the SLOT variable
    of the environment block the kernel shows as ``/proc/<pid>/environ``.

    A forked process keeps its parent's block; tools that find ranks by their
    environment (``RANK`` + ``LOCAL_RANK``, as clusterkit's and its tests' scans do)
    would miss them. Only the SLOT bytes change (nothing reads that variable:
    os.environ, already rebuilt, no longer holds it); entries that do not fit are
    left out. False when the block cannot be written (then /proc shows the zygote's)."""
    try:
        with open("/proc/self/stat", "rb") as fh:
            fields = fh.read().rsplit(b")", 1)[1].split()
        start, end = int(fields[47]), int(fields[48])  # env_start, env_end (Linux >= 3.5)
        with open("/proc/self/mem", "r+b", buffering=0) as mem:
            mem.seek(start)
            block = mem.read(end - start)
            # The SLOT entry's offset in the block (it may be the first entry).
            at = (b"\0" + block).find(b"\0" + SLOT.encode() + b"=")
            if at < 0:
                return False
            stop = block.find(b"\0", at)
            size = (len(block) if stop < 0 else stop) - at
            out = b""
            for key, value in own.items():
                item = f"{key}={value}".encode() + b"\0"
                if len(out) + len(item) <= size:
                    out += item
            mem.seek(start + at)
            mem.write(out.ljust(size, b"\0"))
        return True
    except (OSError, ValueError, IndexError):
        return False


def _threads_rule(env: dict[str, str]) -> None:
    """libgomp read OMP_NUM_THREADS when torch was imported (in the zygote): apply the
    rank's own value, which ``python`` would have read at its import."""
    torch = sys.modules.get("torch")
    want = env.get("OMP_NUM_THREADS", "")
    if torch is not None and want.isdigit() and int(want) > 0:
        try:
            if torch.get_num_threads() != int(want):
                torch.set_num_threads(int(want))
        except (AttributeError, RuntimeError):
            pass


# ----------------------------------------------------------------- the server


class _Stop:
    def __init__(self) -> None:
        self.why: str | None = None

    def set(self, why: str) -> None:
        if self.why is None:
            self.why = why


def main(argv: list[str] | None = None) -> int:
    parent = int(argv[0]) if argv else 0
    _pdeathsig(signal.SIGTERM)  # the agent gone: tear our ranks down (below)
    if parent and os.getppid() != parent:
        return 1  # the agent died before we could ask
    stdin = sys.stdin.buffer
    config = json.loads(stdin.readline() or b"{}")
    status_fd = int(config["status_fd"])
    if config.get("title"):  # before the imports: ps shows who we are while we import
        set_title(str(config["title"]), SERVER_COMM)
    grace_s = float(config.get("grace_s", DEFAULT_GRACE_S))
    cwd = config.get("cwd") or None
    if cwd:
        os.chdir(cwd)
    parsed = parse_argv(list(config["argv"]))
    if parsed is None:
        _status(status_fd, "unfit", why="the program is not `python -u script|-m module`")
        return 0
    kind, target, args = parsed
    if not getattr(sys.flags, "safe_path", False) and sys.path:
        # Import as the ranks will (a torch.py beside the script shadows the real one).
        sys.path[0] = path0(kind, target)
    started = time.monotonic()
    # torch imports numpy, whose OpenBLAS starts OMP_NUM_THREADS - 1 threads as it loads
    # (seen: 2 threads, so no fork, on every node where a rank has 2+ CPUs, i.e. nearly
    # every real node). Loaded here single-threaded: the ranks' torch threads still
    # follow OMP_NUM_THREADS (_threads_rule); numpy's own BLAS stays 1-threaded in a
    # forked rank. Only this process's variable: each rank gets its own env back.
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    try:
        for name in config.get("imports", []):
            __import__(name)
    except BaseException as exc:  # any import failure means: exec instead
        _status(status_fd, "unfit", why=f"import failed: {type(exc).__name__}: {exc}"[:300])
        return 0
    why = unfit_reason()
    _flush()
    if why is not None:
        _status(status_fd, "unfit", why=why)
        return 0
    _status(status_fd, "ready", import_s=round(time.monotonic() - started, 2))
    line = stdin.readline()
    if not line:
        return 0  # the agent went away (or chose exec) before the ranks
    ranks = json.loads(line)["ranks"]
    fds = [int(r["fd"]) for r in ranks]
    pids: dict[int, int] = {}
    # Python's recipe for a pre-fork server: the imported objects move to a permanent
    # generation that the ranks' collections never walk. Their pages stay shared (no
    # copy-on-write from gc bookkeeping), their gen-2 collections are shorter, and
    # their exit is quicker: measured on torch 2.13 CPU, a process that imported
    # torch.distributed took 0.68-0.96 s to exit, 0.17-0.29 s after gc.freeze().
    gc.freeze()
    for spec in ranks:
        _flush()  # nothing buffered may be written twice
        pid = os.fork()
        if pid == 0:
            _become_rank(spec, fds, status_fd, kind, target, args, cwd)
        pids[pid] = int(spec["lr"])
        _status(status_fd, "forked", lr=int(spec["lr"]), pid=pid)
    for fd in fds:
        os.close(fd)  # the agent's read ends see EOF when the ranks end
    return _serve(pids, status_fd, grace_s, stdin)


def _serve(pids: dict[int, int], status_fd: int, grace_s: float, stdin: Any) -> int:
    """Report each rank's exit; on a stop, SIGTERM them, SIGKILL after the grace."""
    stop = _Stop()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda signum, _f: stop.set(signal.Signals(signum).name))
    # A preemption notice is for the ranks; Slurm's --signal reaches every process of
    # the step, this one too, whose default action for USR1 is to die (ranks with it).
    for sig in (signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_IGN)

    def watch_stdin() -> None:  # forked ranks exist already: a thread is safe now
        while stdin.readline():
            pass
        stop.set("stdin-eof")

    threading.Thread(target=watch_stdin, daemon=True).start()
    live = dict(pids)
    kill_at: float | None = None
    while live:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid:
            lr = live.pop(pid, None)
            if lr is not None:
                _status(status_fd, "exit", lr=lr, code=_exit_code(status))
            continue
        if stop.why is not None and kill_at is None:
            kill_at = time.monotonic() + grace_s
            for p in live:
                _killpg(p, signal.SIGTERM)
        if kill_at is not None and time.monotonic() >= kill_at:
            for p in live:
                _killpg(p, signal.SIGKILL)
            kill_at = time.monotonic() + 3600.0  # once; keep reaping
        time.sleep(POLL_S)
    _flush()
    # Not a normal exit: the stdin watcher is blocked in a read, and the interpreter's
    # shutdown would abort on its buffer lock. Nothing else is left to finalise.
    os._exit(0)


def _killpg(pid: int, sig: int) -> None:
    for fn in (os.killpg, os.kill):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            fn(pid, sig)
