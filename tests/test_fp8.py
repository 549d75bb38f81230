"""drafter.matmul_precision=fp8 on the CPU (torch._scaled_mm's row-wise e4m3 products run there too): the
FP8 products are exactly the fp32 products of their dequantised operands, and within what e4m3's rounding
allows of the bf16 ones; fp8 is refused where it cannot run.

Tolerances, per element of a product C = A B over a contraction of K:
  * against the dequantised operands, the only differences are fp32 accumulation (at most K fp32
    roundings of the running sum: K * 2^-24 * (|A| |B|)) and the result's rounding to bf16 (2^-8 |C|);
  * against the unquantised operands, each operand element x also moves by its e4m3 rounding, at most
    2^-4 |x| (3 mantissa bits) or, in e4m3's subnormal range, 2^-10 of its row's scale; the product
    moves by at most dA |B| + |A| dB + dA dB.
"""
import sys

import pytest
import torch
from torch import nn

from dflash_core.kernels import fp8
from dflash_core.kernels.fp8 import Fp8HeadWeight, dequantise, quantise_rows
from dflash_core.loss.frozen_head import FrozenTargetHead
from dflash_core.loss.head_loss import head_loss
from launcher.config import ConfigError, compose_config
from launcher.distributed.topology import Topology
from launcher.resolve import check_step_device, resolve


def _cpu_takes_row_wise_scales() -> bool:
    """torch >= 2.13's CPU _scaled_mm takes row-wise scales; torch 2.11's takes one scale per tensor."""
    q = torch.zeros(16, 16).to(fp8.E4M3)
    try:
        torch._scaled_mm(q, q.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.bfloat16)
    except RuntimeError:
        return False
    return True


CPU_ROW_WISE = _cpu_takes_row_wise_scales()
# Where the product tests run: an FP8 GPU where there is one (the hardware the option is for), else the CPU.
if torch.cuda.is_available() and fp8.unsupported_reason(torch.device("cuda")) is None:
    DEVICE = torch.device("cuda")
else:
    DEVICE = torch.device("cpu") if CPU_ROW_WISE else None
REASON = "no FP8 GPU, and this torch's CPU _scaled_mm takes no row-wise scales (torch >= 2.13's does)"
needs_fp8 = pytest.mark.skipif(DEVICE is None, reason=REASON)
needs_cpu_fp8 = pytest.mark.skipif(not CPU_ROW_WISE, reason=REASON.split(", and ")[1])
# One rounding of a running sum: fp32's on the CPU; Hopper's FP8 tensor cores keep about 14 bits of
# it between cuBLAS's promotions to fp32 (DeepSeek-V3 report, section 3.3.2), so the bound is looser there.
ACCUMULATION_UNIT = 2.0 ** -14 if DEVICE is not None and DEVICE.type == "cuda" else 2.0 ** -24
E4M3_UNIT = 2.0 ** -4        # half an ulp of a 3-bit mantissa, relative
E4M3_SUBNORMAL = 2.0 ** -10  # half the subnormal spacing (2^-9), relative to the row's scale
BF16_UNIT = 2.0 ** -8


def _accumulation_bound(a, b, product):
    """Accumulation plus bf16 rounding of product = a @ b (a [M, K], b [K, N], float64)."""
    return a.shape[1] * ACCUMULATION_UNIT * (a.abs() @ b.abs()) + BF16_UNIT * product.abs()


def _quantisation_error(x):
    """The most e4m3 row-wise quantisation can move each element of x [M, K]."""
    _, scale = quantise_rows(x)
    return E4M3_UNIT * x.double().abs() + E4M3_SUBNORMAL * scale.double()


def _fp8_bound(a, b, product):
    """How far an FP8 product of a [M, K] (rows quantised) and b [K, N] (columns quantised) may be from
    the exact product, bf16 rounding included."""
    da, db = _quantisation_error(a), _quantisation_error(b.t()).t()
    a, b = a.double().abs(), b.double().abs()
    return da @ b + a @ db + da @ db + (2 * BF16_UNIT) * product.abs() + a.shape[1] * ACCUMULATION_UNIT * (a @ b)


