//! Counting events per second, for the budgets a guest's behaviour draws on (log lines,
//! kicks nobody asked for, wake-ups that brought no work).

use std::time::{Duration, Instant};

/// How long a window lasts.
pub const WINDOW: Duration = Duration::from_secs(1);

/// Events in the current one-second window.
#[derive(Debug, Default)]
pub struct PerSecond {
    window_start: Option<Instant>,
    count: u32,
}

impl PerSecond {
    /// Counts one event at `now`; how many the window holds with it (a window starts with
    /// the first event a second or more after the last window's start).
    pub fn note(&mut self, now: Instant) -> u32 {
        if self
            .window_start
            .is_none_or(|start| now.duration_since(start) >= WINDOW)
        {
            self.window_start = Some(now);
            self.count = 0;
        }
        self.count = self.count.saturating_add(1);
        self.count
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_are_counted_per_second() {
        let mut events = PerSecond::default();
        let start = Instant::now();
        assert_eq!(events.note(start), 1);
        assert_eq!(events.note(start + Duration::from_millis(999)), 2);
        assert_eq!(events.note(start + Duration::from_secs(1)), 1);
    }
}
