"""Crash-safe persistence of the stats, keyed by a fingerprint; bad files are set aside."""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import structlog

from cache_manager.stats import StatsTables

# 2: keys carry the graph family ("piecewise:128", and since one cache holds them "full+lora:8", which
# a reader of before sets aside as corrupt, as it would a newer version); 1 (bare sizes, FULL) is read too.
FORMAT_VERSION = 2
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

    Versions before one graph cache kept the LoRA graphs' stats in a file of their own,
    `<name>.lora`, under `lora_fingerprint`: `load()` merges its counters in, keyed by the LoRA
    descriptors, so a restart after the upgrade keeps its warm start; the first save that holds them
    moves the old file aside (`<name>.lora.migrated-<ts>`). A file this store already merged (its
    tables hold LoRA keys) is only moved aside, never counted twice.
    """

    def __init__(self, path: Path, fingerprint: Fingerprint, lora_fingerprint: Fingerprint | None = None) -> None:
        self.path = Path(path)
        self.fingerprint = fingerprint
        self.lora_fingerprint = lora_fingerprint
        self._migrated: Path | None = None  # the old LoRA file, moved aside after the next save

    @property
    def legacy_lora_path(self) -> Path:
        return self.path.with_name(self.path.name + ".lora")

    def load(self) -> StatsTables:
        tables = self._load(self.path, self.fingerprint)
        legacy = self.legacy_lora_path
        if self.lora_fingerprint is None or not legacy.exists():
            return tables
        if not tables.has_lora:
            tables = tables.merged(self._load(legacy, self.lora_fingerprint).as_lora())
        self._migrated = legacy if legacy.exists() else None  # (a bad or foreign one was set aside)
        return tables

    def _load(self, path: Path, fingerprint: Fingerprint) -> StatsTables:
        if path.exists() and not path.is_file():  # a FIFO or device would block the read
            self._set_aside(path, "bad", "not a regular file")
            return StatsTables()
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return StatsTables()
        except OSError as exc:
            self._set_aside(path, "bad", f"unreadable: {exc}")
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
            self._set_aside(path, "bad", f"corrupt: {exc}")
            return StatsTables()
        if data["fingerprint"] != fingerprint.to_json():
            self._set_aside(path, "foreign", f"fingerprint {data['fingerprint']} != {fingerprint.to_json()}")
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
        except OSError as exc:
            log.warning("graph_stats_save_failed", path=str(self.path), error=str(exc))
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass
            return False
        if self._migrated is not None:
            self._set_aside(self._migrated, "migrated", f"its counters are in {self.path} now")
            self._migrated = None
        return True

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

    @staticmethod
    def _set_aside(path: Path, kind: str, reason: str) -> None:
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
        target = path.with_name(f"{path.name}.{kind}-{stamp}")
        i = 1
        while target.exists():
            target = path.with_name(f"{path.name}.{kind}-{stamp}-{i}")
            i += 1
        try:
            os.replace(path, target)
            log.warning("graph_stats_set_aside", path=str(path), moved_to=str(target), reason=reason)
        except OSError as exc:
            log.warning("graph_stats_set_aside_failed", path=str(path), reason=reason, error=str(exc))
