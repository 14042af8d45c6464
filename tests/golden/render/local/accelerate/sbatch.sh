#!/bin/bash
# Slurm batch script for clusterkit job golden-local (local), rendered from the
# inventory; edit the inventory or the clusterkit flags, not this file.
#SBATCH --job-name=ck-golden-local
#SBATCH --nodes=4
#SBATCH --ntasks-per-node=1
#SBATCH --time=01:00:00
#SBATCH --output=/home/me/proj/.clusterkit/jobs/golden-local/logs/slurm-%j.out
#SBATCH --error=/home/me/proj/.clusterkit/jobs/golden-local/logs/slurm-%j.err
# A requeued run appends to the same files (the default truncates: the first run's log
# would be lost); each run starts with a "===== clusterkit: ... run N" line.
#SBATCH --open-mode=append
# 90 s before the time limit Slurm sends USR1 to this script (B:), which writes
# $CLUSTERKIT_STOP_FILE and forwards USR1 to the ranks: they save and exit 0, then the
# script requeues the job, which resumes from that save (same checkpoint dir). USR1 sent
# to the steps only (scancel --signal=USR1 JOB) saves and stops.
#SBATCH --signal=B:USR1@90
#SBATCH --requeue
set -euo pipefail

both() { echo "$1"; echo "$1" >&2; }  # a line for the .out and the .err file
run_line="===== clusterkit: job golden-local slurm=$SLURM_JOB_ID run $(( ${SLURM_RESTART_COUNT:-0} + 1 )) on $SLURM_JOB_NODELIST at $(date -u +%Y-%m-%dT%H:%M:%SZ) ====="
both "$run_line"

# The interpreter's directory in front of the site's own PATH: srun, scontrol and
# scancel stay where the submitting shell found them (/opt/slurm/bin, a module, ...).
export PATH=/opt/py/bin:"$PATH"
export PYTHONUNBUFFERED=1 SLURM_UNBUFFEREDIO=1

# Node 0 of the allocation is the rendezvous head; resolve it to an IPv4 address
# (a name can resolve to 127.0.1.1 on the node itself). sed/awk read all input, so
# no SIGPIPE under pipefail.
head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)
MASTER_ADDR=$(getent ahostsv4 "$head_node" | awk 'NR == 1 { print $1 }')
if [ -z "$MASTER_ADDR" ]; then
    echo "clusterkit: cannot resolve the head node $head_node to an IPv4 address" >&2
    exit 2
fi
# The plan's port (spec.ports, from the job id: 20000-32767, below Linux's ephemeral
# range), the one `clusterkit sbatch` printed; a requeued run keeps it.
MASTER_PORT=25877
export MASTER_ADDR MASTER_PORT

# The job environment (an allowlist, see docs/render.md).
export HF_HUB_OFFLINE=1
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
export PYTHONUNBUFFERED=1
export CLUSTERKIT_JOB_ID=golden-local
export CLUSTERKIT_JOB_DIR=/home/me/proj/.clusterkit/jobs/golden-local
export CLUSTERKIT_DS_CONFIG=/home/me/proj/.clusterkit/jobs/golden-local/ds_config.json
export CLUSTERKIT_CKPT_DIR=/home/me/.cache/clusterkit/local/shared/ckpt/golden-local
export CLUSTERKIT_STORAGE=shared

# CPUs: srun does not inherit --cpus-per-task from the allocation (Slurm >= 22.05), so
# pass it on; OpenMP threads per rank = the task's CPUs / the ranks the task starts
# (at least 1), unless the inventory env sets OMP_NUM_THREADS.
if [ -n "${SLURM_CPUS_PER_TASK:-}" ]; then
    export SRUN_CPUS_PER_TASK=$SLURM_CPUS_PER_TASK
    task_cpus=$SLURM_CPUS_PER_TASK
else
    task_cpus=$(( ${SLURM_CPUS_ON_NODE:-1} / 1 ))
fi
export OMP_NUM_THREADS=$(( task_cpus / 2 > 1 ? task_cpus / 2 : 1 ))
mkdir -p -- /home/me/proj/.clusterkit/jobs/golden-local/logs

# Every node must see the job directory (ds_config.json, accelerate configs, logs):
# one tiny task per node; a node that cannot see it names itself.
job_dir=/home/me/proj/.clusterkit/jobs/golden-local
unseen=$(srun --nodes=4 --ntasks=4 --ntasks-per-node=1 --chdir=/ \
    sh -c '[ -d "$1" ] && [ -r "$2" ] || echo "clusterkit-unseen $(hostname)"' \
    sh "$job_dir" /home/me/proj/.clusterkit/jobs/golden-local/ds_config.json | sed -n 's/^clusterkit-unseen //p') || {
    echo "clusterkit: the file-system check step (srun) failed; see the lines above" >&2
    exit 2
}
if [ -n "$unseen" ]; then
    echo "clusterkit: job dir $job_dir is not visible on" $unseen "(put the inventory workdir on a filesystem every compute node mounts)" >&2
    exit 2
fi

