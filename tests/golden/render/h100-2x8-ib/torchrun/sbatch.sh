#!/bin/bash
# Slurm batch script for clusterkit job golden-h100-2x8-ib (h100-2x8-ib), rendered from the
# inventory; edit the inventory or the clusterkit flags, not this file.
#SBATCH --job-name=ck-golden-h100-2x8-ib
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --time=01:00:00
#SBATCH --output=/lustre/projects/lm/.clusterkit/jobs/golden-h100-2x8-ib/logs/slurm-%j.out
#SBATCH --error=/lustre/projects/lm/.clusterkit/jobs/golden-h100-2x8-ib/logs/slurm-%j.err
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
run_line="===== clusterkit: job golden-h100-2x8-ib slurm=$SLURM_JOB_ID run $(( ${SLURM_RESTART_COUNT:-0} + 1 )) on $SLURM_JOB_NODELIST at $(date -u +%Y-%m-%dT%H:%M:%SZ) ====="
both "$run_line"

# The interpreter's directory in front of the site's own PATH: srun, scontrol and
# scancel stay where the submitting shell found them (/opt/slurm/bin, a module, ...).
export PATH=/home/train/venv/bin:"$PATH"
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
MASTER_PORT=31834
export MASTER_ADDR MASTER_PORT

# The job environment (an allowlist, see docs/render.md).
export HF_HUB_OFFLINE=1
export NCCL_DEBUG=WARN
export NCCL_IB_TIMEOUT=22
export WANDB_PROJECT=lm
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
export PYTHONUNBUFFERED=1
export NCCL_IB_HCA=mlx5_0,mlx5_1,mlx5_2,mlx5_3,mlx5_4,mlx5_5,mlx5_6,mlx5_7
export NCCL_SOCKET_IFNAME==bond0
export CLUSTERKIT_JOB_ID=golden-h100-2x8-ib
export CLUSTERKIT_JOB_DIR=/lustre/projects/lm/.clusterkit/jobs/golden-h100-2x8-ib
export CLUSTERKIT_DS_CONFIG=/lustre/projects/lm/.clusterkit/jobs/golden-h100-2x8-ib/ds_config.json
export CLUSTERKIT_CKPT_DIR=/lustre/projects/lm/ckpt/golden-h100-2x8-ib
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
export OMP_NUM_THREADS=$(( task_cpus / 8 > 1 ? task_cpus / 8 : 1 ))
mkdir -p -- /lustre/projects/lm/.clusterkit/jobs/golden-h100-2x8-ib/logs

# Every node must see the job directory (ds_config.json, accelerate configs, logs):
# one tiny task per node; a node that cannot see it names itself.
job_dir=/lustre/projects/lm/.clusterkit/jobs/golden-h100-2x8-ib
unseen=$(srun --nodes=2 --ntasks=2 --ntasks-per-node=1 --chdir=/ \
    sh -c '[ -d "$1" ] && [ -r "$2" ] || echo "clusterkit-unseen $(hostname)"' \
    sh "$job_dir" /lustre/projects/lm/.clusterkit/jobs/golden-h100-2x8-ib/ds_config.json | sed -n 's/^clusterkit-unseen //p') || {
    echo "clusterkit: the file-system check step (srun) failed; see the lines above" >&2
    exit 2
}
if [ -n "$unseen" ]; then
    echo "clusterkit: job dir $job_dir is not visible on" $unseen "(put the inventory workdir on a filesystem every compute node mounts)" >&2
    exit 2
fi

