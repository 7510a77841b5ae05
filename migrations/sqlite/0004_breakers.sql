-- Circuit breakers per tenant, queue and kind. No row: closed, no failures.
CREATE TABLE breakers (
    tenant             TEXT NOT NULL,
    queue              TEXT NOT NULL,
    kind               TEXT NOT NULL,
    failures           INTEGER NOT NULL,
    max_retry_after_ms INTEGER NOT NULL,
    open_until         INTEGER,
    probe_job          TEXT,
    updated_at         INTEGER NOT NULL,
    PRIMARY KEY (tenant, queue, kind)
);