# DeepSpeed's JIT ops the ranks would build at start (ShareMemCommBuilder; docs/sbatch.md,
# "JIT ops"): built here, one task per node, before the ranks start and before the hang
# watchdog's clock, so no rank races a build and a build of minutes is no silent start.
# A lock a killed build left is removed when its owner record proves it dead; one that
# nothing proves dead stops the job here, the node's line naming the lock and the fix.
ops_bundle=$job_dir/jitops.bundle  # node/provision/jitbatch.py's sources (clusterkit sbatch)
jitbatch=(/opt/py/bin/python3 -u -c 'import linecache,sys,types
r=sys.stdin.buffer
h=r.readline().split()
if h[:2]!=[b'"'"'clusterkit-node'"'"',b'"'"'2'"'"']:sys.exit('"'"'clusterkit node bootstrap: expected a clusterkit-node 2 header on stdin, got %r'"'"'%h[:2])
def P(f,a=None):
 m=types.ModuleType(f);m.__path__=[];sys.modules[f]=m
 if a:setattr(a,f.rsplit('"'"'.'"'"',1)[1],m)
 return m
N=P('"'"'clusterkit.node'"'"',P('"'"'clusterkit'"'"'))
for e in h[2:]:
 n,z=e.decode().split('"'"':'"'"');s=r.read(int(z))
 if len(s)!=int(z):sys.exit('"'"'clusterkit node bootstrap: stdin ended inside '"'"'+n)
 *q,b=n.split('"'"'.'"'"');a=N
 for w in q:a=getattr(a,w,None) or P(a.__name__+'"'"'.'"'"'+w,a)
 f='"'"'clusterkit.node.'"'"'+n;m=types.ModuleType(f);m.__file__='"'"'<'"'"'+f+'"'"'>'"'"'
 t=s.decode('"'"'utf-8'"'"');linecache.cache[m.__file__]=(len(t),None,t.splitlines(True),m.__file__)
 sys.modules[f]=m;setattr(a,b,m)
 exec(compile(t,m.__file__,'"'"'exec'"'"'),m.__dict__)
sys.argv=['"'"'clusterkit.node.'"'"'+sys.argv[1]]+sys.argv[2:]
sys.exit(sys.modules[sys.argv[0]].main(sys.argv[1:]))
' provision.jitbatch)  # python -u -c BOOTSTRAP provision.jitbatch (ship.py)
if [ -r "$ops_bundle" ]; then
    # stdin: the sources, then the request line; each task names its node (Slurm's name)
    # and has the job's GPUs, so DeepSpeed finds the accelerator the ranks will find.
    srun --nodes=4 --ntasks=4 \
        --ntasks-per-node=1 --input=all --chdir=/ \
        sh -c 'exec "$@" "$SLURMD_NODENAME"' sh "${jitbatch[@]}" \
        < <(cat -- "$ops_bundle"; printf '%s\n' '{"accelerator": "cpu", "ds_config": {}, "ops": ["ShareMemCommBuilder"]}') || {
        both "clusterkit: DeepSpeed's JIT ops are not ready on every node (each node's line above says why): not starting"
        exit 2
    }
else
    echo "clusterkit: $ops_bundle is missing (clusterkit sbatch writes it): the ranks build their DeepSpeed ops themselves" >&2
fi
# Per-run state in the job dir: each rank that exits non-zero records how in $exits
# (the first one is the step's cause); $CLUSTERKIT_STOP_FILE appears when the job is
# asked to stop. A requeued run starts with neither.
exits=/home/me/proj/.clusterkit/jobs/golden-local/exits
export CLUSTERKIT_STOP_FILE=/home/me/proj/.clusterkit/jobs/golden-local/stop
hang_file=/home/me/proj/.clusterkit/jobs/golden-local/hang
rm -rf -- "$exits" "$CLUSTERKIT_STOP_FILE" "$hang_file"
mkdir -p -- "$exits"
# world_size/ranks_per_node: `clusterkit sbatch --watch` reads them to place rank labels.
echo "clusterkit: job golden-local slurm=$SLURM_JOB_ID head=$head_node ($MASTER_ADDR:$MASTER_PORT) variant=accelerate world_size=8 ranks_per_node=2 OMP_NUM_THREADS=$OMP_NUM_THREADS"
# Rank labels for `clusterkit sbatch --watch`: srun puts the task (= node) number in front
# of each line ("1: "), torchrun the rank's global rank ("[rank3]:"; torch >= 2.2; older
# torch writes the node-local rank, "[default1]:"). One file per rank needs neither.
export SLURM_LABELIO=1 TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE='[rank${rank}]:'
# The end of a run (and, for a program that does not save on SIGUSR1, what USR1 does):
# node/slurm/end.py decides; its lines on stdout/stderr, its answer on file descriptor 3.
slurmend() {  # python -S -u -c BOOTSTRAP slurm.end (ship.py), its sources on stdin
    /opt/py/bin/python3 -S -u -c 'import linecache,sys,types
r=sys.stdin.buffer
h=r.readline().split()
if h[:2]!=[b'"'"'clusterkit-node'"'"',b'"'"'2'"'"']:sys.exit('"'"'clusterkit node bootstrap: expected a clusterkit-node 2 header on stdin, got %r'"'"'%h[:2])
def P(f,a=None):
 m=types.ModuleType(f);m.__path__=[];sys.modules[f]=m
 if a:setattr(a,f.rsplit('"'"'.'"'"',1)[1],m)
 return m
N=P('"'"'clusterkit.node'"'"',P('"'"'clusterkit'"'"'))
for e in h[2:]:
 n,z=e.decode().split('"'"':'"'"');s=r.read(int(z))
 if len(s)!=int(z):sys.exit('"'"'clusterkit node bootstrap: stdin ended inside '"'"'+n)
 *q,b=n.split('"'"'.'"'"');a=N
 for w in q:a=getattr(a,w,None) or P(a.__name__+'"'"'.'"'"'+w,a)
 f='"'"'clusterkit.node.'"'"'+n;m=types.ModuleType(f);m.__file__='"'"'<'"'"'+f+'"'"'>'"'"'
 t=s.decode('"'"'utf-8'"'"');linecache.cache[m.__file__]=(len(t),None,t.splitlines(True),m.__file__)
 sys.modules[f]=m;setattr(a,b,m)
 exec(compile(t,m.__file__,'"'"'exec'"'"'),m.__dict__)
sys.argv=['"'"'clusterkit.node.'"'"'+sys.argv[1]]+sys.argv[2:]
sys.exit(sys.modules[sys.argv[0]].main(sys.argv[1:]))
' slurm.end '{"ckpt_var":"CLUSTERKIT_CKPT_DIR","count_file":"/home/me/proj/.clusterkit/jobs/golden-local/hang_restarts","exits_dir":"/home/me/proj/.clusterkit/jobs/golden-local/exits","hang_file":"","job_name":"ck-golden-local","log_dir":"/home/me/proj/.clusterkit/jobs/golden-local/logs","max_restarts":0,"node_local":false,"per_rank_files":false,"replicas":0,"signal_lead":90,"stop_file":"/home/me/proj/.clusterkit/jobs/golden-local/stop","stop_var":"CLUSTERKIT_STOP_FILE"}' "$@" <<'CK_SLURMEND_EOF'
clusterkit-node 2 slurm.end:24837
"""Node program: what the end of a ``clusterkit sbatch`` run means (issue 36 item 2).

The batch script (templates/sbatch.sh.j2) only sequences steps; every decision it
makes once the launch step has ended is here, as a pure table: :func:`decide` takes
the facts (:class:`EndFacts`, with the job's :class:`JobEnd` settings) and returns the
:class:`EndDecision`: the script's exit status, whether and how to requeue the job,
the lines for the job's ``.out``/``.err`` files, and whether this run counts as one
more hang restart. tests/process/test_slurm_end_rules.py has a test row for every row below;
docs/sbatch.md ("How the batch job decides") is the same table for users.

The rules, in the order they apply:

====================  =============================================================
row                   when -> what
====================  =============================================================
``ok``                the step exited 0, no stop was asked -> exit 0, nothing said
``hang-requeue``      the watchdog ended the step (its reason in the hang file) and
                      this job's hang restarts < ``--max-restarts`` -> count one
                      more, requeue, exit 124 (both files say so)
``hang-used``         a hang, the restarts used -> exit 124, no requeue (both files)
``stop-end-step``     USR1 came, the program does not save on it (its profile:
                      ``saves_on_usr1``), and it saved since the run's start stamp
                      (node-local: a checkpoint complete on every node; shared: a
                      file): the script ended the step at once (:func:`at_usr1`)
                      -> exit 0, requeue, the line (both files: steps since lost)
``rank-failed``       the step failed and a rank recorded its exit: the earliest
                      record (``<time ns> <node> <status>``, ``exits/rank<R>``) is
                      the cause -> exit with that rank's status; the ``.err`` line
                      names it (``exit code N``, or ``killed by signal N`` above 128)
                      and where its output is (per-rank files or the ``[rankR]``
                      lines of the ``.err`` file)
``step-failed``       the step failed, no rank recorded an exit -> the step's
                      status, the ``.err`` line points at the ``.err`` file
``began-fresh``       the step exited 0, but the run was told where to resume (a
                      user's program on node-local storage) and its output holds
                      the program's progress line and never its resume line ->
                      exit 1, the step-0 line (both files), no requeue
``stop-run-on``       USR1 came, the program does not save on it, and nothing was
                      saved since the run began: at USR1 the line (both files), the
                      step runs on (to the time limit); if it ends before that, the
                      rows above are the answer, no requeue (the stop rows below are
                      for programs that save on USR1)
``stop-unsaved``      USR1 asked the ranks to stop (the stop file) and nothing in the
                      checkpoint dir is newer than the stop file -> no requeue
``stop-failed``       a stop, a save since, but the status (after the rows above) is
                      not 0 -> no requeue
``stop-late``         a stop, a save, status 0, but the ranks ran on for longer than
                      the signal lead -> no requeue (they did not stop for it)
``stop-requeue``      a stop, a save since, status 0, in time -> requeue (``.out``)
====================  =============================================================

A hang ends the table (its rows are the whole answer), and so does ``stop-end-step``
(its ranks were ended by the script: no failure row); a failure row and a stop row may
both apply (the failure's line first). How a requeue is done:

====================  =============================================================
``requeue-any``       checkpoint replicas (``--replicas K``): on any free nodes, the
                      parts are moved before the ranks start (a line says so)
``requeue-pinned``    node-local checkpoints without replicas: held, pinned to this
                      run's nodes (``ReqNodeList``), released
``requeue-plain``     shared checkpoints: a plain requeue
====================  =============================================================

The script runs it the one way node programs are started (``python -S -u -c
BOOTSTRAP slurm.end CONF STATUS STOP_AT HANG_DIR``, the sources on stdin: a heredoc of
the script): ``CONF`` is one JSON word rendered by render/sbatch.py (the job's
settings and paths, :meth:`JobEnd.from_conf`), ``STATUS`` the launch step's exit
status, ``STOP_AT`` when USR1 asked for the stop (epoch seconds, empty: never) and
``HANG_DIR`` where the watchdog put the stacks (empty without one). :func:`main`
gathers the facts from those files, records the hang restart, prints the lines and
writes the answer, ``<exit status> <none|any|pinned>``, as one line to file
descriptor 3; the script performs it (``scontrol requeue``, or the pinned sequence)
and exits with that status.

At USR1, for a program that does not save on it, the script asks first (``slurm.end
CONF usr1 [SAVED_FILE]``, :func:`gather_usr1`); :func:`at_usr1` answers on file
descriptor 3: ``end`` (the script ends the launch step with SIGTERM, as the hang watchdog
does; the save is recorded in CONF's ``ended_file`` for the end of the run) or ``run``.

Standard library only, Python >= 3.8 on the node.
"""

from __future__ import annotations

import json
import os
import re
import signal
import stat
import sys
import time
from dataclasses import dataclass
from typing import IO, Any

# Where a line goes: the job's .out file, its .err file, or both.
OUT, ERR, BOTH = "out", "err", "both"
# How to requeue: not at all, plainly (any nodes Slurm gives), or pinned to this run's nodes.
NONE, ANY, PINNED = "none", "any", "pinned"
HANG_STATUS = 124  # the watchdog ended the step (timeout(1)'s status)
ANSWER_FD = 3
USR1_VERB = "usr1"  # slurm.end CONF usr1: at USR1, end the step or let it run on
END_STEP, RUN_ON = "end", "run"
BEGAN_FRESH_STATUS = 1  # told where to resume, the program began at step 0: never "finished"


@dataclass(frozen=True)
class JobEnd:
    """The job's settings the table reads (render/sbatch.py writes them into CONF)."""

    max_restarts: int = 0  # --max-restarts: hang requeues allowed
    signal_lead: int = 90  # --signal-lead: how long the ranks have to stop after USR1
    replicas: int = 0  # --replicas K (node-local): requeue on any nodes
    node_local: bool = False  # node-local checkpoints without replicas: requeue pinned
    log_dir: str = "logs"
    job_name: str = "ck-job"
    per_rank_files: bool = False  # srun-per-rank: one output file per rank
    stop_var: str = "STOP_FILE"  # the stop file's variable, as the lines name it
    # A user's program told where to resume (node-local): its profile's lines (regexes)
    # and the step-0 line, its tag as CKPT_TAG_TOKEN; empty: not watched.
    resumed_marker: str = ""
    progress_marker: str = ""
    began_fresh: str = ""
    # The program saves and exits 0 on SIGUSR1 (spec/resume.saves_on_usr1); its profile's
    # name and clusterkit's job id, for the lines when it does not.
    saves_on_usr1: bool = True
    program: str = ""
    job_id: str = ""

    @classmethod
    def from_conf(cls, conf: dict[str, Any]) -> JobEnd:
        return cls(max_restarts=int(conf["max_restarts"]), signal_lead=int(conf["signal_lead"]),
                   replicas=int(conf["replicas"]), node_local=bool(conf["node_local"]),
                   log_dir=str(conf["log_dir"]), job_name=str(conf["job_name"]),
                   per_rank_files=bool(conf["per_rank_files"]), stop_var=str(conf["stop_var"]),
                   resumed_marker=str(conf.get("resumed_marker", "")),
                   progress_marker=str(conf.get("progress_marker", "")),
                   began_fresh=str(conf.get("began_fresh", "")),
                   saves_on_usr1=bool(conf.get("saves_on_usr1", True)),
                   program=str(conf.get("program", "")), job_id=str(conf.get("job_id", "")))


@dataclass(frozen=True)
class ExitRecord:
    """One rank's non-zero exit, as the rank recorder wrote it (``exits/rank<R>``)."""

    time_ns: int
    node: str
    status: int
    rank: int


@dataclass(frozen=True)
class EndFacts:
    """What happened in this run (gathered by :func:`gather`)."""

    job: JobEnd
    slurm_id: str
    status: int  # the launch step's exit status
    hang: str | None = None  # the watchdog's reason; None: it did not end the step
    hang_restarts: int = 0  # this job's hang restarts so far
    hang_dir: str = ""  # the watchdog's stacks of this run
    first_exit: ExitRecord | None = None  # the earliest rank that exited non-zero
    stop_at: int | None = None  # when USR1 asked the ranks to stop; None: never
    saved: str | None = None  # a file of the checkpoint dir newer than the stop file
    ckpt_dir: str = ""
    now: int = 0  # epoch seconds, when the step had ended
    began_fresh: str | None = None  # told to resume, it began at step 0: the line
    # A program that does not save on USR1: what it saved since the run's start (at USR1;
    # ``listed``: a tag complete on every node, else a file), what the step was ended for.
    saved_in_run: str | None = None
    ended: str | None = None
    listed: bool = False


@dataclass(frozen=True)
class Line:
    to: str  # OUT, ERR or BOTH
    text: str


@dataclass(frozen=True)
class EndDecision:
    """The answer: the script's exit status, how to requeue, what to say."""

    status: int
    requeue: str = NONE  # NONE, ANY or PINNED
    lines: tuple[Line, ...] = ()
    count_hang: bool = False  # record one more hang restart before requeueing


def _requeue(facts: EndFacts) -> tuple[str, tuple[Line, ...]]:
    """How this job requeues (rows requeue-any, requeue-pinned, requeue-plain)."""
    job = facts.job
    if job.replicas > 0:
        return ANY, (Line(OUT, f"clusterkit: requeueing job {facts.slurm_id} on any free nodes "
                               f"(checkpoint parts replicated: --replicas {job.replicas})"),)
    return (PINNED if job.node_local else ANY), ()


def _hang(facts: EndFacts, reason: str) -> EndDecision:
    job, done = facts.job, facts.hang_restarts
    if done < job.max_restarts:
        how, more = _requeue(facts)
        said = (f"clusterkit: the step hung ({reason}); requeueing job {facts.slurm_id}, "
                f"restart {done + 1} of --max-restarts {job.max_restarts}")
        return EndDecision(HANG_STATUS, how, (Line(BOTH, said), *more), count_hang=True)
    said = (f"clusterkit: the step hung ({reason}); not requeueing (--max-restarts "
            f"{job.max_restarts} used: {done}); stacks in {facts.hang_dir}")
    return EndDecision(HANG_STATUS, NONE, (Line(BOTH, said),))


def _failure(facts: EndFacts) -> tuple[int, Line]:
    """The status and the .err line of a failed step (rows rank-failed, step-failed)."""
    job, first = facts.job, facts.first_exit
    if first is None:
        return facts.status, Line(ERR, f"clusterkit: the launch step failed (exit {facts.status}) "
                                       f"before any rank ended on its own; see "
                                       f"{job.log_dir}/slurm-{facts.slurm_id}.err")
    how = (f"killed by signal {first.status - 128}" if first.status > 128
           else f"exit code {first.status}")
    output = (f"{job.log_dir}/{job.job_name}-{facts.slurm_id}-rank{first.rank}.out"
              if job.per_rank_files
              else f"the [rank{first.rank}] lines of {job.log_dir}/slurm-{facts.slurm_id}.err")
    return first.status, Line(ERR, f"clusterkit: rank {first.rank} on {first.node} failed first "
                                   f"({how}); the other ranks were stopped after it. "
                                   f"Its output: {output}")


def _stop(facts: EndFacts, status: int, stop_at: int) -> tuple[str, tuple[Line, ...]]:
    """After a stop request: requeue only for a save made since, by ranks that then
    stopped within the signal lead (rows stop-*)."""
    job, jid = facts.job, facts.slurm_id
    waited = facts.now - stop_at
    if facts.saved is None:
        return NONE, (Line(BOTH, f"clusterkit: stop requested, but nothing was saved in "
                                 f"{facts.ckpt_dir} since: not requeueing job {jid} (a script "
                                 f"saves on SIGUSR1 or when ${job.stop_var} appears: "
                                 f"docs/sbatch.md, Preemption)"),)
    if status != 0:
        return NONE, (Line(BOTH, f"clusterkit: stop requested and {facts.saved} written since, "
                                 f"but the step failed (exit {status}): not requeueing job {jid}"),)
    if waited > job.signal_lead:
        return NONE, (Line(BOTH, f"clusterkit: stop requested, but the ranks ran on for {waited} s "
                                 f"(more than the signal lead, {job.signal_lead} s): they did not "
                                 f"stop for it; not requeueing job {jid}"),)
    how, more = _requeue(facts)
    return how, (Line(OUT, f"clusterkit: saved after the stop request ({facts.saved}); "
                           f"requeueing job {jid} to resume"), *more)


@dataclass(frozen=True)
class StopAnswer:
    """At USR1, for a program that does not save on it: end the step now, or not."""

    end_step: bool
    lines: tuple[Line, ...] = ()


def _program(job: JobEnd) -> str:
    return f"this program ({job.program})" if job.program else "this program"


def at_usr1(facts: EndFacts) -> StopAnswer:
    """USR1 for a program that does not save on it (rows stop-end-step, stop-run-on):
    end the step when it saved since the run began, so the requeued run resumes from the
    newest complete checkpoint; otherwise a requeue would begin where this run began:
    let it run on. Pure, no I/O."""
    job, jid, who = facts.job, facts.slurm_id, _program(facts.job)
    if facts.saved_in_run is not None:
        what = (f"checkpoint {facts.saved_in_run} (complete on every node)" if facts.listed
                else facts.saved_in_run)
        return StopAnswer(True, (Line(BOTH, f"clusterkit: USR1 (time limit or preemption): {who} "
                                            f"does not save on SIGUSR1; it saved {what} since "
                                            f"this run began: ending the step to requeue job {jid}"),))
    again = f" --job-id {job.job_id}" if job.job_id else " --job-id"
    nothing = (f"no checkpoint complete on every node ({facts.ckpt_dir})" if facts.listed
               else f"nothing in {facts.ckpt_dir}")
    return StopAnswer(False, (Line(BOTH, f"clusterkit: USR1 (time limit or preemption): {who} "
                                         f"does not save on SIGUSR1 and saved {nothing} since "
                                         f"this run began: not requeueing job {jid} (it would "
                                         "begin where this run began); the "
                                         f"step runs on to the time limit. Submit it again with"
                                         f"{again} to resume from its newest checkpoint"),))


def _ended(facts: EndFacts, ended: str) -> EndDecision:
    """The script ended the step at USR1 (row stop-end-step): requeue."""
    how, more = _requeue(facts)
    said = (f"clusterkit: the step was ended at USR1 ({_program(facts.job)} does not save on "
            f"SIGUSR1); requeueing job {facts.slurm_id} to resume from its newest complete "
            f"checkpoint ({ended} was saved in this run): the steps since that save are lost")
    return EndDecision(0, how, (Line(BOTH, said), *more))


def decide(facts: EndFacts) -> EndDecision:
    """The table (module docstring): pure, no I/O."""
    if facts.hang is not None:
        return _hang(facts, facts.hang)
    if facts.ended is not None:
        return _ended(facts, facts.ended)
    status = facts.status
    lines: tuple[Line, ...] = ()
    if status != 0:
        status, failed = _failure(facts)
        lines = (failed,)
    elif facts.began_fresh is not None:
        status, lines = BEGAN_FRESH_STATUS, (Line(BOTH, f"clusterkit: {facts.began_fresh}"),)
    if facts.stop_at is None or not facts.job.saves_on_usr1:
        return EndDecision(status, NONE, lines)  # ok ... began-fresh; stop-run-on
    how, said = _stop(facts, status, facts.stop_at)
    return EndDecision(status, how, lines + said)


# --- the facts, from the files the script and the ranks wrote ---

def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return fh.read()
    except OSError:
        return None


def first_exit(exits_dir: str) -> ExitRecord | None:
    """The earliest record of ``exits_dir`` (``rank<R>``: ``<time ns> <node> <status>``);
    one that cannot be read as such is skipped."""
    try:
        names = sorted(n for n in os.listdir(exits_dir) if n.startswith("rank"))
    except OSError:
        return None
    found = []
    for name in names:
        words = (_read(os.path.join(exits_dir, name)) or "").split()
        try:
            found.append(ExitRecord(int(words[0]), words[1], int(words[2]), int(name[4:])))
        except (IndexError, ValueError):
            continue
    return min(found, key=lambda r: (r.time_ns, r.node, r.status, r.rank)) if found else None


def saved_since(ckpt_dir: str, stop_file: str) -> str | None:
    """A regular file under ``ckpt_dir`` modified after ``stop_file`` was (``find DIR
    -type f -newer STOP``, the first found); None without the stop file or such a file.
    The run's start stamp serves as ``stop_file`` too (:func:`gather_usr1`)."""
    try:
        since = os.stat(stop_file).st_mtime_ns
    except OSError:
        return None
    if not ckpt_dir:
        return None
    for top, dirs, files in os.walk(ckpt_dir):
        dirs.sort()
        for name in sorted(files):
            path = os.path.join(top, name)
            try:
                st = os.lstat(path)
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode) and st.st_mtime_ns > since:
                return path
    return None


def _count(text: str | None) -> int:
    try:
        return int((text or "0").strip() or "0")
    except ValueError:
        return 0


def began_fresh(job: JobEnd, conf: dict[str, Any], environ: dict[str, str]) -> str | None:
    """The step-0 line when this run was told where to resume (the plan step's
    ``resumed_from`` in the run dir) and its output (this run's part of the job's .out
    and .err files, after its ``===== clusterkit: ... run N`` line) holds the program's
    progress line but never its resume line; None otherwise. Its stdout and stderr are two
    files, so which came first is not known: a resume line anywhere counts."""
    if not (job.progress_marker and job.resumed_marker and conf.get("runs_dir")):
        return None
    sid, run = environ.get("SLURM_JOB_ID", ""), int(environ.get("SLURM_RESTART_COUNT") or 0) + 1
    tag = (_read(os.path.join(conf["runs_dir"], f"{sid}.{run}", conf["resumed_from_file"]))
           or "").strip()
    if not tag:
        return None
    resumed, progress = re.compile(job.resumed_marker), re.compile(job.progress_marker)
    seen_progress = False
    for kind in ("out", "err"):
        mine = False
        try:
            with open(os.path.join(job.log_dir, f"slurm-{sid}.{kind}"), encoding="utf-8",
                      errors="replace") as fh:
                for line in fh:
                    if line.startswith("===== clusterkit: job ") and f" slurm={sid} run " in line:
                        mine = f" run {run} on " in line
                    elif mine and resumed.search(line):
                        return None
                    elif mine and progress.search(line):
                        seen_progress = True
        except OSError:
            continue
    return job.began_fresh.replace(conf["tag_token"], tag) if seen_progress else None


def gather(conf: dict[str, Any], status: int, stop_at: str, hang_dir: str,
           environ: dict[str, str], now: int) -> EndFacts:
    """The facts of this run from ``conf``'s paths and the job's environment."""
    hang = None
    if conf.get("hang_file"):
        text = _read(conf["hang_file"])
        hang = text.rstrip("\n") if text else None  # an empty file: no reason, no hang
    ckpt_dir = environ.get(conf["ckpt_var"], "")
    stop = int(stop_at) if stop_at.strip() else None
    job = JobEnd.from_conf(conf)
    ended = (_read(conf["ended_file"]) or "").strip() \
        if stop is not None and conf.get("ended_file") else ""
    return EndFacts(
        job=job, slurm_id=environ.get("SLURM_JOB_ID", ""), status=status,
        hang=hang, hang_restarts=_count(_read(conf["count_file"])), hang_dir=hang_dir,
        first_exit=first_exit(conf["exits_dir"]) if status != 0 else None,
        stop_at=stop, saved=saved_since(ckpt_dir, conf["stop_file"]) if stop is not None else None,
        ckpt_dir=ckpt_dir, now=now,
        began_fresh=began_fresh(job, conf, environ) if status == 0 else None,
        ended=ended or None)


def gather_usr1(conf: dict[str, Any], environ: dict[str, str], saved_file: str = ""
                ) -> EndFacts:
    """The facts at USR1: what was saved since the run's start stamp. ``saved_file``
    (node-local): node/slurm/replica.py ``saved``'s answer from every node's listing (the
    newest checkpoint complete on every node if saved in this run, else empty); without
    it (shared checkpoints, or no listing) a file of the batch host's dir newer than it."""
    ckpt_dir = environ.get(conf["ckpt_var"], "")
    job, sid = JobEnd.from_conf(conf), environ.get("SLURM_JOB_ID", "")
    text = _read(saved_file) if saved_file else None
    if text is not None:
        return EndFacts(job=job, slurm_id=sid, status=0, ckpt_dir=ckpt_dir, listed=True,
                        saved_in_run=text.strip() or None)
    return EndFacts(job=job, slurm_id=sid, status=0, ckpt_dir=ckpt_dir,
                    saved_in_run=saved_since(ckpt_dir, conf.get("started_file", "")))


def _say(lines: tuple[Line, ...], out: IO[str], err: IO[str]) -> None:
    for line in lines:
        for stream in ((out,) if line.to == OUT else (err,) if line.to == ERR else (out, err)):
            stream.write(line.text + "\n")
            stream.flush()


def apply_usr1(stop: StopAnswer, facts: EndFacts, ended_file: str, out: IO[str], err: IO[str],
               answer: IO[str]) -> None:
    """Record the file the step is ended for (the end of the run reads it), print the
    line, answer ``end`` or ``run``."""
    if stop.end_step:
        with open(ended_file, "w", encoding="utf-8") as fh:
            fh.write(f"{facts.saved_in_run}\n")
    _say(stop.lines, out, err)
    answer.write(f"{END_STEP if stop.end_step else RUN_ON}\n")
    answer.flush()


def apply(decision: EndDecision, facts: EndFacts, count_file: str, out: IO[str], err: IO[str],
          answer: IO[str]) -> None:
    """Record the hang restart, print the lines, write the answer line."""
    if decision.count_hang:
        with open(count_file, "w", encoding="utf-8") as fh:
            fh.write(f"{facts.hang_restarts + 1}\n")
    _say(decision.lines, out, err)
    answer.write(f"{decision.status} {decision.requeue}\n")
    answer.flush()


def run(argv: list[str], environ: dict[str, str], out: IO[str], err: IO[str],
        answer: IO[str]) -> int:
    if len(argv) in (2, 3) and argv[1] == USR1_VERB:
        conf = json.loads(argv[0])
        facts = gather_usr1(conf, environ, argv[2] if len(argv) == 3 else "")
        apply_usr1(at_usr1(facts), facts, conf["ended_file"], out, err, answer)
        return 0
    if len(argv) != 4:
        err.write(f"usage: slurm.end CONF STATUS STOP_AT HANG_DIR | slurm.end CONF {USR1_VERB} [FILE]\n")
        return 2
    conf = json.loads(argv[0])
    facts = gather(conf, int(argv[1]), argv[2], argv[3], environ, int(time.time()))
    apply(decide(facts), facts, conf["count_file"], out, err, answer)
    return 0


def main(argv: list[str]) -> int:
    # A USR1 for every process of the job (scancel --full) must not end the decision.
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    answer: IO[str]
    try:
        answer = os.fdopen(ANSWER_FD, "w", encoding="utf-8", closefd=False)
    except OSError:
        answer = sys.stdout  # run by hand: the answer is the last line
    return run(argv, dict(os.environ), sys.stdout, sys.stderr, answer)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
CK_SLURMEND_EOF
}
# USR1 (Slurm's time-limit warning, preemption, `clusterkit sbatch cancel JOB --signal USR1
# --batch`): the stop file appears and every rank gets SIGUSR1. A rank that follows the
# contract (docs/sbatch.md, "Preemption") saves into $CLUSTERKIT_CKPT_DIR and exits 0;
# a program that does not save on SIGUSR1 gets none (docs/sbatch.md, the same section).
stop_at=
forward_usr1() {
    if [ -z "$stop_at" ]; then
        stop_at=$(date +%s)
        date -u +%Y-%m-%dT%H:%M:%SZ > "$CLUSTERKIT_STOP_FILE" \
            || echo "clusterkit: cannot write $CLUSTERKIT_STOP_FILE" >&2
    fi
    echo "clusterkit: USR1 (time limit or preemption): asking every rank to save and stop (SIGUSR1 to the ranks; $CLUSTERKIT_STOP_FILE)"
    scancel --signal=USR1 "$SLURM_JOB_ID" || true
}
trap forward_usr1 USR1
# In the background so the trap runs at once; `wait` returns early on a trapped
# signal, so wait again until the step has really finished.
srun --nodes=4 --ntasks-per-node=1 --kill-on-bad-exit=1 --chdir=/home/me/proj env HF_HUB_OFFLINE=1 LD_LIBRARY_PATH=/usr/local/cuda/lib64 PYTHONUNBUFFERED=1 CLUSTERKIT_JOB_ID=golden-local CLUSTERKIT_JOB_DIR=/home/me/proj/.clusterkit/jobs/golden-local CLUSTERKIT_DS_CONFIG=/home/me/proj/.clusterkit/jobs/golden-local/ds_config.json CLUSTERKIT_CKPT_DIR=/home/me/.cache/clusterkit/local/shared/ckpt/golden-local CLUSTERKIT_STORAGE=shared sh -c 'trap "" USR1; d=$1; l=$2; shift 2; exec "$0" -m accelerate.commands.launch --tee 3 --log_dir="$l" --config_file="$d/accelerate_config.rank$SLURM_NODEID.yaml" --main_process_ip="$MASTER_ADDR" --main_process_port="$MASTER_PORT" "$@"' /opt/py/bin/python3 /home/me/proj/.clusterkit/jobs/golden-local /home/me/proj/.clusterkit/jobs/golden-local/logs --no_python sh -c 'trap "" USR1; d=$0; "$@"; rc=$?; [ "$rc" = 0 ] || printf "%s %s %s\n" "$(date +%s%N)" "${SLURMD_NODENAME:-$(hostname)}" "$rc" 2>/dev/null >"$d/rank$RANK"; exit "$rc"' /home/me/proj/.clusterkit/jobs/golden-local/exits /opt/py/bin/python3 -u -m clusterkit.workload --engine accelerate --model tiny --steps 100 --ds-config /home/me/proj/.clusterkit/jobs/golden-local/ds_config.json --run-dir /home/me/proj/.clusterkit/jobs/golden-local/run --ckpt-dir /home/me/.cache/clusterkit/local/shared/ckpt/golden-local --storage shared &
launch_pid=$!
status=0
while :; do
    wait "$launch_pid" && status=0 || status=$?
    kill -0 "$launch_pid" 2>/dev/null || break
