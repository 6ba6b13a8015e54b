//! What an operator reads of one guest connection (`vrdmactl`, the management socket): its
//! objects against their quotas, what its data path moved, its refused requests by rule, and
//! its QPs as `rdma resource show qp` lists a host's.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::Device;
use crate::datapath::{RateLimits, Stats};

/// One guest connection, as the management socket reports it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct GuestReport {
    /// The backend's number for the connection (its log lines say "connection N").
    pub guest: u64,
    /// The declared guest whose socket the connection came on (`--config`), or `guest` for
    /// the one socket of `--socket-path`.
    pub name: String,
    /// Where its front end has the device: starting, running, or paused.
    #[serde(default)]
    pub state: GuestState,
    /// Objects held, by kind (`pd`, `cq`, `mr`, `qp`, `srq`, `ah`), against the quota.
    pub objects: BTreeMap<String, Usage>,
    /// Bytes of CQ, QP and SRQ rings held, against the quota.
    pub ring_bytes: Usage,
    /// Bytes registered by all MRs together, against the quota.
    pub registered_bytes: Usage,
    /// What the data path moved for the guest.
    pub relayed: Relayed,
    /// The limits its sends are held to (0: none).
    pub rate_limits: RateLimits,
    /// Completions written in error, by libibverbs' name for their status.
    pub completions_in_error: BTreeMap<String, u64>,
    /// Asynchronous events raised for the guest, by kind (SPEC.md §8.4).
    pub events: BTreeMap<String, u64>,
    /// Control requests the device refused, by the rule each broke (the names of
    /// `Refusal`'s variants), and those the host failed.
    pub refusals: BTreeMap<String, u64>,
    pub host_failures: u64,
    pub qps: Vec<QpReport>,
}

/// Where a guest's front end has the device.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum GuestState {
    /// Its control queue has not started yet.
    #[default]
    Starting,
    /// Its control queue runs.
    Running,
    /// Its front end stopped the queues (the VM is paused, or being moved) and has not
    /// started them again; a driver that says when it resets keeps its objects meanwhile.
    Paused,
    /// Its device is being handed between two of its front end's connections (SPEC.md
    /// §11.1): saved by the old one, or taken by the new one, or handed over (the old
    /// connection then holds nothing and waits for its front end to close it).
    Migrating,
}

impl std::fmt::Display for GuestState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            GuestState::Starting => "starting",
            GuestState::Running => "running",
            GuestState::Migrating => "migrating",
            GuestState::Paused => "paused",
        })
    }
}

/// How much of something is held, and how much may be.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    pub used: u64,
    pub quota: u64,
}

/// The data path's counters of one connection.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Relayed {
    /// WQEs taken from the guest's rings and posted to the host.
    pub wqes: u64,
    /// Payload bytes of the send WQEs among them.
    pub bytes: u64,
    /// Completions written to the guest's CQ rings.
    pub completions: u64,
    /// Doorbell kicks from the guest.
    pub kicks: u64,
    /// WQEs refused (completed in error without reaching the host).
    pub refused_wqes: u64,
    /// Times the guest's kicks kept bringing no work and it was not asked for them a while.
    pub kick_storms: u64,
}

impl From<Stats> for Relayed {
    fn from(stats: Stats) -> Self {
        Relayed {
            wqes: stats.wqes,
            bytes: stats.bytes,
            completions: stats.completions,
            kicks: stats.kicks,
            refused_wqes: stats.refused,
            kick_storms: stats.storms,
        }
    }
}

/// One QP of a guest.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct QpReport {
    /// The guest's handle for it.
    pub handle: u32,
    /// Its number on the host (and on the wire).
    pub qp_num: u32,
    /// `RC`, `UC` or `UD`.
    pub qp_type: String,
    /// `RESET` ... `ERR`, as the host reports it; `unknown` if the host could not say.
    pub state: String,
    /// The QP a connected QP sends to, once it has one (RTR and later).
    pub peer_qp_num: Option<u32>,
    /// Handles of its PD, CQs and SRQ.
    pub pd: u32,
    pub send_cq: u32,
    pub recv_cq: u32,
    pub srq: Option<u32>,
}

impl Device {
    /// The report of the connection the backend numbers `guest`: read under the connection's
    /// lock, so its numbers are of one moment (the data path's counters excepted, which move
    /// on).
    pub fn report(&self, guest: u64) -> GuestReport {
        let objects = &self.objects;
        let quotas = &self.quotas;
        let mut counts = vec![
            ("pd", objects.pds.len(), quotas.max_pd),
            ("cq", objects.cqs.len(), quotas.max_cq),
            ("mr", objects.mrs.len(), quotas.max_mr),
            ("qp", objects.qps.len(), quotas.max_qp),
            ("srq", objects.srqs.len(), quotas.max_srq),
            ("ah", objects.ahs.len(), quotas.max_ah),
        ];
        let events = self.data_path.events_raised();
        if let Some(cm) = &self.cm {
            // Those of connection requests not taken yet included (SPEC.md §13.1).
            counts.push(("cm_id", cm.id_count(), self.config.max_qp.to_native()));
        }
        let mut qps: Vec<QpReport> = objects
            .qps
            .iter()
            .map(|(&handle, entry)| {
                let attr = entry.host.query().ok();
                let qp_type = entry.host.qp_type();
                QpReport {
                    handle,
                    qp_num: entry.host.qp_num(),
                    qp_type: format!("{qp_type:?}").to_uppercase(),
                    state: attr.as_ref().map_or_else(
                        || "unknown".to_string(),
                        |attr| format!("{:?}", attr.qp_state).to_uppercase(),
                    ),
                    peer_qp_num: attr
                        .filter(|attr| {
                            qp_type.is_connected()
                                && !matches!(
                                    attr.qp_state,
                                    vrdma_spec::verbs::QpState::Reset
                                        | vrdma_spec::verbs::QpState::Init
                                )
                        })
                        .map(|attr| attr.dest_qp_num),
                    pd: entry.pd,
                    send_cq: entry.send_cq,
                    recv_cq: entry.recv_cq,
                    srq: entry.srq,
                }
            })
            .collect();
        qps.sort_by_key(|qp| qp.qp_num);
        GuestReport {
            guest,
            name: String::new(),
            // The vhost-user side knows: it fills this in.
            state: GuestState::default(),
            objects: counts
                .into_iter()
                .map(|(kind, used, quota)| {
                    let usage = Usage {
                        used: used as u64,
                        quota: quota.into(),
                    };
                    (kind.to_string(), usage)
                })
                .collect(),
            ring_bytes: Usage {
                used: objects.ring_bytes,
                quota: quotas.max_ring_bytes,
            },
            registered_bytes: Usage {
                used: objects.registered_bytes,
                quota: quotas.max_registered_bytes,
            },
            relayed: self.data_path.stats().into(),
            rate_limits: self.data_path.rate_limits(),
            completions_in_error: self
                .data_path
                .completion_errors()
                .into_iter()
                .map(|(status, count)| (crate::hostverbs::wc_status_name(status), count))
                .collect(),
            events: events
                .into_iter()
                .map(|(kind, count)| {
                    let name = vrdma_spec::ring::event_kind::name(kind);
                    (name.map_or_else(|| kind.to_string(), str::to_string), count)
                })
                .chain(
                    self.cm
                        .as_ref()
                        .map(|cm| ("CM_EVENT_DROPPED".to_string(), cm.dropped_events())),
                )
                .filter(|&(_, count)| count != 0)
                .collect(),
            refusals: self.refusals.by_rule().clone(),
            host_failures: self.refusals.host_failures(),
            qps,
        }
    }
}
