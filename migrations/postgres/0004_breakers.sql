-- Circuit breakers per tenant, queue and kind. No row: closed, no failures.
CREATE TABLE breakers (
    tenant             TEXT NOT NULL,
    queue              TEXT NOT NULL,
    kind               TEXT NOT NULL,
    failures           INTEGER NOT NULL,        -- consecutive transient failures
    max_retry_after_ms BIGINT NOT NULL,         -- largest retry_after among them
    open_until         TIMESTAMPTZ,             -- open until then, half-open after; NULL: closed
    probe_job          UUID,                    -- the half-open probe in flight
    updated_at         TIMESTAMPTZ NOT NULL,
    PRIMARY KEY (tenant, queue, kind)
);
