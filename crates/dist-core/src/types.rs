//! Element types and reduce operations, and the reduction kernels the collectives run.

use half::{bf16, f16};

/// The element types dist moves and reduces.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
#[repr(u8)]
pub enum DType {
    /// `f32`
    F32 = 1,
    /// `f64`
    F64 = 2,
    /// IEEE half precision ([`half::f16`]).
    F16 = 3,
    /// bfloat16 ([`half::bf16`]).
    BF16 = 4,
    /// `i8`
    I8 = 5,
    /// `u8`
    U8 = 6,
    /// `i32`
    I32 = 7,
    /// `u32`
    U32 = 8,
    /// `i64`
    I64 = 9,
    /// `u64`
    U64 = 10,
}

impl DType {
    /// Every element type.
    pub const ALL: [DType; 10] = [
        DType::F32,
        DType::F64,
        DType::F16,
        DType::BF16,
        DType::I8,
        DType::U8,
        DType::I32,
        DType::U32,
        DType::I64,
        DType::U64,
    ];

    /// Size of one element in bytes.
    pub const fn size(self) -> usize {
        match self {
            DType::I8 | DType::U8 => 1,
            DType::F16 | DType::BF16 => 2,
            DType::F32 | DType::I32 | DType::U32 => 4,
            DType::F64 | DType::I64 | DType::U64 => 8,
        }
    }

    /// Whether this is a floating-point type.
    pub const fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F64 | DType::F16 | DType::BF16)
    }

    /// The short name used in tables (`float`, `half`, `int32`, …), as nccl-tests prints them.
    pub const fn name(self) -> &'static str {
        match self {
            DType::F32 => "float",
            DType::F64 => "double",
            DType::F16 => "half",
            DType::BF16 => "bfloat16",
            DType::I8 => "int8",
            DType::U8 => "uint8",
            DType::I32 => "int32",
            DType::U32 => "uint32",
            DType::I64 => "int64",
            DType::U64 => "uint64",
        }
    }

    /// Parses a name as [`DType::name`] prints it, or the Rust name (`f32`, `bf16`, `u64`).
    pub fn parse(s: &str) -> Option<DType> {
        DType::ALL
            .into_iter()
            .find(|d| d.name() == s || d.rust_name() == s)
    }

    /// The Rust name of the element type (`f32`, `bf16`, …).
    pub const fn rust_name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::I8 => "i8",
            DType::U8 => "u8",
            DType::I32 => "i32",
            DType::U32 => "u32",
            DType::I64 => "i64",
            DType::U64 => "u64",
        }
    }

    /// The type with this wire code.
    pub fn from_code(code: u8) -> Option<DType> {
        DType::ALL.into_iter().find(|d| *d as u8 == code)
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.rust_name())
    }
}

/// How a reduction combines the ranks' values.
#[derive(Clone, Copy, Debug, PartialEq)]
#[non_exhaustive]
pub enum ReduceOp {
    /// Sum.
    Sum,
    /// Product.
    Prod,
    /// Minimum; a NaN anywhere gives NaN.
    Min,
    /// Maximum; a NaN anywhere gives NaN.
    Max,
    /// Sum divided by the number of ranks (integer division for integers).
    Avg,
    /// Each rank's input multiplied by the scalar, then summed.
    PreMulSum(f64),
    /// Bitwise and (integers only).
    BitAnd,
    /// Bitwise or (integers only).
    BitOr,
    /// Bitwise exclusive or (integers only).
    BitXor,
}

impl ReduceOp {
    /// Every reduce op, in code order; `PreMulSum` stands for any scalar (as `PreMulSum(1.0)`).
    pub const ALL: [ReduceOp; 9] = [
        ReduceOp::Sum,
        ReduceOp::Prod,
        ReduceOp::Min,
        ReduceOp::Max,
        ReduceOp::Avg,
        ReduceOp::PreMulSum(1.0),
        ReduceOp::BitAnd,
        ReduceOp::BitOr,
        ReduceOp::BitXor,
    ];

