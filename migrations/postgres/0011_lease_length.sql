-- The length each lease was taken with, so that a Heartbeat without
-- `extend_by` renews the lease by that length (the proto's contract)
-- instead of the server's default, which would cut a long lease short.
-- Set wherever a job is leased: the claim and the hand-off at submit.
-- Leases already held get the length they were taken with, as far as the
-- row tells it; a NULL left here falls back to the server's default.

ALTER TABLE jobs ADD COLUMN lease_ms BIGINT;

UPDATE jobs
SET lease_ms = GREATEST(1000, (EXTRACT(EPOCH FROM lease_expires_at - leased_at) * 1000)::bigint)
WHERE state = 'running' AND leased_at IS NOT NULL AND lease_expires_at IS NOT NULL;