def _assert_within(actual, expected, bound):
    excess = (actual.double() - expected).abs() - bound
    assert excess.max() <= 0, f"{int((excess > 0).sum())} elements beyond the bound, worst by {excess.max():.3g}"


def _operands(rows=40, vocab=256, hidden=128, seed=0):
    """Rows not a multiple of 16 (the padded path); a wide range of magnitudes per row."""
    gen = torch.Generator().manual_seed(seed)
    h = (torch.randn(rows, hidden, generator=gen) * torch.rand(rows, 1, generator=gen) * 8).to(torch.bfloat16)
    weight = (torch.randn(vocab, hidden, generator=gen) / hidden ** 0.5).to(torch.bfloat16)
    onehots = (torch.rand(rows, vocab, generator=gen) > 0.99).float()
    grad = (torch.randn(rows, vocab, generator=gen).softmax(-1) * 3 - onehots).to(torch.bfloat16)
    return h.to(DEVICE), weight.to(DEVICE), grad.to(DEVICE)


def test_quantised_rows_use_power_of_two_scales_and_fill_the_e4m3_range():
    x = torch.tensor([[3.0, -0.5, 0.0], [0.0, 0.0, 0.0], [1e-3, 2e-3, -7e-4]])
    q, scale = quantise_rows(x)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (3, 1)
    assert torch.equal(torch.exp2(torch.log2(scale).round()), scale)   # powers of two: scaling is exact
    amax = q.float().abs().amax(1)
    assert (amax[[0, 2]] > fp8.E4M3_MAX / 2).all() and (amax[[0, 2]] <= fp8.E4M3_MAX).all()
    assert torch.equal(dequantise(q, scale)[1], torch.zeros(3))          # a zero row stays zero, finite
    torch.testing.assert_close(dequantise(q, scale)[0], x[0])            # 3, -0.5 and 0 are e4m3 values


@needs_fp8
def test_head_logits_are_the_fp32_product_of_the_dequantised_operands():
    h, weight, _ = _operands()
    logits = Fp8HeadWeight(weight).logits(h)
    assert logits.shape == (40, 256) and logits.dtype == torch.bfloat16
    a, b = dequantise(*quantise_rows(h)).double(), dequantise(*quantise_rows(weight)).double().t()
    expected = a @ b
    _assert_within(logits, expected, _accumulation_bound(a, b, expected))


@needs_fp8
def test_head_input_gradient_is_the_fp32_product_of_the_dequantised_operands():
    _, weight, grad = _operands()
    grad_h = Fp8HeadWeight(weight).input_gradient(grad)
    assert grad_h.shape == (40, 128)
    # The weight is quantised per hidden column here (over the vocabulary: the contraction).
    a, b = dequantise(*quantise_rows(grad)).double(), dequantise(*quantise_rows(weight.t())).double().t()
    expected = a @ b
    _assert_within(grad_h, expected, _accumulation_bound(a, b, expected))


@needs_fp8
def test_head_products_are_within_e4m3_rounding_of_the_bf16_ones():
    h, weight, grad = _operands()
    head = Fp8HeadWeight(weight)
    for fp8_product, a, b in ((head.logits(h), h, weight.t()), (head.input_gradient(grad), grad, weight)):
        exact = a.double() @ b.double()
        _assert_within(fp8_product, exact, _fp8_bound(a, b, exact))
        assert not torch.equal(fp8_product, (a @ b).to(torch.bfloat16))   # it is not the bf16 product


@needs_fp8
@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.skipif(
    DEVICE is None or DEVICE.type != "cuda", reason="the e4m3 gradient kernel: Triton on a GPU"))])
