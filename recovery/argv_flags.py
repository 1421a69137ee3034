"""Read and edit flags in a Megatron-LM argv, a plain list of strings.

Flags come as ``--flag value`` or ``--flag=value``. The trainers' parsers do not allow
abbreviations, so a flag is matched by its full name only; when a flag is repeated the last
one wins, as in argparse. Every error is one line (a ValueError).
"""

from __future__ import annotations

import reprlib
from typing import Sequence


MAX_INT = 10**12
"""Far above any model size, batch or layout; the planner lists divisors by trial division
(a million at this bound), and --global-batch-size 10^23 hung it."""


def require_positive(name: str, value: int) -> None:
    if value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value}")


def _occurrences(args: Sequence[str], flag: str) -> list[tuple[int, str | None]]:
    """(index of the flag, its value) for every occurrence; the value is None when missing."""
    found = []
    for index, token in enumerate(args):
        if token == flag:
            value = args[index + 1] if index + 1 < len(args) else None
            found.append((index, None if value is None or value.startswith("--") else value))
        elif token.startswith(flag + "="):
            found.append((index, token[len(flag) + 1:]))
    return found


def flag_present(args: Sequence[str], flag: str) -> bool:
    """Whether ``flag`` appears, with or without a value (a store_true flag has none)."""
    return any(token == flag or token.startswith(flag + "=") for token in args)


def switched_on(args: Sequence[str], flag: str) -> bool:
    """Whether the store_true ``flag`` is on: given, and not turned off by a later
    ``--no-`` form (the trainer's opt-outs, such as ``--no-use-distributed-optimizer``)."""
    last = None
    for token in args:
        if token in (flag, "--no-" + flag[2:]):
            last = token
    return last == flag


def flag_value(args: Sequence[str], flag: str) -> str | None:
    """The value of the last ``flag`` in ``args``, or None when the flag is absent."""
    found = _occurrences(args, flag)
    if not found:
        return None
    value = found[-1][1]
    if value is None:
        raise ValueError(f"{flag} needs a value")
    return value


def int_flag(args: Sequence[str], flag: str, default: int | None = None, *,
             positive: bool = True) -> int | None:
    """``flag`` as an integer; ``default`` when absent (None: absent is allowed only then)."""
    text = flag_value(args, flag)
    if text is None:
        return default
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{flag} must be an integer, got {reprlib.repr(text)}") from None
    if abs(value) > MAX_INT:
        raise ValueError(f"{flag} must be at most 10^12, got {reprlib.repr(value)}")
    if positive:
        require_positive(flag, value)
    return value


def required_int_flag(args: Sequence[str], flag: str) -> int:
    value = int_flag(args, flag)
    if value is None:
        raise ValueError(f"the training arguments need {flag} N")
    return value


def float_flag(args: Sequence[str], flag: str, default: float) -> float:
    text = flag_value(args, flag)
    if text is None:
        return default
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"{flag} must be a number, got {reprlib.repr(text)}") from None


def set_flag(args: Sequence[str], flag: str, value: str) -> list[str]:
    """Replace every occurrence of ``flag`` in the form it was written, or append it."""
    args = list(args)
    found = _occurrences(args, flag)
    if not found:
        return [*args, flag, value]
    for index, old_value in found:
        if args[index] == flag:
            if old_value is None:
                raise ValueError(f"{flag} needs a value")
            args[index + 1] = value
        else:
            args[index] = f"{flag}={value}"
    return args


def remove_flag(args: Sequence[str], flag: str, *, takes_value: bool = True) -> list[str]:
    """``args`` without any occurrence of ``flag`` (and its value, when it takes one)."""
    kept, index = [], 0
    while index < len(args):
        token = args[index]
        index += 1
        if token == flag:
            if takes_value and index < len(args) and not args[index].startswith("--"):
                index += 1
        elif not token.startswith(flag + "="):
            kept.append(token)
    return kept
