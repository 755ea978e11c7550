""":class:`rlwire.trainer.agent.calls.Call`: stopping injects only into the call's own
thread while it runs the call, and the future is always resolved (issue 64, item 10)."""

from __future__ import annotations

import concurrent.futures
import ctypes
import threading
import time

import pytest

from rlwire.trainer.agent.calls import Call, CallStopped


@pytest.fixture
def thread_errors(monkeypatch) -> list[BaseException]:
    """What escaped any thread during the test (``threading.excepthook``)."""
    seen: list[BaseException] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: seen.append(args.exc_value))
    return seen


def test_the_future_is_resolved_when_the_end_is_interrupted_after_done(thread_errors):
    """An exception raised as the call ends, after ``done`` and before the future's
    result (what a stop landing there did): the future is resolved all the same (before:
    never, and whoever awaited it waited for ever)."""
    release = threading.Event()

    class Interrupted(threading.Event):
        def set(self) -> None:
            super().set()
            raise CallStopped("landed between done and the future's result")

    call = Call(release.wait, name="test-call")
    call._done = Interrupted()
    release.set()
    assert call.future.result(timeout=5) is None
    assert call.done() and call.value is True and call.error is None
    call._thread.join(5)
    assert thread_errors == []


def test_a_future_a_waiter_cancelled_is_left_resolved_and_the_thread_ends_quietly(thread_errors):
    """``set_result`` on a cancelled future raises ``InvalidStateError``: the call still
    ends (done, its value kept) and nothing escapes its thread (before: the error did)."""
    release = threading.Event()
    call = Call(lambda: release.wait() and "done", name="test-call")
    assert call.future.cancel()
    release.set()
    assert call.wait(5) and call.value == "done"
    call._thread.join(5)
    assert not call._thread.is_alive()
    assert call.future.cancelled() and thread_errors == []


def test_stop_injects_only_while_the_thread_is_inside_the_call(monkeypatch, thread_errors):
    """The call ends just as ``stop`` decided to stop it (simulated: between its check and
    its injection). The thread cannot leave the call while ``stop`` holds the lock, so the
    injection reaches that very thread, still running, and is caught as it leaves (before:
    it went to a thread id that had ended, which another thread may have taken since). A
    later ``stop`` injects nothing."""
    entered, release = threading.Event(), threading.Event()
    real = ctypes.pythonapi.PyThreadState_SetAsyncExc
    calls: list[Call] = []
    alive_at_injection: list[bool] = []

    def blocked() -> str | bool:
        entered.set()
        return release.wait() and "done"

    def set_async_exc(ident, exc):
        if exc is not None:  # an injection (the thread's own clearing passes None)
            release.set()  # the call ends now
            calls[0]._thread.join(0.5)  # as far as it can get without the lock
            alive_at_injection.append(calls[0]._thread.is_alive())
        return real(ident, exc)

    monkeypatch.setattr(ctypes.pythonapi, "PyThreadState_SetAsyncExc", set_async_exc)
    calls.append(Call(blocked, name="test-call"))
    call = calls[0]
    assert entered.wait(30), "the call never began"  # inside the call, blocked
    call.stop()
    assert call.future.result(timeout=5) is None
    assert alive_at_injection == [True]
    assert (call.value, call.error) == ("done", None)  # it ended: the stop landed after
    call._thread.join(5)
    call.stop()  # ended: nothing more is injected
    assert alive_at_injection == [True] and thread_errors == []


def test_a_stopped_call_ends_with_call_stopped_and_a_resolved_future(thread_errors):
    """A call stopped while it runs (a loop of Python code)."""
    entered = threading.Event()

    def spin() -> None:
        entered.set()
        while True:
            time.sleep(0.001)

    call = Call(spin, name="test-call")
    assert entered.wait(30), "the call never began"
    call.stop()
    assert call.future.result(timeout=5) is None
    assert isinstance(call.error, CallStopped) and str(call.error) == "stopped past its time"
    call._thread.join(5)
    assert not call.alive() and thread_errors == []


def test_stops_racing_the_ends_of_calls_resolve_every_future_and_touch_no_other_thread(
    thread_errors,
):
    """Stops at random points around the ends of 100 short calls: every future is
    resolved, each call either returned or was stopped, and a bystander thread running
    Python code all along never receives a CallStopped."""
    quit_ = threading.Event()
    hit: list[BaseException] = []

    def bystander() -> None:
        while not quit_.is_set():
            try:
                sum(range(50))
            except CallStopped as err:
                hit.append(err)

    other = threading.Thread(target=bystander, daemon=True)
    other.start()
    try:
        for i in range(100):
            call = Call(lambda: sum(range(200)), name="test-call")
            if i % 2:
                time.sleep(0.0001 * (i % 5))
            call.stop()
            done, _ = concurrent.futures.wait([call.future], timeout=5)
            assert done, f"call {i}: the future was never resolved"
            assert (call.value, call.error) == (19900, None) or isinstance(call.error, CallStopped)
            call._thread.join(5)
    finally:
        quit_.set()
        other.join(5)
    assert hit == [] and thread_errors == []