    /// A short name for tables and error messages.
    pub const fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Prod => "prod",
            ReduceOp::Min => "min",
            ReduceOp::Max => "max",
            ReduceOp::Avg => "avg",
            ReduceOp::PreMulSum(_) => "premulsum",
            ReduceOp::BitAnd => "band",
            ReduceOp::BitOr => "bor",
            ReduceOp::BitXor => "bxor",
        }
    }

    /// A wire code; `PreMulSum`'s scalar travels separately.
    pub const fn code(self) -> u8 {
        match self {
            ReduceOp::Sum => 1,
            ReduceOp::Prod => 2,
            ReduceOp::Min => 3,
            ReduceOp::Max => 4,
            ReduceOp::Avg => 5,
            ReduceOp::PreMulSum(_) => 6,
            ReduceOp::BitAnd => 7,
            ReduceOp::BitOr => 8,
            ReduceOp::BitXor => 9,
        }
    }

    /// The op whose [`code`](ReduceOp::code) is `code`, if any. The code has no room for
    /// `PreMulSum`'s scalar: code 6 gives `PreMulSum(1.0)`.
    pub fn from_code(code: u8) -> Option<ReduceOp> {
        ReduceOp::ALL.into_iter().find(|op| op.code() == code)
    }

    /// Whether the op applies to `dtype`: the bitwise ops are for integers only.
    pub fn check(self, dtype: DType) -> std::result::Result<(), String> {
        match self {
            ReduceOp::BitAnd | ReduceOp::BitOr | ReduceOp::BitXor if dtype.is_float() => Err(
                format!("reduce op {} is not defined for {dtype}", self.name()),
            ),
            _ => Ok(()),
        }
    }
}

impl std::fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ReduceOp::PreMulSum(s) => write!(f, "premulsum({s})"),
            _ => f.write_str(self.name()),
        }
    }
}

mod sealed {
    /// Only this crate implements [`super::Element`]: the collectives and typed receives divide
    /// by `size_of::<T>()` and trust that it equals `T::DTYPE.size()`, which a zero-sized or
    /// mislabelled type from outside would break.
    pub trait Sealed {}
}

/// An element type that dist can send and reduce. Sealed: only the ten types of [`DType`]
/// implement it, each of the size its `DTYPE` names (checked by a test below).
///
/// ```compile_fail,E0277
/// // A user type (here zero-sized) cannot become an element type.
/// #[derive(Clone, Copy, Debug, PartialEq)]
/// struct Nothing;
/// unsafe impl bytemuck::Zeroable for Nothing {}
/// unsafe impl bytemuck::Pod for Nothing {}
/// impl dist_core::Element for Nothing {
///     const DTYPE: dist_core::DType = dist_core::DType::U8;
///     fn reduce_into(
///         _: dist_core::ReduceOp,
///         _: &mut [Self],
///         _: &[Self],
///     ) -> Result<(), String> {
///         Ok(())
///     }
///     fn scale(_: &mut [Self], _: Option<f64>, _: usize) {}
///     fn from_f64(_: f64) -> Self {
///         Nothing
///     }
///     fn to_f64(self) -> f64 {
///         0.0
///     }
/// }
/// ```
pub trait Element:
    sealed::Sealed + bytemuck::Pod + Send + Sync + PartialEq + std::fmt::Debug + 'static
{
    /// The runtime tag of this type.
    const DTYPE: DType;

    /// `acc[i] = acc[i] op other[i]` for every `i`. `Avg` and `PreMulSum` combine as a sum here;
    /// their scaling is applied by [`Element::scale`]. Fails, saying why, for a bitwise op on
    /// floats (the caller puts the rank and operation around it).
    fn reduce_into(op: ReduceOp, acc: &mut [Self], other: &[Self]) -> Result<(), String>;

    /// Multiplies every element by `factor` (for `PreMulSum`), or divides by `divisor` when
    /// `factor` is `None` (for `Avg`).
    fn scale(values: &mut [Self], factor: Option<f64>, divisor: usize);

    /// Converts from `f64`, rounding as `as` does; used by tests and `PreMulSum`.
    fn from_f64(x: f64) -> Self;

    /// Converts to `f64`.
    fn to_f64(self) -> f64;
}

fn not_for_floats(op: ReduceOp, dtype: DType) -> String {
    format!("reduce op {} is not defined for {dtype}", op.name())
}

