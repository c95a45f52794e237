"""The Worker's durable inbox on SQLite (ADR-0021; implements ``core.ports.InboxPort``).

Its own small file, ``<state dir>/inbox.sqlite3`` (0600, not the main store: a Worker's inbox
must stay writable and tiny whatever the store is doing), in WAL mode with ``synchronous=FULL``:
every commit is fsync'd before the call returns, so the crash barrier is on disk before the
caller spawns. ``secure_delete`` overwrites pruned rows (they held Lease tokens).

Limits (the Profile's ``inbox_rows`` / ``inbox_bytes``, edge 64 rows / 4 MiB):
- rows: offers kept at once, in any state;
- bytes: their stored ExecutionSpec documents (canonical JSON) together; one outcome adds at
  most ``MAX_OUTCOME_BYTES`` (4 KiB) per row on top, so the file stays under roughly
  ``inbox_bytes + inbox_rows × 4 KiB`` plus SQLite's pages.
A new offer that would pass a cap first prunes acknowledged rows, oldest first; unacknowledged
rows are never dropped, so when they alone fill a cap the offer is refused with ``InboxFull``
(``field`` ``inboxRows`` or ``inboxBytes``) and nothing is written. A spec larger than the byte
cap on its own is bad input (ValidationError ``spec``).

Beside the offers, ``kept_orphans`` names the Attempts whose run ended with ``keepOrphans`` in its
spec (recorded in the commit that acknowledges the row): their leftovers are meant to run on after
the row is pruned, so the Worker's start-up stray scan counts them as known. At most
``KEPT_ORPHANS_MAX`` (256) entries, oldest dropped first; the Worker forgets an entry once no process
carries its Attempt ID.

The schema is the numbered, checksummed files of ``inbox_migrations/``, applied at open by the
store's migrator (``migrations.migrate``: history in ``schema_migrations``); ``PRAGMA user_version``
is the last one applied (3). A file of a later version is refused with StoreIntegrityError
rather than guessed at.
"""

from __future__ import annotations

import os
import sqlite3
import time

import msgspec

from ...core.errors import NotFoundError, StoreIntegrityError, UnavailableError, ValidationError
from ...core.inbox_states import (InboxState, InboxEntry, InboxFull, InboxOffer, OfferConflict, PendingPull,
                                  check_offer, check_outcome, check_pull, check_transition, pull_body, same_offer)
from ...core.profiles import Profile
from ..migration_files import read_migrations
from . import migrations
from .inbox_queries import (KEPT_ORPHANS, KEPT_ORPHANS_TRIM, KEPT_ORPHAN_DELETE, KEPT_ORPHAN_PUT,
                            MIGRATION_HISTORY_EXISTS, OFFER, OFFERS_ACKED, OFFERS_OPEN, OFFERS_OPEN_COUNT,
                            OFFERS_USAGE, OFFER_CONFLICT, OFFER_DELETE, OFFER_INSERT, OFFER_MOVE,
                            OFFER_MOVE_WITH_OUTCOME, PENDING_PULL, PENDING_PULL_DELETE, PENDING_PULL_PUT)

FILENAME = "inbox.sqlite3"
KEPT_ORPHANS_MAX = 256
BUSY_TIMEOUT_MS = 5_000
WAL_CHECKPOINT_PAGES = 64
WAL_LIMIT_BYTES = 262_144

_MIGRATIONS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "inbox_migrations")

def _now_us() -> int:
    return time.time_ns() // 1_000


