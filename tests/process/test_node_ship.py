"""Node programs shipped the one way (bootstrap + sources on stdin), and the agent protocol.

No test bed: every program runs as a subprocess of an interpreter that cannot
import clusterkit (cwd outside the repo, PYTHONPATH cleared), on the oldest
Python found here (3.8 where pyenv has it) and on this one.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from clusterkit import ship
from clusterkit.node import contract, protocol
from clusterkit.node.protocol import AgentSpec, ProtocolError
from tests.testbed.core import NO_CLUSTERKIT
from tests.venvs import venv_over_this_python

NODE_DIR = Path(contract.__file__).parent
PYTHONS = [p for p in ("/root/.pyenv/versions/3.8.18/bin/python3.8", sys.executable)
           if os.path.exists(p)]


def _run_node_command(cmd: ship.NodeCommand, tmp_path: Path,
                      extra: bytes = b"") -> subprocess.CompletedProcess[bytes]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    return subprocess.run(cmd.argv, input=cmd.stdin + extra, capture_output=True, timeout=60,
                          cwd=tmp_path, env=env, check=False)


@pytest.mark.parametrize("python", PYTHONS)
def test_every_program_runs_from_its_shipped_sources_alone(python: str, tmp_path: Path) -> None:
    (tmp_path / "ckpt" / "global_step1").mkdir(parents=True)
    (tmp_path / "ckpt" / "latest").write_text("global_step1")
    (tmp_path / "ckpt" / "global_step1" / "a.pt").write_bytes(b"x" * 10)
    if python != sys.executable:  # this one has clusterkit installed (editable)
        no_ck = subprocess.run([python, "-c", "import clusterkit"], cwd=tmp_path,
                               capture_output=True, check=False)
        assert no_ck.returncode != 0  # the node's Python knows no clusterkit
    cases = {
        "facts.gatefacts": ([], lambda d: d["version"] and "clusterkit" in d),
        "ckpt.listing": ([str(tmp_path / "ckpt"), ""], lambda d: d["latest"] == "global_step1"),
        "hashing": ([str(tmp_path / "ckpt"), json.dumps(["global_step1/a.pt"])],
                    lambda d: d["files"]["global_step1/a.pt"][0] == 10),
        "facts.probe": (["connect", "127.0.0.1", "1", "--timeout", "1"],
                        lambda d: d["ok"] is False),
    }
    if python == sys.executable:  # the editable install's finder is a .pth hook: still found
        cases["facts.gatefacts"] = ([], lambda d: d["version"] and d["clusterkit"] and d["torch"])
    for program, (args, check) in cases.items():
        res = _run_node_command(ship.node_command(python, program, args), tmp_path)
        assert res.returncode == 0, (program, res.stderr.decode()[-800:])
        assert check(json.loads(res.stdout.decode().strip().splitlines()[-1])), program
    # dist (clusterkit sync's node program) checks a directory against its manifest.
    res = _run_node_command(ship.node_command(python, "sync.chain", ["check", str(tmp_path / "ckpt")]),
                            tmp_path)
    assert json.loads(res.stdout.decode().splitlines()[-1])["state"] == "no-manifest", res


@pytest.mark.parametrize("system_site", [False, True])
def test_programs_under_dash_S_see_the_packages_a_normal_start_sees(system_site: bool,
                                                                     tmp_path: Path) -> None:
    """The probe runs with ``-S``: same sys.prefix and packages, no .pth code run."""
    venv = tmp_path / "venv"
    venv_over_this_python(venv, system_site=system_site)
    site_dir = next(venv.glob("lib/python3*/site-packages"))
    (site_dir / "inside-1.2.dist-info").mkdir()
    (tmp_path / "extra" / "viapth-3.4.dist-info").mkdir(parents=True)
    ran = tmp_path / "hook-ran"
    (site_dir / "a.pth").write_text(f"# comment\n{tmp_path / 'extra'}\n"
                                    f"import pathlib; pathlib.Path({str(ran)!r}).touch()\n")
    python = str(venv / "bin" / "python")
    cmd = ship.node_command(python, "facts.probe", ["facts"])
    assert cmd.argv[1] == "-S"
    res = _run_node_command(cmd, tmp_path)
    assert res.returncode == 0, res.stderr.decode()[-800:]
    assert not ran.exists()  # the hook line was skipped, not run
    with_site = _run_node_command(ship.NodeCommand([a for a in cmd.argv if a != "-S"], cmd.stdin), tmp_path)
    assert ran.exists()
    fast, full = (json.loads(r.stdout.decode().splitlines()[-1]) for r in (res, with_site))
    assert fast["python"] == full["python"] and fast["python"]["prefix"] == str(venv)
    assert fast["packages"] == full["packages"]
    items = fast["packages"]["freeze"]["items"]
    assert {"inside==1.2", "viapth==3.4"} <= set(items)
    assert ("torch==2.13.0+cpu" in items) == system_site
    # sitecustomize runs after every .pth (the editable finder included) and may hide a
    # package: the gate's "is clusterkit importable here" must still see that.
    (site_dir / "sitecustomize.py").write_text(NO_CLUSTERKIT)
    gate = ship.node_command(python, "facts.gatefacts")
    fast, full = (json.loads(_run_node_command(ship.NodeCommand(argv, gate.stdin), tmp_path)
                             .stdout.decode().splitlines()[-1])
                  for argv in (gate.argv, [a for a in gate.argv if a != "-S"]))
    assert fast == full and fast["clusterkit"] is None


@pytest.mark.parametrize("python", PYTHONS)
def test_agent_reads_spec_after_its_sources_and_speaks_the_protocol(python: str,
                                                                    tmp_path: Path) -> None:
    spec = AgentSpec(job_id="ship-job", node="n1", job_dir=str(tmp_path / "job"),
                     argv=[python, "-c", "print('hello from rank')"], prefix="single",
                     files={"hostfile": "n1 slots=1\n"})
    cmd = ship.agent_command(python, spec=spec)
    proc = subprocess.Popen(cmd.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=tmp_path)
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(cmd.stdin)
    proc.stdin.flush()  # stdin stays open: EOF would mean "the launcher is gone"
    lines = []
    for raw in proc.stdout:
        lines.append(raw.decode().rstrip("\n"))
        if lines[-1].startswith(protocol.EVENT_PREFIX) and '"exit"' in lines[-1]:
            break
    proc.stdin.close()
    assert proc.wait(30) == 0
    events = [protocol.decode_event(ln) for ln in lines if ln.startswith(protocol.EVENT_PREFIX)]
    assert events[0].ev == "started"
    assert events[-1].ev == "exit" and events[-1].node == "n1" and events[-1].code == 0
    assert f"{protocol.LINE_PREFIX}n1 0 hello from rank" in lines
    assert (tmp_path / "job" / "hostfile").read_text() == "n1 slots=1\n"


def test_agent_refuses_a_spec_of_another_version(tmp_path: Path) -> None:
    data = json.loads(AgentSpec(job_id="j", node="n", job_dir=str(tmp_path)).to_json())
    data["schema_version"] = 99
    cmd = ship.agent_command(sys.executable)
    res = _run_node_command(cmd, tmp_path, (json.dumps(data) + "\n").encode())
    assert res.returncode == 2
    assert b"schema_version 99" in res.stderr and b"different clusterkit versions" in res.stderr


def test_bootstrap_says_what_is_wrong_with_its_stdin(tmp_path: Path) -> None:
    cmd = ship.node_command(sys.executable, "facts.gatefacts")
    res = _run_node_command(ship.NodeCommand(cmd.argv, b"not a bundle\n"), tmp_path)
    assert res.returncode == 1 and b"expected a clusterkit-node 2 header" in res.stderr
    res = _run_node_command(ship.NodeCommand(cmd.argv, cmd.stdin[:-10]), tmp_path)
    assert b"stdin ended inside facts.gatefacts" in res.stderr


def _node_module_name(path: Path) -> str:
    """A node module's dotted name below ``clusterkit.node`` (``agent.core``)."""
    return ".".join(path.relative_to(NODE_DIR).with_suffix("").parts)


