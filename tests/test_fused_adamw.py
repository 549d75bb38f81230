"""The one-pass AdamW (dflash_core/fused_adamw.py): its kernel does torch's AdamW arithmetic on
gradient * multiplier and nothing at all where skipped; OnePassAdamW keeps torch's fused AdamW's
state and checkpoints, and refuses the options its kernel lacks."""
import copy
import json
import warnings

import pytest
import torch

from dflash_core.fused_adamw import OnePassAdamW
from tests.launching import run_in_triton_interpreter

SHAPES = [(7, 5), (33,), (3, 700)]   # odd sizes; 2100 elements span three programs of BLOCK=1024
HYPER = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}

# Run through run_in_triton_interpreter.
_INTERPRETED = """
import json, torch
from dflash_core.fused_adamw import adamw_
shapes, hyper, multiplier = json.loads(input())
gen = torch.Generator().manual_seed(0)
mine = [torch.randn(shape, generator=gen) for shape in shapes]
plain = [torch.nn.Parameter(p.clone()) for p in mine]
reference = torch.optim.AdamW(plain, **hyper, foreach=False)
exp_avgs, exp_avg_sqs = [torch.zeros_like(p) for p in mine], [torch.zeros_like(p) for p in mine]
steps = [torch.zeros((), dtype=torch.float32) for _ in mine]
kwargs = dict(lr=hyper["lr"], beta1=hyper["betas"][0], beta2=hyper["betas"][1], eps=hyper["eps"],
              weight_decay=hyper["weight_decay"], multiplier=torch.tensor(multiplier))
for _ in range(4):
    grads = [torch.randn(shape, generator=gen) for shape in shapes]
    for param, grad in zip(plain, grads):
        param.grad = grad * multiplier
    reference.step()
    adamw_(mine, grads, exp_avgs, exp_avg_sqs, steps, **kwargs, skip=torch.tensor(False))
diffs = [(got - want).abs().max().item() for got, want in zip(mine, plain)]
diffs += [(got - reference.state[p][key]).abs().max().item()
          for key, mine_state in (("exp_avg", exp_avgs), ("exp_avg_sq", exp_avg_sqs))
          for got, p in zip(mine_state, plain)]
before = [t.clone() for t in [*mine, *exp_avgs, *exp_avg_sqs, *steps]]
adamw_(mine, [torch.randn(shape, generator=gen) for shape in shapes], exp_avgs, exp_avg_sqs, steps, **kwargs,
       skip=torch.tensor(True))
after = [*mine, *exp_avgs, *exp_avg_sqs, *steps]
print(json.dumps({"max_diff": max(diffs), "steps": [s.item() for s in steps],
                  "skip_kept": all(torch.equal(a, b) for a, b in zip(before, after))}))
"""


def test_kernel_matches_torch_adamw_and_a_skipped_step_changes_nothing():
    """Triton's interpreter runs the kernel on CPU: 4 steps with a multiplier of 0.5 equal torch's
    AdamW on the multiplied gradients; a 5th with skip set leaves everything bit-identical."""
    pytest.importorskip("triton")
    result = run_in_triton_interpreter(_INTERPRETED, stdin=json.dumps([SHAPES, HYPER, 0.5]))
    assert result["max_diff"] < 1e-5
    assert result["steps"] == [4.0] * len(SHAPES)
    assert result["skip_kept"]


def _params(device: str) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(1)
    return [torch.nn.Parameter(torch.randn(shape, generator=gen).to(device)) for shape in SHAPES]


def _set_grads(params, gen: torch.Generator) -> list[torch.Tensor]:
    grads = [torch.randn(p.shape, generator=gen).to(p.device) for p in params]
    for param, grad in zip(params, grads):
        param.grad = grad.clone()
    return grads


def _assert_same_state(got: dict, want: dict) -> None:
    """Two optimiser state_dicts hold the same keys and bit-identical tensors."""
    assert got["state"].keys() == want["state"].keys()
    for index, state in want["state"].items():
        assert list(got["state"][index]) == list(state), index
        for key, value in state.items():
            assert torch.equal(got["state"][index][key], value), (index, key)


