-- One index insert less per transition (issue 6).
--
-- jobs_by_tenant_state (tenant, state, queue) took an entry for every
-- version of every job: three per job's life, since each transition
-- changes the state. Counting by state now reads job_counts (migration
-- 0008); what still looks jobs up by state is the dead-set side (listing
-- and replaying FAILED, CANCELLED and EXPIRED jobs), and those rows are
-- few and change rarely. Queued jobs have the claim index, running ones
-- jobs_running_owner, succeeded ones jobs_by_tenant (most rows are
-- succeeded, so a filter passes nearly every row it reads).
CREATE INDEX jobs_replayable ON jobs (tenant, state, queue, id)
    WHERE state IN ('failed', 'cancelled', 'expired');
DROP INDEX IF EXISTS jobs_by_tenant_state;
