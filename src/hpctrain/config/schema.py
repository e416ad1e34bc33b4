"""The run configuration: one frozen, keyword-only dataclass per component.

Every field carries an attribute docstring (the string right below it); they are
read back by :func:`field_docs` for ``hpctrain config --describe`` and checked by a
unit test, so a field without one fails CI. Validation (``config/validate.py``)
covers what the config can know alone; what needs the world size (batch
arithmetic) lives in ``config/batch.py``.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from dataclasses import dataclass, field
from functools import cache
from typing import Any, Literal

from hpctrain.config.target import ScriptTarget
from hpctrain.config.validate import validate


@dataclass(frozen=True, kw_only=True)
class RunSection:
    dir: str = ""
    """Run directory (config, metrics, checkpoints, plots, logs). Empty: runs/<experiment>; for a script job
    runs/<the script's file stem or the module's last part>."""
    seed: int = 0
    """Seed of everything: model init, data order (with the epoch), augmentation (with epoch and sample index)."""
    name: str = ""
    """Human name of the run, for logs and reports. Empty: the experiment name."""


@dataclass(frozen=True, kw_only=True)
class TrainSection:
    global_batch_size: int = 256
    """Samples per optimizer step, all ranks together. Fixed when the number of processes changes."""
    micro_batch_size: int = 32
    """Samples per rank per forward/backward. Accumulation steps are computed from it, never configured."""
    max_steps: int = 0
    """Stop after this many optimizer steps; 0 means run train.epochs full epochs."""
    epochs: int = 1
    """Number of passes over the training set (ignored when train.max_steps is set)."""
    stop_at_step: int = 0
    """End this launch after this optimizer step, with a checkpoint, keeping the schedule of the whole run
    (max_steps/epochs); a later launch resumes. For runs longer than one job allocation. 0: run to the end."""
    precision: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    """auto: bf16 autocast on GPUs that compute it natively (Ampere and later), fp16 with a GradScaler on older GPUs
    (V100, T4: emulated bf16 is slower than fp32), fp32 on CPUs. fp16 always uses a GradScaler."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping."""
    max_skipped_steps: int = 20
    """A step whose gradient is not finite (inf or NaN on any rank) is skipped in every step mode: weights, optimizer
    state and EMA stay as they were, the schedule moves on (GradScaler's rule); the train record lists it
    (skipped_steps, skipped_at). More than this many skipped in a row stop the run with an error (a diverged run,
    or inf/NaN in the data); 0: stop at the first. fp16's GradScaler skips a few steps at the start while it finds
    its scale: keep it above those."""
    compile: bool = False
    """Run torch.compile on the DDP-wrapped model (torch's order for compiled DDP: gradient all-reduces overlap the
    compiled backward). The first steps are slow while it compiles. A graph that fails to compile runs eagerly, with
    torch's warning in the log (dynamo's suppress_errors fallback), instead of ending the run."""
    step_mode: Literal["auto", "eager", "compiled", "graphed"] = "auto"
    """Who runs the optimizer step (chosen in train/step_mode.py). eager: Python launches every kernel. compiled:
    the model under torch.compile (train.compile=true is the same). graphed: the whole step (forward, backward, gradient sync,
    clipping, optimizer, EMA) captured once as a CUDA graph and replayed: one launch per step instead of thousands;
    GPUs only, bf16 or fp32, one process or DDP over NCCL; with train.compile=true the compiled kernels are what is
    captured. auto: graphed for one process on a GPU (several GPUs: opt-in until capture under DDP has run on several
    GPUs), else compiled with train.compile=true, else eager; the start-up line says which and why."""
    channels_last: Literal[True, False, "auto"] = False
    """The channels_last (NHWC) memory format for the model's 4-D weights and batches: true, false (NCHW), or auto:
    on GPUs channels_last for a model with 2-D convolutions (tensor cores' convolutions run in it), except NCHW
    for a model with GroupNorm under a graphed step (no channels_last GroupNorm kernel: its conversions cost more
    than channels_last saves; numbers in BENCHMARKS.md); NCHW on CPUs, for a model without convolutions, and for
    one that cannot be built on the meta device (with a warning). The start-up line says which and why
    (train/memory_format.py)."""
    cudnn_benchmark: Literal["auto", "on", "off"] = "auto"
    """torch.backends.cudnn.benchmark: cuDNN times its algorithms for each new convolution shape and keeps the
    fastest. auto: on when the step is graphed (its shapes are fixed, and the search happens in the eager warm-up
    steps before the capture), off otherwise (each new shape, such as an epoch's short last batch, would pay a
    search); on/off: as said. The chosen algorithms can differ from run to run, so results are not bit-identical
    across runs on GPUs with it on. No effect on CPUs."""
    sync_batchnorm: Literal["auto", "on", "off"] = "auto"
    """Batch-norm statistics over the global micro-batch (torch's SyncBatchNorm, one all-reduce per BN layer per
    forward) instead of each GPU's own. auto: on for GPU runs with more than one process and a model with batch
    norm; on: the same, and an error on CPUs (torch's SyncBatchNorm runs only on GPUs); off: per-GPU statistics."""

    @property
    def channels_last_on(self) -> bool:
        """The memory format to use: channels_last resolved per launch (train/memory_format.py). What places the
        model or converts batches reads this, never channels_last itself: an auto never resolved (an experiment
        built by hand from load_config, outside hpctrain's launch) reads as NCHW, torch's default, not as a true
        string."""
        return self.channels_last is True

    @property
    def compiled(self) -> bool:
        """Whether the model runs under torch.compile (train.compile, or train.step_mode=compiled)."""
        return self.compile or self.step_mode == "compiled"


