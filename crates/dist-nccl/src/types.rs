//! The element types NCCL reduces, and how dist's reduce ops map to NCCL's.

use cudarc::driver::DeviceRepr;
use dist_nccl_sys::{ncclDataType_t, version_code};
use half::{bf16, f16};

mod sealed {
    /// Only this crate implements [`super::NcclType`]: NCCL reads and writes `count` elements of
    /// the size its data type code says, so a type whose size differs would let it run past the
    /// buffer.
    pub trait Sealed {}
}

/// An element type NCCL can move and reduce. Sealed: only this crate's impls exist, each with
/// the size NCCL's data type has (checked by [`nccl_size`] in the tests and before each call).
///
/// ```compile_fail,E0277
/// // A user type cannot claim to be an NCCL type.
/// #[derive(Clone, Copy)]
/// struct Wide([u8; 3]);
/// unsafe impl cudarc::driver::DeviceRepr for Wide {}
/// impl dist_nccl::NcclType for Wide {
///     const NCCL: dist_nccl_sys::ncclDataType_t = dist_nccl_sys::ncclDataType_t::ncclUint8;
///     const NAME: &'static str = "wide";
///     fn scalar(_: f64) -> Option<[u8; 8]> { None }
/// }
/// ```
pub trait NcclType: sealed::Sealed + DeviceRepr + Copy + Send + Sync + 'static {
    /// NCCL's code for it.
    const NCCL: ncclDataType_t;
    /// Its name in errors and tables.
    const NAME: &'static str;
    /// The oldest NCCL that has the type.
    const MIN_VERSION: i32 = 0;
    /// `s` as one element, in the first `size_of::<Self>()` bytes, the bytes NCCL reads for a
    /// host-immediate `PreMulSum` scalar (`None` where dist does not convert to the type).
    fn scalar(s: f64) -> Option<[u8; 8]>;
}

/// The size in bytes of one element of NCCL's data type `t` (`None` for a code dist does not
/// know).
pub fn nccl_size(t: ncclDataType_t) -> Option<usize> {
    match t.0 {
        0 | 1 | 10 | 11 => Some(1),
        6 | 9 => Some(2),
        2 | 3 | 7 => Some(4),
        4 | 5 | 8 => Some(8),
        _ => None,
    }
}

/// Whether `T`'s size is NCCL's for its code, which every call checks before NCCL sees a count.
pub(crate) fn size_matches<T: NcclType>() -> bool {
    nccl_size(T::NCCL) == Some(std::mem::size_of::<T>())
}

/// The `PreMulSum` scalar for `T`: exactly one element's bytes, or why not.
pub(crate) fn scalar_for<T: NcclType>(s: f64) -> Result<[u8; 8], String> {
    let bytes = T::scalar(s).ok_or_else(|| format!("PreMulSum is not offered for {}", T::NAME))?;
    scalar_fits(T::NAME, std::mem::size_of::<T>(), T::NCCL).map(|()| bytes)
}

/// NCCL reads `nccl_size(code)` bytes of a host-immediate scalar: refuse where that is not one
/// element of `size` bytes (or more than the 8 bytes the scalar holds).
fn scalar_fits(name: &str, size: usize, code: ncclDataType_t) -> Result<(), String> {
    match nccl_size(code) {
        Some(n) if n == size && n <= 8 => Ok(()),
        n => Err(format!(
            "the PreMulSum scalar of {name} is {size} bytes, NCCL reads {n:?} for data type {}",
            code.0
        )),
    }
}

fn pad<const N: usize>(b: [u8; N]) -> [u8; 8] {
    let mut out = [0u8; 8];
    out[..N].copy_from_slice(&b);
    out
}

macro_rules! nccl_type {
    ($t:ty, $n:ident, $name:expr, $conv:expr) => {
        impl sealed::Sealed for $t {}
        impl NcclType for $t {
            const NCCL: ncclDataType_t = ncclDataType_t::$n;
            const NAME: &'static str = $name;
            fn scalar(s: f64) -> Option<[u8; 8]> {
                let f: fn(f64) -> $t = $conv;
                Some(pad(f(s).to_ne_bytes()))
            }
        }
    };
}

nccl_type!(i8, ncclInt8, "i8", |s| s as i8);
nccl_type!(u8, ncclUint8, "u8", |s| s as u8);
nccl_type!(i32, ncclInt32, "i32", |s| s as i32);
nccl_type!(u32, ncclUint32, "u32", |s| s as u32);
nccl_type!(i64, ncclInt64, "i64", |s| s as i64);
nccl_type!(u64, ncclUint64, "u64", |s| s as u64);
nccl_type!(f16, ncclFloat16, "f16", f16::from_f64);
nccl_type!(f32, ncclFloat32, "f32", |s| s as f32);
nccl_type!(f64, ncclFloat64, "f64", |s| s);
nccl_type!(bf16, ncclBfloat16, "bf16", bf16::from_f64);

