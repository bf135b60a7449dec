"""The YAML's `batch:` block (app/config/root.py's SummitConfig holds it): where the Batch API keeps its data, its
limits, and how much of the engines batch work may take."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class BatchOptions(BaseModel):
    """The OpenAI Batch API (`/v1/files`, `/v1/batches`) and its runner; on when this block is present."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    db_path: str = Field(
        "~/.summit/batch/batch.sqlite3",
        description="SQLite database of files, batches and finished lines. On the local "
        "disk of the node the store runs on (the head node: SQLite's locking is unreliable on NFS/Lustre).",
    )
    files_path: str = Field(
        "~/.summit/batch/files",
        description="Where uploaded and result files are kept (a shared filesystem on "
        "clusters, so that a new head node finds them).",
    )
    max_concurrency: int = Field(
        512,
        ge=1,
        description="Batch lines in flight at once (per application); about twice the engines' sequences (max_num_seqs "
        "× replicas) keeps them full: each replica runs at most its engine's sequences of them and holds the rest, so "
        "online requests never queue behind batch lines in vLLM.",
    )
    group_size: int = Field(
        16,
        ge=1,
        description="Batch lines handed to an engine replica per call (each line still runs as its own engine "
        "request, through vLLM's serving objects in the replica's process).",
    )
    online_share: float = Field(
        0.1,
        ge=0,
        le=1,
        description="While online requests run on a replica (and for 2 s after the last), batch lines may hold at most "
        "this fraction of its engine's sequences (max_num_seqs; at least one line); otherwise up to max_concurrency.",
    )
    priority: int = Field(
        10,
        ge=1,
        description="vLLM request priority of batch lines on models whose engine_kwargs set "
        "`scheduling_policy: priority` (online requests have 0, which runs first).",
    )
    max_file_bytes: int = Field(200 * 2**20, ge=1, description="Largest upload (OpenAI's limit: 200 MB).")
    max_lines: int = Field(50_000, ge=1, description="Most requests in one batch's input file (OpenAI's: 50,000).")
    retention_days: float = Field(30.0, ge=0, description="Files are deleted this long after upload; 0 keeps them.")
    poll_s: float = Field(
        1.0,
        gt=0,
        description="How often the runner looks for cancellation and expiry while a batch "
        "runs (it is woken at once for new batches and cancels).",
    )
