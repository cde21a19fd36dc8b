"""EventOverlap: completion of an asynchronous dispatch or combine (docs/normal-mode.md)."""
from concurrent.futures import Future

from . import _C
from ._errors import InvalidUsageError


class _FutureEvent:
    """A concurrent.futures.Future seen as an event (calls the Python front runs on a worker thread)."""

    def __init__(self, future):
        self._future = future

    def wait(self):
        self._future.result()

    def is_complete(self):
        return self._future.done()


class EventOverlap:
    """wait() blocks until the operation completed and raises its error (every time it is called);
    `event` is an epcomm event or a concurrent.futures.Future;
    current_stream_wait() is wait() (CPU: there are no streams); is_complete(); `with event:` waits on exit.
    EventOverlap() with no event is a completed event (DeepEP's signature: event, extra_tensors)."""

    def __init__(self, event=None, extra_tensors=None):
        if isinstance(event, EventOverlap):
            event = event.event
        if isinstance(event, Future):
            event = _FutureEvent(event)
        if event is not None and not isinstance(event, (_C.Event, _FutureEvent)):
            raise InvalidUsageError(f"EventOverlap: argument: event: expected an event of epcomm or None, got "
                                    f"{type(event).__name__}")
        self.event = event
        # Kept alive until the event is dropped, as in DeepEP (epcomm itself also holds what is in flight).
        self.extra_tensors = extra_tensors

    def wait(self):
        if self.event is not None:
            self.event.wait()

    def current_stream_wait(self):
        self.wait()

    def is_complete(self):
        return self.event is None or self.event.is_complete()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        self.wait()
        return False

    def __repr__(self):
        return f"EventOverlap(complete={self.is_complete()})"


def c_event(previous_event, what="previous_event"):
    """The C++ event behind a previous_event argument (None for None or a completed EventOverlap)."""
    if previous_event is None:
        return None
    if isinstance(previous_event, EventOverlap):
        if isinstance(previous_event.event, _FutureEvent):  # a Python-side call: complete it here
            previous_event.wait()
            return None
        return previous_event.event
    if isinstance(previous_event, _C.Event):
        return previous_event
    raise InvalidUsageError(f"argument: {what}: expected an EventOverlap or None, got {type(previous_event).__name__}")
