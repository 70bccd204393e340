//! The caller's own kernels of the GPU cases, in PTX (loaded by the driver, no compiler
//! needed): `spin_fill` spins for a while and then writes `base + i` into element i, so that a
//! call enqueued after it but not ordered behind it reads or writes before it is done;
//! `add` adds a value to every element.

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtrMut, result, sys};

const PTX: &str = r"
.version 6.0
.target sm_60
.address_size 64

.visible .entry spin_fill(
    .param .u64 p_ptr,
    .param .u64 p_n,
    .param .f32 p_base,
    .param .u64 p_ns
)
{
    .reg .pred %p<3>;
    .reg .f32 %f<4>;
    .reg .b64 %rd<10>;

    ld.param.u64 %rd1, [p_ptr];
    ld.param.u64 %rd2, [p_n];
    ld.param.f32 %f1, [p_base];
    ld.param.u64 %rd3, [p_ns];
    cvta.to.global.u64 %rd1, %rd1;
    mov.u64 %rd4, %globaltimer;
SPIN:
    mov.u64 %rd5, %globaltimer;
    sub.u64 %rd6, %rd5, %rd4;
    setp.lt.u64 %p1, %rd6, %rd3;
    @%p1 bra SPIN;
    mov.u64 %rd7, 0;
    setp.eq.u64 %p2, %rd2, 0;
    @%p2 bra DONE;
FILL:
    cvt.rn.f32.u64 %f2, %rd7;
    add.f32 %f3, %f1, %f2;
    shl.b64 %rd8, %rd7, 2;
    add.u64 %rd9, %rd1, %rd8;
    st.global.f32 [%rd9], %f3;
    add.u64 %rd7, %rd7, 1;
    setp.lt.u64 %p2, %rd7, %rd2;
    @%p2 bra FILL;
DONE:
    ret;
}

.visible .entry add(
    .param .u64 a_ptr,
    .param .u64 a_n,
    .param .f32 a_delta
)
{
    .reg .pred %q<2>;
    .reg .f32 %g<4>;
    .reg .b64 %rs<6>;

    ld.param.u64 %rs1, [a_ptr];
    ld.param.u64 %rs2, [a_n];
    ld.param.f32 %g1, [a_delta];
    cvta.to.global.u64 %rs1, %rs1;
    mov.u64 %rs3, 0;
    setp.eq.u64 %q1, %rs2, 0;
    @%q1 bra ADONE;
ALOOP:
    shl.b64 %rs4, %rs3, 2;
    add.u64 %rs5, %rs1, %rs4;
    ld.global.f32 %g2, [%rs5];
    add.f32 %g3, %g2, %g1;
    st.global.f32 [%rs5], %g3;
    add.u64 %rs3, %rs3, 1;
    setp.lt.u64 %q1, %rs3, %rs2;
    @%q1 bra ALOOP;
ADONE:
    ret;
}
";

/// The two kernels, loaded into one context.
#[allow(missing_debug_implementations, reason = "a test fixture")]
pub struct Kernels {
    module: sys::CUmodule,
    spin_fill: sys::CUfunction,
    add: sys::CUfunction,
    ctx: Arc<CudaContext>,
}

impl Kernels {
    pub fn load(ctx: &Arc<CudaContext>) -> Kernels {
        ctx.bind_to_thread().unwrap();
        let src = std::ffi::CString::new(PTX).unwrap();
        // SAFETY: `src` is a NUL-terminated PTX text that outlives the call; the context is
        // bound to this thread.
        let module = unsafe { result::module::load_data(src.as_ptr().cast()) }.unwrap();
        // SAFETY: `module` was just loaded and holds both entries (named in `PTX`).
        let (spin_fill, add) = unsafe {
            (
                result::module::get_function(module, c"spin_fill".into()).unwrap(),
                result::module::get_function(module, c"add".into()).unwrap(),
            )
        };
        Kernels {
            module,
            spin_fill,
            add,
            ctx: ctx.clone(),
        }
    }

    /// Enqueues `spin_fill` on `stream`: after `ns` nanoseconds, element i of the `n` at `ptr`
    /// becomes `base + i`.
    ///
    /// # Safety
    /// `ptr` must address `n` f32 of this context's device memory that stay allocated until
    /// the kernel has run (or, in a capture, until the graph's last replay has).
    pub unsafe fn spin_fill_raw(
        &self,
        stream: &CudaStream,
        ptr: u64,
        n: usize,
        base: f32,
        ns: u64,
    ) {
        let (mut p, mut n, mut b, mut t) = (ptr, n as u64, base, ns);
        let mut args: [*mut c_void; 4] = [
            (&raw mut p).cast(),
            (&raw mut n).cast(),
            (&raw mut b).cast(),
            (&raw mut t).cast(),
        ];
        self.ctx.bind_to_thread().unwrap();
        // SAFETY: the arguments match `spin_fill`'s parameters in type and order and live
        // through the call (the driver copies them); the caller vouches for `ptr`.
        unsafe {
            result::launch_kernel(
                self.spin_fill,
                (1, 1, 1),
                (1, 1, 1),
                0,
                stream.cu_stream(),
                &mut args,
            )
        }
        .unwrap();
    }

    /// `spin_fill` on a buffer, ordered by cudarc like any use of it on `stream`.
    pub fn spin_fill(&self, stream: &CudaStream, buf: &mut CudaSlice<f32>, base: f32, ns: u64) {
        let n = buf.len();
        let (p, _written) = buf.device_ptr_mut(stream);
        // SAFETY: `p` addresses the buffer's `n` f32, and the guard records the write behind
        // the kernel, so the buffer is not freed before it runs.
        unsafe { self.spin_fill_raw(stream, p, n, base, ns) };
    }

    /// Enqueues `add` on `stream`: `delta` is added to each of the `n` f32 at `ptr`.
    ///
    /// # Safety
    /// As for [`Kernels::spin_fill_raw`].
    pub unsafe fn add_raw(&self, stream: &CudaStream, ptr: u64, n: usize, delta: f32) {
        let (mut p, mut n, mut d) = (ptr, n as u64, delta);
        let mut args: [*mut c_void; 3] = [
            (&raw mut p).cast(),
            (&raw mut n).cast(),
            (&raw mut d).cast(),
        ];
        self.ctx.bind_to_thread().unwrap();
        // SAFETY: as in `spin_fill_raw`, for `add`'s parameters.
        unsafe {
            result::launch_kernel(
                self.add,
                (1, 1, 1),
                (1, 1, 1),
                0,
                stream.cu_stream(),
                &mut args,
            )
        }
        .unwrap();
    }
}

impl Drop for Kernels {
    fn drop(&mut self) {
        let _ = self.ctx.synchronize();
        // SAFETY: the module is no longer used: the context is synchronized (no kernel of it
        // runs) and no graph holding its kernels outlives the case that loaded it.
        let _ = unsafe { result::module::unload(self.module) };
    }
}
