"""The one-pass AdamW (dflash_core/kernels/fused_adamw.py): torch's AdamW arithmetic on gradient * multiplier,
any gradient dtype, the compute copy written as the master rounded to its dtype, and nothing at all
where skipped; on CPU torch's own fused step."""
import io
import json

import pytest
import torch

from dflash_core.kernels.fused_adamw import adamw_
from tests.launching import run_in_triton_interpreter

SHAPES = [(7, 5), (33,), (3, 700)]   # odd sizes; 2100 elements span three programs of BLOCK=1024
HYPER = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}

# Run through run_in_triton_interpreter, or in this process with device "cpu" (torch's fused step).
# The first weight has a bf16 compute copy and a bf16 gradient, as the drafter's matrices on GPU.
_PROGRAM = """
import json, os, torch
from dflash_core.kernels import fused_adamw
from dflash_core.kernels.fused_adamw import adamw_
if os.environ.get("TRITON_INTERPRET") == "1":
    fused_adamw._runs_kernel = lambda tensor: True   # the Triton kernels on CPU tensors, not torch's fused step
    fused_adamw.SQUARES_CHUNK, fused_adamw.SQUARES_BLOCK = 512, 128   # several programs, each looping
shapes, hyper, multiplier = json.loads(input())
gen = torch.Generator().manual_seed(0)
masters = [torch.randn(shape, generator=gen).flatten() for shape in shapes]
plain = [torch.nn.Parameter(p.clone()) for p in masters]
reference = torch.optim.AdamW(plain, **hyper, foreach=False)
exp_avgs, exp_avg_sqs = [torch.zeros_like(p) for p in masters], [torch.zeros_like(p) for p in masters]
computes = [masters[0].bfloat16(), None, None]
step = torch.zeros(())
kwargs = dict(lr=hyper["lr"], beta1=hyper["betas"][0], beta2=hyper["betas"][1], eps=hyper["eps"],
              weight_decay=hyper["weight_decay"], multiplier=torch.tensor(multiplier), computes=computes)

def gradients():
    grads = [torch.randn(p.shape, generator=gen) for p in masters]
    grads[0] = grads[0].bfloat16()
    return grads

for _ in range(4):
    grads = gradients()
    for param, grad in zip(plain, grads):
        param.grad = grad.float() * multiplier
    reference.step()
    adamw_(masters, grads, exp_avgs, exp_avg_sqs, step, **kwargs, skip=torch.tensor(False))
diffs = [(got - want).abs().max().item() for got, want in zip(masters, plain)]
diffs += [(got - reference.state[p][key]).abs().max().item()
          for key, mine in (("exp_avg", exp_avgs), ("exp_avg_sq", exp_avg_sqs)) for got, p in zip(mine, plain)]
rounded = torch.equal(computes[0], masters[0].bfloat16())
copy_error = ((computes[0].float() - masters[0]).abs() / masters[0].abs()).max().item()
before = [t.clone() for t in [*masters, *exp_avgs, *exp_avg_sqs, step, computes[0]]]
adamw_(masters, gradients(), exp_avgs, exp_avg_sqs, step, **kwargs, skip=torch.tensor(True))
after = [*masters, *exp_avgs, *exp_avg_sqs, step, computes[0]]
tensors = [torch.randn(shape, generator=gen) * 3 for shape in shapes + [(1500,)]] + [torch.zeros(0)]
tensors[0], tensors[3] = tensors[0].bfloat16(), tensors[3].bfloat16()
squares = fused_adamw.sum_of_squares(tensors)
want = sum(t.double().square().sum() for t in tensors).item()
print(json.dumps({"max_diff": max(diffs), "step": step.item(), "compute_is_rounded_master": rounded,
                  "compute_copy_error": copy_error,
                  "skip_kept": all(torch.equal(a, b) for a, b in zip(before, after)),
                  "squares_error": abs(squares.item() - want) / want, "squares_dtype": str(squares.dtype),
                  "squares_same_bits": torch.equal(squares, fused_adamw.sum_of_squares(tensors))}))
"""


def _check(result, rounded=True):
    assert result["max_diff"] < 1e-5
    assert result["step"] == 4.0
    if rounded:
        assert result["compute_is_rounded_master"]
    assert result["compute_copy_error"] < 2 ** -7   # under one bf16 unit in the last place
    assert result["skip_kept"]
    assert result["squares_error"] < 1e-6 and result["squares_dtype"] == "torch.float32"
    assert result["squares_same_bits"]


def test_kernels_match_torch_adamw_write_the_copy_and_a_skipped_step_changes_nothing():
    """Triton's interpreter runs the kernels on CPU: 4 steps with a multiplier of 0.5 equal torch's
    AdamW on the multiplied gradients (a bf16 gradient read as its fp32 value); the compute copy is the
    master in bf16 (the interpreter truncates where the GPU rounds to nearest: the GPU test checks that);
    a 5th step with skip set leaves everything bit-identical. The sum of squares over fp32 and bf16
    tensors, an empty one and several programs each is the float64 sum within 1e-6, the same bits twice."""
    pytest.importorskip("triton")
    _check(run_in_triton_interpreter(_PROGRAM, stdin=json.dumps([SHAPES, HYPER, 0.5])), rounded=False)


