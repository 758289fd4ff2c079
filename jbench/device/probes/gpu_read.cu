// jbench GPU read-bandwidth probe: the rate at which a kernel can stream a buffer much larger than L2
// out of device memory (what LLM decode does with its weights), plus a device-to-device cudaMemcpy rate
// for comparison. Prints one JSON object. Built on the device with its own nvcc by jbench calibrate.
//
// usage: gpu_read SIZE_MB RUNS
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CHECK(call) do { cudaError_t e_ = (call); if (e_ != cudaSuccess) { \
    fprintf(stderr, "CUDA error %s at %s:%d: %s\n", #call, __FILE__, __LINE__, cudaGetErrorString(e_)); \
    exit(2); } } while (0)

// Grid-stride read with 16-byte loads, four independent loads in flight per thread; the XOR of
// everything read is written per thread so the compiler cannot drop the loads.
__global__ void read_kernel(const uint4 *__restrict__ src, size_t n, unsigned int *__restrict__ sink) {
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    size_t stride = (size_t)gridDim.x * blockDim.x;
    uint4 a = make_uint4(0, 0, 0, 0), b = a, c = a, d = a;
    for (; i + 3 * stride < n; i += 4 * stride) {
        uint4 x = __ldcs(src + i), y = __ldcs(src + i + stride);
        uint4 z = __ldcs(src + i + 2 * stride), w = __ldcs(src + i + 3 * stride);
        a.x ^= x.x; a.y ^= x.y; a.z ^= x.z; a.w ^= x.w;
        b.x ^= y.x; b.y ^= y.y; b.z ^= y.z; b.w ^= y.w;
        c.x ^= z.x; c.y ^= z.y; c.z ^= z.z; c.w ^= z.w;
        d.x ^= w.x; d.y ^= w.y; d.z ^= w.z; d.w ^= w.w;
    }
    for (; i < n; i += stride) {
        uint4 x = __ldcs(src + i);
        a.x ^= x.x; a.y ^= x.y; a.z ^= x.z; a.w ^= x.w;
    }
    unsigned int v = a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w ^ c.x ^ c.y ^ c.z ^ c.w ^ d.x ^ d.y ^ d.z ^ d.w;
    sink[blockIdx.x * (size_t)blockDim.x + threadIdx.x] = v;
}

static void print_list(const char *name, const double *v, int n) {
    printf("\"%s\": [", name);
    for (int i = 0; i < n; i++) printf("%s%.3f", i ? ", " : "", v[i]);
    printf("]");
}

int main(int argc, char **argv) {
    if (argc != 3) { fprintf(stderr, "usage: %s SIZE_MB RUNS\n", argv[0]); return 2; }
    size_t size = (size_t)atol(argv[1]) << 20;
    int runs = atoi(argv[2]);
    if (size < (16u << 20) || runs < 1 || runs > 100) { fprintf(stderr, "SIZE_MB >= 16, 1 <= RUNS <= 100\n"); return 2; }
    int dev = 0;
    CHECK(cudaSetDevice(dev));
    cudaDeviceProp prop;
    CHECK(cudaGetDeviceProperties(&prop, dev));
    size = size / 16 * 16;
    size_t n = size / 16;
    uint4 *buf, *dst;
    unsigned int *sink;
    CHECK(cudaMalloc(&buf, size));
    CHECK(cudaMalloc(&dst, size / 2));
    CHECK(cudaMemset(buf, 0x5a, size));
    int threads = 512, blocks = prop.multiProcessorCount * (prop.maxThreadsPerMultiProcessor / threads) * 2;
    CHECK(cudaMalloc(&sink, (size_t)blocks * threads * sizeof(unsigned int)));
    cudaEvent_t t0, t1;
    CHECK(cudaEventCreate(&t0));
    CHECK(cudaEventCreate(&t1));
    const int reps = 10;  // kernels per timed run: one launch is too short to time on a fast GPU
    double *read_gbs = (double *)calloc(runs, sizeof(double)), *copy_gbs = (double *)calloc(runs, sizeof(double));
    for (int w = 0; w < 3; w++) read_kernel<<<blocks, threads>>>(buf, n, sink);
    CHECK(cudaGetLastError());
    CHECK(cudaDeviceSynchronize());
    for (int r = 0; r < runs; r++) {
        CHECK(cudaEventRecord(t0));
        for (int k = 0; k < reps; k++) read_kernel<<<blocks, threads>>>(buf, n, sink);
        CHECK(cudaEventRecord(t1));
        CHECK(cudaEventSynchronize(t1));
        CHECK(cudaGetLastError());
        float ms;
        CHECK(cudaEventElapsedTime(&ms, t0, t1));
        read_gbs[r] = (double)size * reps / (ms / 1e3) / 1e9;
    }
    // Device-to-device copy of half the buffer; counted as bytes read plus bytes written, the usual
    // convention for copy bandwidth.
    size_t half = size / 2;
    for (int w = 0; w < 2; w++) CHECK(cudaMemcpy(dst, buf, half, cudaMemcpyDeviceToDevice));
    CHECK(cudaDeviceSynchronize());
    for (int r = 0; r < runs; r++) {
        CHECK(cudaEventRecord(t0));
        for (int k = 0; k < reps; k++) CHECK(cudaMemcpyAsync(dst, buf, half, cudaMemcpyDeviceToDevice));
        CHECK(cudaEventRecord(t1));
        CHECK(cudaEventSynchronize(t1));
        float ms;
        CHECK(cudaEventElapsedTime(&ms, t0, t1));
        copy_gbs[r] = 2.0 * half * reps / (ms / 1e3) / 1e9;
    }
    int rt = 0, drv = 0;
    cudaRuntimeGetVersion(&rt);
    cudaDriverGetVersion(&drv);
    printf("{\"probe\": \"cuda-read\", \"gpu\": \"%s\", \"sm_count\": %d, \"l2_bytes\": %d, \"buffer_bytes\": %zu, "
           "\"cuda_runtime\": %d, \"cuda_driver\": %d, \"threads\": %d, \"blocks\": %d, ",
           prop.name, prop.multiProcessorCount, prop.l2CacheSize, size, rt, drv, threads, blocks);
    print_list("read_gbs", read_gbs, runs);
    printf(", ");
    print_list("copy_gbs", copy_gbs, runs);
    printf("}\n");
    return 0;
}
