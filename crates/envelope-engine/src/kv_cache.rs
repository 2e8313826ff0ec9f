//! The paged KV cache: fixed-size blocks in one pool per layer, and a
//! block allocator that only tracks block ids (vLLM's block manager design,
//! as mistral.rs ports it), so the bookkeeping is tested without tensors.

use crate::precision::KvDtype;
use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

/// Blocks needed to hold `tokens` tokens.
pub fn blocks_for(tokens: usize, block_size: usize) -> usize {
    tokens.div_ceil(block_size)
}

/// Free-list allocator of block ids.
#[derive(Debug, Clone)]
pub struct BlockAllocator {
    free: Vec<u32>,
    total: usize,
}

impl BlockAllocator {
    pub fn new(total: usize) -> BlockAllocator {
        // Hand out low ids first (pop from the end).
        BlockAllocator {
            free: (0..total as u32).rev().collect(),
            total,
        }
    }
    pub fn total(&self) -> usize {
        self.total
    }
    pub fn num_free(&self) -> usize {
        self.free.len()
    }
    pub fn num_used(&self) -> usize {
        self.total - self.free.len()
    }
    /// `n` blocks, or `None` (and nothing taken) when fewer are free.
    pub fn allocate(&mut self, n: usize) -> Option<Vec<u32>> {
        if n > self.free.len() {
            return None;
        }
        let at = self.free.len() - n;
        Some(self.free.split_off(at))
    }
    pub fn release(&mut self, blocks: &mut Vec<u32>) {
        debug_assert!(blocks
            .iter()
            .all(|b| (*b as usize) < self.total && !self.free.contains(b)));
        self.free.append(blocks);
    }
}

/// An element type the cache can hold.
pub trait KvElem: Copy + Send + Sync + Default + 'static {
    /// Whether reading it as f32 needs a buffer (every type but f32).
    const WIDENS: bool = true;
    fn to_f32(self) -> f32;
    fn from_f32(v: f32) -> Self;
    /// `src` as f32: itself when it is f32, else widened into `buf` (as
    /// long as `src`) with the CPU's vector conversion (F16C for f16).
    fn view<'a>(src: &'a [Self], buf: &'a mut [f32]) -> &'a [f32];
    /// `n` rows of `hd` elements, `stride` apart in `src`, as f32 rows and
    /// their stride: `src` itself when it is f32 (which overrides this),
    /// else widened by [`KvElem::view`] into `buf` (`n * hd` long), `hd`
    /// apart.
    #[inline(always)]
    fn rows<'a>(
        src: &'a [Self],
        stride: usize,
        n: usize,
        hd: usize,
        buf: &'a mut [f32],
    ) -> (&'a [f32], usize) {
        for (i, dst) in buf[..n * hd].chunks_exact_mut(hd).enumerate() {
            let wrote = Self::view(&src[i * stride..i * stride + hd], dst).as_ptr();
            debug_assert_eq!(wrote, dst.as_ptr(), "a widening view writes into buf");
        }
        (&buf[..n * hd], hd)
    }
}
impl KvElem for f32 {
    const WIDENS: bool = false;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline(always)]
    fn view<'a>(src: &'a [f32], _: &'a mut [f32]) -> &'a [f32] {
        src
    }
    #[inline(always)]
    fn rows<'a>(
        src: &'a [f32],
        stride: usize,
        n: usize,
        hd: usize,
        _: &'a mut [f32],
    ) -> (&'a [f32], usize) {
        (&src[..(n - 1) * stride + hd], stride)
    }
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        v
    }
}
impl KvElem for f16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    #[inline(always)]
    fn view<'a>(src: &'a [f16], buf: &'a mut [f32]) -> &'a [f32] {
        let buf = &mut buf[..src.len()];
        // Inline F16C on the x86-64-v3 build: `half`'s slice conversion
        // checks the CPU on every call, and attention calls this twice per
        // cached position.
        #[cfg(all(target_arch = "x86_64", target_feature = "f16c"))]
        if src.len().is_multiple_of(8) {
            use std::arch::x86_64::{__m128i, _mm256_cvtph_ps, _mm256_storeu_ps, _mm_loadu_si128};
            for (d, s) in buf.chunks_exact_mut(8).zip(src.chunks_exact(8)) {
                // SAFETY: F16C is enabled at compile time; 8 f16 in, 8 f32 out.
                unsafe {
                    let h = _mm_loadu_si128(s.as_ptr() as *const __m128i);
                    _mm256_storeu_ps(d.as_mut_ptr(), _mm256_cvtph_ps(h));
                }
            }
            return buf;
        }
        src.convert_to_f32_slice(buf);
        buf
    }
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        f16::from_f32(v)
    }
}
impl KvElem for bf16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    #[inline(always)]
    fn view<'a>(src: &'a [bf16], buf: &'a mut [f32]) -> &'a [f32] {
        let buf = &mut buf[..src.len()];
        src.convert_to_f32_slice(buf);
        buf
    }
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        bf16::from_f32(v)
    }
}

/// K and V of one layer, laid out `[block][slot][kv_head][head_dim]`.
pub struct LayerKv<T> {
    pub k: Vec<T>,
    pub v: Vec<T>,
}

