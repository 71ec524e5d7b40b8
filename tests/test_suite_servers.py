"""The object-store servers the suite starts die with the test process that started them: a suite killed mid-run
(SIGKILL, or SIGTERM where fixture teardown does not run) must not leave servers holding ports and memory."""

import os
import signal
import subprocess
import sys
import time

import pytest

CHILD = """
from tests.s3_server import S3Server
server = S3Server().start()
print(server.process.pid, flush=True)
input()  # holds the server until killed
"""


def alive(pid: int) -> bool:
    """Whether `pid` runs; a process that exited but is not yet reaped by its new parent (a zombie) does not."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signals are Linux's")
def test_a_killed_test_process_takes_its_server_with_it():
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                             cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    server_pid = int(child.stdout.readline())
    assert alive(server_pid)
    child.send_signal(signal.SIGKILL)
    child.wait()
    deadline = time.monotonic() + 10
    while alive(server_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(server_pid), f"moto's server (pid {server_pid}) outlived the test process that started it"
