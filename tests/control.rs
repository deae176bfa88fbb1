//! The control plane as processes on 127.0.0.1: `djinn control` over the embedded store and over
//! a real etcd, three `djinn node --control` processes with different budgets, speeds and
//! prices, and placement asked for over HTTP.

mod support;

use std::collections::HashMap;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use djinn_client::{ClientOptions, ClusterClient, DType, FailoverOptions, Fingerprint, Target, TensorRef, Value};
use djinn_control::store::local_etcd::{LocalEtcd, free_port};
use serde_json::{Value as Json, json};
use support::Node;

const MIB: u64 = 1 << 20;
/// Nodes gone because their lease lapsed, in the control plane's /metrics.
const LEASES_LAPSED: &str = "djinn_control_leases_lapsed_total";

/// A `djinn control` child process, killed on drop; or one served by another process.
struct Control {
    child: Option<Child>,
    url: String,
}

impl Control {
    fn start(listen: &str, store: &[&str], lease_ttl: &str) -> Self {
        let mut command = Command::new(env!("CARGO_BIN_EXE_djinn"));
        command.args(["control", "--listen", listen, "--lease-ttl", lease_ttl, "--log", "warn"]).args(store);
        let (child, addr) = support::spawn_listening(command, "djinn control listening on ");
        Self { child: Some(child), url: format!("http://{addr}") }
    }

    fn served_at(addr: &str) -> Self {
        Self { child: None, url: format!("http://{addr}") }
    }

    fn addr(&self) -> &str {
        self.url.trim_start_matches("http://")
    }

    /// SIGKILL: no goodbye.
    fn kill(&mut self) {
        if let Some(child) = &mut self.child {
            let _ = child.kill();
            let _ = child.wait();
        }
        self.child = None;
    }

    /// `(status, body as JSON)`; the body is `null` when empty.
    fn http(&self, method: &str, path: &str, body: Option<&str>) -> (u16, Json) {
        let agent: ureq::Agent = ureq::Agent::config_builder().http_status_as_error(false).build().into();
        let url = format!("{}{path}", self.url);
        let answer = match (method, body) {
            ("GET", _) => agent.get(&url).call(),
            ("DELETE", _) => agent.delete(&url).call(),
            ("POST", Some(body)) => agent.post(&url).content_type("application/json").send(body),
            ("PUT", Some(body)) => agent.put(&url).content_type("application/json").send(body),
            _ => panic!("{method} without a body"),
        };
        let mut response = answer.unwrap_or_else(|e| panic!("{method} {path}: {e}"));
        let status = response.status().as_u16();
        let text = response.body_mut().read_to_string().expect("body");
        (status, if text.is_empty() { Json::Null } else { serde_json::from_str(&text).unwrap_or(Json::String(text)) })
    }

    fn ok(&self, method: &str, path: &str, body: Option<Json>) -> Json {
        let (status, answer) = self.http(method, path, body.map(|b| b.to_string()).as_deref());
        assert!((200..300).contains(&status), "{method} {path}: {status} {answer}");
        answer
    }

    fn cluster(&self) -> Json {
        self.ok("GET", "/v1/cluster", None)
    }

    fn node_names(&self) -> Vec<String> {
        let cluster = self.cluster();
        cluster["nodes"].as_array().unwrap().iter().map(|n| n["name"].as_str().unwrap().to_owned()).collect()
    }

