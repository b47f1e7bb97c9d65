#!/bin/sh
# Start the queue's redis-server: deploy/redis/redis.conf plus the secrets, read from files (or the environment).
#
#   MARGE_REDIS_PASSWORD_FILE   a file (0600; on Kubernetes a Secret mounted as a file) holding the password of the
#                               ACL user `marge` the pipeline connects as:
#                               MARGE_REDIS_URL=redis://marge:<password>@<host>:6380/0
#   MARGE_REDIS_PASSWORD        the same password in the environment, when no file is named (the file is better:
#                               redis-server does not inherit the variable, but whatever started this script has it)
#   MARGE_REDIS_ADMIN_PASSWORD_FILE, MARGE_REDIS_ADMIN_PASSWORD
#                               optional: the password of Redis' `default` user (all commands) for an operator, who
#                               can then make one user per run (`marge redis-user create`); without it the default
#                               user is off. A named file that does not exist counts as none (a Kubernetes Secret
#                               marked optional that was not created), and says so
#   MARGE_REDIS_ACLFILE         where the users are kept (default: users.acl in the current folder); keep it
#                               beside the AOF, on storage that outlives the server
#
# `marge` may only touch keys marge:* with the commands the pipeline uses (streams, hashes, lists, strings, sets,
# transactions, Lua scripts by EVAL/EVALSHA on those keys); not the server's script cache or function libraries,
# which every run on the server shares, and nothing dangerous (FLUSHALL, CONFIG, DEBUG...). Users live in the ACL
# file, not on the command line (`ps` shows every process's arguments to every user), so that no password is in an
# argument and users made while the server runs (`marge redis-user create` saves them there) survive a restart.
# Each start writes `default` and `marge` again and keeps every other user. Passwords must not contain spaces.
# Extra arguments are passed on to redis-server and override the file (e.g. --port 6380 --dir /srv/redis).
set -eu
here=$(dirname "$0")
aclfile=${MARGE_REDIS_ACLFILE:-$PWD/users.acl}

# secret NAME FILE_VARIABLE: the password in the file $FILE_VARIABLE names, else in $NAME; `cat` sees the file's
# name and the shell builtins the value, so no process's arguments hold it
secret() {
    eval "file=\${$2:-}"
    if [ -n "$file" ]; then
        if [ ! -r "$file" ]; then
            echo "$0: $2=$file does not exist or cannot be read: write the password into it (or unset $2)" >&2
            return 2
        fi
        value=$(cat -- "$file")
    else
        eval "value=\${$1:-}"
    fi
    case $value in
        *[[:space:]]*)
            echo "$0: the password in ${file:-\$$1} contains a space or a second line: give one word on one line" >&2
            return 2 ;;
    esac
}

if [ -n "${MARGE_REDIS_ADMIN_PASSWORD_FILE:-}" ] && [ ! -e "$MARGE_REDIS_ADMIN_PASSWORD_FILE" ]; then
    echo "$0: no $MARGE_REDIS_ADMIN_PASSWORD_FILE: the default user is off (no operator account)" >&2
    MARGE_REDIS_ADMIN_PASSWORD_FILE=
fi
secret MARGE_REDIS_ADMIN_PASSWORD MARGE_REDIS_ADMIN_PASSWORD_FILE
admin_password=$value
secret MARGE_REDIS_PASSWORD MARGE_REDIS_PASSWORD_FILE
password=$value
if [ -z "$password" ]; then
    echo "$0: no password for the pipeline user marge: set MARGE_REDIS_PASSWORD_FILE to a file holding it" \
         "(or MARGE_REDIS_PASSWORD)" >&2
    exit 2
fi
unset MARGE_REDIS_PASSWORD MARGE_REDIS_ADMIN_PASSWORD  # redis-server's environment holds no password either

# the ACL file keeps a password's SHA-256 (`#<hash>`), as ACL SAVE writes it, not the password; printf is a builtin
# and sha256sum reads the value from its input, so no process's arguments hold it
hashed() {
    printf '%s' "$1" | sha256sum | cut -d ' ' -f 1
}

# the rights of a pipeline user, as `marge redis-user` grants them (services/ops/redis_users.py)
commands="-@all +@stream +@hash +@list +@string +@set +@sortedset +@transaction +eval +evalsha +eval_ro +evalsha_ro +script|load +script|exists +@connection +del +exists -@dangerous"
umask 077
tmp="$aclfile.tmp.$$"
{
    if [ -n "$admin_password" ]; then
        printf '%s\n' "user default on #$(hashed "$admin_password") ~* &* +@all"
    else
        printf '%s\n' "user default off resetchannels -@all"
    fi
    printf '%s\n' "user marge on #$(hashed "$password") ~marge:* resetchannels $commands"
    if [ -f "$aclfile" ]; then
        grep -v -e '^user default ' -e '^user marge ' "$aclfile" || true
    fi
} > "$tmp"
mv "$tmp" "$aclfile"
exec "${REDIS_SERVER:-redis-server}" "$here/redis.conf" --aclfile "$aclfile" "$@"
