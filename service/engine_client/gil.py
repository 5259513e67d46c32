"""How long a thread may keep the interpreter lock while another thread waits for it.

Each process has one busy thread (the gRPC event loop; the engine loop) beside threads that need
the lock for microseconds at a time: grpc's completion-queue poller, which wakes the event loop
after sends complete, and the engine process's pipe reader, which hands each new request to the
engine. At Python's default of 5 ms each of those waits up to 5 ms, two to three decode steps, and
a burst of 64 new requests reached the engine one switch interval apart.
"""

from __future__ import annotations

import sys

SWITCH_INTERVAL_S = 0.0005  # a third of a batch-64 decode step on an H200


def shorten_switch_interval() -> None:
    sys.setswitchinterval(SWITCH_INTERVAL_S)
