"""`lit-ess` ends its process as the interpreter would, less the teardown of the imported libraries
(lit_ess.cli.run): the exit status, threads, atexit handlers and buffered files are those of a normal exit."""
import gzip
import subprocess
import sys

import pytest

from e2e_utils import pythonpath

SCRIPT = r"""
import atexit, gzip, sys, threading, time
import lit_ess.cli

OPEN = []

def main():
    OPEN.append(open(sys.argv[1], "w"))          # kept open, never closed: only its buffer holds the line
    OPEN[0].write("written by the run\n")
    OPEN.append(gzip.open(sys.argv[1] + ".gz", "wt"))  # its trailer is written on close
    OPEN[1].write("compressed\n")
    atexit.register(lambda: open(sys.argv[1] + ".atexit", "w").write("ran"))
    def late():
        time.sleep(0.5)
        open(sys.argv[1] + ".thread", "w").write("done")
    threading.Thread(target=late).start()        # non-daemon: the exit waits for it
    end = sys.argv[2]
    if end == "raise ValueError":
        raise ValueError("boom")
    if end.startswith("exit "):
        arg = end[5:]
        sys.exit(int(arg) if arg.isdigit() else arg)

lit_ess.cli.main = main
lit_ess.cli.run()
"""


@pytest.mark.parametrize("end, code", [("return", 0), ("exit 2", 2), ("exit a message", 1), ("raise ValueError", 1)])
def test_the_command_exits_with_its_status_threads_atexit_handlers_and_files(end, code, tmp_path):
    log = tmp_path / "log.txt"
    res = subprocess.run([sys.executable, "-c", SCRIPT, str(log), end], capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": pythonpath(), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
    assert res.returncode == code, res.stderr[-2000:]
    assert log.read_text() == "written by the run\n"
    assert gzip.decompress((tmp_path / "log.txt.gz").read_bytes()) == b"compressed\n"
    assert (tmp_path / "log.txt.atexit").read_text() == "ran"
    assert (tmp_path / "log.txt.thread").read_text() == "done"
    if end == "exit a message":
        assert res.stderr.strip().endswith("a message")
    if end == "raise ValueError":
        assert "ValueError: boom" in res.stderr
