"""epcomm's exceptions. The C++ core raises them with the same messages as its epcomm::Error codes."""
import builtins


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
