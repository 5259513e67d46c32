"""The compile cache: the kernels' start-up self-check results, and Triton's compiled kernels, kept in
one directory across restarts (a Kubernetes volume keeps it across pods).

A self-check's result holds only for the machine and code that produced it, so each is stored under
a key: the device (name, compute capability, driver), the versions of torch, CUDA, Triton and
graphserve, a digest of the kernels' source, and what the caller adds (the model's shape, dtypes).
One file per key (`<what>-<digest>.json`): a changed key misses and checks again, and caches of
other models or GPUs in the same directory stay. A file that does not parse, or whose recorded key
is not the one asked for, is ignored (and rewritten). Writes go to a temporary file and replace the
old one, so a crash or two pods sharing the volume never leave half a file. A directory that cannot
be written costs a warning, never the start.

Triton keeps its own cache; unless TRITON_CACHE_DIR is set, `open` points it at `<dir>/triton`.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import structlog
import torch

log = structlog.get_logger("graphserve.compile_cache")


@functools.cache
def _kernels_digest() -> str:
    """The kernels' source: a changed kernel is checked again even under the same version number."""
    h = hashlib.sha256()
    for path in sorted(Path(__file__).parent.glob("*.py")):
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:16]


def environment_key(device: torch.device) -> dict[str, Any]:
    """What a self-check's result depends on besides the model: the device and the software."""
    from service.config import version

    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    key: dict[str, Any] = {"device": device.type, "torch": torch.__version__, "cuda": torch.version.cuda,
                           "triton": triton_version, "graphserve": version(), "kernels": _kernels_digest()}
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        driver = getattr(torch._C, "_cuda_getDriverVersion", None)
        key |= {"device_name": torch.cuda.get_device_name(index),
                "capability": list(torch.cuda.get_device_capability(index)),
                "driver": driver() if driver is not None else None}
    return key


class CompileCache:
    """Self-check results by key, as files under `root`."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    @classmethod
    def open(cls, root: Path, environ: dict[str, str] | None = None) -> CompileCache:
        """The cache at `root`; Triton's compiled kernels go under it unless TRITON_CACHE_DIR says elsewhere."""
        environ = os.environ if environ is None else environ
        cache = cls(root)
        triton = environ.setdefault("TRITON_CACHE_DIR", str(cache.root / "triton"))
        log.info("compile_cache", dir=str(cache.root), triton_cache_dir=triton)
        return cache

    def path(self, what: str, key: dict[str, Any]) -> Path:
        digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:20]
        return self.root / f"{what}-{digest}.json"

    def lookup(self, what: str, key: dict[str, Any]) -> dict[str, Any] | None:
        """The results stored for `key`, or None (logged: `compile_cache_miss` with why)."""
        path = self.path(what, key)
        try:
            record = json.loads(path.read_text())
        except FileNotFoundError:
            log.info("compile_cache_miss", what=what, file=str(path), reason="no results for this key")
            return None
        except (OSError, ValueError) as e:
            log.warning("compile_cache_miss", what=what, file=str(path), reason=f"unreadable: {e}"[:300])
            return None
        stored = record.get("key") if isinstance(record, dict) else None
        if stored != json.loads(json.dumps(key, default=str)) or not isinstance(record.get("results"), dict):
            log.warning("compile_cache_miss", what=what, file=str(path), reason="recorded for another key")
            return None
        log.info("compile_cache_hit", what=what, file=str(path))
        return record["results"]

    def store(self, what: str, key: dict[str, Any], results: dict[str, Any]) -> bool:
        """Writes the results for `key` atomically; False (logged) when the directory cannot be written."""
        path = self.path(what, key)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
            try:
                with os.fdopen(fd, "w") as f:
                    json.dump({"key": key, "results": results}, f, indent=1, sort_keys=True, default=str)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, path)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
        except OSError as e:
            log.warning("compile_cache_not_saved", what=what, file=str(path), error=str(e)[:300])
            return False
        return True
