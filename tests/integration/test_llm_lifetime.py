"""The Python API's lifetime, in processes of its own: what close() gives back, Ctrl-C during
generate, other threads' exits and the interpreter's exit with an LLM left open.

Before these were handled, each closed LLM kept its model and KV cache (gc.freeze() in the warm-up
made them immortal), and an exit while the engine thread ran aborted the process ("terminate called
without an active exception", exit code 134).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OPEN = ("from service import LLM, SamplingParams\n"
        "def open_llm(**kw):\n"
        "    return LLM(model='builtin:tiny', model_cache_dir={cache!r}, device='cpu', **kw)\n")
LONG = "SamplingParams(max_tokens=2000, ignore_eos=True)"  # tens of seconds on a CPU: always interrupted


def script(model_cache_dir: Path, body: str) -> list[str]:
    return [sys.executable, "-c", OPEN.format(cache=str(model_cache_dir)) + textwrap.dedent(body)]


def run(model_cache_dir: Path, body: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(script(model_cache_dir, body), cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def assert_clean(stderr: str) -> None:
    assert "terminate called" not in stderr and "Fatal Python error" not in stderr, stderr[-3000:]


def test_close_releases_the_model_and_the_kv_cache(model_cache_dir: Path) -> None:
    # Default limits (32 sequences x 2048 tokens): about 140 MB of KV cache and buffers per LLM.
    done = run(model_cache_dir, """
        import ctypes, gc, os, weakref
        def rss_mb():
            ctypes.CDLL(None).malloc_trim(0)  # glibc: give freed heap pages back, so RSS shows what is held
            return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
        other = open_llm(max_running_seqs=2, max_seq_len=64)  # stays open: its objects stay frozen
        sizes = []
        for _ in range(5):
            llm = open_llm()
            llm.generate("hello", SamplingParams(max_tokens=2))
            runner = weakref.ref(llm._engine.lr.runner)
            model = weakref.ref(llm._engine.lr.loaded.model)
            llm.close()
            assert runner() is None and model() is None, gc.get_referrers(runner())
            sizes.append(rss_mb())
        assert gc.get_freeze_count() > 0  # the open LLM's
        assert other.generate("hello", SamplingParams(max_tokens=2))[0].outputs[0].token_ids
        other.close()
        assert gc.get_freeze_count() == 0
        print("rss", *sizes)
    """, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    sizes = [float(x) for x in done.stdout.split("rss", 1)[1].split()]
    assert max(sizes) - sizes[0] < 20, sizes  # a leak grows by ~140 MB per LLM


def test_an_unclosed_llm_is_released_with_its_last_reference_or_at_exit(model_cache_dir: Path,
                                                                        tmp_path: Path) -> None:
    stats = tmp_path / "stats.json"
    done = run(model_cache_dir, f"""
        import threading
        llm = open_llm(max_running_seqs=2, max_seq_len=64)
        llm.generate("hello", SamplingParams(max_tokens=2))
        del llm
        print("threads", *[t.name for t in threading.enumerate()])
        kept = open_llm(max_running_seqs=2, max_seq_len=64, stats_file={str(stats)!r})
        kept.generate("hello", SamplingParams(max_tokens=3))  # never closed: the exit stops its engine
    """)
    assert done.returncode == 0, done.stderr[-3000:]
    assert_clean(done.stderr)
    assert "graphserve-engine" not in done.stdout.split("threads")[1].split()
    assert stats.is_file()  # the graph statistics were saved at exit


def test_ctrl_c_aborts_generate_and_raises_keyboard_interrupt(model_cache_dir: Path) -> None:
    # Each Ctrl-C is sent once the engine runs the call's sequences (not after a fixed sleep, which a
    # loaded machine outlasts), and the engine's log lines are JSON, told apart from the traceback:
    # on a loaded machine its slow_step warnings may follow the traceback while the interpreter exits.
    proc = subprocess.Popen(script(model_cache_dir, f"""
        import threading, time
        from service.telemetry.log import configure_logging
        configure_logging("json", "warning")
        def ready_when_running():
            def watch():
                while llm._engine.num_running == 0:
                    time.sleep(0.01)
                print("ready", flush=True)
            threading.Thread(target=watch, daemon=True).start()
        llm = open_llm(max_running_seqs=4, max_seq_len=2048)
        try:
            ready_when_running()
            llm.generate(["a", "b"], SamplingParams(max_tokens=2000, ignore_eos=True, n=3))  # 6 sequences, 4 running
        except KeyboardInterrupt:
            print("interrupted", flush=True)
        out = llm.generate("c", SamplingParams(max_tokens=3, ignore_eos=True))[0].outputs[0]
        print("after", len(out.token_ids), llm._engine.num_running, llm._engine.num_waiting, flush=True)
        ready_when_running()
        llm.generate(["d", "e"], {LONG})  # not caught: the traceback and exit of a Ctrl-C
    """), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lines = []
        for _ in range(2):
            while (line := proc.stdout.readline()) and line.strip() != "ready":
                lines.append(line.strip())
            assert line, proc.stderr.read()[-3000:]
            proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    lines += out.split("\n")
    assert "interrupted" in lines and "after 3 0 0" in lines  # the aborted samples left nothing running or waiting
    assert proc.returncode in (-signal.SIGINT, 130), err[-3000:]
    logged = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
    assert all(event["level"] == "warning" for event in logged), logged  # nothing failed
    rest = "\n".join(line for line in err.splitlines() if not line.startswith("{"))
    assert rest.rstrip().endswith("KeyboardInterrupt"), err[-3000:]
    assert_clean(err)


def test_exit_while_another_thread_generates_ends_cleanly(model_cache_dir: Path) -> None:
    done = run(model_cache_dir, f"""
        import sys, threading, time
        llm = open_llm(max_running_seqs=4, max_seq_len=2048)
        errors = []
        def work():
            try:
                llm.generate(["a", "b"], {LONG})
            except RuntimeError as exc:
                errors.append(str(exc))
        threading.Thread(target=work, daemon=True).start()
        quitter = threading.Thread(target=sys.exit, args=(5,))  # a thread's exit ends only that thread
        quitter.start(); quitter.join()
        time.sleep(0.5)
        sys.exit(3)  # the engine is busy: the interpreter stops it at exit
    """)
    assert done.returncode == 3, done.stderr[-3000:]
    assert_clean(done.stderr)
