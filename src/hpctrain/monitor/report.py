"""`hpctrain report RUN_DIR`: plots and a short summary from the run dir's logs.

Inputs (whatever exists): metrics.jsonl; monitor/top_HOST.log and monitor/dmon_HOST.log from
each node's monitors; monitor/sstat_JOB.txt and sacct/seff files from the job script.
Outputs in RUN_DIR/report/: overview.png (loss, throughput, CPU use per node, GPU use when there is any; the steps
where the run resumed marked),
gpu.png (utilisation, memory bandwidth, power, temperature per GPU), summary.md and
index.html (the same summary with the pictures).
"""

from __future__ import annotations

import html
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from hpctrain.errors import UserError
from hpctrain.metrics.plots import mark_resumes, plot_loss
from hpctrain.metrics.records import events, metric_values, read_metrics, series
from hpctrain.monitor.gpu_busy import HOST_BOUND, LOADER_BOUND
from hpctrain.monitor.parse import DmonTable, TopSeries, node_logs, parse_dmon, parse_parsable, parse_top

GPU_PANELS = (("sm", "GPU utilisation (SM busy, %)"), ("mem", "memory bandwidth utilisation (%)"),
              ("pwr", "power (W)"), ("gtemp", "GPU temperature (C)"))


@dataclass
class RunData:
    run_dir: Path
    records: list[dict] = field(default_factory=list)
    top: dict[str, TopSeries] = field(default_factory=dict)
    dmon: dict[str, DmonTable] = field(default_factory=dict)
    job_stats: dict[str, list[dict[str, str]]] = field(default_factory=dict)


def load_run(run_dir: Path) -> RunData:
    if not run_dir.is_dir():
        raise UserError(f"{run_dir} is not a directory", "pass the run dir of a training run (run.dir).")
    data = RunData(run_dir)
    metrics = run_dir / "metrics.jsonl"
    if metrics.exists():
        data.records = read_metrics(metrics)
    monitor = run_dir / "monitor"
    for host, path in node_logs(monitor, "top").items():
        data.top[host] = parse_top(path.read_text(errors="replace"))
    for host, path in node_logs(monitor, "dmon").items():
        data.dmon[host] = parse_dmon(path.read_text(errors="replace"))
    for path in sorted(monitor.glob("sstat_*.txt")) + sorted(monitor.glob("sacct_*.txt")):
        rows = parse_parsable(path.read_text(errors="replace"))
        if rows:
            data.job_stats[path.stem] = rows
    if not data.records and not data.top and not data.dmon:
        raise UserError(f"nothing to report in {run_dir}: no metrics.jsonl and no monitor logs",
                        "run training into this run dir first (monitor logs come from jobs run with "
                        "'hpctrain slurm submit').")
    return data


def _median(values: list) -> float:
    numbers = [v for v in values if isinstance(v, (int, float))]
    return statistics.median(numbers) if numbers else math.nan


def _mean(values: list[float]) -> float:
    values = [v for v in values if not math.isnan(v)]
    return statistics.fmean(values) if values else math.nan


def summary_facts(data: RunData) -> dict:
    """The numbers the summary states (also what the tests check)."""
    train = [r for r in data.records if r["split"] == "train"]
    val = [r for r in data.records if r["split"] == "val"]
    facts: dict = {"steps": train[-1]["step"] if train else 0}
    facts["samples_per_s_median"] = _median([r.get("samples_per_s") for r in train])
    # Over the log windows that have the number (gpu_busy: windows of training steps alone, loop.log_train).
    facts["gpu_busy_median"] = _median([r.get("gpu_busy") for r in train])
    facts["data_wait_median"] = _median([r.get("data_wait_frac") for r in train])
    facts["interruptions"] = interruptions(data.records)
    if val:
        facts["final_val"] = metric_values(val[-1])
    facts["cpu_busy_mean"] = {h: _mean(t.cpu_busy) for h, t in data.top.items()}
    facts["gpu_util_mean"] = {f"{h} gpu{g}": _mean(d.series(g, "sm")[1])
                              for h, d in data.dmon.items() for g in d.gpus() if "sm" in d.columns}
    facts["gpu_mem_bw_mean"] = {f"{h} gpu{g}": _mean(d.series(g, "mem")[1])
                                for h, d in data.dmon.items() for g in d.gpus() if "mem" in d.columns}
    return facts


def interruptions(records: list[dict]) -> list[str]:
    """Where the run was stopped (by a signal) and resumed, in step order, from metrics.jsonl's event records."""
    found = [(r["step"], 0, f"stopped by {r.get('signal', 'a signal')} at step {r['step']}")
             for r in events(records, "stop")]
    found += [(r["step"], 1, f"resumed at step {r['step']} from checkpoint {r.get('checkpoint', '?')} (saved by "
                             f"{r.get('saved_world_size', '?')} process(es), resumed on {r.get('world_size', '?')})")
              for r in events(records, "resume")]
    return [text for _, _, text in sorted(found)]


