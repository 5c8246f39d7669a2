"""Ctrl-C while a command starts. A command's start-up imports the package (mlx-lm, transformers, torch) for seconds
before its main() runs; Ctrl-C there ends in one line and exit code 130, not an import traceback. The package imports
this module before anything else, and only a process started as one of the commands below is affected: a program
that imports lattice_mlx keeps its own SIGINT handling."""

import _thread
import os
import signal
import sys
import threading
from pathlib import Path

# The commands whose main() calls `interrupts_to_main()` first (the console script by its name).
QUIET_STARTUP = {"lattice_mlx.generate", "lattice_mlx.convert", "lattice_mlx.chat", "lattice_mlx.cache_prompt",
                 "lattice_mlx.server", "lattice-generate"}


def _interrupted_at_startup(signum, frame):
    # exits at once: an exception raised here can land inside native code importing (torch's, through pybind11),
    # which then aborts the process with a C++ traceback; before main() there is nothing to clean up or flush
    os.write(2, b"interrupted\n")  # (not print: this can run while the main thread is inside a write to stderr)
    os._exit(130)


def _started_command() -> str | None:
    """The module `python -m` is starting (sys.argv[0] stays "-m" until it is found), or the script's file name."""
    argv = getattr(sys, "orig_argv", [])
    if sys.argv and sys.argv[0] == "-m" and "-m" in argv[:-1]:
        return argv[argv.index("-m") + 1]
    return Path(sys.argv[0]).name if sys.argv and sys.argv[0] else None


# While a command starts, SIGINT is blocked in every thread and taken by a watcher thread, which hands it to the
# main thread's Python handler. Delivered as usual, a Ctrl-C can be lost: MLX's CPU backend checks for its compiler
# once per process, at its first compiled-kernel build, through C's system(), which ignores SIGINT in the calling
# process until its child exits (POSIX), and a signal that arrives meanwhile is discarded unless it is blocked.
# Blocked from the package's first import on, it is also blocked in every thread started later (loading, MLX's
# own), so it waits in the process's queue until the watcher takes it. Linux only (elsewhere, as usual). The watcher
# waits in sigwait, so that it takes a Ctrl-C at once: a pending SIGINT is discarded, blocked or not, when system()
# sets it to SIG_IGN (POSIX), which a watcher that polled lost (seen). Not sigtimedwait: CPython's, interrupted by
# another signal past its timeout, returns an uninitialised siginfo instead of None (seen: a "SIGINT" from pid 0
# stopped servers nobody signalled). `end_startup` wakes it with a signal of its own (_WAKE) to stop it.
_WAKE = getattr(signal, "SIGRTMAX", None)
_watcher: threading.Thread | None = None


def _watch() -> None:
    while signal.sigwait({signal.SIGINT, _WAKE}) == signal.SIGINT:
        if signal.getsignal(signal.SIGINT) is _interrupted_at_startup:
            _interrupted_at_startup(signal.SIGINT, None)  # (at once, even while the main thread runs native code)
        _thread.interrupt_main()  # the main thread's SIGINT handler runs at its next bytecode


def watch_interrupts() -> None:
    """Start taking SIGINT on a watcher thread (see above); the main thread only. A no-op but on Linux."""
    global _watcher
    if _watcher is not None or not sys.platform.startswith("linux") or _WAKE is None:
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, _WAKE})
    _watcher = threading.Thread(target=_watch, name="sigint-watcher", daemon=True)
    _watcher.start()  # (the watcher keeps _WAKE blocked, for its sigwait; the other threads need not)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {_WAKE})


def end_startup() -> None:
    """Ctrl-C reaches the main thread directly again, where it also interrupts a blocking read (input(), stdin),
    which a handler run for the watcher cannot: call it before the command waits on its user. A SIGINT that came
    meanwhile is delivered here, to the handler installed now."""
    global _watcher
    if _watcher is None:
        return
    signal.pthread_kill(_watcher.ident, _WAKE)  # (a SIGINT pending beside it is taken first: lower numbers first)
    _watcher.join()
    _watcher = None
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


if (_started_command() in QUIET_STARTUP and threading.current_thread() is threading.main_thread()
        and signal.getsignal(signal.SIGINT) is signal.default_int_handler):
    signal.signal(signal.SIGINT, _interrupted_at_startup)
    watch_interrupts()


def interrupts_to_main() -> None:
    """Ctrl-C raises KeyboardInterrupt again, for main() to catch, once the imports are over. Call it first inside
    the `try` that catches KeyboardInterrupt: a SIGINT pending when the handler changes raises right here."""
    if signal.getsignal(signal.SIGINT) is _interrupted_at_startup:
        signal.signal(signal.SIGINT, signal.default_int_handler)