@dataclass(frozen=True, kw_only=True)
class OptimSection:
    name: Literal["adamw", "sgd"] = "adamw"
    """Optimizer."""
    lr: float = 1e-3
    """Peak learning rate (reached after the warmup)."""
    weight_decay: float = 0.01
    """Decoupled weight decay (AdamW) or L2 (SGD)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    momentum: float = 0.9
    """SGD momentum (Nesterov)."""
    warmup_steps: int = 0
    """Linear warmup from 0 to optim.lr over this many optimizer steps."""
    schedule: Literal["cosine", "linear", "poly", "constant"] = "cosine"
    """Learning-rate decay after warmup, down to optim.lr * optim.min_lr_ratio at the last step. poly: (1 -
    progress) ** optim.poly_power, the DeepLab schedule."""
    poly_power: float = 0.9
    """Exponent of the poly schedule."""
    min_lr_ratio: float = 0.0
    """Final learning rate as a fraction of optim.lr."""
    ema_decay: float = 0.0
    """Keep an exponential moving average of the weights with this decay (e.g. 0.9999); 0 disables it."""


@dataclass(frozen=True, kw_only=True)
class DataSection:
    augment: bool = True
    """Apply the experiment's training augmentation. Its randomness comes from (seed, epoch, sample index)."""
    num_workers: int = -1
    """Data-loader worker processes per rank; -1 picks from the CPUs this process may use (one left for the rank, at
    most 8), and none for an in-memory data set (a TensorDataset, a list of samples holding tensors, or one with
    in_memory = True) unless it has a per-sample transform and the run is on a GPU."""
    pin_memory: bool = True
    """Pin host memory for faster, asynchronous copies to the GPU (ignored on CPU)."""
    persistent_workers: bool = True
    """Keep loader workers alive between epochs instead of restarting them."""
    prefetch_factor: int = 2
    """Batches each worker loads ahead."""
    on_error: Literal["raise", "skip"] = "raise"
    """An unreadable sample (corrupt image, missing member, label out of range) stops the run with its name
    (raise), or is left out of its batch, counted, and reported at the end of the epoch (skip). A batch with a
    skipped sample is smaller, and its mean loss still weighs as much as a full batch's."""
    shuffle_window: int = 4096
    """Sharded sets: samples are shuffled within windows of this many consecutive samples of the epoch's shard
    stream (shards permuted per epoch). Larger mixes better and reads more bytes per step's worth of samples."""
    order: Literal["exact", "shard_local"] = "exact"
    """Sharded sets: the epoch's order. exact: step k's samples depend only on (seed, epoch, k), whatever the
    number of processes (a resume may change it), and every node reads nearly the whole set per epoch. shard_local:
    each rank reads its own shards (dealt per epoch, shuffled within data.shuffle_window), so a node reads about
    1/nodes of it; deterministic and resumable at a fixed number of processes only (see docs/data.md)."""
    read_block_kb: int = 1024
    """Sharded sets: shards are read in aligned blocks of this size (large sequential reads). A node reads every
    block holding one of its samples: for large samples on many nodes, near the sample size (e.g. 128 for ~110 KB
    JPEGs) cuts the exact order's shared-file-system reads about 4x (docs/data.md, "Data at cluster scale")."""
    read_cache_mb: int = 128
    """Sharded sets: block cache per loader process; make it hold a shuffle window's bytes."""
    stage_dir: str = ""
    """Sharded sets: copy each split once per node into this node-local folder (e.g. $TMPDIR, $SLURM_TMPDIR or an
    NVMe mount; $VARIABLES and ~ are expanded on each node when the data is opened) and read it there. The copy
    is verified against the manifest, resumed after an interruption, and reused by later jobs on the node while
    the folder lasts (Slurm's per-job $TMPDIR usually ends with the job). Empty: read the shards where they are."""
    on_device: bool = False
    """Hold the whole training set in device memory (the experiment's TensorDataset, e.g. CIFAR-10's 150 MB of
    uint8) and cut each micro-batch there: no loader processes, no host-to-device copy per step. Augmentation runs
    batched on the device (the experiment's device_transform); same order and world-size independence as the
    loader."""
    worker_start: Literal["forkserver", "spawn", "fork"] = "forkserver"
    """How loader workers start. fork copies a process that has threads (watchdog, process group), and a
    child can deadlock in CPython's after-fork handler (seen in this project); forkserver
    forks from a clean single-threaded server. fork starts faster but is unsafe here. The dataset must be
    picklable."""


