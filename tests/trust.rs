//! Where a client follows a node: a compromised node that answers a request with "it moved to
//! ADDR", or a forward the control plane holds, sends a cluster client (with its token) only to
//! a live node the control plane lists; a client given one node's address follows nothing.
//! The catcher, an address that is no node, never sees a connection, and the client's error is
//! the typed refusal.

mod support;

use std::net::TcpListener;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use djinn_client::{
    ClientOptions, ClusterClient, ClusterError, ControlClient, DType, FailoverOptions, Fingerprint, Handle, HandleInfo,
    RemoteSession, RemoteTensor, Signal, TensorDesc, TensorRef,
};
use serde_json::{Value as Json, json};
use support::hostile_node::{Attack, HostileNode};
use support::{Killed, spawn_listening};

const ALICE: &str = "alice-token-0123456789abcdef";
const NODES: &str = "nodes-token-0123456789ab";
const OPS: &str = "ops-token-0123456789abcd";

/// A control plane with tokens and one real node joined to it.
struct Cluster {
    _control: Killed,
    _node: Killed,
    url: String,
    node_addr: String,
}

impl Cluster {
    fn start(dir: &Path) -> Self {
        let tokens = dir.join("tokens.json");
        let principals = json!({ "principals": [
            { "name": "alice", "tokens": [ALICE] },
            { "name": "nodes", "role": "node", "tokens": [NODES] },
            { "name": "ops", "role": "admin", "tokens": [OPS] },
        ]});
        std::fs::write(&tokens, principals.to_string()).unwrap();
        let mut control = Command::new(env!("CARGO_BIN_EXE_djinn"));
        control
            .args(["control", "--listen", "127.0.0.1:0", "--log", "error", "--lease-ttl", "60s", "--store"])
            .arg(dir.join("control.redb"))
            .arg("--auth-file")
            .arg(&tokens);
        let (control, addr) = spawn_listening(control, "djinn control listening on ");
        let control = Killed(control);
        let url = format!("http://{addr}");
        let mut node = Command::new(env!("CARGO_BIN_EXE_djinn"));
        node.args(["node", "--listen", "127.0.0.1:0", "--log", "error", "--control", &url, "--name", "real"])
            .arg("--auth-file")
            .arg(&tokens)
            .env("DJINN_TOKEN", NODES);
        let (node, node_addr) = spawn_listening(node, "djinn node listening on ");
        let cluster = Self { _control: control, _node: Killed(node), url, node_addr };
        cluster.wait_listed(&cluster.node_addr.clone(), true);
        cluster
    }

