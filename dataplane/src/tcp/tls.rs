//! TLS on the data plane's TCP connections (rustls). rustls does no I/O of its own: each side's
//! poller moves the socket's bytes through [`TlsWire`], which reads and writes records on the
//! socket it is handed and gives the frame layer plaintext, as the socket itself does without
//! TLS. Only TCP is covered: frames a client moves to RDMA travel in clear, so a client asking
//! for TLS stays on TCP unless it asks for RDMA by name.

use std::io::{self, IoSlice, IoSliceMut, Read, Write};
use std::net::IpAddr;
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};

/// Plaintext rustls takes before its records are written out: what one connection buffers.
const BUFFER_LIMIT: usize = 256 << 10;

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("{what}: {message}")]
    Pem { what: &'static str, message: String },
    #[error("{0}")]
    Config(#[from] rustls::Error),
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// A node's TLS: its certificate chain (PEM, leaf first) and private key (PEM).
pub fn server_config(chain: &[u8], key: &[u8]) -> Result<Arc<rustls::ServerConfig>, TlsError> {
    let pem = |what, e: rustls::pki_types::pem::Error| TlsError::Pem { what, message: e.to_string() };
    let chain: Vec<CertificateDer<'static>> =
        CertificateDer::pem_slice_iter(chain).collect::<Result<_, _>>().map_err(|e| pem("the certificate chain", e))?;
    if chain.is_empty() {
        return Err(TlsError::Pem { what: "the certificate chain", message: "no certificate in it".into() });
    }
    let key = PrivateKeyDer::from_pem_slice(key).map_err(|e| pem("the private key", e))?;
    let config = rustls::ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_single_cert(chain, key)?;
    Ok(Arc::new(config))
}

/// What a client needs to speak TLS to nodes: the roots it trusts, and the name it expects in
/// a node's certificate (by default the address it connects to).
#[derive(Clone)]
pub struct ClientTls {
    config: Arc<rustls::ClientConfig>,
    server_name: Option<ServerName<'static>>,
}

impl std::fmt::Debug for ClientTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientTls").field("server_name", &self.server_name).finish_non_exhaustive()
    }
}

impl ClientTls {
    /// Trusts the certificates of `roots` (PEM: a CA, or a node's self-signed certificate).
    pub fn trusting(roots: &[u8]) -> Result<Self, TlsError> {
        let mut store = rustls::RootCertStore::empty();
        for cert in CertificateDer::pem_slice_iter(roots) {
            let cert = cert.map_err(|e| TlsError::Pem { what: "the trusted roots", message: e.to_string() })?;
            store.add(cert)?;
        }
        if store.is_empty() {
            return Err(TlsError::Pem { what: "the trusted roots", message: "no certificate in them".into() });
        }
        let config = rustls::ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()?
            .with_root_certificates(store)
            .with_no_client_auth();
        Ok(Self { config: Arc::new(config), server_name: None })
    }

    /// Expects `name` (a DNS name or an address) in the node's certificate.
    pub fn with_server_name(mut self, name: &str) -> Result<Self, TlsError> {
        let name = ServerName::try_from(name.to_owned())
            .map_err(|e| TlsError::Pem { what: "the server name", message: e.to_string() })?;
        self.server_name = Some(name);
        Ok(self)
    }

    /// Whether a name was chosen with [`Self::with_server_name`] (else the certificate must name
    /// the address connected to).
    pub fn has_server_name(&self) -> bool {
        self.server_name.is_some()
    }

    /// The TLS side of a new connection to `peer`.
    pub(crate) fn connect(&self, peer: IpAddr) -> Result<TlsWire, TlsError> {
        let name = self.server_name.clone().unwrap_or(ServerName::IpAddress(peer.into()));
        let conn = rustls::ClientConnection::new(Arc::clone(&self.config), name)?;
        Ok(TlsWire::new(conn.into()))
    }
}

/// One connection's TLS state between its socket and its frames.
#[derive(Debug)]
pub struct TlsWire {
    conn: rustls::Connection,
}

fn tls_failed(e: rustls::Error) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, e)
}

