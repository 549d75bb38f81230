"""The drafter ranks' optimiser (launcher/distributed/sharded_adamw.py): over any number of ranks and
micro-batches it makes torch's AdamW update on the summed gradients; bf16 compute copies are the fp32
masters rounded; each rank writes its own shard of a checkpoint, which loads at another rank count."""
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from launcher.distributed.sharded_adamw import ShardedAdamW
from launcher.run_io import checkpoint

HYPER = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
MULTIPLIER = 0.5


class Net(nn.Module):
    """Two 'layers' and an 'fc' of odd sizes (shard and alignment boundaries fall inside weights), with
    biases and a norm (vectors) besides the matrices; like the drafter, it announces each module's weights
    to `weights_ready` before reading them."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(5, 9, bias=False)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(9, 67), nn.LayerNorm(67), nn.Linear(67, 9, bias=False))
                                    for _ in range(2))
        self.weights_ready = lambda *modules: None

    def forward(self, x):
        self.weights_ready(self.fc)
        x = self.fc(x)
        for layer in self.layers:
            self.weights_ready(layer)
            x = x + layer(x)
        return x


def _net(seed=0) -> Net:
    torch.manual_seed(seed)
    return Net()


def _inputs(count: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(3, 5, generator=gen) for _ in range(count)]


def _loss(net, x):
    return net(x).square().sum()


def _sharded(net, group=None, compute_dtype=torch.float32) -> ShardedAdamW:
    optimizer = ShardedAdamW(net, group or dist.group.WORLD, compute_dtype=compute_dtype, **HYPER)
    net.weights_ready = optimizer.wait_for_weights
    return optimizer


def _train(net, optimizer, steps: list[list[torch.Tensor]], skip_step: int | None = None,
           autocast: bool = False) -> list[float]:
    """One optimiser step per entry (its micro-batches, one backward each); the gradient norms."""
    norms = []
    for i, batches in enumerate(steps):
        for a, x in enumerate(batches):
            optimizer.begin_backward(first=a == 0, last=a == len(batches) - 1)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss = _loss(net, x)
            loss.backward()
        optimizer.end_backward()
        norms.append(float(optimizer.grad_norm()))
        optimizer.step_scaled(torch.tensor(MULTIPLIER), torch.tensor(i == skip_step))
        optimizer.zero_grad()
    return norms


def _reference(steps: list[list[torch.Tensor]], skip_step: int | None = None,
               dtype: torch.dtype = torch.float32) -> tuple[Net, torch.optim.AdamW, list[float]]:
    """torch's AdamW on the summed gradients * MULTIPLIER, in `dtype`; a skipped step changes nothing.
    The gradient norms too."""
    net = _net().to(dtype)
    adamw = torch.optim.AdamW(net.parameters(), **HYPER, foreach=False)
    norms = []
    for i, batches in enumerate(steps):
        for x in batches:
            _loss(net, x.to(dtype)).backward()
        norms.append(float(torch.nn.utils.get_total_norm([p.grad for p in net.parameters()])))
        if i != skip_step:
            for p in net.parameters():
                p.grad.mul_(MULTIPLIER)
            adamw.step()
        adamw.zero_grad()
    return net, adamw, norms


def _whole(optimizer, kind: str) -> dict[str, torch.Tensor]:
    """One rank's `kind` ("model", "exp_avg", "exp_avg_sq") of every weight, by name: its pieces are whole."""
    shapes = {name: param.shape for name, param in optimizer.named}
    return {piece.key.split(".", 1)[1]: piece.tensor.view(shapes[piece.key.split(".", 1)[1]])
            for piece in optimizer.checkpoint_pieces(writing=True) if piece.key.startswith(f"{kind}.")}


def _resume(path, net, optimizer, group=None) -> None:
    """`optimizer` (over `net`) continues the checkpoint at `path`."""
    checkpoint.read_pieces(path, optimizer.checkpoint_pieces(writing=False), group)
    optimizer.loaded()
    optimizer.load_state_dict(checkpoint.read_state(path)["optimizer"])


