#!/bin/sh
# A Patroni node in a container: runs as root to read the passwords from the db-logins volume, hands them
# to Patroni in its own environment variables (PATRONI_SUPERUSER_PASSWORD...), then runs Patroni as
# `postgres` (PostgreSQL refuses root). A command given to the container runs instead (the etcd service).
#
# The superuser's password is db-secrets' (deploy/dbroles.py, as for the single node); the replication
# and pg_rewind roles' are made here on first need, once for both nodes (a link is atomic: the node that
# loses the race reads the winner's), readable by root only.
set -eu
if [ "$#" -gt 0 ]; then
    exec "$@"
fi
logins="${RACKPLANE_DB_LOGINS:-/run/rackplane/db}"
secret() {  # secret NAME: the password in $logins/NAME.password, made if missing
    path="$logins/$1.password"
    if [ ! -s "$path" ]; then
        tmp="$(mktemp "$logins/.$1.XXXXXX")"
        python3 -c 'import secrets; print(secrets.token_urlsafe(24))' > "$tmp"
        chmod 600 "$tmp"
        ln "$tmp" "$path" 2> /dev/null || true
        rm -f "$tmp"
    fi
    tr -d '\n' < "$path"
}
for _ in $(seq 60); do  # db-secrets made it before this starts; a moment's grace all the same
    [ -s "$logins/postgres.password" ] && break
    sleep 1
done
PATRONI_SUPERUSER_PASSWORD="$(secret postgres)"
PATRONI_REPLICATION_PASSWORD="$(secret replicator)"
PATRONI_REWIND_PASSWORD="$(secret rewinder)"
export PATRONI_SUPERUSER_PASSWORD PATRONI_REPLICATION_PASSWORD PATRONI_REWIND_PASSWORD
data="${PATRONI_POSTGRESQL_DATA_DIR:-/var/lib/postgresql/data}"
mkdir -p "$data" /run/postgresql
chown postgres:postgres "$data" /run/postgresql
chmod 700 "$data"
cd /var/lib/postgresql
exec runuser -u postgres -- env HOME=/var/lib/postgresql patroni "${PATRONI_CONFIG:-/etc/patroni/patroni.yml}"
