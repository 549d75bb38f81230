"""The hidden-state channel: target unit leaders -> drafters over torch.distributed P2P.

Per item a fixed-size int64 header goes first (sent before the target's forward, so the
drafter can post its payload receives early), then `input_ids`, `loss_mask`, `hidden`.
Messages between one pair of ranks arrive in order, so no tags are needed.
"""
from __future__ import annotations

import contextlib
import functools
import re
import time
from collections import deque
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist

from launcher.distributed.schedule import Item

HEADER_LEN = 10
HIDDEN_DTYPE = torch.bfloat16  # hidden states travel in bf16 whatever the target computes in
_VERSION = 2  # 2: position ids travel with every item
_EOS = -1
_DTYPES = [torch.bfloat16, torch.float16, torch.float32]


class ChannelError(RuntimeError):
    pass


def _waiting_stream(comm_device: torch.device):
    """Where transfers are awaited and their headers read: on CUDA a side stream, so that the host
    waits for the transfers alone, never for the compute queued on the current stream (the drafter
    queues its next step before it reads the last one)."""
    if comm_device.type != "cuda":
        return contextlib.nullcontext()
    return torch.cuda.stream(_side_stream(comm_device))


@functools.cache
def _side_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)


def _wait_all(works, comm_device: torch.device, what: str) -> None:
    """Block the host until the transfers are done. NCCL's wait() only orders the current CUDA
    stream after them, so the side stream that waits is synchronised too: the transfers are then
    complete for every stream, and a wait for data is booked as waiting, not as the next step. A
    timeout (run.timeout_s) or a lost peer is re-raised naming `what`: the peer rank and the item."""
    try:
        with _waiting_stream(comm_device):
            for work in works:
                work.wait()
            if comm_device.type == "cuda":
                torch.cuda.current_stream(comm_device).synchronize()
    except RuntimeError as exc:
        reason = re.sub(r"^\[[^\]]*\]\s*", "", (str(exc).strip().splitlines() or [type(exc).__name__])[-1])
        raise ChannelError(f"{what} failed (a timeout means no answer within run.timeout_s; see that rank's "
                           f"log): {reason}") from exc


@dataclass
class FeatureBatch:
    """One micro-batch as a drafter trains on it."""
    index: int                # global micro-batch index in its source (seeds the anchors)
    input_ids: torch.Tensor   # [B, S] int64
    loss_mask: torch.Tensor   # [B, S] int64
    position_ids: torch.Tensor  # [B, S] int64, restarting at 0 at every document of a packed row
    hidden: torch.Tensor      # [B, S, L*H] target features
    num_tokens: int           # non-padding tokens


@dataclass
class Payload:
    item: Item                # where it sits in the stream
    batch: FeatureBatch


def _header(item: Item | None, batch_shape=(0, 0), width=0, dtype=torch.bfloat16, num_tokens=0) -> list[int]:
    if item is None:
        return [_VERSION, _EOS, 0, 0, 0, 0, 0, 0, 0, 0]
    b, s = batch_shape
    return [_VERSION, item.seq, item.kind, item.index, item.step, b, s, width, _DTYPES.index(dtype), num_tokens]


def _named(item: Item) -> str:
    return f"item seq={item.seq} (step {item.step})"


