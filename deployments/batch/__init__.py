"""The Batch API's runtime: `store` (SQLite + files), `lines` (input/output lines), `core` (runs lines on a `send`),
`routes` (OpenAI's /v1/files and /v1/batches), `api` (the BatchAPI deployment: the store's one writer and its app),
`runner` (the BatchRunner deployment). The offline `summit batch` command (app/batch/) uses the same core."""
