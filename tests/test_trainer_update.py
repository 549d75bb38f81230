"""The drafter's update: the one multiplier that scales and clips, and the fused AdamW that applies it
(launcher/roles/trainer.py)."""
import pytest
import torch

from launcher.roles.trainer import clip_multiplier


@pytest.mark.parametrize("max_norm", [1.0, 100.0])
def test_one_multiplier_in_the_fused_adamw_equals_scaling_clipping_and_a_step(max_norm):
    """The trainer's update (clip_multiplier, then the fused AdamW's grad_scale) equals scaling
    the gradients, clip_grad_norm_ and a plain AdamW step. Two steps with different scales: Adam's
    first step alone is nearly scale-invariant, so one step would not see a dropped multiplier."""
    gen = torch.Generator().manual_seed(0)
    shapes = [(7, 5), (11,)]
    fused = [torch.nn.Parameter(torch.randn(shape, generator=gen)) for shape in shapes]
    plain = [torch.nn.Parameter(p.detach().clone()) for p in fused]
    fused_adam, plain_adam = torch.optim.AdamW(fused, lr=0.1, fused=True), torch.optim.AdamW(plain, lr=0.1)
    for scale in (0.5, 3.0):
        grads = [torch.randn(shape, generator=gen) for shape in shapes]
        for param, grad in zip(plain, grads):
            param.grad = grad * scale
        want_norm = torch.nn.utils.clip_grad_norm_(plain, max_norm)
        plain_adam.step()
        for param, grad in zip(fused, grads):
            param.grad = grad.clone()
        norm, multiplier = clip_multiplier(torch.nn.utils.get_total_norm([p.grad for p in fused]), scale,
                                           max_norm)
        fused_adam.grad_scale = (1.0 / multiplier).float()
        fused_adam.step()
        assert float(norm) == pytest.approx(float(want_norm), rel=1e-6)
        for got, want in zip(fused, plain):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
