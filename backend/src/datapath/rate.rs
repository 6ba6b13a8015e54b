//! Per-guest rate limits on the data path: WQEs and payload bytes a second that a guest's
//! sends (SEND, WRITE, READ, atomics) may reach the host at. A send over the limit is not
//! refused or dropped: it waits in the guest's ring, where the poller finds it once the limit
//! lets it through, and completes as any other.
//!
//! Each limit is a token bucket that may run into debt: a visit takes WQEs while tokens are
//! left (for bytes: while the WQEs taken so far carry fewer bytes than are left) and pays for
//! all it took, so one large WQE is never held back for ever, and the debt delays the next.
//! Over any stretch longer than the bucket's depth (1/100 s of the rate) the guest moves no
//! more than the limit, plus one WQE. The buckets outlive a connection ([`RateDebt`]): a
//! guest that reconnects pays what it owed.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

/// A guest's rate limits; 0 is no limit.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RateLimits {
    pub wqes_per_second: u64,
    pub bytes_per_second: u64,
}

impl RateLimits {
    pub fn is_unlimited(&self) -> bool {
        self.wqes_per_second == 0 && self.bytes_per_second == 0
    }
}

/// A connection's limits as the control side set them last; the poller reads them every
/// send visit.
#[derive(Default)]
pub(super) struct SharedLimits {
    wqes_per_second: AtomicU64,
    bytes_per_second: AtomicU64,
}

impl SharedLimits {
    pub(super) fn set(&self, limits: RateLimits) {
        self.wqes_per_second
            .store(limits.wqes_per_second, Ordering::Relaxed);
        self.bytes_per_second
            .store(limits.bytes_per_second, Ordering::Relaxed);
    }

    pub(super) fn get(&self) -> RateLimits {
        RateLimits {
            wqes_per_second: self.wqes_per_second.load(Ordering::Relaxed),
            bytes_per_second: self.bytes_per_second.load(Ordering::Relaxed),
        }
    }
}

/// Tokens of one limit: at most 1/100 s of the rate (and at least one WQE's worth), fewer
/// than none after a pass took more than was left.
#[derive(Clone, Default)]
struct Bucket {
    tokens: f64,
    last: Option<Instant>,
}

/// The bucket holds this share of a second's rate.
const DEPTH: f64 = 0.01;

impl Bucket {
    fn depth(rate: u64) -> f64 {
        (rate as f64 * DEPTH).max(1.0)
    }

    fn refill(&mut self, rate: u64, now: Instant) {
        let depth = Bucket::depth(rate);
        self.tokens = match self.last {
            Some(last) => {
                let earned = rate as f64 * now.saturating_duration_since(last).as_secs_f64();
                (self.tokens + earned).min(depth)
            }
            None => depth,
        };
        self.last = Some(now);
    }

    /// How long until the bucket holds a whole token again at `rate`.
    fn wait(&self, rate: u64) -> Duration {
        if self.tokens >= 1.0 || rate == 0 {
            return Duration::ZERO;
        }
        Duration::from_secs_f64((1.0 - self.tokens) / rate as f64)
    }
}

/// One connection's buckets, used by the pool thread that serves it.
#[derive(Clone, Default)]
pub(super) struct RateGate {
    wqes: Bucket,
    bytes: Bucket,
}

/// What a visit may take now: WQEs, and bytes, which the WQEs taken so far must not have
/// reached before the next is taken.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Allowance {
    pub wqes: u32,
    pub bytes: u64,
}

impl Allowance {
    pub(super) const UNLIMITED: Allowance = Allowance {
        wqes: u32::MAX,
        bytes: u64::MAX,
    };
}

impl RateGate {
    /// What may be taken now under `limits`: everything without a limit, no WQE while a
    /// limit is in debt.
    pub(super) fn allowance(&mut self, limits: RateLimits, now: Instant) -> Allowance {
        let mut allowed = Allowance::UNLIMITED;
        if limits.bytes_per_second != 0 {
            self.bytes.refill(limits.bytes_per_second, now);
            if self.bytes.tokens <= 0.0 {
                allowed.wqes = 0;
                return allowed;
            }
            allowed.bytes = tokens_u64(self.bytes.tokens);
        }
        if limits.wqes_per_second != 0 {
            self.wqes.refill(limits.wqes_per_second, now);
            allowed.wqes = u32::try_from(tokens_u64(self.wqes.tokens)).unwrap_or(u32::MAX);
        }
        allowed
    }

    /// Pays for `wqes` WQEs carrying `bytes` bytes.
    pub(super) fn spend(&mut self, limits: RateLimits, wqes: u64, bytes: u64) {
        if limits.wqes_per_second != 0 {
            self.wqes.tokens -= wqes as f64;
        }
        if limits.bytes_per_second != 0 {
            self.bytes.tokens -= bytes as f64;
        }
    }

