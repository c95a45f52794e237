"""The Worker inbox's statements (``adapters.sqlite.inbox``), by name: its own file and schema
(``inbox_migrations/``), so none of the local store's (``adapters/sqlite/queries.py``) and none
shared with the cluster's."""

from ...core.inbox_states import InboxState

# An offer row in ``InboxEntry`` field order (``inbox._entry``).
_COLS = ("offer_id, attempt_id, session_id, generation, lease_generation, lease_expires_at_us, lease_token, "
         "spec_digest, spec_json, state, outcome_json, received_at_us, updated_at_us, conflicts, pull_id")
# One mark per open state (bound: the open states, sorted).
_OPEN = ",".join("?" * len(InboxState.OPEN))

# A file from before the inbox had migration files has no history table.
MIGRATION_HISTORY_EXISTS = "SELECT 1 FROM sqlite_master WHERE name = 'schema_migrations'"
OFFER = f"SELECT {_COLS} FROM offers WHERE offer_id = ?"
OFFERS_OPEN = f"SELECT {_COLS} FROM offers WHERE state IN ({_OPEN}) ORDER BY seq"
OFFERS_OPEN_COUNT = f"SELECT count(*) FROM offers WHERE state IN ({_OPEN})"

# Offers kept before a Pull is sent (ADR-0108), offers, Attempts whose orphans were kept.
PENDING_PULL = "SELECT session_id, generation, pull_id, lease_token, body FROM pending_pull"
PENDING_PULL_PUT = "INSERT OR REPLACE INTO pending_pull VALUES (1, ?, ?, ?, ?, ?, ?)"
PENDING_PULL_DELETE = "DELETE FROM pending_pull WHERE pull_id = ?"
OFFER_CONFLICT = (
    "UPDATE offers SET conflicts = conflicts + 1, last_conflict_digest = ?, "
    "last_conflict_at_us = ? WHERE offer_id = ?")
OFFER_INSERT = (
    "INSERT INTO offers (offer_id, attempt_id, session_id, generation, lease_generation, "
    "lease_expires_at_us, lease_token, spec_digest, spec_json, spec_bytes, state, "
    "received_at_us, updated_at_us, pull_id) VALUES (?,?,?,?,?,?,?,?,?,?,'received',?,?,?)")
OFFERS_USAGE = "SELECT count(*), coalesce(sum(spec_bytes), 0) FROM offers"
OFFERS_ACKED = "SELECT seq, spec_bytes FROM offers WHERE state = 'acked' ORDER BY seq"
OFFER_DELETE = "DELETE FROM offers WHERE seq = ?"
OFFER_MOVE_WITH_OUTCOME = "UPDATE offers SET state = ?, outcome_json = ?, updated_at_us = ? WHERE offer_id = ?"
OFFER_MOVE = "UPDATE offers SET state = ?, updated_at_us = ? WHERE offer_id = ?"
KEPT_ORPHAN_PUT = "INSERT OR REPLACE INTO kept_orphans VALUES (?, ?)"
KEPT_ORPHANS_TRIM = (
    "DELETE FROM kept_orphans WHERE attempt_id NOT IN (SELECT attempt_id FROM kept_orphans "
    "ORDER BY kept_at_us DESC, rowid DESC LIMIT ?)")
KEPT_ORPHANS = "SELECT attempt_id FROM kept_orphans"
KEPT_ORPHAN_DELETE = "DELETE FROM kept_orphans WHERE attempt_id = ?"