def _assert_as_close_to_exact(got, torch_fp32, exact, what: str):
    """`got` and torch's result are the same fp32 arithmetic summed in orders that the CPU's BLAS picks
    (its blocking differs between CPU models), so neither equals the other bit for bit and a fixed
    tolerance holds on one machine only. Against the float64 result both are off by fp32 rounding: ours
    must be as close as torch's own, within 4x (two orders of the same sums, each a few roundings off),
    and never held to less than one fp32 rounding of the tensor's largest value."""
    got, torch_fp32, exact = (torch.as_tensor(t).detach().double() for t in (got, torch_fp32, exact))
    torch_error = float((torch_fp32 - exact).abs().max())
    floor = torch.finfo(torch.float32).eps * float(exact.abs().max())
    error = float((got - exact).abs().max())
    assert error <= 4 * max(torch_error, floor), f"{what}: {error:.3g} from float64, torch's fp32 {torch_error:.3g}"


@pytest.fixture
def world_of_one():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("micro_batches", [1, 3])
def test_one_rank_is_torch_adamw_on_the_summed_gradients(world_of_one, micro_batches):
    """One micro-batch (gradients read where autograd left them) and three (summed in fp32 buffers): the
    weights, moments and gradient norm of torch's AdamW, a skipped step included; weights stay views of
    their bucket's flat buffer."""
    inputs = _inputs(3 * micro_batches)
    steps = [inputs[i:i + micro_batches] for i in range(0, len(inputs), micro_batches)]
    net = _net()
    optimizer = _sharded(net)
    norms = _train(net, optimizer, steps, skip_step=1)
    want, adamw, torch_norms = _reference(steps, skip_step=1)
    exact, exact_adamw, exact_norms = _reference(steps, skip_step=1, dtype=torch.float64)
    _assert_as_close_to_exact(norms, torch_norms, exact_norms, "gradient norms")
    for (name, got), expected, truth in zip(net.named_parameters(), want.parameters(), exact.parameters()):
        _assert_as_close_to_exact(got, expected, truth, name)
    assert optimizer.state_dict()["step"] == 2.0
    moments = {key: _whole(optimizer, key) for key in ("exp_avg", "exp_avg_sq")}
    exact_state = exact_adamw.state_dict()["state"]
    for index, (name, _) in enumerate(net.named_parameters()):
        state = adamw.state_dict()["state"][index]
        assert float(state["step"]) == 2.0
        for key in ("exp_avg", "exp_avg_sq"):
            _assert_as_close_to_exact(moments[key][name], state[key], exact_state[index][key], f"{key}[{name}]")
    base = net.layers[0][0].weight.untyped_storage().data_ptr()
    assert net.layers[0][2].weight.untyped_storage().data_ptr() == base


def test_bf16_compute_copies_are_the_rounded_masters(world_of_one):
    """With bf16 compute copies (trained under autocast) the model's matrices are bf16 and after every
    update the fp32 masters rounded; the vectors stay fp32; the checkpoint's pieces are the fp32 masters,
    finer than their copies."""
    net = _net()
    optimizer = _sharded(net, compute_dtype=torch.bfloat16)
    assert net.fc.weight.dtype == torch.bfloat16 and net.layers[0][0].bias.dtype == torch.float32
    _train(net, optimizer, [[x] for x in _inputs(3)], autocast=True)
    masters = _whole(optimizer, "model")
    for name, param in net.named_parameters():
        assert masters[name].dtype == torch.float32
        assert torch.equal(param.detach(), masters[name].to(param.dtype)), name
    assert not torch.equal(masters["fc.weight"], masters["fc.weight"].bfloat16().float())   # fp32 precision kept


