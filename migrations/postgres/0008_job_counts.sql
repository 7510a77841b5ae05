-- Job counts per tenant, queue and state, kept by the database (issue 6).
--
-- The queue gauges, the Stats call and the queue bound used to count the
-- jobs table: half a second of database CPU per reading at a million
-- queued jobs, every refresh of every replica, whatever the load. The
-- counts are now kept as the rows change, so a reading costs as much with
-- a million jobs as with a thousand.
--
-- Every statement that inserts, updates or deletes jobs appends its net
-- change per (tenant, queue, state) to job_count_deltas, in its own
-- transaction. Appending never waits: one counter row per queue updated by
-- every transaction would serialise all writers of the queue on its lock.
-- Readers fold the deltas into job_counts now and then (one at a time,
-- under an advisory lock) and add what is left to it.
--
-- Statement triggers with transition tables: one trigger call per
-- statement, however many rows it touches, and no path that changes jobs
-- (the hot path, the reaper, retries, future ones) can forget its count.
CREATE TABLE job_counts (
    tenant TEXT NOT NULL,
    queue  TEXT NOT NULL,
    state  TEXT NOT NULL,
    n      BIGINT NOT NULL,
    PRIMARY KEY (tenant, queue, state)
);

CREATE TABLE job_count_deltas (
    tenant TEXT NOT NULL,
    queue  TEXT NOT NULL,
    state  TEXT NOT NULL,
    n      BIGINT NOT NULL
);

-- Rows live for seconds; clear them as fast as they are folded.
ALTER TABLE job_count_deltas SET (
    autovacuum_vacuum_scale_factor = 0,
    autovacuum_vacuum_threshold = 1000,
    autovacuum_vacuum_insert_scale_factor = 0,
    autovacuum_vacuum_insert_threshold = 1000,
    autovacuum_vacuum_cost_delay = 0
);

CREATE FUNCTION jobs_counted_insert() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO job_count_deltas (tenant, queue, state, n)
    SELECT tenant, queue, state, count(*) FROM inserted GROUP BY tenant, queue, state;
    RETURN NULL;
END
$$;

-- Heartbeats and other updates that keep the state add nothing.
CREATE FUNCTION jobs_counted_update() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO job_count_deltas (tenant, queue, state, n)
    SELECT tenant, queue, state, sum(n) FROM (
        SELECT tenant, queue, state, -1 AS n FROM before
        UNION ALL
        SELECT tenant, queue, state, 1 AS n FROM after
    ) moved
    GROUP BY tenant, queue, state
    HAVING sum(n) <> 0;
    RETURN NULL;
END
$$;

CREATE FUNCTION jobs_counted_delete() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO job_count_deltas (tenant, queue, state, n)
    SELECT tenant, queue, state, -count(*) FROM deleted GROUP BY tenant, queue, state;
    RETURN NULL;
END
$$;

-- No writer may slip between the count below and the triggers.
LOCK TABLE jobs IN SHARE MODE;

CREATE TRIGGER jobs_counted_insert AFTER INSERT ON jobs
    REFERENCING NEW TABLE AS inserted
    FOR EACH STATEMENT EXECUTE FUNCTION jobs_counted_insert();
CREATE TRIGGER jobs_counted_update AFTER UPDATE ON jobs
    REFERENCING OLD TABLE AS before NEW TABLE AS after
    FOR EACH STATEMENT EXECUTE FUNCTION jobs_counted_update();
CREATE TRIGGER jobs_counted_delete AFTER DELETE ON jobs
    REFERENCING OLD TABLE AS deleted
    FOR EACH STATEMENT EXECUTE FUNCTION jobs_counted_delete();

INSERT INTO job_counts (tenant, queue, state, n)
SELECT tenant, queue, state, count(*) FROM jobs GROUP BY tenant, queue, state;
