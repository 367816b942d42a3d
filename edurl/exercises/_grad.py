"""Wrappers that turn a loss function into (loss values, gradients), so a checker compares both."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence

import torch

from edurl.exercises._core import CheckFailure, _where_it_raised


def _as_loss(x, name: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise CheckFailure(
            f"{name} should be a scalar torch.Tensor, got {type(x).__name__}"
            + (
                " (did you call .item()? keep it a tensor so it can be backpropagated)."
                if isinstance(x, float)
                else "."
            )
        )
    if x.numel() != 1:
        raise CheckFailure(
            f"{name} should be a scalar (one number), got shape {tuple(x.shape)}: reduce it with .mean()."
        )
    if not x.requires_grad:
        raise CheckFailure(
            f"{name} has no gradient: something detached it from the inputs "
            "(.detach(), .item(), torch.no_grad() or a NumPy round trip)."
        )
    return x.reshape(())


def refuse_overwrite(name: str, given: torch.Tensor, original: torch.Tensor) -> None:
    """Raise unless ``given``, the copy of ``original`` handed to the learner as a leaf with ``requires_grad``, still
    holds its values: the checker's own check of the inputs sees ``original``, and a tensor from ``.detach()`` or
    ``.data`` shares the copy's memory, so a write through one is seen only here."""
    now = given.detach()
    if now.shape != original.shape or not ((now == original) | (now.isnan() & original.isnan())).all():
        raise CheckFailure(
            f"your function changed its input `{name}` in place (a tensor from .detach() or .data shares the input's "
            "memory). Work on a copy (or build a new tensor) so the caller's data stays intact."
        )


def call_on_leaves(fn: Callable, *args):
    """``fn(*args)``, some of whose arguments are leaves with ``requires_grad``: torch's refusal of an in-place write
    to one (``lp -= q`` on an input) becomes a message that says what to do instead."""
    try:
        return fn(*args)
    except RuntimeError as err:
        if "leaf Variable that requires grad" not in str(err):
            raise
        raise CheckFailure(  # torch refuses, before the checker's own comparison of the inputs could
            f"your function changed a tensor that needs a gradient in place{_where_it_raised(err)}, which "
            "torch refuses. If it is an input, work on a copy (or build a new tensor) so the caller's data "
            "stays intact; if you made it with requires_grad=True, build it from the inputs with out-of-place "
            "operations (x = x + y, not x += y)."
        ) from err


def _parameter_name(fn: Callable, i: int) -> str:
    """The name the learner gave ``fn``'s argument ``i`` (they may rename them), or its position."""
    try:
        return list(inspect.signature(fn).parameters)[i]
    except (TypeError, ValueError, IndexError):
        return f"number {i + 1}"


def with_gradients(loss_names: Sequence[str], grad_wrt: Sequence[tuple[str, int]]) -> Callable[[Callable], Callable]:
    """Wrap ``fn(*args) -> loss or tuple of losses`` into ``(*losses, *grads)``.

    ``grad_wrt`` lists (loss name, argument index) pairs: the gradient of that loss with respect to
    that argument (zeros where the loss does not depend on it). Arguments that get gradients are
    floating-point tensors and become fresh leaves with ``requires_grad``.
    """
    grad_args = sorted({i for _, i in grad_wrt})

    def wrap(fn: Callable) -> Callable:
        def run(*args):
            args = list(args)
            given = {i: args[i] for i in grad_args}  # the checker's own check of the inputs sees these, not the clones
            for i in grad_args:
                args[i] = args[i].detach().clone().requires_grad_(True)
            out = call_on_leaves(fn, *args)
            for i, original in given.items():
                refuse_overwrite(_parameter_name(fn, i), args[i], original)
            if out is None:
                raise CheckFailure(
                    f"expected {len(loss_names)} output(s) ({', '.join(loss_names)}), got None "
                    "(did you forget the `return` statement?)."
                )
            if len(loss_names) == 1 and isinstance(out, (tuple, list)):
                raise CheckFailure(
                    f"expected {loss_names[0]} as a scalar tensor, got a {type(out).__name__} of {len(out)} (a "
                    "trailing comma after the return value?): return the tensor itself."
                )
            outs = tuple(out) if isinstance(out, (tuple, list)) else (out,)  # a list unpacks as a tuple does
            if len(outs) != len(loss_names):
                raise CheckFailure(f"expected {len(loss_names)} output(s) ({', '.join(loss_names)}), got {len(outs)}.")
            losses = {name: _as_loss(x, name) for name, x in zip(loss_names, outs)}
            grads = []
            for name, i in grad_wrt:
                (g,) = torch.autograd.grad(losses[name], args[i], retain_graph=True, allow_unused=True)
                grads.append(torch.zeros_like(args[i]) if g is None else g)
            return (*[x.detach() for x in losses.values()], *grads)

        return run

    return wrap
