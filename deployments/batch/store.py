"""The Batch API's durable state (pure: sqlite3 and files, no Ray, no vLLM).

- Metadata (files, batches, each finished line's result) lives in one SQLite database on the local disk of its one
  writer (the BatchAPI replica; SQLite's locking is unreliable on NFS/Lustre).
- File contents live under `files_path` (a shared filesystem on clusters), each written to a temporary name, fsynced
  and renamed into place: a reader never sees half a file, a crash leaves at most an orphan temporary.
- A line's result is recorded once: `(batch_id, custom_id)` is the results table's key and a second result for the
  same line (a line re-run after a crash) is ignored. The output and error files are written from that table when a
  batch ends, in input order, so every input `custom_id` appears exactly once across them.
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import time
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# OpenAI's batch statuses; a batch in ACTIVE is the runner's to work on.
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")
FINAL = ("failed", "completed", "expired", "cancelled")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY, owner TEXT NOT NULL, purpose TEXT NOT NULL, filename TEXT NOT NULL,
    bytes INTEGER NOT NULL, created_at INTEGER NOT NULL, expires_at INTEGER, seq INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS batches (
    id TEXT PRIMARY KEY, owner TEXT NOT NULL, seq INTEGER NOT NULL, data TEXT NOT NULL, status TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS results (
    batch_id TEXT NOT NULL, custom_id TEXT NOT NULL, line INTEGER NOT NULL, ok INTEGER NOT NULL, data TEXT NOT NULL,
    PRIMARY KEY (batch_id, custom_id));
CREATE INDEX IF NOT EXISTS batches_status ON batches (status);
"""


class NotFound(Exception):
    pass


class Conflict(Exception):
    pass


@dataclass
class Page:
    data: list[dict]
    has_more: bool


def _now() -> int:
    return int(time.time())


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex}"