impl TlsWire {
    pub(crate) fn new(mut conn: rustls::Connection) -> Self {
        conn.set_buffer_limit(Some(BUFFER_LIMIT));
        Self { conn }
    }

    #[cfg(feature = "server")]
    pub(crate) fn accept(config: &Arc<rustls::ServerConfig>) -> Result<Self, TlsError> {
        Ok(Self::new(rustls::ServerConnection::new(Arc::clone(config))?.into()))
    }

    /// Plaintext into `bufs`, reading records from `socket` when none is buffered. `Ok(0)` is
    /// the peer's end; `WouldBlock` comes only once nothing is buffered and the socket has
    /// nothing either, so an edge-triggered poller may wait on the socket then.
    pub fn read_vectored<S: Read + Write>(&mut self, socket: &mut S, bufs: &mut [IoSliceMut<'_>]) -> io::Result<usize> {
        loop {
            match self.conn.reader().read_vectored(bufs) {
                Ok(n) => return Ok(n),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                // The peer closed without close_notify: its end, as a socket's would be.
                Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(0),
                Err(e) => return Err(e),
            }
            match self.read_records(socket) {
                Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(0),
                other => other?,
            }
            // Handshake messages and the like: sent now, or once the socket has room.
            match self.flush(socket) {
                Err(e) if e.kind() != io::ErrorKind::WouldBlock => return Err(e),
                _ => {}
            }
        }
    }

    /// Reads the records the socket has and processes them (their plaintext waits for
    /// [`Self::read_vectored`]): `WouldBlock` when it has none, `UnexpectedEof` at its end.
    pub fn read_records<S: Read + Write>(&mut self, socket: &mut S) -> io::Result<()> {
        if self.conn.read_tls(socket)? == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        if let Err(e) = self.conn.process_new_packets() {
            // The alert that says why, if the socket takes it.
            let _ = self.conn.write_tls(socket);
            return Err(tls_failed(e));
        }
        Ok(())
    }

    /// True until the handshake is done.
    pub fn is_handshaking(&self) -> bool {
        self.conn.is_handshaking()
    }

    /// Takes plaintext from `bufs` (up to rustls's buffer) and writes what it can of the records
    /// to `socket`; records made earlier go first, so `WouldBlock` means none was taken.
    pub fn write_vectored<S: Write>(&mut self, socket: &mut S, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        self.flush(socket)?;
        let taken = self.conn.writer().write_vectored(bufs)?;
        match self.flush(socket) {
            Err(e) if e.kind() != io::ErrorKind::WouldBlock => Err(e),
            _ => Ok(taken),
        }
    }

    /// True while records wait for the socket.
    pub fn wants_write(&self) -> bool {
        self.conn.wants_write()
    }

    /// Writes the records that wait, until none does or the socket is full (`WouldBlock`).
    pub fn flush<S: Write>(&mut self, socket: &mut S) -> io::Result<()> {
        while self.conn.wants_write() {
            if self.conn.write_tls(socket)? == 0 {
                return Err(io::ErrorKind::WriteZero.into());
            }
        }
        Ok(())
    }
}

#[cfg(all(test, feature = "server"))]
mod tests {
    use super::*;
    use std::net::{TcpListener, TcpStream};

    fn certificate() -> (String, String) {
        let rcgen::CertifiedKey { cert, key_pair } =
            rcgen::generate_simple_self_signed(vec!["127.0.0.1".into()]).unwrap();
        (cert.pem(), key_pair.serialize_pem())
    }

