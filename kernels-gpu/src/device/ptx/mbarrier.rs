//! Shared-memory transaction barriers (`mbarrier`, sm_90 forms): the handshake between the
//! thread that starts TMA copies and the warps that read what they bring. A barrier is 8 bytes
//! of shared memory; each of its phases completes when the expected number of arrivals has
//! arrived and the expected number of bytes (`expect_tx`) has landed. Waits name the phase by
//! its parity.

use core::arch::asm;

/// Sets up the barrier at shared address `bar` to expect `count` arrivals per phase
/// (`mbarrier.init.shared::cta.b64`).
///
/// # Safety
/// sm_90 only; `bar` is 8-byte aligned shared memory no thread uses yet. Publish with
/// [`fence_mbarrier_init`] and a block barrier before any other thread or a copy uses it.
#[inline(always)]
pub unsafe fn mbarrier_init(bar: u32, count: u32) {
    asm!(
        "mbarrier.init.shared::cta.b64 [{b}], {c};",
        b = in(reg32) bar,
        c = in(reg32) count,
        options(nostack)
    );
}

/// Makes the barriers this thread initialised visible to the async proxy (the TMA engine's
/// `complete_tx`) (`fence.mbarrier_init.release.cluster`).
///
/// # Safety
/// sm_90 only.
#[inline(always)]
pub unsafe fn fence_mbarrier_init() {
    asm!("fence.mbarrier_init.release.cluster;", options(nostack));
}

/// Arrives on `bar` and adds `bytes` to the transactions its current phase waits for
/// (`mbarrier.arrive.expect_tx.shared::cta.b64`): called by the thread that then starts copies
/// of that many bytes completing on `bar`.
///
/// # Safety
/// sm_90 only; `bar` is an initialised barrier.
#[inline(always)]
pub unsafe fn mbarrier_arrive_expect_tx(bar: u32, bytes: u32) {
    asm!(
        "mbarrier.arrive.expect_tx.shared::cta.b64 _, [{b}], {n};",
        b = in(reg32) bar,
        n = in(reg32) bytes,
        options(nostack)
    );
}

/// Arrives on `bar` with release semantics if `arrive` holds: this thread's earlier accesses
/// of the memory the barrier guards are done (`@p mbarrier.arrive.shared::cta.b64`). The
/// condition is a predicate on the instruction, not a branch, so one lane per warp can arrive
/// without a divergent path among `wgmma`s (which ptxas would serialize).
///
/// # Safety
/// sm_90 only; `bar` is an initialised barrier.
#[inline(always)]
pub unsafe fn mbarrier_arrive_if(bar: u32, arrive: bool) {
    asm!(
        "{{ .reg .pred p; setp.ne.u32 p, {a}, 0; @p mbarrier.arrive.shared::cta.b64 _, [{b}]; }}",
        a = in(reg32) arrive as u32,
        b = in(reg32) bar,
        options(nostack)
    );
}

/// Waits until the phase of `bar` with parity `parity` has completed
/// (`mbarrier.try_wait.parity.shared::cta.b64`, acquire, retried until it succeeds): the
/// memory the barrier guards (copies included) is then visible to this thread. Waiting on
/// parity 1 of a fresh barrier returns at once (the phase before its first counts as
/// complete), which starts a ring of "slot free" barriers with every slot free.
///
/// The retry loop is inside the `asm` block (its label scoped by the braces) and its branch
/// is `bra.uni`: the lanes of a warp read the same barrier phase in one instruction, so they
/// agree, and ptxas must be told, or it takes the loop for a divergent path and serializes
/// every `wgmma` after it (its C7520 report; seen on the forward kernels with a plain `bra`,
/// and with a Rust loop around one `try_wait`).
///
/// # Safety
/// sm_90 only; `bar` is an initialised barrier.
#[inline(always)]
#[allow(named_asm_labels)] // scoped by the `{ }` block, so each inlined copy has its own
pub unsafe fn mbarrier_wait(bar: u32, parity: u32) {
    asm!(
        "{{ .reg .pred p; MBAR_WAIT: mbarrier.try_wait.parity.shared::cta.b64 p, [{b}], {ph}; @!p bra.uni MBAR_WAIT; }}",
        b = in(reg32) bar,
        ph = in(reg32) parity,
        options(nostack)
    );
}
