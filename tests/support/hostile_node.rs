//! A compromised node, for tests of what clients trust: it relays a client's frames to a real
//! node and the real node's answers back (so hellos, registrations and kept tensors work), and
//! answers some requests itself as an attacker would. Run in a test's thread
//! ([`HostileNode::start`]) or as its own process (`tools/examples/hostile_node.rs`, for the
//! Python tests).

#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::{Arc, Mutex};

use djinn_proto::{
    DType, DataMessage, Fingerprint, FrameHeader, HEADER_LEN, Handle, HandleInfo, KeptEntry, KeptMessage, Kind, Limits,
    ListEntry, Message, SessionEntry, SessionMessage, TensorDesc, append_head,
};

/// What the node answers itself; everything else goes to the real node.
#[derive(Debug, Clone, Default)]
pub struct Attack {
    /// Kept-tensor requests (fetch, release, push) answered `kept.Moved` to this address.
    pub kept_moved_to: Option<String>,
    /// Session requests (step, signal, close) answered `sessions.Moved` to this address.
    pub session_moved_to: Option<String>,
    /// Every list (named tensors, kept tensors, sessions) answered with a full page and "more"
    /// for ever: the same page each time (`advancing: false`) or new names each time.
    pub endless_lists: Option<EndlessLists>,
    /// Fetches and gets answered with a tensor of this many bytes, whatever was kept.
    pub oversized_reply: Option<u64>,
}

#[derive(Debug, Clone, Copy)]
pub struct EndlessLists {
    pub advancing: bool,
}

impl Attack {
    /// From command-line arguments: `--kept-moved-to ADDR`, `--session-moved-to ADDR`,
    /// `--endless-lists same|advancing`, `--oversized-reply BYTES`.
    pub fn from_args(mut args: impl Iterator<Item = String>) -> Result<Self, String> {
        let mut attack = Self::default();
        while let Some(flag) = args.next() {
            let value = args.next().ok_or_else(|| format!("{flag} needs a value"))?;
            match flag.as_str() {
                "--kept-moved-to" => attack.kept_moved_to = Some(value),
                "--session-moved-to" => attack.session_moved_to = Some(value),
                "--endless-lists" => attack.endless_lists = Some(EndlessLists { advancing: value == "advancing" }),
                "--oversized-reply" => {
                    attack.oversized_reply = Some(value.parse().map_err(|e| format!("--oversized-reply: {e}"))?)
                }
                other => return Err(format!("unknown flag {other}")),
            }
        }
        Ok(attack)
    }
}

/// A running hostile node; its address is what clients are given.
pub struct HostileNode {
    pub addr: String,
}

impl HostileNode {
    /// Listens on an ephemeral loopback port and relays to the node at `upstream`, in threads
    /// that live as long as the process.
    pub fn start(upstream: &str, attack: Attack) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("address").to_string();
        let upstream = upstream.to_owned();
        std::thread::spawn(move || serve(listener, &upstream, &attack));
        Self { addr }
    }
}

/// Serves every connection `listener` accepts, each in its own threads.
pub fn serve(listener: TcpListener, upstream: &str, attack: &Attack) {
    for client in listener.incoming().flatten() {
        let (upstream, attack) = (upstream.to_owned(), attack.clone());
        std::thread::spawn(move || {
            if let Err(e) = relay(client, &upstream, &attack) {
                eprintln!("hostile node: a connection ended: {e}");
            }
        });
    }
}

struct Frame {
    header: FrameHeader,
    message: Message,
    bytes: Vec<u8>,
}

fn read_frame(stream: &mut TcpStream) -> std::io::Result<Option<Frame>> {
    let mut head = [0u8; HEADER_LEN];
    match stream.read_exact(&mut head) {
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        other => other?,
    }
    let invalid = |e: String| std::io::Error::new(std::io::ErrorKind::InvalidData, e);
    let header = FrameHeader::parse(&head).ok_or_else(|| invalid("a bad frame header".into()))?;
    let rest = u64::from(header.meta_len.get()) + header.payload_len.get();
    let mut bytes = head.to_vec();
    bytes.resize(HEADER_LEN + rest as usize, 0);
    stream.read_exact(&mut bytes[HEADER_LEN..])?;
    let kind = Kind::from_wire(header.kind.get()).ok_or_else(|| invalid("an unknown kind".into()))?;
    let meta = &bytes[HEADER_LEN..HEADER_LEN + header.meta_len.get() as usize];
    let limits = Limits { max_meta: u32::MAX, max_payload: u64::MAX, ..Limits::default() };
    let message = Message::decode(kind, meta, &limits).map_err(|e| invalid(e.to_string()))?;
    Ok(Some(Frame { header, message, bytes }))
}

