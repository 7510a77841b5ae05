-- Completion callbacks (issue 7): an outbox of deliveries, written by a
-- trigger on the terminal event of a job with a callback_url, so it commits
-- in the transaction of the transition whichever path wrote the event.
-- Timestamps are Unix milliseconds.
CREATE TABLE webhook_deliveries (
    webhook_id      TEXT PRIMARY KEY,            -- 'evt_<job id>_<sequence>': stable across retries
    job_id          TEXT NOT NULL REFERENCES jobs (id) ON DELETE CASCADE,
    sequence        INTEGER NOT NULL,
    tenant          TEXT NOT NULL,
    event_type      TEXT NOT NULL,
    url             TEXT NOT NULL,
    status          TEXT NOT NULL DEFAULT 'pending' CHECK (status IN ('pending', 'delivered', 'failed')),
    attempts        INTEGER NOT NULL DEFAULT 0,
    next_attempt_at INTEGER NOT NULL,
    created_at      INTEGER NOT NULL,
    last_attempt_at INTEGER,
    last_status     INTEGER,
    last_error      TEXT,
    UNIQUE (job_id, sequence)
);

CREATE INDEX webhook_deliveries_due ON webhook_deliveries (next_attempt_at) WHERE status = 'pending';

CREATE INDEX jobs_callback_finished ON jobs (finished_at) WHERE callback_url IS NOT NULL;

CREATE TRIGGER job_events_webhook_outbox AFTER INSERT ON job_events
WHEN NEW.type IN ('succeeded', 'failed', 'cancelled', 'expired')
BEGIN
    INSERT OR IGNORE INTO webhook_deliveries (webhook_id, job_id, sequence, tenant, event_type, url,
                                              next_attempt_at, created_at)
    SELECT 'evt_' || j.id || '_' || NEW.sequence, j.id, NEW.sequence, j.tenant, NEW.type,
           j.callback_url, NEW.at, NEW.at
    FROM jobs j
    WHERE j.id = NEW.job_id AND j.callback_url IS NOT NULL;
END;
