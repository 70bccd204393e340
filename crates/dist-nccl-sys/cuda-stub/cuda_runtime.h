/* Stand-in for the CUDA toolkit's cuda_runtime.h, enough for bindgen to read nccl.h: the host
 * API needs only size_t and cudaStream_t from it. Part of dist, not of CUDA. */
#ifndef DIST_CUDA_RUNTIME_STUB_H
#define DIST_CUDA_RUNTIME_STUB_H
#include <stddef.h>
typedef struct CUstream_st *cudaStream_t;
#define CUDART_VERSION 12080
#endif
