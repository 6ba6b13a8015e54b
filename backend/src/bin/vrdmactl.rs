//! `vrdmactl`: reads the state of a running `vhost-user-rdma` through its management socket.

// Integer casts that could truncate, lose a sign or wrap are proven or converted (tests,
// whose values are small constants, are exempt).
#![cfg_attr(
    not(test),
    deny(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        clippy::cast_possible_wrap
    )
)]

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use vrdma_backend::admin::{self, Answer, Request};
use vrdma_backend::datapath::RateLimits;
use vrdma_backend::device::{GuestReport, Usage};

/// Shows the guests a vrdma backend serves: their objects against their quotas, what their
/// data path moved, their refused requests and their QPs.
#[derive(Debug, Parser)]
#[command(version, about)]
struct Args {
    /// The backend's management socket (its --admin-socket).
    #[arg(long, default_value = "/run/vrdma/admin.sock")]
    socket: PathBuf,
    /// Print the backend's answer as JSON, for tools.
    #[arg(long)]
    json: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Every connected guest, a line each.
    List,
    /// One guest in detail, with its QPs.
    Show {
        /// The guest's number (as `list` and the backend's log name it).
        guest: u64,
    },
    /// The counters of every guest in Prometheus' text format.
    Metrics,
    /// Holds one guest's sends to these rates from now on (more wait in its rings); no
    /// option lifts its limits.
    /// Serves one more guest, declared as in the backend's --config file: a TOML inline
    /// table, e.g. '{ name = "vm4", socket = "/run/vrdma/vm4.sock", max_qp = 64 }'.
    Add { declaration: String },
    /// Stops serving a declared guest: its connection ends and everything it held is freed.
    Remove { name: String },
    Limit {
        guest: u64,
        /// Send WQEs a second (0: no limit).
        #[arg(long, default_value_t = 0)]
        wqes_per_second: u64,
        /// Payload bytes a second (0: no limit).
        #[arg(long, default_value_t = 0)]
        bytes_per_second: u64,
    },
}

fn main() -> ExitCode {
    let args = Args::parse();
    let request = match args.command {
        Command::List => Request::List,
        Command::Show { guest } => Request::Show(guest),
        Command::Metrics => Request::Metrics,
        Command::Add { declaration } => Request::Add(declaration),
        Command::Remove { name } => Request::Remove(name),
        Command::Limit {
            guest,
            wqes_per_second,
            bytes_per_second,
        } => Request::Limit(
            guest,
            RateLimits {
                wqes_per_second,
                bytes_per_second,
            },
        ),
    };
    match admin::ask(&args.socket, request) {
        Ok(answer) => {
            print!("{}", render(&answer, args.json));
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("vrdmactl: {e}");
            ExitCode::FAILURE
        }
    }
}

fn render(answer: &Answer, json: bool) -> String {
    if json {
        let value = match answer {
            Answer::Guests(guests) => serde_json::to_string_pretty(guests),
            Answer::Guest(guest) => serde_json::to_string_pretty(guest),
            other => serde_json::to_string_pretty(other),
        };
        return value.expect("reports serialize") + "\n";
    }
    match answer {
        Answer::Guests(guests) => list(guests),
        Answer::Guest(guest) => show(guest),
        Answer::Metrics(text) => text.clone(),
        Answer::Done(done) => format!("{done}\n"),
        Answer::Error(e) => format!("error: {e}\n"),
    }
}

const KINDS: [&str; 6] = ["qp", "cq", "mr", "pd", "srq", "ah"];

/// `list`'s columns: heading and width (the first three left-aligned, the rest right-aligned).
const COLUMNS: [(&str, usize); 13] = [
    ("GUEST", 6),
    ("NAME", 12),
    ("STATE", 8),
    ("QP", 11),
    ("CQ", 11),
    ("MR", 11),
    ("PD", 9),
    ("SRQ", 9),
    ("AH", 11),
    ("REGISTERED", 21),
    ("WQES", 12),
    ("COMPLETIONS", 12),
    ("REFUSED", 8),
];

fn row(cells: impl IntoIterator<Item = String>) -> String {
    let mut line: Vec<String> = Vec::new();
    for (index, (cell, (_, width))) in cells.into_iter().zip(COLUMNS).enumerate() {
        line.push(if index < 3 {
            format!("{cell:<width$}")
        } else {
            format!("{cell:>width$}")
        });
    }
    line.join(" ") + "\n"
}

