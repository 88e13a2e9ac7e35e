//! Acknowledging asynchronous events of QPs and SRQs, with the mutex, cond and
//! `events_completed` that libibverbs embeds in both: `ibv_ack_async_event` counts up, and
//! destroying the object waits until every event reported about it is counted.

use crate::sys;

/// A verbs object with libibverbs' fields for acknowledging its asynchronous events.
pub(crate) trait EventsCompleted {
    /// Its mutex, cond and `events_completed`.
    ///
    /// # Safety
    /// `this` points to a live object of ours.
    unsafe fn ack_fields(this: *mut Self) -> (*mut libc::pthread_mutex_t, *mut libc::pthread_cond_t, *mut u32);
}

macro_rules! events_completed {
    ($($object:ty),+) => {$(
        impl EventsCompleted for $object {
            unsafe fn ack_fields(this: *mut Self) -> (*mut libc::pthread_mutex_t, *mut libc::pthread_cond_t, *mut u32) {
                // SAFETY: the caller's contract: the fields are in bounds of a live object
                // (bindgen's mutex and cond types have libc's layout).
                unsafe {
                    (
                        std::ptr::addr_of_mut!((*this).mutex).cast(),
                        std::ptr::addr_of_mut!((*this).cond).cast(),
                        std::ptr::addr_of_mut!((*this).events_completed),
                    )
                }
            }
        }
    )+};
}

events_completed!(sys::ibv_qp, sys::ibv_srq);

/// Waits until `reported` events of `object` are acknowledged (its `events_completed`).
///
/// # Safety
/// `object` is a live QP or SRQ of ours (its mutex and cond initialised at creation).
pub(crate) unsafe fn wait_events_acknowledged<T: EventsCompleted>(object: *mut T, reported: u32) {
    // SAFETY: the caller's contract.
    unsafe {
        let (m, c, completed) = T::ack_fields(object);
        libc::pthread_mutex_lock(m);
        // Read afresh each time: `event_acknowledged` changes it while we wait.
        while std::ptr::read_volatile(completed) < reported {
            libc::pthread_cond_wait(c, m);
        }
        libc::pthread_mutex_unlock(m);
    }
}

/// `ibv_ack_async_event` of an event of `object`.
///
/// # Safety
/// `object` is a live QP or SRQ of ours that an unacknowledged event named.
pub(crate) unsafe fn event_acknowledged<T: EventsCompleted>(object: *mut T) {
    // SAFETY: the caller's contract.
    unsafe {
        let (m, c, completed) = T::ack_fields(object);
        libc::pthread_mutex_lock(m);
        *completed += 1;
        libc::pthread_cond_signal(c);
        libc::pthread_mutex_unlock(m);
    }
}
