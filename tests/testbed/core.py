"""A test bed of real SSH "nodes" on this one Linux host.

Each node is a network namespace (veth to a per-test-bed bridge) plus its own
mount, UTS and PID namespaces whose init runs a real OpenSSH sshd. See
docs/testbed.md for the layout and the CLI (``python -m tests.testbed``).

Layout of one test bed (``<root>`` = /tmp/cktb-<prefix>)::

    state.json            what exists (so `down` works from any process)
    ssh/                  host side: config, known_hosts, id_ed25519, authorized_keys
    nodessh/              bind-mounted over /root/.ssh inside every node
    etc/hosts, etc/resolv.conf, etc/empty   bind-mounted inside every node
    nodes/<name>/         host key, sshd_config, node.log, scratch/ (node-private)
    scratch/              mount point: each node sees its own nodes/<name>/scratch here
    shared/               the same directory on every node (host filesystem)
    work/                 inventory workdir
"""

from __future__ import annotations

import atexit
import contextlib
import ipaddress
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, ClassVar

import yaml

from clusterkit.remote.base import SSHTarget
from tests.testbed import sshfiles, users
from tests.testbed.sysutil import (
    NODE_ENV,
    TestbedError,
    alive,
    flock,
    ip_batch,
    kill_and_wait,
    link_names,
    mountpoints,
    pids_in_netns,
    pids_mentioning,
    run,
    start_time,
    tail,
    write_atomic,
)
from tests.venvs import venv_over_this_python

BASE_DIR = Path("/tmp")
ROOT_PREFIX = "cktb-"
GLOBAL_LOCK = BASE_DIR / "cktb.lock"
# Marker saying a test bed created the (previously missing) /root/.ssh mount point.
ROOT_SSH_MARKER = BASE_DIR / "cktb-created-root-ssh"
SUBNET_BASE = "10.213"  # test bed K uses 10.213.K.0/24, bridge .1, nodes .11, .12, ...
FIRST_HOST_OCTET = 10
MAX_NODES = 254 - FIRST_HOST_OCTET
NODE_INIT = Path(__file__).with_name("node_init.sh")
SSHD = "/usr/sbin/sshd"
NODE_PYTHON_ENV = "CLUSTERKIT_TESTBED_PYTHON"
# sitecustomize of the test bed's clusterkit-less venv (see python_without_clusterkit).
NO_CLUSTERKIT = """\
import sys
sys.meta_path[:] = [f for f in sys.meta_path if "clusterkit" not in repr(f).lower()]
sys.path[:] = [p for p in sys.path if not p.rstrip("/").endswith("/work/main")]


class _NoClusterkit:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name == "clusterkit" or name.startswith("clusterkit."):
            raise ModuleNotFoundError("No module named 'clusterkit' (test bed node without it)")
        return None


sys.meta_path.insert(0, _NoClusterkit)
"""
REQUIRED_TOOLS = ("ip", "nsenter", "unshare", "mount", "umount", "mountpoint", "ssh")


@dataclass(frozen=True)
class TestNode:
    """One node as seen from the host. ``pid`` is the host pid of the node's init."""

    __test__: ClassVar[bool] = False

    name: str
    index: int
    address: str
    netns: str
    veth: str
    pid: int = 0
    pid_start: int = 0


@dataclass
class _State:
    prefix: str
    octet: int
    root: str
    owner_pid: int
    owner_start: int
    persistent: bool = False
    mask_bashrc: bool = False
    name_prefix: str = "node"
    nodes: list[TestNode] = field(default_factory=list)
    destroyed: list[str] = field(default_factory=list)  # nodes lost for good (destroy())
    user: str = ""  # the bed's unprivileged user (tests/testbed/users.py), if any
    user_uid: int = 0

    @staticmethod
    def load(path: Path) -> _State:
        raw = json.loads(path.read_text())
        raw["nodes"] = [TestNode(**n) for n in raw.get("nodes", [])]
        return _State(**raw)

    def save(self) -> None:
        write_atomic(Path(self.root) / "state.json", json.dumps(asdict(self), indent=1) + "\n")


class _NodeProcess(subprocess.Popen[Any]):
    """A Popen of ``nsenter ... argv``: signals go to the whole process group, because
    nsenter does not forward them to the program it forked inside the node."""

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, sig)


def unavailable_reason() -> str | None:
    """Why no test bed can be built here (None = it can)."""
    if os.geteuid() != 0:
        return "the namespace test bed needs root (network namespaces, mounts)"
    if not sys.platform.startswith("linux"):
        return "the namespace test bed needs Linux"
    missing = [t for t in REQUIRED_TOOLS if shutil.which(t) is None]
    if not os.access(SSHD, os.X_OK):
        missing.append(SSHD)
    if missing:
        return (f"test bed tools missing: {', '.join(missing)} "
                "(apt-get install openssh-server openssh-client pdsh iproute2 util-linux)")
    return None