macro_rules! float_element {
    ($t:ty, $d:expr) => {
        impl sealed::Sealed for $t {}
        impl Element for $t {
            const DTYPE: DType = $d;

            fn reduce_into(op: ReduceOp, acc: &mut [Self], other: &[Self]) -> Result<(), String> {
                let n = acc.len().min(other.len());
                let (acc, other) = (&mut acc[..n], &other[..n]);
                match op {
                    ReduceOp::Sum | ReduceOp::Avg | ReduceOp::PreMulSum(_) => {
                        acc.iter_mut().zip(other).for_each(|(a, b)| *a += *b)
                    }
                    ReduceOp::Prod => acc.iter_mut().zip(other).for_each(|(a, b)| *a *= *b),
                    // Written as selects so the loop vectorises; a NaN on either side wins
                    // (`y < x` and `y > x` are false when `x` is NaN, so `x` is kept).
                    ReduceOp::Min => acc.iter_mut().zip(other).for_each(|(a, b)| {
                        let (x, y) = (*a, *b);
                        *a = if y < x || y.is_nan() { y } else { x };
                    }),
                    ReduceOp::Max => acc.iter_mut().zip(other).for_each(|(a, b)| {
                        let (x, y) = (*a, *b);
                        *a = if y > x || y.is_nan() { y } else { x };
                    }),
                    ReduceOp::BitAnd | ReduceOp::BitOr | ReduceOp::BitXor => {
                        return Err(not_for_floats(op, $d));
                    }
                }
                Ok(())
            }

            fn scale(values: &mut [Self], factor: Option<f64>, divisor: usize) {
                match factor {
                    Some(f) => {
                        let f = f as $t;
                        values.iter_mut().for_each(|v| *v *= f);
                    }
                    None => {
                        let d = divisor as $t;
                        values.iter_mut().for_each(|v| *v /= d);
                    }
                }
            }

            fn from_f64(x: f64) -> Self {
                x as $t
            }

            fn to_f64(self) -> f64 {
                self as f64
            }
        }
    };
}

float_element!(f32, DType::F32);
float_element!(f64, DType::F64);

macro_rules! int_element {
    ($t:ty, $d:expr) => {
        impl sealed::Sealed for $t {}
        impl Element for $t {
            const DTYPE: DType = $d;

            fn reduce_into(op: ReduceOp, acc: &mut [Self], other: &[Self]) -> Result<(), String> {
                let n = acc.len().min(other.len());
                let (acc, other) = (&mut acc[..n], &other[..n]);
                let z = acc.iter_mut().zip(other);
                // Integer arithmetic wraps, as in NCCL and MPI.
                match op {
                    ReduceOp::Sum | ReduceOp::Avg | ReduceOp::PreMulSum(_) => {
                        z.for_each(|(a, b)| *a = a.wrapping_add(*b))
                    }
                    ReduceOp::Prod => z.for_each(|(a, b)| *a = a.wrapping_mul(*b)),
                    ReduceOp::Min => z.for_each(|(a, b)| *a = (*a).min(*b)),
                    ReduceOp::Max => z.for_each(|(a, b)| *a = (*a).max(*b)),
                    ReduceOp::BitAnd => z.for_each(|(a, b)| *a &= *b),
                    ReduceOp::BitOr => z.for_each(|(a, b)| *a |= *b),
                    ReduceOp::BitXor => z.for_each(|(a, b)| *a ^= *b),
                }
                Ok(())
            }

            fn scale(values: &mut [Self], factor: Option<f64>, divisor: usize) {
                match factor {
                    Some(f) => {
                        let f = f as $t;
                        values.iter_mut().for_each(|v| *v = v.wrapping_mul(f));
                    }
                    None => {
                        let d = divisor as $t;
                        if d != 0 {
                            values.iter_mut().for_each(|v| *v /= d);
                        }
                    }
                }
            }

            fn from_f64(x: f64) -> Self {
                x as $t
            }

            fn to_f64(self) -> f64 {
                self as f64
            }
        }
    };
}

int_element!(i8, DType::I8);
int_element!(u8, DType::U8);
int_element!(i32, DType::I32);
int_element!(u32, DType::U32);
int_element!(i64, DType::I64);
int_element!(u64, DType::U64);

macro_rules! half_element {
    ($t:ty, $d:expr) => {
        impl sealed::Sealed for $t {}
        impl Element for $t {
            const DTYPE: DType = $d;

            fn reduce_into(op: ReduceOp, acc: &mut [Self], other: &[Self]) -> Result<(), String> {
                use half::slice::HalfFloatSliceExt;
                if matches!(op, ReduceOp::BitAnd | ReduceOp::BitOr | ReduceOp::BitXor) {
                    return Err(not_for_floats(op, $d));
                }
                // Widen a block at a time to f32, combine there, and round once per step.
                const BLOCK: usize = 512;
                let mut x = [0f32; BLOCK];
                let mut y = [0f32; BLOCK];
                let n = acc.len().min(other.len());
                for (a, b) in acc[..n].chunks_mut(BLOCK).zip(other[..n].chunks(BLOCK)) {
                    let (x, y) = (&mut x[..a.len()], &mut y[..a.len()]);
                    a.convert_to_f32_slice(x);
                    b.convert_to_f32_slice(y);
                    f32::reduce_into(op, x, y)?;
                    a.convert_from_f32_slice(x);
                }
                Ok(())
            }

            fn scale(values: &mut [Self], factor: Option<f64>, divisor: usize) {
                for v in values {
                    let x = v.to_f32();
                    *v = <$t>::from_f32(match factor {
                        Some(f) => x * f as f32,
                        None => x / divisor as f32,
                    });
                }
            }

            fn from_f64(x: f64) -> Self {
                <$t>::from_f64(x)
            }

            fn to_f64(self) -> f64 {
                <$t>::to_f64(self)
            }
        }
    };
}