@dataclass(frozen=True, kw_only=True)
class EvalSection:
    every_steps: int = 0
    """Validate every this many optimizer steps; 0 means at the end of each epoch and of the run."""
    micro_batch_size: int = 0
    """Samples per rank per validation forward; 0 means 2 x train.micro_batch_size."""


@dataclass(frozen=True, kw_only=True)
class LogSection:
    every_steps: int = 10
    """Log the all-reduced train loss, lr and throughput every this many optimizer steps."""
    progress: Literal["auto", "bar", "lines", "off"] = "auto"
    """auto: a progress bar on a terminal, plain log lines otherwise (Slurm log files)."""
    tensorboard: bool = True
    """Also write TensorBoard event files (when the tensorboard package is installed)."""
    plots: bool = True
    """Draw PNG plots of the curves into RUN_DIR/plots at the end of the run."""
    outputs_every_steps: int = 0
    """Run the experiment's outputs (samples, pictures; on all ranks, into RUN_DIR/images) every this many
    optimizer steps; 0: not by steps. They also run at the end of the run."""
    outputs_every_epochs: int = 0
    """The same every this many epochs; 0: not by epochs."""
    trackers: tuple[str, ...] = ()
    """Experiment trackers that get the run besides metrics.jsonl: any of wandb, mlflow (optional extras: pip install
    hpctrain[wandb] or hpctrain[mlflow]) and tensorboard (the same as log.tensorboard=true). From rank 0 only, in a
    background thread: a tracker that is slow or down warns once and the training goes on. One tracker run per
    training, kept in RUN_DIR/trackers/, continued by every resume and requeue (docs/trackers.md)."""
    tracker_tags: tuple[str, ...] = ()
    """Tags of the tracker run (W&B tags; MLflow tags with the value 'true')."""
    tracker_group: str = ""
    """The group the run belongs to (W&B group; MLflow tag hpctrain.group and, unless log.mlflow_experiment is set,
    the MLflow experiment). A sweep sets it to the sweep dir's name. Empty: none."""
    tracker_timeout_s: float = 30.0
    """Longest wait for a tracker: W&B's init timeout, and at the end of the run the wait for what is still queued
    (what is left unsent then is in metrics.jsonl and goes out at the run's next launch)."""
    wandb_project: str = ""
    """W&B project. Empty: the experiment's name."""
    wandb_entity: str = ""
    """W&B entity (user or team). Empty: your default entity."""
    wandb_offline: bool = False
    """W&B offline mode: nothing is sent, the run is written under RUN_DIR/trackers/wandb for a later `wandb sync`
    (the command is printed at the end of the job and by `hpctrain slurm status`). For compute nodes without internet."""
    mlflow_uri: str = ""
    """MLflow tracking URI: a tracking server (http://host:5000) or a store. Empty: a file store in RUN_DIR/trackers/
    mlruns (a sweep's points share SWEEP_DIR/mlruns): nothing leaves the machine."""
    mlflow_experiment: str = ""
    """MLflow experiment name (created if missing). Empty: log.tracker_group, else the experiment's name."""


