"""`hpctrain export`: the model card's text, the safetensors file holding the EMA weights, and bad input."""

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from hpctrain.cli import main
from hpctrain.config import config_to_toml
from hpctrain.commands.export import export_run
from hpctrain.export import ModelCard, render_model_card
from hpctrain.resolution import resolve_config
from tests.conftest import write_dcp_checkpoint

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "ddpm_cifar10_tiny.toml"

CARD = ModelCard(
    experiment="ddpm_cifar10", run_name="ddpm-tiny", parameters=1234567, checkpoint="step_00000040", step=40,
    epoch=5, step_in_epoch=0, samples_seen=640, global_batch_size=16, ema_decay=0.99, val_step=40,
    val={"loss_t0": 1.00816724, "loss": 0.971554786}, sample_image="samples.png",
)

EXPECTED = """\
# ddpm-tiny

Weights of an hpctrain run of the experiment `ddpm_cifar10`, exported from checkpoint `step_00000040`.

| | |
|---|---|
| experiment | `ddpm_cifar10` |
| parameters | 1,234,567 |
| training | 40 steps (5 epochs), global batch 16, 640 samples seen |
| weights | EMA of the training weights (decay 0.99) |

## Validation (step 40)

| metric | value |
|---|---|
| loss | 0.9716 |
| loss_t0 | 1.008 |

## Samples

![samples](samples.png)

## Load

`model.safetensors` holds the model's state dict; `config.toml` the run's config. In this directory:

```python
from safetensors.torch import load_file
from hpctrain import resolve_config
cls, cfg = resolve_config("ddpm_cifar10", "config.toml")
model = cls(cfg).build_model()
model.load_state_dict(load_file("model.safetensors"))
```
"""


def test_model_card_text():
    assert render_model_card(CARD) == EXPECTED


def test_model_card_without_validation_ema_or_samples():
    from dataclasses import replace

    text = render_model_card(replace(CARD, val_step=None, val={}, sample_image="", ema_decay=0.0, epoch=1,
                                     step_in_epoch=3))
    assert "## Validation\n\nNo validation metrics were logged.\n" in text
    assert "## Samples" not in text and "samples.png" not in text
    assert "| weights | the training weights (no EMA) |" in text
    assert "40 steps (1 epoch and 3 steps)" in text


def fake_run(run_dir: Path, ema: bool = True) -> dict[str, torch.Tensor]:
    """A run dir as training leaves it (config.toml, one checkpoint, metrics, a sample grid), with EMA weights
    that differ from the model's; returns the weights an export must ship."""
    cls, cfg = resolve_config("ddpm_cifar10", str(CONFIG), (f"run.dir={run_dir}",))
    run_dir.mkdir(parents=True)
    text = config_to_toml(cfg)
    (run_dir / "config.toml").write_text(text)
    torch.manual_seed(0)
    model = cls(cfg).build_model().state_dict()
    shipped = {k: (v + 0.5 if v.is_floating_point() else v.clone()) for k, v in model.items()}
    files = {"config.toml": text,
             "state.json": json.dumps({"step": 7, "epoch": 1, "step_in_epoch": 2, "samples_seen": 112,
                                       "global_batch_size": 16, "world_size": 1})}
    parts = {"model": model, **({"ema": shipped} if ema else {})}
    write_dcp_checkpoint(run_dir / "checkpoints", 7, parts, files, {"experiment": "ddpm_cifar10", "epoch": 1,
                                                                    "world_size": 1})
    with open(run_dir / "metrics.jsonl", "w") as f:
        for step, loss in ((5, 1.5), (7, 0.25), (9, 0.125)):  # step 9: after the exported checkpoint
            f.write(json.dumps({"step": step, "split": "val", "epoch": 1, "time": 1.0, "loss": loss}) + "\n")
        f.write(json.dumps({"step": 7, "split": "train", "loss": 9.0}) + "\n")
    (run_dir / "images" / "samples").mkdir(parents=True)
    (run_dir / "images" / "samples" / "step_0000007.png").write_bytes(b"\x89PNG grid")
    return shipped if ema else model