    /// How long until [`RateGate::allowance`] lets a WQE through again.
    pub(super) fn wait(&self, limits: RateLimits) -> Duration {
        let wqes = match limits.wqes_per_second {
            0 => Duration::ZERO,
            rate => self.wqes.wait(rate),
        };
        let bytes = match limits.bytes_per_second {
            0 => Duration::ZERO,
            rate => self.bytes.wait(rate),
        };
        wqes.max(bytes)
    }
}

/// The buckets a guest's last connection left (its debt, or its unused tokens), for its
/// next connection on the same socket: reconnecting neither clears a debt nor refills a
/// bucket sooner than time does. (Guests that share a socket, `--shared-gid`, are one trust
/// domain: a connection takes whatever the last one to end left.)
#[derive(Default)]
pub struct RateDebt(parking_lot::Mutex<Option<RateGate>>);

impl RateDebt {
    pub(super) fn take(&self) -> RateGate {
        self.0.lock().take().unwrap_or_default()
    }

    pub(super) fn leave(&self, gate: RateGate) {
        *self.0.lock() = Some(gate);
    }
}

/// Whole tokens in a bucket: `as` from a float saturates (negative and NaN give 0), and a
/// bucket holds at most its depth, a second's worth of a `u64` rate.
#[expect(
    clippy::cast_possible_truncation,
    clippy::cast_sign_loss,
    reason = "a float-to-integer `as` saturates: negative counts give 0, none wraps"
)]
fn tokens_u64(tokens: f64) -> u64 {
    tokens as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(wqes_per_second: u64, bytes_per_second: u64) -> RateLimits {
        RateLimits {
            wqes_per_second,
            bytes_per_second,
        }
    }

    #[test]
    fn no_limit_lets_everything_through() {
        let mut gate = RateGate::default();
        let now = Instant::now();
        assert_eq!(
            gate.allowance(RateLimits::default(), now),
            Allowance::UNLIMITED
        );
        gate.spend(RateLimits::default(), 1 << 20, 1 << 40);
        assert_eq!(
            gate.allowance(RateLimits::default(), now),
            Allowance::UNLIMITED
        );
        assert_eq!(gate.wait(RateLimits::default()), Duration::ZERO);
    }

    #[test]
    fn a_wqe_limit_allows_a_hundredth_of_a_second_at_once_and_refills_at_its_rate() {
        let mut gate = RateGate::default();
        let limit = limits(10_000, 0);
        let start = Instant::now();
        assert_eq!(gate.allowance(limit, start).wqes, 100);
        gate.spend(limit, 100, 0);
        assert_eq!(gate.allowance(limit, start).wqes, 0);
        assert_eq!(gate.wait(limit), Duration::from_micros(100));
        assert_eq!(
            gate.allowance(limit, start + Duration::from_millis(1)).wqes,
            10
        );
        // Idle for long, it still holds only the bucket's depth.
        assert_eq!(
            gate.allowance(limit, start + Duration::from_secs(5)).wqes,
            100
        );
    }

    /// Over a simulated second of passes that each take all they are allowed, as WQEs of
    /// 64 KiB, the bytes moved stay within the limit plus one bucket and one WQE.
    #[test]
    fn a_byte_limit_holds_over_time_whatever_the_wqe_size() {
        let (rate, wqe) = (100 << 20, 64 << 10);
        let limit = limits(0, rate);
        let mut gate = RateGate::default();
        let start = Instant::now();
        let mut moved = 0u64;
        for step in 0..=10_000u32 {
            let now = start + Duration::from_micros(100) * step;
            // A pass takes up to 16 WQEs while the bytes taken are below the allowance,
            // paying after.
            let allowed = gate.allowance(limit, now);
            let mut taken = 0u64;
            while taken < 16 && allowed.wqes > 0 && taken * wqe < allowed.bytes {
                taken += 1;
            }
            let taken = u32::try_from(taken).unwrap();
            gate.spend(limit, u64::from(taken), u64::from(taken) * wqe);
            moved += u64::from(taken) * wqe;
        }
        let most = rate + rate / 100 + wqe;
        assert!(moved <= most, "{moved} > {most}");
        assert!(moved >= rate - 16 * wqe, "{moved} is well below the limit");
    }

    #[test]
    fn a_large_wqe_goes_through_and_its_debt_delays_the_next() {
        let limit = limits(0, 1000);
        let mut gate = RateGate::default();
        let start = Instant::now();
        assert_eq!(gate.allowance(limit, start).bytes, 10);
        gate.spend(limit, 1, 5000);
        assert_eq!(
            gate.allowance(limit, start + Duration::from_secs(4)).wqes,
            0
        );
        assert!(gate.wait(limit) > Duration::from_millis(900));
        assert_eq!(
            gate.allowance(limit, start + Duration::from_secs(6)).wqes,
            u32::MAX
        );
    }
}