def test_the_head_loss_in_fp8_stays_close_to_bf16(compiled):
    """The whole fused head loss (logits, loss terms, input gradient), training and evaluation; compiled
    on a GPU, with the Triton kernels and the logit gradient quantised by its kernel."""
    gen = torch.Generator().manual_seed(1)
    h = torch.randn(1, 6, 8, 64, generator=gen).to(DEVICE, torch.bfloat16)
    labels = torch.randint(0, 512, (1, 6, 8), generator=gen).to(DEVICE)
    weights = (torch.rand(1, 6, 8, generator=gen) > 0.2).float().to(DEVICE)
    weights[..., 0] = 0
    head = FrozenTargetHead.random(512, 64, seed=2, device=DEVICE, dtype=torch.bfloat16)
    # 3 blocks of 8: 24-row chunks, padded to the 16-row tiles of the FP8 products
    settings = dict(loss="dflash", gamma=7.0, dpace_alpha=0.5, chunk_blocks=3, compiled=compiled)

    def loss_and_grad():
        leaf = h.clone().requires_grad_()
        loss_sum, weight_sum, *_ = head_loss(leaf, head, labels, weights, **settings)
        (grad,) = torch.autograd.grad(loss_sum / weight_sum, leaf)
        with torch.no_grad():
            held_out = head_loss(h, head, labels, weights, **settings)
        return float(loss_sum.detach() / weight_sum), grad.double(), float(held_out[0] / held_out[1])

    loss16, grad16, held16 = loss_and_grad()
    head.use_fp8()
    loss8, grad8, held8 = loss_and_grad()
    # The logits move by a few e4m3 roundings of |h| |W|; averaged over positions the loss moves far less.
    assert loss8 != loss16 and abs(loss8 - loss16) / loss16 < 0.02
    assert held8 == held16   # evaluation reads the served head's bf16 logits, unchanged by use_fp8
    assert (grad8 - grad16).norm() / grad16.norm() < 2 * E4M3_UNIT


@needs_fp8
@pytest.mark.parametrize("recipe", ["rowwise", "rowwise_with_gw_hp"])
def test_fp8_linear_products_are_the_fp32_products_of_the_dequantised_operands(recipe):
    """torchao's Float8Linear, forward and both gradients: quantised as quantise_rows quantises, each
    product along its contraction; rowwise_with_gw_hp keeps the weight gradient a bf16 product."""
    pytest.importorskip("torchao")
    gen = torch.Generator().manual_seed(3)
    model = nn.Sequential(nn.Linear(64, 48, bias=False)).to(DEVICE)
    weight = model[0].weight
    with torch.no_grad():
        weight.copy_(torch.randn(48, 64, generator=gen) * 0.05)
    assert fp8.convert_linears(model, recipe) == 1
    from torchao.float8.float8_linear import Float8Linear
    assert isinstance(model[0], Float8Linear) and model[0].weight is weight
    assert list(model.state_dict()) == ["0.weight"]   # what the optimiser, checkpoints and the export see
    x = torch.randn(32, 64, generator=gen).to(DEVICE).requires_grad_()
    upstream = torch.randn(32, 48, generator=gen).to(DEVICE)
    y = model(x)
    y.backward(upstream)
    w = weight.detach()
    products = [(y, x.detach(), w.t(), True),                              # x W^T: x per row, W per output row
                (x.grad, upstream, w, True),                               # g W: g per row, W per input column
                (weight.grad, upstream.t(), x.detach(), recipe == "rowwise")]   # g^T x: per column over the rows
    for actual, a, b, in_fp8 in products:
        exact = a.double() @ b.double()
        if in_fp8:
            da = dequantise(*quantise_rows(a)).double()
            db = dequantise(*quantise_rows(b.t())).double().t()
            expected = da @ db
            _assert_within(actual, expected, _accumulation_bound(da, db, expected))   # torchao rounds to bf16
            _assert_within(actual, exact, _fp8_bound(a, b, exact))
        else:   # the product in the operands' own precision (fp32 here), fp32 accumulation
            _assert_within(actual, exact, _accumulation_bound(a.double(), b.double(), exact))


