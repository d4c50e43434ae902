//! The README's example: forward attention on the GPU when there is one, on the CPU otherwise.
//!
//! `cargo run --release -p flash-attn --example quickstart`

use flash_attn::{cpu, flash_attn, AttnParams, Device, DeviceTensor};
use half::f16;
use ndarray::Array4;

fn main() -> flash_attn::Result<()> {
    // Q is [batch, seqlen_q, heads_q, head_dim]; K and V are [batch, seqlen_k, heads_kv, head_dim]
    // (heads_q a multiple of heads_kv: GQA / MQA).
    let (b, n, h, h_kv, d) = (2, 1000, 8, 2, 128);
    let q: Vec<f16> = (0..b * n * h * d)
        .map(|i| f16::from_f32((i % 7) as f32 * 0.1))
        .collect();
    let kv: Vec<f16> = (0..b * n * h_kv * d)
        .map(|i| f16::from_f32(((i % 5) as f32 - 2.0) * 0.1))
        .collect();
    let params = AttnParams {
        causal: true,
        softmax_scale: None, // 1/sqrt(head_dim)
        ..AttnParams::default()
    };

    match Device::new(0) {
        Ok(dev) => {
            let q_dev = DeviceTensor::from_host(&dev, &[b, n, h, d], &q)?;
            let k_dev = DeviceTensor::from_host(&dev, &[b, n, h_kv, d], &kv)?;
            let v_dev = DeviceTensor::from_host(&dev, &[b, n, h_kv, d], &kv)?;
            // O: [b, n, h, d] in f16; LSE: [b, h, n] in f32 (natural log).
            let (o, lse) = flash_attn(&dev, &q_dev, &k_dev, &v_dev, &params)?;
            let o: Vec<f16> = o.to_host(&dev)?;
            let lse: Vec<f32> = lse.to_host(&dev)?;
            println!(
                "GPU ({}): o[0] = {}, lse[0] = {}",
                dev.ptx_arch(),
                o[0],
                lse[0]
            );
        }
        Err(e) => {
            // No driver or no sm_80+ GPU: the CPU backend runs the same algorithm.
            eprintln!("no GPU ({e}); using the CPU backend");
            let q = Array4::from_shape_vec([b, n, h, d], q).expect("shape matches data");
            let kv = Array4::from_shape_vec([b, n, h_kv, d], kv).expect("shape matches data");
            let (o, lse) = cpu::attention_cpu(q.view(), kv.view(), kv.view(), &params)?;
            println!(
                "CPU: o[0] = {}, lse[0] = {}",
                o[[0, 0, 0, 0]],
                lse[[0, 0, 0]]
            );
        }
    }
    Ok(())
}
