"""The drafter's update: the DDP gradient sum, the one multiplier that scales and clips, and the
fused AdamW that applies it (launcher/roles/trainer.py)."""
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from launcher.roles.trainer import _sum_gradients, clip_multiplier


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
        norm, multiplier = clip_multiplier([p.grad for p in fused], scale, max_norm)
        fused_adam.grad_scale = (1.0 / multiplier).float()
        fused_adam.step()
        assert float(norm) == pytest.approx(float(want_norm), rel=1e-6)
        for got, want in zip(fused, plain):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def _ddp_worker(rank: int, store_dir: str, results: str) -> None:
    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(store_dir, "store"), 2), rank=rank,
                            world_size=2)
    try:
        layer = torch.nn.Linear(3, 2, bias=False)
        torch.nn.init.constant_(layer.weight, 1.0)
        ddp = torch.nn.parallel.DistributedDataParallel(layer, gradient_as_bucket_view=True)
        ddp.register_comm_hook(None, _sum_gradients)
        ddp(torch.full((1, 3), float(rank + 1))).sum().backward()
        torch.save(layer.weight.grad, os.path.join(results, f"grad{rank}.pt"))
        del ddp
    finally:
        dist.destroy_process_group()


def test_ddp_hook_sums_the_ranks_gradients(tmp_path):
    """Each rank's gradient is all ones times its input (1 and 2): both ranks must hold the sum,
    3, not DDP's default mean, 1.5 (the trainer's multiplier divides by the global weight sum)."""
    mp.spawn(_ddp_worker, args=(str(tmp_path), str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        torch.testing.assert_close(torch.load(tmp_path / f"grad{rank}.pt"), torch.full((2, 3), 3.0))
