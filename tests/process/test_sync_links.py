"""clusterkit sync carries symbolic links (issue 29 leftover): the source scan (which links
travel as links and with what text, which are followed out of DIR, which are not copied),
the digest and manifest rows, the node's link making, then the whole path on local
virtual nodes with a Hugging Face hub cache's shape. The test-bed run (real sshd nodes,
doctor naming a repointed link) is tests/bed/test_sync_links_testbed.py."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from clusterkit.checks.rules_sync import check_sync
from clusterkit.node.sync import store as store
from clusterkit.sync.source import Ignore, link_text, scan
from tests.synchelpers import SHA_CFG, SHA_W, hf_tree, local_inventory, sync_verb


# ----------------------------------------------------------------------------- the scan
def test_scan_keeps_inside_links_follows_outside_ones_and_lists_dangling(tmp_path: Path) -> None:
    hub = hf_tree(tmp_path / "proj", tmp_path / "outside")
    found = scan(str(hub), Ignore())
    snap = "models--org--tiny/snapshots"
    assert found.symlinks == {
        f"{snap}/rev1/config.json": f"../../blobs/{SHA_CFG}",  # as written
        f"{snap}/rev1/model.safetensors": f"../../blobs/{SHA_W}",
        f"{snap}/rev1/abs.json": f"../../blobs/{SHA_CFG}",  # absolute: made relative
        f"{snap}/latest": "rev1",  # a directory link: kept, not walked
    }
    assert sorted(found.files) == ["extra/a.txt", f"models--org--tiny/blobs/{SHA_CFG}",
                                   f"models--org--tiny/blobs/{SHA_W}",
                                   "models--org--tiny/refs/main", "tokenizer.json"]
    assert found.files["tokenizer.json"].path == str(tmp_path / "outside" / "tokenizer.json")
    assert found.followed == {"extra": str(tmp_path / "outside" / "dir"),
                              "tokenizer.json": str(tmp_path / "outside" / "tokenizer.json")}
    assert found.links == ["dangling"]
    # nodes env's mode: every link listed, none followed or kept.
    old = scan(str(hub), Ignore(), links=False)
    assert sorted(old.links) == ["dangling", "extra", f"{snap}/latest", f"{snap}/rev1/abs.json",
                                 f"{snap}/rev1/config.json", f"{snap}/rev1/model.safetensors",
                                 "tokenizer.json"]
    assert not old.symlinks and not old.followed and "extra/a.txt" not in old.files
    # The snapshot directory itself as DIR: its blob links lead out of it, plain files travel.
    rev1 = scan(str(hub / snap / "rev1"), Ignore())
    assert sorted(rev1.files) == ["abs.json", "config.json", "model.safetensors"]
    assert not rev1.symlinks and len(rev1.followed) == 3
    # An ignored link is neither kept, followed nor listed.
    assert "tokenizer.json" not in scan(str(hub), Ignore.parse("tokenizer.json")).followed


def test_loops_are_not_followed(tmp_path: Path) -> None:
    src = tmp_path / "proj" / "d"
    (src / "sub").mkdir(parents=True)
    (src / "sub" / "f").write_text("x")
    os.symlink("..", src / "sub" / "up")  # inside: a link, never walked
    os.symlink(str(tmp_path / "proj"), src / "parent")  # outside, and holds d itself
    os.symlink("self", src / "self")
    found = scan(str(src), Ignore())
    assert found.symlinks == {"sub/up": ".."}
    assert found.links == ["parent/d", "self"]  # d again: a loop, stopped there
    assert sorted(found.files) == ["sub/f"] and found.followed == {
        "parent": str(tmp_path / "proj")}


@pytest.mark.parametrize(("rel", "target", "want"), [
    ("a/b", "../c", "../c"),               # relative, inside: as written
    ("a/b", "../../d/c", "../c"),          # out of d and back in by name: rewritten
    ("a/b", "ABS/c", "../c"),              # absolute into d: relative to the link
    ("a/b", "ABS", ".."),                  # the directory itself
    ("a/b", "../via/c", "../via/c"),       # through another link, read the same: as written
    ("a/b", "../via/../c", "../real/c"),   # '..' after a link: where the kernel goes
    ("a/b", "../.clusterkit-sync/x", None),  # into the sync's own state: not copied
])
def test_link_text(tmp_path: Path, rel: str, target: str, want: str | None) -> None:
    d = tmp_path / "d"
    for p in ("a", "real/deep", ".clusterkit-sync"):
        (d / p).mkdir(parents=True)
    for p in ("c", "real/c", "real/deep/c", ".clusterkit-sync/x"):
        (d / p).write_text("x")
    os.symlink("real/deep", d / "via")
    target = target.replace("ABS", str(d))
    os.symlink(target, d / rel)
    real = os.path.realpath(d / rel)
    assert link_text(rel, target, str(d), os.path.realpath(d), real) == want


# ----------------------------------------------------------------------------- the store
@pytest.mark.parametrize(("rel", "target", "ok"), [
    ("s/r/config.json", "../../blobs/x", True),
    ("s/latest", "r", True),
    ("s/latest", ".", True),
    ("s/x", "../../up", False),            # out of the destination
    ("x", "/etc/passwd", False),           # absolute
    ("s/x", "../.clusterkit-sync/manifest.json", False),
    ("../x", "y", False),
    ("x", "", False),
])
def test_a_node_makes_only_links_that_stay_inside(rel: str, target: str, ok: bool) -> None:
    assert store.safe_link(rel, target) is ok


def test_links_in_the_digest_and_the_manifest(tmp_path: Path) -> None:
    entries = [["f", 1, 0, 0o644, "s" * 64, ["s" * 64]]]
    assert store.entries_digest(entries) == store.entries_digest(entries, [])  # as before
    one = store.entries_digest(entries, [["l", "f"]])
    assert one != store.entries_digest(entries) != store.entries_digest(entries, [["l", "g"]])
    d = tmp_path / "d"
    d.mkdir()
    (d / "f").write_bytes(b"x")
    st = os.stat(d / "f")
    sha = store.hash_file(str(d / "f"))[0]
    os.symlink("f", d / "l")
    digest = store.write_manifest(str(d), {"f": [1, st.st_mtime_ns, 0o644, sha]}, {"l": "f"})
    assert digest == store.entries_digest([["f", 1, 0, 0, sha, []]], [["l", "f"]])
    assert store.check(str(d), digest)["state"] == "ok"
    os.unlink(d / "l")
    os.symlink("elsewhere", d / "l")  # repointed on the node: named
    assert store.check(str(d), digest) == {"state": "differs", "digest": digest,
                                           "differ": ["l"], "links_differ": 1, "files": 1,
                                           "links": 1}
    (finding,) = check_sync({"n1": store.check(str(d), digest)}, "d", digest, ["n1"])
    assert finding.detail == "d: 1 link(s) differ from what sync put there: l"
    assert store.walk(str(d)) == ["f"] and store.walk(str(d), links=True) == ["f", "l"]


def test_making_links_on_a_node(tmp_path: Path) -> None:
    d = tmp_path / "d"
    (d / "old").mkdir(parents=True)
    (d / "old" / "x").write_text("x")
    os.symlink("old", d / "was-link")  # sync made it; the source now has a directory here
    os.symlink("old", d / "users")  # someone made it on the node: written through
    (d / "file").write_text("a file where a link goes")
    os.symlink("stale", d / "right")
    os.symlink("b", d / "ok")
    (d / "emptied" / "sub").mkdir(parents=True)
    links = [["ok", "b"], ["right", "b"], ["file", "b"], ["emptied", "b"], ["old", "b"],
             ["new/dir/l", "../../b"], ["bad", "../../out"]]
    held, todo, refused = store.plan_links(str(d), links, ["was-link/f", "users/f", "ok",
                                                           "new/dir/l"], {"was-link": "old"})
    assert not os.path.lexists(d / "was-link") and (d / "old" / "x").exists()
    assert os.readlink(d / "users") == "old"
    assert held == {"ok": "b"} and set(refused) == {"bad"}
    made, failed = store.make_links(str(d), todo)
    assert set(made) == {"right", "file", "emptied", "new/dir/l"}
    assert list(failed) == ["old"] and "holds files the source lacks" in failed["old"]
    for rel in made:
        assert os.readlink(d / rel) == todo[rel]
    assert not [n for n in os.listdir(d) if n.startswith(".ck-link-tmp")]


def test_a_directory_link_made_by_sync_gives_way_to_a_directory(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CLUSTERKIT_HOME", str(tmp_path / "home"))
    hub = tmp_path / "proj" / "hub"
    (hub / "rev1").mkdir(parents=True)
    (hub / "rev1" / "f").write_text("1")
    os.symlink("rev1", hub / "main")
    local_inventory(tmp_path, 1)
    sync_verb(tmp_path / "proj", "hub", tmp_path / "inv.yaml", capsys)
    assert os.readlink(tmp_path / "w0" / "hub" / "main") == "rev1"
    os.unlink(hub / "main")
    (hub / "main").mkdir()
    (hub / "main" / "f").write_text("2")
    out, _ = sync_verb(tmp_path / "proj", "hub", tmp_path / "inv.yaml", capsys)
    assert "v0: 1 file(s) sent (1 bytes, verified), 1 unchanged" in out
    node = tmp_path / "w0" / "hub"
    assert not (node / "main").is_symlink() and (node / "main" / "f").read_text() == "2"
    assert (node / "rev1" / "f").read_text() == "1"
    # Back to a link: the directory holds a file the source lacks; --delete clears it.
    shutil.rmtree(hub / "main")
    os.symlink("rev1", hub / "main")
    out, _ = sync_verb(tmp_path / "proj", "hub", tmp_path / "inv.yaml", capsys, code=2)
    assert "v0: 0 file(s) sent (0 bytes, verified), 1 unchanged, 1 failed (main: cannot make " \
        "the link: main is a directory on this node that holds files the source lacks (sync " \
        "--delete removes them)), 1 extra file(s) kept" in out, out
    out, _ = sync_verb(tmp_path / "proj", "hub", tmp_path / "inv.yaml", capsys, "--delete")
    assert "v0: 0 file(s) sent (0 bytes, verified), 1 unchanged, 1 link(s) made, 1 deleted" in out
    assert os.readlink(node / "main") == "rev1"


# ----------------------------------------------------------------------------- local nodes
def test_a_hub_cache_reaches_local_nodes_with_its_links(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CLUSTERKIT_HOME", str(tmp_path / "home"))
    hub = hf_tree(tmp_path / "proj", tmp_path / "outside")
    local_inventory(tmp_path)
    out, err = sync_verb(tmp_path / "proj", "hub", tmp_path / "inv.yaml", capsys)
    assert "v[0-2]: 5 file(s) sent (3,028 bytes, verified), 0 unchanged, 4 link(s) made" in out
    assert "note: 1 symbolic link(s) not copied: dangling" in out
    assert "note: 2 link(s) lead outside hub: copied as what they point at (5 B): extra -> " \
        in err and "list it in hub/.clusterkitignore" in err
    snap = "models--org--tiny/snapshots/rev1"
    for i in range(3):
        dest = tmp_path / f"w{i}" / "hub"
        assert os.readlink(dest / snap / "config.json") == f"../../blobs/{SHA_CFG}"
        assert os.readlink(dest / snap / "abs.json") == f"../../blobs/{SHA_CFG}"
        assert (dest / snap / "abs.json").read_text() == '{"hidden_size": 8}\n'
        assert (dest / "models--org--tiny" / "snapshots" / "latest" / "model.safetensors"
                ).read_bytes() == (hub / snap / "model.safetensors").read_bytes()
        assert not (dest / "tokenizer.json").is_symlink()
        assert (dest / "extra" / "a.txt").read_text() == "a\n"
        assert not os.path.lexists(dest / "dangling")
    out, _ = sync_verb(tmp_path / "proj", "hub", tmp_path / "inv.yaml", capsys, "--json")
    done = json.loads(out.splitlines()[-1])
    assert done["ok"] and done["sent_from_here"] == 0 and done["links"] == ["dangling"]
    assert {n: r["links_made"] for n, r in done["nodes"].items()} == {"v0": 0, "v1": 0, "v2": 0}
    # A link repointed on one node, one gone from the source, one extra on a node.
    w1 = tmp_path / "w1" / "hub"
    os.unlink(w1 / snap / "config.json")
    os.symlink("elsewhere", w1 / snap / "config.json")
    os.unlink(hub / "models--org--tiny" / "snapshots" / "latest")
    os.symlink("rev1", tmp_path / "w2" / "hub" / "mine")
    out, _ = sync_verb(tmp_path / "proj", "hub", tmp_path / "inv.yaml", capsys)
    assert "v1: 0 file(s) sent (0 bytes, verified), 5 unchanged, 1 link(s) made, " \
        "1 extra file(s) kept" in out
    assert os.readlink(w1 / snap / "config.json") == f"../../blobs/{SHA_CFG}"
    assert "v2: 0 file(s) sent (0 bytes, verified), 5 unchanged, 2 extra file(s) kept" in out
    out, _ = sync_verb(tmp_path / "proj", "hub", tmp_path / "inv.yaml", capsys, "--delete")
    assert "v[0-1]: 0 file(s) sent (0 bytes, verified), 5 unchanged, 1 deleted" in out
    assert "v2: 0 file(s) sent (0 bytes, verified), 5 unchanged, 2 deleted" in out
    for i in range(3):
        assert not os.path.lexists(tmp_path / f"w{i}" / "hub" / "models--org--tiny" /
                                   "snapshots" / "latest")
    assert not os.path.lexists(tmp_path / "w2" / "hub" / "mine")