/// An 8-bit float, 4 exponent and 3 mantissa bits (OCP E4M3, CUDA's `__nv_fp8_e4m3`), as its
/// bits. NCCL 2.24 or newer reduces it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[repr(transparent)]
pub struct F8E4M3(pub u8);

/// An 8-bit float, 5 exponent and 2 mantissa bits (OCP E5M2, CUDA's `__nv_fp8_e5m2`), as its
/// bits. NCCL 2.24 or newer reduces it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[repr(transparent)]
pub struct F8E5M2(pub u8);

// SAFETY: both are one plain byte (repr(transparent) over u8), valid for every bit pattern, as
// the device's fp8 types are (the multirank trial `nccl_init_all_fp8` copies both to a device
// and back).
unsafe impl DeviceRepr for F8E4M3 {}
// SAFETY: as above (same trial).
unsafe impl DeviceRepr for F8E5M2 {}

impl sealed::Sealed for F8E4M3 {}
impl sealed::Sealed for F8E5M2 {}

impl NcclType for F8E4M3 {
    const NCCL: ncclDataType_t = ncclDataType_t::ncclFloat8e4m3;
    const NAME: &'static str = "f8e4m3";
    const MIN_VERSION: i32 = version_code(2, 24, 0);
    fn scalar(_: f64) -> Option<[u8; 8]> {
        None
    }
}

impl NcclType for F8E5M2 {
    const NCCL: ncclDataType_t = ncclDataType_t::ncclFloat8e5m2;
    const NAME: &'static str = "f8e5m2";
    const MIN_VERSION: i32 = version_code(2, 24, 0);
    fn scalar(_: f64) -> Option<[u8; 8]> {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_match_ncclh() {
        assert_eq!(<i8 as NcclType>::NCCL.0, 0);
        assert_eq!(<u8 as NcclType>::NCCL.0, 1);
        assert_eq!(<i32 as NcclType>::NCCL.0, 2);
        assert_eq!(<u32 as NcclType>::NCCL.0, 3);
        assert_eq!(<i64 as NcclType>::NCCL.0, 4);
        assert_eq!(<u64 as NcclType>::NCCL.0, 5);
        assert_eq!(<f16 as NcclType>::NCCL.0, 6);
        assert_eq!(<f32 as NcclType>::NCCL.0, 7);
        assert_eq!(<f64 as NcclType>::NCCL.0, 8);
        assert_eq!(<bf16 as NcclType>::NCCL.0, 9);
        assert_eq!(<F8E4M3 as NcclType>::NCCL.0, 10);
        assert_eq!(<F8E5M2 as NcclType>::NCCL.0, 11);
        assert_eq!(F8E4M3::MIN_VERSION, 22400);
        assert_eq!(std::mem::size_of::<F8E5M2>(), 1);
    }

    #[test]
    fn scalars_have_the_element_size() {
        assert_eq!(f32::scalar(0.5).unwrap()[..4], 0.5f32.to_ne_bytes());
        assert_eq!(
            bf16::scalar(2.0).unwrap()[..2],
            bf16::from_f64(2.0).to_ne_bytes()
        );
        assert_eq!(i64::scalar(3.0).unwrap(), 3i64.to_ne_bytes());
        assert_eq!(F8E4M3::scalar(1.0), None);
        assert!(scalar_for::<f16>(1.0).is_ok());
        assert_eq!(
            scalar_for::<F8E5M2>(1.0).unwrap_err(),
            "PreMulSum is not offered for f8e5m2"
        );
    }

    /// Every impl's size is NCCL's size for its code (a mismatch would let NCCL read or write
    /// past a buffer); fails if an impl names the wrong code.
    #[test]
    fn every_type_has_nccls_element_size() {
        fn check<T: NcclType>() {
            assert!(size_matches::<T>(), "{}", T::NAME);
        }
        check::<i8>();
        check::<u8>();
        check::<i32>();
        check::<u32>();
        check::<i64>();
        check::<u64>();
        check::<f16>();
        check::<f32>();
        check::<f64>();
        check::<bf16>();
        check::<F8E4M3>();
        check::<F8E5M2>();
        assert_eq!(nccl_size(ncclDataType_t(99)), None);
    }

    /// A scalar whose length is not NCCL's element size is refused, not read out of bounds.
    #[test]
    fn a_scalar_of_the_wrong_length_is_refused() {
        assert_eq!(scalar_fits("f32", 4, ncclDataType_t::ncclFloat32), Ok(()));
        let e = scalar_fits("x", 2, ncclDataType_t::ncclFloat64).unwrap_err();
        assert!(e.contains("is 2 bytes, NCCL reads Some(8)"), "{e}");
        assert!(scalar_fits("y", 4, ncclDataType_t(42)).is_err());
    }
}
