//! The CPU property tests' checks of one random [`Case`]: the tiled backend's forward and
//! backward against the float64 references under the accuracy rules.

use crate::{
    check_accuracy, check_gradient_accuracy, head_major, random_array, random_qkv, to_f64, Case,
};
use flash_attn::cpu::{
    attention_backward_cpu, attention_backward_naive, attention_backward_reference,
    attention_backward_reference_given, attention_cpu, attention_naive, attention_reference,
};
use flash_attn::{Element, FlashError};
use rand::rngs::StdRng;
use rand::SeedableRng;

/// Runs one case in its element type and applies the accuracy rule.
pub fn cpu_forward_case<T: Element>(case: &Case) -> Result<(), String> {
    let mut rng = StdRng::seed_from_u64(case.seed);
    let scale = case
        .params
        .scale(case.shape.head_dim)
        .map_err(|e| e.to_string())?;
    let (mut q, mut k, mut v) = random_qkv::<T>(&mut rng, &case.shape, case.magnitude, scale);
    if case.head_major {
        (q, k, v) = (
            head_major(q.view()),
            head_major(k.view()),
            head_major(v.view()),
        );
    }
    let p = &case.params;
    let fail = |e: FlashError| e.to_string();
    let ours = attention_cpu(q.view(), k.view(), v.view(), p).map_err(fail)?;
    let naive = attention_naive(q.view(), k.view(), v.view(), p).map_err(fail)?;
    let (q64, k64, v64) = (to_f64(q.view()), to_f64(k.view()), to_f64(v.view()));
    let reference = attention_reference(q64.view(), k64.view(), v64.view(), p).map_err(fail)?;
    check_accuracy(
        (ours.0.view(), ours.1.view()),
        (naive.0.view(), naive.1.view()),
        (reference.0.view(), reference.1.view()),
    )
}

/// Runs one case in its element type (forward then backward on the CPU) and applies the
/// accuracy rule to dQ, dK and dV.
pub fn cpu_backward_case<T: Element>(case: &Case) -> Result<(), String> {
    let mut rng = StdRng::seed_from_u64(case.seed);
    let fail = |e: FlashError| e.to_string();
    let scale = case.params.scale(case.shape.head_dim).map_err(fail)?;
    let (mut q, mut k, mut v) = random_qkv::<T>(&mut rng, &case.shape, case.magnitude, scale);
    let mut d_o = random_array::<T>(&mut rng, case.shape.q_dims(), 1.0);
    if case.head_major {
        (q, k, v, d_o) = (
            head_major(q.view()),
            head_major(k.view()),
            head_major(v.view()),
            head_major(d_o.view()),
        );
    }
    let p = &case.params;
    let (o, lse) = attention_cpu(q.view(), k.view(), v.view(), p).map_err(fail)?;
    let ours = attention_backward_cpu(
        q.view(),
        k.view(),
        v.view(),
        o.view(),
        d_o.view(),
        lse.view(),
        p,
    )
    .map_err(fail)?;
    let naive =
        attention_backward_naive(q.view(), k.view(), v.view(), d_o.view(), p).map_err(fail)?;
    let wide = [&q, &k, &v, &d_o].map(|a| to_f64(a.view()));
    let reference = attention_backward_reference(
        wide[0].view(),
        wide[1].view(),
        wide[2].view(),
        wide[3].view(),
        p,
    )
    .map_err(fail)?;
    let (o64, lse64) = (to_f64(o.view()), to_f64(lse.view()));
    let given = attention_backward_reference_given(
        wide[0].view(),
        wide[1].view(),
        wide[2].view(),
        o64.view(),
        wide[3].view(),
        lse64.view(),
        p,
    )
    .map_err(fail)?;
    check_gradient_accuracy(
        2.0,
        [ours.0.view(), ours.1.view(), ours.2.view()],
        [naive.0.view(), naive.1.view(), naive.2.view()],
        [given.0.view(), given.1.view(), given.2.view()],
        [reference.0.view(), reference.1.view(), reference.2.view()],
    )
}
