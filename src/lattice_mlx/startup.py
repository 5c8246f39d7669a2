"""Ctrl-C while a command starts. A command's start-up imports the package (mlx-lm, transformers, torch) for seconds
before its main() runs; Ctrl-C there ends in one line and exit code 130, not an import traceback. The package imports
this module before anything else, and only a process started as one of the commands below is affected: a program
that imports lattice_mlx keeps its own SIGINT handling."""

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
    print("interrupted", file=sys.stderr, flush=True)
    os._exit(130)


def _started_command() -> str | None:
    """The module `python -m` is starting (sys.argv[0] stays "-m" until it is found), or the script's file name."""
    argv = getattr(sys, "orig_argv", [])
    if sys.argv and sys.argv[0] == "-m" and "-m" in argv[:-1]:
        return argv[argv.index("-m") + 1]
    return Path(sys.argv[0]).name if sys.argv and sys.argv[0] else None


if (_started_command() in QUIET_STARTUP and threading.current_thread() is threading.main_thread()
        and signal.getsignal(signal.SIGINT) is signal.default_int_handler):
    signal.signal(signal.SIGINT, _interrupted_at_startup)


def interrupts_to_main() -> None:
    """Ctrl-C raises KeyboardInterrupt again, for main() to catch, once the start-up is over."""
    if signal.getsignal(signal.SIGINT) is _interrupted_at_startup:
        signal.signal(signal.SIGINT, signal.default_int_handler)
