"""Put one directory on many nodes at the link's rate: a pipelined chain, delta, verified.

The entry point (stable; ``clusterkit sync``, ``launch --sync`` and the environment
replication call it)::

    sync_dir(transport, nodes, src_dir, dest_dir=None, *, options=SyncOptions())
        -> SyncResult

* ``nodes``: :class:`SyncNode` (name, SSH target, the node's Python, the address the
  other nodes reach it at, its destination directory); ``dest_dir``, when given, is
  the destination on every node instead (e.g. an environment's absolute path).
* what travels: every regular file under ``src_dir`` that ``options.ignore`` does not
  exclude (default: nothing is excluded), and its symbolic links (sync/source.scan):
  one that resolves inside ``src_dir`` is made on each node as a link, one that leads
  outside is followed (its target's bytes travel, a note says so), a dangling one or a
  loop is not copied (``SyncResult.links`` lists them). ``options.links=False``
  leaves every link alone (``nodes env``, which makes its links itself).
* how: each node runs the node program ``sync.chain`` (node/sync/chain.py, over the transport);
  it says what it lacks (a file it holds with the same sha256 is kept; a partial
  file's verified 64 MiB chunks too), the launcher plans one chain in the nodes'
  order (plan.Chains), streams every record some node lacks to the first node
  over TCP, and each node writes what it lacks and forwards the rest at once, so S
  bytes reach N nodes in about S/R. Each chunk is checked against this side's
  sha256 on arrival, each file renamed into place only when complete, and each node
  writes its manifest last (node/sync/store.py): its digest equals
  :attr:`SyncResult.digest` exactly when the node holds every file.
* a hop that cannot connect (a blocked port) splits the chain: the launcher feeds
  the next node itself (``notes`` says so, with the cost); a node lost mid-transfer
  is cut out and the launcher re-feeds the nodes after it from where each stopped;
  the others complete. Per-node results, never an exception for one node's failure.
* the per-run secret authenticating every TCP hop goes to each node on stdin only.

What each node holds afterwards, and whether the chain's ports are open, is
:mod:`clusterkit.sync.check` (doctor).
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import secrets
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from clusterkit.errors import TransportError
from clusterkit.node.sync import store as store
from clusterkit.node.sync.wire import END, WireError, dial, header
from clusterkit.remote.base import RemoteProcess, SSHTarget, Transport
from clusterkit.remote.fanout import fan_out
from clusterkit.ship import node_command
from clusterkit.sync.plan import Chains, FeedRoutes, NodeView, records
from clusterkit.sync.source import Ignore, followed_note, scan, source_entries
from clusterkit.sync.ssh import StdinOut
from clusterkit.sync.types import NodeResult, Progress, SyncResult

DEFAULT_PORT = 29640  # first port each node tries for the chain (16 after it)
READY_TIMEOUT_S = 600.0  # a node hashing what it already holds may take long


@dataclass(frozen=True)
class SyncNode:
    name: str
    target: SSHTarget
    python: str
    address: str  # where the other nodes and this machine reach it over TCP
    dest: str = ""  # absolute directory on the node (or sync_dir's dest_dir)


@dataclass(frozen=True)
class SyncOptions:
    delete: bool = False  # remove node files the source lacks (only in a synced dir)
    ignore: Ignore = field(default_factory=Ignore)  # not sent, neither extra nor deleted
    port: int = DEFAULT_PORT  # 0: any free port
    cache_dir: str | None = None  # the source's (path, size, mtime_ns) -> sha256 cache
    on_progress: Callable[[Progress], None] | None = None
    on_note: Callable[[str], None] | None = None  # a note as it happens (also in notes)
    progress_every_s: float = 1.0
    links: bool = True  # symbolic links travel (docs/sync.md); False: left alone
    env: Mapping[str, str] | None = None  # the node program's environment
    ready_timeout_s: float = READY_TIMEOUT_S


STALL_S = 90.0  # no word from a node for this long: it is lost
SLICE = 8 << 20  # one sendfile call: the progress moves at least this often


@dataclass
class _Peer:
    index: int
    node: SyncNode
    proc: RemoteProcess
    result: NodeResult
    port: int = 0
    need: dict[int, list[int]] = field(default_factory=dict)
    last_word: float = field(default_factory=time.monotonic)
    tail: list[str] = field(default_factory=list)
    delete: list[str] = field(default_factory=list)
    addr: str = ""  # the node's address as its SSH session reached it (the chain's)
    out: StdinOut | None = None  # its stdin: control lines, or records (sync/ssh.py)
    fed: threading.Event = field(default_factory=threading.Event)  # its feed-from came
    feed_from: int = 0


def sync_dir(transport: Transport, nodes: Sequence[SyncNode], src_dir: str,
             dest_dir: str | None = None, *, options: SyncOptions | None = None
             ) -> SyncResult:
    """Put ``src_dir`` on every node (module docstring); per-node results."""
    opts = options or SyncOptions()
    found = scan(src_dir, opts.ignore, opts.links)
    notes = [followed_note(src_dir, found)] if found.followed else []
    if notes and opts.on_note:  # before hashing what the links lead to: it may be big
        opts.on_note(notes[0])
    entries, hashed = source_entries(found.files, opts.cache_dir, src_dir)
    paths = {e[store.REL]: found.files[e[store.REL]].path for e in entries}
    links = [[rel, text] for rel, text in sorted(found.symlinks.items())]
    result = SyncResult(
        digest=store.entries_digest(entries, links),
        files=len(entries), total_bytes=sum(int(e[store.SIZE]) for e in entries),
        nodes={n.name: NodeResult(n.name) for n in nodes}, hashed_bytes=hashed,
        links=list(found.links), symlinks=len(links), notes=notes)
    if nodes:
        _Run(transport, nodes, dest_dir, entries, paths, opts, result,
             links if opts.links else None).run()
    return result


class _Run:
    """One sync: the sessions, the feeders, the event loop."""

    def __init__(self, transport: Transport, nodes: Sequence[SyncNode], dest_dir: str | None,
                 entries: list[list[Any]], paths: dict[str, str], opts: SyncOptions,
                 result: SyncResult, links: list[list[str]] | None = None) -> None:
        self.transport, self.nodes, self.dest_dir = transport, nodes, dest_dir
        self.entries, self.paths, self.opts, self.result = entries, paths, opts, result
        self.secret = secrets.token_hex(32)
        self.events: queue.Queue[tuple[int, dict[str, Any]]] = queue.Queue()
        self.peers: dict[int, _Peer] = {}
        self.lock = threading.Lock()
        self.chains = Chains()
        self.routes = FeedRoutes()
        self.recs: list[tuple[int, int, tuple[int, ...]]] = []
        self.stop = threading.Event()
        self.sent = 0
        self.feeders: dict[int, threading.Thread] = {}
        self.socks: list[socket.socket] = []
        self.changed: set[str] = set()
        self.links = links  # [rel, target] the nodes make; None: they leave links alone

    # ---------------------------------------------------------------- sessions
    def _start(self, i: int, node: SyncNode) -> None:
        dest = self.dest_dir or node.dest
        spec = {"dest": dest, "index": i, "secret": self.secret, "files": self.entries,
                "links": self.links, "port": self.opts.port, "delete": self.opts.delete}
        cmd = node_command(node.python, "sync.chain", ["serve"])
        res = self.result.nodes[node.name]
        try:
            proc = self.transport.start(node.target, cmd.argv, env=self.opts.env)
            proc.write_stdin(cmd.stdin + (json.dumps(spec) + "\n").encode())
        except TransportError as exc:
            res.state, res.why = "failed", f"{exc.kind}: {exc.message}"
            return
        peer = self.peers[i] = _Peer(i, node, proc, res, out=StdinOut(proc))
        threading.Thread(target=self._read, args=(peer,), daemon=True,
                         name=f"clusterkit-sync-{node.name}").start()

    def _read(self, peer: _Peer) -> None:
        for stream, line in peer.proc.lines():
            if stream == "stdout" and line.startswith("{"):
                try:
                    self.events.put((peer.index, json.loads(line)))
                    continue
                except ValueError:
                    pass
            peer.tail = ([*peer.tail, line])[-5:]
        try:
            rc = peer.proc.wait(timeout=30)
        except TimeoutError:
            rc = -1
        self.events.put((peer.index, {"ev": "exit", "rc": rc}))

    def _say(self, i: int, msg: dict[str, Any]) -> None:
        out = self.peers[i].out
        if out is not None:
            out.say(msg)

    def _note(self, text: str) -> None:
        self.result.notes.append(text)
        if self.opts.on_note:
            self.opts.on_note(text)

    # ---------------------------------------------------------------- the run
    def run(self) -> None:
        started = time.monotonic()
        fan_out([n.target for n in self.nodes], lambda t: self._start_named(t.name),
                per_host_budget_s=120.0, max_parallel=64)
        try:
            self._gather_ready()
            self._go()
            self._loop(started)
        except KeyboardInterrupt:
            self._end(interrupted=True)
            raise
        self._end()
        self.result.seconds = time.monotonic() - started
        self.result.sent_bytes = self.sent
        self.result.changed = sorted(self.changed)

    def _start_named(self, name: str) -> Any:
        from clusterkit.remote.base import CommandResult

        i = next(k for k, n in enumerate(self.nodes) if n.name == name)
        self._start(i, self.nodes[i])
        return CommandResult(name, ("sync.chain",), 0, "", "", 0.0)

    def _gather_ready(self) -> None:
        waiting = set(self.peers)
        deadline = time.monotonic() + self.opts.ready_timeout_s
        while waiting and time.monotonic() < deadline:
            try:
                i, ev = self.events.get(timeout=1.0)
            except queue.Empty:
                continue
            peer = self.peers[i]
            peer.last_word = time.monotonic()
            kind = ev.get("ev")
            if kind == "ready" and i in waiting:
                self._ready(peer, ev)
                waiting.discard(i)
            elif kind in ("error", "exit") and i in waiting:
                peer.result.state = "failed"
                peer.result.why = str(ev.get("why") or self._exit_why(peer, ev))
                waiting.discard(i)
        for i in waiting:
            self.peers[i].result.state = "failed"
            self.peers[i].result.why = f"not ready after {self.opts.ready_timeout_s:g} s"
            self._say(i, {"op": "stop"})

    def _exit_why(self, peer: _Peer, ev: dict[str, Any]) -> str:
        tail = "; ".join(t for t in peer.tail if t.strip())[-300:]
        return f"the node program ended (exit {ev.get('rc')})" + (f": {tail}" if tail else "")

    def _ready(self, peer: _Peer, ev: dict[str, Any]) -> None:
        res = peer.result
        peer.port = int(ev["port"])
        peer.addr = str(ev.get("addr") or "")
        peer.need = {int(fi): [int(c) for c in cs] for fi, cs in ev["need"]}
        res.need_bytes = int(ev["need_bytes"])
        res.files_sent = len(peer.need)
        res.unchanged = len(self.entries) - len(peer.need)
        extra = [r for r in ev.get("extra", []) if not self.opts.ignore.ignored_path(r)]
        res.extra = [] if self.opts.delete else extra
        peer.delete = extra if self.opts.delete else []
        res.state = "sending"

    def _go(self) -> None:
        ready = [i for i in sorted(self.peers) if self.peers[i].result.state == "sending"]
        self.chains = Chains.plan(ready)
        self.result.chains = [[self.nodes[i].name for i in c] for c in self.chains.chains]
        self.recs = records({i: self.peers[i].need for i in ready})
        for i in ready:
            self._say(i, {"op": "go", "down": self._addr(self.chains.downstream(i)),
                          "delete": self.peers[i].delete})
        for head in self.chains.heads():
            self._feed(head)

    def _addr(self, i: int | None) -> dict[str, Any] | None:
        if i is None:
            return None
        p = self.peers[i]
        return {"node": p.node.name, "address": p.addr or p.node.address, "port": p.port}

    # ---------------------------------------------------------------- feeding
    def _feed(self, head: int) -> None:
        t = threading.Thread(target=self._feeder, args=(head,), daemon=True,
                             name=f"clusterkit-sync-feed-{head}")
        self.feeders[head] = t
        t.start()

    def _feeder(self, head: int) -> None:
        peer = self.peers[head]
        try:
            sock, start = self._dial(peer)
        except (OSError, ValueError, WireError) as exc:
            route, note = self.routes.decide(head, peer.node.name, peer.port, str(exc))
            if route == "ssh":
                if note:
                    self._note(note)
                self._feed_over_ssh(peer)
            else:
                self.events.put((head, {"ev": "unreachable", "why": str(exc)}))
            return
        self.socks.append(sock)
        try:
            self._stream(sock, head, start)
            sock.sendall(header(len(self.recs), END, 0, 0, ()))
            sock.shutdown(socket.SHUT_WR)
            with contextlib.suppress(OSError):
                while sock.recv(65536):
                    pass
        except OSError as exc:
            self.events.put((head, {"ev": "feed-lost", "why": str(exc)}))
        finally:
            sock.close()

    def _feed_over_ssh(self, peer: _Peer) -> None:
        """The same records, verified and resumed the same way, on the node's stdin."""
        out = peer.out
        assert out is not None
        try:
            peer.fed.clear()
            out.start_feed()
            deadline = time.monotonic() + 120.0  # the node dials its downstream first
            while not peer.fed.wait(0.5):
                if (self.stop.is_set() or peer.result.state != "sending"
                        or time.monotonic() > deadline):
                    raise OSError("the node did not take the feed over SSH")
            self._stream(out, peer.index, peer.feed_from, out.record)
            out.end_feed(header(len(self.recs), END, 0, 0, ()))
        except (OSError, TransportError) as exc:
            out.mode = "broken"
            self.events.put((peer.index, {"ev": "feed-lost", "why": f"over SSH: {exc}"}))

    def _dial(self, peer: _Peer) -> tuple[socket.socket, int]:
        """The inventory's address first (this machine's name for the node), then the
        one the node's SSH session came in on."""
        try:
            return dial(peer.node.address, peer.port, self.secret)
        except (OSError, ValueError):
            if not peer.addr or peer.addr == peer.node.address:
                raise
        return dial(peer.addr, peer.port, self.secret)

    def _stream(self, sock: Any, head: int, start: int,
                record: Callable[[], Any] = contextlib.nullcontext) -> None:
        fh: Any = None
        open_fi = -1
        try:
            for seq in range(start, len(self.recs)):
                if self.stop.is_set():
                    raise OSError("stopped")
                fi, ci, to = self.recs[seq]
                with self.lock:
                    members = set(self.chains.members(head))
                if not members & set(to):
                    continue
                e = self.entries[fi]
                n = store.chunk_len(int(e[store.SIZE]), ci)
                if fi != open_fi:
                    if fh is not None:
                        fh.close()
                    fh, open_fi = open(self.paths[e[store.REL]], "rb"), fi  # noqa: SIM115
                with record():
                    sock.sendall(header(seq, fi, ci, n, to))
                    self._send_chunk(sock, fh, ci * store.CHUNK, n, str(e[store.REL]))
                st = os.fstat(fh.fileno())
                if (st.st_size, st.st_mtime_ns) != (int(e[store.SIZE]), int(e[store.MTIME])):
                    self.changed.add(str(e[store.REL]))
        finally:
            if fh is not None:
                fh.close()

    def _send_chunk(self, sock: Any, fh: Any, offset: int, n: int, rel: str) -> None:
        """``n`` bytes of the file from ``offset``, zero-copy, in slices (progress)."""
        left = n
        while left:
            if self.stop.is_set():
                raise OSError("stopped")
            want = min(SLICE, left)
            sent = sock.sendfile(fh, offset + n - left, want)
            if sent < want:  # the file shrank: keep the framing, the nodes refuse it
                sock.sendall(bytes(want - sent))
                self.changed.add(rel)
            left -= want
            with self.lock:
                self.sent += want

    # ---------------------------------------------------------------- events
    def _loop(self, started: float) -> None:
        last_progress = 0.0
        while any(p.result.state == "sending" for p in self.peers.values()):
            try:
                i, ev = self.events.get(timeout=0.5)
                self._event(self.peers[i], ev)
            except queue.Empty:
                pass
            now = time.monotonic()
            for p in self.peers.values():
                if p.result.state == "sending" and now - p.last_word > STALL_S:
                    self._lose(p, f"no word from it for {STALL_S:g} s")
            if self.opts.on_progress and now - last_progress >= self.opts.progress_every_s:
                last_progress = now
                self.opts.on_progress(self.progress(now - started))

    def progress(self, elapsed: float) -> Progress:
        views = tuple(NodeView(p.node.name, p.result.got_bytes, p.result.need_bytes,
                               p.result.state) for _, p in sorted(self.peers.items()))
        return Progress(views, elapsed, self.sent)

    def _event(self, peer: _Peer, ev: dict[str, Any]) -> None:
        peer.last_word = time.monotonic()
        kind, res = ev.get("ev"), peer.result
        if kind in ("progress", "stopped"):
            res.got_bytes = int(ev.get("got", res.got_bytes))
        elif kind == "done" and res.state == "sending":
            res.state, res.digest = "done", str(ev["digest"])
            res.got_bytes = int(ev["got"])
            res.failed = {str(k): str(v) for k, v in dict(ev.get("failed", {})).items()}
            res.lacking, res.lacking_count = list(ev["lacking"]), int(ev["lacking_count"])
            res.deleted = list(ev.get("deleted", []))
            res.links_made = int(ev.get("links", 0))
            res.links_failed = int(ev.get("links_failed", 0))
        elif kind == "feed-from":
            peer.feed_from = int(ev["seq"])
            peer.fed.set()
        elif kind == "blocked":
            self._blocked(peer, ev)
        elif kind == "down-lost":
            with self.lock:
                down = self.chains.downstream(peer.index)
            if down is not None:
                self._lose(self.peers[down], f"{peer.node.name} could not send to it: {ev['why']}")
        elif kind in ("unreachable", "feed-lost"):
            port = peer.port
            if kind == "unreachable":
                self._lose(peer, f"cannot reach it on port {port} from here: {ev['why']}",
                           state="failed")
            else:
                self._lose(peer, f"the stream to it broke: {ev['why']}")
        elif kind == "exit" and res.state == "sending":
            self._lose(peer, self._exit_why(peer, ev))

    def _blocked(self, peer: _Peer, ev: dict[str, Any]) -> None:
        target = next((p for p in self.peers.values() if p.node.name == ev["down"]), None)
        if target is None:
            return
        with self.lock:
            head = self.chains.split_before(target.index)
            copies = len(self.chains.chains)
        if head is not None:
            self._note(
                f"node-to-node blocked on port {ev['port']} ({peer.node.name} -> "
                f"{target.node.name}: {ev['why']}): sending {copies} copies from here, "
                f"~{copies}x size/rate")
            self._feed(head)

    def _lose(self, peer: _Peer, why: str, state: str = "lost") -> None:
        res = peer.result
        if res.state != "sending":
            return
        res.state, res.why = state, why
        with self.lock:
            up = self.chains.upstream(peer.index)
            head = self.chains.lose(peer.index)
        if up is not None:
            self._say(up, {"op": "cut"})
        self._say(peer.index, {"op": "stop"})
        with contextlib.suppress(TransportError, OSError):
            peer.proc.close_stdin()
        if head is not None and self.peers[head].result.state == "sending":
            self._feed(head)

    def _end(self, interrupted: bool = False) -> None:
        self.stop.set()
        for p in self.peers.values():
            self._say(p.index, {"op": "stop"})
            with contextlib.suppress(TransportError, OSError):
                p.proc.close_stdin()
        for s in list(self.socks):
            with contextlib.suppress(OSError):
                s.close()
        for p in self.peers.values():
            try:
                p.proc.wait(timeout=10)
            except (TimeoutError, TransportError):
                p.proc.terminate()
        if interrupted:
            for p in self.peers.values():
                if p.result.state == "sending":
                    p.result.state, p.result.why = "lost", "interrupted"

