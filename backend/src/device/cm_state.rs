//! The state of a CM id as the device keeps it (SPEC.md §13.3, "Id states"): which CM
//! commands each state takes, and what the commands and the host's events make of it.
//!
//! The device consults this table before every call into the host's connection manager, and
//! calls nothing the table refuses. librdmacm trusts its caller to call in order: it
//! dereferences what an id does not have yet (`rdma_resolve_route` reads
//! `id->verbs->device`, NULL until the id is bound to a device; `rdma_connect` reads
//! `id->cma_dev`), so a guest that could reach it out of order could end the backend with
//! every guest on it. The table is pure, so unit tests and the `cm_state` fuzz target check it
//! without a host connection manager; the rxe tests (`cm.rs`) check the device against it.

use vrdma_spec::cm::cm_event;
use vrdma_spec::ctrl::Opcode;

/// Where an id is, by what the driver asked and what the host answered (events are applied
/// when the host delivers them, before the driver takes them).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum IdState {
    /// Made by CM_CREATE_ID: bound to nothing.
    Idle,
    /// Bound to the driver's address (CM_BIND, or an address resolution that failed: the
    /// host binds before it resolves).
    Bound,
    /// CM_RESOLVE_ADDR taken: ADDR_RESOLVED or ADDR_ERROR comes.
    AddrQuery,
    /// ADDR_RESOLVED came (or a route resolution failed).
    AddrResolved,
    /// CM_RESOLVE_ROUTE taken: ROUTE_RESOLVED or ROUTE_ERROR comes.
    RouteQuery,
    /// ROUTE_RESOLVED came.
    RouteResolved,
    /// CM_LISTEN taken.
    Listening,
    /// CM_CONNECT taken: RC waits for CONNECT_RESPONSE, UD for ESTABLISHED.
    Connecting,
    /// RC: CONNECT_RESPONSE came; CM_ESTABLISH (or CM_REJECT) is the driver's answer.
    ConnectResponse,
    /// Made by the device for a CONNECT_REQUEST: CM_ACCEPT or CM_REJECT, once.
    Requested,
    /// CM_ACCEPT taken: RC waits for ESTABLISHED; a UD id stays here.
    Accepted,
    /// The connection is up (ESTABLISHED, or CM_ESTABLISH taken).
    Connected,
    /// CM_DISCONNECT taken, or DISCONNECTED came.
    Disconnected,
    /// The connection was refused or failed: REJECTED, UNREACHABLE or CONNECT_ERROR came,
    /// or the driver took CM_REJECT.
    Failed,
}

impl IdState {
    /// Every state, in the order of SPEC.md's table.
    pub const ALL: [IdState; 14] = [
        IdState::Idle,
        IdState::Bound,
        IdState::AddrQuery,
        IdState::AddrResolved,
        IdState::RouteQuery,
        IdState::RouteResolved,
        IdState::Listening,
        IdState::Connecting,
        IdState::ConnectResponse,
        IdState::Requested,
        IdState::Accepted,
        IdState::Connected,
        IdState::Disconnected,
        IdState::Failed,
    ];

