"""Refuse weights that hold NaN or inf: a diverged drafter must stop where it is read or
written, not be exported or evaluated as if it were a model."""

import torch


class NonFiniteError(ValueError):
    """A module's parameter or buffer holds NaN or inf; the message names the tensor."""


def check_finite(module, where):
    """Raise NonFiniteError naming the first parameter or buffer of `module` with a NaN or inf
    value; `where` says what was being done with the weights (the start of the message)."""
    for kind, named in (("parameter", module.named_parameters()), ("buffer", module.named_buffers())):
        for name, tensor in named:
            if not tensor.is_floating_point():
                continue
            bad = tensor.numel() - int(torch.isfinite(tensor.detach()).sum())
            if bad:
                raise NonFiniteError(
                    f"{where}: {kind} {name!r} holds {bad} non-finite values (NaN or inf) out of "
                    f"{tensor.numel()}; the weights are unusable (training diverged? an earlier "
                    f"checkpoint may still be finite)")
