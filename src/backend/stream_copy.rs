//! Copies into memory the CPU is not expected to read again soon with non-temporal
//! (streaming) stores, which write whole cache lines without first reading them in.
#![allow(unsafe_code)]

/// Copies `src` into `dst` (equal lengths) with streaming stores where the CPU has them and
/// `dst` is 16-byte aligned; with a plain copy otherwise.
pub fn copy_streaming(dst: &mut [u8], src: &[u8]) {
    assert_eq!(
        dst.len(),
        src.len(),
        "a copy between slices of unequal length"
    );
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};
        if dst.as_ptr() as usize % 16 == 0 {
            let whole = dst.len() / 64 * 64;
            let (dst_whole, dst_tail) = dst.split_at_mut(whole);
            let (src_whole, src_tail) = src.split_at(whole);
            for (d, s) in dst_whole
                .chunks_exact_mut(64)
                .zip(src_whole.chunks_exact(64))
            {
                // SAFETY: SSE2 is part of x86_64. `s` and `d` are 64 bytes each; the loads
                // are unaligned loads of 16 bytes within `s`, and the stores write 16 bytes
                // within `d`, which starts a multiple of 64 bytes past `dst`'s 16-byte
                // aligned start (checked above), as the aligned stores require.
                unsafe {
                    let sp = s.as_ptr().cast::<__m128i>();
                    let dp = d.as_mut_ptr().cast::<__m128i>();
                    let a = _mm_loadu_si128(sp);
                    let b = _mm_loadu_si128(sp.add(1));
                    let c = _mm_loadu_si128(sp.add(2));
                    let e = _mm_loadu_si128(sp.add(3));
                    _mm_stream_si128(dp, a);
                    _mm_stream_si128(dp.add(1), b);
                    _mm_stream_si128(dp.add(2), c);
                    _mm_stream_si128(dp.add(3), e);
                }
            }
            dst_tail.copy_from_slice(src_tail);
            if whole > 0 {
                // SAFETY: SSE2 is part of x86_64; the fence orders the streaming stores
                // before every later store (the lock's release), so a reader that takes the
                // lock next sees the data.
                unsafe { _mm_sfence() };
            }
            return;
        }
    }
    dst.copy_from_slice(src);
}

#[cfg(test)]
mod tests {
    use super::copy_streaming;
    use proptest::prelude::*;

    proptest! {
        /// Every length and alignment of either side copies exactly `src` into `dst`, and
        /// touches nothing around it.
        #[test]
        fn a_streaming_copy_equals_a_plain_one(
            len in 0usize..9000,
            dst_at in 0usize..80,
            src_at in 0usize..80,
            seed in any::<u8>(),
        ) {
            let src: Vec<u8> = (0..len + src_at).map(|i| (i as u8).wrapping_mul(31) ^ seed).collect();
            let mut dst = vec![0xa5u8; len + dst_at + 64];
            copy_streaming(&mut dst[dst_at..dst_at + len], &src[src_at..]);
            prop_assert_eq!(&dst[dst_at..dst_at + len], &src[src_at..]);
            prop_assert!(dst[..dst_at].iter().all(|&b| b == 0xa5));
            prop_assert!(dst[dst_at + len..].iter().all(|&b| b == 0xa5));
        }
    }

    /// The streaming path itself is taken for an aligned destination (a pooled buffer is
    /// page-aligned), and the data is whole after it.
    #[test]
    fn an_aligned_page_is_copied_whole() {
        let mut dst = crate::buffer::Buffer::take(4096);
        let src: Vec<u8> = (0..4096u32).map(|i| (i % 251) as u8).collect();
        assert_eq!(dst.as_mut().as_ptr() as usize % 16, 0);
        copy_streaming(dst.as_mut(), &src);
        assert_eq!(dst.as_mut(), &src[..]);
    }
}
