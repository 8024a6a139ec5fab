/* The C ABI of cute_flash.h over the kernels `cute-flash export` compiled ahead of time
 * (cuflash_kernels.h): argument checks, the kernels' (batch, seqlen, heads, head_dim) views of
 * the caller's [batch, heads, seqlen, head_dim] tensors, the backward's workspace, launches.
 *
 * Every argument is checked before the first CUDA call, so the checks need no GPU and no driver.
 * CUDA is reached through the CuTe DSL's runtime library, the one the kernels' launchers use. */
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "cute_flash.h"
#include "cuflash_kernels.h"

/* The CUDA runtime functions the DSL's runtime exports to exported kernels: the runtime's own
 * functions under a leading underscore, returning cudaError_t. */
extern int _cudaGetDevice(int *device);
extern int _cudaDeviceGetAttribute(int *value, int attribute, int device);
extern int _cudaMallocAsync(void **pointer, size_t bytes, void *stream);
extern int _cudaMemsetAsync(void *pointer, int value, size_t bytes, void *stream);
extern int _cudaFreeAsync(void *pointer, void *stream);

enum {
    CUDA_ERROR_MEMORY_ALLOCATION = 2,      /* cudaErrorMemoryAllocation */
    CUDA_ATTR_COMPUTE_CAPABILITY_MAJOR = 75,
    CUDA_ATTR_COMPUTE_CAPABILITY_MINOR = 76,
};

#define MAX_HEAD_DIM 256
#define HEAD_DIM_MULTIPLE 8
/* 16-bit operands move as 16-byte vectors: base and strides must keep every vector aligned. */
#define VECTOR_BYTES 16
#define VECTOR_ELEMENTS 8
/* Loaded state is a bit per device. */
#define MAX_DEVICES 64
/* Workspace regions start on the allocator's granule. */
#define WORKSPACE_ALIGN 256

static __thread char last_message[512];

static int fail(int code, const char *format, ...) {
    va_list args;
    va_start(args, format);
    vsnprintf(last_message, sizeof last_message, format, args);
    va_end(args);
    return code;
}

static int cuda_failure(int cuda_error, const char *what) {
    int code = cuda_error == CUDA_ERROR_MEMORY_ALLOCATION ? CUFLASH_ERROR_OUT_OF_MEMORY : CUFLASH_ERROR_CUDA_ERROR;
    return fail(code, "%s failed with cudaError_t %d", what, cuda_error);
}

int cuflash_abi_version(void) { return CUFLASH_ABI_VERSION; }

const char *cuflash_last_error_message(void) { return last_message; }

const char *cuflash_build_info(void) { return cf_build_info; }

const char *cuflash_error_string(int code) {
    switch (code) {
    case CUFLASH_SUCCESS: return "success";
    case CUFLASH_ERROR_INVALID_DIMENSION: return "invalid dimension, stride, alignment or option";
    case CUFLASH_ERROR_DIMENSION_MISMATCH: return "dimension mismatch";
    case CUFLASH_ERROR_NULL_POINTER: return "null pointer";
    case CUFLASH_ERROR_CUDA_ERROR: return "CUDA error";
    case CUFLASH_ERROR_OUT_OF_MEMORY: return "out of memory";
    case CUFLASH_ERROR_UNSUPPORTED_HEAD_DIM: return "unsupported head dimension";
    case CUFLASH_ERROR_UNSUPPORTED_DTYPE: return "unsupported dtype";
    case CUFLASH_ERROR_VARIANT_NOT_EXPORTED: return "variant not exported into this library";
    default: return "unknown error code";
    }
}

/* ------------------------------------------------------------------------------ checks */

typedef struct {
    int batch, heads, kv_heads, seq_q, seq_k, head_dim;
} problem;

typedef struct {
    const char *name;
    const cuflash_tensor *tensor;
} named_tensor;

static int check_present(const named_tensor *tensors, int count) {
    for (int i = 0; i < count; i++) {
        if (tensors[i].tensor == NULL) return fail(CUFLASH_ERROR_NULL_POINTER, "%s is NULL", tensors[i].name);
        if (tensors[i].tensor->data == NULL) return fail(CUFLASH_ERROR_NULL_POINTER, "%s's data is NULL", tensors[i].name);
    }
    return CUFLASH_SUCCESS;
}

