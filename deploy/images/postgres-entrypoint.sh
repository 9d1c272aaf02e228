#!/bin/sh
# The part of the public postgres image's entrypoint that rackplane relies on: on an empty data folder,
# initdb with POSTGRES_USER (default postgres) and its password (POSTGRES_PASSWORD, or the file named by
# POSTGRES_PASSWORD_FILE) and POSTGRES_INITDB_ARGS; connections from any address with
# POSTGRES_HOST_AUTH_METHOD (default scram-sha-256); the database POSTGRES_DB (default: the user's name).
# Runs as root to read the password file, then runs the server as `postgres`.
set -eu
user="${POSTGRES_USER:-postgres}"
mkdir -p "$PGDATA" /run/postgresql
chown postgres:postgres "$PGDATA" /run/postgresql
chmod 700 "$PGDATA"
if [ ! -s "$PGDATA/PG_VERSION" ]; then
    pwfile=$(mktemp)
    if [ -n "${POSTGRES_PASSWORD_FILE:-}" ]; then
        cat "$POSTGRES_PASSWORD_FILE" > "$pwfile"
    else
        printf '%s' "${POSTGRES_PASSWORD:?set POSTGRES_PASSWORD or POSTGRES_PASSWORD_FILE}" > "$pwfile"
    fi
    chown postgres "$pwfile"
    # shellcheck disable=SC2086 # the arguments are a list, as in the public image
    runuser -u postgres -- initdb -D "$PGDATA" --username="$user" --pwfile="$pwfile" ${POSTGRES_INITDB_ARGS:-}
    rm -f "$pwfile"
    printf 'host all all all %s\n' "${POSTGRES_HOST_AUTH_METHOD:-scram-sha-256}" >> "$PGDATA/pg_hba.conf"
    printf "listen_addresses = '*'\n" >> "$PGDATA/postgresql.conf"
    db="${POSTGRES_DB:-$user}"
    if [ "$db" != postgres ]; then
        echo "CREATE DATABASE \"$db\" OWNER \"$user\";" | runuser -u postgres -- postgres --single -D "$PGDATA" -j postgres > /dev/null
    fi
fi
exec runuser -u postgres -- postgres -D "$PGDATA" "$@"