done
# The step may have ended while a trap ran (USR1 above), after the trap cut its `wait`
# short with 128+N: wait once more for its own status (bash keeps an ended job's
# status); 127 there means none was kept, and the status above stands.
wait "$launch_pid" 2>/dev/null && again=0 || again=$?
[ "$again" = 127 ] || status=$again
# What the run's end means: node/slurm/end.py decides (slurmend, above; docs/sbatch.md,
# "How the batch job decides": the exit status, whether and how to requeue, what the
# .out/.err files say); it prints those lines itself and its answer, "<exit status>
# <none|any|pinned>", on file descriptor 3. This script only performs the answer.
exec 4>&1
answer=$(slurmend "$status" "$stop_at" "${hang_dir:-}" 3>&1 1>&4 4>&-) || answer=
exec 4>&-
read -r status requeue _ <<< "$answer" || true
case "${requeue:-}" in
    any)
        scontrol requeue "$SLURM_JOB_ID" ;;
    pinned)
        # Pinned to these nodes (their disks hold the shards): held while the node list is
        # set, so it cannot start elsewhere first. Slurm TERMs this script once the job is
        # requeued; ignore that for these three calls.
        trap '' TERM
        scontrol requeuehold "$SLURM_JOB_ID"
        scontrol update JobId="$SLURM_JOB_ID" ReqNodeList="$SLURM_JOB_NODELIST" \
            || echo "clusterkit: could not pin job $SLURM_JOB_ID to $SLURM_JOB_NODELIST" >&2
        scontrol release "$SLURM_JOB_ID" ;;
    none) ;;
    *)
        both "clusterkit: node/slurm/end.py gave no answer (the lines above say why): not requeueing job $SLURM_JOB_ID"
        exit 2 ;;
esac
exit "$status"
