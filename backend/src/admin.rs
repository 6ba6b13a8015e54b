//! The management socket: what an operator (`vrdmactl`, a monitoring system) reads of the
//! guests a backend serves.
//!
//! A unix stream socket, `--admin-socket`, that only its owner (root, as the backend starts)
//! and `--admin-group` may open. A client writes one request line and reads one JSON answer,
//! then the backend closes the connection:
//!
//! | request | answer |
//! |---|---|
//! | `list` | `{"guests": [GuestReport, ...]}`, every connected guest |
//! | `show N` | `{"guest": GuestReport}`, guest N |
//! | `metrics` | `{"metrics": "..."}`, the same numbers in Prometheus' text format |
//! | `limit N WQES BYTES` | `{"guest": GuestReport}`, guest N's sends now held to WQES WQEs and BYTES bytes a second (0: no limit) |
//! | `add {TOML inline table}` | `{"done": "..."}`, a guest declared as in `--config`'s file, served from now on |
//! | `remove NAME` | `{"done": "..."}`, the declared guest NAME disconnected, its objects freed, its socket gone |
//!
//! and `{"error": "..."}` for a request it cannot answer. [`GuestReport`] is the guest's
//! objects against its quotas, what its data path moved, its refused requests by rule and
//! its QPs.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::datapath::RateLimits;
use crate::device::GuestReport;
use crate::sandbox::{GroupError, SocketGroup};

/// The longest request line read.
const MAX_REQUEST: u64 = 256;

/// How long a client has to send its request.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(2);

/// How long [`ask`] waits for the answer (a report waits for a control request the guest
/// has under way, a large registration say).
const ANSWER_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Debug, thiserror::Error)]
pub enum AdminError {
    #[error("management socket {path}: {source}")]
    Socket {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("management socket {path}: a file that is not a socket is in the way")]
    NotASocket { path: PathBuf },
    #[error("group {0:?} does not exist")]
    NoSuchGroup(String),
    #[error("cannot look group {name:?} up: {source}")]
    Group { name: String, source: nix::Error },
    #[error("the backend's answer: {0}")]
    Refused(String),
    #[error("the backend's answer is not understood: {0}")]
    Garbled(#[from] serde_json::Error),
}

/// One connection the backend serves, as the management socket sees it.
pub trait Managed: Send + Sync {
    /// Its report, under the number the backend gave the connection.
    fn report(&self, guest: u64) -> GuestReport;
    /// Holds its sends to `limits` from now on.
    fn set_rate_limits(&self, limits: RateLimits);
}

/// Ends a connection from the backend's side (its front end sees the socket close).
pub type Disconnect = Box<dyn Fn() + Send + Sync>;

/// Adds and removes declared guests at run time (`--config`'s guests).
pub trait GuestControl: Send + Sync {
    /// Serves the guest `declaration` declares (a TOML inline table); what was done.
    fn add(&self, declaration: &str) -> Result<String, String>;
    /// Stops serving the guest `name`: its connection ends, its objects are freed.
    fn remove(&self, name: &str) -> Result<String, String>;
}

/// One connection in the registry.
struct Entry {
    /// The declared guest it serves (the socket's name).
    name: String,
    connection: Arc<dyn Managed>,
    disconnect: Disconnect,
}

/// The guests a backend serves, by connection number; and, with declared guests, who adds
/// and removes them.
#[derive(Default)]
pub struct Registry {
    guests: Mutex<BTreeMap<u64, Entry>>,
    control: Mutex<Option<Arc<dyn GuestControl>>>,
}

impl Registry {
    /// Lists connection `guest`, made on the socket of the guest `name`.
    pub fn add(
        &self,
        guest: u64,
        name: &str,
        connection: Arc<dyn Managed>,
        disconnect: Disconnect,
    ) {
        let entry = Entry {
            name: name.to_string(),
            connection,
            disconnect,
        };
        self.lock().insert(guest, entry);
    }

    /// Who serves `add` and `remove` requests.
    pub fn set_control(&self, control: Arc<dyn GuestControl>) {
        *self.control.lock().unwrap_or_else(|e| e.into_inner()) = Some(control);
    }

