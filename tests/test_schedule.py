from collections import Counter

import pytest

from launcher.distributed.schedule import EVAL, TRAIN, Schedule


@pytest.mark.parametrize("units,drafters,accum,eval_every", [(1, 2, 1, 3), (5, 3, 2, 4), (2, 2, 1, 0), (3, 1, 3, 1)])
def test_every_item_has_one_producer_and_one_consumer(units, drafters, accum, eval_every):
    sched = Schedule(steps=10, num_units=units, num_drafters=drafters, grad_accum=accum, eval_every=eval_every,
                     eval_batches=2)
    items = list(sched.items())
    assert [it.seq for it in items] == list(range(len(items)))
    by_unit = sorted(it.seq for u in range(units) for it in sched.items_for_unit(u))
    by_drafter = sorted(it.seq for d in range(drafters) for it in sched.items_for_drafter(d))
    assert by_unit == by_drafter == list(range(len(items)))
    train = [it for it in items if it.kind == TRAIN]
    assert [it.index for it in train] == list(range(10 * drafters * accum))
    per_drafter_step = Counter((it.drafter, it.step) for it in train)
    assert set(per_drafter_step.values()) == {accum}
    eval_steps = sorted({it.step for it in items if it.kind == EVAL})
    expected = sorted({s for s in range(10) if eval_every and (s + 1) % eval_every == 0} | {9})
    assert eval_steps == expected


@pytest.mark.parametrize("eval_every", [0, 1, 3, 5])
def test_resume_starts_at_the_same_items(eval_every):
    sched = Schedule(steps=12, num_units=2, num_drafters=3, grad_accum=2, eval_every=eval_every, eval_batches=1)
    full = list(sched.items())
    for start in range(12):
        resumed = list(sched.items(start))
        assert resumed == [it for it in full if it.step >= start]
        assert sched.first_seq(start) == resumed[0].seq


def test_no_eval_items_when_disabled():
    sched = Schedule(steps=4, num_units=1, num_drafters=2, grad_accum=1, eval_every=2, eval_batches=0)
    assert all(it.kind == TRAIN for it in sched.items())


@pytest.mark.parametrize("drafters,accum", [(1, 1), (1, 2), (3, 1), (4, 2)])
def test_a_stream_resumed_at_another_count_goes_on_at_the_first_untrained_micro_batch(drafters, accum):
    before = Schedule(steps=6, num_units=1, num_drafters=2, grad_accum=1, eval_every=2, eval_batches=1)
    trained = before.trained_before(3)
    after = Schedule(steps=6, num_units=2, num_drafters=drafters, grad_accum=accum, eval_every=2,
                     eval_batches=1).resumed_at(3, trained)
    indices = [it.index for it in before.items() if it.kind == TRAIN and it.step < 3]
    indices += [it.index for it in after.items(3) if it.kind == TRAIN]
    assert indices == list(range(len(indices)))   # every micro-batch once, in order
    assert after.trained_before(6) == trained + 3 * drafters * accum
    assert Counter(it.drafter for it in after.items(3) if it.kind == TRAIN) == {d: 3 * accum for d in range(drafters)}
