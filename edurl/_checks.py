"""Input checks shared by the library, so a bad argument fails at the call with a message that says
what was expected, what was given, and the fix, not deep inside a torch kernel."""

from __future__ import annotations

import dataclasses
import math
import numbers

import torch


def check_gamma(gamma: float, name: str = "gamma") -> float:
    """A discount factor: a real number in [0, 1]. Returns it as a float."""
    if isinstance(gamma, torch.Tensor) and gamma.numel() == 1:
        gamma = gamma.item()
    if isinstance(gamma, bool) or not isinstance(gamma, numbers.Real):
        raise TypeError(f"{name} must be a number in [0, 1], got {type(gamma).__name__} {gamma!r}.")
    gamma = float(gamma)
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(
            f"{name} must be in [0, 1], got {gamma}. It weights each later reward by {name}**k; "
            "0.99 is a common choice."
        )
    return gamma


def check_tensor(
    x, name: str, *, ndim: tuple[int, ...] | None = None, floating: bool = False, boolean: bool = False
) -> torch.Tensor:
    """Check that ``x`` is a torch tensor with an allowed number of dimensions and dtype kind."""
    if not isinstance(x, torch.Tensor):
        hint = " Wrap it with torch.as_tensor(...)." if hasattr(x, "__array__") or isinstance(x, (list, tuple)) else ""
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}.{hint}")
    if ndim is not None and x.dim() not in ndim:
        want = " or ".join(f"{d}-D" for d in ndim)
        raise ValueError(f"{name} must be {want}, got shape {tuple(x.shape)}.")
    if floating and not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {x.dtype}. Use {name}.float().")
    if boolean and x.dtype != torch.bool:
        raise TypeError(
            f"{name} must be a bool tensor, got {x.dtype}. Convert it with {name}.bool() "
            "(True where the episode ended at that step)."
        )
    return x


def check_same_shape(a: torch.Tensor, b: torch.Tensor, name_a: str, name_b: str) -> None:
    if a.shape != b.shape:
        raise ValueError(f"{name_a} and {name_b} must have the same shape, got {tuple(a.shape)} and {tuple(b.shape)}.")
    if a.device != b.device:
        raise ValueError(f"{name_a} is on {a.device} but {name_b} is on {b.device}; move both to one device.")


def check_count(value, name: str, unit: str) -> None:
    """Raise a ValueError unless ``value`` is a whole number >= 1 (a Python or NumPy int, not a bool): a count
    of ``unit`` such as sweeps or episodes."""
    if not is_whole(value) or value < 1:
        raise ValueError(f"{name} must be a whole number of {unit} >= 1, got {value!r}.")


def is_whole(v) -> bool:
    """A Python or NumPy int (``np.arange``'s seeds), not a bool."""
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


_RULES = {
    "positive_int": ("a positive int", lambda v: is_whole(v) and v >= 1),
    "nonneg_int": ("an int >= 0", lambda v: is_whole(v) and v >= 0),
    "positive": ("a finite number > 0", lambda v: _real(v) and math.isfinite(v) and v > 0),
    "nonneg": ("a finite number >= 0", lambda v: _real(v) and math.isfinite(v) and v >= 0),
    "unit": ("a number in [0, 1]", lambda v: _real(v) and 0 <= v <= 1),
    "finite": ("a finite number", lambda v: _real(v) and math.isfinite(v)),
    "sizes": (
        "a non-empty tuple of positive ints",
        lambda v: isinstance(v, (tuple, list)) and len(v) > 0 and all(is_whole(s) and s >= 1 for s in v),
    ),
}


def _real(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def check_fields(
    config, *, optional: tuple[str, ...] = (), choices: dict[str, tuple] | None = None, **rules: tuple[str, ...]
) -> None:
    """Validate a config's fields at construction (call it from ``__post_init__``).

    Each keyword of ``rules`` names a rule of ``_RULES`` (``positive_int``, ``nonneg_int``, ``positive``,
    ``nonneg``, ``unit``, ``finite``, ``sizes``) and the fields it applies to; a field in ``optional`` may also be None.
    The int rules take NumPy ints too and store them as Python ints.
    ``choices`` maps a field to its allowed values. Every field annotated ``bool`` must be True or False (the
    string "False" is truthy, and 0 or 1 would be taken silently). The first bad field raises a ValueError that
    names the config, the field, what it must be and what it got, e.g.
    ``PPOConfig.num_envs must be a positive int, got 0``.
    """
    cls = type(config).__name__
    for f in dataclasses.fields(config):
        if f.type in ("bool", bool) and not isinstance(getattr(config, f.name), bool):
            raise ValueError(f"{cls}.{f.name} must be True or False, got {getattr(config, f.name)!r}.")
    for rule, names in rules.items():
        what, ok = _RULES[rule]
        for name in names:
            value = getattr(config, name)
            if value is None and name in optional:
                continue
            if not ok(value):
                none = " or None" if name in optional else ""
                raise ValueError(f"{cls}.{name} must be {what}{none}, got {value!r}.")
            if rule in ("positive_int", "nonneg_int") and type(value) is not int:  # a NumPy int: stored as Python's,
                object.__setattr__(config, name, int(value))  # which config.json, range() and torch all take
            elif rule == "sizes" and any(type(s) is not int for s in value):
                object.__setattr__(config, name, type(value)(int(s) for s in value))
    for name, allowed in (choices or {}).items():
        value = getattr(config, name)
        if value not in allowed:
            raise ValueError(f"{cls}.{name} must be one of {', '.join(map(repr, allowed))}; got {value!r}.")


def one_number(loss, source: str, checker: str, what: str = "loss") -> torch.Tensor:
    """A learner's loss as a 0-d tensor: any one-element tensor (``mean(0, keepdim=True)`` too), as the exercise's
    ``checker`` accepts it. Anything else is refused with a message that names ``source``, the function that
    returned it, before torch's ``backward`` would fail on it with its own words."""
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        got = f"shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ValueError(
            f"{source} returned a {what} of {got}; return it as a one-number tensor (reduce it with .mean()), "
            f"as {checker} asks"
        )
    return loss.reshape(())
