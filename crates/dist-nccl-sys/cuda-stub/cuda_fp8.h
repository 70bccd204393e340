/* Empty stand-in for the CUDA toolkit's cuda_fp8.h (see cuda_runtime.h here). */
