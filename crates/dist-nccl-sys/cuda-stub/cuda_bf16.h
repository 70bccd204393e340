/* Empty stand-in for the CUDA toolkit's cuda_bf16.h (see cuda_runtime.h here). */