    /// The state's name in SPEC.md.
    pub fn name(self) -> &'static str {
        match self {
            IdState::Idle => "IDLE",
            IdState::Bound => "BOUND",
            IdState::AddrQuery => "ADDR_QUERY",
            IdState::AddrResolved => "ADDR_RESOLVED",
            IdState::RouteQuery => "ROUTE_QUERY",
            IdState::RouteResolved => "ROUTE_RESOLVED",
            IdState::Listening => "LISTENING",
            IdState::Connecting => "CONNECTING",
            IdState::ConnectResponse => "CONNECT_RESPONSE",
            IdState::Requested => "REQUESTED",
            IdState::Accepted => "ACCEPTED",
            IdState::Connected => "CONNECTED",
            IdState::Disconnected => "DISCONNECTED",
            IdState::Failed => "FAILED",
        }
    }

    /// The state after the host delivered `event` (a [`cm_event`] value) for the id. Events
    /// a state does not expect leave it as it is: the host's word on a connection is taken,
    /// but nothing it says moves an id to where a command it could not take would reach the
    /// host. A CONNECT_REQUEST leaves its listener listening (the request's id starts in
    /// [`IdState::Requested`]).
    pub fn after_event(self, event: u32) -> IdState {
        use IdState::*;
        match (self, event) {
            (AddrQuery, cm_event::ADDR_RESOLVED) => AddrResolved,
            (AddrQuery, cm_event::ADDR_ERROR) => Bound,
            (RouteQuery, cm_event::ROUTE_RESOLVED) => RouteResolved,
            (RouteQuery, cm_event::ROUTE_ERROR) => AddrResolved,
            (Connecting, cm_event::CONNECT_RESPONSE) => ConnectResponse,
            (Connecting | ConnectResponse | Accepted, cm_event::ESTABLISHED) => Connected,
            (
                Connecting | ConnectResponse | Accepted,
                cm_event::REJECTED | cm_event::UNREACHABLE | cm_event::CONNECT_ERROR,
            ) => Failed,
            (Connecting | ConnectResponse | Accepted | Connected, cm_event::DISCONNECTED) => {
                Disconnected
            }
            (state, _) => state,
        }
    }
}

/// The CM commands that name an id (all of SPEC.md §13.3 but CM_CREATE_ID).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum CmCommand {
    DestroyId,
    Bind,
    ResolveAddr,
    ResolveRoute,
    Listen,
    Connect,
    Accept,
    Reject,
    Disconnect,
    Establish,
    InitQpAttr,
    Query,
    GetEvent,
}

impl CmCommand {
    pub const ALL: [CmCommand; 13] = [
        CmCommand::DestroyId,
        CmCommand::Bind,
        CmCommand::ResolveAddr,
        CmCommand::ResolveRoute,
        CmCommand::Listen,
        CmCommand::Connect,
        CmCommand::Accept,
        CmCommand::Reject,
        CmCommand::Disconnect,
        CmCommand::Establish,
        CmCommand::InitQpAttr,
        CmCommand::Query,
        CmCommand::GetEvent,
    ];

    /// The command of a CM opcode; `None` for CM_CREATE_ID and the other opcodes.
    pub fn of(opcode: Opcode) -> Option<CmCommand> {
        Some(match opcode {
            Opcode::CmDestroyId => CmCommand::DestroyId,
            Opcode::CmBind => CmCommand::Bind,
            Opcode::CmResolveAddr => CmCommand::ResolveAddr,
            Opcode::CmResolveRoute => CmCommand::ResolveRoute,
            Opcode::CmListen => CmCommand::Listen,
            Opcode::CmConnect => CmCommand::Connect,
            Opcode::CmAccept => CmCommand::Accept,
            Opcode::CmReject => CmCommand::Reject,
            Opcode::CmDisconnect => CmCommand::Disconnect,
            Opcode::CmEstablish => CmCommand::Establish,
            Opcode::CmInitQpAttr => CmCommand::InitQpAttr,
            Opcode::CmQuery => CmCommand::Query,
            Opcode::CmGetEvent => CmCommand::GetEvent,
            _ => return None,
        })
    }

    pub fn opcode(self) -> Opcode {
        match self {
            CmCommand::DestroyId => Opcode::CmDestroyId,
            CmCommand::Bind => Opcode::CmBind,
            CmCommand::ResolveAddr => Opcode::CmResolveAddr,
            CmCommand::ResolveRoute => Opcode::CmResolveRoute,
            CmCommand::Listen => Opcode::CmListen,
            CmCommand::Connect => Opcode::CmConnect,
            CmCommand::Accept => Opcode::CmAccept,
            CmCommand::Reject => Opcode::CmReject,
            CmCommand::Disconnect => Opcode::CmDisconnect,
            CmCommand::Establish => Opcode::CmEstablish,
            CmCommand::InitQpAttr => Opcode::CmInitQpAttr,
            CmCommand::Query => Opcode::CmQuery,
            CmCommand::GetEvent => Opcode::CmGetEvent,
        }
    }

