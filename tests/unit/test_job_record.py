"""The typed job record (issue 30 item 2): old records on disk still load, one that
cannot be read says how to go on in one line, and nothing reads the record by key."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from clusterkit.cli.main import main
from clusterkit.launch.registry import JobRecord, Registry
from clusterkit.node.contract import STORAGE_KINDS, StorageKind
from clusterkit.node.protocol import ProtocolError, StopReply
from clusterkit.spec.jobrecord import JobCheckpoints, JobState, RankSpan
from tests.paths import REPO, TESTS

PACKAGE = REPO / "clusterkit"
# Written by `clusterkit launch --nodes 2 --gpus-per-node 2 --steps 5` on the embedded
# default (shared, and with --storage node-local) before the record had typed fields.
OLD = TESTS / "fixtures" / "job_records"


@pytest.mark.parametrize(("name", "storage"), [("v1_shared", StorageKind.SHARED),
                                               ("v1_node_local", StorageKind.NODE_LOCAL)])
def test_a_record_with_extra_loads_into_the_fields(tmp_path: Path, name: str,
                                                   storage: StorageKind) -> None:
    raw = json.loads((OLD / f"{name}.json").read_text(encoding="utf-8"))
    old = raw["extra"]
    jobs = tmp_path / "jobs" / raw["job_id"]
    jobs.mkdir(parents=True)
    shutil.copy(OLD / f"{name}.json", jobs / "job.json")
    record = Registry(tmp_path).load(raw["job_id"])
    assert record.state is JobState.SUCCEEDED and record.launcher == "native"
    assert record.ckpt.storage is storage and record.ckpt.node_local == (name == "v1_node_local")
    assert record.ckpt.dir == old["ckpt_dir"] and record.ckpt.dirs == old["ckpt_dirs"]
    assert record.ckpt.slots == [2, 2] and record.ckpt.markers is True
    assert record.ckpt.rank_map == [RankSpan("local1", 0, 2), RankSpan("local2", 2, 2)]
    for node in ("local1", "local2"):
        assert record.ckpt.dir_of(node) == old["ckpt_dirs"][node]
    # Saved again: the new form, same values, no `extra`.
    Registry(tmp_path).save(record)
    saved = json.loads((jobs / "job.json").read_text(encoding="utf-8"))
    assert "extra" not in saved and saved["state"] == "succeeded"
    assert saved["ckpt"]["storage"] == storage.value
    assert saved["ckpt"]["rank_map"] == old["rank_map"]
    assert Registry(tmp_path).load(raw["job_id"]) == record


def test_a_record_from_before_markers_and_launcher() -> None:
    """Records from before issues 25/32 named neither: markers, and the backend."""
    ckpt = JobCheckpoints.from_dict({"ckpt_dir": "/ck/j", "storage": "node-local"})
    assert ckpt.markers is True and ckpt.rank_map is None and ckpt.dir_of("n9") == "/ck/j"
    assert JobCheckpoints.from_dict({}).storage is None


def test_every_state_and_storage_keeps_its_spelling() -> None:
    assert [s.value for s in JobState] == ["running", "succeeded", "failed", "interrupted",
                                          "not-started", "stopped", "submitted"]
    assert STORAGE_KINDS == ("shared", "node-local")
    assert json.dumps([JobState.NOT_STARTED, StorageKind.NODE_LOCAL]) == \
        '["not-started", "node-local"]'


@pytest.mark.parametrize("text", ['{"nodes": 3}', '{"job_id": "j"}', "not json",
                                  '{"nodes": [], "state": "paused", "job_id": "j"}'])
def test_an_unreadable_record_says_how_to_go_on_in_one_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        text: str) -> None:
    (tmp_path / "jobs" / "j").mkdir(parents=True)
    (tmp_path / "jobs" / "j" / "job.json").write_text(text, encoding="utf-8")
    monkeypatch.setenv("CLUSTERKIT_HOME", str(tmp_path))
    code = main(["status", "j"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("clusterkit: error: "), err
    assert "job.json: unreadable job record (" in lines[0], lines[0]
    assert "move " in lines[0] and "collect-ckpt" in lines[0], lines[0]


def test_the_stop_reply_is_a_protocol_message() -> None:
    reply = StopReply(signalled=2, killed=1, left=0)
    assert StopReply.from_json(reply.to_json()) == reply
    assert json.loads(reply.to_json()) == {"signalled": 2, "killed": 1, "left": 0}
    with pytest.raises(ProtocolError, match="unknown keys: other"):
        StopReply.from_json('{"signalled": 1, "other": 2}')
    with pytest.raises(ProtocolError, match="'left' has type str"):
        StopReply.from_json('{"left": "2"}')


def test_a_new_record_round_trips(tmp_path: Path) -> None:
    record = JobRecord(job_id="j", backend="torchrun", nodes=[], created=1.0, launcher_pid=1,
                       state=JobState.INTERRUPTED,
                       ckpt=JobCheckpoints(storage=StorageKind.NODE_LOCAL, dir="/ck",
                                           rank_map=[RankSpan("a", 0, 2)], markers=False))
    Registry(tmp_path).save(record)
    assert Registry(tmp_path).load("j") == record


# ------------------------------------------------------------------ acceptance greps

def _package_lines() -> list[tuple[Path, list[str]]]:
    return [(p, p.read_text(encoding="utf-8").splitlines())
            for p in sorted(PACKAGE.rglob("*.py"))]


def test_no_job_record_is_read_by_key() -> None:
    assert "extra" not in JobRecord.__dataclass_fields__
    # What else is called `extra` and is a dict: doctor's report, ssh's -o options.
    allowed = re.compile(r"report\.extra|^\s*extra\[\"KexAlgorithms\"\]")
    bad = [f"{p.relative_to(REPO)}:{i}: {line.strip()}" for p, lines in _package_lines()
           for i, line in enumerate(lines, 1)
           if re.search(r"\bextra(\[|\.get\()", line) and not allowed.search(line)]
    assert not bad, "\n".join(bad)


def test_node_local_is_spelled_in_one_module() -> None:
    home = PACKAGE / "node" / "contract.py"  # StorageKind (node code spells it too)
    bad = [f"{p.relative_to(REPO)}:{i}: {line.strip()}" for p, lines in _package_lines()
           if p != home for i, line in enumerate(lines, 1)
           if re.search(r"[\"']node-local[\"']", line)]
    assert not bad, "\n".join(bad)
