-- The length each lease was taken with, in milliseconds, so that a
-- Heartbeat without `extend_by` renews the lease by that length (the
-- proto's contract) instead of the server's default. Set wherever a job is
-- leased; leases already held get the length they were taken with, as far
-- as the row tells it, and a NULL left falls back to the server's default.

ALTER TABLE jobs ADD COLUMN lease_ms INTEGER;

UPDATE jobs
SET lease_ms = max(1000, lease_expires_at - leased_at)
WHERE state = 'running' AND leased_at IS NOT NULL AND lease_expires_at IS NOT NULL;
