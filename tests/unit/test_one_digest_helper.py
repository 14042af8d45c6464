"""One MAC helper and one file-digest helper (issue 36 item 5): ``clusterkit/node/hashing.py``.

There were two ``mac()`` helpers (the replica wire joined its parts with nothing, the sync
chain with NUL bytes) and five sha256-of-a-file helpers. An AST scan of clusterkit/ fails
on a second ``def mac`` and on a small function that opens a file, feeds it to sha256 and
returns the hex digest (what hashing.sha256_file does); code that hashes while it sends
or receives (the replica wire, ckpt.stream, collect's receiver) is not that shape.
"""

from __future__ import annotations

import ast
import hashlib
import hmac
from pathlib import Path

from clusterkit.node.hashing import mac, sha256_file
from tests.paths import REPO

HOME = "clusterkit/node/hashing.py"


def _is_file_digest(fn: ast.FunctionDef) -> bool:
    """A short function: open(..., "rb"), hashlib.sha256(), return <h>.hexdigest(), on one
    file (no directory walk)."""
    nodes = list(ast.walk(fn))
    opens = any(isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "open"
                and any(isinstance(a, ast.Constant) and a.value == "rb" for a in n.args)
                for n in nodes)
    sha = any(isinstance(n, ast.Attribute) and n.attr == "sha256"
              and isinstance(n.value, ast.Name) and n.value.id == "hashlib" for n in nodes)
    returns = any(isinstance(n, ast.Return) and isinstance(n.value, ast.Call)
                  and isinstance(n.value.func, ast.Attribute) and n.value.func.attr == "hexdigest"
                  for n in nodes)
    walks = any(isinstance(n, ast.Attribute) and n.attr in ("walk", "listdir", "scandir")
                for n in nodes)  # a digest of a tree (gatefacts' package digest) is another thing
    return opens and sha and returns and not walks and len(fn.body) <= 4


def _second_helpers(path: str, tree: ast.AST) -> list[str]:
    out = []
    for n in ast.walk(tree):
        if isinstance(n, ast.FunctionDef) and path != HOME:
            if n.name == "mac":
                out.append(f"{path}:{n.lineno}: def mac: use {HOME}'s mac")
            elif _is_file_digest(n):
                out.append(f"{path}:{n.lineno}: def {n.name} hashes a file: use {HOME}'s "
                           "sha256_file")
    return out


def test_no_second_mac_or_file_digest_helper() -> None:
    problems = []
    for p in sorted((REPO / "clusterkit").rglob("*.py")):
        rel = str(p.relative_to(REPO))
        problems += _second_helpers(rel, ast.parse(p.read_text(encoding="utf-8")))
    assert not problems, "\n".join(problems)


def test_the_scan_sees_the_shapes_it_replaced() -> None:
    old = ("def _sha256(path):\n    h = hashlib.sha256()\n    with open(path, 'rb') as fh:\n"
           "        for b in iter(lambda: fh.read(1 << 20), b''):\n            h.update(b)\n"
           "    return h.hexdigest()\n\n"
           "def mac(secret, *parts):\n    return hmac.new(secret, b''.join(parts)).hexdigest()\n")
    assert len(_second_helpers("clusterkit/x.py", ast.parse(old))) == 2


def test_the_helpers(tmp_path: Path) -> None:
    f = tmp_path / "f"
    f.write_bytes(b"x" * (3 << 20))
    assert sha256_file(str(f)) == hashlib.sha256(b"x" * (3 << 20)).hexdigest()
    # NUL-separated: ("ab", "c") and ("a", "bc") differ
    assert mac(b"k", b"ab", b"c") != mac(b"k", b"a", b"bc")
    assert mac(b"k", b"a", b"b") == hmac.new(b"k", b"a\0b", hashlib.sha256).hexdigest()
