"""collect-ckpt without the test bed: the pure completeness check, source choice,
scatter planning, and the whole pipeline over local "nodes" (transport: local)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from clusterkit.checkpoints import layout
from clusterkit.checkpoints.collect.choose import choose_sources
from clusterkit.checkpoints.collect.discover import verify
from clusterkit.checkpoints.collect.manifest import MANIFEST, read_manifest
from clusterkit.checkpoints.collect.scatter import ScatterTarget, plan_scatter, scatter
from clusterkit.checkpoints.collect.verb import CollectOptions, collect
from clusterkit.checkpoints.collectplan import CheckpointIncomplete, WithoutMarkers
from clusterkit.checkpoints.sources.base import CollectNode, list_nodes
from clusterkit.checkpoints.sources.session import collect_ssh_argv
from clusterkit.checkpoints.sources.transfer import PART_SUFFIX, Hashed
from clusterkit.errors import CheckpointError
from clusterkit.node.contract import MARKER_PREFIX, marker_name
from clusterkit.remote.base import SSHTarget
from clusterkit.remote.dispatch import DispatchTransport
from tests import synthetic_ckpt as synthetic
from tests.cli import clusterkit_cli
from tests.collectnodes import local_collect_nodes

TAG = "global_step1"


def _write_collect_nodes(tmp: Path, n: int = 4, stage: int = 2, shard: int = 4096) -> list[CollectNode]:
    nodes = local_collect_nodes(tmp, n)
    synthetic.write_node_local([c.root for c in nodes], zero_stage=stage, shard_bytes=shard,
                               model_bytes=1024)
    return nodes


# ------------------------------------------------------------------ verify (pure-ish)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_complete_checkpoint_verifies(tmp_path: Path, transport: DispatchTransport,
                                      stage: int) -> None:
    nodes = _write_collect_nodes(tmp_path, stage=stage)
    plan = verify(list_nodes(transport, nodes, None))
    assert (plan.tag, plan.world_size, plan.zero_stage) == (TAG, 8, stage)
    assert [n.ranks for n in plan.nodes] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert plan.canonical_node == "node1"
    assert "latest" not in plan.files and "zero_to_fp32.py" in plan.files
    if stage < 3:
        assert len(plan.files[f"{TAG}/mp_rank_00_model_states.pt"]) == 4


def test_missing_shard_names_node_and_rank(tmp_path: Path, transport: DispatchTransport) -> None:
    nodes = _write_collect_nodes(tmp_path)
    os.unlink(synthetic.shard_paths(nodes[3].root)[1])  # rank 7 on node4
    with pytest.raises(CheckpointIncomplete) as info:
        verify(list_nodes(transport, nodes, None))
    assert any("node4" in p and "rank 7" in p for p in info.value.problems), info.value.problems
    assert info.value.exit_code == 2


def test_duplicate_shard_is_reported(tmp_path: Path, transport: DispatchTransport) -> None:
    nodes = _write_collect_nodes(tmp_path)
    src = synthetic.shard_paths(nodes[0].root)[0]
    Path(nodes[1].root, TAG, os.path.basename(src)).write_bytes(Path(src).read_bytes())
    with pytest.raises(CheckpointIncomplete) as info:
        verify(list_nodes(transport, nodes, None))
    assert any("rank 0" in p and "node1 and node2" in p for p in info.value.problems)


def test_missing_marker_latest_disagreement_and_truncation(tmp_path: Path,
                                                          transport: DispatchTransport) -> None:
    nodes = _write_collect_nodes(tmp_path)
    os.unlink(Path(nodes[2].root, TAG, marker_name(2)))
    shard = synthetic.shard_paths(nodes[1].root)[0]
    with open(shard, "r+b") as fh:
        fh.truncate(10)
    with pytest.raises(CheckpointIncomplete) as info:
        verify(list_nodes(transport, nodes, None))
    text = " | ".join(info.value.problems)
    assert "node3: no completion marker" in text
    assert "no completion marker for node index 2" in text
    Path(nodes[1].root, "latest").write_text("global_step9")
    with pytest.raises(CheckpointIncomplete, match="latest' files disagree"):
        verify(list_nodes(transport, nodes, None))


def test_truncated_shard_against_marker(tmp_path: Path, transport: DispatchTransport) -> None:
    nodes = _write_collect_nodes(tmp_path)
    with open(synthetic.shard_paths(nodes[1].root)[0], "r+b") as fh:
        fh.truncate(10)
    with pytest.raises(CheckpointIncomplete, match=r"node2: .* has 10 bytes"):
        verify(list_nodes(transport, nodes, None))


def test_unknown_tag_and_missing_dir(tmp_path: Path, transport: DispatchTransport) -> None:
    nodes = _write_collect_nodes(tmp_path)
    with pytest.raises(CheckpointIncomplete, match="no global_step7 directory"):
        verify(list_nodes(transport, nodes, "global_step7"), "global_step7")
    nodes.append(local_collect_nodes(tmp_path, 5)[4])
    with pytest.raises(CheckpointIncomplete, match=r"node5: checkpoint directory .* does not exist"):
        verify(list_nodes(transport, nodes, None))


# ------------------------------------------------------------------ choose / split / argv


def test_choose_sources_dedupes_and_prefers_rank0_when_copies_differ(
        tmp_path: Path, transport: DispatchTransport) -> None:
    nodes = _write_collect_nodes(tmp_path)
    plan = verify(list_nodes(transport, nodes, None))
    hashes = {(c.node, rel): Hashed(c.size, c.mtime, "a" * 64)
              for rel, copies in plan.files.items() for c in copies}
    ms = f"{TAG}/mp_rank_00_model_states.pt"
    wanted, notes, problems = choose_sources(plan, hashes)
    assert not problems and not notes
    assert len([w for w in wanted if w.relpath == ms]) == 1
    hashes[("node3", ms)] = Hashed(1024, 0.0, "b" * 64)
    wanted, notes, problems = choose_sources(plan, hashes)
    assert [w.node for w in wanted if w.relpath == ms] == ["node1"]
    assert notes and "node3" in notes[0]


def test_openssh_argv_honours_inventory_fields() -> None:
    t = SSHTarget(name="n1", address="10.0.0.1", user="me", port=2222, identity_file="/k",
                  proxy_jump="bastion", config_file="/cfg", known_hosts_file="/kh")
    argv = collect_ssh_argv(t, "tar -cf - x")
    assert argv[-3:] == ["--", "10.0.0.1", "tar -cf - x"]
    assert argv[argv.index("-F") + 1] == "/cfg"
    # The one options mapping, as -o words (paramiko and pdsh's ssh_config use it too).
    for word in ("User=me", "Port=2222", "IdentityFile=/k", "ProxyJump=bastion",
                 "UserKnownHostsFile=/kh"):
        assert argv[argv.index(word) - 1] == "-o"
    assert "BatchMode=yes" in argv and "StrictHostKeyChecking=yes" in argv
    assert "StrictHostKeyChecking=accept-new" not in argv
    # collect's data path on top of the one OpenSSH argv (remote.openssh.openssh_argv)
    assert "Compression=no" in argv and any(w.startswith("Ciphers=aes128-gcm") for w in argv)
    keys = [w.split("=")[0] for w in argv[argv.index("-T"):] if "=" in w]
    assert len(keys) == len(set(keys))  # each keyword once


# ------------------------------------------------------------------ the pipeline (local)


def test_collect_local_nodes_then_rerun_skips(tmp_path: Path, transport: DispatchTransport) -> None:
    nodes = _write_collect_nodes(tmp_path)
    dest = tmp_path / "dest"
    report = collect(transport, nodes, CollectOptions(dest=str(dest)))
    assert not report.failed and report.skipped == 0
    names = sorted(os.listdir(dest / TAG))
    assert len([n for n in names if n.endswith("_optim_states.pt")]) == 8
    assert len([n for n in names if n.startswith(MARKER_PREFIX)]) == 4
    assert (dest / "latest").read_text() == TAG and (dest / "zero_to_fp32.py").is_file()
    ms = (dest / TAG / "mp_rank_00_model_states.pt").read_bytes()
    assert ms.endswith(b"rank0!!!")  # node1's (global rank 0) copy won
    assert report.notes
    manifest = read_manifest(str(dest), TAG)
    assert manifest["world_size"] == 8 and len(manifest["files"]) == len(report.wanted)
    again = collect(transport, nodes, CollectOptions(dest=str(dest)))
    assert again.skipped == len(report.wanted) and again.bytes_copied == 0


def test_sftp_source_collects_what_the_stream_source_does(tmp_path: Path,
                                                        transport: DispatchTransport) -> None:
    """The two sources behind one verb: --via sftp hashes every file first, then
    copies the same files with the same checksums; a re-run skips them all."""
    nodes = _write_collect_nodes(tmp_path)
    by_method = {}
    for method in ("ssh", "sftp"):
        dest = tmp_path / f"dest-{method}"
        report = collect(transport, nodes, CollectOptions(dest=str(dest), method=method))
        assert not report.failed and report.method == method
        by_method[method] = {rel: (e["sha256"], e["source"])
                             for rel, e in read_manifest(str(dest), TAG)["files"].items()}
    assert by_method["sftp"] == by_method["ssh"]
    assert report.seconds_hash > 0.0  # sftp: a hashing pass of its own
    again = collect(transport, nodes, CollectOptions(dest=str(tmp_path / "dest-sftp"),
                                                     method="sftp"))
    assert again.skipped == len(report.wanted) and again.bytes_copied == 0


@pytest.mark.parametrize("stage", [2, 3])
def test_first_run_manifest_has_the_node_checksums(tmp_path: Path, transport: DispatchTransport,
                                                   stage: int) -> None:
    """Hashed while sent: the manifest (which --scatter checks against) still holds
    every file's sha256, equal to the file's."""
    import hashlib

    nodes = _write_collect_nodes(tmp_path, n=2, stage=stage)
    dest = tmp_path / "dest"
    report = collect(transport, nodes, CollectOptions(dest=str(dest)))
    assert report.seconds_hash == 0.0  # no separate hashing pass
    files = read_manifest(str(dest), TAG)["files"]
    for rel, entry in files.items():
        assert entry["sha256"] == hashlib.sha256((dest / rel).read_bytes()).hexdigest(), rel


def test_rerun_hashes_first_only_what_dest_has(tmp_path: Path,
                                               transport: DispatchTransport) -> None:
    """A re-run checks the files DEST has (skipped when verified) and streams the
    missing one with the single-read path; the manifest has every sha256."""
    import hashlib

    nodes = _write_collect_nodes(tmp_path, n=2)
    dest = tmp_path / "dest"
    collect(transport, nodes, CollectOptions(dest=str(dest)))
    lost = dest / TAG / "zero_pp_rank_3_mp_rank_00_optim_states.pt"
    lost.unlink()
    again = collect(transport, nodes, CollectOptions(dest=str(dest)))
    assert again.bytes_copied == 4096 and again.skipped == len(again.wanted) - 1
    assert again.notes  # the duplicates' note survives the split
    entry = read_manifest(str(dest), TAG)["files"][f"{TAG}/{lost.name}"]
    assert entry["sha256"] == hashlib.sha256(lost.read_bytes()).hexdigest()


def test_a_node_that_cannot_start_is_a_per_node_problem(tmp_path: Path,
                                                        transport: DispatchTransport) -> None:
    import dataclasses

    nodes = _write_collect_nodes(tmp_path, n=3)
    nodes[1] = dataclasses.replace(nodes[1], python=str(tmp_path / "no-python"))
    with pytest.raises(CheckpointIncomplete) as info:
        collect(transport, nodes, CollectOptions(dest=str(tmp_path / "dest")))
    assert any(p.startswith("node2: cannot start") for p in info.value.problems), \
        info.value.problems
    assert not (tmp_path / "dest").exists()


def test_incomplete_copies_nothing(tmp_path: Path, transport: DispatchTransport) -> None:
    nodes = _write_collect_nodes(tmp_path)
    os.unlink(synthetic.shard_paths(nodes[3].root)[0])
    dest = tmp_path / "dest"
    with pytest.raises(CheckpointIncomplete):
        collect(transport, nodes, CollectOptions(dest=str(dest)))
    assert not dest.exists()


def test_corruption_after_hashing_is_a_checksum_mismatch(tmp_path: Path,
                                                         transport: DispatchTransport) -> None:
    nodes = _write_collect_nodes(tmp_path)
    victim = synthetic.shard_paths(nodes[2].root)[0]

    def corrupt(_plan: object) -> None:
        st = os.stat(victim)
        with open(victim, "r+b") as fh:
            fh.seek(100)
            b = fh.read(1)
            fh.seek(100)
            fh.write(bytes([b[0] ^ 0xFF]))
        os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns))  # even with mtime kept

    dest = tmp_path / "dest"
    with pytest.raises(CheckpointError, match="sha256 mismatch") as info:
        collect(transport, nodes, CollectOptions(dest=str(dest)), after_hash=corrupt)
    assert "node3" in info.value.message
    final = dest / TAG / os.path.basename(victim)
    assert not final.exists() and not (dest / TAG / MANIFEST).exists()
    assert not list((dest / TAG).glob(f".*{PART_SUFFIX}"))


def test_killed_stream_leaves_no_final_partial_and_rerun_completes(
        tmp_path: Path, transport: DispatchTransport) -> None:
    nodes = _write_collect_nodes(tmp_path, shard=2 << 20)
    dest = tmp_path / "dest"

    def kill_soon(proc: subprocess.Popen[bytes]) -> None:
        proc.send_signal(signal.SIGKILL)  # each node's session, as its stream starts

    with pytest.raises(CheckpointError, match="not received"):
        collect(transport, nodes, CollectOptions(dest=str(dest), jobs=8), on_start=kill_soon)
    for path in (dest / TAG).iterdir() if (dest / TAG).exists() else []:
        assert not path.name.endswith(PART_SUFFIX) or path.name.startswith(".")
    report = collect(transport, nodes, CollectOptions(dest=str(dest)))
    assert not report.failed and (dest / TAG / MANIFEST).is_file()


def test_prune_sources_only_after_success(tmp_path: Path, transport: DispatchTransport) -> None:
    nodes = _write_collect_nodes(tmp_path)
    collect(transport, nodes, CollectOptions(dest=str(tmp_path / "dest"), prune_sources=True))
    for c in nodes:
        assert not Path(c.root, TAG).exists()
    assert (Path(nodes[0].root) / "latest").exists()


# ------------------------------------------------------------------ scatter


def test_scatter_same_split_and_resplit(tmp_path: Path, transport: DispatchTransport) -> None:
    nodes = _write_collect_nodes(tmp_path)
    dest = tmp_path / "dest"
    collect(transport, nodes, CollectOptions(dest=str(dest)))
    manifest = read_manifest(str(dest), TAG)
    fresh = local_collect_nodes(tmp_path / "fresh", 8)
    with pytest.raises(CheckpointError, match="8 data-parallel ranks but the selected nodes give 4"):
        plan_scatter(manifest, [ScatterTarget(n, 1) for n in fresh[:4]])
    report = scatter(transport, str(dest), TAG, [ScatterTarget(n, 1) for n in fresh])
    assert report.remapped
    for index, n in enumerate(fresh):
        tag_dir = Path(n.root, TAG)
        marker = json.loads((tag_dir / marker_name(index)).read_text())
        assert [r["global_rank"] for r in marker["ranks"]] == [index]
        assert marker["num_nodes"] == 8
        assert (tag_dir / layout.optim_states_name(index, bf16=False)).is_file()
        assert (tag_dir / "mp_rank_00_model_states.pt").is_file()
        assert Path(n.root, "latest").read_text() == TAG
    # The scattered layout is itself a complete node-local checkpoint.
    plan = verify(list_nodes(transport, fresh, None))
    assert plan.world_size == 8 and len(plan.nodes) == 8
    again = scatter(transport, str(dest), TAG, [ScatterTarget(n, 1) for n in fresh])
    assert sum(again.uploaded.values()) == 0


# ------------------------------------------------------------------ the CLI (local hosts)


def _local_inventory(tmp: Path, n: int = 3) -> Path:
    lines = ["schema_version: 1", "defaults:", "  transport: local", "  slots: 2",
             f"  python: {sys.executable}", "hosts:"]
    for i in range(1, n + 1):
        lines += [f"  node{i}:", "    address: 127.0.0.1", "    checkpoint:",
                  f"      local_dir: {tmp}/node{i}/ckpt"]
    path = tmp / "inv.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


def _run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return clusterkit_cli("collect-ckpt", *args, timeout=120)


def test_cli_json_dry_run_and_refusal(tmp_path: Path) -> None:
    inv = _local_inventory(tmp_path)
    synthetic.write_node_local([str(tmp_path / f"node{i}" / "ckpt") for i in (1, 2, 3)],
                               shard_bytes=2048, model_bytes=512)
    dest = tmp_path / "dest"
    dry = _run_cli("-i", str(inv), "--to", str(dest), "--dry-run", "--json")
    assert dry.returncode == 0, dry.stderr
    report = json.loads(dry.stdout)
    assert report["collect"]["world_size"] == 6 and report["copied_bytes"] == 0
    assert "dry run: nothing copied" in dry.stderr and not dest.exists()
    ok = _run_cli("-i", str(inv), "--to", str(dest), "--json")
    assert ok.returncode == 0 and json.loads(ok.stdout)["copied_bytes"] > 0, ok.stderr
    os.unlink(synthetic.shard_paths(str(tmp_path / "node2" / "ckpt"))[0])
    bad = _run_cli("-i", str(inv), "--to", str(tmp_path / "d2"))
    assert bad.returncode == 2
    assert "node2: optimizer shard of rank 2 is missing" in bad.stderr
    assert bad.stderr.strip().splitlines()[-1].startswith("clusterkit: error: checkpoint")


def test_overlapped_hashing_refuses_a_file_changed_since_listing(
        tmp_path: Path, transport: DispatchTransport) -> None:
    nodes = _write_collect_nodes(tmp_path)
    victim = synthetic.shard_paths(nodes[2].root)[1]

    def change(_plan: object) -> None:
        with open(victim, "ab") as fh:
            fh.write(b"x")  # after the listing, before the node reads and hashes it

    dest = tmp_path / "dest"
    with pytest.raises(CheckpointError, match="changed on node3 since listing"):
        collect(transport, nodes, CollectOptions(dest=str(dest)), on_plan=change)
    assert not (dest / TAG / os.path.basename(victim)).exists()
    assert len(list((dest / TAG).glob("*_optim_states.pt"))) == 7  # the others verified


def test_cli_job_mode_uses_the_job_record(tmp_path: Path) -> None:
    from clusterkit.launch.registry import JobRecord, NodeRecord, Registry

    home = tmp_path / "home"
    roots = [str(tmp_path / f"node{i}" / "ckpt") for i in (1, 2)]
    synthetic.write_node_local(roots, shard_bytes=1024, model_bytes=256)
    record = JobRecord(job_id="ck-test-1", backend="torchrun", created=0.0, launcher_pid=0,
                       nodes=[NodeRecord(f"node{i}", sys.executable, "/x/jobs/ck-test-1",
                                         SSHTarget(name=f"node{i}", address="127.0.0.1",
                                                   local=True)) for i in (1, 2)])
    Registry(home).save(record)
    env = dict(os.environ, CLUSTERKIT_HOME=str(home))
    res = subprocess.run([sys.executable, "-m", "clusterkit", "collect-ckpt", "ck-test-1",
                          "--dir", str(tmp_path / "{host}" / "ckpt")],
                         capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 0, res.stderr
    dest = home / "jobs" / "ck-test-1" / "checkpoints"
    assert len(list((dest / TAG).glob("*_optim_states.pt"))) == 4


# ------------------------------------------------------- a user script's save (no markers)


def _user_save(tmp: Path, n: int = 4, stage: int = 2, bf16: bool = False) -> list[CollectNode]:
    """What ``engine.save_checkpoint`` leaves in a user's script: DeepSpeed's files only."""
    nodes = _write_collect_nodes(tmp, n=n, stage=stage)
    for index, node in enumerate(nodes):
        tag_dir = Path(node.root, TAG)
        os.unlink(tag_dir / marker_name(index))
        if bf16:
            for shard in tag_dir.glob("zero_pp_rank_*_optim_states.pt"):
                shard.rename(shard.with_name("bf16_" + shard.name))
    return nodes


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_user_save_is_refused_with_the_way_out_then_collected_without_markers(
        tmp_path: Path, transport: DispatchTransport, stage: int) -> None:
    nodes = _user_save(tmp_path, stage=stage)
    with pytest.raises(CheckpointIncomplete) as info:
        verify(list_nodes(transport, nodes, None))
    assert any("--without-markers" in p for p in info.value.problems), info.value.problems
    plan = verify(list_nodes(transport, nodes, None), "latest", WithoutMarkers(world_size=8))
    assert plan.tag == TAG and plan.world_size == 8 and plan.canonical_node == "node1"
    assert plan.zero_stage == {0: 0, 1: None, 3: 3}[stage]  # names cannot tell 1 from 2
    assert [n.ranks for n in plan.nodes] == ([(), (), (), ()] if stage == 0 else
                                             [(0, 1), (2, 3), (4, 5), (6, 7)])
    assert plan.notes and "no completion markers" in plan.notes[0]


def test_without_markers_names_missing_extra_and_duplicate_ranks(
        tmp_path: Path, transport: DispatchTransport) -> None:
    nodes = _user_save(tmp_path, bf16=True)
    plan = verify(list_nodes(transport, nodes, None), "latest", WithoutMarkers(8))
    assert plan.precision == "bf16"
    with pytest.raises(CheckpointIncomplete) as info:  # the run had more ranks than given
        verify(list_nodes(transport, nodes, None), "latest", WithoutMarkers(6))
    assert ("optimizer shard for ranks [6, 7] beyond the world size 6: pass --world-size with the "
            "run's size") in info.value.problems
    os.unlink(synthetic.shard_paths(nodes[3].root)[1])  # rank 7
    src = synthetic.shard_paths(nodes[0].root)[0]
    Path(nodes[2].root, TAG, os.path.basename(src)).write_bytes(Path(src).read_bytes())
    with pytest.raises(CheckpointIncomplete) as info:
        verify(list_nodes(transport, nodes, None), "latest", WithoutMarkers(8))
    text = " | ".join(info.value.problems)
    assert "optimizer shard of rank 7 is missing (bf16_zero_pp_rank_7_mp_rank_00_optim_states.pt)" in text
    assert "rank 0 (bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt) exists on node1 and node3" in text


def test_a_torch_file_cut_short_is_refused_in_both_modes(
        tmp_path: Path, transport: DispatchTransport) -> None:
    """torch.save writes a zip whose last 22 bytes are the end record; a killed save lacks it."""
    nodes = _user_save(tmp_path)
    shard = Path(synthetic.shard_paths(nodes[1].root)[0])
    whole = b"PK\x03\x04" + b"x" * 100 + b"PK\x05\x06" + bytes(18)
    shard.write_bytes(whole)
    verify(list_nodes(transport, nodes, None), "latest", WithoutMarkers(8))
    shard.write_bytes(whole[:-30])
    with pytest.raises(CheckpointIncomplete, match=r"node2: global_step1/zero_pp_rank_2_mp_rank_00_"
                       r"optim_states.pt is cut short \(96 bytes, no zip end record\)"):
        verify(list_nodes(transport, nodes, None), "latest", WithoutMarkers(8))


def test_cli_without_markers_collects_a_user_save(tmp_path: Path) -> None:
    inv = _local_inventory(tmp_path)
    roots = [str(tmp_path / f"node{i}" / "ckpt") for i in (1, 2, 3)]
    synthetic.write_node_local(roots, shard_bytes=2048, model_bytes=512)
    for i, root in enumerate(roots):
        os.unlink(Path(root, TAG, marker_name(i)))
    dest = tmp_path / "dest"
    refused = _run_cli("-i", str(inv), "--to", str(dest))
    assert refused.returncode == 2 and "pass --without-markers" in refused.stderr
    assert refused.stderr.count("no node has a completion marker") == 1, refused.stderr  # once
    # One finding: it is the error line itself (one line, no bullet list above it).
    assert refused.stderr.strip().splitlines() == [
        f"clusterkit: error: checkpoint {TAG} cannot be collected, nothing was copied: {TAG} "
        "holds DeepSpeed "
        "checkpoint files but no node has a completion marker: only the bundled workload "
        "writes them. For a checkpoint your own script saved, pass --without-markers "
        "(docs/collect-ckpt.md says what it checks) — add --without-markers once the run "
        "has stopped saving"], refused.stderr
    misuse = _run_cli("-i", str(inv), "--to", str(dest), "--world-size", "6")
    assert misuse.returncode == 2 and "--world-size is for --without-markers" in misuse.stderr
    ok = _run_cli("-i", str(inv), "--to", str(dest), "--without-markers", "--json")
    assert ok.returncode == 0, ok.stderr
    report = json.loads(ok.stdout)
    assert report["collect"]["world_size"] == 6 and report["copied_bytes"] > 0
    assert "ZeRO-1/2, 6 ranks on 3 nodes" in ok.stderr
    assert "note: no completion markers" in ok.stderr
    assert len(list((dest / TAG).glob("*_optim_states.pt"))) == 6
    assert read_manifest(str(dest), TAG)["zero_stage"] is None
    # Scattered back onto 2 fresh nodes of 3 slots (re-split): the result is a complete
    # node-local checkpoint with markers, which the marker mode collects.
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    inv2 = _local_inventory(fresh, n=2)
    inv2.write_text(inv2.read_text().replace("slots: 2", "slots: 3"))
    back = _run_cli("-i", str(inv2), "--to", str(dest), "--scatter")
    assert back.returncode == 0, back.stderr
    for i, ranks in ((1, [0, 1, 2]), (2, [3, 4, 5])):
        tag_dir = fresh / f"node{i}" / "ckpt" / TAG
        marker = json.loads((tag_dir / marker_name(i - 1)).read_text())
        assert [r["global_rank"] for r in marker["ranks"]] == ranks
        assert (tag_dir / "mp_rank_00_model_states.pt").is_file()
    again = _run_cli("-i", str(inv2), "--to", str(fresh / "dest2"), "--json")
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["collect"]["world_size"] == 6


@pytest.mark.slow
def test_a_shared_storage_job_on_the_embedded_default_collects(tmp_path: Path) -> None:
    """README step 6 on the embedded default: a job that saved to shared storage is one
    directory seen by every node; collect reads it once (from the first node), and
    --include picks the one node to read it from. Before, every node listed the same
    shards and collect refused ("... exists on local1 and local2")."""
    env = {**os.environ, "CLUSTERKIT_HOME": str(tmp_path / "home")}
    run = subprocess.run(
        [sys.executable, "-m", "clusterkit.cli.main", "launch", "--nodes", "2",
         "--gpus-per-node", "1", "--steps", "2", "--storage", "shared"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    job = next((tmp_path / "home" / "jobs").iterdir()).name
    for i, extra in enumerate(([], ["--include", "local2"])):
        out = subprocess.run(
            [sys.executable, "-m", "clusterkit.cli.main", "collect-ckpt", job,
             "--to", str(tmp_path / f"out{i}"), *extra],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
        assert (tmp_path / f"out{i}" / "global_step2" / "mp_rank_00_model_states.pt").is_file()


def test_latest_without_a_latest_file_is_the_highest_step_not_the_last_name() -> None:
    """A user's own tags (step4, step8, step12; no DeepSpeed 'latest' file) order by their
    step, as everywhere else (node/contract.tag_step): step12, not step8 (a sort by name)."""
    from clusterkit.checkpoints.collect.discover import choose_tag
    from clusterkit.checkpoints.listing import NodeListing

    tags = ("step4", "step8", "step12")
    listings = [NodeListing(node=f"n{i}", index=i, root="/ckpt", exists=True,
                            tags={t: {} for t in tags}, markers={t: {"x": "y"} for t in tags})
                for i in range(2)]
    assert choose_tag(listings, "latest") == ("step12", [])


def test_collecting_an_older_user_tag_keeps_latest_on_the_newer(tmp_path: Path) -> None:
    """DEST/latest names the newest collected step, for a user's tags too (step12 is
    newer than step8, which a by-name or global_step-only rule got wrong)."""
    from clusterkit.checkpoints.collect.manifest import latest_tag_at, write_latest

    for tag in ("step12", "step8"):
        (tmp_path / tag).mkdir()
        (tmp_path / tag / MANIFEST).write_text("{}")
    write_latest(str(tmp_path), "step12")
    write_latest(str(tmp_path), "step8")
    assert latest_tag_at(str(tmp_path)) == "step12"
    write_latest(str(tmp_path), "global_step20")  # by step, whatever the prefix
    assert latest_tag_at(str(tmp_path)) == "global_step20"
