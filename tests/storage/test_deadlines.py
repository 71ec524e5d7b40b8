"""The storage deadline's watchdog: a call that ends, by returning or by raising, is no longer watched, so the
watchdog never ends the process for a call that is over; one that overruns ends it with its one line; a limit that
would switch it off is refused."""

import subprocess
import sys

import pytest

from deberta_jax.storage import deadlines
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


@pytest.mark.parametrize("limit", [float("nan"), float("inf"), 0.5, -1.0])
def test_a_limit_that_is_not_a_number_of_seconds_of_at_least_one_is_refused_naming_the_setting(limit):
    """NaN would switch the deadline off (no time exceeds it), as would infinity; under a second, every call ends
    the process."""
    with pytest.raises(ValueError, match=r"^--storage_deadline_s=(nan|inf|0\.5|-1): give the seconds one storage call "
                                         r"may run, at least 1"):
        deadlines.set_limit(limit, "probe", "--storage_deadline_s")