# DeepSpeed's JIT ops the ranks would build at start (FusedAdamBuilder; docs/sbatch.md,
# "JIT ops"): built here, one task per node, before the ranks start and before the hang
# watchdog's clock, so no rank races a build and a build of minutes is no silent start.
# A lock a killed build left is removed when its owner record proves it dead; one that
# nothing proves dead stops the job here, the node's line naming the lock and the fix.
ops_bundle=$job_dir/jitops.bundle  # node/jitbatch.py's sources (clusterkit sbatch)
jitbatch=(/home/train/venv/bin/python -u -c 'import linecache,sys,types
r=sys.stdin.buffer
h=r.readline().split()
if h[:2]!=[b'"'"'clusterkit-node'"'"',b'"'"'1'"'"']:sys.exit('"'"'clusterkit node bootstrap: expected a clusterkit-node 1 header on stdin, got %r'"'"'%h[:2])
for p in ('"'"'clusterkit'"'"','"'"'clusterkit.node'"'"'):
 m=types.ModuleType(p);m.__path__=[];sys.modules[p]=m
for e in h[2:]:
 n,z=e.decode().split('"'"':'"'"');s=r.read(int(z))
 if len(s)!=int(z):sys.exit('"'"'clusterkit node bootstrap: stdin ended inside '"'"'+n)
 f='"'"'clusterkit.node.'"'"'+n;m=types.ModuleType(f);m.__file__='"'"'<'"'"'+f+'"'"'>'"'"'
 t=s.decode('"'"'utf-8'"'"');linecache.cache[m.__file__]=(len(t),None,t.splitlines(True),m.__file__)
 sys.modules[f]=m;setattr(sys.modules['"'"'clusterkit.node'"'"'],n,m)
 exec(compile(t,m.__file__,'"'"'exec'"'"'),m.__dict__)
sys.argv=['"'"'clusterkit.node.'"'"'+sys.argv[1]]+sys.argv[2:]
sys.exit(sys.modules[sys.argv[0]].main(sys.argv[1:]))
' jitbatch)  # python -u -c BOOTSTRAP jitbatch (node/ship.py)
if [ -r "$ops_bundle" ]; then
    # stdin: the sources, then the request line; each task names its node (Slurm's name)
    # and has the job's GPUs, so DeepSpeed finds the accelerator the ranks will find.
    srun --nodes=2 --ntasks=2 \
        --ntasks-per-node=1 --gpus-per-node=8 --input=all --chdir=/ \
        sh -c 'exec "$@" "$SLURMD_NODENAME"' sh "${jitbatch[@]}" \
        < <(cat -- "$ops_bundle"; printf '%s\n' '{"accelerator": "cuda", "ds_config": {}, "ops": ["FusedAdamBuilder"]}') || {
        both "clusterkit: DeepSpeed's JIT ops are not ready on every node (each node's line above says why): not starting"
        exit 2
    }
else
    echo "clusterkit: $ops_bundle is missing (clusterkit sbatch writes it): the ranks build their DeepSpeed ops themselves" >&2
fi
# Per-run state in the job dir: each rank that exits non-zero records how in $exits
# (the first one is the step's cause); $CLUSTERKIT_STOP_FILE appears when the job is
# asked to stop. A requeued run starts with neither.
exits=/lustre/projects/lm/.clusterkit/jobs/golden-h100-2x8-ib/exits
export CLUSTERKIT_STOP_FILE=/lustre/projects/lm/.clusterkit/jobs/golden-h100-2x8-ib/stop
hang_file=/lustre/projects/lm/.clusterkit/jobs/golden-h100-2x8-ib/hang
rm -rf -- "$exits" "$CLUSTERKIT_STOP_FILE" "$hang_file"
mkdir -p -- "$exits"
# world_size/ranks_per_node: `clusterkit sbatch --watch` reads them to place rank labels.
echo "clusterkit: job golden-h100-2x8-ib slurm=$SLURM_JOB_ID head=$head_node ($MASTER_ADDR:$MASTER_PORT) variant=torchrun world_size=16 ranks_per_node=8 OMP_NUM_THREADS=$OMP_NUM_THREADS"
# Rank labels for `clusterkit sbatch --watch`: srun puts the task (= node) number in front
# of each line ("1: "), torchrun the rank's global rank ("[rank3]:"; torch >= 2.2; older
# torch writes the node-local rank, "[default1]:"). One file per rank needs neither.
export SLURM_LABELIO=1 TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE='[rank${rank}]:'
# USR1 (Slurm's time-limit warning, preemption, `clusterkit sbatch cancel JOB --signal USR1
# --batch`): the stop file appears and every rank gets SIGUSR1. A rank that follows the
# contract (docs/sbatch.md, "Preemption") saves into $CLUSTERKIT_CKPT_DIR and exits 0.
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
srun --nodes=2 --ntasks-per-node=1 --kill-on-bad-exit=1 --chdir=/lustre/projects/lm env HF_HUB_OFFLINE=1 NCCL_DEBUG=WARN NCCL_IB_TIMEOUT=22 WANDB_PROJECT=lm LD_LIBRARY_PATH=/usr/local/cuda/lib64 PYTHONUNBUFFERED=1 NCCL_IB_HCA=mlx5_0,mlx5_1,mlx5_2,mlx5_3,mlx5_4,mlx5_5,mlx5_6,mlx5_7 NCCL_SOCKET_IFNAME==bond0 CLUSTERKIT_JOB_ID=golden-h100-2x8-ib CLUSTERKIT_JOB_DIR=/lustre/projects/lm/.clusterkit/jobs/golden-h100-2x8-ib CLUSTERKIT_DS_CONFIG=/lustre/projects/lm/.clusterkit/jobs/golden-h100-2x8-ib/ds_config.json CLUSTERKIT_CKPT_DIR=/lustre/projects/lm/ckpt/golden-h100-2x8-ib CLUSTERKIT_STORAGE=shared sh -c 'trap "" USR1; exec "$@"' sh /home/train/venv/bin/python -m torch.distributed.run --nnodes=2 --nproc-per-node=8 --max-restarts=0 --log-dir=/lustre/projects/lm/.clusterkit/jobs/golden-h100-2x8-ib/logs --tee=3 --rdzv-backend=c10d --rdzv-endpoint="$MASTER_ADDR":"$MASTER_PORT" --rdzv-id=golden-h100-2x8-ib --no-python sh -c 'trap "" USR1; d=$0; "$@"; rc=$?; [ "$rc" = 0 ] || printf "%s %s %s\n" "$(date +%s%N)" "${SLURMD_NODENAME:-$(hostname)}" "$rc" 2>/dev/null >"$d/rank$RANK"; exit "$rc"' /lustre/projects/lm/.clusterkit/jobs/golden-h100-2x8-ib/exits /home/train/venv/bin/python -u -m clusterkit.workload --engine deepspeed --model tiny --steps 100 --ds-config /lustre/projects/lm/.clusterkit/jobs/golden-h100-2x8-ib/ds_config.json --run-dir /lustre/projects/lm/.clusterkit/jobs/golden-h100-2x8-ib/run --ckpt-dir /lustre/projects/lm/ckpt/golden-h100-2x8-ib --storage shared &
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
requeue() {
    scontrol requeue "$SLURM_JOB_ID"
}
if [ "$status" != 0 ]; then
    # The earliest rank that exited non-zero, "<time ns> <node> <status> <rank>": the
    # cause; srun's own status is the largest of the torn-down tasks' (143 = SIGTERM).
    first=$(for f in "$exits"/rank*; do
                if [ -f "$f" ]; then printf '%s %s\n' "$(cat "$f")" "${f##*/rank}"; fi
            done | sort -n | sed -n 1p) || first=
    if [ -n "$first" ]; then
        read -r _ node rc rank <<< "$first"
        how="exit code $rc"
        [ "$rc" -gt 128 ] && how="killed by signal $(( rc - 128 ))"
        output="the [rank$rank] lines of /lustre/projects/lm/.clusterkit/jobs/golden-h100-2x8-ib/logs/slurm-$SLURM_JOB_ID.err"
        echo "clusterkit: rank $rank on $node failed first ($how); the other ranks were stopped after it. Its output: $output" >&2
        status=$rc
    else
        echo "clusterkit: the launch step failed (exit $status) before any rank ended on its own; see /lustre/projects/lm/.clusterkit/jobs/golden-h100-2x8-ib/logs/slurm-$SLURM_JOB_ID.err" >&2
    fi
fi
if [ -n "$stop_at" ]; then
    # Requeue only for a save made after the stop request, by ranks that then stopped
    # within the signal lead: a script that ignores the request is not requeued as saved.
    waited=$(( $(date +%s) - stop_at ))
    saved=$(find "$CLUSTERKIT_CKPT_DIR" -type f -newer "$CLUSTERKIT_STOP_FILE" -print -quit 2>/dev/null) || saved=
    if [ -z "$saved" ]; then
        both "clusterkit: stop requested, but nothing was saved in $CLUSTERKIT_CKPT_DIR since: not requeueing job $SLURM_JOB_ID (a script saves on SIGUSR1 or when \$CLUSTERKIT_STOP_FILE appears: docs/sbatch.md, Preemption)"
    elif [ "$status" != 0 ]; then
        both "clusterkit: stop requested and $saved written since, but the step failed (exit $status): not requeueing job $SLURM_JOB_ID"
    elif [ "$waited" -gt 90 ]; then
        both "clusterkit: stop requested, but the ranks ran on for $waited s (more than the signal lead, 90 s): they did not stop for it; not requeueing job $SLURM_JOB_ID"
    else
        echo "clusterkit: saved after the stop request ($saved); requeueing job $SLURM_JOB_ID to resume"
        requeue
    fi
fi
exit "$status"