static int check_problem(const problem *p, float scale, int causal, int deterministic, int dtype) {
    const struct { const char *name; int value; } sizes[] = {
        {"batch", p->batch}, {"heads", p->heads}, {"kv_heads", p->kv_heads},
        {"seq_len_q", p->seq_q}, {"seq_len_k", p->seq_k}, {"head_dim", p->head_dim},
    };
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
        if (sizes[i].value <= 0) return fail(CUFLASH_ERROR_INVALID_DIMENSION, "%s must be positive, got %d", sizes[i].name, sizes[i].value);
    }
    if (p->heads % p->kv_heads != 0) {
        return fail(CUFLASH_ERROR_DIMENSION_MISMATCH, "heads (%d) must be a multiple of kv_heads (%d)", p->heads, p->kv_heads);
    }
    if (p->head_dim % HEAD_DIM_MULTIPLE != 0 || p->head_dim > MAX_HEAD_DIM) {
        return fail(CUFLASH_ERROR_UNSUPPORTED_HEAD_DIM, "head_dim %d is not supported: every multiple of %d from %d to %d is",
                    p->head_dim, HEAD_DIM_MULTIPLE, HEAD_DIM_MULTIPLE, MAX_HEAD_DIM);
    }
    if (!isfinite(scale) || scale < 0.0f) return fail(CUFLASH_ERROR_INVALID_DIMENSION, "scale must be finite and non-negative, got %g", scale);
    if (causal != 0 && causal != 1) return fail(CUFLASH_ERROR_INVALID_DIMENSION, "causal must be 0 or 1, got %d", causal);
    if (deterministic != 0 && deterministic != 1) {
        return fail(CUFLASH_ERROR_INVALID_DIMENSION, "deterministic must be 0 or 1, got %d", deterministic);
    }
    if (dtype != CUFLASH_DTYPE_F16 && dtype != CUFLASH_DTYPE_BF16 && dtype != CUFLASH_DTYPE_F32) {
        return fail(CUFLASH_ERROR_UNSUPPORTED_DTYPE, "unknown dtype %d", dtype);
    }
    return CUFLASH_SUCCESS;
}

/* The kernels' (batch, seqlen, heads, head_dim) view of a [batch, heads, seq, head_dim]
 * operand. A stride of an extent of 1 is never multiplied by a non-zero index; it gets a value
 * the kernels' layout accepts. */
static int bshd_view(const char *name, const cuflash_tensor *t, int batch, int heads, int seq, cf_bshd *view) {
    if ((uintptr_t)t->data % VECTOR_BYTES != 0) return fail(CUFLASH_ERROR_INVALID_DIMENSION, "%s's data is not %d-byte aligned", name, VECTOR_BYTES);
    const struct { const char *axis; int extent; int64_t stride; } modes[3] = {
        {"batch_stride", batch, t->batch_stride}, {"seq_stride", seq, t->seq_stride}, {"head_stride", heads, t->head_stride},
    };
    view->data = t->data;
    for (int i = 0; i < 3; i++) {
        int64_t stride = modes[i].extent == 1 ? VECTOR_ELEMENTS : modes[i].stride;
        if (stride < 0 || stride % VECTOR_ELEMENTS != 0) {
            return fail(CUFLASH_ERROR_INVALID_DIMENSION, "%s's %s (%lld) must be a non-negative multiple of %d elements",
                        name, modes[i].axis, (long long)modes[i].stride, VECTOR_ELEMENTS);
        }
        view->shape[i] = modes[i].extent;
        view->stride[i] = stride;
    }
    return CUFLASH_SUCCESS;
}

/* The view of a float32 [batch, heads, seq] row statistic (L). */
static int rows_view(const char *name, const cuflash_tensor *t, int batch, int heads, int seq, cf_rows *view) {
    if ((uintptr_t)t->data % sizeof(float) != 0) return fail(CUFLASH_ERROR_INVALID_DIMENSION, "%s's data is not 4-byte aligned", name);
    if (seq > 1 && t->seq_stride != 1) return fail(CUFLASH_ERROR_INVALID_DIMENSION, "%s's seq_stride must be 1, got %lld", name, (long long)t->seq_stride);
    if (t->batch_stride < 0 || t->head_stride < 0) return fail(CUFLASH_ERROR_INVALID_DIMENSION, "%s's strides must be non-negative", name);
    *view = (cf_rows){t->data, {batch, heads, seq}, {t->batch_stride, t->head_stride}};
    return CUFLASH_SUCCESS;
}

