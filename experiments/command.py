"""What every study's `python -m experiments.<study>` shares with the `marge` command: logging, a SIGTERM that
stops what the study started (a private redis-server, a local Ray) through its `finally` blocks, and bad input
answered in one line without a traceback."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable

from marge.util.files import setup_logging
from services.cli import exit_cleanly_on_sigterm
from services.driver.lock import RunLocked

log = logging.getLogger("marge")


def run_study(parser: argparse.ArgumentParser, command: Callable[[argparse.Namespace], int],
              argv: list[str] | None = None) -> int:
    parser.add_argument("--log-level", default=None, help="DEBUG, INFO (default), WARNING")
    args = parser.parse_args(argv)
    setup_logging(args.log_level)
    exit_cleanly_on_sigterm()
    try:
        code = command(args)
        sys.stdout.flush()
        return code
    except (ValueError, FileNotFoundError, FileExistsError, RunLocked) as e:
        log.debug("error details", exc_info=True)
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader went away: not an error of the study's
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
