"""A real Slurm 22.05 cluster on the namespace test bed (tests/testbed).

One private ``munged`` and ``slurmctld`` run on the host (the control machine,
listening on the test bed's bridge address); one ``slurmd`` runs inside each
node's namespaces (``Testbed.spawn``: net + mount + UTS + PID), so node names
resolve and every node has its own node-local directory, exactly like the SSH
tests. Nothing touches the system's /etc/slurm or /etc/munge: daemons get ``-f``
and clients ``SLURM_CONF`` (``SlurmBed.env``).

Layout (``<tb root>/slurm``)::

    slurm.conf, gres.conf   the cluster; every node declares Gres=gpu:G
    dev/gpuK                character devices (1,3 = /dev/null) standing in for GPUs
    munge/                  key, socket (dir mode 0755, munged insists), log, pid
    state/ spool/<node>/    slurmctld state, slurmd spool dirs
    log/                    slurmctld.log, slurmd-<node>.log

Settings that matter (measured): proctrack/linuxproc + task/none (no cgroup
plugin), config_overrides (declared CPUs/GRES, not the host's), GRES files that
are character devices (file-less ``Count=`` makes nodes INVAL), and a slurmd per
network namespace (``slurmd -N`` on one host breaks name resolution).

On a test bed with an unprivileged user (``temporary(n, user=NAME)``,
tests/testbed/users.py) jobs run as that user: submit with :meth:`SlurmBed.user_client`
or ``tb.user_argv`` + :attr:`SlurmBed.user_env`. Every slurmd already sees the bed's
passwd/group (the nodes bind them); slurmctld, on the host, runs in a private mount
namespace with the same binds, so the controller resolves the user as a site's does.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
import weakref
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from clusterkit.errors import ClusterkitError
from tests.testbed import Testbed, TestNode, users

DAEMONS = ("/usr/sbin/slurmctld", "/usr/sbin/slurmd", "/usr/sbin/munged")
CLIENTS = ("sbatch", "srun", "scontrol", "scancel", "sinfo", "squeue")
CLIENT_TIMEOUT = 30.0
PARTITION = "debug"
# Typed GPUs and a node feature, so --gpu-type/--constraint have something to match
# (untyped --gpus-per-node=N still matches typed GRES).
GPU_TYPE = "tbgpu"
FEATURE = "cktb"
# Processes a node runs by itself; anything else inside its PID namespace belongs to a job.
NODE_BASELINE = ("sshd", "slurmd")
# Binds the bed's passwd/group/shadow over /etc's (tests/testbed/open_root.sh's bind_etc).
OPEN_ROOT = users.AS_USER.with_name("open_root.sh")


class SlurmBedError(ClusterkitError):
    """The Slurm test bed could not be brought up, used or torn down."""

    __test__ = False


def slurm_unavailable_reason() -> str | None:
    missing = [p for p in DAEMONS if not os.access(p, os.X_OK)]
    missing += [c for c in CLIENTS if shutil.which(c) is None]
    if missing:
        return (f"Slurm/munge not installed ({', '.join(missing)}): "
                "apt-get install slurm-wlm munge")
    return None


@dataclass(frozen=True)
class SlurmBedSpec:
    """The cluster's shape. CPUs are declared (config_overrides), not measured."""

    cpus_per_node: int = 4
    gpus_per_node: int = 2
    real_memory_mb: int = 4000
    # Short kill wait: `scancel` sends SIGTERM, then SIGKILL after this many seconds.
    kill_wait_s: int = 5
    # Job credential lifetime = the wait before a requeued job may start (see slurm_conf).
    cred_expire_s: int = 10