/* ------------------------------------------------------------------------------ kernels */

static const cf_forward_variant *forward_variant(int dtype, int head_dim, int causal) {
    for (const cf_forward_variant *v = cf_forward_variants; v->kernel != NULL; v++) {
        if (v->dtype == dtype && v->head_dim == head_dim && v->causal == causal) return v;
    }
    return NULL;
}

/* The backward variant that serves a call: the one asked for if exported, else one that computes
 * the same gradients. A grouped-query variant also serves kv_heads == heads (groups of one, through
 * its fp32 workspace); a deterministic one also serves deterministic == 0. Preferred in that
 * order: exact, then grouped-query, then deterministic. */
static const cf_backward_variant *backward_variant(int dtype, int head_dim, int causal, int gqa, int deterministic) {
    for (int g = gqa; g <= 1; g++) {
        for (int d = deterministic; d <= 1; d++) {
            for (const cf_backward_variant *v = cf_backward_variants; v->main != NULL; v++) {
                if (v->dtype == dtype && v->head_dim == head_dim && v->causal == causal && v->gqa == g &&
                    v->deterministic == d) {
                    return v;
                }
            }
        }
    }
    return NULL;
}

static const char *dtype_name(int dtype) {
    return dtype == CUFLASH_DTYPE_F16 ? "f16" : dtype == CUFLASH_DTYPE_BF16 ? "bf16" : "f32";
}

static int not_exported(const char *pass, int dtype, int head_dim, int causal) {
    return fail(CUFLASH_ERROR_VARIANT_NOT_EXPORTED, "no %s kernel for %s, head_dim %d, causal %d in this library "
                "(cute-flash export --dtypes ... --head-dims ... --causal ...)", pass, dtype_name(dtype), head_dim, causal);
}

static int backward_not_exported(int dtype, int head_dim, int causal, int gqa, int deterministic) {
    return fail(CUFLASH_ERROR_VARIANT_NOT_EXPORTED, "no backward kernel for %s, head_dim %d, causal %d%s%s in this "
                "library (cute-flash export --dtypes ... --head-dims ... --causal ... --gqa ... --deterministic ...)",
                dtype_name(dtype), head_dim, causal, gqa ? ", kv_heads < heads" : "",
                deterministic ? ", deterministic" : "");
}

int cuflash_variant_exported(int backward, int dtype, int head_dim, int causal) {
    return (backward ? backward_variant(dtype, head_dim, causal, 0, 0) != NULL : forward_variant(dtype, head_dim, causal) != NULL);
}

int cuflash_backward_variant_exported(int dtype, int head_dim, int causal, int gqa, int deterministic) {
    return (gqa == 0 || gqa == 1) && (deterministic == 0 || deterministic == 1) &&
           backward_variant(dtype, head_dim, causal, gqa, deterministic) != NULL;
}

/* The current device, checked against the library's compile target. */
static int current_device(int *device) {
    int error = _cudaGetDevice(device);
    if (error != 0) return cuda_failure(error, "cudaGetDevice");
    if (*device < 0 || *device >= MAX_DEVICES) return fail(CUFLASH_ERROR_CUDA_ERROR, "device %d: at most %d devices are supported", *device, MAX_DEVICES);
    return CUFLASH_SUCCESS;
}

static int check_target(int device) {
    int major = 0, minor = 0;
    int error = _cudaDeviceGetAttribute(&major, CUDA_ATTR_COMPUTE_CAPABILITY_MAJOR, device);
    if (error == 0) error = _cudaDeviceGetAttribute(&minor, CUDA_ATTR_COMPUTE_CAPABILITY_MINOR, device);
    if (error != 0) return cuda_failure(error, "cudaDeviceGetAttribute");
    int runs = major == cf_target_major && (cf_target_arch_specific ? minor == cf_target_minor : minor >= cf_target_minor);
    if (!runs) {
        return fail(CUFLASH_ERROR_CUDA_ERROR, "device %d is sm_%d%d; this library holds code for sm_%d%d%s only "
                    "(cute-flash export --arch chooses; the kernels need sm_80 or newer)", device, major, minor,
                    cf_target_major, cf_target_minor, cf_target_arch_specific ? "a" : "");
    }
    return CUFLASH_SUCCESS;
}

