//! Shared by the integration tests: a node process on an ephemeral port, raw frame reading,
//! deterministic test data.

#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read};
use std::net::{SocketAddr, TcpStream};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use djinn_client::Client;
use djinn_proto::{FrameHeader, HEADER_LEN, Kind, Limits, Message};

pub const BACKENDS: [&str; 2] = ["mio", "uring"];

/// Starts `command` and reads its first line of output, `{announce}ADDR`: the address it bound.
pub fn spawn_listening(command: Command, announce: &str) -> (Child, String) {
    let (child, mut addrs) = spawn_announcing(command, &[announce]);
    (child, addrs.remove(0))
}

/// Starts `command` and reads one line of output per announcement, `{announce}ADDR`, in order.
pub fn spawn_announcing(mut command: Command, announces: &[&str]) -> (Child, Vec<String>) {
    let mut child = command.stdout(Stdio::piped()).spawn().expect("cannot start djinn");
    let mut stdout = BufReader::new(child.stdout.take().expect("stdout"));
    let addrs = announces
        .iter()
        .map(|announce| {
            let mut line = String::new();
            stdout.read_line(&mut line).expect("djinn's output");
            match line.strip_prefix(announce) {
                Some(addr) => addr.trim().to_owned(),
                None => panic!("unexpected line: {line:?}, expected {announce:?}ADDR"),
            }
        })
        .collect();
    (child, addrs)
}

/// The `djinn` binary the tests start: cargo's build of it, or `DJINN_BIN` (a test binary run
/// from a bundle, away from the tree it was built in).
pub fn djinn_binary() -> std::ffi::OsString {
    std::env::var_os("DJINN_BIN").unwrap_or_else(|| env!("CARGO_BIN_EXE_djinn").into())
}

/// A `djinn node` child process, killed on drop.
pub struct Node {
    child: Child,
    pub addr: SocketAddr,
}

impl Node {
    pub fn start(backend: &str, extra: &[&str]) -> Self {
        Self::start_at("127.0.0.1:0", backend, extra)
    }

    /// With `DJINN_TEST_DEVICE` set (gpu-suite.sh sets `cuda:0`), every node of the test runs
    /// on that device unless the test names another.
    pub fn start_at(listen: &str, backend: &str, extra: &[&str]) -> Self {
        let mut command = Command::new(djinn_binary());
        command.args(["node", "--listen", listen, "--tcp-backend", backend, "--log", "error"]).args(extra);
        if let Ok(device) = std::env::var("DJINN_TEST_DEVICE")
            && !extra.contains(&"--device")
        {
            command.args(["--device", &device]);
        }
        let (child, addr) = spawn_listening(command, "djinn node listening on ");
        let addr = addr.parse().unwrap_or_else(|_| panic!("not an address: {addr:?}"));
        Self { child, addr }
    }

    pub fn client(&self) -> Client {
        Client::connect(self.addr).expect("connect to the node")
    }

    pub fn stat(&self, client: &mut Client, name: &str) -> u64 {
        counter(client, name)
    }

    /// Waits for a counter that changes as the node catches up with closes.
    pub fn wait_for_stat(&self, client: &mut Client, name: &str, value: u64) {
        wait_for_counter(client, name, value, |now| now == value);
    }

    /// Waits until the counter `name` reaches `value` or more.
    pub fn wait_for_stat_at_least(&self, client: &mut Client, name: &str, value: u64) {
        wait_for_counter_at_least(client, name, value);
    }

    /// Resident set size of the node process, bytes.
    pub fn rss(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).expect("proc status");
        let kib: u64 = status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
            .expect("VmRSS");
        kib * 1024
    }

    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    /// SIGKILL: the node gets no chance to say goodbye.
    pub fn kill(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Sends SIGTERM and waits for the exit.
    pub fn terminate(mut self) -> ExitStatus {
        // SAFETY: kill(2) on our own child's pid.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(status) = self.child.try_wait().expect("wait") {
                return status;
            }
            assert!(Instant::now() < deadline, "node ignored SIGTERM");
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

/// A child process killed (and reaped) on drop.
pub struct Killed(pub Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Deterministic floats in [-1, 1) as f32 bytes.
pub fn f32_bytes(n: usize, seed: u64) -> Vec<u8> {
    pattern(n, seed).iter().flat_map(|&b| ((b as f32 - 128.0) / 128.0).to_le_bytes()).collect()
}

/// A loopback address with a port free now, for a node started later (a peer's list names it).
pub fn free_addr() -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind a free port");
    listener.local_addr().expect("its address").to_string()
}

/// Registers the model whose blocks are the named archives of `tests/models`.
pub fn register(client: &mut Client, names: &[&str]) -> djinn_client::Fingerprint {
    let blocks: Vec<Vec<u8>> = names.iter().map(|n| archive(n)).collect();
    client.register_model(&blocks, |_, _| {}).expect("register").fingerprint
}

/// `len` bytes that differ with `seed` and with position (a period that is no power of two).
pub fn pattern(len: usize, seed: u64) -> Vec<u8> {
    const PERIOD: usize = (1 << 20) + 7;
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let block: Vec<u8> = (0..PERIOD.min(len))
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state as u8
        })
        .collect();
    let mut out = Vec::with_capacity(len);
    while out.len() < len {
        let n = block.len().min(len - out.len());
        out.extend_from_slice(&block[..n]);
    }
    out
}

