"""``clusterkit.api.sync`` (docs/api.md): the verb is parsing and printing around it, and
from Python it returns the typed result, printing nothing (local virtual nodes)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from clusterkit import api
from clusterkit.cli.main import main
from clusterkit.errors import ClusterkitError
from clusterkit.inventory import Inventory
from clusterkit.jobs.sync import SyncHooks
from clusterkit.sync.types import SyncResult


def _write_local_nodes_inventory(tmp_path: Path, hosts: int = 2) -> Path:
    # Local virtual nodes share this machine's disk: a workdir each.
    lines = ["schema_version: 1", "defaults:", "  transport: local", "hosts:"]
    lines += [f"  v{i}: {{workdir: {tmp_path / f'n{i}'}}}" for i in range(hosts)]
    path = tmp_path / "inv.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_the_verb_calls_api_sync_with_its_flags(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CLUSTERKIT_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("CLUSTERKIT_DEBUG", "1")  # main lets the stand-in's exception through
    calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    class Called(Exception):
        pass

    def record(*args: Any, **kwargs: Any) -> None:
        calls.append((args, kwargs))
        raise Called

    monkeypatch.setattr(api, "sync", record)
    with pytest.raises(Called):
        main(["sync", "code", "-i", str(_write_local_nodes_inventory(tmp_path)), "--delete", "--dest", "x",
              "--port", "30000", "--nodes", "1"])
    [(args, kwargs)] = calls
    assert args == ("code",) and isinstance(kwargs.pop("inventory"), Inventory)
    assert isinstance(kwargs.pop("hooks"), SyncHooks)
    assert kwargs == {"nodes": 1, "gpus_per_node": None, "include": "", "exclude": "",
                      "delete": True, "exclude_from": None, "dest": "x", "port": 30000}


def test_api_sync_returns_the_typed_result_and_prints_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("CLUSTERKIT_HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "train.py").write_text("print('hi')\n")
    started: list[tuple[str, int]] = []
    result = api.sync("code", inventory=str(_write_local_nodes_inventory(tmp_path)),
                      hooks=SyncHooks(on_start=lambda where, n: started.append((where, n))))
    assert isinstance(result, SyncResult) and result.ok and result.files == 1
    assert list(result.nodes) == ["v0", "v1"]
    assert started == [("each workdir", 2)]
    for i in range(2):
        assert (tmp_path / f"n{i}" / "code" / "train.py").read_text() == "print('hi')\n"
    assert capsys.readouterr() == ("", "")
    with pytest.raises(ClusterkitError, match="is not a directory"):
        api.sync("nope", inventory=str(_write_local_nodes_inventory(tmp_path)))