static pthread_mutex_t load_lock = PTHREAD_MUTEX_INITIALIZER;

/* Loads a kernel's code once, and onto `device` once; a failure is retried on the next call. */
static int load(cf_kernel *kernel, int device) {
    uint64_t bit = (uint64_t)1 << device;
    if (__atomic_load_n(&kernel->loaded_devices, __ATOMIC_ACQUIRE) & bit) return CUFLASH_SUCCESS;
    int code = check_target(device);
    if (code != CUFLASH_SUCCESS) return code;
    pthread_mutex_lock(&load_lock);
    /* The DSL's packed calling convention: each slot points at one argument. */
    void *library_slot = &kernel->library;
    int32_t error = 0, device_id = device;
    if (kernel->library == NULL) {
        void *init_args[2] = {&library_slot, &error};
        kernel->init(init_args);
        if (error != 0) kernel->library = NULL; /* retried on the next call */
    }
    if (error == 0 && !(kernel->loaded_devices & bit)) { /* another thread may have loaded it meanwhile */
        void *load_args[3] = {&library_slot, &device_id, &error};
        kernel->load_to_device(load_args);
    }
    if (error == 0) __atomic_or_fetch(&kernel->loaded_devices, bit, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&load_lock);
    return error == 0 ? CUFLASH_SUCCESS : cuda_failure(error, kernel->name);
}

static int launch(cf_kernel *kernel, void **args, int32_t count) {
    int32_t error = 0;
    args[count - 1] = &error; /* the launcher's cudaError_t */
    kernel->launch(args, count);
    return error == 0 ? CUFLASH_SUCCESS : cuda_failure(error, kernel->name);
}

/* ------------------------------------------------------------------------------ passes */

/* The views of Q, K, V, O and L, which both passes take, checked in that order. */
static int attention_views(const problem *p, const cuflash_tensor *Q, const cuflash_tensor *K,
                           const cuflash_tensor *V, const cuflash_tensor *O, const cuflash_tensor *L, cf_bshd *q,
                           cf_bshd *k, cf_bshd *v, cf_bshd *o, cf_rows *l) {
    int code = bshd_view("Q", Q, p->batch, p->heads, p->seq_q, q);
    if (code == CUFLASH_SUCCESS) code = bshd_view("K", K, p->batch, p->kv_heads, p->seq_k, k);
    if (code == CUFLASH_SUCCESS) code = bshd_view("V", V, p->batch, p->kv_heads, p->seq_k, v);
    if (code == CUFLASH_SUCCESS) code = bshd_view("O", O, p->batch, p->heads, p->seq_q, o);
    if (code == CUFLASH_SUCCESS) code = rows_view("L", L, p->batch, p->heads, p->seq_q, l);
    return code;
}


int cuflash_attention_forward_ex(int dtype, const cuflash_tensor *Q, const cuflash_tensor *K, const cuflash_tensor *V,
                                 const cuflash_tensor *O, const cuflash_tensor *L, int batch, int heads, int kv_heads,
                                 int seq_len_q, int seq_len_k, int head_dim, float scale, int causal, void *stream) {
    const named_tensor tensors[] = {{"Q", Q}, {"K", K}, {"V", V}, {"O", O}, {"L", L}};
    problem p = {batch, heads, kv_heads, seq_len_q, seq_len_k, head_dim};
    int code = check_present(tensors, 5);
    if (code == CUFLASH_SUCCESS) code = check_problem(&p, scale, causal, 0, dtype);
    cf_bshd q, k, v, o;
    cf_rows l;
    if (code == CUFLASH_SUCCESS) code = attention_views(&p, Q, K, V, O, L, &q, &k, &v, &o, &l);
    if (code != CUFLASH_SUCCESS) return code;
    const cf_forward_variant *variant = forward_variant(dtype, head_dim, causal);
    if (variant == NULL) return not_exported("forward", dtype, head_dim, causal);

    int device;
    code = current_device(&device);
    if (code == CUFLASH_SUCCESS) code = load(variant->kernel, device);
    if (code != CUFLASH_SUCCESS) return code;
    void *args[8] = {&q, &k, &v, &o, &l, &scale, &stream, NULL};
    return launch(variant->kernel, args, 8);
}

static size_t align_up(size_t bytes) { return (bytes + WORKSPACE_ALIGN - 1) / WORKSPACE_ALIGN * WORKSPACE_ALIGN; }

