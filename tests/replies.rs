//! Replies a client takes from a node it cannot trust (issue 49): every reply is bounded by
//! what its request can return, and every listing by a page bound and a cursor that advances.
//! Against a real node behind a hostile one (tests/support/hostile_node.rs) that answers lists
//! with pages for ever and fetches and gets with 512 MiB of zeros.

mod support;

use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use djinn_client::{
    Client, ClientError, ClientOptions, ClusterClient, ClusterError, DType, FailoverOptions, MAX_LIST_PAGES,
    RemoteTensor, TensorRef,
};
use support::hostile_node::{Attack, EndlessLists, HostileNode};
use support::{Killed, Node, djinn_binary};

const OVERSIZED: u64 = 512 << 20;

/// Resident memory of this test process, bytes.
fn rss() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").expect("/proc/self/statm");
    let pages: u64 = statm.split_whitespace().nth(1).and_then(|p| p.parse().ok()).expect("resident pages");
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as u64;
    pages * page
}

/// Runs `f` in a thread and returns its result; fails when this process's resident memory grows
/// by more than `growth` meanwhile, or when it runs past a hang guard (the call is then left to
/// its thread: the test fails instead of hanging or exhausting the machine).
fn bounded<T: Send + 'static>(what: &str, growth: u64, f: impl FnOnce() -> T + Send + 'static) -> T {
    let before = rss();
    let (tx, rx) = mpsc::channel();
    thread::spawn(move || {
        let _ = tx.send(f());
    });
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let grown = rss().saturating_sub(before);
        assert!(grown <= growth, "{what}: memory grew by {} MiB, past {} MiB", grown >> 20, growth >> 20);
        match rx.recv_timeout(Duration::from_millis(20)) {
            Ok(out) => return out,
            Err(mpsc::RecvTimeoutError::Timeout) => {
                assert!(Instant::now() < deadline, "{what}: still running after two minutes")
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => panic!("{what}: the call panicked"),
        }
    }
}

fn hostile(node: &Node, attack: Attack) -> HostileNode {
    HostileNode::start(&node.addr.to_string(), attack)
}

fn endless(advancing: bool) -> Attack {
    Attack { endless_lists: Some(EndlessLists { advancing }), ..Attack::default() }
}

/// The errors of listing named tensors, kept tensors and sessions through the node at `addr`.
fn every_list(addr: &str) -> [ClientError; 3] {
    let mut client = Client::connect(addr).expect("connect through the hostile node");
    [
        client.list().map(|l| l.len()).unwrap_err(),
        client.list_kept().map(|l| l.len()).unwrap_err(),
        client.list_sessions().map(|l| l.len()).unwrap_err(),
    ]
}

#[test]
fn endless_lists_of_the_same_page_end_with_a_typed_error() {
    let node = Node::start("mio", &[]);
    let hostile = hostile(&node, endless(false));
    let addr = hostile.addr.clone();
    let errors = bounded("listing the same page for ever", 64 << 20, move || every_list(&addr));
    for (e, what) in errors.iter().zip(["tensors", "kept tensors", "sessions"]) {
        assert!(
            matches!(e, ClientError::BadListPage { what: w, .. } if *w == what),
            "{what}: {e:?} is not a refused page"
        );
    }
}

#[test]
fn endless_lists_of_new_pages_end_at_the_page_bound() {
    let node = Node::start("mio", &[]);
    let hostile = hostile(&node, endless(true));
    let addr = hostile.addr.clone();
    // 1024 pages of 64 entries each: a few MiB at most.
    let errors = bounded("listing new pages for ever", 128 << 20, move || every_list(&addr));
    for (e, what) in errors.iter().zip(["tensors", "kept tensors", "sessions"]) {
        assert!(
            matches!(e, ClientError::ListTooLong { what: w, pages, entries, .. }
                if *w == what && *pages == MAX_LIST_PAGES && *entries == MAX_LIST_PAGES * 64),
            "{what}: {e:?} is not a listing ended at its bound"
        );
    }
}

