//! `vrdma-ibverbs`: vrdma's drop-in `libibverbs.so.1`.
//!
//! A cdylib exporting the C ABI of Debian's rdma-core 44 libibverbs — the same symbols with
//! the same versions (`exports.txt`, applied by `build.rs`), and the exact layouts of the
//! structures applications read and write (`sys.rs`, generated from `<infiniband/verbs.h>`)
//! — over the [`vrdma`] verbs library. Binaries linked against Debian's libibverbs run
//! unchanged when the dynamic linker finds this library first (`LD_LIBRARY_PATH`, which
//! `vrdma run` sets).
//!
//! Every object handed to the application is a `#[repr(C)]` box whose first field is the C
//! structure (`ibv_qp_ex` for QPs, `verbs_context` for contexts, so that the header's static
//! inline functions find what they look for), followed by the Rust object it wraps. The
//! static inline data-path functions (`ibv_post_send`, `ibv_poll_cq`, …) call through the
//! context's `ops` table and the QP's `ibv_qp_ex` function pointers straight into this
//! library.
//!
//! Verbs vrdma does not support fail the way libibverbs fails for a device without them:
//! `EOPNOTSUPP` (returned, or as errno with a NULL result). Set `VRDMA_IBV_DEBUG=1` to have
//! every failing verb explain itself on stderr.

pub mod ah;
mod async_ack;
pub mod cq;
pub mod device;
pub mod mr;
pub mod qp;
pub mod srq;
pub mod strings;
pub mod stubs;
pub mod sys;

use std::sync::OnceLock;

/// Failures of the drop-in itself (those of the verbs library carry their own errno).
#[derive(Debug, thiserror::Error)]
pub enum DropInError {
    /// The verbs library failed; its errno passes through.
    #[error(transparent)]
    Verbs(#[from] vrdma::Error),
    /// A verb, or an option of one, that vrdma does not implement (EOPNOTSUPP).
    #[error("{op}: not supported by vrdma ({what})")]
    Unsupported {
        /// The C function called.
        op: &'static str,
        /// What of it is unsupported.
        what: String,
    },
    /// The application passed a bad argument (EINVAL).
    #[error("{op}: invalid argument: {reason}")]
    Invalid {
        /// The C function called.
        op: &'static str,
        /// What is wrong with the argument.
        reason: String,
    },
}

impl DropInError {
    /// The errno libibverbs reports for this failure.
    pub fn errno(&self) -> i32 {
        match self {
            DropInError::Verbs(e) => e.errno(),
            DropInError::Unsupported { .. } => libc::EOPNOTSUPP,
            DropInError::Invalid { .. } => libc::EINVAL,
        }
    }
}

pub(crate) fn unsupported(op: &'static str, what: impl Into<String>) -> DropInError {
    DropInError::Unsupported { op, what: what.into() }
}

pub(crate) fn invalid(op: &'static str, reason: impl Into<String>) -> DropInError {
    DropInError::Invalid { op, reason: reason.into() }
}

/// Sets the calling thread's errno.
pub(crate) fn set_errno(e: i32) {
    // SAFETY: __errno_location returns the calling thread's errno slot, always valid.
    unsafe { *libc::__errno_location() = e };
}

fn debug() -> bool {
    static DEBUG: OnceLock<bool> = OnceLock::new();
    *DEBUG.get_or_init(|| std::env::var_os("VRDMA_IBV_DEBUG").is_some_and(|v| !v.is_empty() && v != "0"))
}

/// Reports a failed verb (on stderr with `VRDMA_IBV_DEBUG`; connection refusals always, since
/// applications only print "failed to modify QP") and returns its errno.
#[cold]
#[inline(never)]
pub(crate) fn fail(e: &DropInError) -> i32 {
    let refused = matches!(e, DropInError::Verbs(vrdma::Error::Refused { errno, .. })
        if *errno == libc::ECONNREFUSED || *errno == libc::EHOSTUNREACH);
    if debug() || refused {
        eprintln!("libibverbs (vrdma): {e}");
    }
    e.errno()
}

/// A post verb's failure: points `*bad_wr` (if the caller passed it) at the WR that failed and
/// returns the errno of `e`.
///
/// # Safety
/// `bad_wr` is null or writable.
#[cold]
pub(crate) unsafe fn reject_wr<W>(bad_wr: *mut *mut W, wr: *mut W, e: &DropInError) -> i32 {
    if !bad_wr.is_null() {
        // SAFETY: non-null and writable (the caller's contract).
        unsafe { *bad_wr = wr };
    }
    fail(e)
}

/// Returns `Err`'s errno (after reporting it) or 0: the convention of verbs returning int.
pub(crate) fn rc(r: Result<(), DropInError>) -> i32 {
    match r {
        Ok(()) => 0,
        Err(e) => fail(&e),
    }
}

/// Returns the pointer, or NULL with errno set: the convention of verbs creating objects.
pub(crate) fn ptr<T>(r: Result<*mut T, DropInError>) -> *mut T {
    match r {
        Ok(p) => p,
        Err(e) => {
            let n = fail(&e);
            set_errno(n);
            std::ptr::null_mut()
        }
    }
}

/// Runs `f`, turning a panic into `fallback` (with errno EIO) instead of unwinding into C.
pub(crate) fn guard<T>(fallback: T, f: impl FnOnce() -> T) -> T {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(v) => v,
        Err(_) => {
            set_errno(libc::EIO);
            fallback
        }
    }
}

/// Initialises a `pthread_mutex_t` and `pthread_cond_t` embedded in a verbs object, as
/// libibverbs does for the application (some wait on them around async events).
///
/// # Safety
/// Both pointers must point to writable storage of their type.
pub(crate) unsafe fn init_sync(mutex: *mut sys::pthread_mutex_t, cond: Option<*mut sys::pthread_cond_t>) {
    // SAFETY: the caller guarantees writable storage; the bindgen types have libc's layout.
    unsafe {
        libc::pthread_mutex_init(mutex.cast::<libc::pthread_mutex_t>(), std::ptr::null());
        if let Some(c) = cond {
            libc::pthread_cond_init(c.cast::<libc::pthread_cond_t>(), std::ptr::null());
        }
    }
}