class SqliteInbox:
    """``InboxPort`` over one SQLite file. One owner (the Worker's main loop); not thread-safe.

    Raises ValidationError for ``max_rows``/``max_bytes`` < 1, UnavailableError when the file
    cannot be opened (a symlink is refused), StoreIntegrityError for an unknown schema version.
    """

    def __init__(self, path: str, *, max_rows: int, max_bytes: int, now_us=_now_us) -> None:
        if not isinstance(max_rows, int) or max_rows < 1:
            raise ValidationError("inbox_rows", "must be at least 1", limit=1)
        if not isinstance(max_bytes, int) or max_bytes < 1:
            raise ValidationError("inbox_bytes", "must be at least 1", limit=1)
        self.path, self.max_rows, self.max_bytes, self._now = path, max_rows, max_bytes, now_us
        self._c = None
        try:
            os.makedirs(os.path.dirname(os.path.abspath(path)), mode=0o700, exist_ok=True)
            # Created 0600 if missing; an existing symlink fails here (ELOOP) instead of being followed.
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o600))
            self._c = sqlite3.connect(path, isolation_level=None, timeout=BUSY_TIMEOUT_MS / 1000)
            mode = self._c.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            if mode != "wal":
                raise sqlite3.OperationalError(f"journal_mode is {mode}, WAL refused")
            self._c.execute("PRAGMA synchronous=FULL")
            self._c.execute("PRAGMA secure_delete=ON")
            # Small checkpoints and a truncated WAL keep the files near the caps on flash.
            self._c.execute(f"PRAGMA wal_autocheckpoint={WAL_CHECKPOINT_PAGES}")
            self._c.execute(f"PRAGMA journal_size_limit={WAL_LIMIT_BYTES}")
            self._migrate()
        except BaseException as e:
            if self._c is not None:
                self._c.close()
            if isinstance(e, (sqlite3.Error, OSError)):
                raise UnavailableError(f"cannot open the inbox {path}: {e}") from None
            raise

    @classmethod
    def for_profile(cls, state_dir: str, profile: Profile) -> "SqliteInbox":
        """The inbox of ``state_dir`` with ``profile``'s caps."""
        return cls(os.path.join(state_dir, FILENAME), max_rows=profile.inbox_rows, max_bytes=profile.inbox_bytes)

    def _migrate(self) -> None:
        """Apply ``inbox_migrations/`` as the store applies its own (``migrations.migrate``).
        ``PRAGMA user_version`` follows the last one applied; a file of a version beyond this
        build's is StoreIntegrityError. A file from before the inbox had migration files
        (version 1–3, no history) first records the migrations up to its version as applied."""
        known = read_migrations(_MIGRATIONS)
        latest = known[-1].version
        version = self._c.execute("PRAGMA user_version").fetchone()[0]
        if not 0 <= version <= latest:
            raise StoreIntegrityError(f"inbox {self.path}: schema version {version}, this build knows {latest}")
        if version and not self._c.execute(MIGRATION_HISTORY_EXISTS).fetchone():
            migrations.adopt_history(self._c, [m for m in known if m.version <= version])
        migrations.migrate(self._c, known)
        if version != latest:
            self._c.execute(f"PRAGMA user_version={latest}")

    def close(self) -> None:
        self._c.close()

    def _tx(self, fn):
        self._c.execute("BEGIN IMMEDIATE")
        try:
            result = fn(self._c)
        except BaseException:
            self._c.execute("ROLLBACK")
            raise
        self._c.execute("COMMIT")
        return result

    # -- the Pull request kept before it is sent (ADR-0108)
    def begin_pull(self, session_id: str, generation: int, pull_id: str, lease_token: str) -> PendingPull:
        check_pull(session_id, generation, pull_id, lease_token)

        def tx(c: sqlite3.Connection) -> PendingPull:
            row = c.execute(PENDING_PULL).fetchone()
            if row is not None and row[0] == session_id and row[1] == generation:
                return PendingPull(session_id=row[0], generation=row[1], pull_id=row[2], lease_token=row[3],
                                   body=bytes(row[4]))
            # Another Session's request is dead: its Leases are fenced by the control plane.
            body = pull_body(session_id, generation, pull_id, lease_token)
            c.execute(PENDING_PULL_PUT, (session_id, generation, pull_id, lease_token, body, self._now()))
            return PendingPull(session_id=session_id, generation=generation, pull_id=pull_id,
                               lease_token=lease_token, body=body)
        return self._tx(tx)

    def end_pull(self, pull_id: str) -> None:
        self._tx(lambda c: c.execute(PENDING_PULL_DELETE, (pull_id,)))

    # -- offers
    def receive(self, offer: InboxOffer, pull_id: str | None = None) -> tuple[InboxEntry, bool]:
        data = check_offer(offer, self.max_bytes)

        def tx(c: sqlite3.Connection):
            row = c.execute(OFFER, (offer.offer_id,)).fetchone()
            if row is not None:
                kept = _entry(row)
                reason = same_offer(kept.offer, offer)
                if reason is not None:
                    # Reported on the kept row (a count and the refused digest, no content).
                    c.execute(OFFER_CONFLICT, (offer.spec_digest, self._now(), offer.offer_id))
                    return OfferConflict(offer.offer_id, reason)
                if pull_id is not None:
                    c.execute(PENDING_PULL_DELETE, (pull_id,))
                return kept, False
            self._make_room(c, len(data))
            now = self._now()
            c.execute(OFFER_INSERT, (offer.offer_id, offer.attempt_id, offer.session_id, offer.generation,
                       offer.lease_generation, offer.lease_expires_at_us, offer.lease_token, offer.spec_digest,
                       data, len(data), now, now, pull_id))
            if pull_id is not None:
                c.execute(PENDING_PULL_DELETE, (pull_id,))
            return InboxEntry(offer=offer, state=InboxState.RECEIVED, outcome=None, received_at_us=now,
                              updated_at_us=now, pull_id=pull_id), True

        result = self._tx(tx)
        if isinstance(result, OfferConflict):
            raise result
        return result

    def _make_room(self, c: sqlite3.Connection, need: int) -> None:
        """Prune acknowledged rows, oldest first, until one more row of ``need`` spec bytes fits;
        raise InboxFull (the transaction rolls back, so nothing is pruned either) if it cannot."""
        rows, used = c.execute(OFFERS_USAGE).fetchone()
        acked = c.execute(OFFERS_ACKED).fetchall()
        drop = []
        for seq, size in acked:
            if rows < self.max_rows and used + need <= self.max_bytes:
                break
            drop.append(seq)
            rows, used = rows - 1, used - size
        if rows >= self.max_rows:
            raise InboxFull(f"the inbox holds {rows} unacknowledged offers, its row cap", field="inboxRows",
                            limit=self.max_rows)
        if used + need > self.max_bytes:
            raise InboxFull(f"the inbox holds {used} bytes of unacknowledged specs; {need} more is over its cap",
                            field="inboxBytes", limit=self.max_bytes)
        c.executemany(OFFER_DELETE, [(s,) for s in drop])

    def advance(self, offer_id: str, state: str, outcome: dict | None = None, *,
                keep_orphans: bool = False) -> InboxEntry:
        if (state == InboxState.COMPLETED) != (outcome is not None):
            raise ValidationError("outcome", "required for completed and only for it")
        if keep_orphans and state != InboxState.ACKED:
            raise ValidationError("keep_orphans", "only when the row is acknowledged")
        data = check_outcome(outcome) if outcome is not None else None

        def tx(c: sqlite3.Connection) -> InboxEntry:
            row = c.execute(OFFER, (offer_id,)).fetchone()
            if row is None:
                raise NotFoundError(f"offerId {offer_id}: not in the inbox", field="offerId")
            kept = _entry(row)
            check_transition(kept.state, state)
            now = self._now()
            if data is not None:
                c.execute(OFFER_MOVE_WITH_OUTCOME, (state, data, now, offer_id))
            else:
                c.execute(OFFER_MOVE, (state, now, offer_id))
            if keep_orphans:
                # In the commit that closes the row: no moment when neither names the Attempt.
                c.execute(KEPT_ORPHAN_PUT, (kept.offer.attempt_id, now))
                c.execute(KEPT_ORPHANS_TRIM, (KEPT_ORPHANS_MAX,))
            return msgspec.structs.replace(kept, state=state, updated_at_us=now,
                                           outcome=outcome if outcome is not None else kept.outcome)
        return self._tx(tx)

    def get(self, offer_id: str) -> InboxEntry | None:
        row = self._c.execute(OFFER, (offer_id,)).fetchone()
        return _entry(row) if row is not None else None

    def open_entries(self) -> list[InboxEntry]:
        rows = self._c.execute(OFFERS_OPEN, tuple(sorted(InboxState.OPEN))).fetchall()
        return [_entry(r) for r in rows]

    def kept_orphans(self) -> set[str]:
        return {r[0] for r in self._c.execute(KEPT_ORPHANS)}

    def forget_orphans(self, attempt_ids) -> None:
        if attempt_ids:
            self._tx(lambda c: c.executemany(KEPT_ORPHAN_DELETE, [(a,) for a in attempt_ids]))

    def usage(self) -> tuple[int, int]:
        rows, used = self._c.execute(OFFERS_USAGE).fetchone()
        return rows, used