/* The backward's workspace, one allocation of regions on WORKSPACE_ALIGN boundaries:
 *   lse_log2, dpsum  float32 [B, H, rows]: LSE in log2 and rowsum(dO * O) per query row (rows:
 *                    seq_len_q padded to cf_row_pad), written by the preprocess kernel;
 *   dq_accum         float32 [B, H, query blocks * m_block * head_dim_padded]: dQ's accumulator,
 *                    zeroed by the preprocess kernel;
 *   semaphore        int32 [B, H, query blocks], deterministic variants only: whose turn it is
 *                    to add to a query block of dq_accum;
 *   dk_accum, dv_accum  float32 [B, seq_len_k, H, D], grouped-query variants only: each query
 *                    head's dK and dV, which the group-sum kernel adds per kv head into dK, dV.
 * The semaphore is zeroed here; the rest is written before it is read. */
typedef struct {
    cf_rows lse_log2, dpsum, dq_accum, semaphore;
    cf_bshd dk_accum, dv_accum;
    size_t zeroed_offset, zeroed_bytes, total_bytes;
} backward_workspace;

static void workspace_views(const problem *p, const cf_backward_variant *variant, char *base, backward_workspace *w) {
    int64_t batch = p->batch, heads = p->heads, seq_k = p->seq_k, head_dim = p->head_dim;
    int64_t rows = (p->seq_q + cf_row_pad - 1) / cf_row_pad * (int64_t)cf_row_pad;
    int64_t m_blocks = (p->seq_q + variant->m_block - 1) / variant->m_block;
    int64_t accum_row = m_blocks * variant->m_block * variant->head_dim_padded;
    size_t stat_bytes = align_up((size_t)(batch * heads * rows) * sizeof(float));
    size_t accum_bytes = align_up((size_t)(batch * heads * accum_row) * sizeof(float));
    size_t semaphore_bytes = variant->deterministic ? align_up((size_t)(batch * heads * m_blocks) * sizeof(int32_t)) : 0;
    size_t dkv_bytes = variant->gqa ? align_up((size_t)(batch * seq_k * heads * head_dim) * sizeof(float)) : 0;
    size_t offset = 0;
    w->lse_log2 = (cf_rows){base + offset, {p->batch, p->heads, (int32_t)rows}, {heads * rows, rows}};
    offset += stat_bytes;
    w->dpsum = (cf_rows){base + offset, {p->batch, p->heads, (int32_t)rows}, {heads * rows, rows}};
    offset += stat_bytes;
    w->dq_accum = (cf_rows){base + offset, {p->batch, p->heads, (int32_t)accum_row}, {heads * accum_row, accum_row}};
    offset += accum_bytes;
    w->zeroed_offset = offset;
    if (variant->deterministic) {
        w->semaphore = (cf_rows){base + offset, {p->batch, p->heads, (int32_t)m_blocks}, {heads * m_blocks, m_blocks}};
    } else {
        w->semaphore = (cf_rows){base, {1, 1, 1}, {1, 1}}; /* never read by the main kernel */
    }
    offset += semaphore_bytes;
    w->zeroed_bytes = offset - w->zeroed_offset;
    /* (batch, seq_len_k, heads) as the main kernel writes them: a kv head's group of query heads
     * is one contiguous run per key row for the group sum. */
    const int64_t dkv_strides[3] = {seq_k * heads * head_dim, heads * head_dim, head_dim};
    w->dk_accum = (cf_bshd){base + offset, {p->batch, p->seq_k, p->heads}, {dkv_strides[0], dkv_strides[1], dkv_strides[2]}};
    offset += dkv_bytes;
    w->dv_accum = (cf_bshd){base + offset, {p->batch, p->seq_k, p->heads}, {dkv_strides[0], dkv_strides[1], dkv_strides[2]}};
    offset += dkv_bytes;
    w->total_bytes = offset;
}

