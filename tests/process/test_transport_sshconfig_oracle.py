"""``ssh -G`` is the oracle: our ssh_config resolution agrees with OpenSSH case by case.

Each case writes a user config (``~/.ssh/config``) and a system config
(``/etc/ssh/ssh_config`` + ``ssh_config.d/``), then, in a private mount namespace
where those are bind-mounted in place (nothing outside the test changes), runs
``ssh -G`` with the target's own options (exactly the ``-o`` words the OpenSSH tar
streams pass) and our resolver (in the same namespace, under the system Python),
and compares hostname, user, port, identity files, ProxyJump and known-hosts files.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pytest

from clusterkit.remote.base import SSHTarget
from tests.paths import REPO

SYS_PYTHON = "/usr/bin/python3"  # outside /root, which the namespace hides

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("ssh")
    or not os.path.exists(SYS_PYTHON), reason="needs root, unshare, ssh and /usr/bin/python3")

HELPER = """
import json, sys
sys.path.insert(0, sys.argv[1])
from clusterkit.remote.base import SSHTarget
from clusterkit.remote.sshconfig import ConfigCache, resolve
t = SSHTarget(**json.loads(sys.argv[2]))
ep = resolve(ConfigCache(), t)
print(json.dumps({"hostname": ep.hostname, "user": ep.user, "port": str(ep.port),
                  "identityfile": list(ep.identity_files), "proxyjump": ep.jump and (
                      (ep.jump.proxy_jump + "," if ep.jump.proxy_jump else "") + ep.jump.name),
                  "userknownhostsfile": list(ep.known_hosts_files),
                  "globalknownhostsfile": list(ep.global_known_hosts_files)}))
