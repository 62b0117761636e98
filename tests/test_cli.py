"""The ``april-slime`` command line: commands, and the emulator's options and errors."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys

import pytest

from april_workbench import cli


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    try:
        rc = cli.main(list(argv))
    except SystemExit as e:  # argparse's --help and usage errors
        rc = e.code
    out = capsys.readouterr()
    return rc, out.out, out.err


def _one_line(err: str) -> str:
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


def test_usage_and_unknown_command(capsys):
    rc, out, _ = _run(capsys)
    assert rc == 2 and "commands:" in out and "emulator" in out
    rc, _, err = _run(capsys, "nope")
    assert rc == 2 and "unknown command 'nope'" in err


def test_emulator_help_names_the_program_and_shows_defaults(capsys):
    rc, out, _ = _run(capsys, "emulator", "--help")
    assert rc == 0
    assert out.startswith("usage: april-slime emulator ")
    assert "(default: 30000)" in out and "(default: 1)" in out


@pytest.mark.parametrize("argv, words", [
    (["--port", "99999"], ["--port", "0..65535", "99999"]),
    (["--port", "-1"], ["--port", "-1"]),
    (["--port", "65535", "--engines", "2"], ["--port", "65535", "engine"]),
    (["--port", "abc"], ["--port", "'abc'"]),
    (["--engines", "0"], ["--engines", "0"]),
    (["--time-scale", "0"], ["--time-scale", "0"]),
    (["--time-scale", "inf"], ["--time-scale", "inf"]),
    (["--decode-t0", "-1"], ["--decode-t0", "-1"]),
    (["--eos-token-id", "10", "--vocab-size", "10"], ["--eos-token-id", "10"]),
    (["--length-dist", "nope"], ["--length-dist", "nope"]),
])
def test_emulator_bad_options_give_one_line_naming_the_option(capsys, argv, words):
    rc, _, err = _run(capsys, "emulator", *argv)
    line = _one_line(err)
    assert rc == 2 and line.startswith("april-slime emulator: ")
    for word in words:
        assert word in line


@contextlib.contextmanager
def _listening(port: int = 0):
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", port))
    s.listen()
    try:
        yield s.getsockname()[1]
    finally:
        s.close()


def test_emulator_reports_the_port_in_use(capsys):
    with _listening() as port:
        rc, _, err = _run(capsys, "emulator", "--port", str(port))
    line = _one_line(err)
    assert rc == 1 and f"port {port} (router)" in line and "in use" in line


def test_emulator_reports_an_engine_port_in_use(capsys):
    with _listening() as taken:
        if taken <= 1024:
            pytest.skip("no unprivileged port below the one the OS gave")
        rc, _, err = _run(capsys, "emulator", "--port", str(taken - 1), "--engines", "2")
    line = _one_line(err)
    if f"port {taken - 1} (router)" in line:
        pytest.skip(f"port {taken - 1} was taken by something else")
    assert rc == 1 and f"port {taken} (engine 1 of 2)" in line


def _ctrl_c_as_in_a_terminal() -> None:
    # A command run in the background of a shell without job control (a CI step's `cmd &`) starts
    # with SIGINT ignored, and its children inherit that: Ctrl-C is what this test sends, so the
    # child gets the disposition a terminal gives it (Python then turns SIGINT into KeyboardInterrupt).
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_emulator_still_serves_on_free_ports():
    proc = subprocess.Popen([sys.executable, "-m", "april_workbench.cli", "emulator", "--port", "0",
                             "--engines", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_ctrl_c_as_in_a_terminal)
    try:
        lines = [proc.stdout.readline() for _ in range(3)]
        assert lines[0].startswith("router http://127.0.0.1:")
        assert all(line.startswith("engine http://127.0.0.1:") for line in lines[1:])
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            # communicate, not wait: a child blocked writing to a full stderr pipe never exits
            _, err = proc.communicate(timeout=120)  # a bound only: SIGINT ends it at once
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            _, err = proc.communicate()
    assert proc.returncode == 0, err
