//! A guest's own address (`vhost-user-rdma --guest-ip`, SPEC.md §10) on rxe: the backend puts
//! it on the device's network interface, the guest sees its GID as the only entry of its
//! table, and the address goes when the backend does. Runs inside the VM harness, where rxe0
//! sits on the veth end `va` with the host's address 192.168.77.1/24. The traffic itself
//! under such addresses, between two hosts, is tests/cross-host.sh's.

use std::process::Command;
use std::time::{Duration, Instant};

use vrdma_backend::hostverbs::Gid;
use vrdma_guest::{access, AhAttr, Device, QpType, QueuePair, Status};
use vrdma_tests::{
    backend_refuses, open_test_device, spawn_backend_process, wait_for_backend_log, BackendProcess,
};

const NETDEV: &str = "va";

fn socket(name: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!("vrdma-address-{name}-{}.sock", std::process::id()))
}

/// `ip -4 -o addr show dev va`: one line per address, with its label.
fn addresses() -> String {
    let output = Command::new("ip")
        .args(["-4", "-o", "addr", "show", "dev", NETDEV])
        .output()
        .expect("run ip");
    String::from_utf8_lossy(&output.stdout).into_owned()
}

fn gid_of(address: &str) -> Gid {
    Gid::from(address.parse::<std::net::Ipv4Addr>().unwrap())
}