    /// What the command does, as refusals say it ("the id cannot resolve a route ...").
    pub fn action(self) -> &'static str {
        match self {
            CmCommand::DestroyId => "be destroyed",
            CmCommand::Bind => "bind",
            CmCommand::ResolveAddr => "resolve an address",
            CmCommand::ResolveRoute => "resolve a route",
            CmCommand::Listen => "listen",
            CmCommand::Connect => "connect",
            CmCommand::Accept => "accept",
            CmCommand::Reject => "reject",
            CmCommand::Disconnect => "disconnect",
            CmCommand::Establish => "establish",
            CmCommand::InitQpAttr => "give QP attributes",
            CmCommand::Query => "be queried",
            CmCommand::GetEvent => "give events",
        }
    }
}

/// What the table says of a command in a state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// The device carries the command out (the host may still refuse it); once it
    /// succeeded the id is in `next`. CM_DESTROY_ID's `next` is moot: the id is gone.
    Allowed { next: IdState },
    /// INVALID_ARGUMENT (detail 22, EINVAL) before anything reaches the host.
    Refused,
}

impl Verdict {
    pub fn is_allowed(self) -> bool {
        matches!(self, Verdict::Allowed { .. })
    }
}

/// The table of SPEC.md §13.3: what `command` does to an id in `state`.
pub fn verdict(state: IdState, command: CmCommand) -> Verdict {
    use CmCommand::*;
    use IdState::*;
    let next = match (command, state) {
        // Taken in every state: none reads more of the host's id than it has from its birth.
        (DestroyId | Query | GetEvent, _) => state,
        (Bind, Idle) => Bound,
        // An unbound id is bound first; a failed resolution leaves it bound, to try again.
        (ResolveAddr, Idle | Bound) => AddrQuery,
        // Only once the address is resolved is the host's id on a device (the crash this
        // table closes: librdmacm reads `id->verbs->device` before it asks the host).
        (ResolveRoute, AddrResolved) => RouteQuery,
        // Only on an id bound to the driver's address: listening on an unbound id would
        // listen on every address of the host (SPEC.md §13.2). A listener may change its
        // backlog.
        (Listen, Bound | Listening) => Listening,
        (Connect, RouteResolved) => Connecting,
        (Accept, Requested) => Accepted,
        // A request not answered yet, or an RC peer's answer the driver cannot take.
        (Reject, Requested | ConnectResponse) => Failed,
        (Establish, ConnectResponse) => Connected,
        // Where the host's id has a connection, made or under way (as natively, disconnecting
        // a connection that ended answers the peer, and succeeds).
        (
            Disconnect,
            Connecting | ConnectResponse | Accepted | Connected | Disconnected | Failed,
        ) => Disconnected,
        // Wherever the id is on the device and not listening or resolving an address; the
        // host says which transitions the connection allows yet.
        (InitQpAttr, Idle | AddrQuery | Listening) => return Verdict::Refused,
        (InitQpAttr, _) => state,
        _ => return Verdict::Refused,
    };
    // Disconnecting a failed connection leaves it failed: nothing follows on it.
    let next = match (command, state) {
        (Disconnect, Failed) => Failed,
        _ => next,
    };
    Verdict::Allowed { next }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::{BTreeSet, VecDeque};

    const EVENTS: [u32; 14] = [
        cm_event::ADDR_RESOLVED,
        cm_event::ADDR_ERROR,
        cm_event::ROUTE_RESOLVED,
        cm_event::ROUTE_ERROR,
        cm_event::CONNECT_REQUEST,
        cm_event::CONNECT_RESPONSE,
        cm_event::CONNECT_ERROR,
        cm_event::UNREACHABLE,
        cm_event::REJECTED,
        cm_event::ESTABLISHED,
        cm_event::DISCONNECTED,
        cm_event::DEVICE_REMOVAL,
        cm_event::ADDR_CHANGE,
        cm_event::TIMEWAIT_EXIT,
    ];

    fn allowed(state: IdState) -> BTreeSet<CmCommand> {
        CmCommand::ALL
            .into_iter()
            .filter(|&c| verdict(state, c).is_allowed())
            .collect()
    }

    #[test]
    fn the_commands_that_reach_librdmacm_before_the_id_has_a_device_are_refused() {
        use CmCommand::*;
        // The crash: CM_RESOLVE_ROUTE on a fresh id reached rdma_resolve_route, which
        // read id->verbs->device with id->verbs NULL.
        assert_eq!(verdict(IdState::Idle, ResolveRoute), Verdict::Refused);
        // Everything that reads the id's device (rdma_resolve_route: id->verbs; rdma_connect
        // and rdma_accept: id->cma_dev) only where ADDR_RESOLVED, ROUTE_RESOLVED or a
        // CONNECT_REQUEST came, after which librdmacm has the device.
        for state in IdState::ALL {
            let with_device = matches!(
                state,
                IdState::AddrResolved | IdState::RouteResolved | IdState::Requested
            );
            for command in [ResolveRoute, Connect, Accept] {
                if verdict(state, command).is_allowed() {
                    assert!(with_device, "{command:?} in {state:?}");
                }
            }
        }
    }

    #[test]
    fn each_state_takes_the_commands_of_the_specification() {
        use CmCommand::*;
        let always = [DestroyId, Query, GetEvent];
        let expected: [(IdState, &[CmCommand]); 14] = [
            (IdState::Idle, &[Bind, ResolveAddr]),
            (IdState::Bound, &[ResolveAddr, Listen, InitQpAttr]),
            (IdState::AddrQuery, &[]),
            (IdState::AddrResolved, &[ResolveRoute, InitQpAttr]),
            (IdState::RouteQuery, &[InitQpAttr]),
            (IdState::RouteResolved, &[Connect, InitQpAttr]),
            (IdState::Listening, &[Listen]),
            (IdState::Connecting, &[Disconnect, InitQpAttr]),
            (
                IdState::ConnectResponse,
                &[Reject, Disconnect, Establish, InitQpAttr],
            ),
            (IdState::Requested, &[Accept, Reject, InitQpAttr]),
            (IdState::Accepted, &[Disconnect, InitQpAttr]),
            (IdState::Connected, &[Disconnect, InitQpAttr]),
            (IdState::Disconnected, &[Disconnect, InitQpAttr]),
            (IdState::Failed, &[Disconnect, InitQpAttr]),
        ];
        for (state, commands) in expected {
            let wanted: BTreeSet<CmCommand> = commands.iter().chain(&always).copied().collect();
            assert_eq!(allowed(state), wanted, "{state:?}");
        }
    }

    #[test]
    fn a_refused_command_leaves_the_state_and_an_allowed_one_goes_where_the_table_says() {
        use IdState::*;
        let next = |state, command| match verdict(state, command) {
            Verdict::Allowed { next } => next,
            Verdict::Refused => panic!("{command:?} refused in {state:?}"),
        };
        assert_eq!(next(Idle, CmCommand::Bind), Bound);
        assert_eq!(next(Bound, CmCommand::ResolveAddr), AddrQuery);
        assert_eq!(next(Bound, CmCommand::Listen), Listening);
        assert_eq!(next(Listening, CmCommand::Listen), Listening);
        assert_eq!(next(AddrResolved, CmCommand::ResolveRoute), RouteQuery);
        assert_eq!(next(RouteResolved, CmCommand::Connect), Connecting);
        assert_eq!(next(ConnectResponse, CmCommand::Establish), Connected);
        assert_eq!(next(Requested, CmCommand::Accept), Accepted);
        assert_eq!(next(Requested, CmCommand::Reject), Failed);
        assert_eq!(next(Connected, CmCommand::Disconnect), Disconnected);
        assert_eq!(next(Failed, CmCommand::Disconnect), Failed);
        for state in IdState::ALL {
            for command in [CmCommand::Query, CmCommand::GetEvent, CmCommand::InitQpAttr] {
                if let Verdict::Allowed { next } = verdict(state, command) {
                    assert_eq!(next, state, "{command:?} moved {state:?}");
                }
            }
        }
    }

    #[test]
    fn events_move_only_the_states_that_wait_for_them() {
        use IdState::*;
        assert_eq!(AddrQuery.after_event(cm_event::ADDR_RESOLVED), AddrResolved);
        assert_eq!(AddrQuery.after_event(cm_event::ADDR_ERROR), Bound);
        assert_eq!(
            RouteQuery.after_event(cm_event::ROUTE_RESOLVED),
            RouteResolved
        );
        assert_eq!(RouteQuery.after_event(cm_event::ROUTE_ERROR), AddrResolved);
        assert_eq!(
            Connecting.after_event(cm_event::CONNECT_RESPONSE),
            ConnectResponse
        );
        assert_eq!(Connecting.after_event(cm_event::ESTABLISHED), Connected);
        assert_eq!(Accepted.after_event(cm_event::ESTABLISHED), Connected);
        assert_eq!(Connecting.after_event(cm_event::REJECTED), Failed);
        assert_eq!(Accepted.after_event(cm_event::CONNECT_ERROR), Failed);
        assert_eq!(Connected.after_event(cm_event::DISCONNECTED), Disconnected);
        // An event a state does not wait for changes nothing: an ADDR_RESOLVED can never make
        // a fresh id look resolved.
        for event in EVENTS {
            assert_eq!(Idle.after_event(event), Idle, "{}", cm_event::name(event));
            assert_eq!(
                Listening.after_event(event),
                Listening,
                "{}",
                cm_event::name(event)
            );
        }
        for event in [
            cm_event::DEVICE_REMOVAL,
            cm_event::ADDR_CHANGE,
            cm_event::TIMEWAIT_EXIT,
        ] {
            for state in IdState::ALL {
                assert_eq!(state.after_event(event), state);
            }
        }
    }

    /// Every state is reached from a fresh id or a connection request's by commands the table
    /// allows and events, and so is tested on rxe by the same path (cm.rs).
    #[test]
    fn every_state_is_reachable() {
        let mut seen = BTreeSet::from([IdState::Idle, IdState::Requested]);
        let mut queue = VecDeque::from([IdState::Idle, IdState::Requested]);
        while let Some(state) = queue.pop_front() {
            let by_commands = CmCommand::ALL
                .into_iter()
                .filter_map(|c| match verdict(state, c) {
                    Verdict::Allowed { next } => Some(next),
                    Verdict::Refused => None,
                });
            let by_events = EVENTS.into_iter().map(|e| state.after_event(e));
            for next in by_commands.chain(by_events).collect::<Vec<_>>() {
                if seen.insert(next) {
                    queue.push_back(next);
                }
            }
        }
        assert_eq!(seen, IdState::ALL.into_iter().collect());
    }

    #[test]
    fn commands_and_opcodes_map_both_ways() {
        for command in CmCommand::ALL {
            assert_eq!(CmCommand::of(command.opcode()), Some(command));
            assert!(!command.action().is_empty());
        }
        assert_eq!(CmCommand::of(Opcode::CmCreateId), None);
        assert_eq!(CmCommand::of(Opcode::CreateQp), None);
        let names: BTreeSet<&str> = IdState::ALL.into_iter().map(IdState::name).collect();
        assert_eq!(names.len(), IdState::ALL.len());
    }
}
