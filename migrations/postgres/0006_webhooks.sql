-- Completion callbacks (issue 7): an outbox of deliveries.
--
-- A delivery row is written by a trigger on the terminal event of a job
-- that has a callback_url, so it commits in the transaction of the
-- transition, whichever path (Complete, Cancel, the reaper) wrote the
-- event. The trigger fires only for terminal events (WHEN clause); for a
-- job without a callback it costs one primary-key lookup.
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
    INSERT INTO webhook_deliveries (webhook_id, job_id, sequence, tenant, event_type, url,
                                    next_attempt_at, created_at)
    SELECT 'evt_' || j.id || '_' || NEW.sequence, j.id, NEW.sequence, j.tenant, NEW.type,
           j.callback_url, NEW.at, NEW.at
    FROM jobs j
    WHERE j.id = NEW.job_id AND j.callback_url IS NOT NULL
    ON CONFLICT DO NOTHING;
    RETURN NULL;
END
$$;

CREATE TRIGGER job_events_webhook_outbox AFTER INSERT ON job_events
    FOR EACH ROW WHEN (NEW.type IN ('succeeded', 'failed', 'cancelled', 'expired'))
    EXECUTE FUNCTION intray_webhook_outbox();
