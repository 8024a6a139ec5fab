/* A C program calling the library `cute-flash export` builds: forward and backward of causal
 * bf16 attention on [B, H, N, D] tensors, checked against a float64 computation on the CPU. It
 * needs only the CUDA driver API (cuda.h, libcuda) besides the library. `./c_example FOLDER` also
 * writes inputs and results there as raw arrays (Q.bin, ..., dV.bin: bf16 [B, H, N, D]; L.bin:
 * float32 [B, H, N]).
 *
 *   cute-flash export --arch sm_90a --dtypes bf16 --head-dims 64 -o build/cute-flash-c
 *   cc -O2 examples/c_example.c -I build/cute-flash-c -L build/cute-flash-c -lcute_flash \
 *      -Wl,-rpath,build/cute-flash-c -I /usr/local/cuda/include -L /usr/local/cuda/lib64/stubs -lcuda -lm \
 *      -o c_example
 *   ./c_example [FOLDER]
 *
 * Exit status 0 when every result is within its error bound. */
#include <cuda.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cute_flash.h"

enum { B = 2, H = 3, N = 200, D = 64, CAUSAL = 1 };
#define ELEMENTS ((size_t)B * H * N * D)
#define ROWS ((size_t)B * H * N)

#define CHECK_CU(call)                                                                                  \
    do {                                                                                                \
        CUresult result_ = (call);                                                                      \
        if (result_ != CUDA_SUCCESS) {                                                                  \
            fprintf(stderr, "%s failed: CUresult %d\n", #call, (int)result_);                           \
            exit(1);                                                                                    \
        }                                                                                               \
    } while (0)

#define CHECK_FLASH(call)                                                                               \
    do {                                                                                                \
        int code_ = (call);                                                                             \
        if (code_ != CUFLASH_SUCCESS) {                                                                 \
            fprintf(stderr, "%s: error %d, %s (%s)\n", #call, code_, cuflash_error_string(code_),       \
                    cuflash_last_error_message());                                                      \
            exit(1);                                                                                    \
        }                                                                                               \
    } while (0)

/* bf16 is the upper half of a float32, rounded to nearest even. */
static uint16_t to_bf16(float x) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    bits += 0x7fff + ((bits >> 16) & 1);
    return (uint16_t)(bits >> 16);
}

