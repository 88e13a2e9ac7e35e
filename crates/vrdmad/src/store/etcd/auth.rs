//! etcd users (`auth enable`): the password is exchanged for a token once, the token goes
//! with every request, and a token etcd stops accepting is replaced once and the request
//! retried.

use parking_lot::Mutex;
use serde_json::json;

use super::client::Client;
use super::error::EtcdError;
use super::json::{from_json, AuthenticateResp};
use super::security::Credentials;

/// Longest auth token accepted from etcd (its simple and JWT tokens are far shorter).
const MAX_TOKEN: usize = 4096;

/// Whether an auth token from etcd can go into a request header as it is.
fn valid_token(t: &str) -> bool {
    !t.is_empty() && t.len() <= MAX_TOKEN && t.bytes().all(|b| b.is_ascii_graphic())
}

/// Whether etcd refused a request for its auth token (invalid or expired token, auth
/// changed since it was issued, or none sent while auth is on): authenticating again fixes
/// it. The gateway maps gRPC's Unauthenticated to 401, the rest to 400 with these messages.
fn token_rejected(e: &EtcdError) -> bool {
    match e {
        EtcdError::Status { status: 401, .. } => true,
        EtcdError::Status { message, .. } => {
            ["invalid auth token", "revision of auth store is old", "user name is empty"].iter().any(|m| message.contains(m))
        }
        _ => false,
    }
}

/// Runs `req` with the current token (authenticating first when there is none); when etcd
/// rejects the token, authenticates again and retries once. Concurrent callers share one
/// authentication: whoever holds the lock refreshes, the others use the fresh token.
fn with_token<T>(
    token: &Mutex<Option<String>>,
    mut authenticate: impl FnMut() -> Result<String, EtcdError>,
    mut req: impl FnMut(&str) -> Result<T, EtcdError>,
) -> Result<T, EtcdError> {
    let current = {
        let mut t = token.lock();
        match &*t {
            Some(t) => t.clone(),
            None => t.insert(authenticate()?).clone(),
        }
    };
    match req(&current) {
        Err(e) if token_rejected(&e) => {
            let fresh = {
                let mut t = token.lock();
                match &*t {
                    // Someone else already replaced the rejected token.
                    Some(t) if *t != current => t.clone(),
                    _ => {
                        log::info!("etcd: auth token refused ({e}); authenticating again");
                        *t = None;
                        t.insert(authenticate()?).clone()
                    }
                }
            };
            req(&fresh)
        }
        r => r,
    }
}

impl Client {
    /// Runs `req` with the user's token when credentials are configured.
    pub(super) fn authorized<T>(&self, req: impl FnMut(&str) -> Result<T, EtcdError>) -> Result<T, EtcdError> {
        let Some(cred) = &self.security.credentials else {
            let mut req = req;
            return req("");
        };
        with_token(&self.token, || self.authenticate(cred), req)
    }

    /// Exchanges the user's password for a token (`""` if etcd has auth disabled: then no
    /// token is needed, and one is fetched once etcd asks for it).
    fn authenticate(&self, cred: &Credentials) -> Result<String, EtcdError> {
        let body = json!({"name": cred.user, "password": cred.password.expose()});
        match self.call_with("/v3/auth/authenticate", &body, "") {
            Ok(b) => {
                let r: AuthenticateResp = from_json(&b)?;
                if r.token.is_empty() {
                    return Err(EtcdError::Auth { user: cred.user.clone(), message: "no token in etcd's reply".into() });
                }
                // It goes into a header of every request: printable ASCII and bounded, or a
                // reply could inject headers (or a whole request) into the next ones.
                if !valid_token(&r.token) {
                    return Err(EtcdError::Auth { user: cred.user.clone(), message: "malformed token in etcd's reply".into() });
                }
                Ok(r.token)
            }
            Err(EtcdError::Status { message, .. }) if message.contains("authentication is not enabled") => {
                log::debug!("etcd: auth is not enabled; requests go without a token");
                Ok(String::new())
            }
            Err(EtcdError::Status { message, .. }) => Err(EtcdError::Auth { user: cred.user.clone(), message }),
            Err(e) => Err(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_that_could_break_a_header_are_refused() {
        assert!(valid_token("DjUwMVxJ.abc-123_~"));
        assert!(valid_token("eyJhbGciOiJSUzI1NiJ9.eyJ1c2VybmFtZSI6InZyZG1hIn0.c2ln"));
        for bad in ["", "a\r\nX-Injected: 1", "a b", "tok\n", "t\u{e9}"] {
            assert!(!valid_token(bad), "{bad:?}");
        }
        assert!(!valid_token(&"a".repeat(MAX_TOKEN + 1)));
    }

    fn refused(status: u16, message: &str) -> EtcdError {
        EtcdError::Status { endpoint: "e:1".into(), status, message: message.into() }
    }

    #[test]
    fn token_is_fetched_once_and_refreshed_once_when_refused() {
        let token = Mutex::new(None);
        let auths = std::cell::Cell::new(0);
        let authenticate = || {
            auths.set(auths.get() + 1);
            Ok(format!("t{}", auths.get()))
        };
        // First use authenticates; later ones reuse the token.
        assert_eq!(with_token(&token, authenticate, |t| Ok(t.to_string())).unwrap(), "t1");
        assert_eq!(with_token(&token, authenticate, |t| Ok(t.to_string())).unwrap(), "t1");
        assert_eq!(auths.get(), 1);
        // An expired token: authenticate again, retry with the new one.
        for msg in ["etcdserver: invalid auth token", "etcdserver: revision of auth store is old", "etcdserver: user name is empty"] {
            let before = auths.get();
            let mut seen = Vec::new();
            let r = with_token(&token, authenticate, |t| {
                seen.push(t.to_string());
                if seen.len() == 1 {
                    Err(refused(400, msg))
                } else {
                    Ok(())
                }
            });
            assert!(r.is_ok(), "{msg}");
            assert_eq!(auths.get(), before + 1);
            assert_eq!(seen, vec![format!("t{before}"), format!("t{}", before + 1)]);
        }
        // Refused twice: the second refusal is the answer (no loop).
        let calls = std::cell::Cell::new(0);
        let r: Result<(), _> = with_token(&token, authenticate, |_| {
            calls.set(calls.get() + 1);
            Err(refused(401, "unauthenticated"))
        });
        assert!(matches!(r, Err(EtcdError::Status { status: 401, .. })));
        assert_eq!(calls.get(), 2);
        // Other errors are not about the token.
        let before = auths.get();
        let r: Result<(), _> = with_token(&token, authenticate, |_| Err(refused(400, "etcdserver: permission denied")));
        assert!(r.is_err());
        assert_eq!(auths.get(), before);
        // A failed authentication is the answer, and the next call tries again.
        let none = Mutex::new(None);
        let r: Result<(), _> = with_token(&none, || Err(EtcdError::Auth { user: "u".into(), message: "bad".into() }), |_| Ok(()));
        assert!(matches!(r, Err(EtcdError::Auth { .. })));
        assert!(none.lock().is_none());
    }
}