def test_a_checkpoint_resumes_to_the_same_next_step(world_of_one, tmp_path):
    """Saved after two steps (bf16 copies: the fp32 masters are what is saved) and read into a drafter with
    other weights, the third step is the one the saving optimiser makes, bit for bit."""
    inputs = _inputs(3)
    net = _net()
    optimizer = _sharded(net, compute_dtype=torch.bfloat16)
    _train(net, optimizer, [[x] for x in inputs[:2]], autocast=True)
    path = checkpoint.save(tmp_path, 2, optimizer.checkpoint_pieces(writing=True),
                           {"step": 2, "optimizer": optimizer.state_dict()}, keep=1)
    ours = _net(seed=5)
    resumed = _sharded(ours, compute_dtype=torch.bfloat16)
    _resume(path, ours, resumed)
    for model, opt in ((net, optimizer), (ours, resumed)):
        _train(model, opt, [[inputs[2]]], autocast=True)
    for (name, got), want in zip(ours.named_parameters(), net.parameters()):
        assert torch.equal(got, want), name
    for kind in checkpoint.KINDS:
        assert all(torch.equal(a, b) for a, b in zip(_whole(resumed, kind).values(), _whole(optimizer, kind).values()))


def test_a_weight_without_a_gradient_is_named(world_of_one):
    net = _net()
    optimizer = _sharded(net)
    optimizer.begin_backward(first=True, last=True)
    net.fc(_inputs(1)[0]).sum().backward()   # the layers take no part
    with pytest.raises(RuntimeError, match=r"without a gradient .*'layers.0.0.bias'"):
        optimizer.end_backward()


# (micro-batches per rank and step, collectives through host copies as for CUDA tensors over gloo)
RANK_CASES = [(1, False), (2, False), (1, True)]


def _ranks_worker(rank: int, store_dir: str, world: int, out: str) -> None:
    """`world` ranks, each its own micro-batches of each step, per RANK_CASES: the weights of every rank
    after three steps, and the checkpoint each rank writes its shard of after two (out/case<i>)."""
    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(store_dir, "store"), world), rank=rank,
                            world_size=world)
    try:
        results = []
        for micro_batches, through_host in RANK_CASES:
            inputs = _inputs(3 * world * micro_batches)
            per_step = world * micro_batches
            steps = [inputs[i * per_step + rank * micro_batches:i * per_step + (rank + 1) * micro_batches]
                     for i in range(3)]
            net = _net(seed=rank if (micro_batches, through_host) == RANK_CASES[0] else 0)
            optimizer = _sharded(net)   # the first case starts the ranks apart: rank 0's weights win
            optimizer._through_host = through_host
            bucket = optimizer.buckets[0]
            assert 0 < bucket.hi - bucket.lo < bucket.compute.numel()   # a shard, not the whole bucket
            norms = _train(net, optimizer, steps[:2])
            writer = checkpoint.Checkpointer(Path(out) / f"case{len(results)}", 1, dist.group.WORLD)
            writer.save(2, optimizer.checkpoint_pieces(writing=True), {"step": 2, "optimizer": optimizer.state_dict()})
            assert (writer.close() is None) == (rank != 0)   # the first rank publishes
            announced = _announced(net, optimizer)
            norms += _train(net, optimizer, steps[2:])
            in_flight = sorted(optimizer._gathering)
            optimizer.wait_for_weights()   # the last update's all-gathers, before the weights are read here
            assert not optimizer._gathering
            results.append({"weights": {n: p.detach().clone() for n, p in net.named_parameters()}, "norms": norms,
                            "announced": announced, "in_flight": in_flight})
        torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _announced(net, optimizer) -> list[tuple[str, list[int]]]:
    """Records, for the rest of the run, each module the forward announces and the buckets whose all-gather
    was still unwaited at that moment."""
    calls = []
    names = {id(module): name for name, module in net.named_modules()}

    def recording(*modules):
        calls.append((names[id(modules[0])], sorted(optimizer._gathering)))
        optimizer.wait_for_weights(*modules)
    net.weights_ready = recording
    return calls