@dataclass(frozen=True, kw_only=True)
class CkptSection:
    every_steps: int = 0
    """Save a checkpoint every this many optimizer steps; 0 disables step-based saves."""
    every_minutes: float = 60.0
    """Also save when this many minutes have passed since the last save (rank 0's clock decides for all); 0 disables."""
    keep_last: int = 3
    """Keep this many most recent checkpoints; older ones are deleted after a newer one is complete."""
    resume: str = "auto"
    """auto: continue from RUN_DIR's latest valid checkpoint if any; never: refuse a run dir with checkpoints; or a checkpoint directory path."""
    async_save: bool = True
    """Write periodic checkpoints in the background: training pauses only to copy the state into CPU memory
    (one extra copy of model, optimizer and EMA state in rank 0's host memory). The last save of a run and a
    preemption save are always waited for; a failed background write stops the run at the next save."""
    on_batch_change: Literal["error", "restart_epoch"] = "error"
    """A resume whose train.global_batch_size differs from the checkpoint's: error stops before anything is
    written, naming both values. restart_epoch starts the saved epoch again from its first sample with the new
    batch (the saved position counts batches of the old size); the step count, and so the learning-rate
    schedule, which is in steps, continue."""


@dataclass(frozen=True, kw_only=True)
class DistSection:
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """Process-group backend; auto: nccl with CUDA, gloo without."""
    timeout_s: int = 600
    """Timeout in seconds of the training collectives (gradient all-reduce, the per-step stop vote, loss and metric
    sums): a rank stuck longer than this fails instead of hanging until the wall time. Keep it tight."""
    control_timeout_s: int = 3600
    """Timeout in seconds of the control plane: barriers, object broadcasts, the wait for a checkpoint write on
    rank 0 (a slow shared file system), the end-of-run wait while rank 0 writes plots and reports, checkpoint
    selection and loading. These run on a separate gloo process group, so a slow file system does not turn a
    finished run into an NCCL timeout. At least dist.timeout_s."""
    bucket_cap_mb: int = 25
    """DDP gradient bucket size in MiB."""
    find_unused_parameters: bool = False
    """DDP: allow parameters that get no gradient in a step (costs a graph traversal per step)."""
    grad_compression: Literal["none", "bf16", "fp16"] = "none"
    """DDP: cast gradients to 16 bits for the all-reduce (torch's bf16/fp16_compress_hook), halving the bytes on the
    wire; for communication-bound runs (see 'hpctrain plan'). Changes the numerics slightly: sums are rounded to 16 bits."""
    strategy: Literal["ddp", "zero1", "fsdp"] = "ddp"
    """How the training state is spread over the ranks. ddp: every rank holds the whole model, gradients and
    optimizer state; gradients are all-reduced. zero1: the optimizer state is sharded (ZeroRedundancyOptimizer),
    gradients are all-reduced as under ddp, and each rank broadcasts its updated parameters. fsdp: parameters,
    gradients and optimizer state are sharded (FSDP2 fully_shard per block and at the root): each block's
    parameters are all-gathered for its forward and backward, gradients reduce-scattered. Checkpoints are the
    same format under all three and move between them (see the README)."""
    fsdp_reshard_after_forward: bool = True
    """fsdp: free each block's gathered parameters after its forward and gather them again for the backward
    (ZeRO-3: least memory); false keeps them until the backward (ZeRO-2-like: one all-gather less per block)."""
    fsdp_cpu_offload: bool = False
    """fsdp: keep the sharded parameters, gradients and optimizer state in host memory and step the optimizer on
    the CPU (torch's CPUOffloadPolicy): for models whose state does not fit the GPUs, at a large cost in speed."""


