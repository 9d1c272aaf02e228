# PostgreSQL 15 on a plain Debian, for where no image registry is reachable: `make test-containers` builds
# it on the base that deploy/containers.sh makes (`--build-arg BASE=...`), and docker-compose.yml and the
# testcontainers tests run it in place of the public `postgres:15` image (RACKPLANE_POSTGRES_IMAGE).
# Its entrypoint takes the settings of the public image that rackplane uses (postgres-entrypoint.sh).
ARG BASE=debian:bookworm-slim
FROM ${BASE}

RUN apt-get update \
    && apt-get install -y --no-install-recommends postgresql-15 \
    && rm -rf /var/lib/apt/lists/*

ENV PATH=/usr/lib/postgresql/15/bin:$PATH \
    PGDATA=/var/lib/postgresql/data
COPY postgres-entrypoint.sh /usr/local/bin/postgres-entrypoint.sh
RUN chmod 755 /usr/local/bin/postgres-entrypoint.sh
EXPOSE 5432
STOPSIGNAL SIGINT
ENTRYPOINT ["/usr/local/bin/postgres-entrypoint.sh"]
