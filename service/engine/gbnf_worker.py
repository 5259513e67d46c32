"""The GBNF-to-Lark converter's child process (gbnf.py starts it as a script: it imports the grammar
library alone, not graphserve's packages).

Requests and replies on stdin / stdout, each a 4-byte big-endian length and that many bytes of UTF-8:
a request is the GBNF text; a reply starts with "1" (the Lark text follows) or "0" (why it failed).
"""

from __future__ import annotations

import os
import sys


def main() -> None:
    try:  # as the engine's compile threads (grammar_threads.run_when_idle): streams come first
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        os.nice(19)
    from llguidance.gbnf_to_lark import any_to_lark

    inp, out = sys.stdin.buffer, sys.stdout.buffer
    while True:
        head = inp.read(4)
        if len(head) < 4:  # the engine's process closed the pipe: it ended
            return
        text = inp.read(int.from_bytes(head, "big")).decode("utf-8", "surrogatepass")
        try:
            reply = "1" + any_to_lark(text)
        except RecursionError:
            reply = "0the grammar nests too deeply"
        except Exception as exc:  # noqa: BLE001 - whatever the converter raises is the grammar's fault
            reply = "0" + (str(exc) or type(exc).__name__)
        data = reply.encode("utf-8", "surrogatepass")
        out.write(len(data).to_bytes(4, "big") + data)
        out.flush()


if __name__ == "__main__":
    main()
