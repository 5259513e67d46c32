"""The serving processes keep start-up's objects out of collections and name long collections in the log."""

from __future__ import annotations

import gc

import structlog

from service.telemetry.gc_pauses import freeze_startup_heap, watch_gc_pauses


def test_a_collection_over_the_threshold_is_logged_with_its_process_and_generation() -> None:
    # Names of their own: a server of another test in this process may watch (and log) as well.
    slow = watch_gc_pauses("test-slow", threshold_s=0.0)
    quiet = watch_gc_pauses("test-quiet", threshold_s=60.0)
    mine = {"test-slow", "test-quiet"}
    try:
        with structlog.testing.capture_logs() as logs:
            gc.collect()
    finally:
        gc.callbacks.remove(slow)
        gc.callbacks.remove(quiet)
    pauses = [e for e in logs if e["event"] == "gc_pause" and e["process"] in mine]
    assert [(e["process"], e["generation"]) for e in pauses] == [("test-slow", 2)]
    assert pauses[0]["ms"] >= 0 and pauses[0]["log_level"] == "warning"
    with structlog.testing.capture_logs() as logs:
        gc.collect()  # removed: nothing logs any more
    assert not [e for e in logs if e["event"] == "gc_pause" and e["process"] in mine]


def test_what_start_up_made_is_out_of_later_collections() -> None:
    startup = [[i] for i in range(5000)]  # containers: tracked by the collector
    try:
        frozen = freeze_startup_heap()
        assert frozen >= len(startup)  # (other threads may free frozen objects meanwhile: no equality)
        walked = {id(o) for o in gc.get_objects()}  # what a full collection walks now
        assert not any(id(o) in walked for o in startup)
        later = [[i] for i in range(10)]
        assert all(gc.is_tracked(o) for o in later) and {id(o) for o in later} <= {id(o) for o in gc.get_objects()}
    finally:
        gc.unfreeze()