half_element!(f16, DType::F16);
half_element!(bf16, DType::BF16);

#[cfg(test)]
mod tests {
    use super::*;

    /// Every element type has the size its `DTYPE` names, never zero (the collectives divide
    /// by it).
    #[test]
    fn element_sizes_match_their_dtype() {
        fn check<T: Element>() {
            let size = std::mem::size_of::<T>();
            assert!(size > 0, "{}", T::DTYPE);
            assert_eq!(size, T::DTYPE.size(), "{}", T::DTYPE);
        }
        check::<f32>();
        check::<f64>();
        check::<f16>();
        check::<bf16>();
        check::<i8>();
        check::<u8>();
        check::<i32>();
        check::<u32>();
        check::<i64>();
        check::<u64>();
    }

    #[test]
    fn min_max_propagate_nan() {
        let mut a = [1.0f32, f32::NAN, 3.0, 4.0];
        let b = [2.0f32, 0.0, f32::NAN, 1.0];
        f32::reduce_into(ReduceOp::Min, &mut a, &b).unwrap();
        assert_eq!(a[0], 1.0);
        assert!(a[1].is_nan() && a[2].is_nan());
        assert_eq!(a[3], 1.0);
        let mut a = [1.0f64, f64::NAN, 3.0, 4.0];
        let b = [2.0f64, 0.0, f64::NAN, 1.0];
        f64::reduce_into(ReduceOp::Max, &mut a, &b).unwrap();
        assert_eq!(a[0], 2.0);
        assert!(a[1].is_nan() && a[2].is_nan());
        assert_eq!(a[3], 4.0);
    }

    #[test]
    fn bitwise_ops_refuse_floats_and_work_on_ints() {
        let mut a = [1.0f32];
        let err = f32::reduce_into(ReduceOp::BitXor, &mut a, &[2.0]).unwrap_err();
        assert!(
            err.to_string().contains("bxor is not defined for f32"),
            "{err}"
        );
        let mut b = [bf16::from_f32(1.0)];
        assert!(bf16::reduce_into(ReduceOp::BitAnd, &mut b, &[bf16::ONE]).is_err());
        let mut x = [0b1100u32, 7];
        u32::reduce_into(ReduceOp::BitXor, &mut x, &[0b1010, 7]).unwrap();
        assert_eq!(x, [0b0110, 0]);
        let mut y = [i8::MAX];
        i8::reduce_into(ReduceOp::Sum, &mut y, &[1]).unwrap();
        assert_eq!(y, [i8::MIN]);
    }

    #[test]
    fn half_types_reduce_through_f32() {
        let mut a: Vec<f16> = (0..1000).map(|i| f16::from_f32(i as f32 * 0.5)).collect();
        let b: Vec<f16> = (0..1000).map(|_| f16::from_f32(2.0)).collect();
        f16::reduce_into(ReduceOp::Prod, &mut a, &b).unwrap();
        for (i, v) in a.iter().enumerate() {
            assert_eq!(v.to_f32(), f16::from_f32(i as f32).to_f32());
        }
        let mut s = [bf16::from_f32(4.0)];
        bf16::scale(&mut s, None, 2);
        assert_eq!(s[0].to_f32(), 2.0);
    }

    #[test]
    fn dtype_and_reduce_op_codes_and_names_round_trip() {
        for d in DType::ALL {
            assert_eq!(DType::from_code(d as u8), Some(d));
            assert_eq!(DType::parse(d.name()), Some(d));
            assert_eq!(DType::parse(d.rust_name()), Some(d));
        }
        assert_eq!(DType::from_code(0), None);
        for op in ReduceOp::ALL {
            assert_eq!(ReduceOp::from_code(op.code()), Some(op), "{op}");
        }
        assert_eq!(
            ReduceOp::from_code(ReduceOp::PreMulSum(0.25).code()),
            Some(ReduceOp::PreMulSum(1.0))
        );
        assert_eq!(ReduceOp::from_code(0), None);
        assert_eq!(ReduceOp::from_code(10), None);
        assert_eq!(ReduceOp::Avg.check(DType::F16), Ok(()));
        assert!(ReduceOp::BitOr.check(DType::BF16).is_err());
    }
}
