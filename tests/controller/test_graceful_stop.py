"""Ctrl-C handling of a run's loop (controller/interrupts.py), with real SIGINTs to this process."""

import os
import signal

import pytest

from streamrl.controller.interrupts import GracefulStop, stop_requested


@pytest.fixture
def default_sigint():
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_the_first_ctrl_c_asks_to_stop_and_says_so_the_second_stops_at_once(default_sigint):
    said = []
    with GracefulStop(said.append) as stop:
        assert not stop_requested()
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.requested and stop_requested()  # no exception: the loop finishes its step
        assert len(said) == 1 and "stops after the current step" in said[0] and "again stops at once" in said[0]
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler and not stop_requested()
    with pytest.raises(KeyboardInterrupt):  # outside a run, Ctrl-C is Python's again
        os.kill(os.getpid(), signal.SIGINT)


def test_a_run_started_with_sigint_ignored_keeps_it_ignored():
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with GracefulStop(lambda m: None) as stop:
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
            os.kill(os.getpid(), signal.SIGINT)
            assert not stop.requested
    finally:
        signal.signal(signal.SIGINT, previous)
