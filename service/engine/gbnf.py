"""GBNF grammars converted to Lark in a child process.

The grammar library's GBNF converter is pure Python: 50 ms for a 40 KB grammar of 2,500 alternatives.
Run on a grammar worker thread of the engine's process, it holds the GIL that the engine thread takes
back after every torch call, and each handover waits up to the interpreter's switch interval: streams
saw 72-80 ms gaps (normally 20-25 ms) on a 2-core CPU while such grammars arrived. In a child process
it costs the engine nothing but a pipe. One conversion at a time, under a wall-time budget; a child
over the budget is killed and a new one started for the next grammar.
"""

from __future__ import annotations

import os
import select
import subprocess
import sys
import threading
import time
from pathlib import Path

from service.engine.constraint_limits import InvalidConstraint

_WORKER = Path(__file__).with_name("gbnf_worker.py")


class GbnfConverter:
    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()

    def to_lark(self, text: str) -> str:
        """text (GBNF) as Lark; raises InvalidConstraint saying why the conversion failed."""
        data = text.encode("utf-8", "surrogatepass")
        with self._lock:
            deadline = time.monotonic() + self.timeout_s
            proc = self._started()
            try:
                self._write(proc, len(data).to_bytes(4, "big") + data)
                size = int.from_bytes(self._read(proc, 4, deadline), "big")
                reply = self._read(proc, size, deadline).decode("utf-8", "surrogatepass")
            except TimeoutError:
                self._stop()
                raise InvalidConstraint(f"converting the grammar to Lark took over {self.timeout_s:g} s "
                                        "(--constraint-compile-timeout): simplify it") from None
            except (OSError, EOFError) as exc:
                self._stop()
                raise InvalidConstraint(f"converting the grammar to Lark failed: {exc}") from None
        if reply[:1] != "1":
            raise InvalidConstraint(f"Failed to convert the grammar from GBNF to Lark: {reply[1:]}")
        return reply[1:]

    def close(self) -> None:
        with self._lock:
            self._stop()

    def _started(self) -> subprocess.Popen:
        if self._proc is None or self._proc.poll() is not None:
            self._proc = subprocess.Popen([sys.executable, str(_WORKER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                          stderr=subprocess.DEVNULL, bufsize=0)
        return self._proc

    def _stop(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc.stdin.close()
            self._proc.stdout.close()
            self._proc = None

    @staticmethod
    def _write(proc: subprocess.Popen, data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(proc.stdin.fileno(), view):]

    @staticmethod
    def _read(proc: subprocess.Popen, n: int, deadline: float) -> bytes:
        fd, parts, left = proc.stdout.fileno(), [], n
        while left:
            wait = deadline - time.monotonic()
            if wait <= 0 or not select.select([fd], [], [], wait)[0]:
                raise TimeoutError
            chunk = os.read(fd, left)
            if not chunk:
                raise EOFError("the converter process ended")
            parts.append(chunk)
            left -= len(chunk)
        return b"".join(parts)