def test_on_cpu_step_scaled_is_torch_fused_adamw_and_checkpoints_move_both_ways(monkeypatch):
    """On CPU, step_scaled is torch's fused step given grad_scale = 1 / multiplier and found_inf =
    skip, and reads nothing on the host. Its state_dict loads into a plain AdamW and back; an
    unfused AdamW's (CPU runs wrote them) loads fused, and the steps after it agree."""
    mine, fused = _params("cpu"), _params("cpu")
    optimizer, reference = OnePassAdamW(mine, **HYPER), torch.optim.AdamW(fused, **HYPER, fused=True)
    gen = torch.Generator().manual_seed(2)
    for multiplier, skip in ((0.5, False), (3.0, True), (2.0, False)):
        grads = _set_grads(mine, gen)
        for param, grad in zip(fused, grads):
            param.grad = grad.clone()
        multiplier, skip = torch.tensor(multiplier), torch.tensor(skip)
        with monkeypatch.context() as patch:
            for name in ("item", "tolist", "__float__", "__int__", "__bool__", "__index__"):
                patch.setattr(torch.Tensor, name, lambda *_a, **_k: pytest.fail("step_scaled read a tensor"))
            optimizer.step_scaled(multiplier, skip)
        reference.grad_scale, reference.found_inf = (1.0 / multiplier).float(), skip.float()
        reference.step()
    assert not hasattr(optimizer, "grad_scale") and not hasattr(optimizer, "found_inf")
    for got, want in zip(mine, fused):
        assert torch.equal(got, want)
    saved = optimizer.state_dict()
    _assert_same_state(saved, reference.state_dict())
    assert saved["state"][0]["step"].item() == 2.0

    plain = torch.optim.AdamW(_params("cpu"), **HYPER)
    plain.load_state_dict(saved)
    back = OnePassAdamW(_params("cpu"), **HYPER)
    back.load_state_dict(plain.state_dict())
    for loaded in (plain, back):
        _assert_same_state(loaded.state_dict(), saved)

    old_params, new_params = _params("cpu"), _params("cpu")
    old = torch.optim.AdamW(old_params, **HYPER, foreach=False)
    _set_grads(old_params, gen)
    old.step()
    new = OnePassAdamW(new_params, **HYPER)
    new.load_state_dict(copy.deepcopy(old.state_dict()))   # as from a file: torch would share the tensors
    assert all(group["fused"] for group in new.param_groups)
    assert all(state["step"].dtype == torch.float32 and state["step"].item() == 1.0 for state in new.state.values())
    with torch.no_grad():
        for param, old_param in zip(new_params, old_params):
            param.copy_(old_param)
    for param, grad in zip(old_params, _set_grads(new_params, gen)):
        param.grad = grad * 0.5
    new.step_scaled(torch.tensor(0.5), torch.tensor(False))
    old.step()
    for got, want in zip(new_params, old_params):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


@pytest.mark.parametrize(("option", "named"), [({"amsgrad": True}, "amsgrad=True"),
                                               ({"maximize": True}, "maximize=True"),
                                               ({"differentiable": True}, "differentiable=True"),
                                               ({"lr": torch.tensor(1e-3)}, "a tensor lr")])
def test_options_the_kernel_lacks_are_refused_by_name(option, named):
    with pytest.raises(ValueError, match=f"OnePassAdamW does not implement {named}"):
        OnePassAdamW(_params("cpu"), **{**HYPER, **option})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_step_scaled_matches_torch_fused_adamw():
    """The kernel against torch's fused AdamW on the GPU: 3 updates with different multipliers and a
    skipped step between them; weights, moments and step counts within 1e-6, the state's keys
    torch's. An LR scheduler sees the step (no warning that it stepped first). No update waits for
    the device (a sync there cost the drafter step ~8 ms of idle GPU on H200)."""
    mine, fused = _params("cuda"), _params("cuda")
    optimizer, reference = OnePassAdamW(mine, **HYPER), torch.optim.AdamW(fused, **HYPER, fused=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))
    reference_scheduler = torch.optim.lr_scheduler.LambdaLR(reference, lambda step: 1.0 / (step + 1))
    gen = torch.Generator().manual_seed(3)
    for multiplier, skip in ((0.5, False), (3.0, True), (2.0, False), (0.25, False)):
        grads = _set_grads(mine, gen)
        for param, grad in zip(fused, grads):
            param.grad = grad.clone()
        multiplier, skip = torch.tensor(multiplier, device="cuda"), torch.tensor(skip, device="cuda")
        torch.cuda.set_sync_debug_mode("error")   # a host read of a device tensor raises
        try:
            optimizer.step_scaled(multiplier, skip)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        reference.grad_scale, reference.found_inf = (1.0 / multiplier).float(), skip.float()
        reference.step()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            scheduler.step()
        reference_scheduler.step()
    for got, want in zip(mine, fused):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    for param, want_param in zip(mine, fused):
        got, want = optimizer.state[param], reference.state[want_param]
        assert list(got) == list(want) == ["step", "exp_avg", "exp_avg_sq"]
        assert got["step"].device == param.device and got["step"].dtype == torch.float32
        assert got["step"].item() == want["step"].item() == 3.0
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(got[key], want[key], rtol=0, atol=1e-6)