    /// Waits until the control plane lists (or no longer lists) a node at `addr`.
    fn wait_listed(&self, addr: &str, listed: bool) {
        let alice = ControlClient::new(&self.url, Duration::from_secs(5)).with_token(ALICE);
        let deadline = Instant::now() + Duration::from_secs(20);
        while alice.live_nodes().unwrap().iter().any(|a| a == addr) != listed {
            assert!(Instant::now() < deadline, "{addr} listed: not {listed} after 20 s");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// A request with the node principal's token: `(status, body)`.
    fn as_nodes(&self, method: &str, path: &str, body: Option<&Json>) -> (u16, Json) {
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_global(Some(Duration::from_secs(20)))
            .build()
            .into();
        let request = ureq::http::Request::builder()
            .method(method)
            .uri(format!("{}{path}", self.url))
            .header("Authorization", format!("Bearer {NODES}"))
            .header("Content-Type", "application/json");
        let body = body.map(Json::to_string).unwrap_or_default();
        let mut response = agent.run(request.body(body).unwrap()).unwrap();
        let status = response.status().as_u16();
        let text = response.body_mut().read_to_string().unwrap();
        (status, if text.is_empty() { Json::Null } else { serde_json::from_str(&text).unwrap() })
    }

    /// Registers a node named `name` serving at `addr`, as the node principal would: its lease.
    fn register(&self, name: &str, addr: &str) -> u64 {
        let inventory = json!({
            "addr": addr, "device": "cpu", "memory_total": 1 << 30, "memory_free": 1 << 30,
            "host_memory_free": 1 << 30, "host_to_device": 1e9, "flops": 1e9, "memory_bandwidth": 1e9,
            "link_bandwidth": 1e9, "transports": ["tcp"], "queue_depth": 0, "cost_per_hour": 1.0, "models": []
        });
        let (status, answer) =
            self.as_nodes("POST", "/v1/nodes", Some(&json!({ "name": name, "inventory": inventory })));
        assert_eq!(status, 201, "{answer}");
        self.wait_listed(addr, true);
        answer["lease"].as_u64().unwrap()
    }

    fn alice(&self) -> ClusterClient {
        ClusterClient::open(&self.url, alice_options(), FailoverOptions::default()).expect("alice through the control")
    }
}

fn alice_options() -> ClientOptions {
    ClientOptions { token: ALICE.into(), timeout: Some(Duration::from_secs(10)), ..Default::default() }
}

/// A listener on a free port that is no node: it must never see a connection.
struct Catcher(TcpListener);

impl Catcher {
    fn new() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        Self(listener)
    }

    fn addr(&self) -> String {
        self.0.local_addr().unwrap().to_string()
    }

    fn assert_untouched(&self) {
        match self.0.accept() {
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => panic!("the catcher's accept failed: {e}"),
            Ok((_, from)) => panic!("the catcher was connected to, from {from}"),
        }
    }
}

fn four_floats() -> Vec<u8> {
    [1.0f32, 2.0, 3.0, 4.0].iter().flat_map(|v| v.to_le_bytes()).collect()
}

fn keep_four_floats(cluster: &mut ClusterClient, node: Option<&str>) -> RemoteTensor {
    let bytes = four_floats();
    cluster.keep(node, TensorRef { dtype: DType::F32, shape: &[4], bytes: &bytes }).expect("keep")
}

/// A session handle the node never opened: the hostile node answers for it.
fn made_up_session(node: &str) -> RemoteSession {
    RemoteSession {
        node: node.into(),
        session: Handle { id: 1, epoch: 1 },
        fingerprint: Fingerprint([7; 32]),
        key: None,
    }
}

fn assert_refused(result: Result<impl std::fmt::Debug, ClusterError>, catcher: &Catcher) {
    match result {
        Err(ClusterError::UntrustedAddress { to, .. }) => assert_eq!(to, catcher.addr()),
        other => panic!("not refused: {other:?}"),
    }
    catcher.assert_untouched();
}

/// A listed node that answers a fetch with "the kept tensor moved to ADDR", or a session's
/// step with "the session moved to ADDR", where ADDR is no node: the client goes nowhere.
#[test]
fn a_listed_node_cannot_send_a_client_to_an_unlisted_address() {
    let dir = tempfile::tempdir().unwrap();
    let cluster = Cluster::start(dir.path());
    let catcher = Catcher::new();
    let attack =
        Attack { kept_moved_to: Some(catcher.addr()), session_moved_to: Some(catcher.addr()), ..Attack::default() };
    let hostile = HostileNode::start(&cluster.node_addr, attack);
    cluster.register("hostile", &hostile.addr);

    let mut alice = cluster.alice();
    let kept = keep_four_floats(&mut alice, Some(&hostile.addr));
    assert_refused(alice.fetch(&kept), &catcher);

    let mut session = made_up_session(&hostile.addr);
    assert_refused(alice.session_signal(&mut session, Signal::Compute), &catcher);
    assert_eq!(session.node, hostile.addr, "the session did not follow");
}

/// A move to a listed node is followed: a node that answers "moved to the real node" (which
/// holds the tensor under the same handle) gets the client there.
#[test]
fn a_move_to_a_listed_node_is_followed() {
    let dir = tempfile::tempdir().unwrap();
    let cluster = Cluster::start(dir.path());
    let attack = Attack { kept_moved_to: Some(cluster.node_addr.clone()), ..Attack::default() };
    let redirecting = HostileNode::start(&cluster.node_addr, attack);
    cluster.register("redirecting", &redirecting.addr);

    let mut alice = cluster.alice();
    let kept = keep_four_floats(&mut alice, Some(&redirecting.addr));
    let fetched = alice.fetch(&kept).expect("followed to the real node");
    assert_eq!(fetched.bytes(), four_floats());
}

/// A forward the control plane holds, to a node that has left since (its address now
/// anyone's): a client that finds the drained node gone does not follow it.
#[test]
fn a_forward_to_a_node_that_left_is_not_followed() {
    let dir = tempfile::tempdir().unwrap();
    let cluster = Cluster::start(dir.path());
    let catcher = Catcher::new();
    let gone = support::free_addr();
    cluster.register("gone", &gone);
    let lease = cluster.register("catcher", &catcher.addr());
    let forwards = json!({ "forwards": [
        { "kind": "kept", "tenant": "alice", "id": 5, "epoch": 7, "to": catcher.addr(), "to_id": 1, "to_epoch": 1 },
        { "kind": "session", "tenant": "alice", "id": 5, "epoch": 7, "to": catcher.addr(), "to_id": 1, "to_epoch": 1 },
    ]});
    let (status, answer) = cluster.as_nodes("POST", "/v1/nodes/gone/forwards", Some(&forwards));
    assert_eq!(status, 204, "{answer}");
    let (status, answer) = cluster.as_nodes("DELETE", &format!("/v1/nodes/catcher?lease={lease}"), None);
    assert_eq!(status, 204, "{answer}");
    cluster.wait_listed(&catcher.addr(), false);

    let mut alice = cluster.alice();
    let tensor = TensorDesc::new(DType::F32, vec![4]).unwrap();
    let kept = RemoteTensor { node: gone.clone(), info: HandleInfo { handle: Handle { id: 5, epoch: 7 }, tensor } };
    assert_refused(alice.fetch(&kept), &catcher);
    let mut session = RemoteSession { session: Handle { id: 5, epoch: 7 }, ..made_up_session(&gone) };
    assert_refused(alice.session_signal(&mut session, Signal::Compute), &catcher);
}

/// A client given one node's address (no control plane) follows no move at all, not even to
/// a real node.
#[test]
fn a_client_of_one_node_follows_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let cluster = Cluster::start(dir.path());
    let catcher = Catcher::new();
    let attack =
        Attack { kept_moved_to: Some(catcher.addr()), session_moved_to: Some(catcher.addr()), ..Attack::default() };
    let hostile = HostileNode::start(&cluster.node_addr, attack);

