"""The topology of the bus, in one place: streams, subjects, every durable consumer, and who sends and
who receives each message. Services, deploy, the checker and the contract read it; nothing else spells
a stream, a subject or a durable's name (tests/test_topology.py keeps it so).

- `subjects`: the subject scheme and the streams, with the parse helpers that read a subject's tokens;
- `durables`: every durable consumer as a record (name, stream, filter, owner);
- `routes`: who sends and who receives each kind of message, on which channel;
- `jsapi`: the JetStream API subjects that permissions are granted on.
"""

from shared.topology import durables as durables
from shared.topology import jsapi as jsapi
from shared.topology import routes as routes
from shared.topology import subjects as subjects
from shared.topology.durables import *  # noqa: F403
from shared.topology.subjects import *  # noqa: F403
