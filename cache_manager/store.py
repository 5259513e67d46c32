"""Crash-safe persistence of the stats, keyed by a fingerprint; bad files are set aside."""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import structlog

from cache_manager.stats import StatsTables

FORMAT_VERSION = 2  # 2: keys carry the graph kind ("piecewise:128"); 1 (bare sizes, FULL) is read too
READABLE_VERSIONS = (1, 2)
log = structlog.get_logger("cache_manager")


@dataclass(frozen=True)
class Fingerprint:
    """What must match for stats from an earlier run to describe this run's graphs."""

    model: str
    dtype: str
    device_name: str
    torch_version: str
    capture_sizes: tuple[int, ...]
    max_batch: int

    def to_json(self) -> dict:
        data = asdict(self)
        data["capture_sizes"] = list(self.capture_sizes)
        return data


class StatsStore:
    """Loads and saves `StatsTables` at one path.

    `load()` never raises: a missing file gives empty tables; an unreadable, corrupt, wrongly shaped
    or foreign-fingerprint file is renamed to `<name>.bad-<ts>` / `<name>.foreign-<ts>` with a warning
    and empty tables are returned. `save()` writes a temp file in the same directory, fsyncs it,
    os.replace()s it over the target and fsyncs the directory, so a crash leaves either the old or the
    new file; it never raises (returns False and logs a warning).
    """

    def __init__(self, path: Path, fingerprint: Fingerprint) -> None:
        self.path = Path(path)
        self.fingerprint = fingerprint

    def load(self) -> StatsTables:
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return StatsTables()
        except OSError as exc:
            self._set_aside("bad", f"unreadable: {exc}")
            return StatsTables()
        try:
            data = json.loads(raw.decode("utf-8"))
            if not isinstance(data, dict):
                raise ValueError("top level is not an object")
            if data.get("format_version") not in READABLE_VERSIONS:
                raise ValueError(f"format_version {data.get('format_version')!r} is not one of {READABLE_VERSIONS}")
            if not isinstance(data.get("fingerprint"), dict):
                raise ValueError("missing fingerprint")
            tables = StatsTables.from_json(data.get("stats"))
        except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError is a ValueError
            self._set_aside("bad", f"corrupt: {exc}")
            return StatsTables()
        if data["fingerprint"] != self.fingerprint.to_json():
            self._set_aside("foreign", f"fingerprint {data['fingerprint']} != {self.fingerprint.to_json()}")
            return StatsTables()
        return tables

    def save(self, tables: StatsTables) -> bool:
        payload = {
            "format_version": FORMAT_VERSION,
            "fingerprint": self.fingerprint.to_json(),
            "saved_at": time.time(),
            "stats": tables.to_json(),
        }
        data = json.dumps(payload, indent=1, sort_keys=True).encode("utf-8")
        directory = self.path.parent
        tmp = directory / f".{self.path.name}.tmp-{os.getpid()}"
        try:
            directory.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
            self._fsync_dir(directory)
            return True
        except OSError as exc:
            log.warning("graph_stats_save_failed", path=str(self.path), error=str(exc))
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass
            return False

    @staticmethod
    def _fsync_dir(directory: Path) -> None:
        # Makes the rename itself durable; some filesystems refuse fsync on a directory.
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        except OSError:
            pass
        finally:
            os.close(fd)

    def _set_aside(self, kind: str, reason: str) -> None:
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
        target = self.path.with_name(f"{self.path.name}.{kind}-{stamp}")
        i = 1
        while target.exists():
            target = self.path.with_name(f"{self.path.name}.{kind}-{stamp}-{i}")
            i += 1
        try:
            os.replace(self.path, target)
            log.warning("graph_stats_set_aside", path=str(self.path), moved_to=str(target), reason=reason)
        except OSError as exc:
            log.warning("graph_stats_set_aside_failed", path=str(self.path), reason=reason, error=str(exc))
