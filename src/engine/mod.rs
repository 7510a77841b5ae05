//! Background work: the notifier that wakes waiting calls, the reaper, the
//! metrics gauges' timer, and the observer that turns what the store did
//! into logs, spans and metrics.

pub mod gauges;
pub mod notifier;
pub mod observer;
pub mod reaper;