def _node_imports(path: Path) -> set[str]:
    """The node modules ``path`` imports, dotted below ``clusterkit.node``
    (``from clusterkit.node.agent import env`` is ``agent.env``)."""
    found: set[str] = set()
    for n in ast.walk(ast.parse(path.read_text())):
        if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("clusterkit.node"):
            base = (n.module or "")[len("clusterkit.node."):]
            for a in n.names:
                sub = f"{base}.{a.name}" if base else a.name
                is_module = (NODE_DIR / (sub.replace(".", "/") + ".py")).exists()
                found.add(sub if is_module else base)
        elif isinstance(n, ast.Import):
            found |= {a.name[len("clusterkit.node."):] for a in n.names
                      if a.name.startswith("clusterkit.node.")}
    return found


def test_every_program_ships_its_own_module_last_and_its_file_exists() -> None:
    # A program's name is its module's dotted name: the bootstrap calls that module's main.
    for program, spec in ship.PROGRAMS.items():
        assert spec.modules[-1] == program, program
        for module in spec.modules:
            assert (NODE_DIR / (module.replace(".", "/") + ".py")).is_file(), (program, module)
            assert ship.source(module).startswith(b'"""'), module


def test_each_program_ships_the_node_modules_it_imports_before_their_importer() -> None:
    # The bootstrap runs the sources in the listed order: a module's imports must be
    # registered before it runs, and a module left out does not exist on the node.
    for program, spec in ship.PROGRAMS.items():
        for i, module in enumerate(spec.modules):
            path = NODE_DIR / (module.replace(".", "/") + ".py")
            missing = _node_imports(path) - set(spec.modules[:i])
            assert not missing, (program, module, missing)