def write_atomically(path: Path, chunks: Iterable[bytes]) -> int:
    """Write `chunks` to `path` through a temporary file, fsync, rename; the bytes written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    size = 0
    try:
        with open(tmp, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
                size += len(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    with contextlib.suppress(OSError):  # the rename itself durable too (where the filesystem allows it)
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    return size


class BatchStore:
    def __init__(self, db_path: str | Path, files_path: str | Path, retention_s: float = 0):
        self.files_path = Path(files_path).expanduser()
        self.files_path.mkdir(parents=True, exist_ok=True)
        db_path = Path(db_path).expanduser()
        db_path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(str(db_path), isolation_level=None, check_same_thread=False)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.executescript(_SCHEMA)
        self.retention_s = retention_s
        self._seq = int(
            self._db.execute(
                "SELECT max(m) FROM (SELECT max(seq) m FROM files UNION ALL SELECT max(seq) FROM batches)"
            ).fetchone()[0]
            or 0
        )

    def close(self) -> None:
        self._db.close()

    @contextlib.contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield self._db
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    # ---- files -------------------------------------------------------------------------------------------------
    def file_path(self, file_id: str) -> Path:
        return self.files_path / file_id

    def add_file(self, chunks: Iterable[bytes], filename: str, purpose: str, owner: str = "") -> dict:
        file_id = new_id("file-")
        size = write_atomically(self.file_path(file_id), chunks)
        created = _now()
        expires = created + int(self.retention_s) if self.retention_s > 0 else None
        with self._tx() as db:
            db.execute(
                "INSERT INTO files VALUES (?,?,?,?,?,?,?,?)",
                (file_id, owner, purpose, filename, size, created, expires, self._next_seq()),
            )
        return self.get_file(file_id, owner)

    def get_file(self, file_id: str, owner: str = "") -> dict:
        row = self._db.execute("SELECT * FROM files WHERE id=? AND owner=?", (file_id, owner)).fetchone()
        if row is None or not self.file_path(file_id).exists():
            raise NotFound(f"No file with id {file_id!r}")
        return _file_object(row)

    def list_files(
        self,
        owner: str = "",
        after: str | None = None,
        limit: int = 10000,
        purpose: str | None = None,
        order: str = "desc",
    ) -> Page:
        return self._page(
            "files", owner, after, limit, order, _file_object, ("purpose=?", purpose) if purpose else None
        )

    def delete_file(self, file_id: str, owner: str = "") -> dict:
        self.get_file(file_id, owner)
        with self._tx() as db:
            db.execute("DELETE FROM files WHERE id=?", (file_id,))
        with contextlib.suppress(FileNotFoundError):
            self.file_path(file_id).unlink()
        return {"id": file_id, "object": "file", "deleted": True}

    # ---- batches -----------------------------------------------------------------------------------------------
    def add_batch(
        self,
        owner: str,
        input_file_id: str,
        endpoint: str,
        completion_window_s: float,
        window: str,
        metadata: dict | None,
    ) -> dict:
        self.get_file(input_file_id, owner)
        created = _now()
        batch = {
            "id": new_id("batch_"),
            "object": "batch",
            "endpoint": endpoint,
            "errors": None,
            "input_file_id": input_file_id,
            "completion_window": window,
            "status": "validating",
            "output_file_id": None,
            "error_file_id": None,
            "created_at": created,
            "in_progress_at": None,
            "expires_at": created + int(completion_window_s),
            "finalizing_at": None,
            "completed_at": None,
            "failed_at": None,
            "expired_at": None,
            "cancelling_at": None,
            "cancelled_at": None,
            "request_counts": {"total": 0, "completed": 0, "failed": 0},
            "metadata": metadata,
        }
        with self._tx() as db:
            db.execute(
                "INSERT INTO batches VALUES (?,?,?,?,?)",
                (batch["id"], owner, self._next_seq(), json.dumps(batch), batch["status"]),
            )
        return batch

    def get_batch(self, batch_id: str, owner: str | None = "") -> dict:
        """A batch (owner None: any owner's, for the runner), with its request counts as of now."""
        if owner is None:
            row = self._db.execute("SELECT data FROM batches WHERE id=?", (batch_id,)).fetchone()
        else:
            row = self._db.execute("SELECT data FROM batches WHERE id=? AND owner=?", (batch_id, owner)).fetchone()
        if row is None:
            raise NotFound(f"No batch with id {batch_id!r}")
        batch = json.loads(row["data"])
        if batch["status"] in ("in_progress", "finalizing", "cancelling"):
            batch["request_counts"] = self._counts(batch_id, batch["request_counts"]["total"])
        return batch

    def list_batches(self, owner: str = "", after: str | None = None, limit: int = 20) -> Page:
        return self._page("batches", owner, after, limit, "desc", lambda row: self.get_batch(row["id"], None))

    def active_batches(self) -> list[dict]:
        """Batches the runner has work on, oldest first."""
        rows = self._db.execute(
            f"SELECT id FROM batches WHERE status IN ({','.join('?' * len(ACTIVE))}) ORDER BY seq", ACTIVE
        ).fetchall()
        return [self.get_batch(r["id"], None) for r in rows]

    def update_batch(self, batch_id: str, expect: tuple[str, ...] | None = None, **fields: Any) -> dict:
        """Set fields of a batch (a new `status` also stamps its `<status>_at`); `expect`: the statuses it may be in,
        else Conflict."""
        with self._tx() as db:
            batch = self.get_batch(batch_id, None)
            if expect is not None and batch["status"] not in expect:
                raise Conflict(f"batch {batch_id} is {batch['status']}")
            batch.update(fields)
            if "status" in fields and fields["status"] != "validating":
                batch[f"{fields['status']}_at"] = _now()
            db.execute("UPDATE batches SET data=?, status=? WHERE id=?", (json.dumps(batch), batch["status"], batch_id))
        return batch

    def cancel(self, batch_id: str, owner: str = "") -> dict:
        batch = self.get_batch(batch_id, owner)
        if batch["status"] in ("cancelling", "cancelled"):
            return batch
        try:
            return self.update_batch(batch_id, expect=("validating", "in_progress"), status="cancelling")
        except Conflict as e:
            raise Conflict(f"Cannot cancel a batch that is {batch['status']}") from e

    # ---- results -----------------------------------------------------------------------------------------------
    def record(self, batch_id: str, results: list[tuple[str, int, bool, dict]]) -> dict:
        """Record finished lines: (custom_id, line number, succeeded, output/error line). A line recorded already
        keeps its first result. The batch's counts after."""
        with self._tx() as db:
            db.executemany(
                "INSERT OR IGNORE INTO results VALUES (?,?,?,?,?)",
                [(batch_id, cid, line, int(ok), json.dumps(data)) for cid, line, ok, data in results],
            )
        return self._counts(batch_id, None)

    def finished_ids(self, batch_id: str) -> set[str]:
        return {r[0] for r in self._db.execute("SELECT custom_id FROM results WHERE batch_id=?", (batch_id,))}

    def _counts(self, batch_id: str, total: int | None) -> dict:
        ok, failed = self._db.execute(
            "SELECT coalesce(sum(ok),0), coalesce(sum(1-ok),0) FROM results WHERE batch_id=?", (batch_id,)
        ).fetchone()
        counts = {"completed": ok, "failed": failed}
        return counts if total is None else {"total": total, **counts}

    def finalize(self, batch_id: str, status: str, unfinished: list[tuple[str, int, dict]] = ()) -> dict:
        """End a batch: record `unfinished` lines' errors (expired ones), write the output and error files from the
        results in input order, set their ids and the final status, in one step for the metadata."""
        if unfinished:
            self.record(batch_id, [(cid, line, False, data) for cid, line, data in unfinished])
        batch = self.get_batch(batch_id, None)
        owner = self._db.execute("SELECT owner FROM batches WHERE id=?", (batch_id,)).fetchone()[0]
        ids: dict[str, str | None] = {}
        for ok, key in ((1, "output_file_id"), (0, "error_file_id")):
            n = self._db.execute("SELECT count(*) FROM results WHERE batch_id=? AND ok=?", (batch_id, ok)).fetchone()[0]
            if n == 0:
                ids[key] = None
                continue
            rows = self._db.execute("SELECT data FROM results WHERE batch_id=? AND ok=? ORDER BY line", (batch_id, ok))
            name = f"batch_{batch_id}_{'output' if ok else 'error'}.jsonl"
            ids[key] = self.add_file((r[0].encode() + b"\n" for r in rows), name, "batch_output", owner)["id"]
        counts = self._counts(batch_id, batch["request_counts"]["total"])
        return self.update_batch(batch_id, status=status, request_counts=counts, **ids)

    # ---- housekeeping ------------------------------------------------------------------------------------------
    def expire_files(self) -> int:
        """Delete files past their retention (`expires_at`); how many."""
        rows = self._db.execute(
            "SELECT id FROM files WHERE expires_at IS NOT NULL AND expires_at <= ?", (_now(),)
        ).fetchall()
        for r in rows:
            with self._tx() as db:
                db.execute("DELETE FROM files WHERE id=?", (r["id"],))
            with contextlib.suppress(FileNotFoundError):
                self.file_path(r["id"]).unlink()
        return len(rows)

    def _page(
        self,
        table: str,
        owner: str,
        after: str | None,
        limit: int,
        order: str,
        convert,
        where: tuple[str, Any] | None = None,
    ) -> Page:
        clauses, params = ["owner=?"], [owner]
        if where:
            clauses.append(where[0])
            params.append(where[1])
        op, direction = ("<", "DESC") if order == "desc" else (">", "ASC")
        if after:
            row = self._db.execute(f"SELECT seq FROM {table} WHERE id=?", (after,)).fetchone()
            if row is None:
                raise NotFound(f"`after`: no object with id {after!r}")
            clauses.append(f"seq {op} ?")
            params.append(row["seq"])
        rows = self._db.execute(
            f"SELECT * FROM {table} WHERE {' AND '.join(clauses)} ORDER BY seq {direction} LIMIT ?",
            (*params, limit + 1),
        ).fetchall()
        return Page([convert(r) for r in rows[:limit]], len(rows) > limit)


def _file_object(row: sqlite3.Row) -> dict:
    return {
        "id": row["id"],
        "object": "file",
        "bytes": row["bytes"],
        "created_at": row["created_at"],
        "expires_at": row["expires_at"],
        "filename": row["filename"],
        "purpose": row["purpose"],
        "status": "processed",
        "status_details": None,
    }