    /// Waits until the live nodes are exactly `names`. Fails after a minute: a hang guard (a
    /// node that starts while its control plane's store is down backs off up to 30 s).
    fn wait_for_nodes(&self, names: &[&str]) {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let live = self.node_names();
            if live == names {
                return;
            }
            assert!(Instant::now() < deadline, "nodes {live:?}, waiting for {names:?}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The counter `name` (a whole sample name, labels included) in /metrics.
    fn counter(&self, name: &str) -> u64 {
        let (status, text) = self.http("GET", "/metrics", None);
        let text = text.as_str().unwrap_or_default();
        assert_eq!(status, 200, "{text}");
        let value = text.lines().find_map(|line| line.strip_prefix(name)?.strip_prefix(' '));
        value.and_then(|v| v.parse().ok()).unwrap_or_else(|| panic!("no counter {name} in {text}"))
    }

    /// Waits until the counter `name` in /metrics is `value` or more, and returns it. Fails after
    /// a minute: a hang guard, the control plane is expected to get there long before.
    fn wait_for_counter(&self, name: &str, value: u64) -> u64 {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let now = self.counter(name);
            if now >= value {
                return now;
            }
            assert!(Instant::now() < deadline, "{name} stayed at {now}, waiting for {value}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Describes a model of `blocks` blocks of `block_bytes` each.
    fn describe(&self, fingerprint: &str, blocks: usize, block_bytes: u64, flops: f64) {
        let blocks: Vec<Json> = (0..blocks).map(|_| json!({ "weight_bytes": block_bytes, "flops": flops })).collect();
        self.ok("PUT", &format!("/v1/models/{fingerprint}"), Some(json!({ "blocks": blocks, "io_bytes": 4096 })));
    }

    fn place(&self, fingerprint: &str, policy: &str, session: Option<&str>) -> Json {
        let mut body = json!({ "fingerprint": fingerprint, "policy": policy });
        if let Some(session) = session {
            body["session"] = json!(session);
        }
        self.ok("POST", "/v1/placements", Some(body))
    }
}

impl Drop for Control {
    fn drop(&mut self) {
        if let Some(child) = &mut self.child {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// One control plane's store: the embedded file or an etcd.
enum Backing {
    Embedded(tempfile::TempDir),
    Etcd(LocalEtcd),
}

impl Backing {
    fn embedded() -> Self {
        Self::Embedded(tempfile::tempdir().unwrap())
    }

    fn etcd() -> Self {
        Self::Etcd(LocalEtcd::start())
    }

    fn args(&self) -> Vec<String> {
        match self {
            Self::Embedded(dir) => vec!["--store".into(), dir.path().join("control.redb").display().to_string()],
            Self::Etcd(etcd) => vec!["--etcd".into(), etcd.url.clone()],
        }
    }

    /// etcd's leases last at least 2 s.
    fn lease_ttl_ms(&self) -> u64 {
        match self {
            Self::Embedded(_) => 1000,
            Self::Etcd(_) => 2000,
        }
    }

    fn control(&self, listen: &str) -> Control {
        let args = self.args();
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        Control::start(listen, &args, &format!("{}ms", self.lease_ttl_ms()))
    }
}

/// Three nodes: budgets of 64, 128 and 192 MiB; `c` computes fastest, `a` is cheapest.
fn three_nodes(control: &Control) -> Vec<Node> {
    let nodes = [("a", "64MiB", "1e11", "1"), ("b", "128MiB", "2e11", "4"), ("c", "192MiB", "8e11", "16")].map(
        |(name, budget, flops, price)| {
            Node::start(
                "mio",
                &[
                    "--device",
                    "cpu",
                    "--control",
                    &control.url,
                    "--name",
                    name,
                    "--device-memory-budget",
                    budget,
                    "--flops",
                    flops,
                    "--host-to-device",
                    "1e10",
                    "--cost-per-hour",
                    price,
                ],
            )
        },
    );
    control.wait_for_nodes(&["a", "b", "c"]);
    nodes.into()
}

/// Tests `SCENARIO::embedded` and `SCENARIO::etcd`: the scenario on each store.
macro_rules! on_both_stores {
    ($scenario:ident) => {
        mod $scenario {
            #[test]
            fn embedded() {
                super::$scenario(&super::Backing::embedded());
            }

            #[test]
            fn etcd() {
                super::$scenario(&super::Backing::etcd());
            }
        }
    };
}

fn fingerprint(i: usize) -> String {
    format!("{i:064x}")
}

fn field<'a>(decision: &'a Json, name: &str) -> &'a str {
    decision[name].as_str().unwrap_or_else(|| panic!("no {name} in {decision}"))
}

/// Placement follows each policy and the rules before them, as seen by real nodes.
fn placement_follows_each_policy(backing: &Backing) {
    let control = backing.control("127.0.0.1:0");
    let nodes = three_nodes(&control);

    // load_balance spreads 30 registrations of 4 MiB in proportion to the budgets (64:128:192).
    let mut count: HashMap<String, usize> = HashMap::new();
    for i in 0..30 {
        control.describe(&fingerprint(i), 2, 2 * MIB, 1e6);
        let d = control.place(&fingerprint(i), "load_balance", None);
        assert_eq!(field(&d, "rule"), "policy", "{d}");
        *count.entry(field(&d, "node").to_owned()).or_default() += 1;
    }
    assert!(count["a"].abs_diff(5) <= 1 && count["b"].abs_diff(10) <= 1 && count["c"].abs_diff(15) <= 1, "{count:?}");

    // Identical weights share a node whatever the policy.
    let first = control.place(&fingerprint(0), "load_balance", None);
    for policy in ["minimize_latency", "maximize_throughput", "minimize_cost"] {
        let d = control.place(&fingerprint(0), policy, None);
        assert_eq!((field(&d, "node"), field(&d, "rule")), (field(&first, "node"), "shared"), "{d}");
    }

    // Compute-heavy models: latency and throughput go to the fastest node, cost to the
    // cheapest per call (a: 1/1e11 per FLOP-hour against c: 16/8e11).
    control.describe(&fingerprint(100), 1, MIB, 1e12);
    let d = control.place(&fingerprint(100), "minimize_latency", None);
    assert_eq!(field(&d, "node"), "c", "{d}");
    assert!(d["cost"]["compute_s"].as_f64().unwrap() > 0.0 && d["runner_up"].is_array(), "{d}");
    control.describe(&fingerprint(101), 1, MIB, 1e12);
    assert_eq!(field(&control.place(&fingerprint(101), "maximize_throughput", None), "node"), "c");
    control.describe(&fingerprint(102), 1, MIB, 1e12);
    assert_eq!(field(&control.place(&fingerprint(102), "minimize_cost", None), "node"), "a");

    // A model larger than every node goes where it streams least.
    control.describe(&fingerprint(103), 40, 8 * MIB, 1e6);
    let d = control.place(&fingerprint(103), "minimize_cost", None);
    assert_eq!((field(&d, "node"), field(&d, "rule")), ("c", "streamed"), "{d}");

    // All 100 calls of one session land on its first node, though load_balance alone would
    // move away from it as other models fill it.
    control.describe(&fingerprint(200), 1, MIB, 1e6);
    let home = field(&control.place(&fingerprint(200), "load_balance", Some("s1")), "node").to_owned();
    for i in 0..99 {
        control.describe(&fingerprint(300 + i), 1, MIB / 4, 1e6);
        control.place(&fingerprint(300 + i), "load_balance", None);
        let d = control.place(&fingerprint(200), "load_balance", Some("s1"));
        assert_eq!((field(&d, "node"), field(&d, "rule")), (home.as_str(), "session"), "{d}");
    }

    // A real model placed, registered where the control plane said, and run there; the node's
    // next renewal shows it.
    let archive = support::archive("mlp");
    let fp = Fingerprint::of_blocks(&[&archive]).to_string();
    control.describe(&fp, 1, archive.len() as u64, 1e6);
    let d = control.place(&fp, "minimize_latency", None);
    let node = nodes.iter().find(|n| n.addr.to_string() == field(&d, "addr")).expect("the chosen node");
    let mut client = node.client();
    let registration = client.register_model(&[&archive], |_, _| {}).unwrap();
    let x = vec![0u8; 4 * 256];
    let input = TensorRef { dtype: DType::F32, shape: &[1, 256], bytes: &x };
    let out = client.execute(&registration.fingerprint, &[Value::Tensor(0)], &[input]).expect("runs on its node");
    assert_eq!(out.tensors[0].shape, vec![1, 256]);
    let deadline = Instant::now() + Duration::from_secs(10);
    while !control.cluster()["nodes"].as_array().unwrap().iter().any(|n| n["inventory"]["models"][0] == json!(fp)) {
        assert!(Instant::now() < deadline, "no renewal showed the model: {}", control.cluster());
        std::thread::sleep(Duration::from_millis(50));
    }
}

on_both_stores!(placement_follows_each_policy);

/// A node killed with SIGKILL is gone once its lease lapses (the control plane counts the
/// lapse); the others keep theirs; its session moves.
fn a_killed_node_lapses(backing: &Backing) {
    let control = backing.control("127.0.0.1:0");
    let mut nodes = three_nodes(&control);
    control.describe(&fingerprint(1), 1, MIB, 1e6);
    let home = field(&control.place(&fingerprint(1), "load_balance", Some("s")), "node").to_owned();
    let index = ["a", "b", "c"].iter().position(|n| *n == home).unwrap();
    let lapsed = control.counter(LEASES_LAPSED);
    nodes.remove(index).kill();
    let rest: Vec<&str> = ["a", "b", "c"].into_iter().filter(|n| *n != home).collect();
    control.wait_for_nodes(&rest);
    // SIGKILL sends no goodbye: it went because its lease lapsed, and only its lease did.
    assert_eq!(control.counter(LEASES_LAPSED), lapsed + 1, "lapses counted");
    let d = control.place(&fingerprint(1), "load_balance", Some("s"));
    assert!(rest.contains(&field(&d, "node")) && field(&d, "rule") == "policy", "{d}");
    assert_eq!(field(&control.place(&fingerprint(1), "load_balance", Some("s")), "rule"), "session");
}

on_both_stores!(a_killed_node_lapses);

/// Malformed or wrong requests get a clear status and message; the control plane goes on.
fn bad_input_gets_clear_errors(backing: &Backing) {
    let control = backing.control("127.0.0.1:0");
    let error = |method: &str, path: &str, body: Option<&str>, status: u16, kind: &str| {
        let (got, answer) = control.http(method, path, body);
        assert_eq!((got, answer["error"]["kind"].as_str()), (status, Some(kind)), "{method} {path}: {answer}");
        assert!(!answer["error"]["message"].as_str().unwrap().is_empty());
    };
    let inventory = json!({
        "addr": "127.0.0.1:1", "device": "cpu", "memory_total": 1024, "memory_free": 1024,
        "host_memory_free": 1024, "host_to_device": 1e9, "flops": 1e9, "memory_bandwidth": 1e9, "link_bandwidth": 1e9,
        "transports": ["tcp"], "queue_depth": 0, "cost_per_hour": 1.0, "models": []
    });
    error("POST", "/v1/nodes", Some("{\"name\": \"x\", "), 400, "bad_request");
    error("POST", "/v1/nodes", Some("[1, 2]"), 400, "bad_request");
    error("POST", "/v1/nodes", Some(&json!({ "name": "x" }).to_string()), 400, "bad_request");
    error("POST", "/v1/nodes", Some(&json!({ "name": "a/b", "inventory": inventory }).to_string()), 400, "bad_request");
    // Found by the control_api fuzz target: a path segment that is not UTF-8 once decoded got
    // axum's plain-text 400, not the API's error body.
    error("DELETE", "/v1/nodes/%931?lease=1", None, 400, "bad_request");
    error("PUT", "/v1/models/%FF", Some("{}"), 400, "bad_request");
    let registered = control.ok("POST", "/v1/nodes", Some(json!({ "name": "x", "inventory": inventory })));
    let lease = registered["lease"].as_u64().unwrap();
    error(
        "POST",
        "/v1/nodes",
        Some(&json!({ "name": "x", "inventory": inventory }).to_string()),
        409,
        "already_registered",
    );
    error("PUT", "/v1/nodes/x/lease", Some(&json!({ "lease": lease + 1 }).to_string()), 409, "stale_lease");
    error("PUT", "/v1/nodes/nobody/lease", Some(&json!({ "lease": lease }).to_string()), 404, "unknown_node");
    error("PUT", "/v1/nodes/x/lease", Some("{\"lease\": -1}"), 400, "bad_request");
    error("PUT", &format!("/v1/models/{}", fingerprint(1)), Some("{\"blocks\": []}"), 400, "no_blocks");
    error("PUT", "/v1/models/xyz", Some("{\"blocks\": [{\"weight_bytes\": 1, \"flops\": 1}]}"), 400, "bad_request");
    error("GET", &format!("/v1/models/{}", fingerprint(2)), None, 404, "unknown_model");
    // A captured graph's annotations are typed: an unknown phase or a negative FLOP count is
    // refused; good ones are kept with the record.
    let graph = |phase: &str, flops: f64| {
        json!({
            "blocks": [{"weight_bytes": 0, "flops": 1}],
            "graph": {"phase": phase, "modality": "text", "operations": 3, "attention": 1, "flops": flops,
                      "weight_bytes": 1, "kv_cache_bytes": 2, "activation_bytes": 3}
        })
        .to_string()
    };
    error("PUT", &format!("/v1/models/{}", fingerprint(5)), Some(&graph("warmup", 1.0)), 400, "bad_request");
    error("PUT", &format!("/v1/models/{}", fingerprint(5)), Some(&graph("decode", -1.0)), 400, "bad_request");
    control.ok(
        "PUT",
        &format!("/v1/models/{}", fingerprint(5)),
        Some(serde_json::from_str(&graph("decode", 2.0)).unwrap()),
    );
    let record = control.ok("GET", &format!("/v1/models/{}", fingerprint(5)), None);
    assert_eq!(
        (record["graph"]["phase"].as_str(), record["graph"]["kv_cache_bytes"].as_u64()),
        (Some("decode"), Some(2))
    );
    let place = |fp: String, policy: &str| json!({ "fingerprint": fp, "policy": policy }).to_string();
    error("POST", "/v1/placements", Some(&place(fingerprint(2), "minimize_latency")), 404, "unknown_model");
    control.describe(&fingerprint(3), 1, 4096, 1.0);
    error("POST", "/v1/placements", Some(&place(fingerprint(3), "fastest")), 400, "bad_request");
    control.describe(&fingerprint(4), 1, 1 << 40, 1.0);
    error("POST", "/v1/placements", Some(&place(fingerprint(4), "load_balance")), 422, "fits_nowhere");
    error("GET", "/v1/nowhere", None, 404, "no_endpoint");
    // Renewal with the right lease works, and leaving ends the lease: no nodes for placement.
    control.ok("PUT", "/v1/nodes/x/lease", Some(json!({ "lease": lease })));
    error("DELETE", "/v1/nodes/x?lease=zero", None, 400, "bad_request");
    control.ok("DELETE", &format!("/v1/nodes/x?lease={lease}"), None);
    control.wait_for_nodes(&[]);
    assert_eq!(control.counter(LEASES_LAPSED), 0, "a node that left counted as lapsed");
    error("POST", "/v1/placements", Some(&place(fingerprint(3), "load_balance")), 503, "no_nodes");
    let (status, metrics) = control.http("GET", "/metrics", None);
    let metrics = metrics.as_str().unwrap_or_default().to_owned();
    assert!(status == 200 && metrics.contains("djinn_control_placement_errors_total 3"), "{metrics}");
}

on_both_stores!(bad_input_gets_clear_errors);

/// A restarted control plane on the embedded store keeps its models, sessions and nodes (the
/// nodes renew the leases they had).
#[test]
fn a_restarted_control_keeps_its_state() {
    let backing = Backing::embedded();
    let mut control = backing.control("127.0.0.1:0");
    let _nodes = three_nodes(&control);
    control.describe(&fingerprint(7), 1, MIB, 1e6);
    let first = control.place(&fingerprint(7), "load_balance", Some("kept"));
    let addr = control.addr().to_owned();
    drop(control);
    control = backing.control(&addr);
    assert_eq!(control.node_names(), ["a", "b", "c"]);
    assert_eq!(control.ok("GET", &format!("/v1/models/{}", fingerprint(7)), None)["blocks"][0]["weight_bytes"], MIB);
    let again = control.place(&fingerprint(7), "minimize_cost", Some("kept"));
    assert_eq!((field(&again, "node"), field(&again, "rule")), (field(&first, "node"), "session"), "{again}");
    // The nodes go on renewing the leases they had: still there after several lease times.
    std::thread::sleep(Duration::from_millis(3000));
    assert_eq!(control.node_names(), ["a", "b", "c"]);
}

/// A node that starts while the control plane's etcd is down (every registration answered 503,
/// or not at all) keeps trying, backing off, and joins once etcd is back; then a restart of
/// etcd while it holds its lease leaves it in the cluster.
#[test]
fn a_node_joins_after_its_control_planes_store_comes_back() {
    let Backing::Etcd(mut etcd) = Backing::etcd() else { unreachable!() };
    let control = Control::start("127.0.0.1:0", &["--etcd", &etcd.url.clone()], "2000ms");
    etcd.kill();
    let node = Node::start("mio", &["--device", "cpu", "--control", &control.url, "--name", "late"]);
    // Refused, or unanswered: the agent tries again, and nothing is admitted without the store.
    control.wait_for_counter("djinn_control_registration_requests_total", 2);
    assert_eq!(control.counter("djinn_control_registrations_total"), 0);
    etcd.start_again();
    control.wait_for_nodes(&["late"]);
    etcd.restart();
    std::thread::sleep(Duration::from_secs(3));
    control.wait_for_nodes(&["late"]);
    let mut client = node.client();
    assert!(client.ping().is_ok(), "the node served throughout");
}

/// Two control processes on one etcd see the same nodes, and a session placed through either
/// gets the same node.
#[test]
fn two_controls_on_one_etcd_agree() {
    let backing = Backing::etcd();
    let one = backing.control("127.0.0.1:0");
    let two = backing.control("127.0.0.1:0");
    let _nodes = three_nodes(&one);
    two.wait_for_nodes(&["a", "b", "c"]);
    for i in 0..10 {
        one.describe(&fingerprint(i), 1, MIB, 1e6);
        let session = format!("s{i}");
        let (first, second) = if i % 2 == 0 { (&one, &two) } else { (&two, &one) };
        let a = first.place(&fingerprint(i), "load_balance", Some(&session));
        let b = second.place(&fingerprint(i), "minimize_cost", Some(&session));
        assert_eq!((field(&a, "node"), field(&b, "rule")), (field(&b, "node"), "session"), "{a} {b}");
    }
    let nodes =
        |c: &Control| c.cluster()["nodes"].as_array().unwrap().iter().map(|n| n["name"].clone()).collect::<Vec<_>>();
    assert_eq!(nodes(&one), nodes(&two));
    assert_eq!(one.cluster()["sessions"], two.cluster()["sessions"]);
}

/// A session opened under a key is placed as calls with that key are; moved to another node,
/// node to node, its record follows it: placements of the key answer the new node.
fn a_moved_sessions_record_follows_it(backing: &Backing) {
    let control = backing.control("127.0.0.1:0");
    let _nodes = three_nodes(&control);
    let addr_of = |name: &str| -> String {
        let cluster = control.cluster();
        let node = cluster["nodes"].as_array().unwrap().iter().find(|n| n["name"] == name).unwrap().clone();
        node["inventory"]["addr"].as_str().unwrap().to_owned()
    };
    let options = ClientOptions { timeout: Some(Duration::from_secs(10)), ..ClientOptions::default() };
    let mut client = ClusterClient::open(&control.url, options, FailoverOptions::default()).expect("the control plane");
    let counter = client.register_model(vec![support::archive("counter").into()], None, None, false, |_, _| {});
    let counter = counter.unwrap().fingerprint;
    let (zeros, zero) = (f32_bytes([0.0f32; 3].into_iter()), i64_bytes(&[0]));
    let state = [
        TensorRef { dtype: DType::F32, shape: &[3], bytes: &zeros },
        TensorRef { dtype: DType::I64, shape: &[], bytes: &zero },
    ];
    let mut session = client.session_open(&counter, &state, 0, Some("agent-9")).expect("open");
    let placed = control.place(&counter.to_hex(), "minimize_cost", Some("agent-9"));
    assert_eq!((addr_of(field(&placed, "node")), field(&placed, "rule")), (session.node.clone(), "session"));

    let to = ["a", "b", "c"].into_iter().map(addr_of).find(|a| *a != session.node).unwrap();
    client.session_move(&mut session, &to).expect("move");
    assert_eq!(session.node, to);
    let placed = control.place(&counter.to_hex(), "load_balance", Some("agent-9"));
    assert_eq!((addr_of(field(&placed, "node")), field(&placed, "rule")), (to, "session"), "{placed}");
    let x = f32_bytes([1.0f32, 2.0, 3.0].into_iter());
    let out = client.session_step(
        &mut session,
        &[Value::Tensor(0)],
        &[TensorRef { dtype: DType::F32, shape: &[3], bytes: &x }],
    );
    assert_eq!(out.expect("a step where it went").tensor_bytes(1), i64_bytes(&[10]));
    // A key never placed has no record to move.
    let (status, answer) = control.http("PUT", "/v1/sessions/nobody", Some(r#"{"addr": "127.0.0.1:1"}"#));
    assert_eq!((status, answer["error"]["kind"].as_str()), (404, Some("unknown_session")), "{answer}");
}

on_both_stores!(a_moved_sessions_record_follows_it);

/// `djinn drain` on the node that holds twenty sessions and four kept tensors while four
/// clients step the sessions: every session goes on elsewhere with the outputs it would have
/// had (no step fails), the model goes node to node, keyed sessions' records follow them, the
/// kept tensors are fetched where they went through their old handles, nothing new is placed
/// on the node, and it ends holding nothing. Once it is killed, the clients go on, and one that
/// did nothing during the drain finds its session and tensor through the control plane.
fn a_drained_nodes_sessions_go_on_elsewhere(backing: &Backing) {
    const CLIENTS: usize = 4;
    const SESSIONS_EACH: usize = 5;
    let control = backing.control("127.0.0.1:0");
    let nodes = three_nodes(&control);
    let options = ClientOptions { timeout: Some(Duration::from_secs(20)), ..ClientOptions::default() };
    let open = || ClusterClient::open(&control.url, options.clone(), FailoverOptions::default()).expect("control");
    let counter = support::archive("counter");
    // Each client registers the model (it goes where the first put it) and opens its sessions
    // there, half of them keyed.
    let clients: Vec<_> = (0..CLIENTS)
        .map(|c| {
            let mut client = open();
            let fp = client.register_model(vec![counter.clone().into()], None, None, false, |_, _| {}).unwrap();
            let fp = fp.fingerprint;
            let (zeros, zero) = (f32_bytes([0.0f32; 3].into_iter()), i64_bytes(&[0]));
            let state = [
                TensorRef { dtype: DType::F32, shape: &[3], bytes: &zeros },
                TensorRef { dtype: DType::I64, shape: &[], bytes: &zero },
            ];
            let sessions: Vec<_> = (0..SESSIONS_EACH)
                .map(|i| {
                    let key = (i % 2 == 0).then(|| format!("client{c}-session{i}"));
                    let session = client.session_open(&fp, &state, 0, key.as_deref()).expect("open");
                    (session, support::Counter::new())
                })
                .collect();
            // And a kept tensor, on the same node.
            let node = client.placement(&fp, None).expect("placed").addr.clone();
            let bytes = f32_bytes((0..1000).map(|i| (c * 1000 + i) as f32));
            let kept = client.keep(Some(&node), TensorRef { dtype: DType::F32, shape: &[1000], bytes: &bytes });
            (client, fp, (sessions, kept.expect("keep"), bytes))
        })
        .collect();
    let victim_model = clients[0].1;
    let victim = clients[0].0.placement(&victim_model, None).expect("placed").clone();
    assert!(clients.iter().all(
        |(_, _, (s, kept, _))| kept.node == victim.addr && s.iter().all(|(session, _)| session.node == victim.addr)
    ));
    let on_victim = nodes.iter().find(|n| n.addr.to_string() == victim.addr).expect("the victim");
    let mut victim_client = on_victim.client();
    assert_eq!(on_victim.stat(&mut victim_client, "sessions"), (CLIENTS * SESSIONS_EACH) as u64);
    assert_eq!(on_victim.stat(&mut victim_client, "handles"), CLIENTS as u64);

    // And a client that does nothing while the node is drained: it asks for its session and
    // its tensor only once the node is gone.
    let mut idle = open();
    let (zeros, zero) = (f32_bytes([0.0f32; 3].into_iter()), i64_bytes(&[0]));
    let state = [
        TensorRef { dtype: DType::F32, shape: &[3], bytes: &zeros },
        TensorRef { dtype: DType::I64, shape: &[], bytes: &zero },
    ];
    let mut idle_session = idle.session_open_on(&victim.addr, &victim_model, &state, 0).expect("open");
    let idle_bytes = f32_bytes((0..64).map(|i| i as f32));
    let idle_kept = idle.keep(Some(&victim.addr), TensorRef { dtype: DType::F32, shape: &[64], bytes: &idle_bytes });
    let idle_kept = idle_kept.expect("keep");
    let sessions_on_victim = (CLIENTS * SESSIONS_EACH + 1) as u64;

    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let workers: Vec<_> = clients
        .into_iter()
        .map(|(mut client, _, (mut sessions, kept, bytes))| {
            let stop = stop.clone();
            std::thread::spawn(move || {
                // Until two rounds after the drain ended: each session steps on its new node.
                let (mut rounds, mut until) = (0, usize::MAX);
                while rounds < until {
                    for (session, counter) in &mut sessions {
                        let x = counter.input();
                        let t = [TensorRef { dtype: DType::F32, shape: &[3], bytes: &x }];
                        let out = client.session_step(session, &[Value::Tensor(0)], &t);
                        counter.check(&out.unwrap_or_else(|e| panic!("a step during the drain failed: {e}")));
                    }
                    rounds += 1;
                    if until == usize::MAX && stop.load(std::sync::atomic::Ordering::Relaxed) {
                        until = rounds + 2;
                    }
                }
                // The kept tensor moved too: its handle at the drained node leads to it.
                assert_eq!(client.fetch(&kept).expect("the kept tensor where it went").bytes(), bytes);
                (client, sessions, (kept, bytes), rounds)
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(300));

    let drained = std::process::Command::new(env!("CARGO_BIN_EXE_djinn"))
        .args(["drain", &victim.node, "--control", &control.url, "--timeout", "30"])
        .output()
        .expect("djinn drain");
    let printed = String::from_utf8_lossy(&drained.stdout);
    assert!(drained.status.success(), "{printed}{}", String::from_utf8_lossy(&drained.stderr));
    assert!(printed.contains("is drained: it holds nothing"), "{printed}");
    // Nothing new is placed on a draining node.
    for i in 0..8 {
        control.describe(&fingerprint(100 + i), 1, MIB, 1e6);
        let placed = control.place(&fingerprint(100 + i), "load_balance", None);
        assert_ne!(field(&placed, "node"), victim.node, "{placed}");
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let mut survivors = Vec::new();
    for worker in workers {
        let (client, sessions, kept, rounds) = worker.join().expect("a client failed");
        assert!(rounds >= 4, "{rounds} rounds");
        for (session, _) in &sessions {
            assert_ne!(session.node, victim.addr, "a session still on the drained node");
            if let Some(key) = &session.key {
                let placed = control.place(&session.fingerprint.to_hex(), "load_balance", Some(key));
                assert_eq!(field(&placed, "rule"), "session", "{placed}");
                assert_ne!(field(&placed, "node"), victim.node, "{key}'s record did not follow it: {placed}");
            }
        }
        survivors.push((client, sessions, kept));
    }
    assert_eq!(on_victim.stat(&mut victim_client, "sessions"), 0);
    assert_eq!(on_victim.stat(&mut victim_client, "sessions_moved_out"), sessions_on_victim);
    assert_eq!(on_victim.stat(&mut victim_client, "handles"), 0);
    assert_eq!(on_victim.stat(&mut victim_client, "handles_moved_out"), CLIENTS as u64 + 1);
    // The model's calls are placed where it went, which holds it.
    let placed = control.place(&victim_model.to_hex(), "load_balance", None);
    assert_ne!(field(&placed, "node"), victim.node, "{placed}");
    let there = nodes.iter().find(|n| n.addr.to_string() == field(&placed, "addr")).expect("a node");
    let deadline = Instant::now() + Duration::from_secs(10);
    while !there.client().list_models().unwrap().iter().any(|m| m.fingerprint == victim_model) {
        assert!(Instant::now() < deadline, "the model did not reach {placed}");
        std::thread::sleep(Duration::from_millis(50));
    }
    let status = control.ok("GET", &format!("/v1/nodes/{}/drain", victim.node), None);
    assert_eq!((status["draining"].as_bool(), status["drained"].as_bool()), (Some(true), Some(true)), "{status}");
    // The node can be given work again.
    control.ok("DELETE", &format!("/v1/nodes/{}/drain", victim.node), None);
    let (code, answer) = control.http("POST", "/v1/nodes/nobody/drain", Some(""));
    assert_eq!((code, answer["error"]["kind"].as_str()), (404, Some("unknown_node")), "{answer}");
    // The drained node goes: what its clients followed goes on without it.
    // SAFETY: kill(2) on a child of this process, reaped when `nodes` is dropped.
    unsafe { libc::kill(on_victim.pid(), libc::SIGKILL) };
    for (mut client, mut sessions, (kept, bytes)) in survivors {
        for (session, counter) in &mut sessions {
            let x = counter.input();
            let t = [TensorRef { dtype: DType::F32, shape: &[3], bytes: &x }];
            counter.check(&client.session_step(session, &[Value::Tensor(0)], &t).expect("a step without the node"));
        }
        assert_eq!(client.fetch(&kept).expect("the kept tensor without the node").bytes(), bytes);
    }
    // The idle client finds its session and its tensor through the control plane.
    let mut counter = support::Counter::new();
    let x = counter.input();
    let t = [TensorRef { dtype: DType::F32, shape: &[3], bytes: &x }];
    counter.check(&idle.session_step(&mut idle_session, &[Value::Tensor(0)], &t).expect("the idle session"));
    assert_ne!(idle_session.node, victim.addr);
    assert_eq!(idle.fetch(&idle_kept).expect("the idle tensor").bytes(), idle_bytes);
}

on_both_stores!(a_drained_nodes_sessions_go_on_elsewhere);

/// Two control processes on one etcd, and nodes and a client given both: killing either
/// (SIGKILL) in the middle of a workload loses no request, no node's lease lapses, and
/// placements (and a model's description) go on through the other; then the same with the
/// other, once the first is back.
#[test]
fn either_of_two_control_processes_may_die() {
    let backing = Backing::etcd();
    let mut controls = [backing.control("127.0.0.1:0"), backing.control("127.0.0.1:0")];
    let both = format!("{},{}", controls[0].url, controls[1].url);
    let _nodes: Vec<Node> = ["a", "b"]
        .into_iter()
        .map(|name| {
            let args = ["--device", "cpu", "--control", &both, "--name", name, "--flops", "1e11"];
            Node::start("mio", &[&args[..], &["--host-to-device", "1e10", "--device-memory-budget", "256MiB"]].concat())
        })
        .collect();
    for control in &controls {
        control.wait_for_nodes(&["a", "b"]);
    }
    let leases = |c: &Control| -> Vec<(String, u64)> {
        let cluster = c.cluster();
        let nodes = cluster["nodes"].as_array().unwrap();
        nodes.iter().map(|n| (n["name"].as_str().unwrap().to_owned(), n["lease"].as_u64().unwrap())).collect()
    };
    let held = leases(&controls[0]);
    assert_eq!(held, leases(&controls[1]));

    let options = ClientOptions { timeout: Some(Duration::from_secs(10)), ..ClientOptions::default() };
    let mut client = ClusterClient::open(&both, options, FailoverOptions::default()).expect("the control plane");
    let halves = client.register_model(vec![support::archive("halves").into()], None, None, false, |_, _| {});
    let halves = halves.unwrap().fingerprint;
    // Every request checked; each fifth under a new session key, which the control plane places.
    let work = |client: &mut ClusterClient, round: usize, requests: std::ops::Range<u64>| {
        for i in requests {
            let session = format!("agent-{round}-{}", i / 5);
            run_halves(client, &halves, Some(&session), i).unwrap_or_else(|e| panic!("request {i}: {e}"));
        }
    };
    let ttl = Duration::from_millis(backing.lease_ttl_ms());
    for victim in [0, 1] {
        let survivor = 1 - victim;
        work(&mut client, victim, 0..50);
        let placements = client.stats().0.placements;
        controls[victim].kill();
        work(&mut client, victim, 50..200);
        assert!(client.stats().0.placements >= placements + 30, "placements went on");
        let mlp = client.register_model(vec![support::archive("mlp").into()], None, None, false, |_, _| {});
        mlp.unwrap_or_else(|e| panic!("a model described and placed through the survivor: {e}"));
        // Several lease times later the nodes are there under the leases they had.
        std::thread::sleep(3 * ttl);
        assert_eq!(leases(&controls[survivor]), held, "a lease lapsed");
        let addr = controls[victim].addr().to_owned();
        controls[victim] = backing.control(&addr);
        controls[victim].wait_for_nodes(&["a", "b"]);
        assert_eq!(leases(&controls[victim]), held);
    }
}

/// A node serves its counters as Prometheus text; so does the control plane.
#[test]
fn nodes_and_control_serve_metrics() {
    let backing = Backing::embedded();
    let control = backing.control("127.0.0.1:0");
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    let _node =
        Node::start("mio", &["--device", "cpu", "--device-memory-budget", "64MiB", "--metrics-listen", &listen]);
    let deadline = Instant::now() + Duration::from_secs(10);
    let text = loop {
        match ureq::get(&format!("http://{listen}/metrics")).call() {
            Ok(mut response) => break response.body_mut().read_to_string().unwrap(),
            Err(e) => assert!(Instant::now() < deadline, "no /metrics on {listen}: {e}"),
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(text.contains("# TYPE djinn_node_frames_in_total counter\n"), "{text}");
    assert!(text.contains(&format!("djinn_node_budget_limit_bytes {}\n", 64 * MIB)), "{text}");
    let (status, text) = control.http("GET", "/metrics", None);
    assert!(status == 200 && text.as_str().unwrap().contains("djinn_control_nodes 0\n"), "{text}");
}

/// A workload through the cluster client: a node SIGKILLed while it serves; its lease lapses,
/// the client is placed again, registers the models there from the bytes it kept and replays
/// what failed. All 1000 requests come back correct.
fn a_workload_survives_a_killed_node(backing: &Backing) {
    let control = backing.control("127.0.0.1:0");
    let nodes = three_nodes(&control);
    // A bare HOST:PORT that serves HTTP is a control plane.
    let options = ClientOptions { timeout: Some(Duration::from_secs(10)), ..ClientOptions::default() };
    let failover = FailoverOptions { deadline: Duration::from_secs(20), ..FailoverOptions::default() };
    let mut client = ClusterClient::open(control.addr(), options, failover).expect("the control plane");
    assert!(matches!(client.target(), Target::Control(_)));

    let halves = client.register_model(vec![support::archive("halves").into()], None, None, false, |_, _| {}).unwrap();
    let halves = halves.fingerprint;
    let mlp = client.register_model(vec![support::archive("mlp").into()], None, None, false, |_, _| {}).unwrap();
    let mlp = mlp.fingerprint;
    let victim = client.placement(&halves, None).expect("placed").clone();
    // The MLP's outputs for four inputs, computed once; every node runs the same libtorch.
    let mlp_inputs: Vec<Vec<u8>> =
        (0..4).map(|i| f32_bytes((0..256).map(|j| ((i * 256 + j) % 17) as f32 / 8.0))).collect();
    let run_mlp = |client: &mut ClusterClient, x: &[u8]| {
        let input = TensorRef { dtype: DType::F32, shape: &[1, 256], bytes: x };
        client.execute(&mlp, None, &[Value::Tensor(0)], &[input]).map(|out| out.tensor_bytes(0).to_vec())
    };
    let mlp_outputs: Vec<Vec<u8>> = mlp_inputs.iter().map(|x| run_mlp(&mut client, x).unwrap()).collect();

    let done = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let index = nodes.iter().position(|n| n.addr.to_string() == victim.addr).expect("the victim");
    let killer = {
        let (done, pid) = (done.clone(), nodes[index].pid());
        std::thread::spawn(move || {
            while done.load(std::sync::atomic::Ordering::Relaxed) < 300 {
                std::thread::yield_now();
            }
            // SAFETY: kill(2) on a child of this process, reaped when `nodes` is dropped.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        })
    };
    let lapsed = control.counter(LEASES_LAPSED);
    let mut slowest = Duration::ZERO;
    for i in 0..1000u64 {
        let started = Instant::now();
        if i % 10 == 0 {
            let k = (i / 10 % 4) as usize;
            assert_eq!(run_mlp(&mut client, &mlp_inputs[k]).unwrap(), mlp_outputs[k], "request {i}");
        } else {
            // Every fourth request belongs to a session: it stays on one node while that lives.
            let session = (i % 4 == 0).then_some("agent-1");
            run_halves(&mut client, &halves, session, i).unwrap();
        }
        slowest = slowest.max(started.elapsed());
        done.store(i as usize + 1, std::sync::atomic::Ordering::Relaxed);
    }
    killer.join().unwrap();
    let (stats, _, _, _) = client.stats();
    let placed = client.placement(&halves, None).expect("placed again");
    assert_ne!(placed.node, victim.node, "{stats:?}");
    assert!(stats.node_failures >= 1 && stats.reregistrations >= 1 && stats.replays >= 1, "{stats:?}");
    // The victim went as its lease lapsed (how long a request waited for that is the
    // benchmarks' business: printed, not asserted).
    let rest: Vec<&str> = ["a", "b", "c"].into_iter().filter(|n| *n != victim.node).collect();
    control.wait_for_nodes(&rest);
    assert_eq!(control.counter(LEASES_LAPSED), lapsed + 1, "lapses counted");
    let ttl = Duration::from_millis(backing.lease_ttl_ms());
    println!("failover: {stats:?}; slowest request {slowest:?} (lease {ttl:?})");
}

on_both_stores!(a_workload_survives_a_killed_node);

/// Request `i` of `halves` (x → 2x, idx → idx + 1) under `session`, its outputs checked.
fn run_halves(
    client: &mut ClusterClient,
    halves: &djinn_client::Fingerprint,
    session: Option<&str>,
    i: u64,
) -> Result<(), djinn_client::ClusterError> {
    let x: Vec<f32> = (0..64).map(|j| (i * 64 + j) as f32).collect();
    let idx: Vec<i64> = (0..8).map(|j| (i * 8 + j) as i64).collect();
    let (xb, ib) = (f32_bytes(x.iter().copied()), i64_bytes(&idx));
    let tensors = [
        TensorRef { dtype: DType::F32, shape: &[64], bytes: &xb },
        TensorRef { dtype: DType::I64, shape: &[8], bytes: &ib },
    ];
    let out = client.execute(halves, session, &[Value::Tensor(0), Value::Tensor(1)], &tensors)?;
    assert_eq!(out.tensor_bytes(0), f32_bytes(x.iter().map(|v| v * 2.0)), "request {i}");
    assert_eq!(out.tensor_bytes(1), i64_bytes(&idx.iter().map(|v| v + 1).collect::<Vec<_>>()), "request {i}");
    Ok(())
}

fn f32_bytes(values: impl Iterator<Item = f32>) -> Vec<u8> {
    values.flat_map(f32::to_le_bytes).collect()
}

fn i64_bytes(values: &[i64]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// `djinn up` is a control plane and a node in one process: a client placed through it runs
/// there; `djinn status` shows the node and the model; SIGTERM stops both cleanly.
#[test]
fn djinn_up_serves_a_cluster_of_one() {
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("control.redb").display().to_string();
    let mut command = Command::new(env!("CARGO_BIN_EXE_djinn"));
    command.args(["up", "--listen", "127.0.0.1:0", "--control-listen", "127.0.0.1:0", "--store", &store]);
    command.args(["--device", "cpu", "--device-memory-budget", "64MiB", "--name", "solo", "--log", "warn"]);
    let (mut up, addrs) =
        support::spawn_announcing(command, &["djinn control listening on ", "djinn node listening on "]);
    let control = Control::served_at(&addrs[0]);
    control.wait_for_nodes(&["solo"]);
    assert_eq!(control.cluster()["nodes"][0]["inventory"]["addr"], json!(addrs[1]));

    let mut client = ClusterClient::open(&control.url, ClientOptions::default(), FailoverOptions::default()).unwrap();
    let halves = client.register_model(vec![support::archive("halves").into()], None, None, false, |_, _| {}).unwrap();
    let x = f32_bytes([1.5f32, -2.0].into_iter());
    let idx = i64_bytes(&[41]);
    let tensors = [
        TensorRef { dtype: DType::F32, shape: &[2], bytes: &x },
        TensorRef { dtype: DType::I64, shape: &[1], bytes: &idx },
    ];
    let out = client.execute(&halves.fingerprint, None, &[Value::Tensor(0), Value::Tensor(1)], &tensors).unwrap();
    assert_eq!(
        (out.tensor_bytes(0), out.tensor_bytes(1)),
        (&f32_bytes([3.0f32, -4.0].into_iter())[..], &i64_bytes(&[42])[..])
    );

    let status = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_djinn"))
            .args(["status", "--control", &addrs[0]])
            .args(args)
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stdout).unwrap()
    };
    let table = status(&[]);
    let fingerprint = halves.fingerprint.to_string();
    assert!(table.contains(&addrs[1]) && table.contains("solo") && table.contains("64.0 MiB"), "{table}");
    assert!(table.lines().any(|l| l.starts_with(&fingerprint[..16]) && l.ends_with("solo")), "{table}");
    assert!(
        table.lines().any(|l| l.contains("solo") && l.ends_with("in the node")),
        "kernels run in the node: {table}"
    );
    let parsed: Json = serde_json::from_str(&status(&["--json"])).unwrap();
    assert_eq!(parsed["models"][0]["fingerprint"], json!(fingerprint));

    // SAFETY: kill(2) on our own child's pid.
    unsafe { libc::kill(up.id() as i32, libc::SIGTERM) };
    let deadline = Instant::now() + Duration::from_secs(10);
    let exit = loop {
        if let Some(exit) = up.try_wait().unwrap() {
            break exit;
        }
        assert!(Instant::now() < deadline, "djinn up ignored SIGTERM");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(exit.success(), "{exit:?}");
    let out = Command::new(env!("CARGO_BIN_EXE_djinn")).args(["status", "--control", &addrs[0]]).output().unwrap();
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("unreachable"));
}

/// `djinn control` over TLS with a certificate made in `dir`, and `extra` flags: the process,
/// its address, the certificate's path and its PEM.
fn tls_control(dir: &std::path::Path, extra: &[&str]) -> (support::Killed, String, std::path::PathBuf, Vec<u8>) {
    let (cert, key) = support::self_signed_certificate(dir, "control");
    let mut command = Command::new(env!("CARGO_BIN_EXE_djinn"));
    command.args(["control", "--listen", "127.0.0.1:0", "--log", "error", "--store"]).arg(dir.join("control.redb"));
    command.arg("--tls-cert").arg(&cert).arg("--tls-key").arg(&key).args(extra);
    let (child, addr) = support::spawn_listening(command, "djinn control listening on ");
    let pem = std::fs::read(&cert).unwrap();
    (support::Killed(child), addr, cert, pem)
}

#[test]
fn with_a_certificate_the_api_is_served_over_tls_only() {
    let dir = tempfile::tempdir().unwrap();
    let (_control, addr, cert_path, cert) = tls_control(dir.path(), &[]);
    let url = format!("https://{addr}");
    let timeout = Duration::from_secs(5);

    let trusted = djinn_client::ControlClient::with_roots(&url, timeout, &cert).unwrap();
    assert!(trusted.cluster().expect("over TLS, trusting the certificate").contains("\"nodes\""));
    let untrusted = djinn_client::ControlClient::new(&url, timeout).cluster().unwrap_err();
    assert!(matches!(untrusted, djinn_client::ControlError::Unreachable { .. }), "{untrusted}");
    assert!(untrusted.to_string().contains("UnknownIssuer"), "{untrusted}");
    let plain = djinn_client::ControlClient::new(&format!("http://{addr}"), timeout).cluster();
    assert!(plain.is_err(), "plain HTTP gets no answer from the TLS port");
    let bad_ca = djinn_client::ControlClient::with_roots(&url, timeout, b"not a certificate");
    assert!(bad_ca.is_err());

    // A node joins over HTTPS, trusting the certificate through DJINN_CONTROL_CA.
    let mut node = Command::new(env!("CARGO_BIN_EXE_djinn"));
    node.args(["node", "--listen", "127.0.0.1:0", "--log", "error", "--control", &url, "--flops", "1e12"])
        .args(["--memory-bandwidth", "1e11", "--host-to-device", "1e10"])
        .env(djinn_client::CA_ENV, &cert_path);
    let (node, node_addr) = support::spawn_listening(node, "djinn node listening on ");
    let _node = support::Killed(node);
    let deadline = Instant::now() + Duration::from_secs(20);
    while !trusted.cluster().unwrap().contains(&node_addr) {
        assert!(Instant::now() < deadline, "the node did not join over TLS");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// What a connection to the API holds is bounded: past --max-connections (authenticated
/// connections) a request is refused (503) and its connection closed, while an unauthenticated
/// connection waits apart from them; one that sends no whole request head in time (silent or
/// trickling before it authenticated: 3 s at most, here --header-timeout; idle after an answer:
/// --header-timeout) is closed; a body that does not come within --request-timeout gets a 408;
/// and the API serves throughout. Its /metrics counts each, by cause.
#[test]
fn the_apis_connections_are_bounded_and_timed_out() {
    use std::io::Write;
    use std::net::TcpStream;
    // Long enough that the four connections that fill the cap are still open when the fifth
    // asks, however loaded the machine.
    const HEADER_TIMEOUT: Duration = Duration::from_secs(2);
    const REQUEST_TIMEOUT: Duration = Duration::from_millis(1500);
    const REFUSED: &str = "djinn_control_connections_refused_total";
    const HEADER_TIMEOUTS: &str = "djinn_control_connections_header_timeouts_total";
    const IDLE_CLOSED: &str = "djinn_control_connections_idle_closed_total";
    const REQUEST_TIMEOUTS: &str = "djinn_control_request_timeouts_total";
    const WHOAMI: &[u8] = b"GET /v1/whoami HTTP/1.1\r\nHost: control\r\n\r\n";
    // A timeout closes a connection no sooner than the timeout after the test last wrote to it
    // (less a little: a timer's deadline is rounded to its tick), and well before the defaults
    // (10 s for a head, 30 s for a request): within 5 s past it, which only a process starved
    // for that long misses.
    let by_timeout = |timeout: Duration| timeout - Duration::from_millis(50)..timeout + Duration::from_secs(5);
    let dir = tempfile::tempdir().unwrap();
    let mut command = Command::new(env!("CARGO_BIN_EXE_djinn"));
    command
        .args(["control", "--listen", "127.0.0.1:0", "--log", "error", "--max-connections", "4"])
        .args(["--header-timeout", &format!("{}ms", HEADER_TIMEOUT.as_millis())])
        .args(["--request-timeout", &format!("{}ms", REQUEST_TIMEOUT.as_millis()), "--store"])
        .arg(dir.path().join("control.redb"));
    let (child, addr) = support::spawn_listening(command, "djinn control listening on ");
    let control = Control { child: Some(child), url: format!("http://{addr}") };

    // Four connections that had an answer (without tokens a whole request head authenticates)
    // fill the cap: a fifth's request is refused at once, and a silent connection beside them
    // waits in the unauthenticated pool until its time to authenticate has passed; the four
    // are closed once idle for the header timeout. (Nothing else may connect meanwhile.)
    let mut held: Vec<(TcpStream, Instant)> = (0..4)
        .map(|_| {
            let mut stream = TcpStream::connect(&addr).unwrap();
            stream.write_all(WHOAMI).unwrap();
            let answer = read_response(&mut stream);
            assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
            (stream, Instant::now())
        })
        .collect();
    let mut silent = TcpStream::connect(&addr).unwrap();
    let silent_opened = Instant::now();
    let mut fifth = TcpStream::connect(&addr).unwrap();
    fifth.write_all(WHOAMI).unwrap();
    let refused = support::read_until_closed(&mut fifth, "the fifth");
    assert!(refused.starts_with("HTTP/1.1 503") && refused.contains("too_many_connections"), "{refused}");
    assert_eq!(support::read_until_closed(&mut silent, "a silent connection"), "", "closed without an answer");
    let silent_for = silent_opened.elapsed();
    assert!(
        by_timeout(HEADER_TIMEOUT).contains(&silent_for),
        "closed after {silent_for:?}: not in time to authenticate"
    );
    for (stream, answered) in &mut held {
        assert_eq!(support::read_until_closed(stream, "an idle connection"), "", "idle: closed without more");
        let idle_for = answered.elapsed();
        assert!(by_timeout(HEADER_TIMEOUT).contains(&idle_for), "closed {idle_for:?} after its answer");
    }
    control.wait_for_counter(IDLE_CLOSED, 4);
    assert_eq!((control.counter(REFUSED), control.counter(HEADER_TIMEOUTS)), (1, 1), "the fifth refused");
    assert!(control.cluster()["nodes"].is_array(), "served once they went");

    // Idle after an answer.
    let mut idle = TcpStream::connect(&addr).unwrap();
    let asked = Instant::now();
    idle.write_all(WHOAMI).unwrap();
    let exchange = support::read_until_closed(&mut idle, "an idle connection");
    let idle_for = asked.elapsed();
    assert!(exchange.starts_with("HTTP/1.1 200"), "{exchange}");
    assert!(by_timeout(HEADER_TIMEOUT).contains(&idle_for), "closed {idle_for:?} after the request");
    control.wait_for_counter(IDLE_CLOSED, 5);
    assert_eq!(control.counter(HEADER_TIMEOUTS), 1, "an idle connection counted as one slow to send its head");

    // A head trickled a byte at a time, and a body that never comes, beside requests served.
    let trickled_to = addr.clone();
    let trickled = std::thread::spawn(move || {
        let started = Instant::now();
        let mut stream = TcpStream::connect(&trickled_to).unwrap();
        let deadline = Instant::now() + Duration::from_secs(60);
        let head = b"GET /v1/cluster HTTP/1.1\r\nHost: control\r\nX-Slow: ".iter().chain(std::iter::repeat(&b'a'));
        // Until the API closes the connection (a write after that fails).
        for byte in head {
            if stream.write_all(&[*byte]).is_err() {
                break;
            }
            assert!(Instant::now() < deadline, "a trickled head kept its connection open");
            std::thread::sleep(Duration::from_millis(50));
        }
        started.elapsed()
    });
    let mut slow_body = TcpStream::connect(&addr).unwrap();
    let head =
        "PUT /v1/models/00 HTTP/1.1\r\nHost: control\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{";
    let sent = Instant::now();
    slow_body.write_all(head.as_bytes()).unwrap();
    for _ in 0..10 {
        assert!(control.cluster()["nodes"].is_array());
        std::thread::sleep(Duration::from_millis(50));
    }
    let exchange = support::read_until_closed(&mut slow_body, "a body that never came");
    let answered_after = sent.elapsed();
    assert!(exchange.starts_with("HTTP/1.1 408"), "{exchange}");
    assert!(exchange.contains("request_timeout"), "{exchange}");
    assert!(by_timeout(REQUEST_TIMEOUT).contains(&answered_after), "a 408 after {answered_after:?}");
    let trickling = trickled.join().unwrap();
    assert!(by_timeout(HEADER_TIMEOUT).contains(&trickling), "a trickled head closed after {trickling:?}");
    control.wait_for_counter(HEADER_TIMEOUTS, 2);
    let counted = [REFUSED, HEADER_TIMEOUTS, IDLE_CLOSED, REQUEST_TIMEOUTS].map(|name| control.counter(name));
    assert_eq!(counted, [1, 2, 5, 1], "refused, header timeouts, idle, request timeouts");
}

/// One answer on `stream`, its head and its body (by its Content-Length); the connection stays
/// open.
fn read_response(stream: &mut std::net::TcpStream) -> String {
    use std::io::Read;
    stream.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let mut received = Vec::new();
    let mut byte = [0u8; 1];
    while !received.ends_with(b"\r\n\r\n") {
        stream.read_exact(&mut byte).expect("an answer's head");
        received.push(byte[0]);
    }
    let head = String::from_utf8_lossy(&received).to_ascii_lowercase();
    let length = head.lines().find_map(|l| l.strip_prefix("content-length:")?.trim().parse().ok()).unwrap_or(0);
    let mut body = vec![0u8; length];
    stream.read_exact(&mut body).expect("an answer's body");
    received.extend_from_slice(&body);
    String::from_utf8_lossy(&received).into_owned()
}

const ALICE: &str = "alice-token-0123456789";
const BOB: &str = "bob-token-0123456789ab";
/// Shared by the nodes that use it.
const NODES: &str = "node-token-0123456789a";
/// Node `b`'s own principal, named as it.
const NODE_B: &str = "node-b-token-012345678";
const OPS: &str = "ops-token-0123456789ab";

/// `djinn control` with a token file of tenants `alice` and `bob`, node principals `nodes`
/// (shared) and `b`, and operator `ops`, and `extra` flags.
fn control_with_tokens(dir: &std::path::Path, extra: &[&str]) -> Control {
    let file = dir.join("tokens.json");
    let principals = json!({ "principals": [
        { "name": "alice", "tokens": [ALICE] },
        { "name": "bob", "tokens": [BOB] },
        { "name": "nodes", "role": "node", "tokens": [NODES] },
        { "name": "b", "role": "node", "tokens": [NODE_B] },
        { "name": "ops", "role": "admin", "tokens": [OPS] },
    ]});
    std::fs::write(&file, principals.to_string()).unwrap();
    let mut command = Command::new(env!("CARGO_BIN_EXE_djinn"));
    command.args(["control", "--listen", "127.0.0.1:0", "--log", "error", "--store"]).arg(dir.join("control.redb"));
    command.arg("--auth-file").arg(&file).args(extra);
    let (child, addr) = support::spawn_listening(command, "djinn control listening on ");
    Control { child: Some(child), url: format!("http://{addr}") }
}

impl Control {
    /// `(status, body as JSON)` of a request with `token`, on a connection of its own; a hang
    /// guard of 20 s.
    fn http_as(&self, token: &str, method: &str, path: &str, body: Option<&Json>) -> (u16, Json) {
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_global(Some(Duration::from_secs(20)))
            .build()
            .into();
        let request = ureq::http::Request::builder()
            .method(method)
            .uri(format!("{}{path}", self.url))
            .header("Authorization", format!("Bearer {token}"))
            .header("Content-Type", "application/json");
        let body = body.map(Json::to_string).unwrap_or_default();
        let mut response = agent.run(request.body(body).unwrap()).unwrap_or_else(|e| panic!("{method} {path}: {e}"));
        let status = response.status().as_u16();
        let text = response.body_mut().read_to_string().expect("body");
        (status, if text.is_empty() { Json::Null } else { serde_json::from_str(&text).unwrap_or(Json::String(text)) })
    }

    /// The sample `name` of /metrics, asked by operator `ops`.
    fn metric_as_ops(&self, name: &str) -> u64 {
        let (status, text) = self.http_as(OPS, "GET", "/metrics", None);
        let text = text.as_str().unwrap_or_default();
        assert_eq!(status, 200, "{text}");
        let value = text.lines().find_map(|line| line.strip_prefix(name)?.strip_prefix(' '));
        value.and_then(|v| v.parse().ok()).unwrap_or_else(|| panic!("no sample {name} in {text}"))
    }
}

/// A node's inventory, serving at `addr`.
fn inventory(addr: &str) -> Json {
    json!({
        "addr": addr, "device": "cpu", "memory_total": 1 << 30, "memory_free": 1 << 30,
        "host_memory_free": 1 << 30, "host_to_device": 1e9, "flops": 1e9, "memory_bandwidth": 1e9,
        "link_bandwidth": 1e9, "transports": ["tcp"], "queue_depth": 0, "cost_per_hour": 1.0, "models": []
    })
}

/// Raises this process's soft limit on open files to `want` (within its hard limit).
fn raise_open_files(want: u64) {
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: a valid rlimit to read into and to write from.
    unsafe {
        assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit), 0);
        if limit.rlim_cur < want {
            limit.rlim_cur = want.min(limit.rlim_max);
            assert_eq!(libc::setrlimit(libc::RLIMIT_NOFILE, &limit), 0);
        }
    }
    assert!(limit.rlim_cur >= want, "open files: {} at most, {want} wanted", limit.rlim_max);
}

/// Idle connections to `to`, `count` of them spread over the addresses `sources`, each opened
/// (and opened again soon after the API closes it) at most
/// [`Self::OPEN_PER_ROUND`] a round (the tests beside this one have a machine of two cores to
/// share), until dropped. They never send a byte.
struct Flood {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Flood {
    const OPEN_PER_ROUND: usize = 100;
    const ROUND: Duration = Duration::from_millis(50);

    fn start(to: std::net::SocketAddr, sources: Vec<std::net::IpAddr>, count: usize) -> Self {
        use std::io::{ErrorKind, Read};
        use std::sync::atomic::Ordering;
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let stopped = std::sync::Arc::clone(&stop);
        let thread = std::thread::spawn(move || {
            let mut open: Vec<Option<std::net::TcpStream>> = (0..count).map(|_| None).collect();
            let mut buf = [0u8; 64];
            while !stopped.load(Ordering::Relaxed) {
                let mut opened = 0;
                for (i, slot) in open.iter_mut().enumerate() {
                    let closed = match slot {
                        None => true,
                        Some(stream) => match stream.read(&mut buf) {
                            Ok(n) => n == 0,
                            Err(e) => !matches!(
                                e.kind(),
                                ErrorKind::WouldBlock | ErrorKind::NotConnected | ErrorKind::Interrupted
                            ),
                        },
                    };
                    if closed {
                        *slot = None;
                        if opened < Self::OPEN_PER_ROUND {
                            *slot = connect_from(sources[i % sources.len()], to);
                            opened += 1;
                        }
                    }
                }
                std::thread::sleep(Self::ROUND);
            }
        });
        Self { stop, thread: Some(thread) }
    }
}

impl Drop for Flood {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// A connection from `source` to `to`, its connect begun (not waited for).
fn connect_from(source: std::net::IpAddr, to: std::net::SocketAddr) -> Option<std::net::TcpStream> {
    let socket = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).ok()?;
    socket.set_nonblocking(true).ok()?;
    socket.bind(&std::net::SocketAddr::new(source, 0).into()).ok()?;
    match socket.connect(&to.into()) {
        Ok(()) => {}
        Err(e) if e.raw_os_error() == Some(libc::EINPROGRESS) => {}
        Err(_) => return None,
    }
    Some(socket.into())
}

/// 2,000 unauthenticated idle connections, from one source and then from 25, kept open again as
/// the API closes them, lock out neither a tenant (its requests, each on a new connection) nor
/// a node (its registration and lease renewals): the unauthenticated pool is bounded per source
/// and overall, a full pool makes room by closing the oldest connection of the source that
/// holds the most, and authenticated connections are counted apart.
#[test]
fn an_unauthenticated_flood_locks_out_neither_tenants_nor_nodes() {
    const FLOOD: usize = 2000;
    const EVICTED: &str = "djinn_control_connections_unauthenticated_evicted_total";
    const UNAUTHENTICATED: &str = "djinn_control_connections_unauthenticated";
    // The flood's sockets and the test's own.
    raise_open_files(FLOOD as u64 + 1024);
    let dir = tempfile::tempdir().unwrap();
    // Long enough that the lease outlives the waits between renewals, however loaded the
    // machine: what is tested is that each renewal is answered.
    let control = control_with_tokens(dir.path(), &["--lease-ttl", "60s"]);
    let server: std::net::SocketAddr = control.addr().parse().unwrap();
    let loopback = |last: u8| std::net::IpAddr::V4(std::net::Ipv4Addr::new(127, 0, 0, last));
    let (status, registered) = control.http_as(
        NODES,
        "POST",
        "/v1/nodes",
        Some(&json!({ "name": "n1", "inventory": inventory("127.0.0.1:1") })),
    );
    assert_eq!(status, 201, "{registered}");
    let lease = registered["lease"].as_u64().unwrap();
    // What the flood may hold: 32 connections per source, 256 in all.
    for (floods, sources, held) in
        [("one source", vec![loopback(2)], 32), ("25 sources", (2..=26).map(loopback).collect(), 256)]
    {
        let evicted_before = control.metric_as_ops(EVICTED);
        let _flood = Flood::start(server, sources, FLOOD);
        // Until the flood presses on the pool: it has filled what it may hold, and most of its
        // connections have made room for others.
        let deadline = Instant::now() + Duration::from_secs(60);
        while control.metric_as_ops(UNAUTHENTICATED) < held
            || control.metric_as_ops(EVICTED) < evicted_before + FLOOD as u64 / 2
        {
            assert!(Instant::now() < deadline, "{floods}: the flood did not fill the pool");
            std::thread::sleep(Duration::from_millis(20));
        }
        for i in 0..10 {
            let fingerprint = fingerprint(1000 + i);
            let record = json!({ "blocks": [{ "weight_bytes": MIB, "flops": 1e9 }] });
            let (status, answer) = control.http_as(ALICE, "PUT", &format!("/v1/models/{fingerprint}"), Some(&record));
            assert_eq!(status, 204, "{floods}: alice's description: {answer}");
            let (status, answer) = control.http_as(ALICE, "GET", "/v1/whoami", None);
            assert_eq!((status, answer["name"].as_str()), (200, Some("alice")), "{floods}: {answer}");
            let (status, answer) =
                control.http_as(NODES, "PUT", "/v1/nodes/n1/lease", Some(&json!({ "lease": lease })));
            assert_eq!(status, 200, "{floods}: the node's renewal: {answer}");
            std::thread::sleep(Duration::from_millis(50));
        }
        let name = format!("n-{}", floods.replace(' ', "-"));
        let body = json!({ "name": name, "inventory": inventory("127.0.0.1:2") });
        let (status, answer) = control.http_as(NODES, "POST", "/v1/nodes", Some(&body));
        assert_eq!(status, 201, "{floods}: a new node's registration: {answer}");
        let (status, answer) =
            control.http_as(OPS, "DELETE", &format!("/v1/nodes/{name}?lease={}", answer["lease"]), None);
        assert_eq!(status, 204, "{answer}");
        let waiting = control.metric_as_ops(UNAUTHENTICATED);
        assert!(waiting <= held, "{floods}: {waiting} unauthenticated connections open");
    }
}

/// A request's body must come soon after its head and be at most 1 MiB, and a tenant's bodies in
/// flight at most 4 MiB together: a trickled body is answered 408 within 5 s of its head, a
/// larger one 413 as soon as that is known, and a tenant holding 4 MiB of slow bodies gets 429
/// for its next while another tenant is served.
#[test]
fn request_bodies_are_bounded_in_time_and_bytes() {
    use std::io::Write;
    use std::net::TcpStream;
    const BODY_TIMEOUT: Duration = Duration::from_secs(5);
    const MAX_BODY: usize = 1 << 20;
    let dir = tempfile::tempdir().unwrap();
    let control = control_with_tokens(dir.path(), &[]);
    let addr = control.addr().to_owned();
    let head = |token: &str, length: &str| {
        format!(
            "PUT /v1/models/{} HTTP/1.1\r\nHost: control\r\nAuthorization: Bearer {token}\r\n\
             Content-Type: application/json\r\n{length}\r\n\r\n",
            fingerprint(1)
        )
    };
    let record = json!({ "blocks": [{ "weight_bytes": MIB, "flops": 1e9 }] });
    let describe =
        |token: &str| control.http_as(token, "PUT", &format!("/v1/models/{}", fingerprint(1)), Some(&record));

    // Over the cap by its Content-Length: refused before a byte of it is read.
    let mut large = TcpStream::connect(&addr).unwrap();
    large.write_all(head(ALICE, &format!("Content-Length: {}", MAX_BODY + 1)).as_bytes()).unwrap();
    let answer = support::read_until_closed(&mut large, "a body over the cap");
    assert!(answer.starts_with("HTTP/1.1 413") && answer.contains("too_large"), "{answer}");
    // In chunks: refused once past the cap. (Just past it: what the API does not read would
    // make its close a reset, which may take the answer with it.)
    let mut chunked = TcpStream::connect(&addr).unwrap();
    chunked.write_all(head(ALICE, "Transfer-Encoding: chunked").as_bytes()).unwrap();
    let chunk = [format!("{:x}\r\n", 64 << 10).into_bytes(), vec![b' '; 64 << 10], b"\r\n".to_vec()].concat();
    for _ in 0..MAX_BODY / (64 << 10) {
        chunked.write_all(&chunk).unwrap();
    }
    chunked.write_all(b"1\r\n \r\n").unwrap();
    let answer = support::read_until_closed(&mut chunked, "a chunked body over the cap");
    assert!(answer.starts_with("HTTP/1.1 413") && answer.contains("too_large"), "{answer}");

    // Slow bodies of 1 MiB announced: alice holds 4 of them, and is then refused, while bob is
    // served.
    let sent = Instant::now();
    let mut slow: Vec<TcpStream> = (0..4)
        .map(|_| {
            let mut stream = TcpStream::connect(&addr).unwrap();
            stream.write_all(head(ALICE, &format!("Content-Length: {MAX_BODY}")).as_bytes()).unwrap();
            stream.write_all(b"{").unwrap();
            stream
        })
        .collect();
    // Until the API holds the four bodies against alice's budget (a request of hers in flight
    // as a head was read would take the room of that body): a hang guard.
    let deadline = Instant::now() + Duration::from_secs(10);
    while control.metric_as_ops("djinn_control_tenant_body_bytes") < 4 * MAX_BODY as u64 {
        assert!(Instant::now() < deadline, "alice's slow bodies are not all held");
        std::thread::sleep(Duration::from_millis(20));
    }
    let (status, refused) = describe(ALICE);
    assert_eq!(status, 429, "{refused}");
    assert_eq!(refused["error"]["kind"], "too_many_bodies", "{refused}");
    let (status, answer) = describe(BOB);
    assert_eq!(status, 204, "bob is served meanwhile: {answer}");
    for stream in &mut slow {
        let answer = support::read_until_closed(stream, "a slow body");
        assert!(answer.starts_with("HTTP/1.1 408") && answer.contains("body_timeout"), "{answer}");
    }
    let answered_after = sent.elapsed();
    // Well before the request timeout (30 s).
    let by_body_timeout = BODY_TIMEOUT - Duration::from_millis(50)..BODY_TIMEOUT + Duration::from_secs(5);
    assert!(by_body_timeout.contains(&answered_after), "408 after {answered_after:?}");
    assert_eq!(describe(ALICE).0, 204, "her budget is back");
    assert_eq!(control.metric_as_ops("djinn_control_body_timeouts_total"), 4);
    assert_eq!(control.metric_as_ops("djinn_control_bodies_too_large_total"), 2);
    assert!(control.metric_as_ops("djinn_control_bodies_refused_total") >= 1);
}

/// A node's forwards are written by that node only (the principal that registered it; an
/// operator for any), and only to another live node's address.
#[test]
fn forwards_come_from_their_node_and_go_to_live_nodes() {
    let dir = tempfile::tempdir().unwrap();
    let control = control_with_tokens(dir.path(), &["--lease-ttl", "60s"]);
    let addrs = ["127.0.0.1:11", "127.0.0.1:12", "127.0.0.1:13"];
    // `a` and `c` share the principal `nodes`; `b` has its own.
    for (name, token, addr) in [("a", NODES, addrs[0]), ("b", NODE_B, addrs[1]), ("c", NODES, addrs[2])] {
        let (status, answer) =
            control.http_as(token, "POST", "/v1/nodes", Some(&json!({ "name": name, "inventory": inventory(addr) })));
        assert_eq!(status, 201, "{answer}");
    }
    let forwards = |to: &str| json!({ "forwards": [{ "kind": "session", "tenant": "alice", "id": 7, "epoch": 3, "to": to, "to_id": 9, "to_epoch": 4 }] });
    let post = |token: &str, node: &str, to: &str| {
        let (status, answer) =
            control.http_as(token, "POST", &format!("/v1/nodes/{node}/forwards"), Some(&forwards(to)));
        (status, answer["error"]["kind"].as_str().unwrap_or_default().to_owned())
    };
    assert_eq!(post(NODES, "b", addrs[0]), (403, "forbidden".into()), "another principal's node");
    assert_eq!(post(NODE_B, "a", addrs[1]), (403, "forbidden".into()), "b for a");
    assert_eq!(post(NODES, "a", "127.0.0.1:9"), (400, "unknown_destination".into()), "to no node");
    assert_eq!(post(NODES, "a", addrs[0]), (400, "unknown_destination".into()), "to itself");
    let forward = format!("/v1/forwards/session/{}/{:016x}/7", addrs[0], 3);
    assert_eq!(control.http_as(OPS, "GET", &forward, None).0, 404, "nothing refused was recorded");
    assert_eq!(post(NODES, "a", addrs[2]), (204, String::new()));
    let (status, found) = control.http_as(OPS, "GET", &forward, None);
    assert_eq!((status, found["to"].as_str()), (200, Some(addrs[2])), "{found}");
    assert_eq!(post(NODE_B, "b", addrs[0]), (204, String::new()), "b for itself");
    assert_eq!(post(OPS, "b", addrs[2]), (204, String::new()), "an operator for any node");
}

/// Out of file descriptors, the API (over TLS, whose accept loop is its own) waits, backing
/// off, rather than spinning on its listener (it counts its waits), and serves again once
/// descriptors are free.
#[test]
fn out_of_descriptors_the_api_backs_off_and_recovers() {
    let dir = tempfile::tempdir().unwrap();
    let (control, addr, _, cert) = tls_control(dir.path(), &["--header-timeout", "30s"]);
    let pid = control.0.id();
    let trusted =
        djinn_client::ControlClient::with_roots(&format!("https://{addr}"), Duration::from_secs(5), &cert).unwrap();
    assert!(trusted.cluster().unwrap().contains("\"nodes\""));

    support::limit_open_files(pid, support::open_files(pid) + 2);
    let held: Vec<std::net::TcpStream> = (0..8).map(|_| std::net::TcpStream::connect(&addr).unwrap()).collect();
    std::thread::sleep(Duration::from_millis(300));
    let before = support::cpu_time(pid);
    std::thread::sleep(Duration::from_secs(1));
    let used = support::cpu_time(pid) - before;
    assert!(used < Duration::from_millis(250), "{used:?} of CPU in a second out of descriptors");
    drop(held);
    let deadline = Instant::now() + Duration::from_secs(10);
    while let Err(e) = trusted.cluster() {
        assert!(Instant::now() < deadline, "not served once descriptors were free: {e}");
        std::thread::sleep(Duration::from_millis(100));
    }
    // It was out of descriptors: accepts failed, and it waited before each next one.
    let roots =
        ureq::tls::RootCerts::Specific(std::sync::Arc::new(vec![ureq::tls::Certificate::from_pem(&cert).unwrap()]));
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .tls_config(ureq::tls::TlsConfig::builder().root_certs(roots).build())
        .build()
        .into();
    let metrics = agent.get(&format!("https://{addr}/metrics")).call().unwrap().body_mut().read_to_string().unwrap();
    let backoffs = metrics.lines().find_map(|l| l.strip_prefix("djinn_control_accept_backoffs_total "));
    assert!(backoffs.and_then(|n| n.parse::<u64>().ok()).is_some_and(|n| n >= 1), "{metrics}");
}

/// Without `--store`, `djinn control` keeps its store in the state directory (`$DJINN_STATE_DIR`,
/// else `$XDG_STATE_HOME/djinn`, else `~/.local/state/djinn`), made readable by its owner only,
/// and writes nothing in the directory it was started from; started again the same way, it
/// finds what it had.
#[test]
fn the_default_store_lives_in_the_state_directory_not_the_working_one() {
    use std::os::unix::fs::PermissionsExt;
    for (var, dir, store) in [
        ("DJINN_STATE_DIR", "state", "state/control.redb"),
        ("XDG_STATE_HOME", "xdg", "xdg/djinn/control.redb"),
        ("HOME", "home", "home/.local/state/djinn/control.redb"),
    ] {
        let (cwd, root) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let start = || {
            let mut command = Command::new(env!("CARGO_BIN_EXE_djinn"));
            command.args(["control", "--listen", "127.0.0.1:0", "--log", "warn"]).current_dir(cwd.path());
            command.env_remove("DJINN_STATE_DIR").env_remove("XDG_STATE_HOME").env(var, root.path().join(dir));
            let (child, addr) = support::spawn_listening(command, "djinn control listening on ");
            Control { child: Some(child), url: format!("http://{addr}") }
        };
        let control = start();
        control.describe(&fingerprint(7), 1, MIB, 1e9);
        drop(control);
        let path = root.path().join(store);
        assert!(path.is_file(), "{var}: no store at {}", path.display());
        let mode = std::fs::metadata(path.parent().unwrap()).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o700, "{var}: the state directory is its owner's");
        assert_eq!(std::fs::read_dir(cwd.path()).unwrap().count(), 0, "{var}: nothing in the working directory");
        let again = start();
        assert_eq!(again.ok("GET", &format!("/v1/models/{}", fingerprint(7)), None)["blocks"][0]["weight_bytes"], MIB);
    }
}

/// A model record that no live node holds expires after `--model-record-ttl`: one described and
/// never placed goes, one a node holds stays, and goes once the node lets go of it; describing
/// it again starts its time afresh.
#[test]
fn model_records_no_node_holds_expire() {
    const RECORD_TTL: Duration = Duration::from_secs(2);
    // A record goes no sooner than its time to live after it was last described (or let go of);
    // load only makes that later. The control plane's clock counts whole milliseconds: a little
    // slack.
    let lower_bound = RECORD_TTL - Duration::from_millis(50);
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("control.redb").display().to_string();
    let mut command = Command::new(env!("CARGO_BIN_EXE_djinn"));
    command.args(["up", "--listen", "127.0.0.1:0", "--control-listen", "127.0.0.1:0", "--store", &store]);
    command.args(["--model-record-ttl", &format!("{}ms", RECORD_TTL.as_millis())]);
    command.args(["--device", "cpu", "--device-memory-budget", "64MiB", "--name", "solo", "--log", "warn"]);
    let (up, addrs) = support::spawn_announcing(command, &["djinn control listening on ", "djinn node listening on "]);
    let _up = support::Killed(up);
    let control = Control::served_at(&addrs[0]);
    control.wait_for_nodes(&["solo"]);
    let mut client = ClusterClient::open(&control.url, ClientOptions::default(), FailoverOptions::default()).unwrap();
    let model = client.register_model(vec![support::archive("halves").into()], None, None, false, |_, _| {}).unwrap();
    let held = model.fingerprint.to_string();
    let exists = |fp: &str| control.http("GET", &format!("/v1/models/{fp}"), None).0 == 200;
    // When each of `fps` was first seen gone, once all are. A hang guard of a minute.
    let wait_until_gone = |fps: &[&str]| -> Vec<Instant> {
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut gone: Vec<Option<Instant>> = vec![None; fps.len()];
        while gone.iter().any(Option::is_none) {
            for (fp, at) in fps.iter().zip(&mut gone) {
                if at.is_none() && !exists(fp) {
                    *at = Some(Instant::now());
                }
            }
            assert!(Instant::now() < deadline, "{fps:?} did not all expire: gone at {gone:?}");
            std::thread::sleep(Duration::from_millis(50));
        }
        gone.into_iter().flatten().collect()
    };

    let (unplaced, redescribed) = (fingerprint(9), fingerprint(10));
    let described = Instant::now();
    control.describe(&unplaced, 1, MIB, 1e9);
    control.describe(&redescribed, 1, MIB, 1e9);
    // Described again well within its time: without a fresh start it would go about when the
    // other does, 1.2 s too soon.
    std::thread::sleep(Duration::from_millis(1200));
    let described_again = Instant::now();
    control.describe(&redescribed, 1, MIB, 1e9);
    let gone = wait_until_gone(&[&unplaced, &redescribed]);
    let (unplaced_lasted, redescribed_lasted) =
        (gone[0].duration_since(described), gone[1].duration_since(described_again));
    assert!(unplaced_lasted >= lower_bound, "gone {unplaced_lasted:?} after it was described");
    assert!(redescribed_lasted >= lower_bound, "gone {redescribed_lasted:?} after it was described again");
    assert!(exists(&held), "a record the node holds stays");
    let let_go = Instant::now();
    client.unregister_model(&model.fingerprint).unwrap();
    let held_lasted = wait_until_gone(&[&held])[0].duration_since(let_go);
    assert!(held_lasted >= lower_bound, "gone {held_lasted:?} after the node let go of it");
    assert_eq!(control.counter("djinn_control_model_records_expired_total"), 3);
}