/// Writes `message` (its payload, if any, all zeros) as the answer to `request_id`.
fn answer(to: &Mutex<TcpStream>, request_id: u64, message: Message) -> std::io::Result<()> {
    let mut head = Vec::new();
    let payload = append_head(&mut head, request_id, &message).map_err(std::io::Error::other)?;
    let mut to = to.lock().expect("writer");
    to.write_all(&head)?;
    let zeros = vec![0u8; 1 << 20];
    let mut left = payload;
    while left > 0 {
        let n = left.min(zeros.len() as u64);
        to.write_all(&zeros[..n as usize])?;
        left -= n;
    }
    Ok(())
}

fn relay(client: TcpStream, upstream: &str, attack: &Attack) -> std::io::Result<()> {
    let mut node = TcpStream::connect(upstream)?;
    let to_client = Arc::new(Mutex::new(client.try_clone()?));
    // The real node's answers go back as they come, a whole frame at a time (the attacker's
    // own answers are written between them).
    let (mut from_node, back) = (node.try_clone()?, Arc::clone(&to_client));
    std::thread::spawn(move || {
        while let Ok(Some(frame)) = read_frame(&mut from_node) {
            if back.lock().expect("writer").write_all(&frame.bytes).is_err() {
                break;
            }
        }
        let _ = back.lock().expect("writer").shutdown(Shutdown::Both);
    });
    let mut from_client = client;
    let mut page = 0u64;
    while let Some(frame) = read_frame(&mut from_client)? {
        let id = frame.header.request_id.get();
        match own_answer(attack, &frame.message, &mut page) {
            Some(message) => answer(&to_client, id, message)?,
            None => node.write_all(&frame.bytes)?,
        }
    }
    node.shutdown(Shutdown::Both)
}

/// What the attacker answers to `request` itself, if anything.
fn own_answer(attack: &Attack, request: &Message, page: &mut u64) -> Option<Message> {
    let small = || TensorDesc::new(DType::F32, vec![4]).expect("a descriptor");
    let info = |handle: Handle| HandleInfo { handle, tensor: small() };
    let kept_named = match request {
        Message::Kept(KeptMessage::Fetch { handle }) => Some(*handle),
        Message::Kept(KeptMessage::Release { handles }) => handles.first().copied(),
        Message::Kept(KeptMessage::Push { .. }) => Some(Handle { id: 1, epoch: 1 }),
        _ => None,
    };
    match request {
        _ if kept_named.is_some() && attack.kept_moved_to.is_some() => {
            Some(KeptMessage::Moved { to: attack.kept_moved_to.clone()?, kept: info(kept_named?) }.into())
        }
        Message::Session(
            SessionMessage::Step { session, .. }
            | SessionMessage::Signal { session, .. }
            | SessionMessage::Close { session },
        ) if attack.session_moved_to.is_some() => {
            Some(SessionMessage::Moved { to: attack.session_moved_to.clone()?, session: *session }.into())
        }
        Message::Data(DataMessage::Get { .. }) | Message::Kept(KeptMessage::Fetch { .. })
            if attack.oversized_reply.is_some() =>
        {
            let bytes = attack.oversized_reply?;
            Some(DataMessage::GetReply { tensor: TensorDesc::new(DType::U8, vec![bytes]).ok()? }.into())
        }
        _ => {
            let endless = attack.endless_lists?;
            // A page of names: new ones each time when advancing, else the same page again.
            let first = if endless.advancing { *page * 64 } else { 0 };
            *page += 1;
            let ids = first..first + 64;
            match request {
                Message::Data(DataMessage::List { .. }) => Some(
                    DataMessage::ListReply {
                        entries: ids.map(|i| ListEntry { name: format!("t{i:012}"), tensor: small() }).collect(),
                        more: true,
                    }
                    .into(),
                ),
                Message::Kept(KeptMessage::List { .. }) => Some(
                    KeptMessage::KeptList {
                        tensors: ids
                            .map(|id| KeptEntry { tenant: String::new(), kept: info(Handle { id: id + 1, epoch: 1 }) })
                            .collect(),
                        more: true,
                    }
                    .into(),
                ),
                Message::Session(SessionMessage::List { .. }) => Some(
                    SessionMessage::SessionList {
                        sessions: ids.map(|id| session_entry(Handle { id: id + 1, epoch: 1 })).collect(),
                        more: true,
                    }
                    .into(),
                ),
                _ => None,
            }
        }
    }
}

fn session_entry(session: Handle) -> SessionEntry {
    SessionEntry { tenant: String::new(), session, fingerprint: Fingerprint([0; 32]), state_bytes: 0 }
}
