//! Background work: the coalescers that share transactions between
//! concurrent calls, the hand-off of new jobs to idle workers, the notifier
//! that wakes waiting calls, the reaper, the metrics gauges' timer, and the
//! observer that turns what the store did into logs, spans and metrics.

pub mod batchers;
pub mod coalesce;
pub mod detach;
pub mod gauges;
pub mod handoff;
pub mod notifier;
pub mod observer;
pub mod reaper;
pub mod webhooks;
