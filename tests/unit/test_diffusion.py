import math

import pytest
import torch

from hpctrain.experiments.ddpm.diffusion import GaussianDiffusion


def oracle(diffusion: GaussianDiffusion, x0: torch.Tensor):
    """A perfect epsilon model for a known x0: the noise that puts x0 at x_t."""
    def model(x_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return diffusion.predict_eps(x_t, t, x0)
    return model


def full(t: int, n: int) -> torch.Tensor:
    return torch.full((n,), t, dtype=torch.long)


def test_schedule_endpoints_length_and_cumulative_product():
    d = GaussianDiffusion()
    assert len(d.betas) == 1000 and d.betas.dtype == torch.float64
    assert d.betas[0].item() == pytest.approx(1e-4) and d.betas[-1].item() == pytest.approx(0.02)
    running, expected = 1.0, []
    for beta in d.betas.tolist():
        running *= 1.0 - beta
        expected.append(running)
    assert torch.allclose(d.alphas_cumprod, torch.tensor(expected, dtype=torch.float64), rtol=1e-12)
    assert d.alphas_cumprod_prev[0] == 1.0 and torch.equal(d.alphas_cumprod_prev[1:], d.alphas_cumprod[:-1])


def test_variance_choices():
    large, small = GaussianDiffusion(variance="large"), GaussianDiffusion(variance="small")
    assert torch.allclose(large.model_log_variance[1:], large.betas[1:].log())
    assert large.model_log_variance[0] == small.posterior_variance[1].log()
    assert torch.equal(small.model_log_variance, small.posterior_log_variance_clipped)
    with pytest.raises(ValueError):
        GaussianDiffusion(variance="medium")


def test_q_sample_matches_the_iterated_forward_chain_in_distribution():
    d, n, t = GaussianDiffusion(timesteps=100, beta_end=0.05), 20_000, 60
    gen = torch.Generator().manual_seed(0)
    x0 = torch.full((n,), 0.7, dtype=torch.float64)
    x = x0.clone()
    for s in range(t + 1):  # x_s = sqrt(1 - beta_s) x_{s-1} + sqrt(beta_s) eps_s, s = 0 .. t
        x = (1 - d.betas[s]).sqrt() * x + d.betas[s].sqrt() * torch.randn(n, generator=gen, dtype=torch.float64)
    closed = d.q_sample(x0, full(t, n), torch.randn(n, generator=gen, dtype=torch.float64))
    mean, var = d.sqrt_alphas_cumprod[t] * 0.7, 1 - d.alphas_cumprod[t]
    for samples in (x, closed):  # both within ~4 standard errors of the analytic moments
        assert abs(samples.mean() - mean) < 4 * math.sqrt(var / n)
        assert abs(samples.var() - var) < 4 * var * math.sqrt(2 / n)


def test_posterior_matches_bayes_rule():
    d = GaussianDiffusion()
    x0, x_t = torch.tensor([0.3, -0.8], dtype=torch.float64), torch.tensor([1.1, 0.2], dtype=torch.float64)
    for t in (1, 10, 500, 999):
        # prior x_{t-1} ~ N(sqrt(ab_{t-1}) x0, 1 - ab_{t-1}); likelihood x_t ~ N(sqrt(alpha_t) x_{t-1}, beta_t)
        ab_prev, alpha, beta = d.alphas_cumprod[t - 1], d.alphas[t], d.betas[t]
        precision = 1 / (1 - ab_prev) + alpha / beta
        mean = (ab_prev.sqrt() * x0 / (1 - ab_prev) + alpha.sqrt() * x_t / beta) / precision
        got_mean, got_var, got_log_var = d.q_posterior(x0, x_t, full(t, 2))
        assert torch.allclose(got_mean, mean, rtol=1e-9)
        assert torch.allclose(got_var, (1 / precision).expand(2), rtol=1e-9)
        assert torch.allclose(got_log_var, got_var.log())


def test_predict_x0_inverts_q_sample():
    d = GaussianDiffusion()
    x0, noise = torch.rand(4, 1, 5, 5, dtype=torch.float64) * 2 - 1, torch.randn(4, 1, 5, 5, dtype=torch.float64)
    t = torch.tensor([0, 5, 500, 999])
    assert torch.allclose(d.predict_x0(d.q_sample(x0, t, noise), t, noise), x0, atol=1e-10)


def test_extract_casts_and_broadcasts():
    d = GaussianDiffusion()
    x = torch.zeros(3, 2, 4, 4, dtype=torch.float32)
    out = d._extract("betas", torch.tensor([0, 1, 999]), x)
    assert out.shape == (3, 1, 1, 1) and out.dtype == torch.float32
    assert out[2].item() == pytest.approx(0.02)


def test_training_losses_is_per_sample_mse_in_float32():
    d = GaussianDiffusion()
    x0, noise = torch.randn(3, 1, 4, 4), torch.randn(3, 1, 4, 4)
    t = torch.tensor([0, 100, 999])
    losses = d.training_losses(lambda x_t, t: torch.zeros_like(x_t).half(), x0, t, noise)
    assert losses.shape == (3,) and losses.dtype == torch.float32
    assert torch.allclose(losses, noise.square().mean(dim=(1, 2, 3)))
    assert torch.allclose(d.training_losses(oracle(d, x0), x0, t, noise), torch.zeros(3), atol=1e-8)


def test_ddim_eta0_with_an_oracle_recovers_x0_exactly():
    d = GaussianDiffusion()
    x0 = torch.rand(2, 1, 4, 4, dtype=torch.float64) * 2 - 1
    x = d.q_sample(x0, full(999, 2), torch.randn_like(x0))
    step = d.ddim_step(oracle(d, x0), x, 999, -1, 0.0, None)
    assert torch.allclose(step, x0, atol=1e-9)
    out, _ = d.sample(oracle(d, x0), x, lambda i, s: pytest.fail("eta=0 must not draw noise"), steps=10)
    assert torch.allclose(out, x0, atol=1e-9)


def test_ddim_eta1_over_all_steps_is_ancestral_sampling_with_the_small_variance():
    d = GaussianDiffusion(timesteps=50, variance="small")
    x0, x, z = (torch.randn(2, 3, dtype=torch.float64) for _ in range(3))
    for t in (49, 20, 1):
        assert torch.allclose(d.ddim_step(oracle(d, x0), x, t, t - 1, 1.0, z), d.p_sample(oracle(d, x0), x, t, z))


def test_ancestral_sampling_with_an_oracle_ends_at_x0():
    d = GaussianDiffusion(timesteps=50)
    x0 = torch.rand(8, 1, 4, 4) * 2 - 1
    gen = torch.Generator().manual_seed(1)
    out, kept = d.sample(oracle(d, x0), torch.randn(8, 1, 4, 4, generator=gen),
                         lambda i, shape: torch.randn(shape, generator=gen), record=(49, 25, 0, -1))
    assert torch.allclose(out, x0, atol=1e-4)
    assert list(kept) == [49, 25, 0, -1]
    assert (kept[25] - x0).abs().mean() > (kept[0] - x0).abs().mean()  # closer to x0 as t falls


def test_ddim_timesteps():
    d = GaussianDiffusion()
    assert d.ddim_timesteps(1) == [999]
    assert d.ddim_timesteps(4) == [999, 666, 333, 0]
    assert d.ddim_timesteps(1000) == list(range(999, -1, -1))
    for steps in (2, 7, 50, 250, 999):
        ts = d.ddim_timesteps(steps)
        assert len(set(ts)) == steps and ts[0] == 999 and ts[-1] == 0 and ts == sorted(ts, reverse=True)
    for bad in (0, -3, 1001):
        with pytest.raises(ValueError, match=r"\[1, 1000\]"):
            d.ddim_timesteps(bad)


def test_sample_shapes_range_records_noise_calls_and_progress():
    d = GaussianDiffusion(timesteps=20)
    x_T = torch.randn(3, 1, 8, 8)
    calls, beats = [], []

    def noise_fn(i, shape):
        calls.append((i, tuple(shape)))
        return torch.randn(shape)

    def model(x, t):
        assert t.shape == (3,) and t.dtype == torch.long
        return torch.randn_like(x) * 3

    out, kept = d.sample(model, x_T, noise_fn, record=(19, 7, -1), progress=lambda k, n: beats.append((k, n)))
    assert out.shape == x_T.shape and torch.isfinite(out).all() and out.abs().max() <= 1
    assert list(kept) == [19, 7, -1] and torch.equal(kept[19], x_T) and torch.equal(kept[-1], out)
    assert calls == [(i, (3, 1, 8, 8)) for i in range(19)]  # no noise at the last step (t = 0)
    assert beats == [(k, 20) for k in range(1, 21)]

    calls.clear()
    out, kept = d.sample(model, x_T, noise_fn, steps=5, eta=0.5, record=(18, 9, 3))
    assert d.ddim_timesteps(5) == [19, 14, 10, 5, 0]
    assert list(kept) == [19, 10, 5]  # 18 -> 19, 9 -> 10, 3 -> 5 (nearest visited)
    assert [i for i, _ in calls] == [0, 1, 2, 3] and out.abs().max() <= 1

    with pytest.raises(ValueError):
        d.sample(model, x_T, noise_fn, record=(20,))
