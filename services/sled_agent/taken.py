"""How far a sled has taken its command stream: the number its inventories carry (`commands_read`), on
which a start is judged stuck or still waiting (instance-manager's orders.stuck).

Its durable delivers in stream order, but an order refused for now (a frozen sled, a held one) comes
again only after its delay, and those in hand when the simulator died only after the broker's ack wait;
later ones are taken meanwhile. So the sled has read its stream only up to just before the first order
delivered and not yet taken, not up to the last one it took. What was in hand when the process died is
not known from its own file: at start it asks the broker (its consumer's ack floor), and claims no more
than that until the broker says everything then delivered is acked.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import nats.errors
import nats.js.errors
from nats.js import JetStreamContext

log = logging.getLogger(__name__)


@dataclass
class CommandsTaken:
    last: int | None = 0
    """The stream sequence of the last command taken (None: unknown, from a file of an earlier release)."""
    open: set[int] = field(default_factory=set)
    """Commands delivered and not taken yet: refused for now, or being taken."""
    cap: int | None = None
    """After a restart with commands in hand: the broker's ack floor, past which the sled claims nothing."""
    cap_until: int = 0
    """The last stream sequence delivered when the cap was set: it goes once the ack floor reaches it."""
    started: bool = False
    """Whether the broker has been asked at start; until then the sled claims nothing (0): what it had in
    hand before a restart is not known yet."""
    checking: bool = False

    @property
    def read(self) -> int | None:
        """The stream sequence up to which every command is taken."""
        if not self.started:
            return 0
        floor = min(self.open) - 1 if self.open else self.last
        if floor is not None and self.cap is not None:
            return min(floor, self.cap)
        return floor

    @property
    def asking(self) -> bool:
        """Whether the broker is still to be asked (at start, or while capped)."""
        return not self.started or self.cap is not None

    def delivered(self, seq: int) -> None:
        """A command comes: open until taken, unless it is a late copy of one taken already (delivered in
        order, a command at or below the last taken and not open was taken)."""
        if self.last is None or seq > self.last or seq in self.open:
            self.open.add(seq)

    def took(self, seq: int) -> None:
        self.open.discard(seq)
        self.last = max(self.last or 0, seq)

    async def ask_broker(self, js: JetStreamContext, stream: str, durable: str) -> None:
        """At start (until the broker answers), cap what the sled claims at its durable's ack floor if it
        has messages out unacked (in hand when the process died, or refused for now), and take the floor
        as taken (everything at or below it was acked); later, while capped, lift the cap once the ack
        floor has passed everything delivered then, or raise it to where the floor is."""
        if self.checking or not self.asking:
            return
        self.checking = True
        try:
            info = await js.consumer_info(stream, durable)
        except nats.js.errors.NotFoundError:  # a new durable: nothing was delivered
            self.cap, self.started = None, True
            return
        except (nats.errors.Error, TimeoutError) as e:  # asked again with the next inventory
            log.info("%s: its command consumer's state not read (%s)", durable, e)
            return
        finally:
            self.checking = False
        floor = info.ack_floor.stream_seq if info.ack_floor and info.ack_floor.stream_seq else 0
        delivered = info.delivered.stream_seq if info.delivered and info.delivered.stream_seq else 0
        if not self.started:
            self.last = max(self.last or 0, floor)
            self.cap, self.cap_until = (floor, delivered) if info.num_ack_pending else (None, 0)
            self.started = True
        elif self.cap is not None:
            self.cap = None if floor >= self.cap_until else floor
