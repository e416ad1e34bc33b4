#!/bin/bash
# Written by hpctrain 0.1.0 for a script job.
# Change the [slurm] config and render again rather than editing this file:
#   hpctrain slurm render --script PATH --config FILE [key=value ...] -- SCRIPT ARGS
#SBATCH --job-name=train
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=2
#SBATCH --time=01:00:00
#SBATCH --output=/shared/runs/train/logs/%x_%j.out
#SBATCH --open-mode=append
#SBATCH --requeue
#SBATCH --signal=B:USR2@120

set -euo pipefail
RUN_DIR=/shared/runs/train
cd /home/user/project
mkdir -p "$RUN_DIR/logs" "$RUN_DIR/slurm" "$RUN_DIR/monitor"
echo "hpctrain: job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}) on $SLURM_JOB_NODELIST, started $(date -Is)"

# --- environment ---
set +u
source /home/user/venv/bin/activate
set -u
# srun does not inherit --cpus-per-task since Slurm 22.05: pass it on, or every task gets one CPU
export SRUN_CPUS_PER_TASK=2
# half of each process's CPUs for its own threads, the other half for its loader workers
export OMP_NUM_THREADS=1
export PYTHONUNBUFFERED=1
# each node's launcher records top (and nvidia-smi dmon) into the run dir and stops them on exit
export HPCTRAIN_MONITOR_DIR="$RUN_DIR/monitor"
export HPCTRAIN_MONITOR_EVERY=5

# --- network ---
# NCCL preset: none
export NCCL_DEBUG=WARN
mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
export MASTER_ADDR="${NODES[0]}"
export MASTER_PORT=$(( 15000 + SLURM_JOB_ID % 15000 ))

# --- the resolved config and the settings you gave, fixed at render time (a requeued job runs the same) ---
CONFIG="$RUN_DIR/slurm/config_$SLURM_JOB_ID.toml"
cat > "$CONFIG.tmp" <<'HPCTRAIN_CONFIG_EOF'
experiment = "script:train.py"

[run]
dir = "/shared/runs/train"
HPCTRAIN_CONFIG_EOF
mv -f "$CONFIG.tmp" "$CONFIG"
cp "$CONFIG" "$RUN_DIR/config.toml.tmp"
mv -f "$RUN_DIR/config.toml.tmp" "$RUN_DIR/config.toml"
cat > "$RUN_DIR/settings.toml.tmp" <<'HPCTRAIN_SETTINGS_EOF'
experiment = "script:train.py"

[slurm]
nodes = 2

[run]
dir = "/shared/runs/train"
HPCTRAIN_SETTINGS_EOF
mv -f "$RUN_DIR/settings.toml.tmp" "$RUN_DIR/settings.toml"
# every rank finds the settings there (hpctrain.session() reads them)
export HPCTRAIN_SETTINGS="$RUN_DIR/settings.toml"

# --- signals: Slurm signals every process of the job step itself with ProctrackType cgroup or linuxproc
# (pgid: only each task's process group), the script's ranks included; the node launchers then pass none on,
# or each rank would get every signal twice ---
case "$(scontrol show config 2> /dev/null | sed -n 's/^ProctrackType *= *//p')" in
  proctrack/cgroup|proctrack/linuxproc) export HPCTRAIN_FORWARD_SIGNALS=0 ;;
  *) export HPCTRAIN_FORWARD_SIGNALS=1 ;;
esac
# what 'scontrol requeue' takes (a sweep's point: its own array task, never the whole array)
REQUEUE_ID="$SLURM_JOB_ID"
# each node's launcher records how its ranks ended here, one file per node (hpctrain/slurm/exits.py)
export HPCTRAIN_EXITS_DIR="$RUN_DIR/slurm/exits/$REQUEUE_ID.${SLURM_RESTART_COUNT:-0}"
mkdir -p "$HPCTRAIN_EXITS_DIR"
rm -f "$HPCTRAIN_EXITS_DIR"/node*

# --- launch: one torchrun per node over the script ---
LAUNCH=(srun --kill-on-bad-exit=1 --ntasks-per-node=1 --cpus-per-task=2 /home/user/venv/bin/python -u -m hpctrain.launch --nnodes="$SLURM_JOB_NUM_NODES" --nproc-per-node=2 --rdzv-backend=c10d --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv-id="$SLURM_JOB_ID" --max-restarts=0 train.py --epochs 10)
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
# How the script's ranks ended, from each node's record: requeue when every node asked for it (all its
# ranks exited with a requeue code), mixed when only some did; any other exit is a failure, never requeued
REQUEUE_CODES="75 76"
script_ended() {
  local f code asked=0
  for f in "$HPCTRAIN_EXITS_DIR"/node*.json; do
    [ -e "$f" ] || continue
    code=$(sed -n 's/^{"exit_code": \(-\{0,1\}[0-9]*\).*/\1/p' "$f")
    case " $REQUEUE_CODES " in *" $code "*) asked=$((asked + 1)) ;; esac
  done
  if [ "$asked" -gt 0 ] && [ "$asked" -eq "$SLURM_JOB_NUM_NODES" ]; then echo requeue
  elif [ "$asked" -gt 0 ]; then echo mixed; fi
}
ended=$(script_ended)
if [ "$rc" -eq 0 ] && [ "$ended" = requeue ]; then rc=75; fi
if [ "$rc" -eq 0 ] && [ "$ended" = mixed ]; then
  echo "hpctrain: the ranks of some nodes asked for a requeue, the others did not: a failure"
  rc=1
fi
echo "hpctrain: job step ended with exit code $rc at $(date -Is)"
if [ "$ended" = requeue ] && [ "$rc" -eq 75 ]; then
  echo "hpctrain: every rank of the script exited with a requeue code: requeueing job $REQUEUE_ID"
  scontrol requeue "$REQUEUE_ID" || echo "hpctrain: 'scontrol requeue $REQUEUE_ID' failed; submit the same run dir again to go on"
fi
exit "$rc"