def test_on_cpu_it_is_torch_fused_adamw_and_reads_nothing_on_the_host(monkeypatch, capsys):
    """Off CUDA the same program runs torch's fused step (grad_scale = 1 / multiplier, found_inf = skip),
    and a step reads no tensor on the host."""
    monkeypatch.setattr("sys.stdin", io.StringIO(json.dumps([SHAPES, HYPER, 0.5])))
    exec(_PROGRAM, {})
    _check(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))

    with monkeypatch.context() as patch:
        for name in ("item", "tolist", "__float__", "__int__", "__bool__", "__index__"):
            patch.setattr(torch.Tensor, name, lambda *_a, **_k: pytest.fail("adamw_ read a tensor on the host"))
        adamw_([torch.randn(4)], [torch.randn(4)], [torch.zeros(4)], [torch.zeros(4)], torch.zeros(()), lr=1e-3,
               beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.0, multiplier=torch.tensor(1.0),
               skip=torch.tensor(False), computes=[torch.zeros(4, dtype=torch.bfloat16)])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_the_kernel_matches_torch_fused_adamw_without_waiting_for_the_device():
    """The kernel against torch's fused AdamW on the GPU: 4 updates with different multipliers, one of them
    skipped; fp32 gradients and bf16 ones with a bf16 compute copy. Masters and moments within 1e-6, the
    copy is the master rounded; no update reads the device (a sync there cost the drafter step ~8 ms of
    idle GPU on H200)."""
    gen = torch.Generator().manual_seed(3)
    masters = [torch.randn(s, generator=gen).flatten().cuda() for s in SHAPES]
    reference = [torch.nn.Parameter(m.clone()) for m in masters]
    torch_adamw = torch.optim.AdamW(reference, **HYPER, fused=True)
    exp_avgs, exp_avg_sqs = [torch.zeros_like(m) for m in masters], [torch.zeros_like(m) for m in masters]
    computes = [masters[0].bfloat16(), None, masters[2].bfloat16()]
    step = torch.zeros((), device="cuda")
    for multiplier, skip in ((0.5, False), (3.0, True), (2.0, False), (0.25, False)):
        grads = [torch.randn(m.shape, generator=gen).cuda() for m in masters]
        grads[2] = grads[2].bfloat16()
        for param, grad in zip(reference, grads):
            param.grad = grad.float()
        multiplier, skip = torch.tensor(multiplier, device="cuda"), torch.tensor(skip, device="cuda")
        torch.cuda.set_sync_debug_mode("error")   # a host read of a device tensor raises
        try:
            adamw_(masters, grads, exp_avgs, exp_avg_sqs, step, lr=HYPER["lr"], beta1=HYPER["betas"][0],
                   beta2=HYPER["betas"][1], eps=HYPER["eps"], weight_decay=HYPER["weight_decay"],
                   multiplier=multiplier, skip=skip, computes=computes)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch_adamw.grad_scale, torch_adamw.found_inf = (1.0 / multiplier).float(), skip.float()
        torch_adamw.step()
    assert step.item() == 3.0
    for i, (got, want) in enumerate(zip(masters, reference)):
        torch.testing.assert_close(got, want.detach(), rtol=0, atol=1e-6)
        for key, mine in (("exp_avg", exp_avgs), ("exp_avg_sq", exp_avg_sqs)):
            torch.testing.assert_close(mine[i], torch_adamw.state[want][key], rtol=0, atol=1e-6)
    assert torch.equal(computes[0], masters[0].bfloat16()) and torch.equal(computes[2], masters[2].bfloat16())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_the_sum_of_squares_is_the_float64_sum_the_same_bits_every_time_without_waiting():
    """The gradient-norm pass at a drafter layer's shapes (bf16 matrices, fp32 vectors, one size that
    ends inside a program): the float64 sum within 1e-6, identical bits on a second call, no host read."""
    from dflash_core.kernels.fused_adamw import sum_of_squares

    gen = torch.Generator(device="cuda").manual_seed(0)
    shapes = [(4096, 4096), (1024, 4096), (12288, 4096), (4096,), (128,), (1000, 333)]
    tensors = [torch.randn(s, generator=gen, device="cuda").to(torch.bfloat16 if len(s) == 2 else torch.float32)
               for s in shapes]
    torch.cuda.set_sync_debug_mode("error")
    try:
        first, second = sum_of_squares(tensors), sum_of_squares(tensors)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    want = sum(t.double().square().sum() for t in tensors)
    assert first.dtype == torch.float32 and abs(float(first) - float(want)) / float(want) < 1e-6
    assert torch.equal(first, second)
