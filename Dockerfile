# One image for all four rackplane services. docker-compose.yml chooses what each container runs:
#   python -m services.sled_agent | services.instance_manager | services.accounting | services.recovery
# Settings come from the environment: NATS_URL, NATS_NKEY_FILE, NATS_CA_FILE, DATABASE_URL, RACKPLANE_*
# (see shared/config.py).
#
# Dependencies are exactly the pinned versions of requirements.lock (installed with --no-deps, so nothing
# unpinned slips in). The only network access is pip's, to the package index.
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore

WORKDIR /src

# The pinned dependencies first, in their own layer: rebuilt only when the lock file changes.
COPY requirements.lock ./
RUN pip install --no-deps -r requirements.lock

# Then the project itself; its .sql migrations and queries are package data (see pyproject.toml).
COPY pyproject.toml ./
COPY shared/ shared/
COPY services/ services/
COPY deploy/ deploy/
COPY rackctl/ rackctl/
RUN pip install --no-deps .

# The services need no privileges: they only open outgoing connections to NATS and PostgreSQL.
# /identities is the mount point of compose's identities volume: a fresh volume takes its owner from it.
RUN useradd --system --no-create-home --shell /usr/sbin/nologin rackplane \
    && mkdir /identities && chown rackplane /identities
USER rackplane

# Run from outside /src, so that `python -m services.<name>` imports the installed package.
WORKDIR /

# No default command: each compose service sets its own (`python -m services.<name>`).
