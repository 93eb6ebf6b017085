//! Portable versions of the AVX2 kernels with the same arithmetic, so results do not depend on
//! the CPU: a block's 32 products are summed as integers in 8 lanes of 4 consecutive elements,
//! each lane is multiply-added in f32 into its own accumulator, and the lanes are combined with
//! [`hsum8`](super::hsum8).

use super::{f16_at, hsum8, BlockQ8};

pub fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let n8 = a.len() / 8 * 8;
    for (ca, cb) in a[..n8].chunks_exact(8).zip(b[..n8].chunks_exact(8)) {
        for l in 0..8 {
            acc[l] = ca[l].mul_add(cb[l], acc[l]);
        }
    }
    let mut s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for i in n8..a.len() {
        s = a[i].mul_add(b[i], s);
    }
    s
}

/// `acc[l] += d · Σ w(4l..4l+4)·x(4l..4l+4)`, with `w(i)` the block's i-th weight value.
#[inline]
fn block(acc: &mut [f32; 8], d: f32, w: impl Fn(usize) -> i32, x: &[i8; 32]) {
    for (l, a) in acc.iter_mut().enumerate() {
        let lane: i32 = (4 * l..4 * l + 4).map(|i| w(i) * x[i] as i32).sum();
        *a = d.mul_add(lane as f32, *a);
    }
}

/// Element `i` of a 4-bit block: low nibbles hold elements 0..16, high nibbles 16..32.
#[inline]
fn nibble(qs: &[u8], i: usize) -> i32 {
    if i < 16 {
        (qs[i] & 0x0F) as i32
    } else {
        (qs[i - 16] >> 4) as i32
    }
}

pub fn dot_q8_0(w: &[u8], x: &[BlockQ8]) -> f32 {
    let mut acc = [0f32; 8];
    for (b, xb) in w.chunks_exact(34).zip(x) {
        block(&mut acc, f16_at(b, 0) * xb.d, |i| (b[2 + i] as i8) as i32, &xb.qs);
    }
    hsum8(&acc)
}

pub fn dot_q4_0(w: &[u8], x: &[BlockQ8]) -> f32 {
    let mut acc = [0f32; 8];
    for (b, xb) in w.chunks_exact(18).zip(x) {
        block(&mut acc, f16_at(b, 0) * xb.d, |i| nibble(&b[2..18], i) - 8, &xb.qs);
    }
    hsum8(&acc)
}

pub fn dot_q4_1(w: &[u8], x: &[BlockQ8]) -> f32 {
    let mut acc = [0f32; 8];
    let mut mins = 0f32;
    for (b, xb) in w.chunks_exact(20).zip(x) {
        block(&mut acc, f16_at(b, 0) * xb.d, |i| nibble(&b[4..20], i), &xb.qs);
        mins = f16_at(b, 2).mul_add(xb.sum, mins);
    }
    hsum8(&acc) + mins
}
