/* cute-flash C ABI: FlashAttention forward and backward from a shared library that
 * `cute-flash export` builds ahead of time. No Python at run time; the library needs only the
 * CUDA driver (libcuda.so.1).
 *
 * Tensors are device pointers of the caller's CUDA device (the current device of the calling
 * thread); `stream` is a cudaStream_t / CUstream of that device (NULL: the legacy default stream).
 * Every call validates all of its arguments before it touches CUDA, and returns one of the codes
 * below (the same codes as the Python package's `cute_flash.ErrorCode`). Work is queued on
 * `stream`; a call returns before it finishes.
 */
#ifndef CUTE_FLASH_H
#define CUTE_FLASH_H

#include <stdint.h>

/* Raised when a function changes its arguments or meaning; `cuflash_abi_version()` returns the
 * version the library was built with. 2: cuflash_attention_backward_ex takes `deterministic`. */
#define CUFLASH_ABI_VERSION 2

#ifdef __cplusplus
extern "C" {
#endif

enum {
    CUFLASH_SUCCESS = 0,
    CUFLASH_ERROR_INVALID_DIMENSION = 1,      /* a size <= 0, a stride or alignment the kernels cannot
                                                 address, causal or deterministic not 0/1, a negative
                                                 or non-finite scale */
    CUFLASH_ERROR_DIMENSION_MISMATCH = 2,     /* heads not a multiple of kv_heads */
    CUFLASH_ERROR_NULL_POINTER = 3,           /* a tensor (or its descriptor) is NULL */
    CUFLASH_ERROR_CUDA_ERROR = 4,             /* no usable GPU (older than this library's target, no
                                                 driver) or a failed launch */
    CUFLASH_ERROR_OUT_OF_MEMORY = 5,          /* the backward's workspace could not be allocated */
    CUFLASH_ERROR_UNSUPPORTED_HEAD_DIM = 6,   /* head_dim not a multiple of 8 in [8, 256] */
    CUFLASH_ERROR_UNSUPPORTED_DTYPE = 7,      /* an unknown dtype */
    CUFLASH_ERROR_VARIANT_NOT_EXPORTED = 8    /* a supported problem whose kernel this library was not
                                                 built with (see cuflash_build_info) */
};

/* Element types of the `_ex` functions. */
enum { CUFLASH_DTYPE_F16 = 0, CUFLASH_DTYPE_BF16 = 1, CUFLASH_DTYPE_F32 = 2 };

/* One operand indexed [batch, head, seq, head_dim]: element (b, h, n, d) is at
 * data[b * batch_stride + h * head_stride + n * seq_stride + d], strides in elements. For f16 and
 * bf16 operands, `data` must be 16-byte aligned and every stride of an extent above 1 a
 * non-negative multiple of 8. For L ([batch, head, seq] float32), `data` must be 4-byte aligned
 * and seq_stride 1 (when seq > 1). */
typedef struct cuflash_tensor {
    void *data;
    int64_t batch_stride;
    int64_t head_stride;
    int64_t seq_stride;
} cuflash_tensor;

int cuflash_abi_version(void);
/* A static description of a return code ("unknown error code" for others). */
const char *cuflash_error_string(int code);
/* What the calling thread's last failed call found, in words ("" before any failure). */
const char *cuflash_last_error_message(void);
/* The compile target and the variants this library holds, one line each. */
const char *cuflash_build_info(void);
/* 1 when this library holds the kernels of the pass (0 forward, 1 backward) for the dtype, head
 * dim and causal flag, else 0. For the backward: with kv_heads == heads and deterministic 0. */
int cuflash_variant_exported(int backward, int dtype, int head_dim, int causal);
/* 1 when a backward call of this dtype, head dim and causal flag finds its kernels, else 0: gqa 1
 * for kv_heads < heads (grouped-query or multi-query), deterministic as passed to
 * cuflash_attention_backward_ex. */
int cuflash_backward_variant_exported(int dtype, int head_dim, int causal, int gqa, int deterministic);

/* Forward: O = softmax(scale * Q K^T) V for row-major [B, H, N, D] Q, K, V, O; L = the
 * natural-log logsumexp of each row of scaled scores, float32 [B, H, N]. Causal masking hides key
 * j from query i when j > i. f32 runs split TF32 kernels (three TF32 products per pair, fp32-grade
 * accuracy) where the library was exported with them (cute-flash export --dtypes fp32). */
int cuflash_attention_forward_f16(const void *Q, const void *K, const void *V, void *O, float *L,
                                  int batch, int heads, int seq_len, int head_dim, float scale,
                                  int causal, void *stream);
int cuflash_attention_forward_bf16(const void *Q, const void *K, const void *V, void *O, float *L,
                                   int batch, int heads, int seq_len, int head_dim, float scale,
                                   int causal, void *stream);
int cuflash_attention_forward_f32(const float *Q, const float *K, const float *V, float *O, float *L,
                                  int batch, int heads, int seq_len, int head_dim, float scale,
                                  int causal, void *stream);

/* Backward: dQ, dK, dV from dO and the forward's Q, K, V, O and L (same layouts), as
 * cuflash_attention_backward_ex with deterministic 0 (dQ's partial sums added in any order).
 * Allocates its workspace stream-ordered (cudaMallocAsync) on `stream` and frees it there
 * (cudaFreeAsync), with the CUDA driver: float32, about B x H x N x (D + 2) x 4 bytes. */
int cuflash_attention_backward_f16(const void *dO, const void *Q, const void *K, const void *V,
                                   const void *O, const float *L, void *dQ, void *dK, void *dV,
                                   int batch, int heads, int seq_len, int head_dim, float scale,
                                   int causal, void *stream);
int cuflash_attention_backward_bf16(const void *dO, const void *Q, const void *K, const void *V,
                                    const void *O, const float *L, void *dQ, void *dK, void *dV,
                                    int batch, int heads, int seq_len, int head_dim, float scale,
                                    int causal, void *stream);
int cuflash_attention_backward_f32(const float *dO, const float *Q, const float *K, const float *V,
                                   const float *O, const float *L, float *dQ, float *dK, float *dV,
                                   int batch, int heads, int seq_len, int head_dim, float scale,
                                   int causal, void *stream);

/* Any strides, seq_len_k keys and kv_heads key/value heads (heads a multiple of kv_heads: query
 * head h reads kv head h / (heads / kv_heads)). Q, O, dO, dQ: [batch, heads, seq_len_q, head_dim];
 * K, V, dK, dV: [batch, kv_heads, seq_len_k, head_dim]; L: [batch, heads, seq_len_q]. Causal
 * masking is bottom-right aligned: query i sees key j iff j <= i + seq_len_k - seq_len_q; a row
 * that sees no key gets O = 0 and L = -inf.
 *
 * The backward with kv_heads < heads computes each query head's dK and dV in a float32 workspace
 * and sums each group of heads / kv_heads into dK and dV (in a fixed order). deterministic 1:
 * bit-identical dQ, dK and dV for identical inputs and sizes on one GPU (dQ's partial sums are
 * added in a fixed order; slower); 0: any order. A variant the library was not built with returns
 * CUFLASH_ERROR_VARIANT_NOT_EXPORTED (`cute-flash export --gqa`, `--deterministic`); where the
 * exact variant is missing, a grouped-query one also serves kv_heads == heads and a deterministic
 * one also serves deterministic 0. The workspace grows by at most B x H x ceil(seq_len_q / 64) x 4
 * bytes when deterministic and by 2 x B x seq_len_k x H x D x 4 bytes for grouped-query kernels. */
int cuflash_attention_forward_ex(int dtype, const cuflash_tensor *Q, const cuflash_tensor *K,
                                 const cuflash_tensor *V, const cuflash_tensor *O,
                                 const cuflash_tensor *L, int batch, int heads, int kv_heads,
                                 int seq_len_q, int seq_len_k, int head_dim, float scale, int causal,
                                 void *stream);
int cuflash_attention_backward_ex(int dtype, const cuflash_tensor *dO, const cuflash_tensor *Q,
                                  const cuflash_tensor *K, const cuflash_tensor *V,
                                  const cuflash_tensor *O, const cuflash_tensor *L,
                                  const cuflash_tensor *dQ, const cuflash_tensor *dK,
                                  const cuflash_tensor *dV, int batch, int heads, int kv_heads,
                                  int seq_len_q, int seq_len_k, int head_dim, float scale, int causal,
                                  int deterministic, void *stream);

#ifdef __cplusplus
}
#endif

#endif /* CUTE_FLASH_H */
