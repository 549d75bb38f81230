"""The drafter's training step as the loop drives it (launcher/roles/trainer.py, launcher/roles/drafter.py):
queued without a host read, a non-finite step skipped on the device, its values read one step later."""
import copy
import logging
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from launcher.distributed.channel import HIDDEN_DTYPE, FeatureBatch

SEQ_LEN = 64


@pytest.fixture(scope="module")
def trainer(tiny_target_dir):
    from launcher.config import compose_config
    from launcher.distributed.topology import Topology
    from launcher.resolve import resolve
    from launcher.roles.trainer import DrafterTrainer

    cfg = compose_config([f"target.path={tiny_target_dir}", "target.build_tiny=false", "drafter=tiny",
                          "run.device=cpu", f"data.fixed_length={SEQ_LEN}", "drafter.num_anchors=8"])
    job = resolve(cfg, Topology(num_targets=0, num_drafters=1), torch.device("cpu"))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield DrafterTrainer(job, dist.group.WORLD)
    dist.destroy_process_group()


def _batch(trainer, index: int, hidden_value: float | None = None) -> FeatureBatch:
    gen = torch.Generator().manual_seed(index)
    dcfg = trainer.dcfg
    ids = torch.randint(0, dcfg.mask_token_id, (1, SEQ_LEN), generator=gen)
    hidden = torch.randn(1, SEQ_LEN, dcfg.num_features * dcfg.hidden_size, generator=gen).to(HIDDEN_DTYPE)
    if hidden_value is not None:
        hidden.fill_(hidden_value)
    return FeatureBatch(index, ids, torch.ones_like(ids), torch.arange(SEQ_LEN).unsqueeze(0), hidden, SEQ_LEN)


def test_a_step_reads_nothing_from_the_device(trainer, monkeypatch):
    """Queuing a step may not wait for the device: no .item(), .tolist(), float(), int() or bool() of a
    tensor inside train_step (each is a host read, on a GPU a synchronisation that idles it)."""
    def refuse(*_args, **_kwargs):
        raise AssertionError("train_step read a tensor on the host")

    with monkeypatch.context() as patch:
        for name in ("item", "tolist", "__float__", "__int__", "__bool__", "__index__"):
            patch.setattr(torch.Tensor, name, refuse)
        launched = trainer.train_step([_batch(trainer, 0)])
    result = launched.result()
    assert not result.skipped and result.grad_norm > 0 and result.busy_s > 0
    assert result.counts.tokens.item() == SEQ_LEN and result.counts.tau_count.item() > 0


def test_a_non_finite_step_changes_nothing_and_the_next_one_trains(trainer):
    """NaN features: the step is reported skipped, and weights, AdamW moments and its step count are
    exactly as before it (the fused AdamW's found_inf); the next finite step updates again."""
    trainer.train_step([_batch(trainer, 1)]).result()
    weights = copy.deepcopy(trainer.drafter.state_dict())
    moments = {piece.key: piece.tensor.clone() for piece in trainer.optimizer.checkpoint_pieces(writing=False)}
    update_count = trainer.optimizer.state_dict()["step"]
    tokens = trainer.tokens_seen

    result = trainer.train_step([_batch(trainer, 2, hidden_value=float("nan"))]).result()
    assert result.skipped
    for name, value in trainer.drafter.state_dict().items():
        assert torch.equal(value, weights[name]), name
    for piece in trainer.optimizer.checkpoint_pieces(writing=False):   # fp32 masters and both moments
        assert torch.equal(piece.tensor, moments[piece.key]), piece.key
    assert trainer.optimizer.state_dict()["step"] == update_count

    result = trainer.train_step([_batch(trainer, 3)]).result()
    assert not result.skipped
    assert not torch.equal(trainer.drafter.state_dict()["fc.weight"], weights["fc.weight"])
    assert trainer.tokens_seen == tokens + 2 * SEQ_LEN   # the skipped step's tokens were still streamed


def test_books_stop_after_max_bad_steps(tmp_path, caplog):
    """The loop's books read launched steps in order: each skipped one is a warning naming its step,
    and run.max_bad_steps in a row raise NonFiniteError naming the step, the rank and the knob."""
    from dflash_core.loss.objective import StepCounts
    from launcher.roles.drafter import NonFiniteError, _Books, _InFlight
    from launcher.roles.trainer import StepResult

    class Done:   # a launched step whose values are ready
        def __init__(self, skipped):
            self.value = StepResult(StepCounts.zeros(4), float("nan") if skipped else 1.0, skipped, 0.1)

        def result(self):
            return self.value

    ctx = SimpleNamespace(run_dir=tmp_path, rank=3, job=SimpleNamespace(run=SimpleNamespace(max_bad_steps=2)))
    books = _Books(ctx, sink=None)
    caplog.set_level(logging.WARNING, logger="dflash")
    for step, skipped in enumerate([True, False, True]):
        books.read(_InFlight(step, Done(skipped), [], 0.0, 1e-3))
    assert books.stats.skipped == 2 and "step 3: non-finite" in caplog.text
    with pytest.raises(NonFiniteError, match=r"2 consecutive non-finite steps, the last at step 4 on rank 3 "
                                             r"\(run.max_bad_steps=2\)"):
        books.read(_InFlight(3, Done(True), [], 0.0, 1e-3))
    books.seq_log.close()


def test_bf16_on_cpu_trains_on_bf16_copies_and_tracks_fp32(tiny_target_dir, trainer):
    """drafter.matmul_precision=bf16 on CPU (issue 44: several times fp32's GEMM rate on CPUs with bf16
    instructions): the layers' compute copies and the frozen head are bf16, the masters fp32, and a
    fresh drafter's first loss is fp32's to within bf16's rounding. 0.05: the loss (about ln(vocab) = 7)
    sums products rounded at 2^-8 relative through two layers and the head."""
    from launcher.config import compose_config
    from launcher.distributed.topology import Topology
    from launcher.resolve import resolve
    from launcher.roles.trainer import DrafterTrainer

    def fresh(*overrides):   # the `trainer` fixture's process group; the same seed, so the same weights
        cfg = compose_config([f"target.path={tiny_target_dir}", "target.build_tiny=false", "drafter=tiny",
                              "run.device=cpu", f"data.fixed_length={SEQ_LEN}", "drafter.num_anchors=8", *overrides])
        return DrafterTrainer(resolve(cfg, Topology(num_targets=0, num_drafters=1), torch.device("cpu")),
                              dist.group.WORLD)

    fp32, bf16 = fresh(), fresh("drafter.matmul_precision=bf16")
    assert fp32.head.lm_head_weight.dtype == torch.float32 and fp32.drafter.fc.weight.dtype == torch.float32
    assert bf16.head.lm_head_weight.dtype == torch.bfloat16 and bf16.drafter.fc.weight.dtype == torch.bfloat16
    assert all(bucket.master.dtype == torch.float32 for bucket in bf16.optimizer.buckets)
    results = [t.train_step([_batch(t, 7)]).result().counts for t in (fp32, bf16)]
    losses = [float(c.loss_sum / c.weight_sum) for c in results]
    assert abs(losses[0] - losses[1]) < 0.05, losses
