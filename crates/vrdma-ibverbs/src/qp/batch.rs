//! The WRs an application builds with the `ibv_wr_*` API between `ibv_wr_start` and
//! `ibv_wr_complete`.

use std::ffi::c_int;

use vrdma::{SendWr, Sge, WrOpcode};

use crate::sys;

/// A work request of a batch that has several, kept until `ibv_wr_complete` (only the last
/// one started is [`Batch::cur`]).
#[derive(Clone, Copy)]
pub(super) struct BatchWr {
    pub(super) wr_id: u64,
    pub(super) remote_addr: u64,
    pub(super) compare_add: u64,
    pub(super) swap: u64,
    pub(super) flags: u32,
    pub(super) imm: u32,
    pub(super) rkey: u32,
    pub(super) opcode: WrOpcode,
    /// The inline bytes (`Batch::inline[inline.0..inline.1]`) are the WR's data, not `sges`.
    pub(super) is_inline: bool,
    /// Ranges of `Batch::sges` and `Batch::inline`.
    pub(super) sges: (u32, u32),
    pub(super) inline: (u32, u32),
    /// Index + 1 into `Batch::ud` (0: none).
    pub(super) ud: u32,
}

/// Capacities reserved when the QP is created, so that building the usual batch (a few
/// WRs, a few SGEs, inline data up to a cache line or two) never allocates.
const BATCH_WRS: usize = 16;
const BATCH_SGES: usize = 16;
const BATCH_INLINE: usize = 1024;

/// Inline data up to this size is kept beside the current WR (`CurStore::bytes`).
pub(super) const SMALL_INLINE: usize = 64;

/// Where the data of the current WR is (what `Batch::spill` copies into the batch's lists).
#[derive(Clone, Copy)]
pub(super) enum CurData {
    None,
    /// `CurStore::sge`.
    OneSge,
    /// `Batch::sges[a..e]`.
    Sges(u32, u32),
    /// The first `n` bytes of `CurStore::bytes`.
    SmallInline(u32),
    /// `Batch::inline[a..e]`.
    Inline(u32, u32),
}

/// The current WR's gather element and small inline data, at a fixed address (its own
/// allocation) that `Batch::cur.sg_list` points to.
pub(super) struct CurStore {
    pub(super) sge: Sge,
    pub(super) bytes: [u8; SMALL_INLINE],
}

/// The WRs built between `ibv_wr_start` and `ibv_wr_complete`. The last one started is kept
/// in the form `Qp::post_send` takes (`cur`), so the usual batch of one WR is posted as it
/// was built, without being copied again; a second WR first moves the current one into
/// `wrs` (`spill`).
pub(super) struct Batch {
    /// The WR being built (meaningful while `has_cur`). Its gather list points into
    /// `store`, `sges` or `inline`, whichever `cur_data` names, and is set again whenever
    /// those may have moved (each `ibv_wr_set_*` call sets it after appending).
    pub(super) cur: SendWr<'static>,
    pub(super) cur_data: CurData,
    /// Index + 1 into `ud` (0: none).
    pub(super) cur_ud: u32,
    pub(super) has_cur: bool,
    pub(super) store: std::ptr::NonNull<CurStore>,
    /// The WRs before `cur` in a batch of several.
    pub(super) wrs: Vec<BatchWr>,
    pub(super) sges: Vec<Sge>,
    pub(super) inline: Vec<u8>,
    /// UD destinations (`ibv_wr_set_ud_addr`).
    pub(super) ud: Vec<(*mut sys::ibv_ah, u32, u32)>,
    /// First error of the batch (reported by `ibv_wr_complete`).
    pub(super) error: c_int,
}

impl Batch {
    pub(super) fn new() -> Batch {
        let store = Box::new(CurStore { sge: Sge { addr: 0, length: 0, lkey: 0 }, bytes: [0; SMALL_INLINE] });
        Batch {
            cur: SendWr::new(0, WrOpcode::Send, &[], 0),
            cur_data: CurData::None,
            cur_ud: 0,
            has_cur: false,
            store: std::ptr::NonNull::from(Box::leak(store)),
            wrs: Vec::with_capacity(BATCH_WRS),
            sges: Vec::with_capacity(BATCH_SGES),
            inline: Vec::with_capacity(BATCH_INLINE),
            ud: Vec::new(),
            error: 0,
        }
    }

    #[inline]
    pub(super) fn clear(&mut self) {
        self.has_cur = false;
        self.wrs.clear();
        self.sges.clear();
        self.inline.clear();
        self.ud.clear();
        self.error = 0;
    }

    /// `cur`'s gather list: `n` (0 or 1) elements at `store.sge`.
    #[inline(always)]
    pub(super) fn point_at_store_sge(&mut self, n: usize) {
        // SAFETY: `store` is our own allocation, alive until the batch is dropped, and the
        // slice is read only through `cur` (by `Qp::post_send`) while the batch lives; it is
        // written only through the raw pointer, never while a post reads it (one builder
        // per QP at a time, verbs contract).
        self.cur.sg_list = unsafe { std::slice::from_raw_parts(&raw const (*self.store.as_ptr()).sge, n) };
    }

    /// Sets or clears `cur`'s INLINE flag with a store of the whole word: a byte-wide store
    /// there (what the compiler would make of `|=`) could not be forwarded to the 4-byte
    /// load of the flags that posting does a few instructions later, which would wait for
    /// the store to reach the cache.
    #[inline(always)]
    pub(super) fn set_inline_flag(&mut self, on: bool) {
        let f = self.cur.send_flags;
        let f = if on { f | vrdma::send_flags::INLINE } else { f & !vrdma::send_flags::INLINE };
        // SAFETY: a valid, aligned place of ours.
        unsafe { std::ptr::write_volatile(&mut self.cur.send_flags, f) };
    }

    /// Moves the current WR into `wrs` (its data into `sges` or `inline`), before another
    /// WR starts.
    #[cold]
    #[inline(never)]
    pub(super) fn spill(&mut self) {
        let c = &self.cur;
        let (s, i) = (self.sges.len() as u32, self.inline.len() as u32);
        let (sges, inline, is_inline) = match self.cur_data {
            CurData::None => ((s, s), (i, i), false),
            CurData::OneSge => {
                // SAFETY: our own allocation (see point_at_store_sge).
                self.sges.push(unsafe { (*self.store.as_ptr()).sge });
                ((s, s + 1), (i, i), false)
            }
            CurData::Sges(a, e) => ((a, e), (i, i), false),
            CurData::SmallInline(n) => {
                // SAFETY: our own allocation; n <= SMALL_INLINE (set by wr_set_inline_data).
                let bytes = unsafe { &(&(*self.store.as_ptr()).bytes)[..n as usize] };
                self.inline.extend_from_slice(bytes);
                ((s, s), (i, i + n), true)
            }
            CurData::Inline(a, e) => ((s, s), (a, e), true),
        };
        self.wrs.push(BatchWr {
            wr_id: c.wr_id,
            remote_addr: c.remote_addr,
            compare_add: c.compare_add,
            swap: c.swap,
            flags: c.send_flags,
            imm: c.imm_data,
            rkey: c.rkey,
            opcode: c.opcode,
            is_inline,
            sges,
            inline,
            ud: self.cur_ud,
        });
        self.has_cur = false;
    }
}

impl Drop for Batch {
    fn drop(&mut self) {
        // SAFETY: `store` came from Box::leak in Batch::new and is freed only here.
        drop(unsafe { Box::from_raw(self.store.as_ptr()) });
    }
}
