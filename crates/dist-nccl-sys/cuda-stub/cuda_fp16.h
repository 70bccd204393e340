/* Empty stand-in for the CUDA toolkit's cuda_fp16.h (see cuda_runtime.h here). */