    /// Ends every connection made on the socket of the guest `name`.
    pub fn disconnect(&self, name: &str) {
        for entry in self.lock().values().filter(|entry| entry.name == name) {
            (entry.disconnect)();
        }
    }

    /// Forgets a guest. Reports are made under the registry's lock, so once this returns no
    /// report holds the connection any more: its last reference is its owner's.
    pub fn remove(&self, guest: u64) {
        self.lock().remove(&guest);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<u64, Entry>> {
        self.guests.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn control(&self) -> Option<Arc<dyn GuestControl>> {
        self.control
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    fn reports(&self) -> Vec<GuestReport> {
        let guests = self.lock();
        guests
            .iter()
            .map(|(&guest, entry)| entry.report(guest))
            .collect()
    }

    fn report(&self, guest: u64) -> Option<GuestReport> {
        let guests = self.lock();
        guests.get(&guest).map(|entry| entry.report(guest))
    }

    fn limit(&self, guest: u64, limits: RateLimits) -> Option<GuestReport> {
        let guests = self.lock();
        guests.get(&guest).map(|entry| {
            entry.connection.set_rate_limits(limits);
            log::info!("connection {guest}: rate limits now {limits:?}");
            entry.report(guest)
        })
    }
}

impl Entry {
    fn report(&self, guest: u64) -> GuestReport {
        GuestReport {
            name: self.name.clone(),
            ..self.connection.report(guest)
        }
    }
}

/// A request of the management socket's protocol.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Request {
    List,
    Show(u64),
    Metrics,
    Limit(u64, RateLimits),
    /// A guest declaration, a TOML inline table.
    Add(String),
    Remove(String),
}

impl Request {
    pub fn parse(line: &str) -> Result<Request, String> {
        if let Some(declaration) = line.trim().strip_prefix("add ") {
            return Ok(Request::Add(declaration.trim().to_string()));
        }
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            ["list"] => Ok(Request::List),
            ["metrics"] => Ok(Request::Metrics),
            ["show", guest] => number(guest, "a guest number").map(Request::Show),
            ["remove", name] => Ok(Request::Remove(name.to_string())),
            ["limit", guest, wqes, bytes] => Ok(Request::Limit(
                number(guest, "a guest number")?,
                RateLimits {
                    wqes_per_second: number(wqes, "a number of WQEs a second")?,
                    bytes_per_second: number(bytes, "a number of bytes a second")?,
                },
            )),
            _ => Err(format!(
                "unknown request {:?} (list, show N, metrics, limit N WQES BYTES, add {{...}}, remove NAME)",
                line.trim()
            )),
        }
    }

    fn line(&self) -> String {
        match self {
            Request::List => "list\n".into(),
            Request::Show(guest) => format!("show {guest}\n"),
            Request::Metrics => "metrics\n".into(),
            Request::Limit(guest, limits) => format!(
                "limit {guest} {} {}\n",
                limits.wqes_per_second, limits.bytes_per_second
            ),
            Request::Add(declaration) => format!("add {declaration}\n"),
            Request::Remove(name) => format!("remove {name}\n"),
        }
    }
}

fn number(word: &str, what: &str) -> Result<u64, String> {
    word.parse().map_err(|_| format!("{word:?} is not {what}"))
}

/// An answer of the management socket.
#[derive(Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Answer {
    Guests(Vec<GuestReport>),
    Guest(Box<GuestReport>),
    Metrics(String),
    Done(String),
    Error(String),
}

/// `change`'s outcome on the guests `registry`'s control declares, if any does.
fn controlled(
    registry: &Registry,
    change: impl FnOnce(&dyn GuestControl) -> Result<String, String>,
) -> Answer {
    match registry.control() {
        None => Answer::Error(
            "this backend serves one socket (--socket-path): guests are added and removed where they are declared (--config)".into(),
        ),
        Some(control) => match change(control.as_ref()) {
            Ok(done) => Answer::Done(done),
            Err(e) => Answer::Error(e),
        },
    }
}

/// The answer to `request` from the guests of `registry`.
pub fn answer(registry: &Registry, request: Result<Request, String>) -> Answer {
    match request {
        Ok(Request::List) => Answer::Guests(registry.reports()),
        Ok(Request::Show(guest)) => match registry.report(guest) {
            Some(report) => Answer::Guest(Box::new(report)),
            None => Answer::Error(format!("no guest {guest} is connected")),
        },
        Ok(Request::Metrics) => Answer::Metrics(prometheus(&registry.reports())),
        Ok(Request::Limit(guest, limits)) => match registry.limit(guest, limits) {
            Some(report) => Answer::Guest(Box::new(report)),
            None => Answer::Error(format!("no guest {guest} is connected")),
        },
        Ok(Request::Add(declaration)) => controlled(registry, |control| control.add(&declaration)),
        Ok(Request::Remove(name)) => controlled(registry, |control| control.remove(&name)),
        Err(e) => Answer::Error(e),
    }
}

/// The guests' numbers in Prometheus' text exposition format.
pub fn prometheus(reports: &[GuestReport]) -> String {
    let mut out = String::new();
    let mut family =
        |name: &str, kind: &str, help: &str, samples: &mut dyn Iterator<Item = (String, u64)>| {
            let _ = writeln!(out, "# HELP {name} {help}");
            let _ = writeln!(out, "# TYPE {name} {kind}");
            for (labels, value) in samples {
                let _ = if labels.is_empty() {
                    writeln!(out, "{name} {value}")
                } else {
                    writeln!(out, "{name}{{{labels}}} {value}")
                };
            }
        };
    let guest = |r: &GuestReport| format!("guest=\"{}\"", r.guest);
    let per_kind = |pick: fn(&crate::device::Usage) -> u64| {
        reports.iter().flat_map(move |r| {
            r.objects
                .iter()
                .map(move |(kind, usage)| (format!("{},kind=\"{kind}\"", guest(r)), pick(usage)))
        })
    };
    family(
        "vrdma_guest_objects",
        "gauge",
        "Objects a guest holds, by kind.",
        &mut per_kind(|u| u.used),
    );
    family(
        "vrdma_guest_object_quota",
        "gauge",
        "Objects a guest may hold, by kind.",
        &mut per_kind(|u| u.quota),
    );
    type Pick = fn(&GuestReport) -> u64;
    let scalars: [(&str, &str, &str, Pick); 12] = [
        (
            "vrdma_guest_ring_bytes",
            "gauge",
            "Bytes of queue rings a guest holds.",
            |r| r.ring_bytes.used,
        ),
        (
            "vrdma_guest_ring_bytes_quota",
            "gauge",
            "Bytes of queue rings a guest may hold.",
            |r| r.ring_bytes.quota,
        ),
        (
            "vrdma_guest_registered_bytes",
            "gauge",
            "Bytes a guest has registered.",
            |r| r.registered_bytes.used,
        ),
        (
            "vrdma_guest_registered_bytes_quota",
            "gauge",
            "Bytes a guest may register.",
            |r| r.registered_bytes.quota,
        ),
        (
            "vrdma_guest_wqes_total",
            "counter",
            "WQEs relayed from a guest's rings to the host.",
            |r| r.relayed.wqes,
        ),
        (
            "vrdma_guest_bytes_total",
            "counter",
            "Payload bytes of the send WQEs relayed.",
            |r| r.relayed.bytes,
        ),
        (
            "vrdma_guest_wqes_per_second_limit",
            "gauge",
            "A guest's limit on send WQEs a second (0: none).",
            |r| r.rate_limits.wqes_per_second,
        ),
        (
            "vrdma_guest_bytes_per_second_limit",
            "gauge",
            "A guest's limit on send payload bytes a second (0: none).",
            |r| r.rate_limits.bytes_per_second,
        ),
        (
            "vrdma_guest_completions_total",
            "counter",
            "Completions written to a guest's CQ rings.",
            |r| r.relayed.completions,
        ),
        (
            "vrdma_guest_kicks_total",
            "counter",
            "Doorbell kicks from a guest.",
            |r| r.relayed.kicks,
        ),
        (
            "vrdma_guest_refused_wqes_total",
            "counter",
            "WQEs refused without reaching the host.",
            |r| r.relayed.refused_wqes,
        ),
        (
            "vrdma_guest_host_failures_total",
            "counter",
            "Control requests the host failed.",
            |r| r.host_failures,
        ),
    ];
    for (name, kind, help, pick) in scalars {
        family(
            name,
            kind,
            help,
            &mut reports.iter().map(|r| (guest(r), pick(r))),
        );
    }
    type Counts = fn(&GuestReport) -> &BTreeMap<String, u64>;
    let by_label: [(&str, &str, &str, Counts); 3] = [
        (
            "vrdma_guest_refusals_total",
            "Control requests refused, by the rule they broke.",
            "rule",
            |r| &r.refusals,
        ),
        (
            "vrdma_guest_completions_in_error_total",
            "Completions written in error, by status.",
            "status",
            |r| &r.completions_in_error,
        ),
        (
            "vrdma_guest_events_total",
            "Asynchronous events raised for a guest, by kind.",
            "kind",
            |r| &r.events,
        ),
    ];
    for (name, help, label, counts) in by_label {
        let mut samples = reports.iter().flat_map(|r| {
            counts(r)
                .iter()
                .map(move |(value, &count)| (format!("{},{label}=\"{value}\"", guest(r)), count))
        });
        family(name, "counter", help, &mut samples);
    }
    family(
        "vrdma_guests",
        "gauge",
        "Guests connected.",
        &mut std::iter::once((String::new(), reports.len() as u64)),
    );
    out
}

/// The management socket, bound.
pub struct AdminSocket {
    listener: UnixListener,
    path: PathBuf,
}

/// Binds the management socket at `path` (a socket left there is replaced), open to its
/// owner and, with `group`, to that group's members.
pub fn listen(path: &Path, group: Option<&str>) -> Result<AdminSocket, AdminError> {
    let socket_error = |source| AdminError::Socket {
        path: path.to_owned(),
        source,
    };
    let group = group
        .map(SocketGroup::named)
        .transpose()
        .map_err(|e| match e {
            GroupError::NotFound(name) => AdminError::NoSuchGroup(name),
            GroupError::Lookup { name, source } => AdminError::Group { name, source },
        })?;
    match std::fs::symlink_metadata(path) {
        Ok(meta) if std::os::unix::fs::FileTypeExt::is_socket(&meta.file_type()) => {
            std::fs::remove_file(path).map_err(socket_error)?;
        }
        Ok(_) => {
            return Err(AdminError::NotASocket {
                path: path.to_owned(),
            })
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(socket_error(e)),
    }
    let listener = UnixListener::bind(path).map_err(socket_error)?;
    match group {
        Some(group) => group.give(path),
        None => std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)),
    }
    .map_err(socket_error)?;
    log::info!("management socket on {}", path.display());
    Ok(AdminSocket {
        listener,
        path: path.to_owned(),
    })
}