class Sender:
    """Posts sends asynchronously; at most `max_in_flight` items outstanding (backpressure)."""

    def __init__(self, comm_device: torch.device, max_in_flight: int):
        self.comm_device = comm_device
        self.max_in_flight = max_in_flight
        self._in_flight: deque[list] = deque()
        self.wait_s = 0.0
        self.bytes_sent = 0
        self.sent: list[int] = []

    def _post(self, dst: int, tensors: list[torch.Tensor], what: str) -> tuple[list, str]:
        # gloo raises on the sender for non-contiguous tensors while the receiver waits: copy first.
        tensors = [t.to(self.comm_device).contiguous() for t in tensors]
        self.bytes_sent += sum(t.numel() * t.element_size() for t in tensors)
        return [(dist.isend(t, dst), t) for t in tensors], f"sending {what} to drafter rank {dst}"

    def announce(self, dst: int, item: Item, input_ids: torch.Tensor, width: int, dtype: torch.dtype,
                 num_tokens: int) -> None:
        header = torch.tensor(_header(item, tuple(input_ids.shape), width, dtype, num_tokens), dtype=torch.int64)
        self._in_flight.append(self._post(dst, [header], f"the header of {_named(item)}"))

    def send(self, dst: int, item: Item, input_ids: torch.Tensor, loss_mask: torch.Tensor,
             position_ids: torch.Tensor, hidden: torch.Tensor) -> None:
        self._in_flight.append(self._post(dst, [input_ids, loss_mask, position_ids, hidden],
                                          _named(item)))
        self.sent.append(item.seq)
        # Each item is two entries (header, payload).
        while len(self._in_flight) > 2 * self.max_in_flight:
            self._wait_oldest()

    def _wait_oldest(self) -> None:
        start = time.perf_counter()
        posted, what = self._in_flight.popleft()
        _wait_all([work for work, _ in posted], self.comm_device, what)
        self.wait_s += time.perf_counter() - start

    def close(self, drafter_ranks: list[int]) -> None:
        """End of stream: one EOS header to every drafter, then drain."""
        for dst in drafter_ranks:
            self._in_flight.append(self._post(dst, [torch.tensor(_header(None), dtype=torch.int64)], "end of stream"))
        while self._in_flight:
            self._wait_oldest()


class Receiver:
    """Yields this drafter's items in schedule order, keeping the next item's payload in flight
    while the caller trains on the current one (double buffering)."""

    def __init__(self, items: Iterator[Item], source_rank, comm_device: torch.device, device: torch.device):
        self._items = iter(items)
        self._source_rank = source_rank  # unit -> rank of its leader
        self.comm_device = comm_device
        self.device = device
        self.wait_s = 0.0
        self.received: list[int] = []
        self._pending = None

    def _recv_header(self, src: int, expected: str) -> list[int]:
        header = torch.empty(HEADER_LEN, dtype=torch.int64, device=self.comm_device)
        _wait_all([dist.irecv(header, src)], self.comm_device,
                  f"receiving the header of {expected} from target rank {src}")
        with _waiting_stream(self.comm_device):
            values = header.tolist()
        if values[0] != _VERSION:
            raise ChannelError(f"channel header from rank {src} has version {values[0]}, expected {_VERSION}")
        return values

    def _post(self, item: Item):
        src = self._source_rank(item.unit)
        start = time.perf_counter()
        _, seq, kind, index, step, b, s, width, dtype_code, num_tokens = self._recv_header(src, _named(item))
        self.wait_s += time.perf_counter() - start
        if seq == _EOS:
            raise ChannelError(f"target rank {src} ended its stream before item seq={item.seq}")
        if (seq, kind, index, step) != (item.seq, item.kind, item.index, item.step):
            raise ChannelError(f"rank {src} sent item seq={seq} kind={kind} index={index} step={step}, "
                               f"expected {item}")
        tensors = [*(torch.empty(b, s, dtype=torch.int64, device=self.comm_device) for _ in range(3)),
                   torch.empty(b, s, width, dtype=_DTYPES[dtype_code], device=self.comm_device)]
        works = [dist.irecv(t, src) for t in tensors]
        return item, tensors, works, num_tokens, src

    def __iter__(self):
        return self

    def __next__(self) -> Payload:
        if self._pending is None:
            self._pending = self._post(next(self._items))
        item, tensors, works, num_tokens, src = self._pending
        start = time.perf_counter()
        _wait_all(works, self.comm_device, f"receiving {_named(item)} from target rank {src}")
        self.wait_s += time.perf_counter() - start
        nxt = next(self._items, None)
        self._pending = self._post(nxt) if nxt is not None else None
        self.received.append(item.seq)
        input_ids, loss_mask, position_ids, hidden = (t.to(self.device, non_blocking=True) for t in tensors)
        return Payload(item, FeatureBatch(item.index, input_ids, loss_mask, position_ids, hidden, num_tokens))

    def close(self, unit_leaders: list[int]) -> None:
        """Every unit ends with an EOS header to every drafter: read them so no send is left hanging."""
        for src in unit_leaders:
            values = self._recv_header(src, "the end of stream")
            if values[1] != _EOS:
                raise ChannelError(f"expected end of stream from rank {src}, got item seq={values[1]}")