@dataclass(frozen=True, kw_only=True)
class FaultSection:
    warning_signal: Literal["SIGUSR2", "SIGUSR1", "SIGHUP", "none"] = "SIGUSR2"
    """Signal that asks for a checkpoint and a requeue, besides SIGTERM (Slurm: --signal=B:USR2@SECONDS).
    Not SIGUSR1 by default: NCCL has used it."""
    requeue: bool = True
    """After a preemption checkpoint inside a Slurm job, rank 0 runs 'scontrol requeue $SLURM_JOB_ID'. A script job
    (--script) is requeued by its batch shell instead, when every rank exited with a requeue code; false: never."""
    exit_code: int = 75
    """Exit code of a run stopped by a signal after its checkpoint (75, EX_TEMPFAIL: 'try again'). A script job
    (--script) is requeued when every one of its processes exits with it (or with one of fault.requeue_exit_codes);
    any other non-zero exit is a failure, never requeued."""
    requeue_exit_codes: tuple[int, ...] = ()
    """Script jobs (--script): more exit codes, besides fault.exit_code, with which your script asks to be requeued
    (e.g. [76] when 75 already means something else to it). Each in 1..255."""
    heartbeat_every_s: float = 10.0
    """Each rank writes RUN_DIR/heartbeat/rank_N.json this often (step, phase, host, pid)."""
    hang_timeout_s: float = 300.0
    """A rank with no progress for this long is reported as stuck (phase, step, host, Python stack); 0 disables.
    Keep it below dist.timeout_s so the report comes before the collective timeout ends the job."""
    slow_phase_timeout_s: float = 1800.0
    """The same limit for phases that are slow without a hang: a checkpoint save, and the first time a process
    enters a phase (torch.compile in the first forward, NCCL set-up and autotuning in the first step, loader
    workers starting, a recompile in the first validation batch). Below hang_timeout_s: hang_timeout_s applies.
    Capped just below dist.timeout_s: a rank waiting longer than that for a peer fails its collective anyway,
    and the report must come first."""

    @property
    def requeue_codes(self) -> frozenset[int]:
        """The exit codes with which a script job's processes ask to be requeued: fault.exit_code and
        fault.requeue_exit_codes."""
        return frozenset({self.exit_code, *self.requeue_exit_codes})


@dataclass(frozen=True, kw_only=True)
class AlertSection:
    webhook_file: str = ""
    """File holding the webhook URL (never pass the URL itself on the command line); the environment variable
    HPCTRAIN_ALERT_WEBHOOK takes precedence. Empty and unset: no alerts."""
    events: tuple[str, ...] = ("failure", "requeue", "hang")
    """Events to send: any of failure, requeue, hang, complete."""
    format: Literal["auto", "json", "slack", "discord"] = "auto"
    """Payload shape: json (all fields), slack ({"text": ...}, also Mattermost/Rocket.Chat), discord
    ({"content": ...}); auto picks from the URL's host."""
    timeout_s: float = 5.0
    """Give up on a webhook after this long; a failing webhook never stops training."""


