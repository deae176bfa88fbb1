//! A single-member etcd on loopback ports, for tests (here and in the workspace's integration
//! tests, through the `local-etcd` feature): Debian's etcd-server, killed with its data
//! directory when dropped.

use std::fs::File;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

#[derive(Debug)]
pub struct LocalEtcd {
    child: Child,
    dir: tempfile::TempDir,
    /// The client URL, `http://127.0.0.1:PORT`.
    pub url: String,
    client_port: u16,
    peer_port: u16,
}

fn etcd_binary() -> PathBuf {
    let debian = Path::new("/usr/bin/etcd");
    if debian.is_file() {
        return debian.to_owned();
    }
    std::env::var_os("PATH")
        .and_then(|paths| std::env::split_paths(&paths).map(|dir| dir.join("etcd")).find(|path| path.is_file()))
        .unwrap_or_else(|| panic!("no etcd (/usr/bin/etcd or etcd on PATH): scripts/setup.sh installs etcd-server"))
}

/// A port nothing listens on now (another process may take it before etcd does: unlikely).
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map(|a| a.port()).expect("a free loopback port")
}

/// Whether etcd's /health on `port` says it is healthy (it has a leader).
fn healthy(port: u16) -> bool {
    let Ok(mut stream) = TcpStream::connect(("127.0.0.1", port)) else { return false };
    let mut answer = String::new();
    stream.write_all(b"GET /health HTTP/1.0\r\n\r\n").is_ok()
        && stream.read_to_string(&mut answer).is_ok()
        && answer.contains("\"health\":\"true\"")
}

/// Starts a single-member etcd keeping its data (and log, appended) in `dir`.
fn spawn(dir: &Path, client_port: u16, peer_port: u16) -> Child {
    let url = format!("http://127.0.0.1:{client_port}");
    let peer = format!("http://127.0.0.1:{peer_port}");
    let log = File::options().create(true).append(true).open(dir.join("etcd.log")).expect("etcd's log file");
    Command::new(etcd_binary())
        .arg("--name=default")
        .arg(format!("--data-dir={}", dir.join("data").display()))
        .arg(format!("--listen-client-urls={url}"))
        .arg(format!("--advertise-client-urls={url}"))
        .arg(format!("--listen-peer-urls={peer}"))
        .arg(format!("--initial-advertise-peer-urls={peer}"))
        .arg(format!("--initial-cluster=default={peer}"))
        .stdout(log.try_clone().expect("etcd's log file"))
        .stderr(log)
        .spawn()
        .expect("cannot start etcd")
}

impl LocalEtcd {
    /// Starts etcd and returns once it is healthy; panics with its log if it does not get there
    /// within 15 s.
    pub fn start() -> Self {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let (client_port, peer_port) = (free_port(), free_port());
        let url = format!("http://127.0.0.1:{client_port}");
        let child = spawn(dir.path(), client_port, peer_port);
        let mut etcd = Self { child, dir, url, client_port, peer_port };
        etcd.wait_healthy();
        etcd
    }

    /// Kills etcd and starts it again on the same ports and data: its clients see it go away
    /// and come back.
    pub fn restart(&mut self) {
        self.kill();
        self.start_again();
    }

    /// Kills etcd (its data stays): clients find nothing listening.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Starts a killed etcd again on its ports and data; returns once it is healthy.
    pub fn start_again(&mut self) {
        self.child = spawn(self.dir.path(), self.client_port, self.peer_port);
        self.wait_healthy();
    }

    fn wait_healthy(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(15);
        while !healthy(self.client_port) {
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!("etcd exited ({status}):\n{}", self.log());
            }
            assert!(Instant::now() < deadline, "etcd was not healthy within 15 s:\n{}", self.log());
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("etcd.log")).unwrap_or_default()
    }
}

impl Drop for LocalEtcd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
