//! The element types NCCL reduces, and how dist's reduce ops map to NCCL's.

use cudarc::driver::DeviceRepr;
use dist_nccl_sys::{ncclDataType_t, version_code};
use half::{bf16, f16};

/// An element type NCCL can move and reduce.
pub trait NcclType: DeviceRepr + Copy + Send + Sync + 'static {
    /// NCCL's code for it.
    const NCCL: ncclDataType_t;
    /// Its name in errors and tables.
    const NAME: &'static str;
    /// The oldest NCCL that has the type.
    const MIN_VERSION: i32 = 0;
    /// `s` as one element, in the bytes NCCL reads for a host-immediate `PreMulSum` scalar
    /// (`None` where dist does not convert to the type).
    fn scalar(s: f64) -> Option<Vec<u8>>;
}

macro_rules! nccl_type {
    ($t:ty, $n:ident, $name:expr, $conv:expr) => {
        impl NcclType for $t {
            const NCCL: ncclDataType_t = ncclDataType_t::$n;
            const NAME: &'static str = $name;
            fn scalar(s: f64) -> Option<Vec<u8>> {
                let f: fn(f64) -> $t = $conv;
                Some(f(s).to_ne_bytes().to_vec())
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
// the device's fp8 types are.
unsafe impl DeviceRepr for F8E4M3 {}
// SAFETY: as above.
unsafe impl DeviceRepr for F8E5M2 {}

impl NcclType for F8E4M3 {
    const NCCL: ncclDataType_t = ncclDataType_t::ncclFloat8e4m3;
    const NAME: &'static str = "f8e4m3";
    const MIN_VERSION: i32 = version_code(2, 24, 0);
    fn scalar(_: f64) -> Option<Vec<u8>> {
        None
    }
}

impl NcclType for F8E5M2 {
    const NCCL: ncclDataType_t = ncclDataType_t::ncclFloat8e5m2;
    const NAME: &'static str = "f8e5m2";
    const MIN_VERSION: i32 = version_code(2, 24, 0);
    fn scalar(_: f64) -> Option<Vec<u8>> {
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
        assert_eq!(f32::scalar(0.5).unwrap(), 0.5f32.to_ne_bytes());
        assert_eq!(bf16::scalar(2.0).unwrap().len(), 2);
        assert_eq!(i64::scalar(3.0).unwrap(), 3i64.to_ne_bytes());
        assert_eq!(F8E4M3::scalar(1.0), None);
    }
}
