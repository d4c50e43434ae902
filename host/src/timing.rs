//! Timing with CUDA events, for the benchmark binary and users who profile their own calls.

use crate::device::Device;
use crate::error::Result;
use cudarc::driver::sys::CUevent_flags;

/// Runs `f` `warmup` times, then `reps` times with a pair of events around each run on the
/// device's stream, and returns the per-run times in milliseconds, sorted.
pub fn time_ms(
    dev: &Device,
    warmup: usize,
    reps: usize,
    mut f: impl FnMut() -> Result<()>,
) -> Result<Vec<f32>> {
    for _ in 0..warmup {
        f()?;
    }
    dev.synchronize()?;
    let mut times = Vec::with_capacity(reps);
    for _ in 0..reps {
        let start = dev
            .stream()
            .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
        f()?;
        let end = dev
            .stream()
            .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
        end.synchronize()?;
        times.push(start.elapsed_ms(&end)?);
    }
    times.sort_by(f32::total_cmp);
    Ok(times)
}

/// The median of sorted times.
pub fn median(sorted: &[f32]) -> f32 {
    if sorted.is_empty() {
        return f32::NAN;
    }
    sorted[sorted.len() / 2]
}
