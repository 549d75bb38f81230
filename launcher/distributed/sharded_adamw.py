"""The drafter ranks' optimiser: AdamW on fp32 master weights sharded over the ranks (ZeRO-1), with
the model computing on compute copies that the update itself writes.

Why (what each costs at the Qwen3-8B shape: docs/perf_notes.md, "Step time, fifth pass"):
- An fp32 model under autocast casts every weight to bf16 before its forward GEMM and every weight
  gradient back to fp32 after its backward GEMM. Here the model holds its matrices in bf16 and the
  AdamW pass over the fp32 masters writes their bf16 copy as well (2 more bytes per weight in a pass
  that moves 28).
- DDP all-reduced the fp32 gradients and every drafter rank then updated all the weights from the
  whole fp32 masters and moments. Here each bucket of gradients is reduce-scattered in fp32 as soon
  as its last gradient arrives (overlapping the rest of the backward), each rank updates its 1/D of
  the masters and moments and writes its 1/D of the compute copies, and the ranks all-gather those:
  fewer bytes through the links, 1/D of the AdamW pass and 1/D of the optimiser state per rank.

Which weights: *matrices* (the Linear weights, all but 0.02% of the drafter) are held in the compute
dtype, as views of one flat buffer per bucket (each decoder layer's, and one for the rest), and
sharded; *vectors* (norm weights, biases) stay fp32 in the model (autocast casts a bias for its GEMM,
as before) and are replicated: every rank updates them all. So a step computes what the fp32 model
under autocast computed: the same bf16 weights (rounded to nearest even) in the same GEMMs, and
bf16 weight gradients that autocast cast to fp32 (equal but for the GEMM kernels' summation order).

Gradients: with one rank and one micro-batch the update reads each weight's gradient where autograd
left it (bf16 for a matrix: no copy, no cast). Otherwise a hook adds each gradient to an fp32 buffer
as it arrives (sums over micro-batches and ranks are fp32), and on the last micro-batch the buckets
are reduced in one fixed order on every rank (NCCL requires it), each as soon as it and the buckets
before it are complete.

The new weights: after the update the ranks all-gather each bucket's compute copies and nobody waits
for them there. The next forward does, bucket by bucket, just before it first reads them
(`wait_for_weights`, which the trainer hands the drafter as its `weights_ready` hook), so the transfers
overlap the rest of the update and the next forward instead of following the update (what that hides:
docs/perf_notes.md, "Step time, sixth pass").

Checkpoints: `checkpoint_pieces()` are this rank's part of the fp32 weights and moments as flat
tensors per weight at their global offsets, which each rank writes and reads itself (no gather:
launcher/run_io/checkpoint.py), so a checkpoint loads at any drafter count; `state_dict()` is the rest
(the update count and the hyper-parameters) as JSON values.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch import nn

from dflash_core.kernels.fused_adamw import adamw_, sum_of_squares
from launcher.run_io.checkpoint import KINDS, Piece

# torch 2.13 renamed both collectives (same arguments); 2.11 and 2.12 have only the old names.
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class _Done:
    """The work handle of a collective that has completed already."""

    def wait(self) -> None:
        pass


def _through_host(collective, output: torch.Tensor, input: torch.Tensor, group) -> _Done:
    """`collective(output, input)` on host copies: gloo (drafters sharing a GPU) moves CUDA tensors only
    for broadcast and all-reduce. A debugging layout, not a fast one: it waits for the device."""
    host_out = output.cpu()
    if input.untyped_storage().data_ptr() == output.untyped_storage().data_ptr():
        start = input.storage_offset() - output.storage_offset()   # in place: input is a slice of output
        host_in = host_out[start:start + input.numel()]
    else:
        host_in = input.cpu()
    collective(host_out, host_in, group=group)
    output.copy_(host_out)
    return _Done()


# Elements: every weight's view and every shard starts 256-byte aligned (bf16), as a fresh allocation
# would: cuBLAS picks its GEMM kernels by the operands' alignment, up to 256 bytes.
ALIGN = 128


@dataclasses.dataclass
class _Bucket:
    """Weights whose gradients are reduced together, laid out in one flat buffer."""
    params: list[nn.Parameter]
    offsets: list[int]              # of each weight in the flat layout
    compute: torch.Tensor           # [numel]: the weights' own storage (each param is a view of it)
    sharded: bool                   # matrices: masters and moments split over the ranks; vectors: replicated
    lo: int                         # this rank's shard [lo, hi) of the flat layout
    hi: int
    master: torch.Tensor            # fp32 [hi - lo]; a view of compute[lo:hi] when compute is fp32
    exp_avg: torch.Tensor           # fp32 [hi - lo]
    exp_avg_sq: torch.Tensor        # fp32 [hi - lo]
    grad: torch.Tensor | None = None        # fp32 [numel]: this step's gradients summed so far (lazy)
    grad_shard: torch.Tensor | None = None  # fp32 [hi - lo]: summed over the ranks as well
    waiting: int = 0                        # gradients still to arrive before the bucket is reduced
    work: object = None                     # its reduction in flight

    @property
    def separate_master(self) -> bool:
        return self.compute.dtype != torch.float32

    def weights(self):
        """(weight, its span of the flat layout, where it meets this rank's shard: `_overlap`) per weight."""
        for param, offset in zip(self.params, self.offsets):
            yield param, slice(offset, offset + param.numel()), _overlap(offset, param.numel(), self.lo, self.hi)


def _bucket_key(name: str) -> str:
    """A decoder layer's matrices share a bucket ('layers.3'); the other matrices share one."""
    parts = name.split(".")
    return ".".join(parts[:2]) if len(parts) > 2 and parts[1].isdigit() else "other"


def _aligned(n: int, multiple: int = ALIGN) -> int:
    return -(-n // multiple) * multiple


def _overlap(offset: int, numel: int, lo: int, hi: int) -> tuple[slice, slice] | None:
    """Where weight [offset, offset + numel) meets shard [lo, hi): (slice of the weight, slice of the shard)."""
    start, end = max(offset, lo), min(offset + numel, hi)
    if start >= end:
        return None
    return slice(start - offset, end - offset), slice(start - lo, end - lo)


class ShardedAdamW(torch.optim.Optimizer):
    """AdamW over `model`'s weights on the ranks of `group` (see the module docstring). Per step:
    `begin_backward(first, last)` before each micro-batch's backward, `end_backward()` after the last,
    `grad_norm()`, then `step_scaled(multiplier, skip)` and `zero_grad()`; `wait_for_weights(*modules)`
    before a forward reads the modules' weights. No call reads the device."""

    def __init__(self, model: nn.Module, group: dist.ProcessGroup, *, compute_dtype: torch.dtype, lr: float,
                 betas: tuple[float, float], eps: float, weight_decay: float):
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.named = list(model.named_parameters())
        if self.world > 1:   # every rank starts from the first rank's weights, as DDP made them
            with torch.no_grad():
                for _, param in self.named:
                    dist.broadcast(param.data, src=dist.get_global_rank(group, 0), group=group)
        self._index = {id(p): i for i, (_, p) in enumerate(self.named)}
        self._name = {id(p): name for name, p in self.named}
        self.buckets = self._layout(compute_dtype)
        self._where = {id(p): (b, o) for b in self.buckets for p, o in zip(b.params, b.offsets)}
        # Each bucket's all-gather of the last update's compute copies, while nobody has waited for it; and
        # the buckets a module's weights live in (filled as modules are asked for).
        self._gathering: dict[int, object] = {}
        self._module_buckets: dict[int, list[int]] = {}
        super().__init__([b.master for b in self.buckets],
                         dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        device = self.named[0][1].device
        self._through_host = device.type == "cuda" and dist.get_backend(group) == "gloo"
        self._step = torch.zeros((), dtype=torch.float32, device=device)
        # How this backward's gradients are kept (begin_backward): left in .grad for the update to read,
        # or summed into the fp32 buffers, and then reduced.
        self._accumulate = self._first = self._reduce = False
        self._missing: set[str] = set()
        self._reduced = 0
        for _, param in self.named:
            param.register_post_accumulate_grad_hook(self._on_gradient)

    # ------------------------------------------------------------------ layout
    def _layout(self, compute_dtype: torch.dtype) -> list[_Bucket]:
        """Buckets in the order their gradients complete in a backward (the last layer's first, the
        vectors last) and so the order they are reduced in."""
        matrices: dict[str, list] = {}
        vectors = []
        for name, param in self.named:
            (matrices.setdefault(_bucket_key(name), []) if param.dim() >= 2 else vectors).append(param)
        layers = sorted((k for k in matrices if k != "other"), key=lambda k: -int(k.split(".")[1]))
        groups = [(matrices.get(k, []), compute_dtype, True) for k in layers + ["other"]]
        groups.append((vectors, torch.float32, False))
        return [self._bucket(members, dtype, sharded) for members, dtype, sharded in groups if members]

    def _bucket(self, members: list, dtype: torch.dtype, sharded: bool) -> _Bucket:
        offsets, numel = [], 0
        for param in members:
            offsets.append(numel)
            numel += _aligned(param.numel())
        parts = self.world if sharded else 1
        numel = _aligned(numel, ALIGN * parts)
        lo = self.rank * numel // parts if sharded else 0
        hi = lo + numel // parts
        device = members[0].device
        compute = torch.zeros(numel, dtype=dtype, device=device)
        master = torch.zeros(hi - lo, device=device) if dtype != torch.float32 else compute[lo:hi]
        bucket = _Bucket(members, offsets, compute, sharded, lo, hi, master, torch.zeros_like(master),
                         torch.zeros_like(master))
        with torch.no_grad():
            for param, span, where in bucket.weights():
                flat = param.detach().reshape(-1)
                if bucket.separate_master and where is not None:   # the master from the fp32 weight, before rounding
                    master[where[1]] = flat[where[0]].float()
                compute[span].copy_(flat)
                param.data = compute[span].view(param.shape)
        return bucket

    # ------------------------------------------------------------------ gradients
    def begin_backward(self, first: bool, last: bool) -> None:
        """Before each micro-batch's backward of a step: `first` and `last` of the step's micro-batches."""
        self._check_arrived()
        self._accumulate = self.world > 1 or not (first and last)
        self._first, self._reduce = first, last and self.world > 1
        self._missing = {name for name, _ in self.named}
        if self._accumulate:
            for bucket in self.buckets:
                if bucket.grad is None:   # zeros once: the padding between weights stays zero
                    bucket.grad = torch.zeros_like(bucket.compute, dtype=torch.float32)
                    bucket.grad_shard = (torch.empty_like(bucket.master) if bucket.sharded and self.world > 1
                                         else bucket.grad[bucket.lo:bucket.hi])
                bucket.waiting = len(bucket.params)
        self._reduced = 0

    def _on_gradient(self, param: nn.Parameter) -> None:
        """Autograd's hook, once a weight's gradient of this backward is in param.grad."""
        bucket, offset = self._where[id(param)]
        self._missing.discard(self._name[id(param)])
        if not self._accumulate:
            return
        grad = param.grad.reshape(-1)
        view = bucket.grad[offset:offset + grad.numel()]
        view.copy_(grad) if self._first else view.add_(grad)
        param.grad = None
        bucket.waiting -= 1
        if self._reduce:
            self._launch_reductions()

    def _launch_reductions(self) -> None:
        """Reduce every complete bucket whose predecessors are reduced (the same order on every rank)."""
        while self._reduced < len(self.buckets) and self.buckets[self._reduced].waiting == 0:
            bucket = self.buckets[self._reduced]
            if bucket.sharded:
                bucket.work = self._collective(_REDUCE_SCATTER, bucket.grad_shard, bucket.grad)
            else:
                bucket.work = dist.all_reduce(bucket.grad, group=self.group, async_op=True)
            self._reduced += 1

    def _collective(self, collective, output: torch.Tensor, input: torch.Tensor):
        if self._through_host:
            return _through_host(collective, output, input, self.group)
        return collective(output, input, group=self.group, async_op=True)

    def _check_arrived(self) -> None:
        if self._missing:
            raise RuntimeError(f"drafter weights without a gradient in the last backward: {sorted(self._missing)}; "
                               f"every weight must take part in the loss")

    def end_backward(self) -> None:
        """After the step's last backward: the reductions are complete (on the device) for the update."""
        self._check_arrived()
        if self._reduce:
            self._launch_reductions()
            for bucket in self.buckets:
                bucket.work.wait()
                bucket.work = None

    def grad_norm(self) -> torch.Tensor:
        """The global L2 norm of this step's summed gradients (0-d fp32 on the device)."""
        if not self._accumulate:
            return sum_of_squares([p.grad for _, p in self.named]).sqrt()
        total = sum_of_squares([b.grad_shard for b in self.buckets if b.sharded])
        if self.world > 1:
            dist.all_reduce(total, group=self.group)
        replicated = [b.grad_shard for b in self.buckets if not b.sharded]
        return (total + sum_of_squares(replicated) if replicated else total).sqrt()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for _, param in self.named:
            param.grad = None

    # ------------------------------------------------------------------ update
    def step_scaled(self, multiplier: torch.Tensor, skip: torch.Tensor) -> None:
        """AdamW on gradient * `multiplier` (0-d tensor), or no update at all where `skip` (0-d tensor)
        is nonzero, on this rank's shard; then the all-gathers of the new compute copies start, and
        `wait_for_weights` waits for them."""
        self.wait_for_weights()   # the last update's (a no-op after a forward: it waited for every bucket)
        segments = self._accumulated_segments() if self._accumulate else self._direct_segments()
        masters, grads, exp_avgs, exp_avg_sqs, computes = map(list, zip(*segments))
        group = self.param_groups[0]
        beta1, beta2 = group["betas"]
        adamw_(masters, grads, exp_avgs, exp_avg_sqs, self._step, lr=group["lr"], beta1=beta1, beta2=beta2,
               eps=group["eps"], weight_decay=group["weight_decay"], multiplier=multiplier, skip=skip,
               computes=computes)
        if self.world > 1:   # in the order the next forward reads them: the buckets are in backward order
            for index in reversed(range(len(self.buckets))):
                bucket = self.buckets[index]
                if bucket.sharded:
                    self._gathering[index] = self._collective(_ALL_GATHER, bucket.compute,
                                                              bucket.compute[bucket.lo:bucket.hi])
        self._accumulate = False
        # The mark torch's LR schedulers look for (they wrap step(), which this optimiser never runs).
        self._opt_called = True

    def wait_for_weights(self, *modules: nn.Module) -> None:
        """Return once `modules`' compute copies (all of them without modules) can be read: on CUDA the
        caller's stream waits for their all-gather on the device, gloo waits on the host. Once per bucket
        and update; free when nothing is in flight (one rank)."""
        if not self._gathering:
            return
        indices = [i for module in modules for i in self._buckets_of(module)] if modules else list(self._gathering)
        for index in indices:
            work = self._gathering.pop(index, None)
            if work is not None:
                work.wait()

    def _buckets_of(self, module: nn.Module) -> list[int]:
        """The indices of the buckets that hold `module`'s weights."""
        key = id(module)
        if key not in self._module_buckets:
            held = {id(self._where[id(p)][0]) for p in module.parameters()}
            self._module_buckets[key] = [i for i, b in enumerate(self.buckets) if id(b) in held]
        return self._module_buckets[key]

    def _accumulated_segments(self):
        """(master, gradient, exp_avg, exp_avg_sq, compute copy or None) per bucket shard."""
        return [(b.master, b.grad_shard, b.exp_avg, b.exp_avg_sq,
                 b.compute[b.lo:b.hi] if b.separate_master else None) for b in self.buckets]

    def _direct_segments(self):
        """The same per weight, its gradient read from .grad (one rank: every shard is its whole bucket)."""
        return [(b.master[span], param.grad.reshape(-1), b.exp_avg[span], b.exp_avg_sq[span],
                 b.compute[span] if b.separate_master else None)
                for b in self.buckets for param, span, _ in b.weights()]

    # ------------------------------------------------------------------ checkpoints
    def checkpoint_pieces(self, writing: bool) -> list[Piece]:
        """This rank's part of the fp32 weights and AdamW moments: Pieces of one flat tensor per weight and
        kind ("model.<name>", "exp_avg.<name>", "exp_avg_sq.<name>"), where this rank's shard meets each
        matrix, and each vector whole (every rank holds them all: written by the group's first rank alone,
        when `writing`; read by every rank). Views of the live state: reading into them sets it, then
        `loaded()`."""
        pieces = []
        for bucket in self.buckets:
            if writing and not bucket.sharded and self.rank != 0:
                continue
            for param, _, where in bucket.weights():
                if where is not None:
                    name = self._name[id(param)]
                    pieces += [Piece(f"{kind}.{name}", param.numel(), where[0].start, values[where[1]])
                               for kind, values in zip(KINDS, (bucket.master, bucket.exp_avg, bucket.exp_avg_sq))]
        return pieces

    def loaded(self) -> None:
        """After checkpoint_pieces() were read into (on every rank): the compute copies from the masters."""
        self.wait_for_weights()
        with torch.no_grad():
            for bucket in self.buckets:
                if bucket.separate_master:
                    bucket.compute[bucket.lo:bucket.hi].copy_(bucket.master)
                if bucket.sharded and self.world > 1:
                    self._collective(_ALL_GATHER, bucket.compute, bucket.compute[bucket.lo:bucket.hi]).wait()

    def state_dict(self) -> dict:
        """The optimiser's state besides its tensors (checkpoint_pieces): the update count and the
        hyper-parameters, as JSON values."""
        group = {key: value for key, value in self.param_groups[0].items() if key != "params"}
        return {"step": float(self._step), "param_groups": [group]}

    def load_model_state_dict(self, weights: dict[str, torch.Tensor], keep=()) -> None:
        """Set masters and compute copies from whole fp32 weights by name (every rank reads all of them);
        the weights named in `keep` may be absent, and then stay as they are."""
        self.wait_for_weights()
        names = [name for name, _ in self.named]
        if set(weights) - set(names) or set(names) - set(weights) - set(keep):
            raise KeyError(f"the weights do not match the drafter: missing {sorted(set(names) - set(weights))}, "
                           f"unexpected {sorted(set(weights) - set(names))}")
        with torch.no_grad():
            for bucket in self.buckets:
                for param, _, where in bucket.weights():
                    if self._name[id(param)] not in weights:
                        continue
                    value = weights[self._name[id(param)]].to(device=param.device, dtype=torch.float32).reshape(-1)
                    param.copy_(value.view(param.shape))
                    if bucket.separate_master and where is not None:
                        bucket.master[where[1]] = value[where[0]]

    def load_state_dict(self, state: dict) -> None:
        """state_dict()'s values: the update count, and the hyper-parameters the checkpoint was trained with."""
        saved = state["param_groups"][0]
        group = self.param_groups[0]
        for key in group:
            if key != "params" and key in saved:
                group[key] = tuple(saved[key]) if key == "betas" else saved[key]
        self._step.fill_(state["step"])