def test_the_bootstrap_makes_the_packages_of_dotted_modules(tmp_path: Path) -> None:
    """Bundle version 2: ``a.b.c`` is registered as ``clusterkit.node.a.b.c`` under empty
    package modules (``__path__ == []``), each its parent's attribute, and imports of
    its siblings resolve both ways (``from clusterkit.node.a.b import x``, the module)."""
    sources = [
        ("x", b"X = 1\n"),
        ("a.b.y", b"from clusterkit.node import x\nY = x.X + 1\n"),
        ("a.b.z", b"import sys\nfrom clusterkit.node.a.b import y\nfrom clusterkit.node.a.b.y import Y\n"
                  b"import clusterkit.node.a.b.y as yy\n"
                  b"def main(argv):\n"
                  b"    n = sys.modules['clusterkit.node']\n"
                  b"    a, b = sys.modules['clusterkit.node.a'], sys.modules['clusterkit.node.a.b']\n"
                  b"    assert a.__path__ == [] and b.__path__ == [] and n.a is a and a.b is b\n"
                  b"    assert b.y is y is yy and b.z is sys.modules[__name__]\n"
                  b"    assert sys.modules['clusterkit'].node is n\n"
                  b"    print(__name__, Y, y.Y, argv)\n"
                  b"    return 3\n"),
    ]
    argv = [sys.executable, "-S", "-u", "-c", contract.BOOTSTRAP, "a.b.z", "w"]
    res = _run_node_command(ship.NodeCommand(argv, contract.encode_bundle(sources)), tmp_path)
    assert res.returncode == 3, res.stderr.decode()[-800:]
    assert res.stdout.decode().split() == ["clusterkit.node.a.b.z", "2", "2", "['w']"]


def test_the_agent_modules_all_ship_each_says_what_it_holds_and_stays_small() -> None:
    """Issue 23 item 3: the agent split by concern (entry + loop, processes, files,
    environment, output, fork server, hangs), every part in the agent program; issue 36:
    the agent's room is ``node/agent/``."""
    parts = [m for m in ship.PROGRAMS["agent.core"].modules if m.startswith("agent.")]
    assert sorted(parts) == sorted(_node_module_name(p) for p in (NODE_DIR / "agent").glob("[!_]*.py"))
    assert parts[-1] == "agent.core"  # the entry runs last, its parts are there by then
    for module in parts:
        text = (NODE_DIR / (module.replace(".", "/") + ".py")).read_text()
        doc = ast.get_docstring(ast.parse(text))
        assert doc, module
        # (The fork server, agent.zygote, is its own process and says why it is one file.)
        assert len(text.splitlines()) <= 500 or "One file because:" in doc, module


def test_spec_round_trips_and_decodes_strictly() -> None:
    spec = AgentSpec(job_id="j", node="n", job_dir="/d", argv=["x"], native=None, grace_s=2)
    assert AgentSpec.from_json(spec.to_json()) == spec
    good = json.loads(spec.to_json())
    for bad, why in [({**good, "extra": 1}, "unknown keys: extra"),
                     ({k: v for k, v in good.items() if k != "node"}, "lacks: node"),
                     ({**good, "attempt": "1"}, "'attempt' has type str"),
                     ({**good, "hold": 1}, "'hold' has type int"),
                     ({**good, "prefix": "mpi"}, "prefix 'mpi'"),
                     ({**good, "files": {"../x": ""}}, "bad job file name"),
                     ({**good, "schema_version": 0}, "schema_version 0")]:
        with pytest.raises(ProtocolError, match=why):
            AgentSpec.from_dict(bad)
    with pytest.raises(ProtocolError, match="not JSON"):
        AgentSpec.from_json("{")
