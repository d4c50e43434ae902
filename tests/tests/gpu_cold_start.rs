//! Cold start: how long `Device::new` plus the first forward call take in a fresh process
//! (run with `CUDA_CACHE_DISABLE=1` to measure without the driver's JIT cache). The time is
//! reported, not asserted (speed targets live in the benchmark); the test checks that the
//! first call's result is right. Its own test binary, so nothing else warms the process up.

use flash_attn::cpu::{attention_naive, attention_reference};
use flash_attn::shape::AttnShape;
use flash_attn::{flash_attn, flash_attn_into, AttnParams, Device, DeviceTensor};
use flash_attn_tests::{check_accuracy, random_qkv, to_f64, Magnitude};
use half::bf16;
use rand::SeedableRng;
use std::io::Write;
use std::time::Instant;

#[test]
fn device_new_plus_first_forward() {
    let t0 = Instant::now();
    let dev = match Device::new(0) {
        Ok(d) => d,
        Err(e) => {
            if std::env::var("FLASH_ATTN_REQUIRE_GPU").is_ok_and(|v| v == "1") {
                panic!("FLASH_ATTN_REQUIRE_GPU=1 but no usable GPU: {e}");
            }
            let _ = writeln!(
                std::io::stderr(),
                "\n***** SKIPPED: gpu_cold_start did not run: no CUDA device/driver on this machine ({e}) *****\n"
            );
            return;
        }
    };
    let t_new = t0.elapsed();
    let shape = AttnShape {
        batch: 1,
        seqlen_q: 512,
        seqlen_k: 512,
        heads_q: 8,
        heads_kv: 8,
        head_dim: 128,
    };
    let params = AttnParams {
        causal: true,
        softmax_scale: None,
        ..AttnParams::default()
    };
    let mut rng = rand::rngs::StdRng::seed_from_u64(1);
    let (q, k, v) = random_qkv::<bf16>(&mut rng, &shape, Magnitude::Normal, 0.088);
    let up = |a: &ndarray::Array4<bf16>| DeviceTensor::from_ndarray(&dev, a.view()).unwrap();
    let (qd, kd, vd) = (up(&q), up(&k), up(&v));
    let mut o = DeviceTensor::<bf16>::zeros(&dev, &shape.q_dims()).unwrap();
    let mut lse = DeviceTensor::<f32>::zeros(&dev, &shape.lse_dims()).unwrap();
    o.fill_nan(&dev).unwrap();
    lse.fill_nan(&dev).unwrap();
    dev.synchronize().unwrap();
    let t1 = Instant::now();
    flash_attn_into(&dev, &qd, &kd, &vd, &params, &mut o, &mut lse).unwrap();
    dev.synchronize().unwrap();
    let t_first = t1.elapsed();
    let t2 = Instant::now();
    let _again = flash_attn(&dev, &qd, &kd, &vd, &params).unwrap();
    dev.synchronize().unwrap();
    let t_second = t2.elapsed();
    let _ =
        writeln!(
        std::io::stderr(),
        "COLD START on {} ({}, {}): Device::new {:.1} ms + first forward (bf16, d=128, causal, \
         512 tokens × 8 heads) {:.1} ms = {:.1} ms; second call {:.2} ms; CUDA_CACHE_DISABLE={}",
        dev.name().unwrap_or_default(),
        dev.ptx_arch(),
        if dev.uses_sass() { "embedded SASS" } else { "PTX JIT" },
        t_new.as_secs_f64() * 1e3,
        t_first.as_secs_f64() * 1e3,
        (t_new + t_first).as_secs_f64() * 1e3,
        t_second.as_secs_f64() * 1e3,
        std::env::var("CUDA_CACHE_DISABLE").unwrap_or_else(|_| "unset".into()),
    );
    let o = o.to_ndarray(&dev).unwrap();
    let lse = lse.to_ndarray(&dev).unwrap();
    let reference = attention_reference(
        to_f64(q.view()).view(),
        to_f64(k.view()).view(),
        to_f64(v.view()).view(),
        &params,
    )
    .unwrap();
    let naive = attention_naive(q.view(), k.view(), v.view(), &params).unwrap();
    check_accuracy(
        (
            o.view().into_dimensionality().unwrap(),
            lse.view().into_dimensionality().unwrap(),
        ),
        (naive.0.view(), naive.1.view()),
        (reference.0.view(), reference.1.view()),
    )
    .unwrap();
}
