-- Spend-bounded retries, paused queues, and retention of finished jobs.

ALTER TABLE jobs ADD COLUMN max_cost_cents INTEGER;

CREATE INDEX jobs_finished ON jobs (finished_at)
    WHERE state IN ('succeeded', 'failed', 'cancelled', 'expired');

CREATE TABLE paused_queues (
    tenant    TEXT NOT NULL,
    queue     TEXT NOT NULL,
    paused_at INTEGER NOT NULL,
    PRIMARY KEY (tenant, queue)
);
