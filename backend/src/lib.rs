//! vrdma backend: the vhost-user device that serves vrdma guests on the host's RDMA device.
//!
//! Layers: [`hostverbs`] is the only code that touches libibverbs; [`limits`] decides what a
//! guest is offered; the device logic above them knows nothing of vhost-user plumbing.

pub mod datapath;
pub mod device;
mod guest_mapping;
pub mod hostverbs;
pub mod limits;
pub mod mtt;
pub mod vhost_user;

use std::sync::Arc;

use hostverbs::{Context, Gid, LINK_LAYER_ETHERNET, PORT_ACTIVE};
pub use limits::Quotas;

/// Errors that stop the backend.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    HostVerbs(#[from] hostverbs::Error),
    #[error("port {port} of {device} is not active (state {state})")]
    PortNotActive {
        device: String,
        port: u8,
        state: u32,
    },
    #[error("port {port} of {device} is not an Ethernet (RoCE) port")]
    NotRoce { device: String, port: u8 },
    #[error("GID index {index} of {device} port {port} is unusable: {reason}")]
    BadGidIndex {
        device: String,
        port: u8,
        index: u32,
        reason: String,
    },
    #[error("vhost-user socket: {0}")]
    VhostUser(#[source] vhost::vhost_user::Error),
    /// vhost-user-backend's error type implements Display but not std::error::Error.
    #[error("vhost-user daemon: {0}")]
    Daemon(vhost_user_backend::Error),
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

/// What the backend serves guests with.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Config {
    /// Host RDMA device, e.g. `rxe0`.
    pub device: String,
    pub port: u8,
    /// Source GID index for guest traffic; `None` picks the first RoCEv2 IPv4 GID.
    pub gid_index: Option<u32>,
    pub quotas: Quotas,
    pub notify_queues: u32,
    /// Data-path poller threads per connection.
    pub pollers: usize,
    /// How long a poller keeps polling after its last work before it sleeps.
    pub poll_idle: std::time::Duration,
}

/// The host device, checked to be usable for guests.
pub struct HostDevice {
    pub context: Arc<Context>,
    pub port: u8,
    pub gid_index: u32,
    pub gid: Gid,
}

impl HostDevice {
    /// Opens the device and checks the port is an active RoCE port with a usable GID.
    pub fn open(config: &Config) -> Result<HostDevice, Error> {
        let context = Context::open(&config.device)?;
        let port_attr = context.query_port(config.port)?;
        if port_attr.state != PORT_ACTIVE {
            return Err(Error::PortNotActive {
                device: config.device.clone(),
                port: config.port,
                state: port_attr.state,
            });
        }
        if port_attr.link_layer != LINK_LAYER_ETHERNET {
            return Err(Error::NotRoce {
                device: config.device.clone(),
                port: config.port,
            });
        }
        let (gid_index, gid) = match config.gid_index {
            None => context.find_roce_v2_ipv4_gid(config.port)?,
            Some(index) => {
                let bad = |reason: String| Error::BadGidIndex {
                    device: config.device.clone(),
                    port: config.port,
                    index,
                    reason,
                };
                let (gid, _) = context
                    .query_gid(config.port, index)
                    .map_err(|e| bad(e.to_string()))?;
                if gid.is_zero() {
                    return Err(bad("the entry is empty".into()));
                }
                (index, gid)
            }
        };
        Ok(HostDevice {
            context,
            port: config.port,
            gid_index,
            gid,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_device_is_reported_by_name_with_the_rxe_hint() {
        let config = Config {
            device: "no-such-rdma-device".into(),
            port: 1,
            gid_index: None,
            quotas: Quotas::default(),
            notify_queues: 1,
            pollers: 1,
            poll_idle: std::time::Duration::from_millis(2),
        };
        let message = HostDevice::open(&config)
            .err()
            .expect("no such device")
            .to_string();
        assert!(
            message.contains("'no-such-rdma-device' not found"),
            "{message}"
        );
        assert!(message.contains("rdma_rxe"), "{message}");
    }
}
