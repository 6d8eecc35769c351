"""How long and how much the store keeps (``--store-retention``, ``--store-max-size``).

`sweep` removes, in one transaction, every finished object older than the retention
period, then the oldest finished objects until the stored bytes fit the size limit, and
leaves a tombstone per removed id (table ``evicted``) so that a client asking for it
learns it was evicted and why, not merely that it does not exist. Objects still in use
(a queued or running background response, a batch in progress and the files it reads or
writes) are never evicted. Tombstones themselves go after another retention period, or
beyond `MAX_TOMBSTONES`.
"""

from __future__ import annotations

from dataclasses import dataclass

from trio_llm.store import conversations
from trio_llm.store.database import Transaction
from trio_llm.store.objects import loads, now

#: Most tombstones kept (the oldest go first).
MAX_TOMBSTONES = 100_000

#: Response and batch statuses of objects that are still in use.
ACTIVE_RESPONSE = ("queued", "in_progress")
ACTIVE_BATCH = ("validating", "in_progress", "finalizing", "cancelling")


def format_duration(seconds: float) -> str:
    """``2592000`` -> ``"30d"``, ``5400`` -> ``"90m"`` (the largest whole unit)."""
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    return f"{seconds:g}s"


@dataclass(frozen=True)
class RetentionPolicy:
    """What the store keeps.

    Attributes:
        max_age: seconds a finished object is kept after it was created; None: no limit.
        max_bytes: most bytes of stored objects (JSON and file contents); None: no limit.
    """

    max_age: float | None = 30 * 86400.0
    max_bytes: int | None = 10 * 2**30


@dataclass(frozen=True)
class _Candidate:
    kind: str
    object_id: str
    created_at: int
    nbytes: int


def _candidates(tx: Transaction) -> list[_Candidate]:
    """Every finished object that may be evicted, oldest first."""
    active_batch = ",".join("?" * len(ACTIVE_BATCH))
    active_response = ",".join("?" * len(ACTIVE_RESPONSE))
    rows = tx.rows(
        f"SELECT 'response', id, created_at, nbytes FROM responses "
        f"WHERE status NOT IN ({active_response}) "
        "UNION ALL SELECT 'conversation', id, created_at, nbytes FROM conversations "
        "WHERE hidden = 0 "
        f"UNION ALL SELECT 'batch', id, created_at, LENGTH(body) FROM batches "
        f"WHERE status NOT IN ({active_batch}) "
        "UNION ALL SELECT 'file', id, created_at, bytes FROM files",
        (*ACTIVE_RESPONSE, *ACTIVE_BATCH),
    )
    found = [_Candidate(str(r[0]), str(r[1]), int(r[2]), int(r[3])) for r in rows]
    in_use = _files_in_use(tx)
    return sorted(
        (c for c in found if c.object_id not in in_use), key=lambda c: (c.created_at, c.object_id)
    )


def _files_in_use(tx: Transaction) -> set[str]:
    """Ids of the input, output and error files of batches still running."""
    marks = ",".join("?" * len(ACTIVE_BATCH))
    rows = tx.rows(f"SELECT body FROM batches WHERE status IN ({marks})", ACTIVE_BATCH)
    used: set[str] = set()
    for (body,) in rows:
        batch = loads(body)
        used.update(batch.get(key) for key in ("input_file_id", "output_file_id", "error_file_id"))
    used.discard(None)  # type: ignore[arg-type]
    return used


_DELETE = {
    "response": "DELETE FROM responses WHERE id = ?",
    "batch": "DELETE FROM batches WHERE id = ?",
    "file": "DELETE FROM files WHERE id = ?",
}


class _Freed:
    """The bytes a sweep frees as it evicts, oldest first. A conversation whose items
    stored responses still list is hidden, not removed (`conversations.evict`): its bytes
    are freed with the last such response (a deleted conversation's too)."""

    def __init__(self, tx: Transaction) -> None:
        rows = tx.rows(
            "SELECT id, context_conversation FROM responses WHERE context_conversation IS NOT NULL"
        )
        self.listing = {str(r[0]): str(r[1]) for r in rows}
        self.listed: dict[str, int] = {}
        for conversation_id in self.listing.values():
            self.listed[conversation_id] = self.listed.get(conversation_id, 0) + 1
        hidden = tx.rows("SELECT id, nbytes FROM conversations WHERE hidden = 1")
        self.held = {str(r[0]): int(r[1]) for r in hidden}

    def evict(self, candidate: _Candidate) -> int:
        """The bytes evicting ``candidate`` frees."""
        if candidate.kind == "conversation" and self.listed.get(candidate.object_id):
            self.held[candidate.object_id] = candidate.nbytes
            return 0
        freed = candidate.nbytes
        conversation_id = self.listing.pop(candidate.object_id, None)
        if conversation_id is not None:
            self.listed[conversation_id] -= 1
            if not self.listed[conversation_id]:
                freed += self.held.pop(conversation_id, 0)
        return freed


def sweep(tx: Transaction, policy: RetentionPolicy, at: int | None = None) -> list[tuple[str, str]]:
    """Evict what the policy no longer keeps; return ``(kind, id)`` of each object removed
    (the caller deletes the files' contents from disk after the commit)."""
    at = now() if at is None else at
    removed: list[tuple[str, str, str]] = []
    freed = _Freed(tx)
    total = stored_bytes(tx)
    for candidate in _candidates(tx):
        if policy.max_age is not None and candidate.created_at < at - policy.max_age:
            period = format_duration(policy.max_age)
            reason = f"older than the store's retention period (--store-retention {period})"
        elif policy.max_bytes is not None and total > policy.max_bytes:
            reason = "evicted to keep the store within its size (--store-max-size)"
        else:
            continue
        removed.append((candidate.kind, candidate.object_id, reason))
        total -= freed.evict(candidate)
    for kind, object_id, reason in removed:
        if kind == "conversation":
            conversations.evict(tx, object_id)
        else:
            tx.execute(_DELETE[kind], (object_id,))
        tx.execute(
            "INSERT INTO evicted (id, kind, evicted_at, reason) VALUES (?, ?, ?, ?) "
            "ON CONFLICT (id) DO NOTHING",
            (object_id, kind, at, reason),
        )
    conversations.collect(tx)
    _prune_tombstones(tx, policy, at)
    return [(kind, object_id) for kind, object_id, _ in removed]


def stored_bytes(tx: Transaction) -> int:
    """The bytes the store holds: stored JSON, batch results and file contents."""
    row = tx.one(
        "SELECT (SELECT COALESCE(SUM(nbytes), 0) FROM responses)"
        " + (SELECT COALESCE(SUM(nbytes), 0) FROM conversations)"
        " + (SELECT COALESCE(SUM(LENGTH(body)), 0) FROM batches)"
        " + (SELECT COALESCE(SUM(LENGTH(result)), 0) FROM batch_results)"
        " + (SELECT COALESCE(SUM(bytes), 0) FROM files)"
    )
    return int(row[0]) if row is not None else 0


def _prune_tombstones(tx: Transaction, policy: RetentionPolicy, at: int) -> None:
    if policy.max_age is not None:
        tx.execute("DELETE FROM evicted WHERE evicted_at < ?", (at - policy.max_age,))
    row = tx.one("SELECT COUNT(*) FROM evicted")
    excess = (int(row[0]) if row else 0) - MAX_TOMBSTONES
    if excess > 0:
        tx.execute(
            "DELETE FROM evicted WHERE id IN "
            "(SELECT id FROM evicted ORDER BY evicted_at, id LIMIT ?)",
            (excess,),
        )
