"""`marge redis-user`: one Redis ACL user per run on a shared queue Redis, made by an operator's account.

A user `marge-<run>` may run the queue protocol (streams, hashes, lists, strings, sets, sorted sets,
transactions, Lua scripts by EVAL/EVALSHA) on its own run's keys `marge:<run>:*` and nothing else: not another
run's keys, not the server-wide script cache or function libraries (SCRIPT FLUSH/KILL, FUNCTION, FCALL), no
dangerous command (FLUSHALL, CONFIG, DEBUG, KEYS ...). Its URL (the operator's URL with this user and a new
random password) is written to a 0600 file, which the run reads through MARGE_REDIS_URL_FILE, so the password
is in no process's arguments and no job's runtime_env. The operator's own URL comes from a file as well.

Users must outlive a restart of redis-server: when the server has an ACL file (`aclfile`, as
deploy/redis/start.sh sets up), the change is saved to it (`ACL SAVE`); without one the user lives until the
server restarts, and the command says so.
"""

from __future__ import annotations

import re
import secrets
from pathlib import Path
from urllib.parse import quote, urlsplit, urlunsplit

import redis

from marge.util.files import atomic_write_text

PIPELINE_COMMANDS = ("-@all +@stream +@hash +@list +@string +@set +@sortedset +@transaction +eval +evalsha +eval_ro "
                     "+evalsha_ro +script|load +script|exists +@connection +del +exists -@dangerous")
"""The commands the pipeline's Redis user may run (deploy/redis/start.sh grants the same to its user `marge`).

Scripting is granted command by command, not as @scripting: the script cache and the function libraries are
one per server, so SCRIPT FLUSH/KILL/DEBUG, FUNCTION (LOAD, DELETE, FLUSH, KILL, ...) and FCALL would reach every
other run on it. EVAL/EVALSHA stay key-checked (a script touches the user's keys alone); SCRIPT LOAD/EXISTS only
add to the cache, as redis-py's registered scripts do. -@dangerous comes last so that no category granted above
(@sortedset brings SORT, @connection parts of CLIENT) lets FLUSHALL, CONFIG, DEBUG, KEYS and the like back in."""


def user_name(run: str) -> str:
    return f"marge-{run}"


def key_pattern(run: str) -> str:
    """The run's keys (`marge.contracts.slots.RunKeys`: every key is marge:<run>:...), with glob characters escaped."""
    return "marge:" + re.sub(r"([*?\[\]\\])", r"\\\1", run) + ":*"


def with_user(url: str, user: str, password: str) -> str:
    """`url` (host, port, database, TLS options kept) authenticating as `user`."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    netloc = f"{quote(user, safe='')}:{quote(password, safe='')}@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def persist(admin: redis.Redis) -> bool:
    """Save the ACL to the server's ACL file; False when it has none (the change lasts until a restart)."""
    aclfile = admin.config_get("aclfile").get("aclfile", "")
    if not aclfile:
        return False
    admin.acl_save()
    return True


def create_run_user(admin_url: str, run: str, out: Path) -> dict:
    """Make (or give a new password to) the run's user and write its URL to `out` (0600)."""
    admin = redis.Redis.from_url(admin_url)
    password = secrets.token_urlsafe(32)
    name = user_name(run)
    # reset: a user made again gets exactly these rights and only the new password
    admin.execute_command("ACL", "SETUSER", name, "reset", "on", f">{password}", f"~{key_pattern(run)}",
                          "resetchannels", *PIPELINE_COMMANDS.split())
    saved = persist(admin)
    atomic_write_text(out, with_user(admin_url, name, password) + "\n", mode=0o600)
    return {"user": name, "keys": key_pattern(run), "url_file": str(out), "saved_to_aclfile": saved}


def delete_run_user(admin_url: str, run: str) -> dict:
    admin = redis.Redis.from_url(admin_url)
    deleted = int(admin.execute_command("ACL", "DELUSER", user_name(run)))
    return {"user": user_name(run), "deleted": bool(deleted), "saved_to_aclfile": persist(admin) if deleted else False}
