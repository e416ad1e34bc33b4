"""The diffusion process of DDPM (Ho et al., 2020), kept apart from the network as in improved-diffusion's
``gaussian_diffusion.py``: the noise schedule, the training loss, ancestral and DDIM sampling.

Timesteps are 0-indexed, t = 0 .. T-1, as in improved-diffusion: x_t is the sample at noise level
alpha_bar_t, the pure-noise input x_T of sampling is treated as x_{T-1}, and a step at t = 0 gives the
clean sample (written x_{-1} below only where an index is needed, e.g. ``record`` key -1).
All images are in [-1, 1] space. ``model(x_t, t)`` predicts epsilon; t is a (B,) long tensor."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Literal

import torch
from torch import Tensor

Model = Callable[[Tensor, Tensor], Tensor]
NoiseFn = Callable[[int, torch.Size], Tensor]

_TABLES = ("betas", "alphas", "alphas_cumprod", "alphas_cumprod_prev", "sqrt_alphas_cumprod",
           "sqrt_one_minus_alphas_cumprod", "sqrt_recip_alphas_cumprod", "sqrt_recipm1_alphas_cumprod",
           "posterior_variance", "posterior_log_variance_clipped", "posterior_mean_coef1",
           "posterior_mean_coef2", "model_log_variance")


class GaussianDiffusion:
    """Linear beta schedule, epsilon prediction, fixed (not learned) reverse variance.

    ``variance="large"``: sigma_t^2 = beta_t (Ho et al.'s choice for CIFAR-10), except sigma_0^2 =
    beta_tilde_1 as in improved-diffusion (beta_0 would be a needlessly small log-variance; no noise is
    added at t = 0 anyway). ``variance="small"``: sigma_t^2 = beta_tilde_t, the posterior variance."""

    def __init__(self, timesteps: int = 1000, beta_start: float = 1e-4, beta_end: float = 0.02,
                 variance: Literal["small", "large"] = "large") -> None:
        if timesteps < 2:
            raise ValueError(f"timesteps must be at least 2, got {timesteps}")
        if not 0 < beta_start <= beta_end < 1:
            raise ValueError(f"need 0 < beta_start <= beta_end < 1, got {beta_start}, {beta_end}")
        if variance not in ("small", "large"):
            raise ValueError(f"variance must be 'small' or 'large', got {variance!r}")
        self.num_timesteps, self.variance = timesteps, variance
        # float64 on the CPU: the products over 1000 steps lose digits in float32.
        betas = torch.linspace(beta_start, beta_end, timesteps, dtype=torch.float64)
        self.betas = betas
        self.alphas = 1.0 - betas
        self.alphas_cumprod = torch.cumprod(self.alphas, dim=0)
        self.alphas_cumprod_prev = torch.cat([torch.ones(1, dtype=torch.float64), self.alphas_cumprod[:-1]])
        self.sqrt_alphas_cumprod = self.alphas_cumprod.sqrt()
        self.sqrt_one_minus_alphas_cumprod = (1.0 - self.alphas_cumprod).sqrt()
        self.sqrt_recip_alphas_cumprod = (1.0 / self.alphas_cumprod).sqrt()
        self.sqrt_recipm1_alphas_cumprod = (1.0 / self.alphas_cumprod - 1.0).sqrt()
        self._init_posterior()
        self._device_tables: dict[torch.device, dict[str, Tensor]] = {}

    def _init_posterior(self) -> None:
        """q(x_{t-1} | x_t, x_0) = N(coef1_t x_0 + coef2_t x_t, beta_tilde_t),
        beta_tilde_t = beta_t (1 - alpha_bar_{t-1}) / (1 - alpha_bar_t)."""
        ab, ab_prev, betas = self.alphas_cumprod, self.alphas_cumprod_prev, self.betas
        self.posterior_variance = betas * (1.0 - ab_prev) / (1.0 - ab)
        # beta_tilde_0 = 0: its log is clipped to beta_tilde_1's (never used to add noise).
        first_nonzero = self.posterior_variance[1:2]
        self.posterior_log_variance_clipped = torch.cat([first_nonzero, self.posterior_variance[1:]]).log()
        self.posterior_mean_coef1 = betas * ab_prev.sqrt() / (1.0 - ab)
        self.posterior_mean_coef2 = (1.0 - ab_prev) * self.alphas.sqrt() / (1.0 - ab)
        if self.variance == "large":
            self.model_log_variance = torch.cat([first_nonzero, betas[1:]]).log()
        else:
            self.model_log_variance = self.posterior_log_variance_clipped

    # -- tables ---------------------------------------------------------------------------------------

    def _tables_on(self, device: torch.device) -> dict[str, Tensor]:
        """All tables on ``device``, copied once per device and cached (one transfer, then only gathers)."""
        tables = self._device_tables.get(device)
        if tables is None:
            dtype = torch.float32 if device.type == "mps" else torch.float64  # MPS has no float64
            stacked = torch.stack([getattr(self, name) for name in _TABLES]).to(device=device, dtype=dtype)
            tables = self._device_tables[device] = dict(zip(_TABLES, stacked.unbind(0)))
        return tables

    def _extract(self, name: str, t: Tensor, x: Tensor) -> Tensor:
        """table[t] for a (B,) long tensor t, as x's dtype on x's device, shaped (B, 1, ..., 1) to broadcast.
        Indexes on t's device so that nothing waits for the device (no .item())."""
        values = self._tables_on(t.device)[name][t]
        return values.to(device=x.device, dtype=x.dtype).reshape(-1, *([1] * (x.dim() - 1)))

    def _t_batch(self, t: int, x: Tensor) -> Tensor:
        if not 0 <= t < self.num_timesteps:
            raise ValueError(f"timestep must be in [0, {self.num_timesteps - 1}], got {t}")
        return torch.full((x.shape[0],), t, device=x.device, dtype=torch.long)

    # -- forward process and training ----------------------------------------------------------------

    def q_sample(self, x0: Tensor, t: Tensor, noise: Tensor) -> Tensor:
        """q(x_t | x_0): x_t = sqrt(alpha_bar_t) x_0 + sqrt(1 - alpha_bar_t) eps."""
        return (self._extract("sqrt_alphas_cumprod", t, x0) * x0
                + self._extract("sqrt_one_minus_alphas_cumprod", t, x0) * noise)

    def training_losses(self, model: Model, x0: Tensor, t: Tensor, noise: Tensor) -> Tensor:
        """L_simple per sample: mean over non-batch dims of (eps - eps_theta(x_t, t))^2, in float32
        (the model may run under autocast), shape (B,)."""
        eps = model(self.q_sample(x0, t, noise), t).float()
        return (eps - noise.float()).square().mean(dim=tuple(range(1, eps.dim())))

    def predict_x0(self, x_t: Tensor, t: Tensor, eps: Tensor) -> Tensor:
        """x_0 = sqrt(1 / alpha_bar_t) x_t - sqrt(1 / alpha_bar_t - 1) eps (q_sample solved for x_0)."""
        return (self._extract("sqrt_recip_alphas_cumprod", t, x_t) * x_t
                - self._extract("sqrt_recipm1_alphas_cumprod", t, x_t) * eps)

    def predict_eps(self, x_t: Tensor, t: Tensor, x0: Tensor) -> Tensor:
        """eps = (sqrt(1 / alpha_bar_t) x_t - x_0) / sqrt(1 / alpha_bar_t - 1) (q_sample solved for eps)."""
        return ((self._extract("sqrt_recip_alphas_cumprod", t, x_t) * x_t - x0)
                / self._extract("sqrt_recipm1_alphas_cumprod", t, x_t))

    def q_posterior(self, x0: Tensor, x_t: Tensor, t: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q(x_{t-1} | x_t, x_0): (mean coef1_t x_0 + coef2_t x_t, variance beta_tilde_t, its clipped log)."""
        mean = self._extract("posterior_mean_coef1", t, x_t) * x0 + self._extract("posterior_mean_coef2", t, x_t) * x_t
        return (mean, self._extract("posterior_variance", t, x_t),
                self._extract("posterior_log_variance_clipped", t, x_t))

    # -- sampling ------------------------------------------------------------------------------------

    def _predict_x0(self, model: Model, x_t: Tensor, t: Tensor, clip: bool) -> Tensor:
        # The model may return bf16 under autocast; the update arithmetic stays in x_t's dtype.
        x0 = self.predict_x0(x_t, t, model(x_t, t).to(x_t.dtype))
        return x0.clamp(-1.0, 1.0) if clip else x0

    @torch.no_grad()
    def p_sample(self, model: Model, x_t: Tensor, t: int, noise: Tensor | None, clip: bool = True) -> Tensor:
        """One ancestral step of p(x_{t-1} | x_t) = N(mu~_t(x0_hat, x_t), sigma_t^2), with mu~ the posterior
        mean at the predicted x0_hat. At t = 0 it returns the mean (no noise; ``noise`` may be None)."""
        tt = self._t_batch(t, x_t)
        mean, _, _ = self.q_posterior(self._predict_x0(model, x_t, tt, clip), x_t, tt)
        if t == 0:
            return mean
        return mean + (0.5 * self._extract("model_log_variance", tt, x_t)).exp() * noise.to(mean)

    def ddim_sigma(self, t: int, t_prev: int, eta: float) -> float:
        """DDIM's sigma = eta sqrt((1 - a_prev) / (1 - a_t)) sqrt(1 - a_t / a_prev), a = alpha_bar.
        Zero when eta = 0 or t_prev = -1 (a_prev = 1)."""
        a_t, a_prev = self._alpha_bar(t), self._alpha_bar(t_prev)
        return eta * math.sqrt((1.0 - a_prev) / (1.0 - a_t) * (1.0 - a_t / a_prev))

    def _alpha_bar(self, t: int) -> float:
        return 1.0 if t == -1 else float(self.alphas_cumprod[t])  # a CPU table: no device sync

    @torch.no_grad()
    def ddim_step(self, model: Model, x_t: Tensor, t: int, t_prev: int, eta: float, noise: Tensor | None,
                  clip: bool = True) -> Tensor:
        """DDIM (Song et al., 2021, eq. 12): x_{t_prev} = sqrt(a_prev) x0_hat + sqrt(1 - a_prev - sigma^2) eps
        + sigma z. t_prev = -1 means a_prev = 1 (the clean sample). ``noise`` (z) is read only if sigma > 0."""
        if not -1 <= t_prev < t:
            raise ValueError(f"need -1 <= t_prev < t, got t={t}, t_prev={t_prev}")
        tt = self._t_batch(t, x_t)
        x0 = self._predict_x0(model, x_t, tt, clip)
        # eps re-derived from the (clipped) x0 so that the step stays consistent with the x0 it moves to.
        eps = self.predict_eps(x_t, tt, x0)
        a_prev, sigma = self._alpha_bar(t_prev), self.ddim_sigma(t, t_prev, eta)
        x_prev = math.sqrt(a_prev) * x0 + math.sqrt(max(1.0 - a_prev - sigma**2, 0.0)) * eps
        return x_prev + sigma * noise.to(x_prev) if sigma > 0 else x_prev

    def ddim_timesteps(self, steps: int) -> list[int]:
        """The timesteps DDIM visits, in visiting (descending) order: ``steps`` values evenly spaced over
        [0, T-1], both ends included (round(i (T-1) / (steps-1))), so the first step starts at pure noise
        (T-1, like ancestral sampling) and the last ends at t = 0. steps = 1 gives [T-1] (one jump to x_0);
        steps = T gives T-1, ..., 0, the ancestral grid."""
        top = self.num_timesteps - 1
        if not 1 <= steps <= self.num_timesteps:
            raise ValueError(f"DDIM steps must be in [1, {self.num_timesteps}] (the number of timesteps), got {steps}")
        if steps == 1:
            return [top]
        # Spacing (T-1)/(steps-1) >= 1 when steps <= T, so the rounded values are distinct.
        return [round(i * top / (steps - 1)) for i in range(steps - 1, -1, -1)]

    def _record_keys(self, record: Sequence[int], visited: list[int]) -> set[int]:
        """Each requested timestep maps to the nearest visited one (ties: the noisier); -1 is the final x_0."""
        keys = set()
        for r in record:
            if not -1 <= r < self.num_timesteps:
                raise ValueError(f"record timesteps must be in [-1, {self.num_timesteps - 1}], got {r}")
            keys.add(-1 if r == -1 else min(visited, key=lambda v: (abs(v - r), -v)))
        return keys

    def recorded_keys(self, record: Sequence[int], steps: int | None = None) -> list[int]:
        """The keys sample() records for ``record`` with these steps, in its order (visiting order, -1 last):
        known without sampling, so every rank agrees on them, also one that samples nothing."""
        visited = list(range(self.num_timesteps - 1, -1, -1)) if steps is None else self.ddim_timesteps(steps)
        keys = self._record_keys(record, visited)
        return [t for t in visited if t in keys] + ([-1] if -1 in keys else [])

    @torch.no_grad()
    def sample(self, model: Model, x_T: Tensor, noise_fn: NoiseFn, steps: int | None = None, eta: float = 0.0,
               record: Sequence[int] = (), progress: Callable[[int, int], None] | None = None,
               clip: bool = True) -> tuple[Tensor, dict[int, Tensor]]:
        """Sample from x_T ~ N(0, I): ancestral over all T steps (``steps`` None) or DDIM over
        ``ddim_timesteps(steps)`` with ``eta``. Returns (x_0 clamped to [-1, 1], recorded states).

        ``noise_fn(i, shape)`` gives the noise of loop iteration i (0-based); it is called only for steps that
        add noise: never at the last iteration, never for DDIM with eta = 0.
        ``record``: timesteps whose state to keep; each maps to the nearest visited timestep and the dict is
        keyed by that visited timestep (in visiting order), its value being x_t as fed to the model at t
        (not clamped; x_T itself at T-1). Key -1 holds the final clamped x_0.
        ``progress(k, n)`` is called after each iteration, k = 1 .. n. The model's train/eval mode is the
        caller's."""
        visited = list(range(self.num_timesteps - 1, -1, -1)) if steps is None else self.ddim_timesteps(steps)
        keys, kept, x = self._record_keys(record, visited), {}, x_T
        for i, t in enumerate(visited):
            if t in keys:
                kept[t] = x.clone()  # x_T is the caller's tensor; later states are fresh tensors anyway
            x = self._step(model, x, i, visited, noise_fn, steps is None, eta, clip)
            if progress is not None:
                progress(i + 1, len(visited))
        x = x.clamp(-1.0, 1.0)
        if -1 in keys:
            kept[-1] = x
        return x, kept

    def _step(self, model: Model, x: Tensor, i: int, visited: list[int], noise_fn: NoiseFn, ancestral: bool,
              eta: float, clip: bool) -> Tensor:
        t = visited[i]
        if ancestral:
            return self.p_sample(model, x, t, noise_fn(i, x.shape) if t > 0 else None, clip)
        t_prev = visited[i + 1] if i + 1 < len(visited) else -1
        noise = noise_fn(i, x.shape) if self.ddim_sigma(t, t_prev, eta) > 0 else None
        return self.ddim_step(model, x, t, t_prev, eta, noise, clip)