def observations(facts: dict) -> list[str]:
    """Plain-language reading of the numbers; the thresholds are rules of thumb, and say so."""
    notes = []
    gpu = {k: v for k, v in facts["gpu_util_mean"].items() if not math.isnan(v)}
    cpu = {k: v for k, v in facts["cpu_busy_mean"].items() if not math.isnan(v)}
    if gpu:
        low = {k: v for k, v in gpu.items() if v < 60}
        if low:
            cpu_high = [h for h, v in cpu.items() if v > 85]
            notes.append(
                f"GPU utilisation below 60% on {', '.join(sorted(low))}: the GPUs waited. "
                + ("The CPUs were busy too (" + ", ".join(cpu_high) + "): the data pipeline is the likely limit; "
                   "raise slurm.cpus_per_task and data.num_workers, or pre-resize the data into shards."
                   if cpu_high else "The CPUs were not saturated: look at the host's kernel launches (one core per "
                   "rank is enough to bound a step: gpu_busy in the training log), communication (hpctrain doctor, "
                   "larger micro batch or accumulation) or I/O.")
            )
        if max(gpu.values()) - min(gpu.values()) > 20:
            notes.append("GPU utilisation differs by more than 20 points between GPUs: a straggler or an uneven node.")
    elif cpu and math.isnan(facts.get("gpu_busy_median", math.nan)):
        notes.append("No GPU monitor logs (no nvidia-smi on the nodes, or monitors off): CPU figures only.")
    notes += busy_observations(facts)
    if cpu and max(cpu.values()) > 95:
        notes.append(f"CPU busy above 95% on {', '.join(h for h, v in cpu.items() if v > 95)}.")
    return notes


def busy_observations(facts: dict) -> list[str]:
    """From the training log's gpu_busy (NVML kernel time per log window, monitor/gpu_busy.py): host-bound or
    loader-bound, and what to try."""
    busy, wait = facts.get("gpu_busy_median", math.nan), facts.get("data_wait_median", math.nan)
    if math.isnan(busy) or busy >= HOST_BOUND:
        return []
    share = f"The GPUs ran kernels {busy:.0%} of the training time (NVML, median of the log windows)"
    if not math.isnan(wait) and wait >= LOADER_BOUND:
        return [f"{share}, and the ranks waited {wait:.0%} of it for batches: the data loader set the pace "
                "(more data.num_workers, pre-resized shards, or data.on_device=true)."]
    return [f"{share} while the loader kept up: the host (kernel launches, Python, autograd) set the pace. The "
            "training log's warning says what to try for the run's own step; in general: capture the step as a CUDA "
            "graph (train.step_mode=auto in one process, graphed over several GPUs), compile the model "
            "(train.compile=true), give each launch more work (a larger micro batch)."]