fn list(guests: &[GuestReport]) -> String {
    let mut out = row(COLUMNS.map(|(heading, _)| heading.to_string()));
    for guest in guests {
        let objects = KINDS
            .iter()
            .map(|kind| guest.objects.get(*kind).map_or("-".into(), count));
        let cells = [
            guest.guest.to_string(),
            guest.name.clone(),
            guest.state.to_string(),
        ]
        .into_iter()
        .chain(objects)
        .chain([
            bytes(&guest.registered_bytes),
            guest.relayed.wqes.to_string(),
            guest.relayed.completions.to_string(),
            (guest.refusals.values().sum::<u64>() + guest.host_failures).to_string(),
        ]);
        out += &row(cells);
    }
    if guests.is_empty() {
        out += "(no guest is connected)\n";
    }
    out
}

fn show(guest: &GuestReport) -> String {
    let mut out = format!("guest {} ({}), {}\n", guest.guest, guest.name, guest.state);
    for kind in KINDS {
        if let Some(usage) = guest.objects.get(kind) {
            out += &format!("  {kind:<18} {}\n", count(usage));
        }
    }
    out += &format!("  {:<18} {}\n", "ring bytes", bytes(&guest.ring_bytes));
    out += &format!(
        "  {:<18} {}\n",
        "registered bytes",
        bytes(&guest.registered_bytes)
    );
    let relayed = &guest.relayed;
    out += &format!(
        "  relayed            {} WQEs ({} payload bytes), {} completions, {} kicks, {} WQEs refused, {} kick storms\n",
        relayed.wqes,
        relayed.bytes,
        relayed.completions,
        relayed.kicks,
        relayed.refused_wqes,
        relayed.kick_storms
    );
    let limit = |rate: u64| match rate {
        0 => "no limit".to_string(),
        rate => rate.to_string(),
    };
    out += &format!(
        "  rate limits        WQEs a second: {}; bytes a second: {}\n",
        limit(guest.rate_limits.wqes_per_second),
        limit(guest.rate_limits.bytes_per_second)
    );
    let listed = |counts: &std::collections::BTreeMap<String, u64>| {
        if counts.is_empty() {
            return "none".to_string();
        }
        let each: Vec<String> = counts
            .iter()
            .map(|(name, n)| format!("{name} {n}"))
            .collect();
        each.join(", ")
    };
    out += &format!(
        "  completions in error {}\n",
        listed(&guest.completions_in_error)
    );
    out += &format!("  events raised      {}\n", listed(&guest.events));
    if guest.refusals.is_empty() && guest.host_failures == 0 {
        out += "  refused requests   none\n";
    } else {
        out += "  refused requests  ";
        for (rule, times) in &guest.refusals {
            out += &format!(" {rule} {times},");
        }
        out += &format!(" host failures {}\n", guest.host_failures);
    }
    for qp in &guest.qps {
        out += &format!(
            "  qpn {} type {} state {}{} pd {:#x} send-cq {:#x} recv-cq {:#x}{} handle {:#x}\n",
            qp.qp_num,
            qp.qp_type,
            qp.state,
            qp.peer_qp_num
                .map_or(String::new(), |peer| format!(" peer-qpn {peer}")),
            qp.pd,
            qp.send_cq,
            qp.recv_cq,
            qp.srq.map_or(String::new(), |srq| format!(" srq {srq:#x}")),
            qp.handle,
        );
    }
    out
}

fn count(usage: &Usage) -> String {
    format!("{}/{}", usage.used, usage.quota)
}

fn bytes(usage: &Usage) -> String {
    format!("{}/{}", human(usage.used), human(usage.quota))
}

/// Bytes in the largest binary unit that keeps a whole number.
fn human(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes;
    let mut unit = 0;
    while value >= 1024 && value.is_multiple_of(1024) && unit + 1 < UNITS.len() {
        value /= 1024;
        unit += 1;
    }
    format!("{value} {}", UNITS[unit])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_read_in_whole_units() {
        assert_eq!(human(0), "0 B");
        assert_eq!(human(4096), "4 KiB");
        assert_eq!(human(1 << 30), "1 GiB");
        assert_eq!(human(1536), "1536 B");
    }

    #[test]
    fn an_empty_backend_says_so() {
        assert!(list(&[]).ends_with("(no guest is connected)\n"));
    }
}
