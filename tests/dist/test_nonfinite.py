"""A run that diverges (a learning rate far too high) on 2 CPU processes: its non-finite steps are skipped and listed,
and when more than train.max_skipped_steps come in a row every rank stops at the same step with the reason, also
when a stop and a resume fall inside that run of skips (the checkpoint holds the count). Hard timeouts."""

from pathlib import Path

import pytest

from tests.conftest import read_jsonl, run_hpctrain

pytestmark = [pytest.mark.dist, pytest.mark.timeout(400)]

LIMIT = 4
DIVERGING = ["model.width=8", "model.norm=group", "train.global_batch_size=40", "train.micro_batch_size=10",
             "log.every_steps=1", "log.plots=false", "log.tensorboard=false", "optim.lr=1e8", "optim.warmup_steps=0",
             "train.max_steps=40", f"train.max_skipped_steps={LIMIT}", "eval.every_steps=100"]


def train(run_dir: Path, *extra: str):
    return run_hpctrain(["train", "digits", f"run.dir={run_dir}", "--nproc-per-node=2", *DIVERGING, *extra], 180)


def test_a_diverged_run_skips_lists_and_stops_on_every_rank_across_a_resume(tmp_path: Path):
    first = train(tmp_path, "train.stop_at_step=4")
    assert first.returncode == 0, first.output
    skipped = [s for r in read_jsonl(tmp_path / "metrics.jsonl") if r["split"] == "train" for s in r.get("skipped_at", [])]
    start = skipped[0] if skipped else 0
    # The stop fell inside the run of skips: steps start..4, fewer than the limit.
    assert 1 <= start <= 4 and skipped == list(range(start, 5)), first.output
    second = train(tmp_path)
    assert second.returncode != 0, second.output
    last = start + LIMIT
    # Counted on from the checkpoint: the uninterrupted run's step, not LIMIT + 1 steps after the resume.
    assert f"{LIMIT + 1} optimizer steps in a row (steps {start}-{last}) had a non-finite gradient" in second.output
    assert f"more than train.max_skipped_steps={LIMIT}" in second.output and "optim.lr" in second.output
    records = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if r["split"] == "train"]
    assert max(r["step"] for r in records) < last  # stopped there, on both ranks (no hang: the hard timeout)


# ---- zero1 with a rank that holds no parameters ------------------------------------------------------------------

def _zero1_worker(rank: int, tmp: Path, fused: bool) -> None:
    """Five steps (gradients NaN at steps 1 and 3, set alike on both ranks as DDP's all-reduce leaves them) of a
    one-tensor model under ZeroRedundancyOptimizer with torch's fused AdamW (a GPU's; it runs on the CPU too): one
    rank holds the parameter, the other none and keeps an empty optimizer state. Not fused: the CPU's foreach AdamW,
    decided on the host."""
    import datetime
    import json
    import math
    import traceback
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.optim.lr_scheduler import LambdaLR

    from hpctrain.train.ema import EMA
    from hpctrain.train.state import TrainState
    from hpctrain.train.step import EagerStep

    report: dict = {}
    dist.init_process_group("gloo", init_method=f"file://{tmp / 'store'}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))  # a rank left waiting fails after 60 s
    try:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1, bias=False)
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=0.1,
                                      fused=fused or None)
        report["holds"] = sum(len(g["params"]) for g in opt.optim.param_groups)
        ctx = SimpleNamespace(
            cfg=SimpleNamespace(train=SimpleNamespace(grad_clip=0.0, max_skipped_steps=5)), optimizer=opt,
            raw_model=model, scaler=torch.amp.GradScaler("cpu", enabled=False), scheduler=LambdaLR(opt, lambda s: 1.0),
            ema=EMA(model, 0.5), state=TrainState(), runtime=SimpleNamespace(is_main=rank == 0))
        calls, step = [], opt.step  # after the scheduler, which wraps step() itself
        opt.step = lambda *a, **k: calls.append(1) or step(*a, **k)  # step() broadcasts from every rank
        stepper = EagerStep()
        for n, grad in enumerate((1.0, math.nan, 2.0, math.nan, 3.0)):
            model.weight.grad = torch.full_like(model.weight, grad)
            stepper.finish(ctx, n)
            ctx.state.step += 1
        report |= {"step_calls": len(calls), "skipped_at": ctx.state.skipped_at, "weight": model.weight.tolist(),
                   "ema": ctx.ema.module.weight.tolist()}
        everyone = [None, None]
        dist.all_gather_object(everyone, report)  # ends with every rank here: no collective left unmatched
    except BaseException:
        report["crash"] = traceback.format_exc()
    finally:
        (tmp / f"zero1_rank{rank}.json").write_text(json.dumps(report))
        dist.destroy_process_group()


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "foreach"])
def test_zero1_skips_a_non_finite_step_alike_on_a_rank_that_holds_no_parameters(tmp_path: Path, fused: bool):
    """The device-flag path is chosen from what every rank shares: a rank with no parameters (an empty optimizer
    state) must call ZeroRedundancyOptimizer.step() (its broadcasts) on a skipped step as the others do, or the
    rank that holds the parameter waits for it: a hang at 512 ranks, here a gloo timeout. On the host path (the
    CPU's optimizers) every rank leaves step() out of a skipped step alike."""
    import json

    import torch.multiprocessing as mp

    procs = mp.start_processes(_zero1_worker, args=(tmp_path, fused), nprocs=2, join=False, start_method="spawn")
    try:
        for _ in range(240):
            if procs.join(timeout=1):
                break
        else:
            pytest.fail("the 2 ranks did not finish within 240 s: a rank was left waiting in a collective")
    finally:
        for p in procs.processes:
            if p.is_alive():
                p.kill()
    reports = [json.loads((tmp_path / f"zero1_rank{r}.json").read_text()) for r in range(2)]
    for r in reports:
        assert "crash" not in r, r["crash"]
    assert sorted(r["holds"] for r in reports) == [0, 1]  # the case: one rank has nothing to step
    # The first step is decided on the host (fused SGD's first step must not be skipped on the device); from the
    # first applied step on, every rank steps with the flag, and the skipped steps are the same on both.
    calls = 5 if fused else 3  # foreach: the two skipped steps call step() on no rank
    assert [r["step_calls"] for r in reports] == [calls, calls]
    assert reports[0]["skipped_at"] == reports[1]["skipped_at"] == [2, 4]
    assert reports[0]["weight"] == reports[1]["weight"] and reports[0]["ema"] == reports[1]["ema"]
