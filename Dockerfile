# One image for all four rackplane services. docker-compose.yml chooses what each container runs:
#   python -m services.sled_agent | services.instance_manager | services.accounting | services.recovery
# Settings come from the environment: NATS_URL, NATS_NKEY_FILE, NATS_CA_FILE, DATABASE_URL, RACKPLANE_*
# (see shared/config.py).
#
# Dependencies are exactly the pinned versions of requirements.lock (installed with --no-deps, so nothing
# unpinned slips in), in a virtual environment. The network access is pip's, to the package index, and,
# on a base without Python, apt's.
#
# BASE: the public `python:3.11-slim` by default; where no image registry is reachable, a plain Debian
# bookworm made locally (`make test-containers`: deploy/containers.sh), which gets Debian's Python 3.11.
ARG BASE=python:3.11-slim
FROM ${BASE}

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore

RUN command -v python3 > /dev/null || { apt-get update \
        && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
        && rm -rf /var/lib/apt/lists/*; }
RUN python3 -m venv /opt/rackplane
ENV PATH=/opt/rackplane/bin:$PATH

WORKDIR /src

# WHEELHOUSE: a page of links to every pinned package (and setuptools), which pip then uses instead of
# the package index; deploy/containers.sh serves one on the host's loopback (a build with --network host)
# where the index is reached only through the host's own certificate authority. Unset: the index.
ARG WHEELHOUSE

# The pinned dependencies first, in their own layer: rebuilt only when the lock file changes.
COPY requirements.lock ./
RUN pip install ${WHEELHOUSE:+--no-index --find-links "$WHEELHOUSE"} --no-deps -r requirements.lock

# Then the project itself; its .sql migrations and queries are package data (see pyproject.toml).
COPY pyproject.toml ./
COPY shared/ shared/
COPY services/ services/
COPY deploy/ deploy/
COPY rackctl/ rackctl/
RUN pip install ${WHEELHOUSE:+--no-index --find-links "$WHEELHOUSE"} --no-deps .

# The services need no privileges: they only open outgoing connections to NATS and PostgreSQL.
# /identities is the mount point of compose's identities volume: a fresh volume takes its owner from it.
# A uid of its own (10001): the first system uid, 999, is the PostgreSQL images' `postgres`,
# which owns the superuser's password file on the db-logins volume every service mounts.
RUN useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin rackplane \
    && mkdir /identities && chown rackplane /identities
USER rackplane

# Run from outside /src, so that `python -m services.<name>` imports the installed package.
WORKDIR /

# No default command: each compose service sets its own (`python -m services.<name>`).
