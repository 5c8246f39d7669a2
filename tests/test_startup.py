"""Ctrl-C while a command starts (startup.py): a SIGINT that arrives while the process runs C's system() (MLX's CPU
backend builds its compiled kernels so) is not lost; a blocking read after `end_startup` is interrupted; and a
SIGINT that lands between the start-up handler and each command's `try` is caught there, not a traceback."""

import importlib
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

STARTUP = Path(__file__).parents[1] / "src" / "lattice_mlx" / "startup.py"
needs_watcher = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only: SIGINT as usual")

# Loads startup.py alone (the package's imports would take seconds), then does what argv says.
SCRIPT = f"""
import importlib.util, os, sys, time
spec = importlib.util.spec_from_file_location("startup", {str(STARTUP)!r})
startup = importlib.util.module_from_spec(spec)
spec.loader.exec_module(startup)
if "watch" in sys.argv:
    startup.watch_interrupts()
if "end" in sys.argv:
    startup.end_startup()
try:
    print("ready", flush=True)
    if "system" in sys.argv:
        os.system("sleep 1.5")  # (glibc's system() ignores SIGINT in this process meanwhile)
    else:
        sys.stdin.read()
    time.sleep(0.3)  # (bytecode, where a pending handler runs)
    print("not interrupted", flush=True)
except KeyboardInterrupt:
    print("interrupted", flush=True)
"""


def _interrupt(*modes: str, close_stdin_after: float | None = None) -> tuple[str, float]:
    """Starts SCRIPT, sends SIGINT half a second after it is ready; (its last line, seconds from the signal)."""
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT, *modes], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(0.5)
        tic = time.monotonic()
        proc.send_signal(signal.SIGINT)
        if close_stdin_after is not None:
            time.sleep(close_stdin_after)
            assert proc.poll() is None, "the read ended before its input did"
            proc.stdin.close()
        proc.wait(timeout=30)
        return proc.stdout.read().strip().splitlines()[-1], time.monotonic() - tic
    finally:
        proc.kill()


@needs_watcher
def test_a_ctrl_c_during_system_reaches_the_main_thread():
    last, _ = _interrupt("system")
    if last != "not interrupted":
        pytest.skip("this libc's system() does not ignore SIGINT: nothing to watch for")  # the control, unwatched
    assert _interrupt("watch", "system")[0] == "interrupted"


@needs_watcher
def test_after_end_startup_ctrl_c_interrupts_a_blocking_read():
    last, seconds = _interrupt("watch", "end")
    assert last == "interrupted" and seconds < 10
    # the control: watched, the handler waits for the read to end (here when its input closes)
    assert _interrupt("watch", close_stdin_after=1.0)[0] == "interrupted"


def _interrupted_on_entry(*args, **kwargs):
    raise KeyboardInterrupt  # what interrupts_to_main raises when a SIGINT is pending as the handler changes


@pytest.mark.parametrize("module, argv, line", [
    ("lattice_mlx.generate", ["--max-tokens", "2"], "interrupted"),
    ("lattice_mlx.cache_prompt", ["--prompt", "x", "--prompt-cache-file", "{tmp}/c.safetensors"],
     "interrupted: nothing was written"),
    ("lattice_mlx.convert", ["--hf-path", "{tmp}/in", "--mlx-path", "{tmp}/out"],
     "interrupted: nothing was written (the partial output was removed)"),
    ("lattice_mlx.chat", ["--max-tokens", "2"], "interrupted: bye"),
    ("lattice_mlx.server", ["--port", "0", "--no-warmup"], "error: interrupted while loading"),
])
def test_a_ctrl_c_as_the_handler_changes_is_caught(module, argv, line, monkeypatch, capsys, tmp_path):
    mod = importlib.import_module(module)
    monkeypatch.setattr(mod, "interrupts_to_main", _interrupted_on_entry)
    try:
        rc = mod.main([a.format(tmp=tmp_path) for a in argv])
    except KeyboardInterrupt:  # (escaping, it would stop the whole pytest session)
        pytest.fail(f"Ctrl-C escaped {module}.main")
    assert rc == 130 and capsys.readouterr().err.strip().splitlines() == [line]
    assert not list(tmp_path.iterdir())


def test_a_ctrl_c_as_the_server_installs_its_stopper_is_caught(monkeypatch, capsys):
    """The last moment of the start-up: a SIGINT pending when the Stopper replaces the handler raises there."""
    server = importlib.import_module("lattice_mlx.server")
    closed = []
    monkeypatch.setattr(server, "Stopper", _interrupted_on_entry)
    monkeypatch.setattr(server, "_closed", lambda httpd, code: closed.append(httpd) or code)
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        rc = server.main(["--port", "0", "--no-warmup"])
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C escaped the server's main")
    finally:  # (main set SIGTERM's start-up handler: this test process keeps its own)
        for s, handler in before.items():
            signal.signal(s, handler)
    assert rc == 130 and capsys.readouterr().err.strip().splitlines() == ["error: interrupted while starting"]
    assert closed and closed[0] is not None
    closed[0].server_close()