int cuflash_attention_backward_ex(int dtype, const cuflash_tensor *dO, const cuflash_tensor *Q, const cuflash_tensor *K,
                                  const cuflash_tensor *V, const cuflash_tensor *O, const cuflash_tensor *L,
                                  const cuflash_tensor *dQ, const cuflash_tensor *dK, const cuflash_tensor *dV, int batch,
                                  int heads, int kv_heads, int seq_len_q, int seq_len_k, int head_dim, float scale,
                                  int causal, int deterministic, void *stream) {
    const named_tensor tensors[] = {{"dO", dO}, {"Q", Q}, {"K", K}, {"V", V}, {"O", O},
                                    {"L", L},   {"dQ", dQ}, {"dK", dK}, {"dV", dV}};
    problem p = {batch, heads, kv_heads, seq_len_q, seq_len_k, head_dim};
    int code = check_present(tensors, 9);
    if (code == CUFLASH_SUCCESS) code = check_problem(&p, scale, causal, deterministic, dtype);
    cf_bshd d_o, q, k, v, o, dq, dk, dv;
    cf_rows l;
    if (code == CUFLASH_SUCCESS) code = bshd_view("dO", dO, batch, heads, seq_len_q, &d_o);
    if (code == CUFLASH_SUCCESS) code = attention_views(&p, Q, K, V, O, L, &q, &k, &v, &o, &l);
    if (code == CUFLASH_SUCCESS) code = bshd_view("dQ", dQ, batch, heads, seq_len_q, &dq);
    if (code == CUFLASH_SUCCESS) code = bshd_view("dK", dK, batch, kv_heads, seq_len_k, &dk);
    if (code == CUFLASH_SUCCESS) code = bshd_view("dV", dV, batch, kv_heads, seq_len_k, &dv);
    if (code != CUFLASH_SUCCESS) return code;
    int gqa = kv_heads != heads;
    const cf_backward_variant *variant = backward_variant(dtype, head_dim, causal, gqa, deterministic);
    if (variant == NULL) return backward_not_exported(dtype, head_dim, causal, gqa, deterministic);

    int device;
    code = current_device(&device);
    if (code == CUFLASH_SUCCESS) code = load(variant->pre, device);
    if (code == CUFLASH_SUCCESS) code = load(variant->main, device);
    if (code == CUFLASH_SUCCESS) code = load(variant->post, device);
    if (code == CUFLASH_SUCCESS && variant->gqa) code = load(variant->sum, device);
    if (code != CUFLASH_SUCCESS) return code;

    backward_workspace w;
    workspace_views(&p, variant, NULL, &w);
    char *base = NULL;
    int error = _cudaMallocAsync((void **)&base, w.total_bytes, stream);
    if (error != 0) return cuda_failure(error, "the backward's workspace (cudaMallocAsync)");
    workspace_views(&p, variant, base, &w);
    error = w.zeroed_bytes == 0 ? 0 : _cudaMemsetAsync(base + w.zeroed_offset, 0, w.zeroed_bytes, stream);
    code = error == 0 ? CUFLASH_SUCCESS : cuda_failure(error, "cudaMemsetAsync");
    if (code == CUFLASH_SUCCESS) {
        void *args[8] = {&o, &d_o, &l, &w.lse_log2, &w.dpsum, &w.dq_accum, &stream, NULL};
        code = launch(variant->pre, args, 8);
    }
    if (code == CUFLASH_SUCCESS) {
        /* Grouped-query: the main kernel's dK / dV are per query head, in the fp32 workspace. */
        void *dk_out = variant->gqa ? (void *)&w.dk_accum : (void *)&dk;
        void *dv_out = variant->gqa ? (void *)&w.dv_accum : (void *)&dv;
        void *args[13] = {&q, &k, &v, &d_o, &w.lse_log2, &w.dpsum, &w.dq_accum, dk_out, dv_out, &w.semaphore, &scale, &stream, NULL};
        code = launch(variant->main, args, 13);
    }
    if (code == CUFLASH_SUCCESS) {
        void *args[5] = {&w.dq_accum, &dq, &scale, &stream, NULL};
        code = launch(variant->post, args, 5);
    }
    if (code == CUFLASH_SUCCESS && variant->gqa) {
        void *args[6] = {&w.dk_accum, &w.dv_accum, &dk, &dv, &stream, NULL};
        code = launch(variant->sum, args, 6);
    }
    /* Stream-ordered: the memory returns to the pool after the kernels queued before it. */
    error = _cudaFreeAsync(base, stream);
    if (code == CUFLASH_SUCCESS && error != 0) code = cuda_failure(error, "cudaFreeAsync");
    return code;
}

/* ------------------------------------------------------------------------------ [B, H, N, D] entry points */

