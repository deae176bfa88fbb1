//! The principals' document (a token file, or the value of the etcd key every process watches),
//! as `Authenticator::from_json` and `update` read it:
//! - no input panics;
//! - a document that is accepted is a JSON object whose every principal is an object (its quota
//!   too, where it has one: serde would read a struct from an array of its fields, no name
//!   checked) with a name, a role and tokens, each of which verifies to that principal, and
//!   nothing else verifies;
//! - reading the same document again changes nothing;
//! - a second document that is refused leaves the first one's principals exactly as they were;
//!   one that is accepted replaces them, and a tenant named in both keeps its number.
//!
//! Input layout: the first document, then (after the first 0xFF byte, which no JSON text holds)
//! the second.

use djinn_auth::{AuthError, Authenticator, Origin, Principal};
use serde_json::Value;

/// Every (token, name, role) of a document the authenticator accepted.
fn tokens(document: &[u8]) -> Vec<(String, String, String)> {
    let value: Value = serde_json::from_slice(document).expect("an accepted document is JSON");
    let mut out = Vec::new();
    for p in value["principals"].as_array().expect("an accepted document lists principals") {
        assert!(p.is_object(), "an accepted principal is an object: {p}");
        assert!(p.get("quota").is_none_or(Value::is_object), "an accepted quota is an object: {p}");
        let name = p["name"].as_str().expect("every principal is named").to_owned();
        let role = p.get("role").map_or("tenant", |r| r.as_str().expect("a role is a string")).to_owned();
        for token in p["tokens"].as_array().expect("every principal has tokens") {
            out.push((token.as_str().expect("a token is a string").to_owned(), name.clone(), role.clone()));
        }
    }
    out
}

fn check(auth: &Authenticator, expected: &[(String, String, String)]) -> Vec<(String, Principal)> {
    let mut verified = Vec::new();
    for (token, name, role) in expected {
        let p = auth.verify(token).unwrap_or_else(|e| panic!("a configured token of {name:?} is refused: {e}"));
        assert_eq!((&*p.name, p.role.name()), (name.as_str(), role.as_str()));
        verified.push((name.clone(), p));
    }
    assert_eq!(auth.verify(""), Err(AuthError::Missing));
    verified
}

pub fn run(data: &[u8]) {
    let (first, second) = match data.iter().position(|&b| b == 0xff) {
        Some(i) => (&data[..i], Some(&data[i + 1..])),
        None => (data, None),
    };
    let Ok(auth) = Authenticator::from_json(Origin::Elsewhere("fuzz".into()), first) else { return };
    let expected = tokens(first);
    let before = check(&auth, &expected);
    // A string that is no configured token does not verify.
    let guess = String::from_utf8_lossy(first).into_owned();
    if !expected.iter().any(|(t, _, _)| *t == guess) {
        assert_eq!(auth.verify(&guess), Err(AuthError::Invalid));
    }
    assert!(!auth.update(first).expect("the same document again"), "nothing changed");
    let Some(second) = second else { return };
    match auth.update(second) {
        Err(_) => {
            assert_eq!(check(&auth, &expected), before, "a refused document changed the principals");
        }
        Ok(_) => {
            let after = check(&auth, &tokens(second));
            for (name, p) in &after {
                if let Some((_, old)) = before.iter().find(|(n, _)| n == name) {
                    assert_eq!(p.tenant, old.tenant, "{name:?} was renumbered");
                }
            }
        }
    }
}