@needs_fp8
def test_fp8_linear_layers_evaluate_as_the_export_is_served():
    """Training mode runs the FP8 products; eval mode the plain product of the same weights, which the
    exported drafter runs when served (and which held-out tau scores)."""
    pytest.importorskip("torchao")
    gen = torch.Generator().manual_seed(4)
    model = nn.Sequential(nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 32, bias=False)).to(DEVICE)
    x = torch.randn(16, 64, generator=gen).to(DEVICE)
    with torch.no_grad():
        served = model(x)
        assert fp8.convert_linears(model) == 2
        trained = model(x)
        model.eval()
        evaluated = model(x)
    assert not torch.equal(trained, served) and torch.equal(evaluated, served)


def test_the_schema_offers_every_fp8_recipe():
    from dataclasses import fields

    from launcher.config.schema import DrafterSettings
    knob = next(f for f in fields(DrafterSettings) if f.name == "fp8_recipe")
    assert tuple(knob.metadata["choices"]) == fp8.FP8_RECIPES and knob.default == fp8.FP8_RECIPES[0]


def test_fp8_linear_layers_refuse_a_shape_fp8_cannot_take():
    with pytest.raises(ValueError, match=r"1 is 64 -> 40; both must be multiples of 16"):
        fp8.convert_linears(nn.Sequential(nn.Linear(64, 48), nn.Linear(64, 40)))


def test_a_missing_torchao_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao.float8", None)   # makes the import fail
    with pytest.raises(ImportError, match=r"pip install -e '\.\[fp8\]'"):
        fp8.convert_linears(nn.Sequential(nn.Linear(64, 48)))
    monkeypatch.setattr(fp8, "torchao_available", lambda: False)
    monkeypatch.setattr(fp8, "unsupported_reason", lambda device: None)
    with pytest.raises(ConfigError, match=r"drafter.matmul_precision=fp8: .*torchao is not installed: pip install"):
        check_step_device(compose_config(["drafter.matmul_precision=fp8"]), torch.device("cuda"))


def test_fp8_is_refused_on_the_cpu_naming_key_device_and_reason(tiny_target_dir):
    cfg = compose_config([f"target.path={tiny_target_dir}", "target.build_tiny=false", "drafter=tiny",
                          "drafter.matmul_precision=fp8"])
    with pytest.raises(ConfigError, match=r"drafter.matmul_precision=fp8: not on device cpu: cpu has no FP8 tensor "
                                          r"cores .*capability 8.9"):
        resolve(cfg, Topology(1, 1), torch.device("cpu"))


