//! The element types NCCL reduces, and how dist's reduce ops map to NCCL's.

use cudarc::driver::DeviceRepr;
use dist_core::DType;
use dist_nccl_sys::ncclDataType_t;
use half::{bf16, f16};

/// An element type NCCL can move and reduce.
pub trait NcclType: DeviceRepr + Copy + Send + Sync + 'static {
    /// NCCL's code for it.
    const NCCL: ncclDataType_t;
    /// dist's tag for it.
    const DTYPE: DType;
}

macro_rules! nccl_type {
    ($t:ty, $n:ident, $d:expr) => {
        impl NcclType for $t {
            const NCCL: ncclDataType_t = ncclDataType_t::$n;
            const DTYPE: DType = $d;
        }
    };
}

nccl_type!(i8, ncclInt8, DType::I8);
nccl_type!(u8, ncclUint8, DType::U8);
nccl_type!(i32, ncclInt32, DType::I32);
nccl_type!(u32, ncclUint32, DType::U32);
nccl_type!(i64, ncclInt64, DType::I64);
nccl_type!(u64, ncclUint64, DType::U64);
nccl_type!(f16, ncclFloat16, DType::F16);
nccl_type!(f32, ncclFloat32, DType::F32);
nccl_type!(f64, ncclFloat64, DType::F64);
nccl_type!(bf16, ncclBfloat16, DType::BF16);

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
    }
}
