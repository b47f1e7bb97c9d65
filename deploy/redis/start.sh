#!/bin/sh
# Start the queue's redis-server: deploy/redis/redis.conf plus the secrets, from the environment.
#
#   MARGE_REDIS_PASSWORD        password of the ACL user `marge` the pipeline connects as:
#                               MARGE_REDIS_URL=redis://marge:<password>@<host>:6380/0
#   MARGE_REDIS_ADMIN_PASSWORD  optional: password of Redis' `default` user (all commands) for an operator, who
#                               can then make one user per run (`marge redis-user create`); without it the
#                               default user is off
#   MARGE_REDIS_ACLFILE         where the users are kept (default: users.acl in the current folder); keep it
#                               beside the AOF, on storage that outlives the server
#
# `marge` may only touch keys marge:* with the commands the pipeline uses (streams, hashes, lists, strings, sets,
# transactions, Lua scripts on those keys); nothing dangerous (FLUSHALL, CONFIG, DEBUG...). Users live in the ACL
# file, not on the command line, so that users made while the server runs (`marge redis-user create` saves them
# there) survive a restart. Each start writes `default` and `marge` again from the environment and keeps every
# other user. Passwords must not contain spaces.
# Extra arguments are passed on to redis-server and override the file (e.g. --port 6380 --dir /srv/redis).
set -eu
: "${MARGE_REDIS_PASSWORD:?set MARGE_REDIS_PASSWORD (the password of the pipeline user marge)}"
here=$(dirname "$0")
aclfile=${MARGE_REDIS_ACLFILE:-$PWD/users.acl}
# the rights of a pipeline user, as `marge redis-user` grants them (services/driver/redis_users.py)
commands="-@all +@stream +@hash +@list +@string +@set +@sortedset +@transaction +@scripting +@connection +del +exists -@dangerous"
umask 077
tmp="$aclfile.tmp.$$"
{
    if [ -n "${MARGE_REDIS_ADMIN_PASSWORD:-}" ]; then
        echo "user default on >$MARGE_REDIS_ADMIN_PASSWORD ~* &* +@all"
    else
        echo "user default off resetchannels -@all"
    fi
    echo "user marge on >$MARGE_REDIS_PASSWORD ~marge:* resetchannels $commands"
    if [ -f "$aclfile" ]; then
        grep -v -e '^user default ' -e '^user marge ' "$aclfile" || true
    fi
} > "$tmp"
mv "$tmp" "$aclfile"
exec "${REDIS_SERVER:-redis-server}" "$here/redis.conf" --aclfile "$aclfile" "$@"
