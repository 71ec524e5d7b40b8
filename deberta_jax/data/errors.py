"""How entry points end on what a user can cause (a bad config value, a missing or unreadable file, a damaged
checkpoint): one line naming the thing and the fix, without a traceback. The library raises these as ValueError,
OSError and their subclasses, with messages written for the user; anything else is a bug and keeps its traceback.
A user error's traceback is one environment variable away (`TRACEBACK_VARIABLE`), for reporting a suspected bug.
"""

from __future__ import annotations

import functools
import os
import re
import signal
import sys
from collections.abc import Callable

from deberta_jax import storage

TRACEBACK_VARIABLE = "DEBERTA_JAX_TRACEBACK"
USER_ERRORS: tuple[type[BaseException], ...] = (ValueError, OSError)


def check_location(flag: str, value: str) -> None:
    """Refuses a folder or file flag whose value would quietly name somewhere else: empty (the current folder) or a
    bucket URL missing a slash (`gs:/bucket/run`, which a local path takes for a folder named `gs:`). Raises
    ValueError naming the flag and the fix."""
    if not value.strip():
        raise ValueError(f"{flag} is empty: give a folder, local or gs://bucket/... (an empty path would mean the "
                         "current folder)")
    scheme = re.match(r"([a-z0-9]+):/?(?!/)", value)
    if scheme and scheme[1] in storage.SCHEMES:
        raise ValueError(f"{flag}={value!r} is neither a bucket URL nor a local path: write "
                         f"{scheme[1]}://{value[len(scheme[0]):]} (two slashes)")


def list_flag(name: str, default, help: str, flag_values=None) -> None:
    """`flags.DEFINE_list` that refuses an empty item (`--seeds=0,`, `--runs=a,,b`): absl would hand back an empty
    name, which then matches nothing or everything. The refusal is absl's one-line flag error."""
    from absl import flags

    flag_values = flag_values or flags.FLAGS
    flags.DEFINE_list(name, default, help, flag_values=flag_values)
    flags.register_validator(name, lambda items: items is None or all(item.strip() for item in items),
                             message="an empty item (a trailing or doubled comma?): give the items separated by "
                                     "single commas", flag_values=flag_values)


def reporting_user_errors(main: Callable, program: str, also: tuple[type[BaseException], ...] = ()) -> Callable:
    """`main` (an absl main) that exits with `program: message` for `USER_ERRORS` and `also`, unless
    `TRACEBACK_VARIABLE` is set, and with status 130 on Ctrl-C."""
    @functools.wraps(main)
    def wrapped(argv):
        try:
            result = main(argv)
        except USER_ERRORS + also as err:
            if os.environ.get(TRACEBACK_VARIABLE):
                raise
            sys.exit(f"{program}: {err}\n({TRACEBACK_VARIABLE}=1 shows where it was raised)")
        except KeyboardInterrupt:  # the `finally` blocks on the way here have closed what was open
            sys.stdout.flush()
            sys.stderr.write(f"{program}: interrupted\n")
            sys.stderr.flush()
            # Skip the interpreter's teardown, which can crash ("Fatal Python error: Segmentation fault") while
            # XLA's compiler threads still run, as they do in a run's first seconds.
            os._exit(130)
        # The work is done: a Ctrl-C from here on would only turn a finished program's exit into a traceback.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        return result
    return wrapped
