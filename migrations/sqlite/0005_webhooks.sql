-- Completion callbacks (issue 7): an outbox of deliveries, written by a
-- trigger on the update that moves a job with a callback_url into a
-- terminal state, so it commits in the transaction of the transition
-- whichever path made it. Timestamps are Unix milliseconds.
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

-- event_seq is the terminal event's sequence (written with it); the
-- terminal states and event types share their names.
CREATE TRIGGER jobs_webhook_outbox AFTER UPDATE ON jobs
WHEN NEW.callback_url IS NOT NULL
     AND NEW.state IN ('succeeded', 'failed', 'cancelled', 'expired')
     AND OLD.state IS NOT NEW.state
BEGIN
    INSERT OR IGNORE INTO webhook_deliveries (webhook_id, job_id, sequence, tenant, event_type, url,
                                              next_attempt_at, created_at)
    VALUES ('evt_' || NEW.id || '_' || NEW.event_seq, NEW.id, NEW.event_seq, NEW.tenant,
            NEW.state, NEW.callback_url, NEW.updated_at, NEW.updated_at);
END;
