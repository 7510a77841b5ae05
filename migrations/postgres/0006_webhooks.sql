-- Completion callbacks (issue 7): an outbox of deliveries.
--
-- A delivery row is written by a trigger on the update that moves a job
-- with a callback_url into a terminal state, so it commits in the
-- transaction of the transition whichever path (Complete, Cancel, the
-- reaper) made it. The WHEN clause filters in the executor: for a job
-- without a callback, and for every non-terminal update (heartbeats), no
-- function is called at all.
CREATE TABLE webhook_deliveries (
    webhook_id      TEXT PRIMARY KEY,            -- 'evt_<job id>_<sequence>': stable across retries
    job_id          UUID NOT NULL REFERENCES jobs (id) ON DELETE CASCADE,
    sequence        BIGINT NOT NULL,             -- the terminal event's sequence
    tenant          TEXT NOT NULL,
    event_type      TEXT NOT NULL,
    url             TEXT NOT NULL,
    status          TEXT NOT NULL DEFAULT 'pending' CHECK (status IN ('pending', 'delivered', 'failed')),
    attempts        INTEGER NOT NULL DEFAULT 0,
    next_attempt_at TIMESTAMPTZ NOT NULL,        -- also the claim: a claimed row is pushed forward
    created_at      TIMESTAMPTZ NOT NULL,
    last_attempt_at TIMESTAMPTZ,
    last_status     INTEGER,                     -- HTTP status of the last attempt
    last_error      TEXT,
    UNIQUE (job_id, sequence)
);

CREATE INDEX webhook_deliveries_due ON webhook_deliveries (next_attempt_at) WHERE status = 'pending';

-- The reconciliation sweep finds recently finished jobs with a callback
-- through this; callback_url never changes, so it keeps heartbeats HOT.
CREATE INDEX jobs_callback_finished ON jobs (finished_at) WHERE callback_url IS NOT NULL;

CREATE FUNCTION intray_webhook_outbox() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    -- event_seq is the terminal event's sequence (written with it); the
    -- terminal states and event types share their names.
    INSERT INTO webhook_deliveries (webhook_id, job_id, sequence, tenant, event_type, url,
                                    next_attempt_at, created_at)
    VALUES ('evt_' || NEW.id || '_' || NEW.event_seq, NEW.id, NEW.event_seq, NEW.tenant,
            NEW.state, NEW.callback_url, now(), now())
    ON CONFLICT DO NOTHING;
    RETURN NULL;
END
$$;

CREATE TRIGGER jobs_webhook_outbox AFTER UPDATE ON jobs
    FOR EACH ROW
    WHEN (NEW.callback_url IS NOT NULL
          AND NEW.state IN ('succeeded', 'failed', 'cancelled', 'expired')
          AND OLD.state IS DISTINCT FROM NEW.state)
    EXECUTE FUNCTION intray_webhook_outbox();