@dataclass(frozen=True, kw_only=True)
class SlurmSection:
    job_name: str = ""
    """Slurm job name (%x in output paths). Empty: the run name."""
    partition: str = ""
    """Partition (--partition). Empty: the cluster's default."""
    account: str = ""
    """Account to charge (--account). Empty: your default account."""
    qos: str = ""
    """Quality of service (--qos). Empty: the default."""
    nodes: int = 1
    """Number of nodes. With slurm.launcher=torchrun one launcher (torchrun) runs per node."""
    gpus_per_node: int = 1
    """Training processes per node, one per GPU. With slurm.gpus=false (CPU-only nodes) the number of gloo
    processes per node."""
    launcher: Literal["torchrun", "srun"] = "torchrun"
    """How the job starts its processes. torchrun: one torchrun per node (a Slurm task of its own) starts the
    node's slurm.gpus_per_node processes, forwards signals to them and names the worker that failed first. srun:
    Slurm starts slurm.gpus_per_node tasks per node, each running hpctrain directly (rank from SLURM_PROCID,
    rendezvous at the first node), GPUs bound per slurm.gpu_bind: for sites that bind one GPU per task. The
    README's Slurm section lists what differs (failure report, alerts)."""
    gpu_bind: Literal["per_task", "none"] = "per_task"
    """GPU binding of slurm.launcher=srun tasks (with slurm.gpus=true; otherwise unused). per_task: each task is
    bound to one of the node's GPUs (srun --gpu-bind=per_task:1, Slurm 21.08 or later) and sees only it, as
    cuda:0. none: every task sees all of the node's GPUs and uses cuda:LOCAL_RANK; choose it where confining
    each task to its bound GPU (cgroup devices) blocks direct GPU-to-GPU (NVLink) transfers between a node's
    processes."""
    gpus: bool = True
    """Request GPUs (--gres=gpu[:TYPE]:N). false for CPU-only nodes: no --gres, gloo processes."""
    gpu_type: str = ""
    """GPU type in the gres request (e.g. a100 gives --gres=gpu:a100:N). Empty: any GPU."""
    cpus_per_task: int = 0
    """CPUs per node for the training: the node's launcher, all its processes and their loader workers. With
    slurm.launcher=srun each of the node's tasks gets an equal share (--cpus-per-task=this/gpus_per_node).
    0: 8 per process."""
    mem: str = ""
    """Memory per node (--mem, e.g. 200G; 0 means all of the node). Empty: the cluster's default."""
    time: str = "01:00:00"
    """Time limit ([D-]HH:MM:SS or minutes). The job is warned slurm.signal_lead_s before it."""
    constraint: str = ""
    """Node features (--constraint), e.g. 'a100&ib'. Empty: none."""
    exclusive: bool = False
    """Whole nodes only (--exclusive)."""
    extra_sbatch: tuple[str, ...] = ()
    """Further sbatch options, one per item without '#SBATCH', e.g. ['--mail-type=END', '--reservation=big']."""
    modules: tuple[str, ...] = ()
    """Environment modules to load after 'module purge' (e.g. ['CUDA/12.4', 'NCCL']). Empty: no module commands."""
    setup: tuple[str, ...] = ()
    """Shell lines run before the launch (e.g. 'conda activate torch'). Taken verbatim: they are your shell code."""
    python: str = ""
    """Python interpreter that runs hpctrain on the nodes. Empty: the interpreter that renders the script (the
    same environment), or 'python' inside a container."""
    container: str = ""
    """Apptainer/Singularity image (.sif) to run the training in. Empty: no container."""
    container_runtime: Literal["apptainer", "singularity"] = "apptainer"
    """Command that runs the container."""
    container_binds: tuple[str, ...] = ()
    """Extra bind mounts (SRC[:DST]) besides the run dir and the working directory, e.g. the data directory."""
    requeue: bool = True
    """Let Slurm requeue the job (--requeue); hpctrain requeues it itself after a preemption checkpoint."""
    signal_lead_s: int = 120
    """Seconds before the time limit at which Slurm sends fault.warning_signal (to the batch shell, which passes
    it on to every process). 0: no warning signal."""
    nccl: Literal["infiniband", "ethernet", "none"] = "none"
    """NCCL network preset. infiniband: NCCL_NET=IB (fail loudly rather than fall back to slow sockets),
    GPUDirect RDMA up to the PCIe host bridge; ethernet: NCCL_NET=Socket, InfiniBand off; none: set nothing and
    let NCCL detect the network."""
    nccl_socket_ifname: str = ""
    """NCCL_SOCKET_IFNAME (e.g. ib0, or ^lo,docker for 'not these'). Each process gives gloo (hpctrain's
    control plane) the first interface of its node that this selects, unless GLOO_SOCKET_IFNAME is set. Empty: let
    NCCL (and gloo) choose."""
    nccl_debug: Literal["", "VERSION", "WARN", "INFO", "TRACE"] = "WARN"
    """NCCL_DEBUG level. WARN keeps logs small but shows errors; INFO to debug the network setup."""
    env: tuple[str, ...] = ()
    """Extra environment variables, as 'NAME=value' items; values are passed literally (no shell expansion)."""
    monitor_every_s: int = 5
    """Each node records 'top -b' (and 'nvidia-smi dmon' where GPUs exist) every this many seconds into
    RUN_DIR/monitor; 0 disables the monitors."""
    port: int = 0
    """Rendezvous port on the first node. 0: derived from the job id (15000 + id % 15000), so that two jobs
    sharing a node do not collide."""
    preflight: bool = False
    """Run `hpctrain doctor --perf` on all ranks as the job's first step (report in RUN_DIR/preflight/JOBID);
    a failed check ends the job before training (`hpctrain slurm submit --preflight` sets this)."""
    preflight_args: tuple[str, ...] = ()
    """Extra `doctor --perf` options for the pre-flight, e.g. ["--min-busbw", "20", "--max-size", "256MiB"]."""


