"""Inventory loading: good files parse to the right hosts; bad ones give one clear line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from clusterkit.cli.main import main
from clusterkit.inventory import load_inventory, local_inventory, parse_inventory
from tests.paths import REPO

GOOD = """\
schema_version: 1
cluster: {name: t}
defaults:
  ssh: {user: root, port: 2222}
  gpus: 2
  python: /opt/py/bin/python
  checkpoint: {local_dir: /scratch/ckpt}
  env: {NCCL_DEBUG: WARN, FLAG: "true"}
hosts:
  node[01-03]:
    address: 10.0.0.[11-13]
  node04:
    address: 10.0.0.14
    ssh: {port: 22}
    slots: 1
    python: /other/bin/python
    env: {EXTRA: "1"}
"""


def test_good_inventory_parses_in_order_with_overrides() -> None:
    inv = parse_inventory(GOOD, "good.yaml")
    assert inv.names() == ["node01", "node02", "node03", "node04"]
    assert [h.address for h in inv.hosts] == ["10.0.0.11", "10.0.0.12", "10.0.0.13", "10.0.0.14"]
    n1, n4 = inv.host("node01"), inv.host("node04")
    assert (n1.slots, n1.gpus, n1.ssh.port, n1.ssh.user) == (2, 2, 2222, "root")
    assert (n4.slots, n4.ssh.port, n4.ssh.user, n4.python) == (1, 22, "root", "/other/bin/python")
    assert dict(n4.env) == {"NCCL_DEBUG": "WARN", "FLAG": "true", "EXTRA": "1"}
    assert n1.checkpoint.local_dir == "/scratch/ckpt"


@pytest.mark.parametrize("path", sorted((REPO / "hostfiles").glob("*.yaml")))
def test_example_inventories_load(path: Path) -> None:
    assert load_inventory(path).hosts


def test_embedded_default_has_private_node_dirs() -> None:
    inv = local_inventory("/base", nodes=2, slots=2)
    dirs = {h.checkpoint.local_dir for h in inv.hosts}
    assert len(dirs) == 2 and all(h.transport == "local" for h in inv.hosts)


# (inventory text, expected "file:line" or key fragment, fragment of the message)
BAD = [
    ("schema_version: 1\nhosts:\n  node1:\n    slot: 2\n", ":4:", "did you mean 'slots'"),
    ("schema_version: 1\nhosts:\n  node[1-3:\n    slots: 2\n", ":3:", "bad host range"),
    ("schema_version: 1\nhosts:\n  node[5-1]: {}\n", ":3:", "goes backwards"),
    ("schema_version: 1\nhosts:\n  node[1-3]: {}\n  node2: {}\n", ":4:", "duplicate host 'node2'"),
    ("schema_version: 1\nhosts:\n  node1: {slots: 0}\n", ":3:", "between 1 and"),
    ("schema_version: 1\nhosts:\n  node1: {slots: -2}\n", ":3:", "between 1 and"),
    ("schema_version: 1\nhosts:\n  node1: {slots: two}\n", ":3:", "must be an integer"),
    ("schema_version: 1\nhosts:\n  node1: {gpus: 2\n", ":", "YAML syntax error"),
    ("schema_version: 1\nhosts:\n\tnode1: {}\n", ":3:", "YAML syntax error"),
    ("hosts:\n  node1: {}\n", ":1:", "missing schema_version"),
    ("schema_version: 7\nhosts:\n  node1: {}\n", ":1:", "not supported"),
    ("schema_version: 1\nhosts: {}\n", ":2:", "non-empty mapping"),
    ("schema_version: 1\n", ":1:", "non-empty mapping"),
    ("schema_version: 1\nhost:\n  node1: {}\n", ":2:", "did you mean 'hosts'"),
    ("schema_version: 1\nhosts:\n  node[1-3]:\n    address: 10.0.0.[1-2]\n", ":3:", "3 names but"),
    ("schema_version: 1\nhosts:\n  node[1-3]:\n    address: 10.0.0.1\n", ":3:", "one address"),
    ("schema_version: 1\nhosts:\n  node1:\n    python: bin/python\n", ":4:", "absolute path"),
    ("schema_version: 1\nhosts:\n  node1:\n    ssh: {port: 70000}\n", ":4:", "between 1 and 65535"),
    ("schema_version: 1\nhosts:\n  node1:\n    ssh: {usr: root}\n", ":4:", "did you mean 'user'"),
    ("schema_version: 1\nhosts:\n  node1:\n    transport: telnet\n", ":4:", "one of ssh, local"),
    ("schema_version: 1\nhosts:\n  node1: {}\n  node1: {}\n", ":4:", "duplicate key 'node1'"),
    ("schema_version: 1\nhosts:\n  'node;rm -rf /': {}\n", ":3:", "not a plain host name"),
    ("schema_version: 1\nhosts:\n  node1:\n    env: {A: [1, 2]}\n", ":4:", "scalar value"),
    ("schema_version: 1\nhosts:\n  node1:\n    checkpoint: {local: /x}\n", ":4:", "local_dir"),
    # issue 25: what the launch refuses, refused here, where the user wrote it
    ("schema_version: 1\nhosts:\n  node1:\n    env: {A: \"x$HOME\"}\n", ":4: hosts.node1.env.A",
     "contains '$'"),
    ("schema_version: 1\nhosts:\n  node1:\n    env: {A: \" x\"}\n", ":4:", "trailing whitespace"),
    ("schema_version: 1\nhosts:\n  node1:\n    workdir: ~/proj\n", ":4:", "nothing expands ~"),
    ("schema_version: 1\nhosts:\n  node1:\n    checkpoint: {local_dir: ~/ck}\n", ":4:",
     "absolute path"),
    ("schema_version: 1\nhosts:\n  node1:\n    ssh: {user: 'a\"b'}\n", ":4: hosts.node1.ssh.user",
     "cannot be written to an ssh_config file"),
    ("schema_version: 1\nhosts:\n  node1:\n    workdir: '/w/$USER'\n", ":4: hosts.node1.workdir",
     "CLUSTERKIT_JOB_DIR contains '$'"),
    ("- node1\n- node2\n", ":1:", "must be a YAML mapping"),
    ("schema_version: 1\ndefaults: {address: 1.2.3.4}\nhosts: {n1: {}}\n", ":2:", "set address per host"),
]


@pytest.mark.parametrize(("text", "where", "what"), BAD, ids=[b[2] for b in BAD])
def test_bad_inventory_gives_one_clear_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, where: str, what: str
) -> None:
    path = tmp_path / "inv.yaml"
    path.write_text(text)
    assert main(["inventory", "validate", "-i", str(path)]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"clusterkit: error: {path}{where}"), lines[0]
    assert what in lines[0]
    assert "Traceback" not in err


@pytest.mark.parametrize(("written", "read_as"), [
    ("1.10", "a number (1.1)"), ("010", "a number (8)"), ("true", "a boolean (True)"),
    ("null", "null (no value)"), ("yes", "a boolean (True)")])
def test_env_values_must_be_strings_in_yaml(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                            written: str, read_as: str) -> None:
    """Issue 25: `env: {MYLIB_VERSION: 1.10, OCT: 010}` validated, and the ranks got `1.1`
    and `8`. Refused by validate and launch alike, naming file:line, the key and the fix."""
    path = tmp_path / "inv.yaml"
    path.write_text("schema_version: 1\ndefaults:\n  transport: local\n  env:\n"
                    f"    OK: \"1.10\"\n    MYLIB_VERSION: {written}\nhosts:\n"
                    "  l1: {address: 127.0.0.1}\n")
    for argv in (["inventory", "validate", "-i", str(path)],
                 ["launch", "--dry-run", "-i", str(path)]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err == (f"clusterkit: error: {path}:6: defaults.env.MYLIB_VERSION: {written} is not "
                       f"a string: YAML reads it as {read_as} — quote it: "
                       f'MYLIB_VERSION: "{written}"\n'), err
    path.write_text(path.read_text().replace(f"MYLIB_VERSION: {written}",
                                             f"MYLIB_VERSION: '{written}'"))
    assert dict(load_inventory(path).hosts[0].env) == {"OK": "1.10", "MYLIB_VERSION": written}


_AGREE_BASE = ("schema_version: 1\ncluster: {name: t}\n"
               "defaults: {transport: local, checkpoint: {shared_dir: /tmp/ck-agree}}\nhosts:\n")
AGREE = {
    "plain": "  l1: {address: 127.0.0.1}\n",
    "env number": "  l1: {address: 127.0.0.1, env: {V: 1.10}}\n",
    "env percent": "  l1: {address: 127.0.0.1, env: {A: '50%'}}\n",
    "env newline": "  l1: {address: 127.0.0.1, env: {A: \"x\\ny\"}}\n",
    "env spaces": "  l1: {address: 127.0.0.1, env: {A: ' x'}}\n",
    "workdir dollar": "  l1: {address: 127.0.0.1, workdir: '/tmp/a$b'}\n",
    "workdir quote": "  l1: {address: 127.0.0.1, workdir: '/tmp/a\"b'}\n",
    "workdir tilde": "  l1: {address: 127.0.0.1, workdir: '~/proj'}\n",
    "workdir space": "  l1: {address: 127.0.0.1, workdir: '/tmp/a b'}\n",
    "ckpt newline": "  l1: {address: 127.0.0.1, checkpoint: {shared_dir: \"/tmp/c\\nk\"}}\n",
    "ckpt space": "  l1: {address: 127.0.0.1, checkpoint: {shared_dir: '/tmp/c k'}}\n",
    "ssh quote": "  l1: {address: 127.0.0.1, ssh: {identity_file: '/k\"ey'}}\n",
    "ipv6 zone": "  l1: {address: 'fe80::1%eth0'}\n",
}


@pytest.mark.parametrize("hosts", AGREE.values(), ids=AGREE.keys())
def test_validate_refuses_exactly_what_launch_refuses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str],
                                                      hosts: str) -> None:
    """Issue 25: `inventory validate` said ok to values the launch then refused. One parse
    (clusterkit.inventory) holds the launch's rules, so both agree on every inventory.
    (What depends on the job, like DeepSpeed's runner putting the workdir unquoted on its
    command line, is for `launch --dry-run`: the launcher here is the default.)"""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CLUSTERKIT_HOME", str(tmp_path / "home"))
    (tmp_path / "train.py").write_text("")
    (tmp_path / "inv.yaml").write_text(_AGREE_BASE + hosts)
    validate = main(["inventory", "validate", "-i", "inv.yaml"])
    launch = main(["launch", "--dry-run", "--skip-checks", "-i", "inv.yaml", "train.py"])
    err = capsys.readouterr().err
    assert validate == launch, err
    if validate:
        assert err.count("clusterkit: error: inv.yaml:5: hosts.l1.") == 2, err


def test_missing_and_directory_inventory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inventory", "validate", "-i", str(tmp_path / "nope.yaml")]) == 2
    assert "inventory file not found" in capsys.readouterr().err
    assert main(["inventory", "validate", "-i", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err


def test_cli_subprocess_prints_no_traceback(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("schema_version: 1\nhosts:\n  node1: {slots: 0}\n")
    proc = subprocess.run([sys.executable, "-m", "clusterkit", "inventory", "validate", "-i", str(bad)],
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr


def test_show_json_and_hostfile_roundtrip(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    inv_path = tmp_path / "inv.yaml"
    inv_path.write_text(GOOD)
    assert main(["inventory", "show", "-i", str(inv_path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [h["name"] for h in data["hosts"]] == ["node01", "node02", "node03", "node04"]
    hf = tmp_path / "hostfile"
    assert main(["inventory", "export-hostfile", "-i", str(inv_path), "-o", str(hf)]) == 0
    assert hf.read_text() == "node01 slots=2\nnode02 slots=2\nnode03 slots=2\nnode04 slots=1\n"
    out = tmp_path / "imported.yaml"
    assert main(["inventory", "import-hostfile", str(hf), "-o", str(out)]) == 0
    reimported = load_inventory(out)
    assert [(h.name, h.slots) for h in reimported.hosts] == [
        ("node01", 2), ("node02", 2), ("node03", 2), ("node04", 1)]


def test_help_lists_every_verb(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for verb in ("doctor", "launch", "sbatch", "collect-ckpt", "inventory", "render"):
        assert f"    {verb}" in out