def _plot_overview(data: RunData, out: Path) -> Path:
    """Loss, throughput, CPU use per node (or the validation metrics), and GPU use when there is any to show: a CPU
    run's figure has no empty GPU panel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [lambda ax: plot_loss(ax, data.records), lambda ax: _throughput_panel(ax, data.records),
              lambda ax: _hosts_panel(ax, data)]
    gpu = _gpu_panel(data)
    if gpu is not None:
        panels.append(gpu)
    rows, cols = (2, 2) if len(panels) == 4 else (1, len(panels))
    fig, axes = plt.subplots(rows, cols, figsize=(12, 7.5) if rows == 2 else (15, 4.5), constrained_layout=True)
    for ax, draw in zip(axes.flat, panels):
        draw(ax)
    fig.suptitle(f"{data.run_dir.name}")
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def _throughput_panel(ax, records: list[dict]) -> None:
    x, y = series(records, "train", "samples_per_s")
    ax.plot(x, y, "-")
    mark_resumes(ax, records)
    ax.set(title="throughput (samples/s, all ranks)", xlabel="optimizer step")


def _hosts_panel(ax, data: RunData) -> None:
    if not data.top:  # a run without the job's node monitors (a local one): its validation metrics instead
        plot_val_metrics(ax, data.records)
        return
    for host, top in sorted(data.top.items()):
        ax.plot(top.seconds, top.cpu_busy, label=host)
    ax.set(title="CPU busy per node (%)", xlabel="seconds since the node's launcher started", ylim=(0, 105))
    ax.legend()


def _gpu_panel(data: RunData) -> Callable[[Any], None] | None:
    """The GPU panel's drawing: nvidia-smi's utilisation per GPU, else the training log's own NVML kernel time
    (gpu_busy); None without either (a CPU run)."""
    if data.dmon:
        return lambda ax: _dmon_panel(ax, data.dmon)
    x, y = series(data.records, "train", "gpu_busy")
    if not x:
        return None

    def busy(ax) -> None:
        ax.plot(x, [100 * v for v in y], "-", label="gpu_busy (mean of the ranks)")
        mark_resumes(ax, data.records)
        ax.set(title="GPU busy (% of time a kernel ran, NVML)", xlabel="optimizer step", ylim=(0, 105))
        ax.legend(fontsize="small")
    return busy


def _dmon_panel(ax, dmon: dict[str, DmonTable]) -> None:
    for host, table in sorted(dmon.items()):
        for gpu in table.gpus():
            t, v = table.series(gpu, "sm")
            ax.plot(t, v, label=f"{host} gpu{gpu}")
    ax.set(title="GPU utilisation (%)", xlabel="seconds", ylim=(0, 105))
    ax.legend(fontsize="small")


def plot_val_metrics(ax, records: list[dict]) -> None:
    """Every validation metric but the loss (accuracy, mIoU, ...; not per-class details) against the step."""
    names = sorted({k for r in records if r.get("split") == "val" for k, v in r.items()
                    if isinstance(v, (int, float)) and k not in ("step", "epoch", "time", "loss") and "/" not in k})
    for name in names:
        x, y = series(records, "val", name)
        ax.plot(x, y, "o-", label=name)
    mark_resumes(ax, records)
    ax.set(title="validation metrics" if names else "validation metrics: none logged", xlabel="optimizer step")
    if names:
        ax.legend()


def _plot_gpus(data: RunData, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 7.5), constrained_layout=True)
    for ax, (column, title) in zip(axes.flat, GPU_PANELS):
        for host, table in sorted(data.dmon.items()):
            for gpu in table.gpus():
                t, v = table.series(gpu, column)
                if t:
                    ax.plot(t, v, label=f"{host} gpu{gpu}")
        ax.set(title=title, xlabel="seconds")
        if ax.lines:
            ax.legend(fontsize="small")
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def _fmt(value: float, unit: str = "") -> str:
    return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.3g}{unit}"


def summary_markdown(data: RunData, facts: dict, pictures: list[str]) -> str:
    lines = [f"# Run report: {data.run_dir.name}", "", f"Run dir: `{data.run_dir}`", ""]
    lines += [f"- optimizer steps logged: {facts['steps']}",
              f"- throughput (median of the logged intervals): {_fmt(facts['samples_per_s_median'])} samples/s"]
    if facts["interruptions"]:  # the plots mark the resumes with dashed lines
        lines.append("- stops and resumes: " + "; ".join(facts["interruptions"]))
    details: dict[str, list[tuple[str, float]]] = {}
    if "final_val" in facts:
        top = {k: v for k, v in facts["final_val"].items() if "/" not in k}
        lines.append("- final validation: " + ", ".join(f"{k} {_fmt(v)}" for k, v in top.items()))
        for key, value in facts["final_val"].items():  # 'iou/skin': a table per group below
            group, slash, name = key.partition("/")
            if slash:
                details.setdefault(group, []).append((name, value))
    if facts["cpu_busy_mean"]:
        lines.append("- CPU busy (mean): " + ", ".join(f"{h} {_fmt(v, '%')}" for h, v in facts["cpu_busy_mean"].items()))
    if not math.isnan(facts["gpu_busy_median"]):
        lines.append(f"- GPU busy in training (NVML kernel time, median of the log windows, mean of the ranks): "
                     f"{facts['gpu_busy_median']:.0%}")
    if facts["gpu_util_mean"]:
        lines.append("- GPU utilisation (mean): "
                     + ", ".join(f"{g} {_fmt(v, '%')}" for g, v in facts["gpu_util_mean"].items()))
        lines.append("- GPU memory bandwidth utilisation (mean): "
                     + ", ".join(f"{g} {_fmt(v, '%')}" for g, v in facts["gpu_mem_bw_mean"].items()))
    notes = observations(facts)
    if notes:
        lines += ["", "## Observations", ""] + [f"- {n}" for n in notes]
    for group, items in details.items():
        lines += ["", f"## Final validation: {group}", "", f"| | {group} |", "|---|---:|"]
        lines += [f"| {name} | {_fmt(value)} |" for name, value in items]
    for name, rows in data.job_stats.items():
        lines += ["", f"## {name}", "", "| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
        lines += ["| " + " | ".join(r.values()) + " |" for r in rows]
    lines += [""] + [f"![{p}]({p})" for p in pictures]
    return "\n".join(lines) + "\n"


def summary_html(markdown: str, pictures: list[str]) -> str:
    """A self-contained page: the summary as preformatted text (no Markdown renderer needed) and the images."""
    body = "\n".join(line for line in markdown.splitlines() if not line.startswith("!["))
    images = "\n".join(f'<p><img src="{html.escape(p)}" style="max-width:100%"></p>' for p in pictures)
    return (f"<!doctype html>\n<meta charset='utf-8'><title>hpctrain report</title>\n"
            f"<pre style='font-size:14px'>{html.escape(body)}</pre>\n{images}\n")


def write_report(run_dir: Path) -> Path:
    data = load_run(run_dir)
    out = run_dir / "report"
    out.mkdir(exist_ok=True)
    pictures = [_plot_overview(data, out / "overview.png").name]
    if data.dmon:
        pictures.append(_plot_gpus(data, out / "gpu.png").name)
    facts = summary_facts(data)
    markdown = summary_markdown(data, facts, pictures)
    (out / "summary.md").write_text(markdown)
    (out / "index.html").write_text(summary_html(markdown, pictures))
    return out
