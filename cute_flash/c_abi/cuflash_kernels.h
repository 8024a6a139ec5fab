/* The contract between cuflash.c (argument checks, views, workspaces, launches) and the kernel
 * table that `cute-flash export` generates (cute_flash/export.py): which kernels the library
 * holds and the CuTe DSL entry points of each. */
#ifndef CUFLASH_KERNELS_H
#define CUFLASH_KERNELS_H

#include <stdint.h>

/* The tensor descriptors the DSL's exported launchers take for our kernels' operands (export.py
 * checks every kernel's generated header against these layouts). Dynamic extents, then dynamic
 * strides, in elements. */
typedef struct {
    void *data;
    int32_t shape[3];  /* batch, seqlen, heads (head_dim is static, stride 1) */
    int64_t stride[3]; /* batch, seqlen, heads */
} cf_bshd;

typedef struct {
    void *data;
    int32_t shape[3];  /* batch, heads, rows */
    int64_t stride[2]; /* batch, heads (rows: stride 1) */
} cf_rows;

/* One exported kernel: its DSL entry points (symbols prefixed per kernel) and its load state. */
typedef struct cf_kernel {
    const char *name;
    void (*init)(void **);           /* loads the embedded cubin as a cudaLibrary_t */
    void (*load_to_device)(void **); /* resolves the kernels and sets their attributes on a device */
    void (*launch)(void **, int32_t);
    void *library;                   /* the cudaLibrary_t, once init succeeded */
    uint64_t loaded_devices;         /* bit d: load_to_device succeeded on device d */
} cf_kernel;

typedef struct {
    int dtype, head_dim, causal;
    cf_kernel *kernel; /* FlashAttnFwdSm80: (q, k, v, out, lse, scale, stream) */
} cf_forward_variant;

typedef struct {
    int dtype, head_dim, causal;
    int gqa;             /* main writes fp32 per-query-head dK / dV into the workspace; `sum` adds
                            each group into the caller's dK / dV */
    int deterministic;   /* main orders dQ's accumulation with a zeroed int32 counter per
                            (batch, head, query block) */
    int m_block;         /* the main kernel's query block: dQ's accumulator is blocked by it */
    int head_dim_padded; /* the accumulator's row width */
    cf_kernel *pre;      /* (out, dout, lse, lse_log2, dpsum, stream) */
    cf_kernel *main;     /* (q, k, v, dout, lse_log2, dpsum, dq_accum, dk, dv, semaphore, scale, stream) */
    cf_kernel *post;     /* (dq_accum, dq, scale, stream) */
    cf_kernel *sum;      /* gqa only, else NULL: (dk_accum, dv_accum, dk, dv, stream) */
} cf_backward_variant;

/* Both tables end with an entry whose kernel pointers are NULL. */
extern const cf_forward_variant cf_forward_variants[];
extern const cf_backward_variant cf_backward_variants[];

/* The compile target: code for sm_<major><minor> runs on that major version from that minor on;
 * an arch-specific target ('a', e.g. sm_90a) on exactly that version. */
extern const int cf_target_major, cf_target_minor, cf_target_arch_specific;
extern const char cf_build_info[];
/* Rows of the backward's row statistics are padded to a multiple of this (launchers.ROW_PAD). */
extern const int cf_row_pad;

#endif /* CUFLASH_KERNELS_H */
