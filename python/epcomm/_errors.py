"""epcomm's exceptions. The C++ core raises them with the same messages as its epcomm::Error codes."""
import builtins
import math
import operator


class Error(RuntimeError):
    """Base of every epcomm error (C++ epcomm::Error)."""


class InvalidUsageError(Error, ValueError):
    """A bad argument, ranks that disagree about a collective call, or a capacity problem (InvalidUsage)."""


class TimeoutError(Error, builtins.TimeoutError):  # noqa: A001 - deliberately also the builtin
    """A peer made no progress before the deadline (Timeout). The Buffer is failed afterwards."""


class AbortedError(Error):
    """A peer reported a failure, this Buffer failed earlier, or previous_event failed (Aborted)."""


class SystemError(Error):  # noqa: A001 - epcomm.SystemError, distinct from the builtin
    """An operating-system call failed (shm_open, mmap, ...)."""


class InternalError(Error):
    """A broken invariant inside epcomm: a bug, please report it with the message."""


class IndexError(InvalidUsageError, builtins.IndexError):  # noqa: A001 - also the builtin (tuple protocol)
    """A handle index out of range: InvalidUsageError and the builtin IndexError (iteration ends on it)."""


class KeyError(InvalidUsageError, builtins.KeyError):  # noqa: A001 - also the builtin (mapping protocol)
    """A handle key it does not have: InvalidUsageError and the builtin KeyError."""


INT64 = (-(1 << 63), (1 << 63) - 1)
INT32 = (-(1 << 31), (1 << 31) - 1)


def int_arg(value, name, bounds=INT64, prefix=""):
    """An integer argument (not a float, a string or None), within bounds (inclusive): else InvalidUsageError
    naming it, so that no pybind TypeError or Python ValueError leaves the API."""
    try:
        v = operator.index(value)
    except TypeError:
        raise InvalidUsageError(f"{prefix}argument: {name}: expected an int, got {type(value).__name__}") from None
    lo, hi = bounds
    if not lo <= v <= hi:
        what = "a 64-bit integer" if bounds == INT64 else "a 32-bit integer" if bounds == INT32 else "an int"
        raise InvalidUsageError(f"{prefix}argument: {name}: expected {what} in [{lo}, {hi}], got {v}")
    return v


def number_arg(value, name, prefix=""):
    """A real number of seconds or the like: an int or a float, finite."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidUsageError(f"{prefix}argument: {name}: expected a finite number, got {value!r}")
    return float(value)
