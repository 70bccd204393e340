//! Caller-supplied timeouts too large for an `Instant` are errors naming the input, never a
//! panic. Fails before the fix: `Instant::now() + Duration::MAX` panicked
//! with "overflow when adding duration to instant".

use std::net::TcpListener;
use std::time::Duration;

use dist_core::{Backend, DistError, Tag};
use dist_tcp::TcpBackend;

#[test]
fn huge_timeouts_are_errors_naming_the_input() {
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let b = TcpBackend::with_config(
        TcpBackend::builder(0, 1, format!("127.0.0.1:{port}"))
            .init_timeout(Duration::from_secs(20))
            .linger(Duration::from_secs(1)),
    )
    .unwrap();
    let mut buf = [0u8; 4];
    for r in [
        b.recv_tagged_timeout(&mut buf, 0, Tag::user(1), Duration::MAX),
        b.barrier_timeout(Duration::MAX),
    ] {
        match r {
            Err(DistError::InvalidArgument {
                rank: 0, reason, ..
            }) => {
                assert!(reason.contains(&format!("{:?}", Duration::MAX)), "{reason}");
            }
            other => panic!("expected InvalidArgument, got {other:?}"),
        }
    }
    // A timeout that fits still works.
    b.send_tagged(b"abcd", 0, Tag::user(1)).unwrap();
    b.recv_tagged_timeout(&mut buf, 0, Tag::user(1), Duration::from_secs(5))
        .unwrap();
    assert_eq!(&buf, b"abcd");
}
