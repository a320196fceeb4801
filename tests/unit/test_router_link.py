"""A worker's registration with its router gives up when the worker is told to stop: a SIGTERM
while the router is away used to wait out the whole registration timeout (60 s), and the
launcher's stop then ended it with SIGKILL."""

from __future__ import annotations

import threading

import pytest

from pdserve_proto import pdserve_pb2 as pb
from serving.loop import LoadSnapshot
from serving.router_link import RouterLink


def test_registration_stops_when_the_worker_is_stopping():
    link = RouterLink("127.0.0.1:1", pb.RegisterRequest(worker_id="d0"), LoadSnapshot)
    stop = threading.Event()
    threading.Timer(0.3, stop.set).start()
    try:
        with pytest.raises(InterruptedError, match="stopped while registering"):
            link.register(600.0, stop)  # nothing listens there: it would retry for 600 s
    finally:
        link.stop()


def test_registration_times_out_without_a_stop():
    link = RouterLink("127.0.0.1:1", pb.RegisterRequest(worker_id="d0"), LoadSnapshot)
    try:
        with pytest.raises(TimeoutError, match="did not accept the registration"):
            link.register(0.3)
    finally:
        link.stop()