#[test]
fn a_kept_tensor_answered_with_512_mib_is_refused_before_it_is_read() {
    let node = Node::start("mio", &[]);
    let hostile = hostile(&node, Attack { oversized_reply: Some(OVERSIZED), ..Attack::default() });
    let addr = hostile.addr.clone();
    let (error, cluster_error, after) = bounded("fetching a kept tensor", 64 << 20, move || {
        let bytes: Vec<u8> = (0..16).collect();
        let tensor = TensorRef { dtype: DType::U8, shape: &[16], bytes: &bytes };
        let mut client = Client::connect(&addr).expect("connect through the hostile node");
        let kept = client.keep(tensor).expect("kept on the real node");
        let error = client.fetch_as(kept.handle, &kept.tensor).map(|t| t.bytes().len()).unwrap_err();
        // The connection was closed; the client connects again for the next request.
        let after = client.ping().map(drop);

        // As the Python package fetches: through the cluster client, which knows the descriptor.
        let options = ClientOptions::default();
        let mut cluster = ClusterClient::open(&addr, options, FailoverOptions::default()).expect("open");
        let remote: RemoteTensor = cluster.keep(None, tensor).expect("kept");
        let cluster_error = cluster.fetch(&remote).map(|t| t.bytes().len()).unwrap_err();
        (error, cluster_error, after)
    });
    assert!(
        matches!(error, ClientError::ReplyTooLarge { announced: OVERSIZED, bound: 16, .. }),
        "{error:?} is not a refused 512 MiB reply"
    );
    assert!(
        matches!(cluster_error, ClusterError::Node(ClientError::ReplyTooLarge { announced: OVERSIZED, bound: 16, .. })),
        "{cluster_error:?} is not a refused 512 MiB reply"
    );
    after.expect("the client works again after the refused reply");
}

#[test]
fn gets_and_fetches_without_a_descriptor_are_bounded_by_the_nodes_limits() {
    let node = Node::start("mio", &["--max-payload", "64MiB"]);
    let hostile = hostile(&node, Attack { oversized_reply: Some(OVERSIZED), ..Attack::default() });
    let addr = hostile.addr.clone();
    let errors = bounded("getting a named tensor", 64 << 20, move || {
        let mut client = Client::connect(&addr).expect("connect through the hostile node");
        let bytes = [0u8; 16];
        let kept = client.keep(TensorRef { dtype: DType::U8, shape: &[16], bytes: &bytes }).expect("kept");
        [
            client.get("x").map(|t| t.bytes().len()).unwrap_err(),
            client.fetch(kept.handle).map(|t| t.bytes().len()).unwrap_err(),
        ]
    });
    for e in errors {
        assert!(
            matches!(e, ClientError::ReplyTooLarge { announced: OVERSIZED, bound, .. } if bound == 64 << 20),
            "{e:?} is not a reply refused at the node's limit"
        );
    }
}

#[test]
fn djinn_ls_against_endless_lists_exits_with_an_error() {
    let node = Node::start("mio", &[]);
    for advancing in [false, true] {
        let hostile = hostile(&node, endless(advancing));
        let mut child = Killed(
            Command::new(djinn_binary())
                .args(["ls", &hostile.addr, "--transport", "tcp", "--log", "error"])
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .spawn()
                .expect("start djinn ls"),
        );
        let deadline = Instant::now() + Duration::from_secs(60);
        let status = loop {
            if let Some(status) = child.0.try_wait().expect("wait") {
                break status;
            }
            assert!(Instant::now() < deadline, "djinn ls (advancing: {advancing}) still running after a minute");
            thread::sleep(Duration::from_millis(50));
        };
        let mut stderr = String::new();
        std::io::Read::read_to_string(&mut child.0.stderr.take().expect("stderr"), &mut stderr).expect("stderr");
        assert!(!status.success(), "djinn ls (advancing: {advancing}) succeeded: {stderr}");
        assert!(stderr.contains("tensors"), "djinn ls (advancing: {advancing}) said: {stderr}");
    }
}