    let mut alice = ClusterClient::open(&hostile.addr, alice_options(), FailoverOptions::default()).expect("open");
    let kept = keep_four_floats(&mut alice, None);
    assert_refused(alice.fetch(&kept), &catcher);
    let mut session = made_up_session(&hostile.addr);
    assert_refused(alice.session_signal(&mut session, Signal::Compute), &catcher);
}

/// With TLS, a node's certificate must name the node's address as the client was given it: a
/// certificate for 127.0.0.1 alone passes at `127.0.0.1:PORT` but not at `localhost:PORT`,
/// though that name resolves there (the name, not what it resolved to, is what is checked).
#[test]
fn a_node_certificate_must_name_the_address_as_given() {
    let dir = tempfile::tempdir().unwrap();
    let rcgen::CertifiedKey { cert, key_pair } = rcgen::generate_simple_self_signed(vec!["127.0.0.1".into()]).unwrap();
    let (cert_path, key_path) = (dir.path().join("node.pem"), dir.path().join("node.key"));
    std::fs::write(&cert_path, cert.pem()).unwrap();
    std::fs::write(&key_path, key_pair.serialize_pem()).unwrap();
    let mut node = Command::new(env!("CARGO_BIN_EXE_djinn"));
    node.args(["node", "--listen", "127.0.0.1:0", "--log", "error", "--tls-cert"])
        .arg(&cert_path)
        .arg("--tls-key")
        .arg(&key_path)
        .env_remove("DJINN_TOKEN");
    let (node, addr) = spawn_listening(node, "djinn node listening on ");
    let _node = Killed(node);
    let tls = djinn_client::ClientTls::trusting(cert.pem().as_bytes()).unwrap();
    let options = ClientOptions { tls: Some(tls), timeout: Some(Duration::from_secs(10)), ..Default::default() };

    let mut by_address = ClusterClient::open(&addr, options.clone(), FailoverOptions::default()).expect("by address");
    keep_four_floats(&mut by_address, None);
    let by_name = addr.replace("127.0.0.1", "localhost");
    match ClusterClient::open(&by_name, options, FailoverOptions::default()) {
        Err(e) => assert!(format!("{e:?}").contains("NotValidForName"), "{by_name}: {e:?}"),
        Ok(_) => panic!("{by_name}: a certificate for 127.0.0.1 alone passed"),
    }
}