/// Reads one frame: header, decoded message, payload bytes.
pub fn read_reply(stream: &mut TcpStream) -> (FrameHeader, Message, Vec<u8>) {
    let mut head = [0u8; HEADER_LEN];
    stream.read_exact(&mut head).expect("reply header");
    let header = FrameHeader::parse(&head).expect("header");
    let mut meta = vec![0u8; header.meta_len.get() as usize];
    stream.read_exact(&mut meta).expect("reply metadata");
    let kind = Kind::from_wire(header.kind.get()).expect("known kind");
    let message = Message::decode(kind, &meta, &Limits::default()).expect("reply decodes");
    let mut payload = vec![0u8; header.payload_len.get() as usize];
    stream.read_exact(&mut payload).expect("reply payload");
    (header, message, payload)
}

/// Makes closing `stream` send a reset instead of a FIN: the peer sees a client vanish.
pub fn reset_on_close(stream: &TcpStream) {
    use std::os::fd::AsRawFd;
    let linger = libc::linger { l_onoff: 1, l_linger: 0 };
    // SAFETY: a valid socket and a linger struct of the size passed.
    let rc = unsafe {
        libc::setsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            (&linger as *const libc::linger).cast(),
            size_of::<libc::linger>() as libc::socklen_t,
        )
    };
    assert_eq!(rc, 0, "SO_LINGER: {}", std::io::Error::last_os_error());
}

/// The folder of TorchScript archives that tests/models/make_models.py writes with the torch of
/// .venv: once per version of the script, under cargo's temporary folder for tests, so that
/// test processes share it and nothing is left in /tmp.
pub fn models_dir() -> &'static std::path::Path {
    static DIR: std::sync::OnceLock<std::path::PathBuf> = std::sync::OnceLock::new();
    DIR.get_or_init(|| {
        // Made beforehand where Python is slow to start (the emulated RDMA VM).
        if let Some(dir) = std::env::var_os("DJINN_TEST_MODELS") {
            return dir.into();
        }
        const SCRIPT: &[u8] = include_bytes!("../models/make_models.py");
        // FNV-1a: a new version of the script gets a new folder.
        let version =
            SCRIPT.iter().fold(0xcbf2_9ce4_8422_2325_u64, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3));
        let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("test-models-{version:016x}"));
        if dir.is_dir() {
            return dir;
        }
        // Written beside it, then renamed: the folder exists only once complete, and processes
        // that make it at the same time do not see each other's half.
        let partial = dir.with_extension(std::process::id().to_string());
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let status = Command::new(root.join(".venv/bin/python"))
            .arg(root.join("tests/models/make_models.py"))
            .arg(&partial)
            .stdout(Stdio::null())
            .status()
            .expect("cannot run .venv/bin/python (run scripts/setup.sh)");
        assert!(status.success(), "make_models.py failed");
        if std::fs::rename(&partial, &dir).is_err() {
            // Another process got there first.
            std::fs::remove_dir_all(&partial).ok();
            assert!(dir.is_dir(), "cannot rename {} to {}", partial.display(), dir.display());
        }
        dir
    })
}

pub fn archive(name: &str) -> Vec<u8> {
    std::fs::read(models_dir().join(format!("{name}.pt"))).expect("archive")
}

/// Puts tensors of several sizes (eager and rendezvous over RDMA), fetches them all with one
/// `get_many`, then one more batch naming a missing tensor: that batch fails with NotFound and
/// the client goes on.
pub fn many_gets_come_back_in_order(client: &mut Client) {
    let sizes = [1usize, 4096, 100_000, 300_000, 7, 0, 65_536, 1 << 20];
    let names: Vec<String> = (0..sizes.len()).map(|i| format!("many{i}")).collect();
    let data: Vec<Vec<u8>> = sizes.iter().enumerate().map(|(i, &len)| pattern(len, 900 + i as u64)).collect();
    for ((name, bytes), len) in names.iter().zip(&data).zip(sizes) {
        client.put(name, djinn_client::DType::U8, &[len as u64], bytes).unwrap();
    }
    let mut asked: Vec<&str> = names.iter().map(String::as_str).collect();
    // The same tensor twice in one batch.
    asked.push(&names[2]);
    let got = client.get_many(&asked).unwrap();
    assert_eq!(got.len(), asked.len());
    for (i, tensor) in got.iter().enumerate() {
        let want = &data[if i < sizes.len() { i } else { 2 }];
        assert!(tensor.bytes() == want.as_slice(), "tensor {i} of the batch");
    }
    let err = client.get_many(&[&names[0], "missing", &names[1]]).unwrap_err();
    assert_eq!(err.remote_code(), Some(djinn_client::ErrorCode::NotFound), "{err}");
    assert!(client.get(&names[3]).unwrap().bytes() == data[3].as_slice());
}

