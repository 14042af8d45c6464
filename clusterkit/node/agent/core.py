"""The node agent (node program ``agent.core``, shipped by :mod:`clusterkit.ship`).

One agent runs per node and job, over ONE SSH session (or as a local child for
virtual nodes). It reads its :class:`~clusterkit.node.protocol.AgentSpec` as JSON
on the first stdin line after its sources (or ``--spec-b64``), writes the job's
files atomically into the per-job directory, starts the per-node launcher (torchrun,
``accelerate launch``, DeepSpeed's runner or the workload itself) in its own session
with ``CLUSTERKIT_JOB_ID`` in the environment of every process, and streams the output
back as machine-parsable lines (``@ck:L`` output lines, ``@ck:E`` events:
:mod:`clusterkit.node.agent.output`). The rest of stdin carries control commands, one
per line: ``TERM`` (teardown with a grace period), ``KILL``, ``USR1``, ``USR2``
(forwarded to the ranks), ``GO`` (after the gate), ``DUMP`` (stacks). EOF on stdin — the
launcher exited or the SSH connection dropped — tears the job down on this node.
Teardown is job-scoped, by the ``CLUSTERKIT_JOB_ID`` tag, never by command line
(:mod:`clusterkit.node.agent.procs`).

This module is the entry and the core loop; the agent's other concerns live beside it
in ``node/agent/``, each a module of the ``agent.core`` program (``ship.py``'s ``PROGRAMS``):

- ``state``: holding, running, stopping, exited, guarded moves; ``procs``: the job's
  processes found by their tag, signalled, swept; ``--status``
- ``files``: the job-dir token, the checkpoint dir; ``env``: the ranks' environment
- ``output``: rank labels, log files, the writer thread, failure reports
- ``forkserver``: the fork server's client (native mode; the server is ``zygote``)
- ``hangs``: progress (heartbeats) and stack dumps for the hang watchdog
- ``replicas.proc`` (with ``replicas.service``, ``replicas.wire``, ``replicas.done``):
  checkpoint replicas, agent to agent, copied by a child process in a session of its own

The agent's exit code is the launcher's (128+N when a signal N ended it). Other modes,
used by ``clusterkit stop`` / ``status`` through ``run_all``: ``--stop JOB_ID [--grace S]``
and ``--status JOB_ID [--job-dir D --node N]``. Standard library only, Python >= 3.8 on
the node. The wire format lives in :mod:`clusterkit.node.protocol`.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import IO, Any

from clusterkit.node import protocol
from clusterkit.node.agent import env, hangs, zygote
from clusterkit.node.agent.files import expand
from clusterkit.node.agent.forkserver import ForkServer
from clusterkit.node.agent.hangs import PROGRESS_EVERY_S, StackDump
from clusterkit.node.agent.output import AgentOutput
from clusterkit.node.agent.procs import (
    POLL_S,
    Child,
    job_processes,
    job_status,
    rank_pids_of,
    signal_group,
    signal_pid,
    sweep,
)
from clusterkit.node.agent.state import Lifecycle, State
from clusterkit.node.ckpt.ready import ready_checkpoints
from clusterkit.node.contract import JobDir
from clusterkit.node.facts.gatefacts import drop_tokens, gate_facts
from clusterkit.node.files import write_atomic
from clusterkit.node.protocol import (
    DEFAULT_GRACE_S,
    AgentSpec,
    Control,
    ProtocolError,
)
from clusterkit.node.replicas import proc as replica_proc

AGENT_COMM = "ck-agent"


class Agent:
    """One node's agent: the job's files, its ranks or launcher, control words, the end.

    Its collaborators are built here and hold their own state: ``output``
    (:class:`~clusterkit.node.agent.output.AgentOutput`), ``forkserver``
    (:class:`~clusterkit.node.agent.forkserver.ForkServer`) and ``stacks``
    (:class:`~clusterkit.node.agent.hangs.StackDump`)."""

    def __init__(self, spec: AgentSpec, out: IO[str]) -> None:
        self.spec = spec
        self.job_dir = os.path.abspath(os.path.expanduser(spec.job_dir))
        node_dir = JobDir(self.job_dir).node_dir(spec.node)
        self.progress_dir = JobDir(self.job_dir).node_progress(spec.node)
        self.child: subprocess.Popen[bytes] | None = None  # the launcher (launcher mode)
        self.ranks: dict[int, Child] = {}  # local rank -> process (native)
        self.rank_codes: dict[int, int] = {}  # local rank -> exit code, in order of exit
        self.life = Lifecycle()  # holding, running, stopping, exited (node/agent/state.py)
        self.stop_reason: str | None = None  # the first stop's reason
        self._stop = self.life.stopping  # the fork server waits on it too
        self._last_control = time.monotonic()
        self._started = time.monotonic()
        self._started_wall = time.time()
        self._next_progress = 0.0
        self.output = AgentOutput(spec, node_dir, out, self.request_stop)
        # Native mode's fork server (issue 15): started early, forks the ranks on GO.
        self.forkserver = ForkServer(spec, self.job_dir, self.output, self.ranks, self.rank_env,
                                     self._stop, self.check_keepalive, self.request_stop)
        self.stacks = StackDump(self.job_dir, self.progress_dir, spec.node, spec.attempt,
                                self.output.send)
        # Checkpoint replicas (issue 22): a service that does nothing when they are off.
        self.replicas = replica_proc.for_agent(spec, self.job_dir, self.output)

    # -------------------------------------------------------------- output (agent_output)

    @property
    def node_dir(self) -> str:
        """This node's directory in the job dir: its log files and ``agent.json``."""
        return self.output.node_dir

    def start_writer(self) -> None:
        """From now on output goes through a writer thread (the real agent, not tests)."""
        self.output.start_writer()

    def send(self, msg: protocol.AgentEvent) -> None:
        self.output.send(msg)

    def drain(self, timeout: float = 5.0) -> None:
        self.output.drain(timeout)

    @property
    def keepalive_lost(self) -> bool:
        """The launcher went silent: nothing more is written to the session."""
        return self.output.silenced

    def tail_rank_logs(self) -> None:
        """Until the agent finishes: stream DeepSpeed's per-rank log files as rank lines."""
        assert self.spec.rank_log_dir is not None
        self.output.tail_rank_logs(expand(self.spec.rank_log_dir, self.job_dir))

    # -------------------------------------------------------------- control

    @property
    def state(self) -> State:
        return self.life.state

    def request_stop(self, reason: str) -> None:
        if not self.life.move(State.STOPPING):
            return  # stopping already (the first reason stays), or exited
        self.stop_reason = reason
        self._stop.set()
        self.replicas.abort()  # a failure or a stop: copies end at once

    def forward(self, sig: int) -> int:
        """USR1/USR2 go to the ranks (a launcher such as torchrun dies of SIGUSR1)."""
        procs = job_processes(self.spec.job_id, self.spec.node, self.spec.attempt)
        ranks = [p for p, env in procs.items() if b"RANK" in env or b"LOCAL_RANK" in env]
        if not ranks and self.child is not None and self.child.poll() is None:
            ranks = [self.child.pid]
        # Forked ranks carry RANK only in os.environ, not in /proc/<pid>/environ.
        ranks = sorted({*ranks, *(p.pid for p in self.ranks.values() if p.poll() is None)})
        return sum(signal_pid(p, sig) for p in ranks)

    def read_control(self, stream: IO[str]) -> None:
        for raw in stream:
            self._last_control = time.monotonic()
            cmd = Control.parse(raw)
            if cmd in (Control.TERM, Control.KILL):
                self.request_stop(cmd.value.lower())
                if cmd == Control.KILL:
                    self.kill_now()
            elif cmd == Control.GO:
                self.life.move(State.RUNNING)
            elif cmd in (Control.USR1, Control.USR2):
                n = self.forward(getattr(signal, f"SIG{cmd.value}"))
                self.send(protocol.Forwarded(self.spec.node, signal=cmd.value, processes=n))
            elif cmd == Control.DUMP:
                threading.Thread(target=self.dump_stacks, daemon=True).start()
        self.request_stop("stdin-eof")  # the launcher exited or the connection dropped

    def kill_now(self) -> None:
        for child in self.children():
            if child.poll() is None:
                signal_group(child.pid, signal.SIGKILL)
        for pid in job_processes(self.spec.job_id, self.spec.node, self.spec.attempt):
            signal_pid(pid, signal.SIGKILL)

    # -------------------------------------------------------------- lifecycle

    def prepare(self) -> None:
        os.makedirs(self.node_dir, exist_ok=True)
        os.makedirs(self.progress_dir, exist_ok=True)
        if self.spec.rank_log_dir:
            # DeepSpeed's launcher creates it with exists()+makedirs(): on a shared job
            # dir its launchers on several nodes race and one dies. Exists before them.
            os.makedirs(expand(self.spec.rank_log_dir, self.job_dir), exist_ok=True)
        for name, content in self.spec.files.items():
            if "/" in name or name.startswith("."):
                raise ValueError(f"bad job file name {name!r}")
            write_atomic(os.path.join(self.job_dir, name), expand(content, self.job_dir))

    def ready_checkpoint_dir(self) -> None:
        """The checkpoint dir ready before any rank starts (node/ckpt/ready.py). After the
        gate's GO, not in prepare(): the gate names a dir that cannot be made; here it ends the agent."""
        prep = self.spec.files.get(JobDir.ckpt_prep(self.spec.node))
        if prep is not None:
            for said in ready_checkpoints(prep):
                self.output.send(protocol.Line(self.spec.node, None, f"[clusterkit] {said}"))

    def child_env(self) -> dict[str, str]:
        return env.child_env(self.spec, self.job_dir, self.progress_dir)

    def start_child(self) -> None:
        argv = [expand(a, self.job_dir) for a in self.spec.argv]
        cwd = os.path.expanduser(self.spec.cwd) if self.spec.cwd else None
        self.child = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            env=self.child_env(), cwd=cwd, start_new_session=True,
        )
        self.write_state("running")
        self.send(protocol.Started(self.spec.node, pid=self.child.pid, argv=argv))

    def children(self) -> list[Child]:
        out: list[Child] = [self.child] if self.child is not None else []
        if self.forkserver.proc is not None:
            out.append(self.forkserver.proc)
        return out + list(self.ranks.values())

    def rank_env(self, local_rank: int) -> dict[str, str]:
        return env.rank_env(self.spec, self.job_dir, self.progress_dir, local_rank)

    def start_ranks(self) -> list[threading.Thread]:
        server = self.forkserver.proc
        if server is not None:
            forked = self.forkserver.fork(lambda: self._ranks_started(zygote=server.pid))
            if forked is not None:
                return forked
        n = self.spec.native or {}
        argv = [expand(a, self.job_dir) for a in self.spec.argv]
        cwd = os.path.expanduser(self.spec.cwd) if self.spec.cwd else None
        pumps = []
        for lr in range(int(n["nproc"])):
            proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                env=self.rank_env(lr), cwd=cwd, start_new_session=True,
            )
            self.ranks[lr] = proc
            t = threading.Thread(target=self.pump_rank, args=(lr, proc), daemon=True)
            t.start()
            pumps.append(t)
        self._ranks_started()
        return pumps

    def _ranks_started(self, zygote: int | None = None) -> None:
        argv = [expand(a, self.job_dir) for a in self.spec.argv]
        self.write_state("running")
        self.send(protocol.Started(self.spec.node, pids=[p.pid for p in self.ranks.values()],
                                   argv=argv, zygote=zygote))

    def pump_rank(self, local_rank: int, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        rank = int((self.spec.native or {})["first_rank"]) + local_rank
        for raw in iter(proc.stdout.readline, b""):
            self.output.handle_rank_line(rank, raw.decode("utf-8", "replace").rstrip("\r\n"))

    def check_ranks(self) -> bool:
        """Native mode: record exits; a failed rank stops the node. True when all are done."""
        for lr, proc in self.ranks.items():
            code = proc.poll()
            if code is None or lr in self.rank_codes:
                continue
            self.rank_codes[lr] = code
            if code != 0 and not self.output.failure_sent:
                self.output.rank_failed(self.spec.node, lr, code)
                self.request_stop("rank-failed")
        return len(self.rank_codes) == len(self.ranks)

    def pump_child(self) -> None:
        assert self.child is not None and self.child.stdout is not None
        for raw in iter(self.child.stdout.readline, b""):
            self.output.handle_line(raw.decode("utf-8", "replace").rstrip("\r\n"))

    def write_state(self, state: str, **extra: Any) -> None:
        server = self.forkserver.proc
        data = {"job_id": self.spec.job_id, "node": self.spec.node, "attempt": self.spec.attempt,
                "agent_pid": os.getpid(), "child_pid": self.child.pid if self.child else None,
                "rank_pids": [p.pid for p in self.ranks.values()],
                # Forked ranks carry RANK only in os.environ: `status` reads them here.
                "ranks": {str(r): pid for r, pid in self.rank_pids().items()} if self.ranks else {},
                "zygote_pid": server.pid if server is not None else None,
                "state": state, "time": time.time(), **extra}
        # A full or vanished disk must not stop the teardown.
        with contextlib.suppress(OSError):
            write_atomic(os.path.join(self.node_dir, JobDir.AGENT_STATE), json.dumps(data))

    # -------------------------------------------------------------- hangs (issue 14)

    def check_keepalive(self) -> None:
        """The dead-man switch: no word from the launcher for keepalive_s -> tear down.

        Behind a network partition the SSH session neither delivers nor closes, so
        EOF never comes; silence is the only sign. From here on nothing is written to
        the session (it would block); the log files keep everything.
        """
        ka = self.spec.keepalive_s
        if ka <= 0 or self.keepalive_lost or time.monotonic() - self._last_control <= ka:
            return
        self.output.silenced = True
        self.output.log(JobDir.LAUNCHER_LOG, f"clusterkit agent: no keepalive from the launcher for "
                                        f"{ka:g} s: tearing down this node's ranks")
        self.request_stop("keepalive-lost")

    def rank_pids(self) -> dict[int, int]:
        """global rank -> pid of this node's rank processes."""
        if self.ranks:
            first = int((self.spec.native or {})["first_rank"])
            return {first + lr: p.pid for lr, p in self.ranks.items() if p.poll() is None}
        return rank_pids_of(job_processes(self.spec.job_id, self.spec.node, self.spec.attempt))

    def progress(self) -> dict[str, Any]:
        """Seconds since this node's ranks last showed progress, and their steps."""
        return hangs.progress(self.progress_dir, self.output.last_line, self._started,
                                    self._started_wall)

    def report_progress(self) -> None:
        if time.monotonic() < self._next_progress:
            return
        self._next_progress = time.monotonic() + PROGRESS_EVERY_S
        prog = self.progress()
        self.send(protocol.Progress(self.spec.node, **prog))
        self.write_state("running", progress=prog)  # what `clusterkit status JOB` shows

    def dump_stacks(self) -> None:
        """Every rank's Python stacks: py-spy where installed, else faulthandler's file."""
        pids = self.rank_pids()
        self.stacks.dump(pids, self.job_pythons(pids.values()), self.child_env().get("PATH"))

    def job_pythons(self, pids: Any = ()) -> list[str]:
        """The interpreters this node's ranks run (hangs.job_pythons), the job's
        command looked up on the ranks' PATH."""
        command = expand(self.spec.argv[0], self.job_dir) if self.spec.argv else None
        return hangs.job_pythons(pids, command, self.child_env().get("PATH"))

    # -------------------------------------------------------------- the run

    def hold_for_go(self) -> bool:
        """True once the launcher says GO, False on a stop (a later GO moves nothing)."""
        while self.state is State.HOLDING:
            self.life.moved.wait(POLL_S / 2)  # set by the move out of HOLDING
            self.check_keepalive()
        drop_tokens(self.spec.needs)  # every node has looked (gatefacts.token_seen)
        return self.state is State.RUNNING

    def run(self) -> int:
        self.prepare()  # while the launcher compares the nodes' facts
        self.replicas.start()
        if self.spec.hold:
            self.send(protocol.Facts(self.spec.node, facts=gate_facts(self.spec.needs)))
        # The fork server's imports overlap the gate's round trip and the GO. Started
        # after the facts: on a node short of CPUs, its import would delay our report.
        if self.forkserver.wanted():
            self.forkserver.start()
        if not (self.hold_for_go() if self.spec.hold else self.life.move(State.RUNNING)):
            self.forkserver.drop()  # stopped before the ranks started: nothing to sweep
            self.send(protocol.Exit(self.spec.node, code=0, reason=self.stop_reason, held=True))
            self.life.move(State.EXITED)
            return 0
        self.ready_checkpoint_dir()
        pumps: list[threading.Thread] = []
        tail: threading.Thread | None = None
        if self.spec.rank_log_dir:
            tail = threading.Thread(target=self.tail_rank_logs, daemon=True)
            tail.start()
        if self.spec.argv and self.spec.native:
            pumps = self.start_ranks()
        elif self.spec.argv:
            self.start_child()
            pumps = [threading.Thread(target=self.pump_child, daemon=True)]
            pumps[0].start()
        else:
            self.write_state("watching")
            self.send(protocol.Started(self.spec.node))
        while not self._stop.wait(POLL_S):
            if self.child is not None and self.child.poll() is not None:
                break
            if self.ranks and self.check_ranks():
                break
            self.check_keepalive()
            self.report_progress()
        return self.finish(pumps, tail)

    def _exit_code(self) -> int:
        if self.ranks:
            self.check_ranks()
            # The first rank that failed decides (dicts keep the order of exits).
            failed = [c for c in self.rank_codes.values() if c != 0]
            raw: int | None = failed[0] if failed else (
                0 if len(self.rank_codes) == len(self.ranks) else None)
        elif self.child is not None:
            raw = self.child.poll()
        else:
            return 0
        return 128 + (-raw) if raw is not None and raw < 0 else (raw if raw is not None else 137)

    def finish(self, pumps: Sequence[threading.Thread] = (),
               tail: threading.Thread | None = None) -> int:
        node = self.spec.node
        if self.stop_reason is not None:
            self.send(protocol.Teardown(self.spec.node, reason=self.stop_reason))
            # On teardown match untagged job processes too (pdsh-started ranks).
            counts = sweep(self.spec.job_id, node, self.spec.attempt, self.spec.grace_s,
                           self.children())
        else:
            server = self.forkserver.proc
            if server is not None:
                # Its ranks are done: it reports the last exit and ends by itself.
                with contextlib.suppress(subprocess.TimeoutExpired):
                    server.wait(2.0)
            # The launcher ended by itself: only stragglers it left behind on this node.
            counts = sweep(self.spec.job_id, node, self.spec.attempt, min(self.spec.grace_s, 1.0),
                           self.children())
        for pump in pumps:
            pump.join(2.0)
        if tail is not None:
            self.output.tail_done.set()  # the ranks are gone: read what is left, then stop
            tail.join(5.0)
        code = self._exit_code()
        self.replicas.end(ok=code == 0 and self.stop_reason is None)  # bounded waits
        self.write_state("exited", exit_code=code, reason=self.stop_reason, **counts)
        self.send(protocol.Exit(self.spec.node, code=code, reason=self.stop_reason,
                                signalled=counts["signalled"], killed=counts["killed"],
                                left=counts["left"]))
        self.drain()
        self.output.close()
        self.life.move(State.EXITED)
        return code


# ----------------------------------------------------------------- entry points


def _read_spec(args: argparse.Namespace) -> AgentSpec:
    if args.spec_b64:
        return AgentSpec.from_json(base64.b64decode(args.spec_b64).decode())
    first = sys.stdin.readline()
    if not first:
        raise SystemExit("clusterkit agent: no job spec on stdin")
    return AgentSpec.from_json(first)


def _install_signals(agent: Agent) -> None:
    def on_signal(signum: int, _frame: Any) -> None:
        agent.request_stop(signal.Signals(signum).name)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="clusterkit node agent", allow_abbrev=False)
    p.add_argument("--spec-b64")
    p.add_argument("--stop", metavar="JOB_ID")
    p.add_argument("--status", metavar="JOB_ID")
    p.add_argument("--job-dir")
    p.add_argument("--node")
    p.add_argument("--grace", type=float, default=DEFAULT_GRACE_S)
    args = p.parse_args(argv)
    if args.stop:
        print(protocol.StopReply(**sweep(args.stop, args.node, None, args.grace)).to_json(),
              flush=True)
        return 0
    if args.status:
        print(json.dumps(job_status(args.status, args.job_dir, args.node)), flush=True)
        return 0
    try:
        spec = _read_spec(args)
    except ProtocolError as exc:
        # Said on stderr and as the exit code: the launcher shows the agent's last line.
        sys.stderr.write(f"clusterkit agent: {exc}\n")
        return 2
    # ps/top show the job's agent as such, not as `python3 -u -c import linecache,...`.
    zygote.set_title(f"[clusterkit agent job {spec.job_id} node {spec.node}]", AGENT_COMM)
    agent = Agent(spec, sys.stdout)
    agent.start_writer()
    _install_signals(agent)
    threading.Thread(target=agent.read_control, args=(sys.stdin,), daemon=True).start()
    try:
        code = agent.run()
    except (OSError, ValueError) as exc:
        agent.send(protocol.Error(spec.node, message=f"{type(exc).__name__}: {exc}"))
        agent.drain()
        return 127 if isinstance(exc, FileNotFoundError) else 126
    if agent.keepalive_lost:
        # stdout may be stuck on a dead session: flushing it at exit would block.
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
