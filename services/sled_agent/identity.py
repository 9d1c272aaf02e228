"""Each simulated sled connects to NATS as itself: its own nkey, its own reply inbox, its own permissions
(publish only its reports, consume only its own command consumer: deploy/identities.py).

The sleds' credentials are `<sled id>.nk` files in RACKPLANE_SLED_NKEYS (made by deploy/identities.py,
a pool of them up front). A sled without one cannot join: `rp.sim.sled.add` says how to provision it.
"""

from __future__ import annotations

from pathlib import Path

from nats.aio.client import Client as NATS

from shared import bus
from shared.config import Settings
from shared.topology import subjects


class NoCredential(Exception):
    pass


def seed_file(sled_id: str, folder: Path | None) -> Path | None:
    """The sled's credential in `folder` (RACKPLANE_SLED_NKEYS), or None when the broker asks for none (no
    folder)."""
    if folder is None:
        return None
    path = folder / f"{sled_id}.nk"
    if not path.exists():
        raise NoCredential(
            f"no credential for {sled_id} in {folder}: provision one first "
            f"(python -m deploy.identities add-sled, then reload nats-server; see docs/security.md)"
        )
    return path


async def connect(settings: Settings, sled_id: str) -> NATS:
    seed = seed_file(sled_id, settings.sled_nkeys)
    return await bus.connect(
        settings.nats_url,
        f"sled-agent/{sled_id}",
        seed_file=str(seed) if seed else None,
        inbox_prefix=subjects.inbox_prefix(sled_id),
        ca_file=settings.nats_ca_file,
    )
