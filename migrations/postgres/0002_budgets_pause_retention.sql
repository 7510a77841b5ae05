-- Spend-bounded retries, paused queues, and retention of finished jobs.

ALTER TABLE jobs ADD COLUMN max_cost_cents BIGINT;

-- Retention deletes the oldest finished jobs first, in small batches.
CREATE INDEX jobs_finished ON jobs (finished_at)
    WHERE state IN ('succeeded', 'failed', 'cancelled', 'expired');

-- A paused queue accepts jobs but leases none; the claim checks this table.
CREATE TABLE paused_queues (
    tenant    TEXT NOT NULL,
    queue     TEXT NOT NULL,
    paused_at TIMESTAMPTZ NOT NULL,
    PRIMARY KEY (tenant, queue)
);
