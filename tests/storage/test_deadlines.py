"""The storage deadline's watchdog: a call that ends, by returning or by raising, is no longer watched, so the
watchdog never ends the process for a call that is over; one that overruns ends it with its one line."""

import subprocess
import sys

from tests.helpers import REPO

PROGRAM = """
import sys, time
from deberta_jax.storage import deadlines
deadlines.set_limit(1, "probe", "--storage_deadline_s")
for outcome in ("returns", "raises"):
    try:
        with deadlines.watched(f"a call that {outcome}", "gs://store"):
            if outcome == "raises":
                raise OSError("refused")
    except OSError:
        pass
time.sleep(float(sys.argv[1]))
print("survived", flush=True)
with deadlines.watched("a call that hangs", "gs://store"):
    time.sleep(30)
"""


def test_finished_calls_are_unwatched_and_an_overdue_one_ends_the_process():
    run = subprocess.run([sys.executable, "-c", PROGRAM, "2.5"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert run.stdout.strip() == "survived", run.stderr[-2000:]
    assert run.returncode == 1
    assert run.stderr.strip() == ("probe: a call that hangs did not finish within 1 s: gs://store is not answering. "
                                  "Stopped; what was saved before it is intact, so rerun the same command to resume; "
                                  "--storage_deadline_s sets the limit")