def test_export_ships_the_ema_weights_and_they_load_into_a_fresh_model(tmp_path, monkeypatch):
    from safetensors.torch import load_file

    run_dir = tmp_path / "run"
    shipped = fake_run(run_dir)
    written = export_run(run_dir)
    out = run_dir / "export"
    assert [p.name for p in written] == ["README.md", "config.toml", "model.safetensors", "samples.png"]

    tensors = load_file(str(out / "model.safetensors"))
    assert tensors.keys() == shipped.keys()
    assert all(t.device.type == "cpu" and t.is_contiguous() for t in tensors.values())
    assert all(torch.equal(tensors[k], shipped[k]) for k in shipped)
    assert (out / "config.toml").read_bytes() == (run_dir / "config.toml").read_bytes()
    assert (out / "samples.png").read_bytes() == b"\x89PNG grid"

    card = (out / "README.md").read_text()
    assert "7 steps (1 epoch and 2 steps), global batch 16, 112 samples seen" in card
    assert "## Validation (step 7)" in card and "| loss | 0.25 |" in card
    assert "EMA of the training weights (decay 0.99)" in card and "![samples](samples.png)" in card
    cls, cfg = resolve_config("ddpm_cifar10", str(CONFIG), ())
    params = sum(p.numel() for p in cls(cfg).build_model().parameters())
    assert f"| parameters | {params:,} |" in card

    # The card's snippet, run in the export directory, builds the model with the EMA weights.
    snippet = re.search(r"```python\n(.*?)```", card, re.S).group(1)
    monkeypatch.chdir(out)
    scope: dict = {}
    exec(snippet, scope)
    fresh = scope["model"].state_dict()
    assert all(torch.equal(fresh[k], shipped[k]) for k in shipped)

    # A card exported by an earlier version (it imported hpctrain.train.entry) still loads after the upgrade.
    old = snippet.replace("from hpctrain import resolve_config", "from hpctrain.train.entry import resolve")
    old = old.replace('resolve_config("ddpm_cifar10", "config.toml")', 'resolve("ddpm_cifar10", "config.toml", ())')
    assert "hpctrain.train.entry" in old and "resolve_config" not in old
    scope = {}
    exec(old, scope)
    assert all(torch.equal(scope["model"].state_dict()[k], shipped[k]) for k in shipped)

    # Again: the earlier export is replaced whole, nothing left beside it.
    export_run(run_dir)
    assert sorted(p.name for p in run_dir.iterdir()) == ["checkpoints", "config.toml", "export", "images",
                                                         "metrics.jsonl"]


def test_export_without_ema_ships_the_model_weights(tmp_path):
    from safetensors.torch import load_file

    run_dir = tmp_path / "run"
    model = fake_run(run_dir, ema=False)
    export_run(run_dir, tmp_path / "hub")
    tensors = load_file(str(tmp_path / "hub" / "model.safetensors"))
    assert all(torch.equal(tensors[k], model[k]) for k in model)
    assert "the training weights (no EMA)" in (tmp_path / "hub" / "README.md").read_text()


@pytest.mark.parametrize("case", ["missing", "no_config", "no_checkpoint", "out_not_export"])
def test_bad_run_dir_is_a_message_and_writes_nothing(tmp_path, capsys, case):
    run_dir = tmp_path / "run"
    args = ["export", str(run_dir)]
    if case == "no_config":
        run_dir.mkdir()
    elif case == "no_checkpoint":
        fake_run(run_dir)
        shutil.rmtree(run_dir / "checkpoints")
    elif case == "out_not_export":
        fake_run(run_dir)
        (tmp_path / "busy").mkdir()
        (tmp_path / "busy" / "notes.txt").write_text("mine")
        args += ["--out", str(tmp_path / "busy")]
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("hpctrain: error: ") and "Traceback" not in err
    assert {"missing": "does not exist", "no_config": "has no config.toml", "no_checkpoint": "no checkpoint in",
            "out_not_export": "holds no previous export"}[case] in err
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before
