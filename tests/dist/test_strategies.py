"""dist.strategy with real processes: ddp, zero1 and fsdp train the same run (same losses), and validation under
fsdp, where every forward is a collective and the ranks' shares of the set differ, gives the exact metrics."""

import json
from pathlib import Path

import pytest

from tests.conftest import read_jsonl, run_hpctrain, train_losses

pytestmark = [pytest.mark.dist, pytest.mark.timeout(400)]

# fp32 on the CPU, GroupNorm (no batch-dependent layers), accumulation 2 (micro 10 x 2 ranks x 2), clipping that
# binds (the norm is ~2-4) and EMA: each strategy's own path for no_sync, the global norm and the EMA update.
# eval.micro_batch_size=150: 3 validation batches (150, 150, 97) for 2 ranks, so one rank runs a padding batch.
# channels_last: FSDP2 refuses non-contiguous (channels_last) weights; under fsdp they stay contiguous.
RUN = ["model.width=8", "model.norm=group", "train.global_batch_size=40", "train.micro_batch_size=10",
       "train.max_steps=20", "log.every_steps=1", "log.plots=false", "log.tensorboard=false", "optim.lr=1e-3",
       "optim.warmup_steps=0", "train.grad_clip=1.0", "optim.ema_decay=0.9", "eval.every_steps=10",
       "eval.micro_batch_size=150", "train.channels_last=true"]


# fsdp_zero2: parameters stay gathered between forward and backward (dist.fsdp_reshard_after_forward=false); the
# validations at steps 10 and 20 run forwards without a backward, which must not leave them gathered for the EMA
# update, the next step or the checkpoint.
STRATEGIES = {"ddp": ["dist.strategy=ddp"], "zero1": ["dist.strategy=zero1"], "fsdp": ["dist.strategy=fsdp"],
              "fsdp_zero2": ["dist.strategy=fsdp", "dist.fsdp_reshard_after_forward=false"]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    out = {}
    for strategy, options in STRATEGIES.items():
        run_dir = tmp_path_factory.mktemp(strategy)
        result = run_hpctrain(["train", "digits", f"run.dir={run_dir}", "--nproc-per-node=2", *RUN, *options], 200)
        assert result.returncode == 0, result.output
        assert "micro 10 x 2 ranks x 2 accumulation" in result.stderr
        out[strategy] = run_dir
    return out


@pytest.mark.parametrize("strategy", ["zero1", "fsdp", "fsdp_zero2"])
def test_the_same_run_gives_the_same_losses_under_every_strategy(runs: dict[str, Path], strategy: str):
    want, got = train_losses(runs["ddp"]), train_losses(runs[strategy])
    assert sorted(got) == sorted(want) == list(range(1, 21))
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=1e-5), step
    assert want[20] < want[1] - 0.1  # the losses move, or agreeing would prove nothing
    norms = {r["step"]: r["grad_norm"] for r in read_jsonl(runs[strategy] / "metrics.jsonl") if "grad_norm" in r}
    ddp_norms = {r["step"]: r["grad_norm"] for r in read_jsonl(runs["ddp"] / "metrics.jsonl") if "grad_norm" in r}
    assert norms.keys() == ddp_norms.keys() and len(norms) == 20
    assert max(ddp_norms.values()) > 1.0  # clipping binds at least once
    for step in ddp_norms:  # the global norm, not a shard's
        assert norms[step] == pytest.approx(ddp_norms[step], rel=1e-4), step


def validations(run_dir: Path) -> dict[int, dict]:
    return {r["step"]: r for r in read_jsonl(run_dir / "metrics.jsonl") if r["split"] == "val"}


def test_validation_under_fsdp_with_uneven_shares_is_exact(runs: dict[str, Path]):
    """The fsdp run's validation (EMA weights, 2 ranks, one of them padding) against `hpctrain eval` of its own
    checkpoint on 3 plain processes (another split of the set, no padding, no sharding)."""
    fsdp = validations(runs["fsdp"])
    assert sorted(fsdp) == [10, 20]
    result = run_hpctrain(["eval", "digits", f"run.dir={runs['fsdp']}", "--nproc-per-node=3", *RUN], 200)
    assert result.returncode == 0, result.output
    printed = json.loads(result.stdout.strip().splitlines()[-1])
    assert printed["step"] == 20
    assert printed["accuracy"] == fsdp[20]["accuracy"]  # counts: exact
    assert printed["loss"] == pytest.approx(fsdp[20]["loss"], rel=1e-6)  # thread counts move the last bits
    # And the same numbers as ddp's run, whose weights agree to ~1e-7.
    ddp = validations(runs["ddp"])
    assert ddp[20]["accuracy"] == fsdp[20]["accuracy"]
    assert ddp[20]["loss"] == pytest.approx(fsdp[20]["loss"], rel=1e-4)
    zero2 = validations(runs["fsdp_zero2"])  # its gathered-after-validation parameters were resharded each time
    for step in (10, 20):
        assert zero2[step]["accuracy"] == fsdp[step]["accuracy"]
        assert zero2[step]["loss"] == pytest.approx(fsdp[step]["loss"], rel=1e-5)