"""

NODES_CONF = ("Host node3\n  HostName 10.9.0.13\n  User alice\n  Port 2222\n"
              "  IdentityFile /keys/id_node\n  UserKnownHostsFile /keys/known_hosts\n")
DEBIAN_SYSTEM = "Include /etc/ssh/ssh_config.d/*.conf\nHost *\n    SendEnv LANG LC_*\n"


@dataclass(frozen=True)
class Case:
    name: str
    host: str
    user: str = ""  # ~/.ssh/config
    system: str = ""  # /etc/ssh/ssh_config
    dropins: dict[str, str] = field(default_factory=dict)  # /etc/ssh/ssh_config.d/<name>
    user_files: dict[str, str] = field(default_factory=dict)  # ~/.ssh/<name>
    target: dict[str, object] = field(default_factory=dict)  # inventory fields
    identities: bool = True  # compare IdentityFile (OpenSSH's default list is longer)


CASES = [
    Case("system-file-only", "node3", system=DEBIAN_SYSTEM, dropins={"nodes.conf": NODES_CONF}),
    Case("user-first-then-system", "node3", user="Host node3\n  User bob\n  Port 2200\n",
         system=DEBIAN_SYSTEM, dropins={"nodes.conf": NODES_CONF}),
    Case("inventory-fields-win", "node3", user="Host node3\n  User bob\n",
         system=DEBIAN_SYSTEM, dropins={"nodes.conf": NODES_CONF},
         target={"user": "root", "port": 22, "identity_file": "/inv/key",
                 "known_hosts_file": "/inv/kh"}),
    Case("match-host-sees-hostname", "n1",
         system="Host n1\n  HostName 10.1.1.1\nMatch host 10.1.1.*\n  User matched\n  Port 2022\n",
         identities=False),
    Case("match-originalhost-not-user", "gpu7",
         user="Match originalhost gpu* !user root\n  Port 2201\n"
              "Match originalhost gpu* user root\n  Port 2202\n", identities=False),
    Case("match-final", "n2",
         system="Host n2\n  HostName 10.2.0.2\nMatch final host 10.2.*\n  User late\n",
         identities=False),
    Case("relative-include-in-user-config", "db1", user="Include conf.d/*.conf\n",
         user_files={"conf.d/a.conf": "Host db*\n  HostName db.example\n  User dbadmin\n"
                                      "  IdentityFile ~/.ssh/id_%h_%r\n"}),
    Case("include-inside-other-block-is-skipped", "node1",
         user="Host other\n  Include extra.conf\nHost node1\n  Port 2301\n",
         user_files={"extra.conf": "User nobody-should-see-this\n"}, identities=False),
    Case("include-state-does-not-leak", "node2",
         system="Host node*\n  Include /etc/ssh/ssh_config.d/*.conf\n  Port 2201\nHost *\n  User fb\n",
         dropins={"a.conf": "Host unrelated\n  User x\n"}, identities=False),
    Case("identity-files-accumulate", "node4", user="Host *\n  IdentityFile ~/.ssh/a\n",
         system="Host node*\n  IdentityFile /keys/b\n  IdentityFile ~/.ssh/a\n"),
    Case("proxyjump-chain", "node5",
         user="Host node5\n  ProxyJump alice@bastion:2022,gw\n", identities=False),
    Case("patterns-negation-and-equals", "node4",
         user="Host node? !node4\n  User q\nHost node?\n  USER=r\n  Port = 2400\n",
         identities=False),
    Case("global-known-hosts-from-system-file", "node1",
         system="Host node*\n  GlobalKnownHostsFile /etc/ssh/cluster_known_hosts\n",
         identities=False),
    Case("known-hosts-tokens-and-quotes", "node6",
         user='Host node6\n  UserKnownHostsFile "~/.ssh/kh %h" %d/kh2\n', identities=False),
    Case("explicit-config-file-ignores-system", "node3", user="Host node3\n  User fromfile\n",
         system=DEBIAN_SYSTEM, dropins={"nodes.conf": NODES_CONF},
         target={"config_file": "/root/.ssh/config"}, identities=False),
]


def _write_case(root: Path, case: Case) -> None:
    (root / "etc" / "ssh_config.d").mkdir(parents=True)
    (root / "etc" / "ssh_config").write_text(case.system)
    for name, text in case.dropins.items():
        (root / "etc" / "ssh_config.d" / name).write_text(text)
    (root / "home").mkdir()
    (root / "home" / "config").write_text(case.user)
    for name, text in case.user_files.items():
        (root / "home" / name).parent.mkdir(parents=True, exist_ok=True)
        (root / "home" / name).write_text(text)


def _ssh_g(target: SSHTarget) -> list[str]:
    argv = ["ssh", "-G"]
    if target.config_file:
        argv += ["-F", target.config_file]
    for key, value in target.options().items():  # the OpenSSH tar streams' -o words
        argv += ["-o", f"{key}={value}"]
    return [*argv, "--", target.address]


def _in_namespace(root: Path, target: SSHTarget) -> tuple[dict[str, list[str]], dict[str, object]]:
    helper = root / "helper.py"
    helper.write_text(HELPER)
    script = " && ".join([
        "mount --make-rprivate /", f"mount --bind {root / 'etc'} /etc/ssh",
        "mount -t tmpfs none /root", "mkdir -p /root/.ssh", f"cp -r {root / 'home'}/. /root/.ssh/",
        shlex.join(_ssh_g(target)) + " </dev/null", "echo =====",
        shlex.join([SYS_PYTHON, str(helper), str(REPO), json.dumps(asdict(target))]),
    ])
    res = subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True, text=True,
                         timeout=30, check=False)
    assert res.returncode == 0, res.stderr
    oracle_text, ours = res.stdout.split("=====\n")
    oracle: dict[str, list[str]] = {}
    for line in oracle_text.splitlines():
        key, _, value = line.partition(" ")
        oracle.setdefault(key, []).append(value)
    return oracle, json.loads(ours)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_resolution_agrees_with_ssh_G(case: Case, tmp_path: Path) -> None:
    _write_case(tmp_path, case)
    target = SSHTarget(name=case.host, address=case.host, **case.target)  # type: ignore[arg-type]
    oracle, ours = _in_namespace(tmp_path, target)
    want = {"hostname": oracle["hostname"][0], "user": oracle["user"][0],
            "port": oracle["port"][0], "proxyjump": (oracle.get("proxyjump") or [None])[0],
            "userknownhostsfile": oracle["userknownhostsfile"][0],
            "globalknownhostsfile": oracle["globalknownhostsfile"][0]}
    got = {k: ours[k] for k in want}
    for key in ("userknownhostsfile", "globalknownhostsfile"):
        got[key] = " ".join(ours[key])  # ssh -G joins them
    assert got == want, case.name
    if case.identities:
        # ssh -G prints IdentityFile unexpanded: expand with the values it decided.
        home, user, host = "/root", want["user"], want["hostname"]
        expanded = [v.replace("~", home, 1).replace("%h", str(host)).replace("%r", str(user))
                    .replace("%d", home) for v in oracle["identityfile"]]
        # OpenSSH lists a file named twice twice (and tries it twice); we try it once.
        assert ours["identityfile"] == list(dict.fromkeys(expanded)), case.name


def test_the_case_table_is_not_vacuous() -> None:
    assert len(CASES) >= 12 and sys.platform.startswith("linux")


def test_pdsh_ssh_config_keeps_what_the_system_files_say(tmp_path: Path) -> None:
    """DeepSpeed's pdsh reads our rendered file with -F: for an inventory that lists only
    names, ssh must still take HostName/User/Port from /etc/ssh/ssh_config.d."""
    from clusterkit.inventory import Host
    from clusterkit.render.ssh_config import render_ssh_config

    case = Case("pdsh", "node3", system=DEBIAN_SYSTEM, dropins={"nodes.conf": NODES_CONF})
    _write_case(tmp_path, case)
    rendered = tmp_path / "pdsh_ssh_config"
    rendered.write_text(render_ssh_config([Host(name="node3", address="node3")]))
    script = " && ".join([
        "mount --make-rprivate /", f"mount --bind {tmp_path / 'etc'} /etc/ssh",
        "mount -t tmpfs none /root", "mkdir -p /root/.ssh",
        f"ssh -G -F {rendered} node3 </dev/null", "echo =====", "ssh -G node3 </dev/null"])
    res = subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True, text=True,
                         timeout=30, check=False)
    assert res.returncode == 0, res.stderr
    via_pdsh, plain = res.stdout.split("=====\n")

    def pick(text: str) -> dict[str, str]:
        keys = ("hostname", "user", "port", "userknownhostsfile")
        return {k: v for k, _, v in (ln.partition(" ") for ln in text.splitlines()) if k in keys}

    assert pick(via_pdsh) == pick(plain)
    assert pick(plain)["hostname"] == "10.9.0.13"