/// Waits up to 5 s for `gid` to be (or not be) in rxe0's GID table.
fn wait_for_host_gid(gid: Gid, present: bool) {
    let deadline = Instant::now() + Duration::from_secs(5);
    let context = open_test_device();
    while context.find_roce_v2_gid(1, gid).unwrap().is_some() != present {
        assert!(
            Instant::now() < deadline,
            "{gid} {} rxe0's GID table",
            if present {
                "never entered"
            } else {
                "never left"
            }
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// SIGTERM, as an operator (or systemd) stops the backend.
fn stop(mut backend: BackendProcess) -> std::process::ExitStatus {
    let sent = Command::new("kill")
        .args(["-TERM", &backend.id().to_string()])
        .status()
        .expect("run kill");
    assert!(sent.success());
    backend.wait().expect("reap the backend")
}

#[test]
#[ignore = "needs rdma_rxe: run by tests/run-all.sh inside the VM harness"]
fn a_guest_address_is_the_guests_only_gid_and_leaves_with_the_backend() {
    let address = "192.168.77.50";
    let socket = socket("own");
    let backend = spawn_backend_process(&socket, &["--guest-ip", "192.168.77.50/24"]);
    // The backend serves confined (its default; it says so just after it listens), and
    // removing the address still works.
    wait_for_log(&socket, "seccomp filter installed (Kill)");
    let on_netdev = addresses();
    assert!(
        on_netdev.contains(&format!("inet {address}/24")) && on_netdev.contains("va:vrdma"),
        "{on_netdev}"
    );
    wait_for_host_gid(gid_of(address), true);
    {
        let device = Device::open(socket.to_str().unwrap()).expect("open the device");
        let port = device.query_port().unwrap();
        assert_eq!(
            (port.gid_tbl_len.to_native(), port.gid_index.to_native()),
            (1, 0)
        );
        assert_eq!(device.gid().unwrap(), (0, gid_of(address)));
        // No other entry: the host's own GIDs stay hidden.
        let beyond = device.query_gid(1).expect_err("a second GID entry");
        assert_eq!(beyond.status(), Some(Status::InvalidArgument));
        // An address vector can name no other source GID.
        let pd = device.alloc_pd().unwrap();
        let route = AhAttr {
            dgid: gid_of("192.168.77.1"),
            sgid_index: 0,
            hop_limit: 1,
            is_global: true,
            port_num: 1,
            ..Default::default()
        };
        pd.create_ah(&route)
            .expect("an AH from the guest's own GID");
        let other = pd
            .create_ah(&AhAttr {
                sgid_index: 1,
                ..route
            })
            .expect_err("an AH from another GID");
        assert_eq!(other.status(), Some(Status::InvalidArgument));
    }
    assert!(
        stop(backend).success(),
        "the backend stops cleanly on SIGTERM"
    );
    assert!(!addresses().contains(address), "{}", addresses());
    wait_for_host_gid(gid_of(address), false);
}

#[test]
#[ignore = "needs rdma_rxe: run by tests/run-all.sh inside the VM harness"]
fn an_address_the_host_holds_is_refused_and_one_a_killed_backend_left_is_taken_over() {
    // The host's own address is never a guest's.
    let stderr = backend_refuses(&socket("host"), &["--guest-ip", "192.168.77.1/24"]);
    assert!(
        stderr.contains("192.168.77.1 is already in use on this host (va)"),
        "{stderr}"
    );
    assert!(addresses().contains("inet 192.168.77.1/24"), "left alone");

    // A backend killed outright leaves its address; the next one for the guest takes it over.
    let address = "192.168.77.51";
    let socket = socket("killed");
    let mut first = spawn_backend_process(&socket, &["--guest-ip", "192.168.77.51/24"]);
    first.kill().unwrap();
    first.wait().unwrap();
    assert!(addresses().contains(address), "{}", addresses());
    let second = spawn_backend_process(&socket, &["--guest-ip", "192.168.77.51/24"]);
    wait_for_log(&socket, "left by an earlier vrdma backend");
    let device = Device::open(socket.to_str().unwrap()).expect("open the device");
    assert_eq!(device.gid().unwrap(), (0, gid_of(address)));
    drop(device);
    assert!(stop(second).success());
    assert!(!addresses().contains(address), "{}", addresses());
}

/// Waits for the log of the backend on `socket` to say `line`.
fn wait_for_log(socket: &std::path::Path, line: &str) {
    wait_for_backend_log(socket, &format!("`{line}`"), |log| log.contains(line));
}

/// `/proc/PID/task/*/status` lines starting with `field`, one per thread of `pid`.
fn thread_status(pid: u32, field: &str) -> Vec<String> {
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).expect("the backend's threads");
    tasks
        .filter_map(|task| std::fs::read_to_string(task.ok()?.path().join("status")).ok())
        .filter_map(|status| {
            let line = status.lines().find(|l| l.starts_with(field))?;
            Some(
                line.split_whitespace()
                    .skip(1)
                    .collect::<Vec<_>>()
                    .join(" "),
            )
        })
        .collect()
}

#[test]
#[ignore = "needs rdma_rxe: run by tests/run-all.sh inside the VM harness"]
fn a_backend_serving_as_an_unprivileged_user_pins_guest_memory_and_removes_its_address() {
    let address = "192.168.77.52";
    let socket = socket("user");
    let backend = spawn_backend_process(
        &socket,
        &["--guest-ip", "192.168.77.52/24", "--user", "nobody"],
    );
    wait_for_log(
        &socket,
        "running as user nobody (uid 65534, gid 65534), keeping CAP_NET_ADMIN only",
    );
    {
        let device = Device::open(socket.to_str().unwrap()).expect("open the device");
        // 64 MiB pinned: eight times the usual RLIMIT_MEMLOCK of an unprivileged process.
        let pd = device.alloc_pd().unwrap();
        let buffer = device.alloc_buffer(64 << 20).unwrap();
        let mr = pd
            .reg_mr(&buffer, access::LOCAL_WRITE | access::REMOTE_WRITE)
            .expect("register 64 MiB as nobody");
        let cq = device.create_cq(16).unwrap();
        let qp = QueuePair::builder(QpType::Rc, &cq).build(&pd).unwrap();
        // Every thread, the connection's among them: nobody, CAP_NET_ADMIN (bit 12) alone.
        let uids = thread_status(backend.id(), "Uid:");
        assert!(uids.len() > 2, "{uids:?}");
        assert!(
            uids.iter().all(|uid| uid == "65534 65534 65534 65534"),
            "{uids:?}"
        );
        let effective = thread_status(backend.id(), "CapEff:");
        assert!(
            effective.iter().all(|caps| caps == "0000000000001000"),
            "{effective:?}"
        );
        let permitted = thread_status(backend.id(), "CapPrm:");
        assert!(
            permitted.iter().all(|caps| caps == "0000000000001000"),
            "{permitted:?}"
        );
        drop((qp, cq, mr, buffer, pd));
    }
    assert!(stop(backend).success(), "stops cleanly on SIGTERM");
    assert!(!addresses().contains(address), "{}", addresses());
    wait_for_host_gid(gid_of(address), false);
}