impl AdminSocket {
    /// Answers requests about `registry`'s guests on a thread of its own, for as long as
    /// the process runs.
    pub fn serve(self, registry: Arc<Registry>) -> std::io::Result<()> {
        std::thread::Builder::new()
            .name("vrdma-admin".into())
            .spawn(move || {
                for client in self.listener.incoming() {
                    match client {
                        Ok(client) => {
                            if let Err(e) = serve_client(&registry, client) {
                                log::debug!("management socket: a client: {e}");
                            }
                        }
                        Err(e) => {
                            log::error!("management socket {}: {e}", self.path.display());
                            std::thread::sleep(Duration::from_millis(100));
                        }
                    }
                }
            })
            .map(drop)
    }
}

/// Reads one request from `client` (it has [`REQUEST_TIMEOUT`] to send it) and answers.
fn serve_client(registry: &Registry, client: UnixStream) -> std::io::Result<()> {
    client.set_read_timeout(Some(REQUEST_TIMEOUT))?;
    let mut line = String::new();
    BufReader::new((&client).take(MAX_REQUEST)).read_line(&mut line)?;
    let request = if line.ends_with('\n') {
        Request::parse(&line)
    } else {
        Err(format!(
            "a request is one line of at most {MAX_REQUEST} bytes"
        ))
    };
    let answer = answer(registry, request);
    let mut json = serde_json::to_vec(&answer).map_err(std::io::Error::other)?;
    json.push(b'\n');
    (&client).write_all(&json)
}