class Testbed:
    """N namespace nodes with sshd, reachable from the host over a private bridge."""

    __test__: ClassVar[bool] = False

    def __init__(self, state: _State) -> None:
        self._state = state
        self._procs: dict[str, subprocess.Popen[bytes]] = {}  # node init launchers we own
        self._spawned: list[subprocess.Popen[Any]] = []
        self._down = False

    # ------------------------------------------------------------------ creation
    @classmethod
    def create(cls, prefix: str | None = None, *, persistent: bool = False,
               mask_bashrc: bool = False, name_prefix: str = "node",
               auto_down: bool = True, user: str | None = None) -> Testbed:
        """Allocate a prefix + /24 and create the bridge and files (no nodes yet).

        ``persistent`` test beds (the CLI's) outlive this process; others are swept
        by the next ``create`` once their owner process is gone. ``auto_down``
        registers atexit + SIGTERM/SIGHUP handlers that tear the test bed down.
        ``user``: an unprivileged user of that name on every node (tests/testbed/users.py;
        ``write_inventory(as_user=True)``, ``user_argv``).
        """
        reason = unavailable_reason()
        if reason:
            raise TestbedError(reason)
        _sweep_orphans()
        with flock(GLOBAL_LOCK):
            # The saved state reserves prefix and subnet; the rest needs no global lock.
            state = _allocate(prefix, persistent, mask_bashrc, name_prefix)
            if user:
                state.user, state.user_uid = user, users.pick_ids(user)[0]
                state.save()
        tb = cls(state)
        try:
            tb._prepare_host()
        except BaseException:
            tb.down()
            raise
        if auto_down:
            tb._install_cleanup()
        return tb

    @classmethod
    def load(cls, prefix: str) -> Testbed:
        """Attach to an existing test bed (e.g. one brought up by the CLI)."""
        path = BASE_DIR / f"{ROOT_PREFIX}{prefix}" / "state.json"
        if not path.is_file():
            raise TestbedError(f"no test bed with prefix {prefix!r}", path=str(path),
                               hint="see `python -m tests.testbed status`")
        return cls(_State.load(path))

    @staticmethod
    def list_prefixes() -> list[str]:
        return sorted(p.name[len(ROOT_PREFIX):] for p in BASE_DIR.glob(f"{ROOT_PREFIX}*")
                      if p.is_dir())

    def _prepare_host(self) -> None:
        root = self.root
        for sub in ("ssh", "nodessh", "etc", "nodes", "scratch", "shared/ckpt", "work"):
            (root / sub).mkdir(parents=True, exist_ok=True)
        _ensure_root_ssh_mountpoint()
        client = sshfiles.new_ed25519(f"cktb-{self.prefix}")
        for d in (root / "ssh", root / "nodessh"):
            write_atomic(d / "id_ed25519", client.private_openssh, 0o600)
            write_atomic(d / "id_ed25519.pub", client.public_openssh + "\n")
        write_atomic(root / "ssh" / "authorized_keys", client.public_openssh + "\n")
        write_atomic(root / "nodessh" / "config", sshfiles.node_ssh_config())
        write_atomic(root / "etc" / "hosts", sshfiles.etc_hosts_header())
        write_atomic(root / "etc" / "resolv.conf", sshfiles.RESOLV_CONF)
        write_atomic(root / "etc" / "empty", "")
        if self.user is not None:
            users.write_etc(self.user, root / "etc")
            (root / "home").mkdir()
            users.prepare_host(self.user, sshfiles.new_ed25519(f"{self.user.name}@cktb"))
        self._write_ssh_client_files()
        bridge = self.bridge
        ip_batch([f"link add {bridge} type bridge",
                  f"link set {bridge} type bridge stp_state 0 forward_delay 0",
                  f"addr add {self.bridge_address}/24 dev {bridge}",
                  f"link set {bridge} up"])

    def _install_cleanup(self) -> None:
        ref = weakref.ref(self)

        def _atexit() -> None:
            tb = ref()
            if tb is not None:
                tb.down()

        atexit.register(_atexit)
        for sig in (signal.SIGTERM, signal.SIGHUP):
            # Turn "please stop" into KeyboardInterrupt so finally-blocks, pytest
            # finalizers and atexit run; leave handlers someone else installed alone.
            with contextlib.suppress(ValueError):  # not the main thread
                if signal.getsignal(sig) == signal.SIG_DFL:
                    signal.signal(sig, _raise_interrupt)

    # ---------------------------------------------------------------- properties
    @property
    def prefix(self) -> str:
        return self._state.prefix

    @property
    def root(self) -> Path:
        return Path(self._state.root)

    @property
    def bridge(self) -> str:
        return f"{self.prefix}-br"

    @property
    def subnet(self) -> str:
        return f"{SUBNET_BASE}.{self._state.octet}.0/24"

    @property
    def bridge_address(self) -> str:
        return f"{SUBNET_BASE}.{self._state.octet}.1"

    @property
    def nodes(self) -> list[TestNode]:
        return list(self._state.nodes)

    @property
    def user(self) -> users.BedUser | None:
        """The bed's unprivileged user (``create(user=...)``), or None."""
        s = self._state
        return users.BedUser(s.user, s.user_uid, s.user_uid, s.root) if s.user else None

    def _the_user(self) -> users.BedUser:
        if self.user is None:
            raise TestbedError(f"test bed {self.prefix} has no user",
                               hint="Testbed.create(user=NAME) / up --user NAME")
        return self.user

    def user_argv(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run on this host as the bed's user: in a private mount namespace that
        sees the bed's passwd/group/shadow and an opened /root (tests/testbed/as_user.sh).
        Give it ``user_env()``; the command's cwd must be one the user may enter."""
        u = self._the_user()
        return ["unshare", "--mount", "--propagation", "private", "--", "/bin/bash",
                str(users.AS_USER), str(self.root), u.name, *argv]

    def user_env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """``base`` (default: this environment) with the user's HOME, USER, LOGNAME."""
        u = self._the_user()
        return {**(os.environ if base is None else base), "HOME": str(u.home),
                "USER": u.name, "LOGNAME": u.name}

    @property
    def ssh_config(self) -> Path:
        return self.root / "ssh" / "config"

    @property
    def known_hosts(self) -> Path:
        return self.root / "ssh" / "known_hosts"

    @property
    def identity_file(self) -> Path:
        return self.root / "ssh" / "id_ed25519"

    @property
    def shared_dir(self) -> Path:
        return self.root / "shared"

    @property
    def local_mountpoint(self) -> Path:
        """The node-local directory: the same path on every node, private content."""
        return self.root / "scratch"

    @property
    def inventory_path(self) -> Path:
        return self.root / "inventory.yaml"

    def python_without_clusterkit(self) -> str:
        """A node interpreter that cannot import clusterkit (torch, deepspeed... it keeps).

        A venv over this interpreter's site-packages, whose sitecustomize (run after
        every .pth, so after the editable-install finder) removes that finder and
        refuses ``import clusterkit``: what a cluster node without clusterkit looks
        like. Created once per test bed under its root (every node sees the path).
        """
        venv = self.root / "venv-no-clusterkit"
        python = venv / "bin" / "python"
        if python.exists():
            return str(python)
        with flock(self.root / ".venv.lock"):
            if not python.exists():
                venv_over_this_python(venv)
                site_dir = next((venv / "lib").glob("python3*/site-packages"))
                write_atomic(site_dir / "sitecustomize.py", NO_CLUSTERKIT)
        return str(python)

    def node(self, node: TestNode | str) -> TestNode:
        name = node if isinstance(node, str) else node.name
        for n in self._state.nodes:
            if n.name == name:
                return n
        raise TestbedError(f"no node {name!r} in test bed {self.prefix}",
                           hint=f"nodes: {', '.join(n.name for n in self._state.nodes)}")

    # ------------------------------------------------------------------- growing
    def ensure(self, n: int) -> list[TestNode]:
        """Bring up (or grow to) ``n`` nodes, all new ones in parallel; return the first n."""
        if n > MAX_NODES:
            raise TestbedError(f"at most {MAX_NODES} nodes per test bed (asked for {n})")
        if self._down:
            raise TestbedError(f"test bed {self.prefix} was torn down")
        with flock(self.root / ".lock"):
            have = len(self._state.nodes)
            if n > have:
                self._grow(range(have + 1, n + 1))
                self.write_inventory(self.inventory_path)
        return self.nodes[:n]

    def _grow(self, indices: range) -> None:
        new = [self._plan_node(i) for i in indices]
        entries = [self._write_node_files(node) for node in new]
        self._state.nodes.extend(new)
        self._state.save()  # before creating anything, so `down` finds partial work
        # In place (append), not os.replace: running nodes bind-mount this file's inode.
        with open(self.root / "etc" / "hosts", "a") as fh:
            fh.write(sshfiles.etc_hosts_lines(entries))
        self._write_ssh_client_files()
        ip_batch(line for node in new for line in (
            f"netns add {node.netns}",
            f"link add {node.veth} type veth peer name eth0 address {self._mac(node)} "
            f"netns {node.netns}",
            f"link set {node.veth} master {self.bridge}",
            f"link set {node.veth} up",
        ))
        procs = {node.name: self._launch(node) for node in new}
        self._procs.update(procs)
        started = self._wait_started(new, procs)
        names = {node.name for node in started}
        self._state.nodes = [*[n for n in self._state.nodes if n.name not in names], *started]
        self._state.nodes.sort(key=lambda n: n.index)
        self._state.save()
        self._pin_neighbors(started)

    def _mac(self, node: TestNode) -> str:
        """A fixed, locally administered MAC per node (unique on the bed's bridge)."""
        return f"02:c4:{self._state.octet:02x}:00:{node.index >> 8:02x}:{node.index & 0xFF:02x}"

    def _pin_neighbors(self, new: Sequence[TestNode]) -> None:
        """Permanent node-to-node ARP entries. Measured at 32 x 1: with ARP left to the
        kernel, 9-17 of 32 ranks sat 35.5 s in init_process_group on every run, for
        clusterkit and DeepSpeed's runner alike (TCP retransmission timeouts while 32
        namespaces resolved each other on 2 busy cores); pinned, none did. A real LAN
        does not lose ARP to CPU load, so this removes a test-bed artifact, not a
        check: a node whose link goes down still drops every packet. The host's own
        entries stay dynamic (its SSH errors are those of a real client)."""
        fresh = {n.name for n in new}
        for node in self._state.nodes:
            peers = [p for p in (self._state.nodes if node.name in fresh else new)
                     if p.name != node.name]
            ip_batch((f"neigh replace {p.address} lladdr {self._mac(p)} dev eth0 nud permanent"
                      for p in peers), netns=node.netns)

    def _plan_node(self, index: int) -> TestNode:
        name = f"{self._state.name_prefix}{index}"
        return TestNode(name=name, index=index,
                        address=f"{SUBNET_BASE}.{self._state.octet}.{FIRST_HOST_OCTET + index}",
                        netns=f"{ROOT_PREFIX}{self.prefix}-{name}",
                        veth=f"{self.prefix}-v{index}")

    def _write_node_files(self, node: TestNode) -> sshfiles.HostEntry:
        d = self.root / "nodes" / node.name
        (d / "scratch").mkdir(parents=True, exist_ok=True)
        key = sshfiles.new_ed25519(f"root@{node.name}")
        write_atomic(d / "ssh_host_ed25519_key", key.private_openssh, 0o600)
        write_atomic(d / "ssh_host_ed25519_key.pub", key.public_openssh + "\n")
        write_atomic(d / "sshd_config", sshfiles.sshd_config(
            d / "ssh_host_ed25519_key", self.root / "ssh" / "authorized_keys",
            users_own_keys=self.user is not None))
        if self.user is not None:
            users.prepare_node(self.user, d)
        return sshfiles.HostEntry(node.name, node.address, key.public_openssh)

    def _host_entries(self) -> list[sshfiles.HostEntry]:
        out = []
        for node in self._state.nodes:
            pub = (self.root / "nodes" / node.name / "ssh_host_ed25519_key.pub").read_text()
            out.append(sshfiles.HostEntry(node.name, node.address, pub.strip()))
        return out

    def _write_ssh_client_files(self) -> None:
        entries = self._host_entries()
        text = sshfiles.known_hosts(entries)
        write_atomic(self.root / "ssh" / "known_hosts", text)
        write_atomic(self.root / "nodessh" / "known_hosts", text)
        globs = (f"{self._state.name_prefix}*", f"{SUBNET_BASE}.{self._state.octet}.*")
        write_atomic(self.ssh_config, sshfiles.host_ssh_config(self.root, entries, *globs))
        if self.user is not None:
            u = self.user
            users.write_client_files(
                u, [self.root / "nodes" / n.name for n in self._state.nodes], text,
                sshfiles.host_ssh_config(self.root, entries, *globs, ssh_dir=u.ssh_dir,
                                         user=u.name))

    def _launch(self, node: TestNode) -> subprocess.Popen[bytes]:
        log = open(self.root / "nodes" / node.name / "node.log", "ab")  # noqa: SIM115
        cidr = f"{node.address}/24"
        argv = ["nsenter", f"--net=/run/netns/{node.netns}",
                "unshare", "--mount", "--uts", "--pid", "--fork", "--kill-child",
                "--mount-proc", "--propagation", "slave",
                "/bin/bash", str(NODE_INIT), node.name, cidr, str(self.root),
                "1" if self._state.mask_bashrc else "0"]
        with log:
            # New session: a Ctrl-C in the terminal must reach us (we tear down), not the
            # nodes directly; nodes of a CLI test bed outlive the CLI process.
            return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT, cwd="/", env=NODE_ENV,
                                    start_new_session=True, close_fds=True)

    def _wait_started(self, nodes: Sequence[TestNode],
                      procs: dict[str, subprocess.Popen[bytes]]) -> list[TestNode]:
        """Wait until every node's init exists and its sshd wrote its pid file (= listens)."""
        deadline = time.monotonic() + 30.0 + 0.25 * len(nodes)
        pending = {node.name: node for node in nodes}
        done: list[TestNode] = []
        while pending:
            for name, node in list(pending.items()):
                proc = procs[name]
                if proc.poll() is not None:
                    log = self.root / "nodes" / name / "node.log"
                    raise TestbedError(f"node init exited with {proc.returncode}: {tail(log)}",
                                       host=name, path=str(log))
                init = _first_child(proc.pid)
                if init and Path(f"/proc/{init}/root/run/sshd.pid").exists():
                    started = start_time(init) or 0
                    done.append(TestNode(**{**asdict(node), "pid": init, "pid_start": started}))
                    del pending[name]
            if pending and time.monotonic() > deadline:
                raise TestbedError(f"{len(pending)} node(s) did not start sshd in time",
                                   host=",".join(sorted(pending)),
                                   hint=f"see {self.root}/nodes/<name>/node.log")
            if pending:
                time.sleep(0.02)
        return done

    # ------------------------------------------------------------ using nodes
    def _nsenter(self, node: TestNode | str, cwd: str | os.PathLike[str] | None) -> list[str]:
        n = self.node(node)
        if not alive(n.pid, n.pid_start):
            raise TestbedError("node is not running", host=n.name,
                               hint="bring it up again with tb.ensure(n)")
        return ["nsenter", f"--target={n.pid}", "--net", "--mount", "--uts", "--pid",
                f"--wd={cwd if cwd is not None else '/'}", "--"]

    def exec(self, node: TestNode | str, argv: Sequence[str], *, timeout: float = 60.0,
             input: str | None = None, env: dict[str, str] | None = None,
             cwd: str | os.PathLike[str] | None = None,
             check: bool = False) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` inside the node's namespaces (no SSH), capturing text output.

        On timeout the whole process group is killed and TimeoutExpired is raised.
        """
        cmd = [*self._nsenter(node, cwd), *argv]
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE if input is not None else
                                subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=env,
                                start_new_session=True)
        try:
            out, err = proc.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise
        result = subprocess.CompletedProcess(list(argv), proc.returncode, out, err)
        if check:
            result.check_returncode()
        return result

    def spawn(self, node: TestNode | str, argv: Sequence[str],
              **popen_kw: Any) -> subprocess.Popen[Any]:
        """Start a background process in the node's net+mount+UTS+PID namespaces.

        ``cwd`` is applied inside the node. The returned Popen signals the whole
        process group (terminate()/kill() reach the program, not just nsenter). It
        is killed at ``down()`` at the latest (it dies with the node).
        """
        cwd = popen_kw.pop("cwd", None)
        popen_kw.setdefault("stdin", subprocess.DEVNULL)
        popen_kw["start_new_session"] = True
        proc = _NodeProcess([*self._nsenter(node, cwd), *argv], **popen_kw)
        self._spawned.append(proc)
        return proc

    def node_local_path(self, node: TestNode | str, path_inside: str | os.PathLike[str]) -> Path:
        """Where the node-private file ``path_inside`` (under the node-local dir) lives."""
        n = self.node(node)
        inside = Path(path_inside)
        mount = self.local_mountpoint
        if not inside.is_absolute():
            inside = mount / inside
        try:
            rel = inside.relative_to(mount)
        except ValueError:
            raise TestbedError(f"{inside} is not under the node-local dir {mount}",
                               host=n.name) from None
        return self.root / "nodes" / n.name / "scratch" / rel

    # --------------------------------------------------------------- sshd control
    def _sshd_pidfile(self, node: TestNode) -> Path:
        return Path(f"/proc/{node.pid}/root/run/sshd.pid")

    def stop_sshd(self, node: TestNode | str, timeout: float = 10.0) -> None:
        """Stop the node's sshd listener: new connections are refused, the node stays up."""
        n = self.node(node)
        self.exec(n, ["sh", "-c", "[ ! -e /run/sshd.pid ] || kill $(cat /run/sshd.pid)"],
                  check=True)
        self._wait_for(lambda: not self._sshd_pidfile(n).exists(), timeout,
                       f"sshd on {n.name} did not stop")

    def start_sshd(self, node: TestNode | str, timeout: float = 10.0) -> None:
        """Start the node's sshd again (the node's init does it on SIGUSR1)."""
        n = self.node(node)
        if not alive(n.pid, n.pid_start):
            raise TestbedError("node is not running", host=n.name)
        os.kill(n.pid, signal.SIGUSR1)
        self._wait_for(lambda: self._sshd_pidfile(n).exists(), timeout,
                       f"sshd on {n.name} did not start")

    def rotate_host_key(self, node: TestNode | str, *, update_known_hosts: bool = False) -> str:
        """Give the node a NEW host key and restart its sshd; return the new public key.

        known_hosts keeps the old key unless ``update_known_hosts`` (so clients see
        "REMOTE HOST IDENTIFICATION HAS CHANGED").
        """
        n = self.node(node)
        d = self.root / "nodes" / n.name
        key = sshfiles.new_ed25519(f"root@{n.name}")
        self.stop_sshd(n)
        write_atomic(d / "ssh_host_ed25519_key", key.private_openssh, 0o600)
        write_atomic(d / "ssh_host_ed25519_key.pub", key.public_openssh + "\n")
        self.start_sshd(n)
        if update_known_hosts:
            self._write_ssh_client_files()
        return key.public_openssh

    @staticmethod
    def _wait_for(cond: Any, timeout: float, message: str) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            if time.monotonic() > deadline:
                raise TestbedError(message)
            time.sleep(0.02)

    # ------------------------------------------------------------ clusterkit glue
    def ssh_target(self, node: TestNode | str, *, as_user: bool = False) -> SSHTarget:
        """root's target, or with ``as_user`` the bed's user's (its files are the user's:
        use it from a process running as the user, ``user_argv``)."""
        n = self.node(node)
        if as_user:
            u = self._the_user()
            return SSHTarget(name=n.name, address=n.address, user=u.name, port=22,
                             identity_file=str(u.ssh_dir / "id_ed25519"),
                             config_file=str(u.ssh_dir / "config"),
                             known_hosts_file=str(u.ssh_dir / "known_hosts"))
        return SSHTarget(name=n.name, address=n.address, user="root", port=22,
                         identity_file=str(self.identity_file),
                         config_file=str(self.ssh_config),
                         known_hosts_file=str(self.known_hosts))

    def node_python(self) -> str:
        """The inventory's python: this interpreter, or with CLUSTERKIT_TESTBED_PYTHON=
        no-clusterkit one that cannot import clusterkit (nodes need only a Python)."""
        want = os.environ.get(NODE_PYTHON_ENV, "")
        if want == "no-clusterkit":
            return self.python_without_clusterkit()
        return want or sys.executable

    def inventory_dict(self, nodes: Sequence[TestNode | str] | None = None, slots: int = 2,
                       *, as_user: bool = False, **defaults_overrides: Any) -> dict[str, Any]:
        """``as_user``: log in as the bed's user, with its workdir and checkpoint dirs."""
        if as_user:
            defaults_overrides = _merge(users.inventory_overrides(self._the_user()),
                                        defaults_overrides)
        chosen = [self.node(n) for n in nodes] if nodes is not None else self.nodes
        defaults: dict[str, Any] = {
            "transport": "ssh",
            "ssh": {"user": "root", "port": 22, "identity_file": str(self.identity_file),
                    "config_file": str(self.ssh_config),
                    "known_hosts_file": str(self.known_hosts)},
            "gpus": 0,
            "slots": slots,
            # Nodes share the host's filesystem, so this path is valid on every node.
            "python": self.node_python(),
            "workdir": str(self.root / "work"),
            "checkpoint": {"shared_dir": str(self.shared_dir / "ckpt"),
                           "local_dir": str(self.local_mountpoint / "ckpt")},
        }
        return {
            "schema_version": 1,
            "cluster": {"name": f"cktb-{self.prefix}"},
            "defaults": _merge(defaults, defaults_overrides),
            "hosts": {n.name: {"address": n.address} for n in chosen},
        }

    def write_inventory(self, path: str | os.PathLike[str],
                        nodes: Sequence[TestNode | str] | None = None, slots: int = 2,
                        *, as_user: bool = False, **defaults_overrides: Any) -> Path:
        """Write a clusterkit inventory (docs/inventory.md) for ``nodes`` (default: all)."""
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        data = self.inventory_dict(nodes, slots, as_user=as_user, **defaults_overrides)
        write_atomic(out, "# clusterkit test bed inventory (tests/testbed)\n"
                     + yaml.safe_dump(data, sort_keys=False, default_flow_style=False))
        return out

    # ------------------------------------------------------------- losing a node
    def destroy(self, node: TestNode | str) -> None:
        """Lose ``node`` for good, as a dead server: every process in its namespaces
        killed, its network namespace (and with it its veth and address) deleted, its
        node-private ``/scratch`` deleted, and the other nodes' pinned ARP entry for it
        dropped (a dead host's address then fails like one: no ARP answer, "no route to
        host", instead of packets swallowed by a permanent entry). Its name stays in
        the state (``ensure`` never brings it back; ``down`` has nothing left to do for
        it). Idempotent."""
        n = self.node(node)
        if n.name in self._state.destroyed:
            return
        with flock(self.root / ".lock"):
            self._state.destroyed.append(n.name)
            self._state.save()  # first: a crash half-way still counts it as lost
            ns_path = Path("/run/netns") / n.netns
            pids = [n.pid] if n.pid and alive(n.pid, n.pid_start) else []
            proc = self._procs.pop(n.name, None)
            pids += [proc.pid] if proc is not None and proc.poll() is None else []
            left = kill_and_wait(pids) + kill_and_wait(pids_in_netns([ns_path]))
            if proc is not None:
                with contextlib.suppress(Exception):
                    proc.wait(timeout=5)
            if ns_path.exists():
                ip_batch([f"netns del {n.netns}"], force=True)
            _wait_links_gone({n.veth}, timeout=5.0)
            for peer in self.nodes:
                if peer.name != n.name and peer.name not in self._state.destroyed \
                        and alive(peer.pid, peer.pid_start):
                    ip_batch([f"neigh del {n.address} dev eth0"], netns=peer.netns, force=True)
            shutil.rmtree(self.root / "nodes" / n.name / "scratch", ignore_errors=True)
        if left:
            raise TestbedError(f"processes of {n.name} survived SIGKILL: {left}", host=n.name)

    def destroyed(self, node: TestNode | str) -> bool:
        return self.node(node).name in self._state.destroyed

    # ------------------------------------------------------------------ teardown
    def down(self) -> None:
        """Remove processes, namespaces, links, mounts and the root dir. Idempotent."""
        if self._down:
            return
        self._down = True
        _teardown(self._state, self._procs.values(), self._spawned)


# ---------------------------------------------------------------------- helpers
def _raise_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _first_child(pid: int) -> int | None:
    try:
        kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return None
    return int(kids[0]) if kids else None


def _used_octets() -> set[int]:
    """Subnets taken by other test beds or overlapping any address/route of the host."""
    used: set[int] = set()
    for state_file in BASE_DIR.glob(f"{ROOT_PREFIX}*/state.json"):
        with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
            used.add(int(json.loads(state_file.read_text())["octet"]))
    nets = []
    for cmd in (["ip", "-4", "-o", "addr", "show"], ["ip", "-4", "route", "show", "table", "all"]):
        for line in run(cmd, check=False).stdout.splitlines():
            for word in line.split():
                with contextlib.suppress(ValueError):
                    if "/" in word or word[:1].isdigit():
                        nets.append(ipaddress.ip_network(word, strict=False))
    for k in range(1, 255):
        mine = ipaddress.ip_network(f"{SUBNET_BASE}.{k}.0/24")
        if any(net.version == 4 and net.prefixlen > 0 and net.overlaps(mine) for net in nets):
            used.add(k)
    return used


def _allocate(prefix: str | None, persistent: bool, mask_bashrc: bool,
              name_prefix: str) -> _State:
    if prefix is not None and not (prefix[:1].isalpha() and prefix.isalnum()
                                   and prefix.islower() and len(prefix) <= 8):
        raise TestbedError(f"bad test bed prefix {prefix!r}",
                           hint="1-8 lowercase letters/digits, starting with a letter")
    used = _used_octets()
    octet = next((k for k in range(1, 255) if k not in used), None)
    if octet is None:
        raise TestbedError("no free 10.213.K.0/24 subnet left", hint="python -m tests.testbed down --all")
    if prefix is None:
        prefix = next(p for p in (f"tb{octet}", *(f"tb{octet}x{i}" for i in range(99)))
                      if not (BASE_DIR / f"{ROOT_PREFIX}{p}").exists())
    root = BASE_DIR / f"{ROOT_PREFIX}{prefix}"
    if root.exists():
        raise TestbedError(f"test bed {prefix!r} already exists", path=str(root),
                           hint=f"python -m tests.testbed down --prefix {prefix}")
    if any(name.startswith(f"{prefix}-") for name in link_names()):
        raise TestbedError(f"network links named {prefix}-* already exist",
                           hint=f"python -m tests.testbed down --prefix {prefix}")
    root.mkdir(mode=0o755)
    me = os.getpid()
    state = _State(prefix=prefix, octet=octet, root=str(root), owner_pid=me,
                   owner_start=start_time(me) or 0, persistent=persistent,
                   mask_bashrc=mask_bashrc, name_prefix=name_prefix)
    state.save()
    return state


def _ensure_root_ssh_mountpoint() -> None:
    """Nodes bind-mount the test bed's ssh dir over /root/.ssh, which needs a mount
    point. If the host has no /root/.ssh we create an empty one (and remove it when
    the last test bed goes); its content is never touched."""
    target = Path("/root/.ssh")
    if target.exists():
        return
    target.mkdir(mode=0o700)
    ROOT_SSH_MARKER.write_text("created by tests/testbed; removed with the last test bed\n")


def _teardown(state: _State, procs: Any = (), spawned: Any = ()) -> None:
    root = Path(state.root)
    # 1. processes: the node inits (taking their PID namespaces with them) and
    #    anything else living in one of our network namespaces (e.g. a slurmd).
    ns_paths = [Path("/run/netns") / n.netns for n in state.nodes]
    pids = [n.pid for n in state.nodes if n.pid and alive(n.pid, n.pid_start)]
    pids += [p.pid for p in procs if p.poll() is None]  # launched, init not known yet
    kill_and_wait(pids)
    left = kill_and_wait(pids_in_netns(ns_paths))
    left += kill_and_wait(pids_mentioning(f"{root}/"))  # host daemons of a killed session
    for proc in [*procs, *spawned]:
        with contextlib.suppress(Exception):
            proc.kill()
            proc.wait(timeout=5)
    # 2. namespaces, then links. With no process left, deleting a netns destroys its
    #    veth pair in one batched kernel cleanup (128 nodes: ~0.1 s, versus ~2.5 s
    #    for one `link del` per veth); whatever is left is deleted explicitly.
    ip_batch((f"netns del {n.netns}" for n in state.nodes
              if (Path("/run/netns") / n.netns).exists()), force=True)
    _wait_links_gone({n.veth for n in state.nodes if n.veth}, timeout=5.0)
    stray = {name for name in link_names() if name.startswith(f"{state.prefix}-")}
    ip_batch((f"link del {name}" for name in sorted(stray)), force=True)
    # 3. mounts in the host namespace (there should be none; never rmtree through one)
    for point in sorted(mountpoints(), reverse=True):
        if point.startswith(f"{root}/") or point == str(root):
            run(["umount", "-l", point], check=False)
    shutil.rmtree(root, ignore_errors=True)
    if left:
        raise TestbedError(f"processes survived SIGKILL: {left}", path=str(root))
    with flock(GLOBAL_LOCK):
        _cleanup_host_if_last()


def _wait_links_gone(names: set[str], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while names & link_names() and time.monotonic() < deadline:
        time.sleep(0.02)


def _cleanup_host_if_last() -> None:
    """When no test bed is left, undo the two host-wide traces we may have created."""
    if any(BASE_DIR.glob(f"{ROOT_PREFIX}*/state.json")):
        return
    root_ssh = Path("/root/.ssh")
    if ROOT_SSH_MARKER.exists():
        with contextlib.suppress(OSError):
            root_ssh.rmdir()  # only succeeds while still empty
        ROOT_SSH_MARKER.unlink(missing_ok=True)
    netns_dir = Path("/run/netns")
    # `ip netns add` leaves /run/netns bind-mounted on itself; drop it once empty.
    if netns_dir.is_dir() and not any(netns_dir.iterdir()) and str(netns_dir) in mountpoints():
        run(["umount", str(netns_dir)], check=False)


def _state_alive(state: _State) -> bool:
    return alive(state.owner_pid, state.owner_start)


def _sweep_orphans() -> None:
    """Tear down non-persistent test beds whose owner process died (e.g. kill -9)."""
    for state_file in BASE_DIR.glob(f"{ROOT_PREFIX}*/state.json"):
        try:
            state = _State.load(state_file)
        except (OSError, ValueError, TypeError, KeyError):
            continue
        if not state.persistent and not _state_alive(state):
            with contextlib.suppress(TestbedError):
                _teardown(state)


def down_prefix(prefix: str) -> bool:
    """Tear down one test bed by prefix, from any process; tolerate a broken state file.

    Returns False when there was nothing to remove."""
    root = BASE_DIR / f"{ROOT_PREFIX}{prefix}"
    try:
        state = _State.load(root / "state.json")
    except (OSError, ValueError, TypeError, KeyError):
        state = _State(prefix=prefix, octet=0, root=str(root), owner_pid=0, owner_start=0,
                       nodes=_guess_nodes(prefix))
        links = [n for n in link_names() if n.startswith(f"{prefix}-")]
        if not root.exists() and not state.nodes and not links:
            return False
    _teardown(state)
    return True


def _guess_nodes(prefix: str) -> list[TestNode]:
    """Without a state file, find our namespaces by name (cktb-<prefix>-<node>)."""
    netns_dir = Path("/run/netns")
    nodes = []
    head = f"{ROOT_PREFIX}{prefix}-"
    for entry in sorted(netns_dir.glob(f"{head}*")) if netns_dir.is_dir() else []:
        nodes.append(TestNode(name=entry.name[len(head):], index=0, address="",
                              netns=entry.name, veth=""))
    return nodes


def down_all() -> list[str]:
    """Tear down every test bed on this host (all /tmp/cktb-*); return their prefixes."""
    prefixes = set(Testbed.list_prefixes())
    netns_dir = Path("/run/netns")
    if netns_dir.is_dir():
        for entry in netns_dir.glob(f"{ROOT_PREFIX}*-*"):
            prefixes.add(entry.name[len(ROOT_PREFIX):].split("-", 1)[0])
    for prefix in sorted(prefixes):
        down_prefix(prefix)
    with flock(GLOBAL_LOCK):
        _cleanup_host_if_last()
    return sorted(prefixes)


@contextlib.contextmanager
def temporary(n: int, **create_kw: Any) -> Iterator[Testbed]:
    """``with temporary(7) as tb:`` — a test bed with n nodes, always torn down."""
    tb = Testbed.create(**create_kw)
    try:
        tb.ensure(n)
        yield tb
    finally:
        tb.down()