def test_fp8_is_refused_on_a_gpu_before_ada(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(ConfigError, match=r"not on device cuda:0: NVIDIA A100-SXM4-80GB has CUDA capability 8.0; "
                                          r"FP8 matmuls need 8.9"):
        check_step_device(compose_config(["drafter.matmul_precision=fp8"]), torch.device("cuda", 0))


@needs_cpu_fp8
def test_an_fp8_training_step_trains_the_same_parameters_close_to_bf16(tiny_target_dir):
    """The trainer with matmul_precision=fp8 (forced past the CPU refusal: _scaled_mm runs on the CPU):
    the same parameter names and dtypes as bf16 (the optimiser's, the checkpoint's and the export's), the
    first step's loss within e4m3's rounding of bf16's, and a finite update."""
    pytest.importorskip("torchao")
    import dataclasses

    import torch.distributed as dist

    from launcher.distributed.channel import HIDDEN_DTYPE, FeatureBatch
    from launcher.roles.trainer import DrafterTrainer

    cfg = compose_config([f"target.path={tiny_target_dir}", "target.build_tiny=false", "drafter=tiny",
                          "run.device=cpu", "data.fixed_length=64", "drafter.num_anchors=8"])
    job = resolve(cfg, Topology(num_targets=0, num_drafters=1), torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, job.drafter.mask_token_id, (1, 64), generator=gen)
    hidden = torch.randn(1, 64, job.target.feature_width, generator=gen).to(HIDDEN_DTYPE)
    batch = FeatureBatch(0, ids, torch.ones_like(ids), torch.arange(64).unsqueeze(0), hidden, 64)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        results, parameters = {}, {}
        for precision in ("bf16", "fp8"):
            trainer = DrafterTrainer(dataclasses.replace(job, step=dataclasses.replace(
                job.step, matmul_precision=precision)), dist.group.WORLD)
            parameters[precision] = {name: p.dtype for name, p in trainer.drafter.named_parameters()}
            results[precision] = trainer.train_step([batch]).result()
            assert (trainer.head.fp8 is not None) == (precision == "fp8")
    finally:
        dist.destroy_process_group()
    assert parameters["fp8"] == parameters["bf16"]
    loss16, loss8 = (results[p].counts.summary()["loss"] for p in ("bf16", "fp8"))
    assert loss8 != loss16 and abs(loss8 - loss16) / loss16 < 0.02
    assert not results["fp8"].skipped and results["fp8"].grad_norm == pytest.approx(results["bf16"].grad_norm, rel=0.1)


@needs_cpu_fp8
def test_the_fp8_ceiling_times_row_wise_scaled_products_and_is_checked_against_twice_bf16():
    from launcher.bench.ceiling import fp8_matmul_ceiling, fp8_peak
    readings = iter([0.0, 1e-9, 0.0, 1e-9])   # implausibly fast twice: an error row, no ceiling
    row = fp8_matmul_ceiling(torch.device("cpu"), size=64, reps=2, peak=fp8_peak(1.0), peak_source="test",
                             clock=lambda: next(readings))
    assert row["row"] == "fp8 matmul ceiling" and row["shape"] == "64^3 e4m3 row-wise scaled"
    assert row["remeasured"] and row["mfu"] is None and "exceeds the plausible peak 2 " in row["error"]
    ok = fp8_matmul_ceiling(torch.device("cpu"), size=64, reps=2, peak=None, peak_source="cpu")
    assert ok["tflops"] > 0 and "error" not in ok and fp8_peak(989.0) == 1978.0 and fp8_peak(None) is None


def test_the_parity_script_compares_smoothed_curves_and_tau_on_the_same_data():
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[1] / "scripts" / "fp8_parity.py"
    spec = importlib.util.spec_from_file_location("fp8_parity", path)
    parity = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(parity)
    assert parity.smoothed([1.0, 2.0, 3.0, 4.0], 2) == [1.5, 2.5, 3.5]
    bf16 = {"losses": [2.0] * 30, "tau": 3.0, "step_ms_median": 130.0, "peak_memory_gib": 20.0}
    fp8_run = {"losses": [2.0] * 10 + [2.03] * 20, "tau": 2.95, "step_ms_median": 100.0, "peak_memory_gib": 21.0}
    against = parity.compare({"bf16": bf16, "fp8": fp8_run, "bf16_again": {"error": "exit 1"}}, window=5)
    assert list(against) == ["fp8"]
    assert against["fp8"]["max_rel_loss_diff"] == pytest.approx(0.015) and not against["fp8"]["loss_within_1pct"]
    assert against["fp8"]["tau_within_2pct"] and against["fp8"]["speedup_vs_bf16"] == pytest.approx(1.3)
    stream = parity.MarkovStream(64, 16, torch.device("cpu"))
    first, again, other = stream.batch(3), stream.batch(3), stream.batch(4)
    assert torch.equal(first.input_ids, again.input_ids) and not torch.equal(first.input_ids, other.input_ids)
    assert first.input_ids.shape == (1, 64) and first.hidden.shape == (1, 64, 16)
    walk = first.input_ids[0].tolist()
    assert all(after in stream.successors[before] for before, after in zip(walk, walk[1:]))   # the chain's steps
    assert torch.equal(first.hidden[0, 5], stream.features[first.input_ids[0, 5]])   # a token's feature
