#!/bin/sh
# Start the queue's redis-server: deploy/redis/redis.conf plus the secrets, from the environment.
#
#   MARGE_REDIS_PASSWORD        password of the ACL user `marge` the pipeline connects as:
#                               MARGE_REDIS_URL=redis://marge:<password>@<host>:6379/0
#   MARGE_REDIS_ADMIN_PASSWORD  optional: password of Redis' `default` user (all commands) for an operator;
#                               without it the default user is off
#
# `marge` may only touch keys marge:* with the commands the pipeline uses (streams, hashes, lists,
# strings, sets, transactions, Lua scripts on those keys); nothing dangerous (FLUSHALL, CONFIG, DEBUG...).
# Extra arguments are passed on to redis-server and override the file (e.g. --port 6380 --dir /srv/redis).
set -eu
: "${MARGE_REDIS_PASSWORD:?set MARGE_REDIS_PASSWORD (the password of the pipeline user marge)}"
here=$(dirname "$0")
if [ -n "${MARGE_REDIS_ADMIN_PASSWORD:-}" ]; then
    set -- --requirepass "$MARGE_REDIS_ADMIN_PASSWORD" "$@"
else
    set -- --user default off "$@"
fi
exec "${REDIS_SERVER:-redis-server}" "$here/redis.conf" \
    --user marge on ">$MARGE_REDIS_PASSWORD" resetkeys "~marge:*" resetchannels -@all \
        +@stream +@hash +@list +@string +@set +@sortedset +@transaction +@scripting +@connection +del +exists -@dangerous \
    "$@"