def _entry(row) -> InboxEntry:
    (offer_id, attempt_id, session_id, generation, lease_generation, expires, token, digest, spec_json, state,
     outcome_json, received, updated, conflicts, pull_id) = row
    offer = InboxOffer(offer_id=offer_id, attempt_id=attempt_id, session_id=session_id, generation=generation,
                       lease_generation=lease_generation, lease_expires_at_us=expires, lease_token=token,
                       spec_digest=digest, spec=msgspec.json.decode(spec_json))
    return InboxEntry(offer=offer, state=state, received_at_us=received, updated_at_us=updated,
                      conflicts=conflicts, outcome=msgspec.json.decode(outcome_json) if outcome_json else None,
                      pull_id=pull_id)


def diagnose(path: str, max_rows: int, max_bytes: int) -> tuple[bool, str]:
    """``qlagent doctor`` on a fleet Worker: (ok, detail) of the inbox file at ``path``, read
    only (``mode=ro``: nothing created, migrated or checkpointed): its schema version,
    ``PRAGMA quick_check``, rows and stored bytes against the caps. A missing file is ok (the
    Worker creates it at its first start). Never raises for what it inspects."""
    if not os.path.lexists(path):
        return True, f"{path} not created yet (`qlagent serve` creates it)"
    if os.path.islink(path):
        return False, f"{path} is a symlink (the Worker refuses it)"
    import urllib.parse
    # Without a -wal/-shm beside it (no Worker has it open; a clean stop removes them) a read-only
    # connection would still create both: as another user (doctor run as root) they would lock
    # the Worker out. Then the file is read as immutable; else read-only through the Worker's WAL.
    quiet = not any(os.path.lexists(path + x) for x in ("-wal", "-shm"))
    try:
        c = sqlite3.connect(f"file:{urllib.parse.quote(path)}?mode=ro" + ("&immutable=1" if quiet else ""), uri=True,
                            timeout=BUSY_TIMEOUT_MS / 1000)
    except sqlite3.Error as e:
        return False, f"{path}: cannot be opened read-only ({e})"
    try:
        version, latest = c.execute("PRAGMA user_version").fetchone()[0], read_migrations(_MIGRATIONS)[-1].version
        if not 1 <= version <= latest:
            return False, f"{path}: schema version {version}, this build knows {latest}"
        check = [r[0] for r in c.execute("PRAGMA quick_check")]
        if check != ["ok"]:
            return False, f"{path}: quick_check: {'; '.join(check[:3])}"
        rows, used = c.execute(OFFERS_USAGE).fetchone()
        open_rows = c.execute(OFFERS_OPEN_COUNT, tuple(sorted(InboxState.OPEN))).fetchone()[0]
    except sqlite3.Error as e:
        return False, f"{path}: {e}"
    finally:
        c.close()
    return True, (f"{path} quick_check ok; {rows} row(s) ({open_rows} open) of {max_rows}, "
                  f"{used} of {max_bytes} spec bytes")
