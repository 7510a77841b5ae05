-- Jobs and their append-only history. Timestamps are Unix milliseconds, ids
-- and JSON are text.

CREATE TABLE jobs (
    id                  TEXT PRIMARY KEY,            -- UUIDv7 text: sorts by time, so keyset pages by id
    tenant              TEXT NOT NULL,
    queue               TEXT NOT NULL,
    kind                TEXT NOT NULL,
    state               TEXT NOT NULL CHECK (state IN ('queued', 'running', 'succeeded', 'failed', 'cancelled', 'expired')),
    payload             TEXT NOT NULL,
    result              TEXT,
    error_class         TEXT,
    error_message       TEXT,
    attempt             INTEGER NOT NULL DEFAULT 0,
    max_attempts        INTEGER NOT NULL,
    priority            INTEGER NOT NULL DEFAULT 0,
    idempotency_key     TEXT,
    input_hash          TEXT NOT NULL,
    labels              TEXT NOT NULL DEFAULT '{}',
    progress            REAL NOT NULL DEFAULT 0,
    cancel_requested    INTEGER NOT NULL DEFAULT 0,
    cancel_requested_at INTEGER,
    cost_cents          INTEGER NOT NULL DEFAULT 0,
    lease_owner         TEXT,
    lease_token         TEXT,
    lease_expires_at    INTEGER,
    run_at              INTEGER NOT NULL,
    deadline            INTEGER,
    backoff_initial_ms  INTEGER NOT NULL,
    backoff_max_ms      INTEGER NOT NULL,
    callback_url        TEXT,
    created_at          INTEGER NOT NULL,
    updated_at          INTEGER NOT NULL,
    started_at          INTEGER,
    finished_at         INTEGER,
    event_seq           INTEGER NOT NULL
);

CREATE INDEX jobs_claim ON jobs (tenant, queue, priority DESC, run_at, id) WHERE state = 'queued';
CREATE UNIQUE INDEX jobs_idempotency ON jobs (tenant, idempotency_key) WHERE idempotency_key IS NOT NULL;
CREATE INDEX jobs_lease_expiry ON jobs (lease_expires_at) WHERE state = 'running';
CREATE INDEX jobs_deadline ON jobs (deadline) WHERE state = 'queued' AND deadline IS NOT NULL;
CREATE INDEX jobs_running_owner ON jobs (tenant, lease_owner) WHERE state = 'running';
CREATE INDEX jobs_by_tenant ON jobs (tenant, id DESC);
CREATE INDEX jobs_by_tenant_state ON jobs (tenant, state, queue);

CREATE TABLE job_events (
    job_id    TEXT NOT NULL REFERENCES jobs (id) ON DELETE CASCADE,
    sequence  INTEGER NOT NULL,
    type      TEXT NOT NULL,
    state     TEXT NOT NULL,
    attempt   INTEGER NOT NULL,
    worker_id TEXT,
    at        INTEGER NOT NULL,
    detail    TEXT,
    PRIMARY KEY (job_id, sequence)
) WITHOUT ROWID;

CREATE TRIGGER job_events_append_only BEFORE UPDATE ON job_events
BEGIN
    SELECT RAISE(ABORT, 'job_events is append-only');
END;

CREATE TABLE workers (
    tenant        TEXT NOT NULL,
    worker_id     TEXT NOT NULL,
    queues        TEXT NOT NULL,
    last_lease_at INTEGER NOT NULL,
    PRIMARY KEY (tenant, worker_id)
);
