"""The `marge` command line: one entry point, one subcommand per job.

One module per group of commands, each with the parsers of its commands (`add_<command>(sub)`) and their
`cmd_*(args)` functions, which read the flags and call the module that owns the work:

    data.py         prepare, prepare-tasks, info
    train.py        pretrain, finetune, report, plan, config reference
    evaluate.py     eval retrieval | translate | finetuned, translate
    serve.py        serve
    ops.py          audit, queue, scale

What a command needs is imported inside its `cmd_*` function: building the parser imports no torch, so `marge
--help` and a bad flag answer at once.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from marge.util.files import setup_logging
from services.cli import data, evaluate, ops, serve, train
from services.driver.lock import RunLocked

log = logging.getLogger("marge")

# The commands in the order `marge --help` lists them.
COMMANDS = (data.add_prepare, train.add_pretrain, serve.add_serve, serve.add_index, evaluate.add_eval, train.add_finetune,
            ops.add_scale, data.add_prepare_tasks, evaluate.add_translate, train.add_report,
            train.add_config, train.add_plan, ops.add_audit, ops.add_queue, ops.add_redis_user, data.add_info)

# Commands that start processes (a private redis-server, a local Ray, Ray Train workers) that a SIGTERM must stop.
STARTS_PROCESSES = ("pretrain", "finetune")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="marge", description="MARGE pre-training pipeline")
    parser.add_argument("--log-level", default=None, help="DEBUG, INFO (default), WARNING")
    parser.add_argument("--version", action="version", version=f"marge {__import__('marge').__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in COMMANDS:
        add(sub)
    return parser


def exit_cleanly_on_sigterm() -> None:
    """`ray job stop`, `kill` and CI time-outs send SIGTERM: exit through the normal path so that what the
    command started (a private redis-server, a local Ray) is stopped by its `finally` blocks."""
    import signal

    def handler(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    setup_logging(args.log_level)
    if args.command in STARTS_PROCESSES:
        exit_cleanly_on_sigterm()
    try:
        code = args.func(args)
        sys.stdout.flush()  # here, where a reader that went away is handled, not at interpreter exit
        return code
    except (ValueError, FileNotFoundError, FileExistsError, RunLocked) as e:
        # bad input or configuration: one clear line, no traceback (set MARGE_LOG_LEVEL=DEBUG for it)
        log.debug("error details", exc_info=True)
        print(f"marge {args.command}: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader went away (`marge info | head`): not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second complaint when Python flushes
        return 0
    except Exception as e:
        failure = ray_failure_line(e)
        if failure is None:
            raise  # a fault of the program itself: its traceback is the report
        # Ray could not start, schedule or keep what the command needed: one line; what it started is stopped
        log.debug("error details", exc_info=True)
        print(f"marge {args.command}: error: {failure}", file=sys.stderr)
        return 1


def ray_failure_line(error: Exception) -> str | None:
    """The one line for a failure of Ray's (it did not start, could not schedule or lost an actor, a stage stopped
    answering), None for any other error. Ray is only looked at when the command imported it."""
    from marge.util.local_ray import RayStartError

    if isinstance(error, RayStartError):
        return str(error)
    if "ray" not in sys.modules:
        return None
    from services.driver.resources import StageFailure, describe_stage_failure, is_ray_failure

    if isinstance(error, StageFailure):
        return str(error)
    return str(describe_stage_failure(None, error)) if is_ray_failure(error) else None
