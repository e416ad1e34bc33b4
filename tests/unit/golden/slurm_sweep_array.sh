#!/bin/bash
# Written by hpctrain 0.1.0 for experiment 'digits'.
# Change the [slurm] config and render again rather than editing this file:
#   hpctrain sweep submit EXPERIMENT --grid KEY=V1,V2 ... --dry-run
#SBATCH --job-name=sweep-lr
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=8
#SBATCH --time=01:00:00
#SBATCH --array=0-3%2
#SBATCH --output=/shared/sweeps/lr/logs/%x_%A_%a.out
#SBATCH --open-mode=append
#SBATCH --requeue
#SBATCH --signal=B:USR2@120

set -euo pipefail
SWEEP_DIR=/shared/sweeps/lr
# this array task's point of the sweep: its own run dir, config, checkpoints (a requeue resumes it alone)
POINTS=(p000_lr=1e-3_micro_batch_size=25 p001_lr=1e-3_micro_batch_size=50 p002_lr=3e-3_micro_batch_size=25 p003_lr=3e-3_micro_batch_size=50)
POINT="${POINTS[$SLURM_ARRAY_TASK_ID]}"
RUN_DIR="$SWEEP_DIR/$POINT"
echo "hpctrain: sweep point $POINT (array task $SLURM_ARRAY_TASK_ID of job $SLURM_ARRAY_JOB_ID)"
cd /home/user/project
mkdir -p "$RUN_DIR/logs" "$RUN_DIR/slurm" "$RUN_DIR/monitor"
echo "hpctrain: job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}) on $SLURM_JOB_NODELIST, started $(date -Is)"

# --- environment ---
set +u
source /home/user/venv/bin/activate
set -u
# srun does not inherit --cpus-per-task since Slurm 22.05: pass it on, or every task gets one CPU
export SRUN_CPUS_PER_TASK=8
# half of each process's CPUs for its own threads, the other half for its loader workers
export OMP_NUM_THREADS=4
export PYTHONUNBUFFERED=1
# each node's launcher records top (and nvidia-smi dmon) into the run dir and stops them on exit
export HPCTRAIN_MONITOR_DIR="$RUN_DIR/monitor"
export HPCTRAIN_MONITOR_EVERY=5

# --- network ---
# NCCL preset: none
export NCCL_DEBUG=WARN

# --- the point's resolved config, written by 'hpctrain sweep submit' (a requeued task runs the same) ---
CONFIG="$RUN_DIR/slurm/config_$SLURM_JOB_ID.toml"
cp "$SWEEP_DIR/configs/$POINT.toml" "$CONFIG.tmp"
mv -f "$CONFIG.tmp" "$CONFIG"

# --- launch: one torchrun per node ---
LAUNCH=(srun --kill-on-bad-exit=1 --ntasks-per-node=1 --cpus-per-task=8 /home/user/venv/bin/python -u -m hpctrain.launch --standalone --nnodes=1 --nproc-per-node=1 -m hpctrain train digits --config "$CONFIG")
printf "%q " "${LAUNCH[@]}" > "$RUN_DIR/slurm/launch_$SLURM_JOB_ID.sh"
echo "hpctrain: launching: $(cat "$RUN_DIR/slurm/launch_$SLURM_JOB_ID.sh")"

# Slurm's job statistics go into the run dir: sstat while the step runs, sacct (and seff) at the end.
job_stats() {
  local out="$RUN_DIR/monitor/sstat_$SLURM_JOB_ID.txt"
  # keep the last snapshot of a running step (sstat shows nothing once a step has ended)
  if sstat --allsteps --parsable2 --format=JobID,AveCPU,MaxRSS,MaxRSSNode,AveRSS,MaxDiskRead,MaxDiskWrite -j "$SLURM_JOB_ID" > "$out.tmp" 2> /dev/null && [ "$(wc -l < "$out.tmp")" -gt 1 ]; then mv -f "$out.tmp" "$out"; else rm -f "$out.tmp"; fi
}
finish() {
  sacct --parsable2 --format=JobID,JobName,State,ExitCode,Elapsed,TotalCPU,MaxRSS,NodeList -j "$SLURM_JOB_ID" > "$RUN_DIR/monitor/sacct_$SLURM_JOB_ID.txt" 2>&1 || true
  if command -v seff > /dev/null; then seff "$SLURM_JOB_ID" > "$RUN_DIR/monitor/seff_$SLURM_JOB_ID.txt" 2>&1 || true; fi
  if [ -n "${STATS_PID:-}" ]; then kill "$STATS_PID" 2> /dev/null || true; fi
}
trap finish EXIT
# --signal=B:USR2 reaches only this shell: pass it to srun, which passes it to every task
trap 'echo "hpctrain: got SIGUSR2, passing it to the job step"; kill -USR2 "${SRUN_PID:-}" 2> /dev/null || true' USR2
"${LAUNCH[@]}" &
SRUN_PID=$!
( sleep 5; while true; do job_stats; sleep 30; done ) &
STATS_PID=$!
# wait returns early when a trapped signal arrives: wait again until srun has really ended;
# bash keeps the status of an ended child, so the last wait gives srun's own exit code
while kill -0 "$SRUN_PID" 2> /dev/null; do wait "$SRUN_PID" || true; done
rc=0; wait "$SRUN_PID" || rc=$?
echo "hpctrain: job step ended with exit code $rc at $(date -Is)"
exit "$rc"