static double from_bf16(uint16_t x) {
    uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static double uniform(void) { return 2.0 * rand() / RAND_MAX - 1.0; }

static uint16_t *random_bf16(void) {
    uint16_t *host = malloc(ELEMENTS * sizeof *host);
    for (size_t i = 0; i < ELEMENTS; i++) host[i] = to_bf16((float)(2.0 * uniform()));
    return host;
}

static CUdeviceptr upload(const void *host, size_t bytes) {
    CUdeviceptr device;
    CHECK_CU(cuMemAlloc(&device, bytes));
    if (host != NULL) CHECK_CU(cuMemcpyHtoD(device, host, bytes));
    return device;
}

static uint16_t *download(CUdeviceptr device) {
    uint16_t *host = malloc(ELEMENTS * sizeof *host);
    CHECK_CU(cuMemcpyDtoH(host, device, ELEMENTS * sizeof *host));
    return host;
}

static double *widen(const uint16_t *bf16) {
    double *values = malloc(ELEMENTS * sizeof *values);
    for (size_t i = 0; i < ELEMENTS; i++) values[i] = from_bf16(bf16[i]);
    return values;
}

/* Raw arrays for checking elsewhere: bf16 [B, H, N, D], or float32 [B, H, N] for L. */
static void save(const char *folder, const char *name, const void *data, size_t bytes) {
    char path[4096];
    snprintf(path, sizeof path, "%s/%s.bin", folder, name);
    FILE *file = fopen(path, "wb");
    if (file == NULL || fwrite(data, 1, bytes, file) != bytes || fclose(file) != 0) {
        fprintf(stderr, "cannot write %s\n", path);
        exit(1);
    }
}

/* Attention of one (batch, head) in float64: O, L and, from dO, the gradients (FlashAttention-2's
 * Algorithm 2 without tiles). Inputs and outputs are N x D row-major blocks. */
static void reference(const double *q, const double *k, const double *v, const double *dout, double scale,
                      double *out, double *lse, double *dq, double *dk, double *dv) {
    static double p[N][N], dp[N][N];
    for (int i = 0; i < N; i++) {
        double max = -INFINITY, sum = 0.0;
        for (int j = 0; j < N; j++) {
            double s = 0.0;
            for (int d = 0; d < D; d++) s += q[i * D + d] * k[j * D + d];
            p[i][j] = CAUSAL && j > i ? -INFINITY : s * scale;
            if (p[i][j] > max) max = p[i][j];
        }
        for (int j = 0; j < N; j++) sum += p[i][j] = exp(p[i][j] - max);
        lse[i] = max + log(sum);
        for (int j = 0; j < N; j++) p[i][j] /= sum;
        for (int d = 0; d < D; d++) {
            double o = 0.0;
            for (int j = 0; j < N; j++) o += p[i][j] * v[j * D + d];
            out[i * D + d] = o;
        }
    }
    memset(dq, 0, N * D * sizeof *dq);
    memset(dk, 0, N * D * sizeof *dk);
    memset(dv, 0, N * D * sizeof *dv);
    for (int i = 0; i < N; i++) {
        double row = 0.0; /* rowsum(dO * O) = sum_j P_ij dP_ij */
        for (int d = 0; d < D; d++) row += dout[i * D + d] * out[i * D + d];
        for (int j = 0; j < N; j++) {
            dp[i][j] = 0.0;
            for (int d = 0; d < D; d++) dp[i][j] += dout[i * D + d] * v[j * D + d];
            double ds = p[i][j] * (dp[i][j] - row) * scale;
            for (int d = 0; d < D; d++) {
                dv[j * D + d] += p[i][j] * dout[i * D + d];
                dq[i * D + d] += ds * k[j * D + d];
                dk[j * D + d] += ds * q[i * D + d];
            }
        }
    }
}

/* Largest error relative to the reference's largest magnitude. */
static double relative_error(const double *got, const double *want, size_t count) {
    double error = 0.0, scale = 0.0;
    for (size_t i = 0; i < count; i++) {
        if (fabs(got[i] - want[i]) > error) error = fabs(got[i] - want[i]);
        if (fabs(want[i]) > scale) scale = fabs(want[i]);
    }
    return error / (scale > 0.0 ? scale : 1.0);
}

int main(int argc, char **argv) {
    printf("%s", cuflash_build_info());
    /* The library takes the caller's current device and a stream of it. */
    CUdevice device;
    CUcontext context;
    CUstream stream;
    CHECK_CU(cuInit(0));
    CHECK_CU(cuDeviceGet(&device, 0));
    CHECK_CU(cuDevicePrimaryCtxRetain(&context, device));
    CHECK_CU(cuCtxSetCurrent(context));
    CHECK_CU(cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING));

    srand(7);
    uint16_t *host[4];
    for (int i = 0; i < 4; i++) host[i] = random_bf16(); /* Q, K, V, dO */
    size_t bytes = ELEMENTS * sizeof(uint16_t);
    CUdeviceptr q = upload(host[0], bytes), k = upload(host[1], bytes), v = upload(host[2], bytes),
                dout = upload(host[3], bytes), out = upload(NULL, bytes), dq = upload(NULL, bytes),
                dk = upload(NULL, bytes), dv = upload(NULL, bytes), lse = upload(NULL, ROWS * sizeof(float));
    float scale = 1.0f / sqrtf((float)D);

    CHECK_FLASH(cuflash_attention_forward_bf16((void *)q, (void *)k, (void *)v, (void *)out, (float *)lse, B, H, N, D,
                                               scale, CAUSAL, stream));
    CHECK_FLASH(cuflash_attention_backward_bf16((void *)dout, (void *)q, (void *)k, (void *)v, (void *)out,
                                                (float *)lse, (void *)dq, (void *)dk, (void *)dv, B, H, N, D, scale,
                                                CAUSAL, stream));
    CHECK_CU(cuStreamSynchronize(stream));

    /* Which variants the library holds (cute-flash export --dtypes ...): a call of another one
     * returns CUFLASH_ERROR_VARIANT_NOT_EXPORTED before any launch. */
    printf("f32 forward exported: %d\n", cuflash_variant_exported(0, CUFLASH_DTYPE_F32, D, CAUSAL));

    uint16_t *results[4] = {download(out), download(dq), download(dk), download(dv)};
    double *got[4] = {widen(results[0]), widen(results[1]), widen(results[2]), widen(results[3])};
    float *got_lse = malloc(ROWS * sizeof *got_lse);
    CHECK_CU(cuMemcpyDtoH(got_lse, lse, ROWS * sizeof *got_lse));
    if (argc > 1) {
        const char *names[8] = {"Q", "K", "V", "dO", "O", "dQ", "dK", "dV"};
        for (int t = 0; t < 8; t++) save(argv[1], names[t], t < 4 ? host[t] : results[t - 4], bytes);
        save(argv[1], "L", got_lse, ROWS * sizeof *got_lse);
    }

    double *in[4], *want[4], *want_lse = malloc(ROWS * sizeof *want_lse);
    for (int t = 0; t < 4; t++) {
        in[t] = widen(host[t]);
        want[t] = malloc(ELEMENTS * sizeof **want);
    }
    for (size_t bh = 0; bh < (size_t)B * H; bh++) {
        size_t at = bh * N * D;
        reference(in[0] + at, in[1] + at, in[2] + at, in[3] + at, scale, want[0] + at, want_lse + bh * N,
                  want[1] + at, want[2] + at, want[3] + at);
    }
    double lse_error = 0.0;
    for (size_t i = 0; i < ROWS; i++) lse_error = fmax(lse_error, fabs(got_lse[i] - want_lse[i]));

    /* bf16 outputs carry a relative rounding of 2^-8; the gradients also go through bf16 P and dS. */
    const char *names[4] = {"O", "dQ", "dK", "dV"};
    const double bounds[4] = {1e-2, 3e-2, 3e-2, 3e-2};
    int failed = !(lse_error < 1e-3);
    printf("L: max error %.2e (bound 1e-3)\n", lse_error);
    for (int t = 0; t < 4; t++) {
        double error = relative_error(got[t], want[t], ELEMENTS);
        failed |= !(error < bounds[t]);
        printf("%s: max error %.2e of the largest value (bound %.0e)\n", names[t], error, bounds[t]);
    }
    CUdeviceptr buffers[9] = {q, k, v, dout, out, dq, dk, dv, lse};
    for (int i = 0; i < 9; i++) CHECK_CU(cuMemFree(buffers[i]));
    CHECK_CU(cuStreamDestroy(stream));
    CHECK_CU(cuDevicePrimaryCtxRelease(device));
    puts(failed ? "FAILED" : "ok");
    return failed;
}
