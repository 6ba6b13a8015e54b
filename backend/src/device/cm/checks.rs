//! What a CM command carries, checked before librdmacm sees it: addresses (only the guest's
//! own as a source), private data lengths, connection parameters and timeouts.

use super::*;

/// A source address the guest names (SPEC.md §13.2): `own`, 0.0.0.0 or a loopback address
/// (127.0.0.0/8), which stand for `own`, or none (family 0, where `optional`), with any port.
/// A guest's loopback address is its own machine, never the host's.
pub(super) fn own_source(
    own: Ipv4Addr,
    addr: &CmAddr,
    optional: bool,
) -> Result<SocketAddrV4, Refusal> {
    if optional && *addr == CmAddr::default() {
        return Ok(SocketAddrV4::new(own, 0));
    }
    let address = addr.to_ipv4().ok_or(Refusal::NotIpv4("source address"))?;
    let ip = *address.ip();
    if !ip.is_unspecified() && !ip.is_loopback() && ip != own {
        return Err(Refusal::ForeignAddress(ip.to_string()));
    }
    Ok(SocketAddrV4::new(own, address.port()))
}

/// A destination the guest names (SPEC.md §13.2): any IPv4 address but 0.0.0.0; a loopback
/// address is the guest's own (a connection to itself, as natively to one's own host).
pub(super) fn destination(own: Ipv4Addr, addr: &CmAddr) -> Result<SocketAddrV4, Refusal> {
    let address = addr
        .to_ipv4()
        .filter(|d| !d.ip().is_unspecified())
        .ok_or(Refusal::NotIpv4("destination address"))?;
    Ok(match address.ip().is_loopback() {
        true => SocketAddrV4::new(own, address.port()),
        false => address,
    })
}

/// The most private data `command` (CM_CONNECT, CM_ACCEPT or CM_REJECT) carries on an id of
/// `space`: what the CM message holds (SPEC.md §13.3). The device refuses more itself, so
/// the refusal says which rule, not the host's EINVAL.
pub(super) fn check_private_data(
    command: CmCommand,
    space: PortSpace,
    len: usize,
) -> Result<(), Refusal> {
    use vrdma_spec::cm::private_data_limit as limit;
    let max = match (command, space) {
        (CmCommand::Connect, PortSpace::Tcp) => limit::CONNECT_TCP,
        (CmCommand::Connect, PortSpace::Udp) => limit::CONNECT_UDP,
        (CmCommand::Accept, PortSpace::Tcp) => limit::ACCEPT_TCP,
        (CmCommand::Accept, PortSpace::Udp) => limit::ACCEPT_UDP,
        (CmCommand::Reject, PortSpace::Tcp) => limit::REJECT_TCP,
        (CmCommand::Reject, PortSpace::Udp) => limit::REJECT_UDP,
        _ => return Ok(()),
    };
    if len > max {
        return Err(Refusal::PrivateData {
            command: command.action(),
            len,
            max,
        });
    }
    Ok(())
}

pub(super) fn conn_param(
    wire: &CmConnParam,
    config: &vrdma_spec::config::DeviceConfig,
) -> Result<ConnParam, Refusal> {
    let range = |field, value: u8, max: u32| {
        if u32::from(value) > max {
            Err(Refusal::OutOfRange {
                field,
                value: value.into(),
                min: 0,
                max: max.into(),
            })
        } else {
            Ok(value)
        }
    };
    let boolean = |field, value: u8| match value {
        0 | 1 => Ok(value),
        _ => Err(Refusal::NotBoolean { field, value }),
    };
    Ok(ConnParam {
        responder_resources: range(
            "responder_resources",
            wire.responder_resources,
            config.max_qp_rd_atom.to_native(),
        )?,
        initiator_depth: range(
            "initiator_depth",
            wire.initiator_depth,
            config.max_qp_init_rd_atom.to_native(),
        )?,
        flow_control: boolean("flow_control", wire.flow_control)?,
        retry_count: range("retry_count", wire.retry_count, 7)?,
        rnr_retry_count: range("rnr_retry_count", wire.rnr_retry_count, 7)?,
        srq: boolean("srq", wire.srq)? == 1,
        qp_num: 0,
        qkey: 0,
        private_data: wire.private_data().to_vec(),
    })
}

pub(super) fn timeout(value: u32) -> Result<u32, Refusal> {
    if value == 0 || value > MAX_TIMEOUT_MS {
        return Err(Refusal::OutOfRange {
            field: "timeout_ms",
            value: value.into(),
            min: 1,
            max: MAX_TIMEOUT_MS.into(),
        });
    }
    Ok(value)
}

/// A host refusal of a CM call: EINVAL is a state of the host's id the device does not
/// keep (SPEC.md §13.3), INVALID_ARGUMENT with detail 22 as the device's own state refusals.
pub(super) fn host(command: CmCommand) -> impl FnOnce(hostverbs::Error) -> CommandError {
    move |e| match e.errno() {
        Some(libc::EINVAL) => Refusal::CmHost(format!(
            "the host's connection manager would not {} ({e})",
            command.action()
        ))
        .into(),
        _ => CommandError::from(e),
    }
}

/// The connection's connection manager, if the driver negotiated it. (A function of the
/// two fields, so that the device's other fields stay free to borrow.)
pub(super) fn negotiated(
    cm: &Option<ConnectionManager>,
    features: u64,
) -> Result<&ConnectionManager, CommandError> {
    match cm {
        Some(cm) if features & vrdma_spec::config::features::CM != 0 => Ok(cm),
        _ => Err(Refusal::NotNegotiated("CM").into()),
    }
}