def _resume_worker(rank: int, store_dir: str, world: int, path: str, out: str) -> None:
    """`world` ranks continue the checkpoint at `path` for one step, each on its own input of
    _inputs(world): every rank's weights."""
    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(store_dir, "store"), world), rank=rank,
                            world_size=world)
    try:
        net = _net(seed=7)
        optimizer = _sharded(net)
        _resume(path, net, optimizer, dist.group.WORLD)
        _train(net, optimizer, [[_inputs(world)[rank]]])
        optimizer.wait_for_weights()
        torch.save({n: p.detach().clone() for n, p in net.named_parameters()}, os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_ranks_make_the_update_of_one_rank_on_all_their_micro_batches(tmp_path, world_of_one):
    """Two ranks with sharded masters and moments, one or two micro-batches each, collectives direct or
    through host copies: every rank ends with the same weights, those of one rank training on both ranks'
    micro-batches (and of torch's AdamW); the checkpoint both ranks write their shard of after two steps
    resumes on one rank to the same third step, and on three ranks to the one rank's."""
    mp.spawn(_ranks_worker, args=(str(tmp_path), 2, str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for case, (micro_batches, _) in enumerate(RANK_CASES):
        first, second = ranks[0][case], ranks[1][case]
        # The third step's first forward: every bucket's all-gather from the second update was still
        # unwaited when it began (buckets are in backward order: layers.1, layers.0, other(fc), vectors),
        # and each module waited for its own before reading it, the later layers' still in flight.
        sharded = [0, 1, 2]
        assert first["announced"][:3] == [("fc", sharded), ("layers.0", [0, 1]), ("layers.1", [0])], first["announced"]
        assert first["in_flight"] == sharded   # after the last update, until wait_for_weights()
        for name, value in first["weights"].items():
            assert torch.equal(value, second["weights"][name]), (RANK_CASES[case], name)

        inputs = _inputs(6 * micro_batches)
        steps = [inputs[i:i + 2 * micro_batches] for i in range(0, len(inputs), 2 * micro_batches)]
        net = _net()
        norms = _train(net, _sharded(net), steps)
        want, _, torch_norms = _reference(steps)
        exact, _, exact_norms = _reference(steps, dtype=torch.float64)
        for (name, param), expected, truth in zip(net.named_parameters(), want.parameters(), exact.parameters()):
            _assert_as_close_to_exact(first["weights"][name], expected, truth, f"{RANK_CASES[case]}: {name}")
            _assert_as_close_to_exact(param, expected, truth, f"one rank: {name}")
        _assert_as_close_to_exact(first["norms"], torch_norms, exact_norms, f"{RANK_CASES[case]}: gradient norms")
        _assert_as_close_to_exact(norms, torch_norms, exact_norms, "one rank: gradient norms")

        path = tmp_path / f"case{case}" / "step_00000002"
        # Each rank wrote its own shard: one file per rank, the vectors (which every rank holds) by the first.
        assert sorted(p.name for p in path.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.json",
                                                          "trainer.json"]
        resumed_net = _net(seed=7)
        resumed = _sharded(resumed_net)
        _resume(path, resumed_net, resumed)
        _train(resumed_net, resumed, steps[2:])
        for (name, got), expected, truth in zip(resumed_net.named_parameters(), want.parameters(), exact.parameters()):
            _assert_as_close_to_exact(got, expected, truth, f"{RANK_CASES[case]} resumed on one rank: {name}")

    # Three ranks (other shard boundaries, inside other weights) read the two ranks' checkpoint.
    path = tmp_path / "case0" / "step_00000002"
    (tmp_path / "three").mkdir()
    mp.spawn(_resume_worker, args=(str(tmp_path / "three"), 3, str(path), str(tmp_path / "three")), nprocs=3,
             join=True)
    three = [torch.load(tmp_path / "three" / f"rank{r}.pt") for r in range(3)]
    one_net = _net(seed=7)
    one = _sharded(one_net)
    _resume(path, one_net, one)
    _train(one_net, one, [_inputs(3)])
    for name, param in one_net.named_parameters():
        assert torch.equal(three[0][name], three[1][name]) and torch.equal(three[0][name], three[2][name]), name
        # The same fp32 sums of three gradients, reduced over three ranks or accumulated on one: another
        # order, a few fp32 roundings of values of order 1 apart (1e-6 is ten of them).
        torch.testing.assert_close(three[0][name], param.detach(), rtol=0, atol=1e-6, msg=name)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_bf16_copies_train_as_the_fp32_drafter_under_autocast(world_of_one):
    """The drafter with bf16 compute copies trains as the fp32 drafter under autocast: its weight gradients
    are the fp32 drafter's within bf16 rounding (not bitwise: cuBLAS may sum in another order for other
    operands); the fp32 masters are torch's fused AdamW on them within 1e-6 and the copies the rounded
    masters; no call waits for the device."""
    from dflash_core.drafter.model import DFlashDrafter
    from dflash_core.loss.frozen_head import FrozenTargetHead
    from dflash_core.loss.objective import drafter_step
    from tests.drafters import drafter_config, step_settings

    cfg = drafter_config(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                         intermediate_size=512, vocab_size=1000, block_size=8, mask_token_id=999)
    fp32, ours = DFlashDrafter(cfg, seed=0).cuda(), DFlashDrafter(cfg, seed=0).cuda()
    optimizer = _sharded(ours, compute_dtype=torch.bfloat16)
    reference = [nn.Parameter(p.detach().clone()) for p in fp32.parameters()]   # AdamW on our gradients
    adamw = torch.optim.AdamW(reference, **HYPER, fused=True)
    head = FrozenTargetHead.random(cfg.vocab_size, cfg.hidden_size, seed=0, device="cuda", dtype=torch.bfloat16)
    gen = torch.Generator(device="cuda").manual_seed(0)
    for step in range(3):
        ids = torch.randint(0, cfg.mask_token_id, (1, 256), generator=gen, device="cuda")
        hidden = torch.randn(1, 256, cfg.num_features * cfg.hidden_size, generator=gen, device="cuda",
                             dtype=torch.bfloat16)
        anchors = torch.randint(0, 255, (1, 16), generator=gen, device="cuda").sort(1).values
        keep = torch.ones_like(anchors, dtype=torch.bool)
        fp32.load_state_dict(_whole(optimizer, "model"))
        for model in (fp32, ours):
            torch.cuda.set_sync_debug_mode("error" if step and model is ours else "default")
            try:
                if model is ours:
                    optimizer.begin_backward(first=True, last=True)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    out = drafter_step(model, head, ids, torch.ones_like(ids), hidden,
                                       step_settings(model, backend="flex"), fixed_anchors=(anchors, keep))
                out.loss_sum.backward()
                if model is ours:
                    optimizer.end_backward()
                    norm = optimizer.grad_norm()
                    grads = [p.grad.float() for p in ours.parameters()]
                    optimizer.step_scaled(1.0 / norm, torch.zeros((), dtype=torch.bool, device="cuda"))
            finally:
                torch.cuda.set_sync_debug_mode("default")
        for (name, mine), theirs in zip(ours.named_parameters(), fp32.parameters()):
            assert mine.grad.dtype == mine.dtype and (mine.dtype == torch.bfloat16) == (mine.dim() == 2), name
            error = (mine.grad.float() - theirs.grad).norm() / theirs.grad.norm()
            assert error < 1e-2, (name, float(error))
        for param, grad in zip(reference, grads):
            param.grad = grad
        adamw.grad_scale, adamw.found_inf = norm.float(), torch.zeros((), device="cuda")
        adamw.step()
        optimizer.zero_grad()
        fp32.zero_grad()
    masters = {name: value.cpu() for name, value in _whole(optimizer, "model").items()}
    for (name, mine), theirs in zip(ours.named_parameters(), reference):
        torch.testing.assert_close(masters[name], theirs.detach().cpu(), rtol=0, atol=1e-6)
        assert torch.equal(mine.detach().cpu(), masters[name].to(mine.dtype)), name
