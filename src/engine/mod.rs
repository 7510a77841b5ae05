//! Background work: the coalescers that share transactions between
//! concurrent calls, the notifier that wakes waiting calls, the reaper, the
//! metrics gauges' timer, and the observer that turns what the store did
//! into logs, spans and metrics.

pub mod batchers;
pub mod coalesce;
pub mod gauges;
pub mod notifier;
pub mod observer;
pub mod reaper;
pub mod webhooks;