@dataclass(frozen=True, kw_only=True)
class NoModelOptions:
    """Placeholder [model] section for experiments without options."""


SECTIONS: dict[str, type] = {
    "run": RunSection,
    "train": TrainSection,
    "optim": OptimSection,
    "data": DataSection,
    "eval": EvalSection,
    "log": LogSection,
    "ckpt": CkptSection,
    "dist": DistSection,
    "fault": FaultSection,
    "alert": AlertSection,
    "slurm": SlurmSection,
}


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    experiment: str
    """Registered experiment name or 'package.module:Class'; for a script job 'script:PATH' or 'script:-m MODULE'
    (config/target.py)."""
    run: RunSection = field(default_factory=RunSection)
    """Run identity and seed."""
    train: TrainSection = field(default_factory=TrainSection)
    """Batch sizes, length, precision."""
    optim: OptimSection = field(default_factory=OptimSection)
    """Optimizer, learning-rate schedule, EMA."""
    data: DataSection = field(default_factory=DataSection)
    """Augmentation and data-loader settings."""
    eval: EvalSection = field(default_factory=EvalSection)
    """Validation cadence."""
    log: LogSection = field(default_factory=LogSection)
    """Console, metrics.jsonl, TensorBoard, plots."""
    ckpt: CkptSection = field(default_factory=CkptSection)
    """Checkpoint cadence, retention and resume."""
    dist: DistSection = field(default_factory=DistSection)
    """torch.distributed settings."""
    fault: FaultSection = field(default_factory=FaultSection)
    """Preemption, requeue, heartbeat and hang detection."""
    alert: AlertSection = field(default_factory=AlertSection)
    """Webhook alerts."""
    slurm: SlurmSection = field(default_factory=SlurmSection)
    """Job script settings for 'hpctrain slurm render|submit|check'."""
    model: Any = field(default_factory=NoModelOptions)
    """The experiment's own options (its config_class)."""

    def __post_init__(self) -> None:
        validate(self)

    @property
    def script(self) -> ScriptTarget | None:
        """The script or module a script job runs (None: an experiment)."""
        return ScriptTarget.parse(self.experiment)

    @property
    def run_dir(self) -> str:
        if self.script is not None:  # runs/train for train.py or pkg.train, not runs/script_train_py
            return self.run.dir or f"runs/{self.script.run_name}"
        return self.run.dir or f"runs/{self.experiment.replace(':', '_').replace('.', '_')}"

    @property
    def run_name(self) -> str:
        return self.run.name or (self.script.run_name if self.script is not None else self.experiment)


@cache
def field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings of a dataclass, read from its source."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):
        return {}
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, nxt in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = nxt.value.value
    return docs

