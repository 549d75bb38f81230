"""The hidden-state channel between two real gloo processes: payloads arrive intact and in order,
and a protocol slip (wrong item, early end of stream) or a silent peer is a clear ChannelError
naming the peer rank and the item, not a hang."""
import os
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from launcher.distributed.channel import ChannelError, Receiver, Sender
from launcher.distributed.schedule import Schedule

pytestmark = pytest.mark.multiproc
SCHEDULE = Schedule(steps=3, num_units=1, num_drafters=1, grad_accum=1, eval_every=0, eval_batches=0)


def _payload(index: int):
    ids = torch.arange(12).view(3, 4) + index
    mask = (ids % 2).long()
    # A transposed (non-contiguous) view: gloo would raise on it if the sender did not copy.
    positions = torch.tensor([0, 1, 0, 1]).repeat(3, 1) + index   # a packed row: documents of two tokens
    hidden = (torch.arange(3 * 4 * 6, dtype=torch.float32).view(6, 4, 3).transpose(0, 2) + index).to(torch.bfloat16)
    return ids, mask, positions, hidden


def _worker(rank: int, store_dir: str, scenario: str) -> None:
    # A silent target is waited for only the process-group timeout (run.timeout_s in a job).
    timeout = timedelta(seconds=2 if scenario == "silent" else 120)
    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(store_dir, "store"), 2), rank=rank,
                            world_size=2, timeout=timeout)
    items = list(SCHEDULE.items())
    if rank == 0:
        sender = Sender(torch.device("cpu"), max_in_flight=1)
        order = {"ok": items, "wrong_order": items[1:2], "early_eos": items[:1], "silent": items[:1]}[scenario]
        for item in order:
            ids, mask, positions, hidden = _payload(item.index)
            sender.announce(1, item, ids, hidden.shape[-1], hidden.dtype, num_tokens=int(mask.sum()))
            sender.send(1, item, ids, mask, positions, hidden)
        if scenario not in ("wrong_order", "silent"):
            sender.close([1])
        # Stay up until the receiver has its verdict: exiting would reset the connection under it.
        peer_result = os.path.join(store_dir, "rank1.txt")
        deadline = time.monotonic() + 60
        while not os.path.exists(peer_result) and time.monotonic() < deadline:
            time.sleep(0.05)
    else:
        try:
            receiver = Receiver(iter(items), lambda unit: 0, torch.device("cpu"), torch.device("cpu"))
            for payload in receiver:
                ids, mask, positions, hidden = _payload(payload.item.index)
                batch = payload.batch
                assert torch.equal(batch.input_ids, ids) and torch.equal(batch.loss_mask, mask)
                assert torch.equal(batch.position_ids, positions)
                assert torch.equal(batch.hidden, hidden) and batch.num_tokens == int(mask.sum())
            receiver.close([0])
            verdict = f"ok {receiver.received}"
        except ChannelError as exc:
            verdict = f"ChannelError {exc}"
        partial = os.path.join(store_dir, "rank1.partial")
        open(partial, "w").write(verdict)
        os.rename(partial, os.path.join(store_dir, "rank1.txt"))
    # Skip process-group teardown: after a protocol error a send is left unmatched on purpose.
    os._exit(0)


@pytest.mark.parametrize("scenario,expected", [
    ("ok", "ok [0, 1, 2]"),
    ("wrong_order", "ChannelError rank 0 sent item seq=1"),
    ("early_eos", "ChannelError target rank 0 ended its stream before item seq=1"),
    ("silent", "ChannelError receiving the header of item seq=1 (step 1) from target rank 0 failed (a timeout means "
               "no answer within run.timeout_s"),
])
def test_channel_between_two_processes(tmp_path, scenario, expected):
    mp.spawn(_worker, args=(str(tmp_path), scenario), nprocs=2, join=True)
    assert (tmp_path / "rank1.txt").read_text().startswith(expected)