pub enum KvStorage {
    F32(Vec<LayerKv<f32>>),
    F16(Vec<LayerKv<f16>>),
    Bf16(Vec<LayerKv<bf16>>),
}

/// Shape of the pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvGeometry {
    pub num_layers: usize,
    pub num_blocks: usize,
    pub block_size: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
}

impl KvGeometry {
    /// Elements in one token's K (or V) of one layer.
    pub fn token_stride(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }
    pub fn layer_elems(&self) -> usize {
        self.num_blocks * self.block_size * self.token_stride()
    }
    /// Offset of (block, slot) in a layer's K or V.
    #[inline(always)]
    pub fn offset(&self, block: u32, slot: usize) -> usize {
        (block as usize * self.block_size + slot) * self.token_stride()
    }
}

pub struct KvPool {
    pub geometry: KvGeometry,
    pub dtype: KvDtype,
    pub storage: KvStorage,
}

impl KvPool {
    /// Allocates the pool. Pages are zero-mapped lazily by the OS, so the
    /// resident size grows as blocks are first written.
    pub fn new(geometry: KvGeometry, dtype: KvDtype) -> KvPool {
        fn layers<T: KvElem>(g: &KvGeometry) -> Vec<LayerKv<T>> {
            (0..g.num_layers)
                .map(|_| LayerKv {
                    k: vec![T::default(); g.layer_elems()],
                    v: vec![T::default(); g.layer_elems()],
                })
                .collect()
        }
        let storage = match dtype {
            KvDtype::F32 => KvStorage::F32(layers(&geometry)),
            KvDtype::F16 => KvStorage::F16(layers(&geometry)),
            KvDtype::Bf16 => KvStorage::Bf16(layers(&geometry)),
        };
        KvPool {
            geometry,
            dtype,
            storage,
        }
    }

    pub fn bytes(&self) -> usize {
        2 * self.geometry.num_layers * self.geometry.layer_elems() * self.dtype.elem_bytes()
    }

    pub fn bytes_per_token(&self) -> usize {
        2 * self.geometry.num_layers * self.geometry.token_stride() * self.dtype.elem_bytes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn views_widen_exactly() {
        let xs: Vec<f32> = (0..64)
            .map(|i| match i {
                0 => f32::INFINITY,
                1 => -0.0,
                2 => 6.1e-5,
                3 => 65504.0,
                _ => (i as f32 - 30.0) * 0.37,
            })
            .collect();
        let mut buf = vec![0f32; 64];
        let h: Vec<f16> = xs.iter().map(|&v| f16::from_f32(v)).collect();
        let got = f16::view(&h, &mut buf).to_vec();
        let want: Vec<f32> = h.iter().map(|v| v.to_f32()).collect();
        assert_eq!(
            got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            want.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        );
        let b: Vec<bf16> = xs.iter().map(|&v| bf16::from_f32(v)).collect();
        let got = bf16::view(&b, &mut buf).to_vec();
        assert_eq!(got, b.iter().map(|v| v.to_f32()).collect::<Vec<_>>());
        assert_eq!(f32::view(&xs, &mut buf), &xs[..]);
        // Rows 16 apart, 8 wide: f32 is read in place, f16 widened row by row.
        let (rows, stride) = f32::rows(&xs, 16, 4, 8, &mut buf);
        assert_eq!((rows.as_ptr(), rows.len(), stride), (xs.as_ptr(), 56, 16));
        let (rows, stride) = f16::rows(&h, 16, 4, 8, &mut buf);
        assert_eq!((rows.len(), stride), (32, 8));
        for i in 0..4 {
            assert_eq!(rows[i * 8..i * 8 + 8], want[i * 16..i * 16 + 8]);
        }
    }

    #[test]
    fn allocator_never_hands_out_a_block_twice() {
        let mut a = BlockAllocator::new(10);
        let mut x = a.allocate(4).unwrap();
        let mut y = a.allocate(6).unwrap();
        assert!(a.allocate(1).is_none());
        assert_eq!(a.num_used(), 10);
        let mut all: Vec<u32> = x.iter().chain(y.iter()).copied().collect();
        all.sort();
        assert_eq!(all, (0..10).collect::<Vec<_>>());
        a.release(&mut x);
        assert!(x.is_empty());
        assert_eq!(a.num_free(), 4);
        assert!(a.allocate(5).is_none(), "a failed allocation takes nothing");
        assert_eq!(a.num_free(), 4);
        a.release(&mut y);
        assert_eq!(a.num_free(), 10);
    }

    #[test]
    fn block_math() {
        assert_eq!(blocks_for(0, 16), 0);
        assert_eq!(blocks_for(1, 16), 1);
        assert_eq!(blocks_for(16, 16), 1);
        assert_eq!(blocks_for(17, 16), 2);
        let g = KvGeometry {
            num_layers: 30,
            num_blocks: 4,
            block_size: 16,
            num_kv_heads: 3,
            head_dim: 64,
        };
        let p = KvPool::new(g, KvDtype::F16);
        // SmolLM2: 2 x 30 layers x 3 heads x 64 dims x 2 bytes per token.
        assert_eq!(p.bytes_per_token(), 23_040);
        assert_eq!(p.bytes(), 23_040 * 64);
        assert_eq!(g.offset(2, 3), (2 * 16 + 3) * 192);
    }
}