/// The counter `name` of the node `client` is connected to.
pub fn counter(client: &mut Client, name: &str) -> u64 {
    let stats = client.stats().expect("stats");
    stats.iter().find(|(k, _)| k == name).unwrap_or_else(|| panic!("no counter {name} in {stats:?}")).1
}

/// Waits until the counter `name` of the node `client` is connected to is `value` or more, and
/// returns it.
pub fn wait_for_counter_at_least(client: &mut Client, name: &str, value: u64) -> u64 {
    wait_for_counter(client, name, value, |now| now >= value)
}

/// Waits until the counter `name` of the node `client` is connected to is `done` (expected:
/// `value`), and returns it. Fails after a minute: a hang guard, the node gets there long before.
fn wait_for_counter(client: &mut Client, name: &str, value: u64, done: impl Fn(u64) -> bool) -> u64 {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let now = counter(client, name);
        if done(now) {
            return now;
        }
        assert!(Instant::now() < deadline, "{name} stayed at {now}, expected {value}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// What `stream` receives until its peer closes it (its end, or a reset). Call it once the
/// peer is expected to close it (a counter says so, or a timeout it was given has begun): the
/// read timeout of a minute is a hang guard, not a limit on how soon; `what` names the
/// connection when it stays open.
pub fn read_until_closed(stream: &mut TcpStream, what: &str) -> String {
    use std::io::ErrorKind;
    stream.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let (mut received, mut buf) = (Vec::new(), [0u8; 4096]);
    loop {
        match stream.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => received.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                panic!("{what}: the peer left the connection open after {:?}", String::from_utf8_lossy(&received))
            }
            Err(_) => break,
        }
    }
    String::from_utf8_lossy(&received).into_owned()
}

/// CPU time process `pid` has used, user and system.
pub fn cpu_time(pid: u32) -> Duration {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("proc stat");
    // The fields after the command's name, which is in parentheses and may hold spaces.
    let fields: Vec<&str> = stat[stat.rfind(')').expect("stat") + 2..].split(' ').collect();
    // SAFETY: sysconf has no preconditions.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64;
    let used: u64 = fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap();
    Duration::from_millis(used * 1000 / ticks)
}

/// Sets process `pid`'s soft limit on open files to `limit` (its hard limit stays).
pub fn limit_open_files(pid: u32, limit: u64) {
    let mut current = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: valid rlimit pointers; the hard limit read is the one written back.
    unsafe {
        assert_eq!(libc::prlimit(pid as i32, libc::RLIMIT_NOFILE, std::ptr::null(), &mut current), 0);
        let new = libc::rlimit { rlim_cur: limit, rlim_max: current.rlim_max };
        assert_eq!(libc::prlimit(pid as i32, libc::RLIMIT_NOFILE, &new, std::ptr::null_mut()), 0);
    }
}

/// Descriptors process `pid` has open.
pub fn open_files(pid: u32) -> u64 {
    std::fs::read_dir(format!("/proc/{pid}/fd")).expect("proc fd").count() as u64
}

/// A self-signed certificate for 127.0.0.1 and localhost, written to `dir` as `NAME.pem` and its
/// key as `NAME.key`: (certificate, key).
pub fn self_signed_certificate(dir: &std::path::Path, name: &str) -> (std::path::PathBuf, std::path::PathBuf) {
    let rcgen::CertifiedKey { cert, key_pair } =
        rcgen::generate_simple_self_signed(vec!["127.0.0.1".into(), "localhost".into()]).expect("a certificate");
    let (cert_path, key_path) = (dir.join(format!("{name}.pem")), dir.join(format!("{name}.key")));
    std::fs::write(&cert_path, cert.pem()).expect("write the certificate");
    std::fs::write(&key_path, key_pair.serialize_pem()).expect("write the key");
    (cert_path, key_path)
}

/// What a session of the test model `counter` (state: a running total of three floats and a
/// step count) returns, step by step: twice the total of the inputs so far, and ten times the
/// step count.
pub struct Counter {
    total: [f32; 3],
    steps: i64,
}

impl Counter {
    pub fn new() -> Self {
        Self { total: [0.0; 3], steps: 0 }
    }

    /// The next step's input: three floats.
    pub fn input(&self) -> Vec<u8> {
        let n = self.steps as f32 + 1.0;
        [n, 1.0, -2.0 * n].iter().flat_map(|v| v.to_le_bytes()).collect()
    }

    /// Checks a step's outputs against the inputs so far (the last being [`Self::input`]).
    pub fn check(&mut self, out: &djinn_client::Output) {
        let x = self.input();
        let x = x.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]));
        self.total.iter_mut().zip(x).for_each(|(t, v)| *t += v);
        self.steps += 1;
        let expected: Vec<u8> = self.total.iter().flat_map(|t| (t * 2.0).to_le_bytes()).collect();
        assert_eq!(out.tensor_bytes(0), expected, "step {}", self.steps);
        assert_eq!(out.tensor_bytes(1), (self.steps * 10).to_le_bytes(), "step {}", self.steps);
    }
}
pub mod hostile_node;
