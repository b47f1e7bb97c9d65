"""`marge audit`, `marge queue` and `marge scale`: looking after a run that is running or has run."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REDIS_URL_HELP = ("the run's Redis if it was external; a password given here is visible to every user of the machine "
                  "(`ps`): prefer MARGE_REDIS_URL_FILE (a file holding the URL) or MARGE_REDIS_URL")


def add_audit(sub) -> None:
    p = sub.add_parser("audit", help="was every batch of a run trained exactly once? (exit 1 if one was lost or twice)")
    p.add_argument("--run", required=True, type=Path, help="run directory of `marge pretrain`")
    p.add_argument("--redis-url", default=None, help=REDIS_URL_HELP)
    p.add_argument("--json", action="store_true", help="only the JSON object (always printed last, on one line)")
    p.set_defaults(func=cmd_audit)


def cmd_audit(args: argparse.Namespace) -> int:
    from services.ops.audit import audit, run_queue

    with run_queue(args.run, args.redis_url) as (cfg, queue):
        result = audit(cfg, queue)
    if not args.json:
        print(f"run {args.run}: {result['steps']} updates in the newest checkpoint; batches produced "
              f"{result['batches_produced']}, trained {result['batches_trained']}, lost {result['batches_lost']}, "
              f"trained twice {result['trained_twice']}, pending {result['batches_pending']}, dead-lettered "
              f"{result['batches_dead_lettered']} (replayed {result['batches_replayed']})", file=sys.stderr)
        for wrong in result["commits_disagree_with_train_log"]:
            rank = "" if wrong["rank"] is None else f", rank {wrong['rank']}"
            print(f"checkpoint of update {wrong['checkpoint']}{rank}: {wrong['what']}", file=sys.stderr)
        for changed in result["content_changed"]:
            print(f"batch {changed['position']} was made with different contents {changed['contents']}: its "
                  "builder is not deterministic for the run's seed (see docs/pipeline.md)", file=sys.stderr)
    print(json.dumps(result), flush=True)
    return 0 if result["ok"] else 1


def add_queue(sub) -> None:
    p = sub.add_parser("queue", help="a run's dead-lettered batches: list them, requeue them")
    queue_sub = p.add_subparsers(dest="queue_command", required=True)
    for name, text in (("list-dead", "list the batches that could not be trained, with slot and reason"),
                       ("replay", "requeue dead-lettered batches (entries from list-dead)")):
        q = queue_sub.add_parser(name, help=text)
        q.add_argument("--run", required=True, type=Path, help="run directory of `marge pretrain`")
        q.add_argument("--redis-url", default=None, help=REDIS_URL_HELP)
        if name == "replay":
            q.add_argument("entries", nargs="+", metavar="ENTRY", help="dead-letter entry ids")
        else:
            q.add_argument("--json", action="store_true")
        q.set_defaults(func=cmd_queue)


def cmd_queue(args: argparse.Namespace) -> int:
    from services.ops.audit import run_queue

    with run_queue(args.run, args.redis_url) as (_, queue):
        if args.queue_command == "list-dead":
            dead = queue.dead_letters()
            if args.json:
                print(json.dumps(dead))
            else:
                for d in dead:
                    where = (f"requeued into slot {d['replayed_to_slot']}" if d["replayed_to_slot"] is not None
                             else "replay requested" if d["replay_requested"] else "")
                    print(f"{d['entry']}  slot {d['slot']}  {d['batch_id']}  {d['reason']}  {where}")
                print(f"{len(dead)} dead-lettered batch(es)", file=sys.stderr)
        else:
            for entry in args.entries:
                queue.request_replay(entry)
                print(f"requeued {entry}: the batcher writes it into the next slot it writes (a running run trains "
                      "it within the queue's depth; a stopped one when it is resumed)")
    return 0


def add_scale(sub) -> None:
    p = sub.add_parser("scale", help="resize a running job's indexer pool (from its next index version)")
    p.add_argument("--run", required=True, help="the job's run.name")
    p.add_argument("--indexer-workers", type=int, required=True, help="indexer workers wanted")
    p.add_argument("--address", default=None, help="the Ray cluster, HOST:PORT as `ray start --head` prints it "
                                                   "(default: RAY_ADDRESS)")
    p.set_defaults(func=cmd_scale)


def cmd_scale(args: argparse.Namespace) -> int:
    """Resize a running job's indexer pool; the coordinator applies it from the next index version."""
    import os

    from services.driver.resources import scale_indexer_pool

    address = args.address or os.environ.get("RAY_ADDRESS")
    if not address:
        raise ValueError("marge scale needs the Ray cluster: --address HOST:PORT (as `ray start --head` prints it) "
                         "or RAY_ADDRESS")
    if args.indexer_workers < 1:
        raise ValueError(f"--indexer-workers must be >= 1, got {args.indexer_workers}")
    result = scale_indexer_pool(args.run, args.indexer_workers, address)
    print(json.dumps({"run": args.run, **result}))
    return 0


def add_redis_user(sub) -> None:
    p = sub.add_parser("redis-user", help="a run's own ACL user on a shared queue Redis: its keys only, its URL in a "
                                          "0600 file for MARGE_REDIS_URL_FILE")
    user_sub = p.add_subparsers(dest="redis_user_command", required=True)
    for name, text in (("create", "make the run's user (or give it a new password) and write its URL to --out"),
                       ("delete", "remove the run's user")):
        q = user_sub.add_parser(name, help=text)
        q.add_argument("--run", required=True, help="the run's run.name (its keys are marge:<run>:*)")
        q.add_argument("--admin-url-file", type=Path, default=None,
                       help="a file whose first line is an operator's Redis URL, allowed ACL SETUSER/DELUSER "
                            "(default: the file MARGE_REDIS_ADMIN_URL_FILE names)")
        if name == "create":
            q.add_argument("--out", type=Path, required=True,
                           help="where to write the run's URL (mode 0600): give it to the run as MARGE_REDIS_URL_FILE")
        q.set_defaults(func=cmd_redis_user)


def cmd_redis_user(args: argparse.Namespace) -> int:
    import os

    from services.driver.config import read_redis_url_file
    from services.ops.redis_users import create_run_user, delete_run_user

    admin_file = args.admin_url_file or os.environ.get("MARGE_REDIS_ADMIN_URL_FILE")
    if not admin_file:
        raise ValueError("marge redis-user needs an operator's Redis URL in a file: --admin-url-file PATH or "
                         "MARGE_REDIS_ADMIN_URL_FILE (never on the command line, where `ps` shows it)")
    admin_url = read_redis_url_file(Path(admin_file), f"the operator's URL file {admin_file}")
    if args.redis_user_command == "create":
        result = create_run_user(admin_url, args.run, args.out)
        if not result["saved_to_aclfile"]:
            print(f"warning: the server has no ACL file (`aclfile`), so user {result['user']} lasts until "
                  "redis-server restarts; start it with deploy/redis/start.sh (which keeps users in an ACL file)",
                  file=sys.stderr)
    else:
        result = delete_run_user(admin_url, args.run)
    print(json.dumps({"run": args.run, **result}))
    return 0
