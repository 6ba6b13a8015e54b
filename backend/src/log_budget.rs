//! One guest connection's share of the backend's log: whatever a guest makes the backend say
//! (refused control requests, failed QPs, event buffers it cannot write), it says at most
//! [`LINES_PER_WINDOW`] lines per [`WINDOW`]; the rest are counted, and the next line logged
//! says how many were left out. A guest repeating a mistake in a loop fills no disk.

use std::sync::{Arc, Mutex};
use std::time::Instant;

use crate::per_second::PerSecond;
pub use crate::per_second::WINDOW;

/// Most lines one connection logs per [`WINDOW`].
pub const LINES_PER_WINDOW: u32 = 10;

#[derive(Debug, Default)]
struct Window {
    lines: PerSecond,
    left_out: u64,
}

/// A connection's log budget; clones share it (the control path, the data path and the event
/// queue of one connection draw from one).
#[derive(Clone, Debug, Default)]
pub struct LogBudget(Arc<Mutex<Window>>);

impl LogBudget {
    /// `line`, with a note of the lines left out before it, if the connection may log one at
    /// `now`; `None` (and the line counted as left out) if it has logged its share for now.
    pub fn admit(&self, line: impl FnOnce() -> String, now: Instant) -> Option<String> {
        let mut window = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if window.lines.note(now) > LINES_PER_WINDOW {
            window.left_out += 1;
            return None;
        }
        let mut line = line();
        if window.left_out > 0 {
            line += &format!(" ({} more not logged before this one)", window.left_out);
            window.left_out = 0;
        }
        Some(line)
    }

    /// Logs `line` at warning level, within the budget.
    pub fn warn(&self, line: impl FnOnce() -> String) {
        if let Some(line) = self.admit(line, Instant::now()) {
            log::warn!("{line}");
        }
    }

    /// Logs `line` at info level, within the budget.
    pub fn info(&self, line: impl FnOnce() -> String) {
        if log::log_enabled!(log::Level::Info) {
            if let Some(line) = self.admit(line, Instant::now()) {
                log::info!("{line}");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_budget_admits_its_share_per_window_and_then_says_what_it_left_out() {
        let budget = LogBudget::default();
        let shared = budget.clone();
        let start = Instant::now();
        let admitted: Vec<String> = (0..25)
            .filter_map(|i| {
                let from = if i % 2 == 0 { &budget } else { &shared };
                from.admit(|| format!("line {i}"), start)
            })
            .collect();
        assert_eq!(admitted.len(), LINES_PER_WINDOW as usize, "clones share it");
        let next = budget.admit(|| "later".into(), start + WINDOW).unwrap();
        assert_eq!(next, "later (15 more not logged before this one)");
        assert_eq!(
            budget.admit(|| "then".into(), start + WINDOW).unwrap(),
            "then"
        );
    }
}
