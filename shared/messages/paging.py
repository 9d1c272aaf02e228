"""How every list command pages: one base, so that silos, projects, instances, pools and sleds are all
listed alike."""

from __future__ import annotations

from shared.messages.base import Cursor, Model, PageSize


class Paged(Model):
    """A list is read a page at a time, in a stable order: `after` is the `next` of the page before (an
    opaque cursor); the reply is `{items, next}`, `next` null on the last page."""

    limit: PageSize = 100
    after: Cursor | None = None
