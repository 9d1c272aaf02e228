# PostgreSQL 15 under Patroni, with etcd beside it, on a plain Debian: docker-compose.ha.yml's database
# nodes (pg0, pg1) and its etcd member all run this one image (Debian's `patroni`, `postgresql-15` and
# `etcd-server`, the versions `make run HA=1` uses on the host). `make test-containers` builds it on the
# base that deploy/containers.sh makes (`--build-arg BASE=...`).
#
# The entrypoint (patroni-entrypoint.sh) runs Patroni with /etc/patroni/patroni.yml (deploy/patroni.yml,
# mounted by compose) and the node's own settings from Patroni's PATRONI_* environment variables; the etcd
# service runs `etcd` instead. Patroni's Python is Debian's python3, which the healthchecks use too.
ARG BASE=debian:bookworm-slim
FROM ${BASE}

RUN apt-get update \
    && apt-get install -y --no-install-recommends postgresql-15 patroni python3-etcd etcd-server \
    && rm -rf /var/lib/apt/lists/*

ENV PATH=/usr/lib/postgresql/15/bin:$PATH
COPY patroni-entrypoint.sh /usr/local/bin/patroni-entrypoint.sh
RUN chmod 755 /usr/local/bin/patroni-entrypoint.sh
# 5432 PostgreSQL, 8008 Patroni's REST API; 2379 and 2380 etcd's client and peer ports
EXPOSE 5432 8008 2379 2380
ENTRYPOINT ["/usr/local/bin/patroni-entrypoint.sh"]
