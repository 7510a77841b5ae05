-- One index fewer on the jobs table (issue 6): the primary key becomes
-- (tenant, id), and jobs_by_tenant (tenant, id DESC) goes.
--
-- A claim and a completion each change the state, which is in the
-- predicate of the partial indexes, so neither can be a HOT update: every
-- version of every job took an entry in jobs_pkey and one in
-- jobs_by_tenant, three each over a job's life. One index keyed by
-- (tenant, id) serves both what the two served: every lookup of a job by
-- id already knows its tenant, and ListJobs pages a tenant's jobs by id,
-- newest first, with a backward scan. The machine's CPU per job went down
-- 4-6 % in burn-down and e2e (docs/performance-log.md, "Changes of
-- 2026-12-05, session 19").
--
-- Job ids stay unique: they are UUIDv7s the server makes.
--
-- Not for a rolling update: the jobs table is locked while the new key is
-- built (0.9 s for a million jobs on the development machine), and pods
-- of an earlier build find jobs by id alone, which no index serves once
-- it has run. Stop them first (README, "Upgrades and migrations").
ALTER TABLE webhook_deliveries DROP CONSTRAINT webhook_deliveries_job_id_fkey;
ALTER TABLE jobs DROP CONSTRAINT jobs_pkey;
ALTER TABLE jobs ADD PRIMARY KEY (tenant, id);
ALTER TABLE webhook_deliveries
    ADD FOREIGN KEY (tenant, job_id) REFERENCES jobs (tenant, id) ON DELETE CASCADE;
DROP INDEX IF EXISTS jobs_by_tenant;
