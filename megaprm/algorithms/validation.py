"""Input checks shared by the estimators, filters and losses.

Errors a caller can cause (wrong shapes, NaN rewards, bad masks) raise ValueError naming the
argument, what was wrong and how to fix it, before any collective runs, so one bad rank fails
loudly instead of deadlocking the others in a half-issued reduction.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch


def check_finite(x: torch.Tensor, name: str) -> None:
    """Raise ValueError if `x` holds NaN or inf.

    Fast path: a sum is finite iff every term is (NaN and inf propagate), and one reduction
    costs a fraction of `isfinite(x).all()`; only a non-finite sum (or an overflowing one,
    which the exact count then clears) pays for the elementwise test.
    """
    if not x.dtype.is_floating_point or not x.numel() or math.isfinite(x.sum().item()):
        return
    n_bad = int((~torch.isfinite(x)).sum())
    if n_bad:
        raise ValueError(f"{name} contains {n_bad} NaN/inf value(s); rewards and scores must be "
                         f"finite (map failed verifications / PRM calls to a number upstream)")


def check_tensor(x: torch.Tensor | None, name: str, shape: Sequence[int | None],
                 *, finite: bool = True, dims: str = "") -> torch.Tensor:
    """Check `x` is a tensor of `shape` (None = any size) and finite; return it.

    `dims` is the symbolic shape for the message, e.g. "[B, T]".
    """
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor of shape {dims or tuple(shape)}, "
                         f"got {type(x).__name__}")
    ok = x.dim() == len(shape) and all(s is None or x.shape[i] == s for i, s in enumerate(shape))
    if not ok:
        want = dims or tuple("*" if s is None else s for s in shape)
        raise ValueError(f"{name} has shape {tuple(x.shape)} but {want} = "
                         f"{tuple('*' if s is None else s for s in shape)} is required; "
                         f"pass one row per sample of this rank's batch")
    if finite:
        check_finite(x, name)
    return x


def check_vector(x: torch.Tensor, name: str, batch_size: int | None = None) -> torch.Tensor:
    """A finite float `[B]` per-sample value (outcome, process score)."""
    check_tensor(x, name, (batch_size,), dims="[B]")
    if not x.dtype.is_floating_point:
        raise ValueError(f"{name} has dtype {x.dtype}; pass a float tensor (e.g. {name}.float())")
    return x


def check_mask(mask: torch.Tensor, name: str, shape: Sequence[int | None],
               dims: str) -> torch.Tensor:
    """A {0,1} mask of `shape` (bool or float); returned as float."""
    check_tensor(mask, name, shape, dims=dims)
    # m - m*m is exactly 0 iff m is 0 or 1 (NaN/inf give NaN/inf): float passes only, about a
    # quarter of the cost of ((m == 0) | (m == 1)).all() on CPU.
    if mask.dtype != torch.bool and mask.numel() and not _is_binary(mask):
        raise ValueError(f"{name} must hold only 0/1 (or be bool); got values outside {{0, 1}}")
    return mask.to(torch.float32) if mask.dtype == torch.bool else mask


def _is_binary(mask: torch.Tensor) -> bool:
    if not mask.dtype.is_floating_point:
        return bool(((mask == 0) | (mask == 1)).all())
    return float(torch.addcmul(mask, mask, mask, value=-1).abs_().amax()) == 0.0


def check_choice(value: str, name: str, choices: Sequence[str]) -> str:
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not valid; choose one of {list(choices)}")
    return value
