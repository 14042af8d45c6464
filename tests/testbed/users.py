"""An unprivileged user on every node of a test bed (``Testbed.create(user=NAME)``).

Real clusters are used by people who are not root. With ``user`` set, the test bed
makes one user, with the same name, uid and gid on every node, **without editing the
host's /etc**: the bed writes its own copies (``<root>/etc/passwd``, ``group``,
``shadow``: the host's lines plus the user's) and every node bind-mounts them over
/etc/passwd, /etc/group and /etc/shadow inside its own mount namespace, so they go
away with the node. Per node (``<root>/nodes/<name>/``):

* ``home/<user>``, bind-mounted on ``<root>/home`` inside the node: the user's home
  (``<root>/home/<user>``, the same path everywhere, private content), with its own
  ``.ssh`` (``authorized_keys``, a key, ``config`` and ``known_hosts`` for node to node
  logins) and a copy of root's DeepSpeed JIT build cache (see ``_seed_cache``);
* ``scratch/<user>``: the user's node-local directory, ``<root>/scratch/<user>`` inside
  the node (the inventory's ``checkpoint.local_dir`` is ``.../<user>/ckpt``).

Shared: ``<root>/shared/<user>`` (``checkpoint.shared_dir``), ``<root>/work/<user>``
(``workdir``). On the host, ``<root>/home/<user>`` is the user's home for the
launcher: its ``.ssh`` holds the client files the inventory names (owned by the user:
ssh refuses a config or key another user owns).

/root is mode 700 on this machine and the interpreter lives under /root/.pyenv, so a
user could not start Python. Inside each node (and in the launcher's namespace, see
``user_argv``) ``open_root.sh`` puts a mode-755 tmpfs over /root holding binds of each
of root's entries: the same paths, their own modes, /root's mode alone changed.

The launcher itself runs as the user too (``Testbed.user_argv``): ``unshare --mount``
gives it a private mount namespace with the same binds, then ``setpriv`` drops to the
user. Nothing of it is seen outside that process tree.
"""

from __future__ import annotations

import grp
import os
import pwd
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.testbed import sshfiles
from tests.testbed.sysutil import TestbedError, write_atomic

FIRST_UID = 3100  # the first uid (and gid) tried; the first free pair is taken
AS_USER = Path(__file__).with_name("as_user.sh")
# What a rank needs from root's JIT build cache (DeepSpeed's shm comm op on CPU).
JIT_CACHE = Path("/root/.cache/torch_extensions")


@dataclass(frozen=True)
class BedUser:
    name: str
    uid: int
    gid: int
    root: str  # the test bed's root directory

    @property
    def home(self) -> Path:
        """The user's home: the same path on every node (node-private content) and here."""
        return Path(self.root) / "home" / self.name

    @property
    def ssh_dir(self) -> Path:
        """The launcher-side ssh files (the inventory names them)."""
        return self.home / ".ssh"

    @property
    def local_dir(self) -> Path:
        """The user's node-local directory (inside nodes)."""
        return Path(self.root) / "scratch" / self.name

    @property
    def shared_dir(self) -> Path:
        return Path(self.root) / "shared" / self.name

    @property
    def workdir(self) -> Path:
        return Path(self.root) / "work" / self.name


def pick_ids(name: str) -> tuple[int, int]:
    """The first uid (= gid) from FIRST_UID that the host uses for no user and no group."""
    if not (name[:1].isalpha() and name.isalnum() and name.islower() and len(name) <= 16):
        raise TestbedError(f"bad test bed user name {name!r}",
                           hint="1-16 lowercase letters/digits, starting with a letter")
    with_name = [e for e in pwd.getpwall() if e.pw_name == name]
    if with_name:
        raise TestbedError(f"the host already has a user {name!r}",
                           hint="pick another name: the bed's user exists only in its nodes")
    uids = {e.pw_uid for e in pwd.getpwall()}
    gids = {e.gr_gid for e in grp.getgrall()} | {e.pw_gid for e in pwd.getpwall()}
    uid = next(u for u in range(FIRST_UID, 60000) if u not in uids and u not in gids)
    return uid, uid


def write_etc(user: BedUser, etc: Path) -> None:
    """The bed's passwd/group/shadow: the host's lines plus the user's."""
    line = f"{user.name}:x:{user.uid}:{user.gid}:clusterkit test bed user:{user.home}:/bin/bash\n"
    write_atomic(etc / "passwd", _host("/etc/passwd") + line, 0o644)
    write_atomic(etc / "group", _host("/etc/group") + f"{user.name}:x:{user.gid}:\n", 0o644)
    # "*", not "!": with UsePAM no, sshd refuses key logins to a locked account.
    write_atomic(etc / "shadow", _host("/etc/shadow") + f"{user.name}:*:19000:0:99999:7:::\n",
                 0o600)


