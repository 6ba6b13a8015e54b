//! Unit tests of `vhost_user`.

use super::*;
use std::os::unix::fs::{MetadataExt, PermissionsExt};

/// Finding: the backend (and `vrdmactl add`) replaced whatever file sat at a guest's
/// socket path. Now only a socket no process serves is replaced.
#[test]
fn only_a_socket_no_one_serves_is_replaced() {
    let path = std::env::temp_dir().join(format!("vrdma-path-{}.sock", std::process::id()));
    std::fs::write(&path, "an operator's file").unwrap();
    let refused = listen(&path, None).err().expect("a plain file is refused");
    assert!(
        refused.to_string().contains("other than a socket"),
        "{refused}"
    );
    assert_eq!(
        std::fs::read_to_string(&path).unwrap(),
        "an operator's file"
    );
    std::fs::remove_file(&path).unwrap();

    let served = std::os::unix::net::UnixListener::bind(&path).unwrap();
    let refused = listen(&path, None)
        .err()
        .expect("a served socket is refused");
    assert!(refused.to_string().contains("serves"), "{refused}");
    drop(served); // the file stays, served by no one
    let listener = listen(&path, None).unwrap();
    drop(listener);
    let _ = std::fs::remove_file(&path);
}

#[test]
fn a_socket_group_gets_the_guests_socket_with_mode_0660() {
    let own_group = nix::unistd::Group::from_gid(nix::unistd::getegid())
        .unwrap()
        .expect("the process's group has a name");
    let group: crate::sandbox::SocketGroup = own_group.name.parse().unwrap();
    let socket = std::env::temp_dir().join(format!("vrdma-group-{}.sock", std::process::id()));
    let listener = listen(&socket, Some(&group)).unwrap();
    let meta = std::fs::metadata(&socket).unwrap();
    assert_eq!(meta.gid(), group.gid.as_raw());
    assert_eq!(meta.permissions().mode() & 0o777, 0o660);
    drop(listener);
    let _ = std::fs::remove_file(&socket);
}
