#!/bin/bash
# Slurm batch script for clusterkit job golden-a800-7x2 (a800-7x2), rendered from the
# inventory; edit the inventory or the clusterkit flags, not this file.
#SBATCH --job-name=ck-golden-a800-7x2
#SBATCH --nodes=7
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=2
#SBATCH --time=01:00:00
#SBATCH --output=/srv/train/.clusterkit/jobs/golden-a800-7x2/logs/slurm-%j.out
#SBATCH --error=/srv/train/.clusterkit/jobs/golden-a800-7x2/logs/slurm-%j.err
# 90 s before the time limit Slurm sends USR1 to this script (B:), which forwards it
# to the launch step: the workload checkpoints and exits 0, then the script requeues
# the job, which resumes from that checkpoint (--resume auto, same checkpoint dir).
# USR1 sent to the steps only (scancel --signal=USR1 JOB) checkpoints and stops.
#SBATCH --signal=B:USR1@90
#SBATCH --requeue
set -euo pipefail

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
# The same port derivation as clusterkit's plan for a numeric job id.
MASTER_PORT=$(( 20000 + SLURM_JOB_ID % 40001 ))
export MASTER_ADDR MASTER_PORT

# The job environment (an allowlist, see docs/render.md).
export HF_HUB_OFFLINE=1
export NCCL_DEBUG=WARN
export NCCL_IB_TIMEOUT=22
export PATH=/opt/conda/envs/train/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
export PYTHONUNBUFFERED=1
export NCCL_SOCKET_IFNAME==ens1f0
export GLOO_SOCKET_IFNAME=ens1f0
export CLUSTERKIT_JOB_ID=golden-a800-7x2

mkdir -p -- /srv/train/.clusterkit/jobs/golden-a800-7x2/logs
# Node-local checkpoints: every node needs its own directory.
srun --nodes=7 --ntasks-per-node=1 mkdir -p -- /scratch/ckpt/golden-a800-7x2

echo "clusterkit: job golden-a800-7x2 slurm=$SLURM_JOB_ID head=$head_node ($MASTER_ADDR:$MASTER_PORT) variant=torchrun"
preempted=0
forward_usr1() {
    preempted=1
    echo "clusterkit: USR1 (time limit or preemption): asking every rank to checkpoint"
    scancel --signal=USR1 "$SLURM_JOB_ID" || true
}
trap forward_usr1 USR1
# In the background so the trap runs at once; `wait` returns early on a trapped
# signal, so wait again until the step has really finished.
srun --nodes=7 --ntasks-per-node=1 --kill-on-bad-exit=1 --chdir=/srv/train env HF_HUB_OFFLINE=1 NCCL_DEBUG=WARN NCCL_IB_TIMEOUT=22 PATH=/opt/conda/envs/train/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin LD_LIBRARY_PATH=/usr/local/cuda/lib64 PYTHONUNBUFFERED=1 NCCL_SOCKET_IFNAME==ens1f0 GLOO_SOCKET_IFNAME=ens1f0 CLUSTERKIT_JOB_ID=golden-a800-7x2 sh -c 'trap "" USR1; exec "$0" -m torch.distributed.run --node-rank="$SLURM_NODEID" "$@"' /opt/conda/envs/train/bin/python --nnodes=7 --nproc-per-node=2 --max-restarts=0 --tee=3 --master-addr="$MASTER_ADDR" --master-port="$MASTER_PORT" -m clusterkit.workload --engine deepspeed --model tiny --steps 100 --ds-config /srv/train/.clusterkit/jobs/golden-a800-7x2/ds_config.json --run-dir /srv/train/.clusterkit/jobs/golden-a800-7x2/run --ckpt-dir /scratch/ckpt/golden-a800-7x2 --storage node-local &
launch_pid=$!
status=0
while :; do
    wait "$launch_pid" && status=0 || status=$?
    kill -0 "$launch_pid" 2>/dev/null || break
done
if [ "$preempted" = 1 ] && [ "$status" = 0 ]; then
    echo "clusterkit: checkpoint saved; requeueing job $SLURM_JOB_ID to resume"
    scontrol requeue "$SLURM_JOB_ID"
fi
exit "$status"
