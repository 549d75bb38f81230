"""The channel's waits on a GPU (skipped without CUDA; run through the device tool): a drafter that
queued its next step and then waits for data must wait for the transfer alone, never for the step."""
import pytest
import torch

from launcher.distributed.channel import _wait_all, _waiting_stream

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


class _EventWork:
    """A transfer that is done when `event` is: wait() orders the current stream after it, as NCCL's does."""

    def __init__(self, event: torch.cuda.Event):
        self.event = event

    def wait(self) -> bool:
        torch.cuda.current_stream().wait_event(self.event)
        return True


def _receive_while_a_step_runs(device: torch.device, header: torch.Tensor) -> tuple[bool, list, bool]:
    """Queue ~1 s of GPU work (the step), then wait for a ~0.5 ms transfer on another stream and read
    the header: (transfer done, header values, step still running) when the reads returned."""
    torch.cuda.synchronize(device)
    torch.cuda._sleep(2_000_000_000)
    transfer = torch.cuda.Stream(device)
    with torch.cuda.stream(transfer):
        torch.cuda._sleep(1_000_000)
        done = torch.cuda.Event()
        done.record()
    _wait_all([_EventWork(done)], device, "a test transfer")
    transferred = done.query()
    with _waiting_stream(device):
        values = header.tolist()
    running = not torch.cuda.current_stream(device).query()
    torch.cuda.synchronize(device)
    return transferred, values, running


def test_waiting_for_data_and_reading_a_header_leave_the_queued_step_running():
    device = torch.device("cuda", 0)
    header = torch.arange(10, device=device)
    # The first round sets things up once per process (stream pool, driver staging buffers), and such
    # first uses may wait for the whole device (seen on H200): the steady state is the second round.
    _receive_while_a_step_runs(device, header)
    transferred, values, running = _receive_while_a_step_runs(device, header)
    assert transferred, "returned before the transfer was done"
    assert values == list(range(10))
    assert running, "waited for the queued step"
