//! Push grants: one-time capabilities a node gives a tenant, so that another node may make one
//! delivery into the tenant's memory here (a kept tensor, a moved session) and do nothing else.
//! Pushing nodes carry no credential of their own: they present the grant in their hello.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use djinn_auth::TenantId;
use djinn_proto::{ErrorCode, Fingerprint, KeptMessage, Message, SessionMessage, TensorDesc};

use crate::Reply;

/// How long a push grant stays good, and how many a tenant may hold at once.
pub const GRANT_TTL: Duration = Duration::from_secs(60);
pub const MAX_GRANTS_PER_TENANT: usize = 64;

/// What a grant lets another node deliver.
#[derive(Debug, Clone, PartialEq)]
pub enum Delivery {
    /// One tensor of this description, kept (`kept.Keep`).
    Tensor(TensorDesc),
    /// A session of this model, moved here (`sessions.Open`, with its state).
    Session(Fingerprint),
}

impl Delivery {
    /// Whether `message` is the delivery granted.
    pub fn is(&self, message: &Message) -> bool {
        match (self, message) {
            (Self::Tensor(granted), Message::Kept(KeptMessage::Keep { tensor })) => tensor == granted,
            (Self::Session(granted), Message::Session(SessionMessage::Open { fingerprint, .. })) => {
                fingerprint == granted
            }
            _ => false,
        }
    }
}

/// A grant given and not used yet: whose, for which tenant name it is presented, what it lets
/// through, and until when.
#[derive(Debug)]
struct Grant {
    tenant: TenantId,
    name: String,
    delivery: Delivery,
    expires: Instant,
}

/// The grants given and not used yet, by their secret.
#[derive(Debug, Default)]
pub struct Grants(HashMap<String, Grant>);

impl Grants {
    /// Gives `tenant` (named `name` to other nodes) a grant for `delivery`, good until `now` +
    /// [`GRANT_TTL`]: its secret, or why not.
    pub fn give(&mut self, tenant: TenantId, name: String, delivery: Delivery, now: Instant) -> Reply {
        self.0.retain(|_, g| g.expires > now);
        if self.0.values().filter(|g| g.tenant == tenant).count() >= MAX_GRANTS_PER_TENANT {
            return Reply::error(
                ErrorCode::QuotaExceeded,
                format!("{MAX_GRANTS_PER_TENANT} push grants of this tenant are outstanding already"),
            );
        }
        let secret = match random_secret() {
            Ok(secret) => secret,
            Err(e) => return Reply::error(ErrorCode::Internal, format!("no randomness for a grant: {e}")),
        };
        self.0.insert(secret.clone(), Grant { tenant, name, delivery, expires: now + GRANT_TTL });
        Reply::message(KeptMessage::PushGranted { grant: secret })
    }

    /// Takes the grant `secret` presented for the tenant named `name`, when it is one, unexpired:
    /// the tenant and what it lets through. A secret presented is spent, whatever the name.
    pub fn redeem(&mut self, secret: &str, name: &str, now: Instant) -> Option<(TenantId, Delivery)> {
        let grant = self.0.remove(secret)?;
        (grant.expires > now && grant.name == name).then_some((grant.tenant, grant.delivery))
    }
}

/// 32 bytes from the system's random source, in hex.
fn random_secret() -> std::io::Result<String> {
    let mut bytes = [0u8; 32];
    // SAFETY: a writable buffer of the length given.
    let n = unsafe { libc::getrandom(bytes.as_mut_ptr().cast(), bytes.len(), 0) };
    if n != bytes.len() as isize {
        return Err(std::io::Error::last_os_error());
    }
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use djinn_proto::DType;

    fn secret_of(reply: Reply) -> String {
        match reply.message {
            Message::Kept(KeptMessage::PushGranted { grant }) => grant,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_grant_is_one_delivery_for_the_tenant_named_until_it_expires() {
        let mut grants = Grants::default();
        let now = Instant::now();
        let tensor = TensorDesc::new(DType::F32, vec![2]).unwrap();
        let delivery = Delivery::Tensor(tensor.clone());
        let secret = secret_of(grants.give(TenantId(1), "alice".into(), delivery.clone(), now));
        assert_eq!(secret.len(), 64);
        assert!(grants.redeem(&secret, "bob", now).is_none(), "for alice only");
        assert!(grants.redeem(&secret, "alice", now).is_none(), "a secret presented is spent");
        let secret = secret_of(grants.give(TenantId(1), "alice".into(), delivery.clone(), now));
        assert_eq!(grants.redeem(&secret, "alice", now), Some((TenantId(1), delivery.clone())));
        assert!(grants.redeem(&secret, "alice", now).is_none(), "once");
        let secret = secret_of(grants.give(TenantId(1), "alice".into(), delivery.clone(), now));
        assert!(grants.redeem(&secret, "alice", now + GRANT_TTL).is_none(), "expired");
        assert!(delivery.is(&KeptMessage::Keep { tensor }.into()));
        let other = TensorDesc::new(DType::F32, vec![3]).unwrap();
        assert!(!delivery.is(&KeptMessage::Keep { tensor: other }.into()), "another tensor is not the one granted");
    }

    #[test]
    fn a_tenants_outstanding_grants_are_bounded_and_expired_ones_make_room() {
        let mut grants = Grants::default();
        let now = Instant::now();
        let delivery = Delivery::Session(Fingerprint::of_blocks(&[[0u8]]));
        for _ in 0..MAX_GRANTS_PER_TENANT {
            secret_of(grants.give(TenantId(1), "alice".into(), delivery.clone(), now));
        }
        let refused = grants.give(TenantId(1), "alice".into(), delivery.clone(), now);
        assert!(matches!(
            refused.message,
            Message::Data(djinn_proto::DataMessage::Error { code: ErrorCode::QuotaExceeded, .. })
        ));
        secret_of(grants.give(TenantId(2), "bob".into(), delivery.clone(), now));
        secret_of(grants.give(TenantId(1), "alice".into(), delivery, now + GRANT_TTL));
    }
}