static cuflash_tensor row_major(const void *data, int heads, int seq_len, int head_dim) {
    int64_t row = head_dim, head = row * seq_len;
    return (cuflash_tensor){(void *)data, head * heads, head, row};
}

static cuflash_tensor row_major_stat(const float *data, int heads, int seq_len) {
    return (cuflash_tensor){(void *)data, (int64_t)heads * seq_len, seq_len, 1};
}

static int forward_row_major(int dtype, const void *Q, const void *K, const void *V, void *O, float *L, int batch,
                             int heads, int seq_len, int head_dim, float scale, int causal, void *stream) {
    cuflash_tensor q = row_major(Q, heads, seq_len, head_dim), k = row_major(K, heads, seq_len, head_dim),
                   v = row_major(V, heads, seq_len, head_dim), o = row_major(O, heads, seq_len, head_dim),
                   l = row_major_stat(L, heads, seq_len);
    return cuflash_attention_forward_ex(dtype, &q, &k, &v, &o, &l, batch, heads, heads, seq_len, seq_len, head_dim,
                                        scale, causal, stream);
}

static int backward_row_major(int dtype, const void *dO, const void *Q, const void *K, const void *V, const void *O,
                              const float *L, void *dQ, void *dK, void *dV, int batch, int heads, int seq_len,
                              int head_dim, float scale, int causal, void *stream) {
    cuflash_tensor t[9];
    const void *data[9] = {dO, Q, K, V, O, NULL, dQ, dK, dV};
    for (int i = 0; i < 9; i++) t[i] = row_major(data[i], heads, seq_len, head_dim);
    t[5] = row_major_stat(L, heads, seq_len);
    return cuflash_attention_backward_ex(dtype, &t[0], &t[1], &t[2], &t[3], &t[4], &t[5], &t[6], &t[7], &t[8], batch,
                                         heads, heads, seq_len, seq_len, head_dim, scale, causal, 0, stream);
}

int cuflash_attention_forward_f16(const void *Q, const void *K, const void *V, void *O, float *L, int batch, int heads,
                                  int seq_len, int head_dim, float scale, int causal, void *stream) {
    return forward_row_major(CUFLASH_DTYPE_F16, Q, K, V, O, L, batch, heads, seq_len, head_dim, scale, causal, stream);
}

int cuflash_attention_forward_bf16(const void *Q, const void *K, const void *V, void *O, float *L, int batch,
                                   int heads, int seq_len, int head_dim, float scale, int causal, void *stream) {
    return forward_row_major(CUFLASH_DTYPE_BF16, Q, K, V, O, L, batch, heads, seq_len, head_dim, scale, causal, stream);
}

int cuflash_attention_forward_f32(const float *Q, const float *K, const float *V, float *O, float *L, int batch,
                                  int heads, int seq_len, int head_dim, float scale, int causal, void *stream) {
    return forward_row_major(CUFLASH_DTYPE_F32, Q, K, V, O, L, batch, heads, seq_len, head_dim, scale, causal, stream);
}

int cuflash_attention_backward_f16(const void *dO, const void *Q, const void *K, const void *V, const void *O,
                                   const float *L, void *dQ, void *dK, void *dV, int batch, int heads, int seq_len,
                                   int head_dim, float scale, int causal, void *stream) {
    return backward_row_major(CUFLASH_DTYPE_F16, dO, Q, K, V, O, L, dQ, dK, dV, batch, heads, seq_len, head_dim, scale,
                              causal, stream);
}

int cuflash_attention_backward_bf16(const void *dO, const void *Q, const void *K, const void *V, const void *O,
                                    const float *L, void *dQ, void *dK, void *dV, int batch, int heads, int seq_len,
                                    int head_dim, float scale, int causal, void *stream) {
    return backward_row_major(CUFLASH_DTYPE_BF16, dO, Q, K, V, O, L, dQ, dK, dV, batch, heads, seq_len, head_dim, scale,
                              causal, stream);
}

int cuflash_attention_backward_f32(const float *dO, const float *Q, const float *K, const float *V, const float *O,
                                   const float *L, float *dQ, float *dK, float *dV, int batch, int heads, int seq_len,
                                   int head_dim, float scale, int causal, void *stream) {
    return backward_row_major(CUFLASH_DTYPE_F32, dO, Q, K, V, O, L, dQ, dK, dV, batch, heads, seq_len, head_dim, scale,
                              causal, stream);
}
