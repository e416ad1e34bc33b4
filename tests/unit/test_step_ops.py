"""benchmarks/step_ops.py on the smoke U-Net: the host's operators per optimizer step in each mode, counted for real
(below autograd, so the backward is in), and a graphed step's host work a small fraction of the eager step's."""

from __future__ import annotations

import pytest

from tests.conftest import benchmark_module


@pytest.fixture(scope="module")
def bench():
    with benchmark_module("step_ops") as module:
        yield module


@pytest.mark.timeout(120)
def test_counts_per_mode_on_the_smoke_unet(bench, tmp_path, capsys):
    results = bench.main(["--smoke", "--json", str(tmp_path / "ops.json")])
    eager, nchw, graphed = results["eager"], results["eager-nchw"], results["graphed"]
    ops = dict(eager["top"])
    assert eager["launching"] > 300 and eager["copies"] > 0
    # The graph holds the eager step's arithmetic (without cutting the batch from the data; with the non-finite
    # check and the EMA's tensor weight): about as many operators.
    assert 0.8 * eager["launching"] < graphed["in_graph"] < 1.2 * eager["launching"]
    # Per replay the host copies the batch, the draws and the learning rates in, and launches the graph.
    assert graphed["launching"] < eager["launching"] / 10 and graphed["graph_launches"] == 1
    assert nchw["ops"] != eager["ops"]
    # The EMA's update is a few foreach operators, not one per tensor (it detached each one every step).
    without_ema = bench.count_step("eager", 2, True, 1, extra=("optim.ema_decay=0",))
    assert eager["ops"] - without_ema["ops"] < 10
    assert eager["counts"]["detach"] == without_ema["counts"]["detach"]
    table = capsys.readouterr().out
    assert "| graphed, host per replay |" in table and "(1 launch)" in table


def test_the_counter_sees_the_backward_and_counts_views_apart(bench):
    import torch

    x = torch.randn(4, 3, requires_grad=True)
    with bench.OpCounter() as counter:
        (x.t() @ x).sum().backward()
    names = set(counter.ops)
    assert {"t", "mm", "sum"} <= names and "expand" in names  # sum's backward expands the gradient
    assert counter.views >= 2 and counter.summary()["launching"] == sum(counter.ops.values()) - counter.views


def test_profiled_launches_count_a_foreach_once_and_skip_what_launches_nothing(bench):
    import types

    def ev(name, *children):
        return types.SimpleNamespace(name=name, cpu_children=list(children))

    step = ev("step", ev("aten::_foreach_lerp_", ev("aten::lerp_"), ev("aten::lerp_")),
              ev("aten::to", ev("aten::_to_copy", ev("aten::empty_strided"), ev("aten::copy_"))),
              ev("aten::to"), ev("graph_0_cpp_fused_add_0"))
    assert bench.launches(step) == ["aten::_foreach_lerp_", "aten::copy_", "graph_0_cpp_fused_add_0"]
