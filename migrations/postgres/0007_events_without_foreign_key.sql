-- The hot path (issue 6): no foreign key from job_events to jobs.
--
-- Every transition writes its job row and its event in one statement, so
-- an event without its job cannot be written; the key only cost work. Its
-- check ran once per event: a trigger, a query and a KEY SHARE lock on the
-- job row (one more WAL record), three times per job's life. Retention,
-- which relied on ON DELETE CASCADE, now deletes a job's events in the
-- statement that deletes the job.
ALTER TABLE job_events DROP CONSTRAINT IF EXISTS job_events_job_id_fkey;
