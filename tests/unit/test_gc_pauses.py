"""The serving processes keep start-up's objects out of collections and name long collections in the log."""

from __future__ import annotations

import gc

import structlog

from service.telemetry.gc_pauses import freeze_startup_heap, watch_gc_pauses


def test_a_collection_over_the_threshold_is_logged_with_its_process_and_generation() -> None:
    slow = watch_gc_pauses("grpc", threshold_s=0.0)
    quiet = watch_gc_pauses("engine", threshold_s=60.0)
    try:
        with structlog.testing.capture_logs() as logs:
            gc.collect()
    finally:
        gc.callbacks.remove(slow)
        gc.callbacks.remove(quiet)
    pauses = [e for e in logs if e["event"] == "gc_pause"]
    assert [(e["process"], e["generation"]) for e in pauses] == [("grpc", 2)]
    assert pauses[0]["ms"] >= 0 and pauses[0]["log_level"] == "warning"
    with structlog.testing.capture_logs() as logs:
        gc.collect()  # removed: nothing logs any more
    assert not [e for e in logs if e["event"] == "gc_pause"]


def test_what_start_up_made_is_out_of_later_collections() -> None:
    startup = [[i] for i in range(5000)]  # containers: tracked by the collector
    try:
        frozen = freeze_startup_heap()
        assert frozen == gc.get_freeze_count() >= len(startup)
        walked = {id(o) for o in gc.get_objects()}  # what a full collection walks now
        assert not any(id(o) in walked for o in startup)
        later = [[i] for i in range(10)]
        assert all(gc.is_tracked(o) for o in later) and {id(o) for o in later} <= {id(o) for o in gc.get_objects()}
    finally:
        gc.unfreeze()
