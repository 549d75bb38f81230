import pytest

from launcher.config.schema import OptimSettings
from launcher.roles.lr_schedule import lr_multiplier


def _optim(schedule):
    return OptimSettings(schedule=schedule, warmup_fraction=0.1, decay_fraction=0.2, min_lr_ratio=0.1)


@pytest.mark.parametrize("schedule", ["cosine", "wsd", "constant"])
def test_warmup_then_shape(schedule):
    f = lr_multiplier(_optim(schedule), 100)
    warm = [f(s) for s in range(10)]
    assert warm == sorted(warm) and warm[0] == pytest.approx(0.1) and warm[-1] == pytest.approx(1.0)
    tail = [f(s) for s in range(10, 100)]
    assert all(b <= a + 1e-12 for a, b in zip(tail, tail[1:]))
    if schedule == "constant":
        assert tail[-1] == 1.0
    else:
        assert tail[-1] == pytest.approx(0.1, abs=0.02)
    if schedule == "wsd":
        assert f(79) == 1.0 and f(85) < 1.0