def _free_port(address: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((address, 0))
        return int(s.getsockname()[1])


def _pid_ns(pid: int) -> int | None:
    try:
        return os.stat(f"/proc/{pid}/ns/pid").st_ino
    except OSError:
        return None


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _ppid(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return 0


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        return ""


def _stop_at_exit(ref: weakref.ReferenceType[SlurmBed]) -> None:
    bed = ref()
    if bed is not None:
        bed.stop()


class SlurmBed:
    """Slurm over the first ``n`` test bed nodes. Create with :meth:`start`; :meth:`stop` always."""

    __test__: ClassVar[bool] = False

    def __init__(self, tb: Testbed, nodes: Sequence[TestNode], spec: SlurmBedSpec) -> None:
        self.tb = tb
        self.nodes = list(nodes)
        self.spec = spec
        self.root = tb.root / "slurm"
        self.conf = self.root / "slurm.conf"
        self.ctld_port = 0
        self._procs: list[subprocess.Popen[Any]] = []
        self._slurmd: dict[str, subprocess.Popen[Any]] = {}
        self._stopped = False

    # ------------------------------------------------------------------ start
    @classmethod
    def start(cls, tb: Testbed, n: int, spec: SlurmBedSpec | None = None,
              timeout: float = 60.0) -> SlurmBed:
        reason = slurm_unavailable_reason()
        if reason:
            raise SlurmBedError(reason)
        bed = cls(tb, tb.ensure(n), spec or SlurmBedSpec())
        # munged/slurmctld run on the host, outside every node: the test bed's own
        # teardown cannot see them, so a caller that forgets stop() still gets it at exit.
        atexit.register(_stop_at_exit, weakref.ref(bed))
        try:
            bed._write_files()
            bed._start_munged(timeout)
            bed._start_slurmctld(timeout)
            for node in bed.nodes:
                bed._start_slurmd(node)
            bed.wait_nodes_idle(timeout)
        except BaseException:
            bed.stop()
            raise
        return bed

    @property
    def munge_socket(self) -> Path:
        return self.root / "munge" / "munge.socket.2"

    @property
    def env(self) -> dict[str, str]:
        """Environment for Slurm clients (sbatch, scontrol, ...) talking to this cluster."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    @property
    def user_env(self) -> dict[str, str]:
        """:attr:`env` for a process run as the bed's user (``tb.user_argv``): its HOME,
        USER, LOGNAME, and its own clusterkit registry (the test session's CLUSTERKIT_HOME
        is root's). sbatch exports it to the job, so the batch script has them too."""
        env = self.tb.user_env(self.env)
        return {**env, "CLUSTERKIT_HOME": str(Path(env["HOME"]) / ".cache" / "clusterkit")}

    def _with_bed_etc(self, argv: list[str]) -> list[str]:
        """``argv`` in a private mount namespace that sees the bed's passwd/group (a
        bed with a user), else as it is. Same pid: terminate() reaches the daemon."""
        if self.tb.user is None:
            return argv
        return ["unshare", "--mount", "--propagation", "private", "--", "/bin/bash", "-c",
                '. "$0"; bind_etc "$1"; shift 2; exec "$@"', str(OPEN_ROOT), str(self.tb.root),
                "--", *argv]

    def _write_files(self) -> None:
        if self.root.exists():
            raise SlurmBedError("a Slurm test bed already runs on this test bed", path=str(self.root))
        for sub in ("munge", "state", "log", "dev", *(f"spool/{n.name}" for n in self.nodes)):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        self.root.chmod(0o755)  # a user's sbatch/srun read slurm.conf and use munge's socket
        (self.root / "munge").chmod(0o755)  # munged refuses group/other-writable dirs
        key = self.root / "munge" / "munge.key"
        fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as fh:
            fh.write(os.urandom(1024))
        for k in range(self.spec.gpus_per_node):
            # A character device (here /dev/null's 1,3): slurmd wants GRES File= to exist.
            os.mknod(self.root / "dev" / f"gpu{k}", 0o666 | 0o020000, os.makedev(1, 3))
        self.ctld_port = _free_port(self.tb.bridge_address)
        self._write_atomic(self.conf, self.slurm_conf())
        self._write_atomic(self.root / "gres.conf", self.gres_conf())

    @staticmethod
    def _write_atomic(path: Path, text: str) -> None:
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(text)
        os.replace(tmp, path)

    def slurm_conf(self) -> str:
        r, s = self.root, self.spec
        lines = [
            "# Slurm test bed (tests/slurmbed); generated, removed at teardown",
            f"ClusterName=cktb{self.tb.prefix}",
            f"SlurmctldHost={socket.gethostname()}({self.tb.bridge_address})",
            f"SlurmctldPort={self.ctld_port}",
            "SlurmdPort=6818",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            # cred_expire is also how long a requeued job waits before it may start again
            # (begin time = requeue + cred_expire + 1; default 120 s, which was most of
            # the node-local requeue test). 10 s still leaves a loaded 2-core machine
            # time to launch a step with its credential: the credential is made when
            # slurmctld creates the step and checked when slurmd gets the launch, a
            # message or two later, not after the ranks' start (30 s, then 15 s before
            # issue 37 item 6: each requeue in the suite waited that long).
            f"AuthInfo=socket={self.munge_socket},cred_expire={self.spec.cred_expire_s}",
            "SlurmUser=root",
            "SlurmdUser=root",
            f"StateSaveLocation={r}/state",
            f"SlurmdSpoolDir={r}/spool/%n",
            f"SlurmctldPidFile={r}/state/slurmctld.pid",
            f"SlurmdPidFile={r}/spool/%n/slurmd.pid",
            f"SlurmctldLogFile={r}/log/slurmctld.log",
            f"SlurmdLogFile={r}/log/slurmd-%n.log",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "SlurmdParameters=config_overrides",
            "SchedulerType=sched/backfill",
            # A requeued job becomes eligible cred_expire s later, but starts only at
            # the next periodic scheduler pass (default: up to 60 s on top; 5 s until
            # issue 37 item 6, ~2.5 s per requeue on average; a pass over a handful of
            # jobs costs slurmctld nothing measurable).
            "SchedulerParameters=sched_interval=2,bf_interval=2",
            "MpiDefault=none",
            "SwitchType=switch/none",
            "GresTypes=gpu",
            "ReturnToService=2",
            f"KillWait={s.kill_wait_s}",
            # Finished jobs stay visible to `scontrol show job` for 10 minutes.
            "MinJobAge=600",
            "InactiveLimit=0",
            "SlurmctldTimeout=120",
            "SlurmdTimeout=300",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
        ]
        for n in self.nodes:
            lines.append(f"NodeName={n.name} NodeAddr={n.address} CPUs={s.cpus_per_node} "
                         f"RealMemory={s.real_memory_mb} Gres=gpu:{GPU_TYPE}:{s.gpus_per_node} "
                         f"Features={FEATURE} State=UNKNOWN")
        names = ",".join(n.name for n in self.nodes)
        lines.append(f"PartitionName={PARTITION} Nodes={names} Default=YES MaxTime=INFINITE State=UP")
        return "\n".join(lines) + "\n"

    def gres_conf(self) -> str:
        last = self.spec.gpus_per_node - 1
        files = f"{self.root}/dev/gpu[0-{last}]" if last > 0 else f"{self.root}/dev/gpu0"
        return f"Name=gpu Type={GPU_TYPE} File={files}\n"

    def _spawn_host(self, argv: list[str], log: str) -> subprocess.Popen[Any]:
        with open(self.root / "log" / log, "ab") as fh:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=fh, stderr=subprocess.STDOUT,
                                    start_new_session=True, env=self.env)
        self._procs.append(proc)
        return proc

    def _start_munged(self, timeout: float) -> None:
        m = self.root / "munge"
        self._spawn_host(["/usr/sbin/munged", "-F", f"--socket={self.munge_socket}",
                          f"--key-file={m / 'munge.key'}", f"--log-file={m / 'munged.log'}",
                          f"--pid-file={m / 'munged.pid'}", f"--seed-file={m / 'munged.seed'}"],
                         "munged.out")
        self._wait(lambda: self.munge_socket.exists(), timeout, "munged did not create its socket",
                   self.root / "munge" / "munged.log")

    def _start_slurmctld(self, timeout: float) -> None:
        # The controller looks the job's uid up: without the bed's passwd a user's job
        # never ran (measured: back to PENDING, reason BeginTime, after a minute).
        self._spawn_host(self._with_bed_etc(["/usr/sbin/slurmctld", "-D", "-i", "-f", str(self.conf)]),
                         "slurmctld.out")
        self._wait(lambda: self.client(["scontrol", "ping"], check=False).returncode == 0
                   and "UP" in self.client(["scontrol", "ping"], check=False).stdout,
                   timeout, "slurmctld did not answer `scontrol ping`",
                   self.root / "log" / "slurmctld.log")

    def _start_slurmd(self, node: TestNode) -> None:
        with open(self.root / "log" / f"slurmd-{node.name}.out", "ab") as fh:
            proc = self.tb.spawn(node, ["/usr/sbin/slurmd", "-D", "-f", str(self.conf)],
                                 stdout=fh, stderr=subprocess.STDOUT,
                                 env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"),
                                      "SLURM_CONF": str(self.conf)})
        self._slurmd[node.name] = proc

    def _wait(self, cond: Any, timeout: float, message: str, log: Path) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            dead = [p for p in self._procs if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                raise SlurmBedError(f"{message}: {self._tail(log)}", path=str(log))
            time.sleep(0.1)

    @staticmethod
    def _tail(path: Path, lines: int = 5) -> str:
        try:
            return " | ".join(path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def node_states(self) -> dict[str, str]:
        out = self.client(["sinfo", "-h", "-N", "-o", "%N %T"]).stdout
        states: dict[str, str] = {}
        for line in out.splitlines():
            name, _, state = line.partition(" ")
            states[name] = state.strip()
        return states

    def wait_nodes_idle(self, timeout: float = 60.0) -> None:
        names = {n.name for n in self.nodes}
        deadline = time.monotonic() + timeout
        states: dict[str, str] = {}
        while time.monotonic() < deadline:
            states = self.node_states()
            if all(states.get(n) == "idle" for n in names):
                return
            dead = [name for name, p in self._slurmd.items() if p.poll() is not None]
            if dead:
                raise SlurmBedError(f"slurmd exited on {', '.join(dead)}: "
                                    f"{self._tail(self.root / 'log' / f'slurmd-{dead[0]}.log')}")
            time.sleep(0.2)
        raise SlurmBedError(f"nodes not idle after {timeout:.0f} s: {states}",
                            path=str(self.root / "log"))

    # --------------------------------------------------------------- clients
    def client(self, argv: Sequence[str], *, check: bool = True, timeout: float = CLIENT_TIMEOUT,
               env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        """Run a Slurm client on the host against this cluster."""
        proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout,
                              env={**self.env, **(env or {})}, check=False)
        if check and proc.returncode != 0:
            raise SlurmBedError(f"`{' '.join(argv)}` failed (exit {proc.returncode}): "
                                f"{(proc.stderr or proc.stdout).strip()}")
        return proc

    def user_client(self, argv: Sequence[str], *, check: bool = True,
                    timeout: float = CLIENT_TIMEOUT,
                    env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        """:meth:`client` run as the bed's user (``tb.user_argv``), from its home: a Slurm
        client, or ``clusterkit`` itself (``[sys.executable, "-m", "clusterkit", ...]``)."""
        user = self.tb.user
        if user is None:
            raise SlurmBedError("this Slurm bed's test bed has no user",
                                hint="temporary(n, user=NAME) / Testbed.create(user=NAME)")
        proc = subprocess.run(self.tb.user_argv(argv), capture_output=True, text=True,
                              timeout=timeout, env={**self.user_env, **(env or {})},
                              cwd=user.home, check=False)
        if check and proc.returncode != 0:
            raise SlurmBedError(f"`{' '.join(argv)}` as {user.name} failed (exit {proc.returncode}): "
                                f"{(proc.stderr or proc.stdout).strip()}")
        return proc

    def job_state(self, job_id: str) -> str:
        out = self.client(["scontrol", "show", "job", "-o", job_id]).stdout
        for word in out.split():
            if word.startswith("JobState="):
                return word.split("=", 1)[1]
        raise SlurmBedError(f"no JobState for job {job_id}: {out.strip()}")

    def wait_all_jobs_gone(self, timeout: float = 60.0) -> None:
        """Until squeue shows no pending/running job (between tests)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.client(["squeue", "-h", "-o", "%i"]).stdout.strip():
                return
            time.sleep(0.2)
        raise SlurmBedError("jobs still queued or running", hint="scancel them")

    def job_processes(self, node: TestNode | str) -> list[tuple[int, str]]:
        """(pid, cmdline) of every process in the node that is not the node's own
        (init, sshd, slurmd): slurmstepd, the batch script, ranks."""
        n = self.tb.node(node)
        ns = _pid_ns(n.pid)
        if ns is None:
            raise SlurmBedError("node is not running", host=n.name)
        found = []
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            pid = int(entry.name)
            if pid == n.pid or _pid_ns(pid) != ns:
                continue
            comm = _comm(pid)
            if comm in NODE_BASELINE or not _cmdline(pid):
                continue
            if comm == "sleep" and _ppid(pid) == n.pid:  # the init's `sleep infinity`
                continue
            found.append((pid, _cmdline(pid)))
        return found

    def kill_job_leftovers(self) -> dict[str, list[tuple[int, str]]]:
        """SIGKILL job processes Slurm lost track of (proctrack/linuxproc follows the
        process tree: ranks whose launcher died are reparented to the node's init and
        escape it); return what was found."""
        found = {}
        for node in self.nodes:
            procs = self.job_processes(node)
            if procs:
                found[node.name] = procs
            for pid, _ in procs:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        return found

    # ---------------------------------------------------- site PATH variant
    @contextlib.contextmanager
    def clients_off_default_path(self) -> Iterator[dict[str, str]]:
        """A site whose Slurm clients live only in a private bin dir ("/opt/slurm/bin").

        Debian installs them in /usr/bin, which every default PATH holds, so hiding them
        needs more than a PATH: inside each node's mount namespace /usr/bin/<client> is
        bind-mounted over by a stub that fails with exit 127 (as "command not found"),
        and copies of the real binaries sit in ``<slurm root>/opt-slurm-bin``. The
        yielded environment has that dir first on PATH, as a login shell with the
        site's module loaded would; a batch script that replaces PATH with the system
        dirs then finds only the stubs. The mounts are undone on exit (node-private:
        the host and other test beds never see them)."""
        bin_dir = self.root / "opt-slurm-bin"
        bin_dir.mkdir(exist_ok=True)
        stub = self.root / "no-slurm-client"
        self._write_atomic(stub, "#!/bin/sh\necho \"$0: Slurm clients are in /opt/slurm/bin "
                                 "on this site (not on the default PATH)\" >&2\nexit 127\n")
        stub.chmod(0o755)
        masked: list[tuple[TestNode, str]] = []
        try:
            for name in (*CLIENTS, "salloc", "sattach", "sstat"):
                real = shutil.which(name, path="/usr/bin")
                if real is None:
                    continue
                shutil.copy2(real, bin_dir / name)
                for node in self.nodes:
                    self.tb.exec(node, ["mount", "--bind", str(stub), real], check=True)
                    masked.append((node, real))
            path = f"{bin_dir}:{os.environ.get('PATH', '/usr/bin:/bin')}"
            yield {**self.env, "PATH": path}
        finally:
            for node, real in reversed(masked):
                self.tb.exec(node, ["umount", real], check=False)

    # --------------------------------------------------------------- teardown
    def stop(self) -> None:
        """Cancel jobs, stop every daemon, kill job leftovers on the nodes, remove files.
        Idempotent; safe after a partial start."""
        if self._stopped:
            return
        self._stopped = True
        with contextlib.suppress(Exception):
            self.client(["scancel", "--full", f"--partition={PARTITION}"], check=False, timeout=10)
        for proc in [*self._slurmd.values(), *reversed(self._procs)]:
            with contextlib.suppress(Exception):
                proc.terminate()
        for proc in [*self._slurmd.values(), *reversed(self._procs)]:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=5)
        # slurmstepd and job processes outlive slurmd (they are not its children's group).
        with contextlib.suppress(SlurmBedError):
            self.kill_job_leftovers()
        shutil.rmtree(self.root, ignore_errors=True)