    /// Both ends on nonblocking sockets, one thread: whatever either writes the other reads, in
    /// pieces of every size, across the handshake.
    #[test]
    fn plaintext_crosses_both_ways_over_nonblocking_sockets() {
        let (cert, key) = certificate();
        let server_config = server_config(cert.as_bytes(), key.as_bytes()).unwrap();
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let mut client_socket = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (mut server_socket, _) = listener.accept().unwrap();
        client_socket.set_nonblocking(true).unwrap();
        server_socket.set_nonblocking(true).unwrap();
        let mut client = ClientTls::trusting(cert.as_bytes()).unwrap().connect([127, 0, 0, 1].into()).unwrap();
        let mut server = TlsWire::accept(&server_config).unwrap();

        let message: Vec<u8> = (0..3_000_000u32).map(|i| (i * 7 + i / 251) as u8).collect();
        let (mut sent, mut got, mut answer) = (0, Vec::new(), Vec::new());
        let mut buf = vec![0u8; 70_001];
        for _ in 0..100_000 {
            if sent < message.len() {
                let end = (sent + 100_000).min(message.len());
                match client.write_vectored(&mut client_socket, &[IoSlice::new(&message[sent..end])]) {
                    Ok(n) => sent += n,
                    Err(e) => assert_eq!(e.kind(), io::ErrorKind::WouldBlock),
                }
            } else if client.wants_write() {
                let _ = client.flush(&mut client_socket);
            }
            let piece = got.len() % 4093 + 1;
            match server.read_vectored(&mut server_socket, &mut [IoSliceMut::new(&mut buf[..piece])]) {
                Ok(n) => {
                    assert!(n > 0, "the client has not closed");
                    got.extend_from_slice(&buf[..n]);
                    if got.len() == message.len() {
                        server.write_vectored(&mut server_socket, &[IoSlice::new(b"thanks")]).unwrap();
                        server.flush(&mut server_socket).unwrap();
                    }
                }
                Err(e) => assert_eq!(e.kind(), io::ErrorKind::WouldBlock),
            }
            // The client reads too: the handshake's answers, then the server's.
            match client.read_vectored(&mut client_socket, &mut [IoSliceMut::new(&mut buf)]) {
                Ok(n) => answer.extend_from_slice(&buf[..n]),
                Err(e) => assert_eq!(e.kind(), io::ErrorKind::WouldBlock),
            }
            if answer.len() == 6 {
                break;
            }
        }
        assert!(got == message, "{} of {} bytes, or not the same", got.len(), message.len());
        assert_eq!(answer, b"thanks");
        drop(client_socket);
        let mut end = Ok(1);
        for _ in 0..1000 {
            end = server.read_vectored(&mut server_socket, &mut [IoSliceMut::new(&mut buf)]);
            if !matches!(&end, Err(e) if e.kind() == io::ErrorKind::WouldBlock) {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        assert_eq!(end.unwrap(), 0, "the client's end reads as the end");
    }

    #[test]
    fn a_client_that_does_not_trust_the_node_fails_its_handshake() {
        let (cert, key) = certificate();
        let (other, _) = certificate();
        let server_config = server_config(cert.as_bytes(), key.as_bytes()).unwrap();
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let mut client_socket = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (mut server_socket, _) = listener.accept().unwrap();
        let mut client = ClientTls::trusting(other.as_bytes()).unwrap().connect([127, 0, 0, 1].into()).unwrap();
        let mut server = TlsWire::accept(&server_config).unwrap();
        client.write_vectored(&mut client_socket, &[IoSlice::new(b"hello")]).unwrap();
        let mut buf = [0u8; 64];
        // The server answers the client's hello and waits for more; the client reads the answer.
        server_socket.set_nonblocking(true).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(50));
        let _ = server.read_vectored(&mut server_socket, &mut [IoSliceMut::new(&mut buf)]);
        let refused = client.read_vectored(&mut client_socket, &mut [IoSliceMut::new(&mut buf)]).unwrap_err();
        assert_eq!(refused.kind(), io::ErrorKind::InvalidData);
        assert!(refused.to_string().contains("invalid peer certificate"), "{refused}");
    }

    #[test]
    fn bad_pem_is_a_clear_error() {
        let (cert, key) = certificate();
        assert!(server_config(b"not pem", key.as_bytes()).unwrap_err().to_string().contains("no certificate"));
        assert!(server_config(cert.as_bytes(), b"nope").unwrap_err().to_string().contains("private key"));
        assert!(ClientTls::trusting(b"").unwrap_err().to_string().contains("no certificate"));
    }
}
