-- Jobs and their append-only history.

CREATE TABLE jobs (
    id                  UUID PRIMARY KEY,            -- UUIDv7: time-ordered, so keyset pages by id
    tenant              TEXT NOT NULL,
    queue               TEXT NOT NULL,
    kind                TEXT NOT NULL,
    state               TEXT NOT NULL CHECK (state IN ('queued', 'running', 'succeeded', 'failed', 'cancelled', 'expired')),
    payload             JSONB NOT NULL,
    result              JSONB,
    error_class         TEXT,
    error_message       TEXT,
    attempt             INTEGER NOT NULL DEFAULT 0,
    max_attempts        INTEGER NOT NULL,
    priority            INTEGER NOT NULL DEFAULT 0,
    idempotency_key     TEXT,
    input_hash          TEXT NOT NULL,
    labels              JSONB NOT NULL DEFAULT '{}',
    progress            DOUBLE PRECISION NOT NULL DEFAULT 0,
    cancel_requested    BOOLEAN NOT NULL DEFAULT false,
    cancel_requested_at TIMESTAMPTZ,
    cost_cents          BIGINT NOT NULL DEFAULT 0,
    lease_owner         TEXT,
    lease_token         TEXT,
    lease_expires_at    TIMESTAMPTZ,
    run_at              TIMESTAMPTZ NOT NULL,
    deadline            TIMESTAMPTZ,
    backoff_initial_ms  BIGINT NOT NULL,
    backoff_max_ms      BIGINT NOT NULL,
    callback_url        TEXT,
    created_at          TIMESTAMPTZ NOT NULL,
    updated_at          TIMESTAMPTZ NOT NULL,
    started_at          TIMESTAMPTZ,
    finished_at         TIMESTAMPTZ,
    event_seq           BIGINT NOT NULL              -- sequence of the last event: the next one is gap-free
);

-- The claim: only runnable rows are in it, in claim order, so its cost does
-- not grow with the number of finished jobs.
CREATE INDEX jobs_claim ON jobs (tenant, queue, priority DESC, run_at, id) WHERE state = 'queued';
CREATE UNIQUE INDEX jobs_idempotency ON jobs (tenant, idempotency_key) WHERE idempotency_key IS NOT NULL;
CREATE INDEX jobs_lease_expiry ON jobs (lease_expires_at) WHERE state = 'running';
CREATE INDEX jobs_deadline ON jobs (deadline) WHERE state = 'queued' AND deadline IS NOT NULL;
CREATE INDEX jobs_running_owner ON jobs (tenant, lease_owner) WHERE state = 'running';
CREATE INDEX jobs_by_tenant ON jobs (tenant, id DESC);
CREATE INDEX jobs_by_tenant_state ON jobs (tenant, state, queue);

CREATE TABLE job_events (
    job_id    UUID NOT NULL REFERENCES jobs (id) ON DELETE CASCADE,
    sequence  BIGINT NOT NULL,
    type      TEXT NOT NULL,
    state     TEXT NOT NULL,
    attempt   INTEGER NOT NULL,
    worker_id TEXT,
    at        TIMESTAMPTZ NOT NULL,
    detail    JSONB,
    PRIMARY KEY (job_id, sequence)
);

-- Events are history: nothing may rewrite one (retention deletes whole jobs).
CREATE FUNCTION intray_job_events_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'job_events is append-only';
END
$$;
CREATE TRIGGER job_events_append_only BEFORE UPDATE ON job_events
    FOR EACH ROW EXECUTE FUNCTION intray_job_events_append_only();

-- Workers seen by Lease, for Stats.
CREATE TABLE workers (
    tenant        TEXT NOT NULL,
    worker_id     TEXT NOT NULL,
    queues        JSONB NOT NULL,
    last_lease_at TIMESTAMPTZ NOT NULL,
    PRIMARY KEY (tenant, worker_id)
);
