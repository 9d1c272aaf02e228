"""The broker's side of a stack: identities, the server's auth (and TLS) config, the streams, contexts.

deploy/stack.py calls this; it keeps what a throwaway stack needs in one place:

- the identities (deploy/identities.py), in `<stack>/identities` (the test identity only with fault
  injection on), or in $RACKPLANE_IDENTITIES when set (the tests make one set per test run, for all their
  stacks, with the test identity);
- with TLS (RACKPLANE_TLS=1, `make run TLS=1`), a CA and a server certificate (deploy/tls.py);
- `nats-auth.conf`, included by the server's config: the accounts and users, and the `tls` block;
- each service's environment: its own credential (NATS_NKEY_FILE), the CA (NATS_CA_FILE), and for the
  sled agent the sleds' credentials (RACKPLANE_SLED_NKEYS);
- contexts for rackctl (rackctl/context.py).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from deploy import identities, streams, subscribers, tls
from rackctl import context as contexts
from shared.topology import subjects

SERVICE_IDENTITY = {
    "sled_agent": "simulator",
    "instance_manager": "instance-manager",
    "accounting": "accounting",
    "recovery": "recovery",
}


@dataclass
class BrokerSecurity:
    dir: Path
    tls: bool = False
    sleds: int = identities.DEFAULT_SLEDS
    test_identity: bool = False
    """Make the test identity (fault injection: `make run FAULTS=1`); without it, a test identity left in
    the folder by an earlier start is removed, seed and all, so that the broker refuses it."""
    store: identities.Store = field(init=False)
    certs: tls.Files | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        shared = os.environ.get("RACKPLANE_IDENTITIES")
        folder = Path(shared) if shared else self.dir / "identities"
        if shared and (folder / "identities.json").exists():  # the tests' own set, test identity included
            self.store = identities.Store.load(folder)
        else:
            self.store = identities.Store.init(
                folder, identities.standard(self.sleds, test=self.test_identity)
            )
            if not self.test_identity:
                self.store.remove(identities.TEST)
        if self.tls:
            self.certs = tls.make(self.dir / "tls")

    @property
    def scheme(self) -> str:
        return "tls" if self.tls else "nats"

    @property
    def ca_file(self) -> str | None:
        return str(self.certs.ca) if self.certs else None

    def server_conf(self) -> Path:
        """The part of nats-server's config that is about who may connect: the accounts and users (an
        include of the identities' `auth.conf`, so that a new identity needs only a reload) and TLS."""
        path = self.dir / "nats-auth.conf"
        text = f"include {json.dumps(os.path.relpath(self.store.auth_conf, self.dir))}\n"
        if self.certs is not None:
            text += self.certs.server_conf()
        path.write_text(text)
        return path

    def seed(self, name: str) -> str:
        return str(self.store.seed_file(name))

    def service_env(self, service: str) -> dict[str, str]:
        env = {"NATS_NKEY_FILE": self.seed(SERVICE_IDENTITY[service])}
        if service == "sled_agent":
            env["RACKPLANE_SLED_NKEYS"] = str(self.store.sleds_dir)
        if self.ca_file:
            env["NATS_CA_FILE"] = self.ca_file
        return env

    def context(self, name: str, url: str) -> contexts.ConnectionContext:
        """A context for identity `name`; a subscriber's names its stream and its silo."""
        identity = self.store.identities.get(name)
        if identity is not None and identity.kind == "subscriber":
            return contexts.ConnectionContext(
                url=url,
                nkey=self.seed(name),
                ca=self.ca_file,
                identity=name,
                stream=subjects.subscriber_stream(name),
                silo=identity.param or None,
            )
        return contexts.ConnectionContext(url=url, nkey=self.seed(name), ca=self.ca_file, identity=name)

    def write_context(self, context_name: str, identity: str, url: str) -> Path:
        return contexts.write(context_name, self.context(identity, url), self.dir / "contexts")

    def add(self, identity: identities.Identity) -> str:
        """A new identity (a silo's operator, a sled): the server needs a reload to know it."""
        seed = str(self.store.add(identity))
        self.server_conf()
        return seed

    def rack(self, url: str, reload: Callable[[], None], replicas: int | None = None) -> subscribers.Rack:
        return subscribers.Rack(self.store, url, self.ca_file, reload, replicas)

    async def ensure_streams(
        self, url: str, window: float | None = None, replicas: int | None = None
    ) -> None:
        """Rackplane's streams, then those of the subscribers the folder names (the events reader's), each
        with `replicas` copies (None: RACKPLANE_STREAM_REPLICAS)."""
        await streams.ensure(url, self.seed("stream-admin"), self.ca_file, window=window, replicas=replicas)
        rack = self.rack(url, lambda: None, replicas)
        for s in self.store.subscribers():
            await subscribers.add(rack, s.name, subscribers.scope(s))
