//! Background work: the notifier that wakes waiting calls, and the reaper.

pub mod notifier;
pub mod reaper;
