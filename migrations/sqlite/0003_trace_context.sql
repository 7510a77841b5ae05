-- Trace context (issue 4): the submitter's W3C traceparent, so that every
-- attempt's span joins the submitter's trace, and when the current attempt
-- was leased, so that whichever replica ends the attempt can emit its span
-- with the true start time. The attempt's span id is derived from its lease
-- token (src/telemetry/traceparent.rs), so it needs no column of its own.

ALTER TABLE jobs ADD COLUMN trace_parent TEXT;
ALTER TABLE jobs ADD COLUMN leased_at INTEGER;