/// Asks the backend whose management socket is at `path`.
pub fn ask(path: &Path, request: Request) -> Result<Answer, AdminError> {
    let socket_error = |source| AdminError::Socket {
        path: path.to_owned(),
        source,
    };
    let mut stream = UnixStream::connect(path).map_err(socket_error)?;
    stream
        .set_read_timeout(Some(ANSWER_TIMEOUT))
        .map_err(socket_error)?;
    stream
        .write_all(request.line().as_bytes())
        .map_err(socket_error)?;
    let mut reply = String::new();
    stream.read_to_string(&mut reply).map_err(socket_error)?;
    match serde_json::from_str(&reply)? {
        Answer::Error(e) => Err(AdminError::Refused(e)),
        answer => Ok(answer),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::{QpReport, Relayed, Usage};

    struct Fixed(GuestReport);

    impl Managed for Fixed {
        fn report(&self, guest: u64) -> GuestReport {
            GuestReport {
                guest,
                ..self.0.clone()
            }
        }

        fn set_rate_limits(&self, _: RateLimits) {}
    }

    fn sample() -> GuestReport {
        GuestReport {
            guest: 0,
            name: String::new(),
            state: crate::device::GuestState::Running,
            objects: [(
                "qp".to_string(),
                Usage {
                    used: 2,
                    quota: 256,
                },
            )]
            .into(),
            ring_bytes: Usage {
                used: 8192,
                quota: 1 << 20,
            },
            registered_bytes: Usage {
                used: 4096,
                quota: 1 << 30,
            },
            relayed: Relayed {
                wqes: 10,
                bytes: 640,
                completions: 9,
                kicks: 1,
                refused_wqes: 0,
                kick_storms: 0,
            },
            rate_limits: RateLimits::default(),
            completions_in_error: [("remote access error".to_string(), 1)].into(),
            events: [("QP_FATAL".to_string(), 1)].into(),
            refusals: [("BadHandle".to_string(), 3)].into(),
            host_failures: 0,
            qps: vec![QpReport {
                handle: 7,
                qp_num: 17,
                qp_type: "RC".into(),
                state: "RTS".into(),
                peer_qp_num: Some(18),
                pd: 1,
                send_cq: 2,
                recv_cq: 2,
                srq: None,
            }],
        }
    }

    #[test]
    fn requests_are_one_word_or_show_and_a_number() {
        assert_eq!(Request::parse("list\n"), Ok(Request::List));
        assert_eq!(Request::parse(" show 12 \n"), Ok(Request::Show(12)));
        assert_eq!(Request::parse("metrics"), Ok(Request::Metrics));
        let limits = RateLimits {
            wqes_per_second: 1000,
            bytes_per_second: 0,
        };
        assert_eq!(
            Request::parse("limit 3 1000 0\n"),
            Ok(Request::Limit(3, limits))
        );
        for bad in [
            "",
            "show",
            "show x",
            "show 1 2",
            "lists",
            "drop 1",
            "limit 3 1000",
            "limit 3 -1 0",
            "limit 3 1e3 0",
        ] {
            assert!(Request::parse(bad).is_err(), "{bad:?}");
        }
        assert_eq!(
            Request::parse("add { name = \"vm4\", socket = \"/s\" }\n"),
            Ok(Request::Add(r#"{ name = "vm4", socket = "/s" }"#.into()))
        );
        assert_eq!(
            Request::parse("remove vm4"),
            Ok(Request::Remove("vm4".into()))
        );
        for request in [
            Request::Add("{ name = \"a\" }".into()),
            Request::Remove("a".into()),
            Request::List,
            Request::Show(3),
            Request::Metrics,
            Request::Limit(3, limits),
        ] {
            assert_eq!(Request::parse(&request.line()), Ok(request));
        }
    }

    #[test]
    fn answers_name_each_guest_by_its_connection_and_unknown_ones_are_errors() {
        let registry = Registry::default();
        let disconnected = Arc::new(std::sync::atomic::AtomicU32::new(0));
        let counted = |times: &Arc<std::sync::atomic::AtomicU32>| -> Disconnect {
            let times = Arc::clone(times);
            Box::new(move || {
                times.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            })
        };
        registry.add(4, "vm1", Arc::new(Fixed(sample())), counted(&disconnected));
        registry.add(9, "vm2", Arc::new(Fixed(sample())), counted(&disconnected));
        registry.disconnect("vm2");
        assert_eq!(disconnected.load(std::sync::atomic::Ordering::Relaxed), 1);
        let Answer::Guests(all) = answer(&registry, Ok(Request::List)) else {
            panic!("not a list");
        };
        assert_eq!(all.iter().map(|r| r.guest).collect::<Vec<_>>(), [4, 9]);
        assert_eq!(
            answer(&registry, Ok(Request::Show(9))),
            Answer::Guest(Box::new(GuestReport {
                guest: 9,
                name: "vm2".into(),
                ..sample()
            }))
        );
        let refused = answer(&registry, Request::parse("remove vm1"));
        assert!(
            matches!(&refused, Answer::Error(e) if e.contains("--config")),
            "{refused:?}"
        );
        registry.remove(9);
        assert!(matches!(
            answer(&registry, Ok(Request::Show(9))),
            Answer::Error(_)
        ));
        let json = serde_json::to_string(&answer(&registry, Ok(Request::List))).unwrap();
        assert!(json.starts_with(r#"{"guests":[{"guest":4,"#), "{json}");
    }

    #[test]
    fn metrics_label_every_sample_with_its_guest() {
        let text = prometheus(&[GuestReport {
            guest: 4,
            ..sample()
        }]);
        for line in [
            "# TYPE vrdma_guest_objects gauge",
            r#"vrdma_guest_objects{guest="4",kind="qp"} 2"#,
            r#"vrdma_guest_object_quota{guest="4",kind="qp"} 256"#,
            r#"vrdma_guest_registered_bytes{guest="4"} 4096"#,
            r#"vrdma_guest_wqes_total{guest="4"} 10"#,
            r#"vrdma_guest_refusals_total{guest="4",rule="BadHandle"} 3"#,
            r#"vrdma_guest_completions_in_error_total{guest="4",status="remote access error"} 1"#,
            r#"vrdma_guest_events_total{guest="4",kind="QP_FATAL"} 1"#,
            "vrdma_guests 1",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} missing in\n{text}");
        }
    }

    #[test]
    fn the_socket_is_its_owners_or_its_groups_and_answers_one_request() {
        let dir = std::env::temp_dir().join(format!("vrdma-admin-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("admin.sock");
        let socket = listen(&path, None).unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        let registry = Arc::new(Registry::default());
        registry.add(1, "vm1", Arc::new(Fixed(sample())), Box::new(|| {}));
        socket.serve(Arc::clone(&registry)).unwrap();
        let Answer::Guest(report) = ask(&path, Request::Show(1)).unwrap() else {
            panic!("not a guest");
        };
        assert_eq!(report.qps[0].qp_num, 17);
        assert!(matches!(
            ask(&path, Request::Show(2)),
            Err(AdminError::Refused(_))
        ));
        // A request that is not one is answered with an error; one longer than a request
        // may be is answered so or cut off, and the next client is served.
        let mut raw = UnixStream::connect(&path).unwrap();
        raw.write_all(b"drop 1\n").unwrap();
        let mut reply = String::new();
        raw.read_to_string(&mut reply).unwrap();
        assert!(reply.starts_with(r#"{"error":"unknown request"#), "{reply}");
        let mut raw = UnixStream::connect(&path).unwrap();
        let _ = raw.write_all(&[b'x'; 300]);
        let mut reply = String::new();
        if raw.read_to_string(&mut reply).is_ok() {
            assert!(
                reply.starts_with(r#"{"error":"a request is one line"#),
                "{reply}"
            );
        }
        assert!(matches!(ask(&path, Request::List), Ok(Answer::Guests(_))));
        assert!(matches!(
            listen(&dir, None),
            Err(AdminError::NotASocket { .. })
        ));
        assert!(matches!(
            listen(&dir.join("other.sock"), Some("no-such-group-vrdma")),
            Err(AdminError::NoSuchGroup(_))
        ));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