def _host(path: str) -> str:
    text = Path(path).read_text()
    return text if text.endswith("\n") or not text else text + "\n"


def prepare_host(user: BedUser, key: sshfiles.KeyPair) -> None:
    """The user's shared directories and launcher-side home (before any node exists)."""
    for d in (user.ssh_dir, user.shared_dir / "ckpt", user.workdir):
        d.mkdir(parents=True, exist_ok=True)
    write_atomic(user.ssh_dir / "id_ed25519", key.private_openssh, 0o600)
    write_atomic(user.ssh_dir / "id_ed25519.pub", key.public_openssh + "\n")
    for d in (user.home, user.shared_dir, user.workdir):
        _chown_tree(d, user)


def prepare_node(user: BedUser, node_dir: Path) -> None:
    """A node's private home (ssh files, build cache) and node-local directory."""
    key = sshfiles.KeyPair((user.ssh_dir / "id_ed25519").read_text(),
                           (user.ssh_dir / "id_ed25519.pub").read_text().strip())
    home = node_dir / "home" / user.name
    ssh = home / ".ssh"
    ssh.mkdir(parents=True, exist_ok=True)
    (node_dir / "scratch" / user.name).mkdir(parents=True, exist_ok=True)
    write_atomic(ssh / "authorized_keys", key.public_openssh + "\n", 0o600)
    write_atomic(ssh / "id_ed25519", key.private_openssh, 0o600)
    write_atomic(ssh / "id_ed25519.pub", key.public_openssh + "\n")
    write_atomic(ssh / "config", sshfiles.node_ssh_config(user.name), 0o600)
    _seed_cache(home)
    _chown_tree(home, user)
    _chown_tree(node_dir / "scratch" / user.name, user)


def write_client_files(user: BedUser, node_dirs: list[Path], known_hosts: str,
                       host_config: str) -> None:
    """known_hosts (every node's home and the launcher side) and the launcher's config."""
    for ssh in [user.ssh_dir, *(d / "home" / user.name / ".ssh" for d in node_dirs)]:
        if ssh.is_dir():
            write_atomic(ssh / "known_hosts", known_hosts, 0o644)
            _chown(ssh / "known_hosts", user)
    write_atomic(user.ssh_dir / "config", host_config, 0o600)
    _chown(user.ssh_dir / "config", user)


def _seed_cache(home: Path) -> None:
    """Root's built JIT ops (DeepSpeed's shm comm op, ~1 MB), copied with their times.

    Every rank builds it at start-up when the user's cache lacks it: with a private home
    per node that is one C++ build per node, minutes on this 2-core machine, for what a
    real user's first job does once. The same interpreter path (see open_root.sh) keeps
    torch's build files valid; a build lock left behind is not copied (torch would wait
    on it forever)."""
    if not JIT_CACHE.is_dir():
        return
    target = home / ".cache" / "torch_extensions"
    shutil.copytree(JIT_CACHE, target, dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("lock", ".ninja_lock"))


def _chown(path: Path, user: BedUser) -> None:
    os.chown(path, user.uid, user.gid, follow_symlinks=False)


def _chown_tree(top: Path, user: BedUser) -> None:
    _chown(top, user)
    for p in top.rglob("*"):
        _chown(p, user)


def inventory_overrides(user: BedUser) -> dict[str, Any]:
    """``defaults`` of an inventory that logs in as the user (Testbed.write_inventory)."""
    return {
        "ssh": {"user": user.name, "identity_file": str(user.ssh_dir / "id_ed25519"),
                "config_file": str(user.ssh_dir / "config"),
                "known_hosts_file": str(user.ssh_dir / "known_hosts")},
        "workdir": str(user.workdir),
        "checkpoint": {"shared_dir": str(user.shared_dir / "ckpt"),
                       "local_dir": str(user.local_dir / "ckpt")},
    }


def assert_owned_by_user(user: BedUser | None, paths: Iterable[Path]) -> None:
    """Every one of ``paths``, and at least one, belongs to the bed's ``user`` (a bed
    made with one)."""
    assert user is not None
    owners = {str(p): p.stat().st_uid for p in paths}
    assert set(owners.values()) == {user.uid}, owners
