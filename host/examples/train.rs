//! Training with our forward and backward on the GPU: one causal attention layer whose
//! queries, keys and values are learned by gradient descent so that its output matches a
//! target made by another, hidden layer. Prints the falling loss.
//!
//! `cargo run --release -p flash-attn --example train` (needs a CUDA GPU; on a machine without
//! one it says so and exits).

use flash_attn::{flash_attn, flash_attn_backward, AttnParams, BwdMode, Device, DeviceTensor};
use half::bf16;
use ndarray::{Array4, Zip};

/// Deterministic pseudo-random values in [-1, 1).
fn random(shape: [usize; 4], seed: u64) -> Array4<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    Array4::from_shape_simple_fn(shape, || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    })
}

fn main() -> flash_attn::Result<()> {
    let dev = match Device::new(0) {
        Ok(d) => d,
        Err(e) => {
            println!("no usable GPU ({e}): this example trains on the GPU only");
            return Ok(());
        }
    };
    let (b, n, h, h_kv, d) = (2, 256, 8, 2, 64);
    let params = AttnParams {
        causal: true,
        softmax_scale: None,
        ..AttnParams::default()
    };
    let up = |a: &Array4<f32>| DeviceTensor::from_ndarray(&dev, a.mapv(bf16::from_f32).view());
    let down = |t: &DeviceTensor<bf16>| -> flash_attn::Result<Array4<f32>> {
        let a = t.to_ndarray(&dev)?.mapv(f32::from);
        Ok(a.into_dimensionality().expect("rank 4"))
    };
    // The hidden layer that makes the target.
    let target = {
        let (q, k, v) = (
            random([b, n, h, d], 1),
            random([b, n, h_kv, d], 2),
            random([b, n, h_kv, d], 3),
        );
        let (o, _) = flash_attn(&dev, &up(&q)?, &up(&k)?, &up(&v)?, &params)?;
        down(&o)?
    };
    // The layer we train, from another starting point.
    let mut q = random([b, n, h, d], 11);
    let mut k = random([b, n, h_kv, d], 12);
    let mut v = random([b, n, h_kv, d], 13);
    // Normalised gradient descent (each tensor's step has RMS `lr`): robust to the scale of
    // the gradients, so no tuning is needed for this demo.
    let lr = 0.02;
    for step in 0..=200 {
        let (qd, kd, vd) = (up(&q)?, up(&k)?, up(&v)?);
        let (o, lse) = flash_attn(&dev, &qd, &kd, &vd, &params)?;
        // loss = mean((O − target)²);  dL/dO = 2 (O − target) / count
        let diff = down(&o)? - &target;
        let count = diff.len() as f32;
        let loss = diff.iter().map(|x| x * x).sum::<f32>() / count;
        if step % 20 == 0 {
            println!("step {step:3}  loss {loss:.6}");
        }
        let d_o = up(&diff.mapv(|x| 2.0 * x / count))?;
        let (dq, dk, dv) =
            flash_attn_backward(&dev, &qd, &kd, &vd, &o, &d_o, &lse, &params, BwdMode::Fast)?;
        for (param, grad) in [(&mut q, dq), (&mut k, dk), (&mut v, dv)] {
            let grad = down(&grad)?;
            let rms = (grad.iter().map(|g| g * g).sum::<f32>() / grad.len() as f32).sqrt();
            let step = lr / (rms + 1e-12);
            Zip::from(param).and(&grad).for_each(|p, g| *p -= step * g);
        }
    }
    Ok(())
}
