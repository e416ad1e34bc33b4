"""`hpctrain sample RUN_DIR`: the run's outputs drawn again from its checkpoint, the same pixels on 1 and 2
processes, and nothing written into the run dir (its checkpoints, its metrics) on the way."""

import hashlib
from pathlib import Path

import numpy as np
import pytest

from hpctrain.cli import main
from hpctrain.errors import UserError
from tests.conftest import TESTS, run_hpctrain
from tests.toy_experiment import LinearToy

pytestmark = [pytest.mark.dist, pytest.mark.timeout(240)]

CONFIG = TESTS.parent / "configs" / "ddpm_cifar10_tiny.toml"


def tree_digest(root: Path) -> dict[str, tuple[int, int, str]]:
    """Every file under root: (size, mtime_ns, sha256)."""
    return {
        str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
        for p in sorted(root.rglob("*")) if p.is_file()
    }


def pixels(path: Path) -> np.ndarray:
    from PIL import Image

    with Image.open(path) as image:
        image.verify()  # a valid PNG (verify leaves the image unusable: open again for the pixels)
    with Image.open(path) as image:
        assert image.format == "PNG"
        return np.asarray(image.convert("RGB"))


def test_samples_are_the_same_on_1_and_2_processes_and_the_run_dir_is_untouched(tmp_path):
    run_dir = tmp_path / "run"
    trained = run_hpctrain(["train", "ddpm_cifar10", "--config", str(CONFIG), f"run.dir={run_dir}",
                            "train.max_steps=10", "log.outputs_every_steps=0", "model.samples=8",
                            "log.tensorboard=false", "log.plots=false"], timeout=120)
    assert trained.returncode == 0, trained.output
    checkpoints = tree_digest(run_dir / "checkpoints")
    assert checkpoints
    metrics = (run_dir / "metrics.jsonl").read_bytes()

    a, b = tmp_path / "A", tmp_path / "B"
    one = run_hpctrain(["sample", str(run_dir), "--n", "6", "--ddim-steps", "5", "--out", str(a)], timeout=120)
    assert one.returncode == 0, one.output
    two = run_hpctrain(["sample", str(run_dir), "--n", "6", "--ddim-steps", "5", "--nproc-per-node", "2",
                        "--out", str(b)], timeout=120)
    assert two.returncode == 0, two.output

    for out, result in ((a, one), (b, two)):
        grid = out / "samples" / "step_0000010.png"
        assert grid.is_file(), result.output
        assert str(grid) in result.stdout.splitlines()  # the written paths are printed
    for tag in ("samples", "denoising"):
        left, right = pixels(a / tag / "step_0000010.png"), pixels(b / tag / "step_0000010.png")
        assert left.shape == right.shape and np.array_equal(left, right), tag
    # 6 samples of 16 x 16 in a 3 x 2 grid with 2-pixel padding (not the run's model.samples=8).
    assert pixels(a / "samples" / "step_0000010.png").shape == (2 + 2 * 18, 2 + 3 * 18, 3)

    assert tree_digest(run_dir / "checkpoints") == checkpoints
    assert (run_dir / "metrics.jsonl").read_bytes() == metrics
    assert not (run_dir / "samples").exists()


def test_sample_refuses_bad_run_dirs(tmp_path, capsys):
    assert main(["sample", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err

    no_outputs = tmp_path / "digits"
    no_outputs.mkdir()
    (no_outputs / "config.toml").write_text('experiment = "digits"\n')
    assert main(["sample", str(no_outputs), "--n", "4"]) == 2
    err = capsys.readouterr().err
    assert "has no outputs to draw" in err and "Traceback" not in err
    assert sorted(p.name for p in no_outputs.iterdir()) == ["config.toml"]


def test_sampling_flags_need_sampling_options():
    from hpctrain.resolution import check_can_sample

    class DrawsWithoutOptions(LinearToy):
        def outputs(self, model, out):
            pass

    check_can_sample(DrawsWithoutOptions, ("run.seed=1",))
    with pytest.raises(UserError, match="has no sampling options: --ddim-steps \\(model.sample_steps\\)"):
        check_can_sample(DrawsWithoutOptions, ("model.sample_steps=5",))


def test_out_dir_must_not_be_the_runs_own_folders_or_a_file(tmp_path):
    from hpctrain.train.sampling import check_out_dir

    run = tmp_path / "run"
    (run / "images").mkdir(parents=True)
    for bad in (run / "checkpoints", run / "images" / "samples"):
        with pytest.raises(UserError, match="written by training"):
            check_out_dir(bad, run)
    (tmp_path / "file.png").write_bytes(b"x")
    with pytest.raises(UserError, match="is a file"):
        check_out_dir(tmp_path / "file.png", run)
    check_out_dir(run / "samples", run)  # the default is fine
