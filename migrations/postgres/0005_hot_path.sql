-- The hot path (issue 6): keep heartbeats HOT and the claim flat.
--
-- A heartbeat rewrites lease_expires_at, progress, updated_at and event_seq.
-- An index on any of them makes every heartbeat a non-HOT update that adds
-- entries to every index of the table, so the lease-expiry index goes: the
-- reaper finds expired leases through jobs_running_owner (state = 'running'
-- only: as many rows as leases in flight).
DROP INDEX IF EXISTS jobs_lease_expiry;

-- Room on each page for the new versions of its rows, so that updates
-- which change no indexed column stay on the page (HOT) and need no index
-- work at all.
ALTER TABLE jobs SET (fillfactor = 80);

-- A queue turns its rows over fast: every job is inserted, updated two or
-- three times and then finished. Vacuum it by small fractions, without the
-- cost-based pauses, so that dead versions (and the dead entries they leave
-- in the claim index) are cleared before claims have to step over them.
ALTER TABLE jobs SET (
    autovacuum_vacuum_scale_factor = 0.01,
    autovacuum_vacuum_threshold = 1000,
    autovacuum_vacuum_insert_scale_factor = 0.02,
    autovacuum_analyze_scale_factor = 0.02,
    autovacuum_vacuum_cost_delay = 0
);
ALTER TABLE job_events SET (
    autovacuum_vacuum_insert_scale_factor = 0.05,
    autovacuum_analyze_scale_factor = 0.05
);
