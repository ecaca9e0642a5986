/* A stand-in libcuda.so.1 for running the patched SGLang server on a machine WITHOUT a GPU driver
 * (CI, laptops; tools/bootstrap_sglang builds it into .cache/sgl-venv/cuda-stub/).
 *
 * Why it exists: sglang imports sgl_kernel unconditionally, and sgl_kernel's CUDA library is linked
 * against the driver library, so the dynamic loader refuses to load it when no libcuda.so.1 exists.
 * On the CPU path none of these functions is ever called; they only have to resolve. Each one
 * answers CUDA_ERROR_NO_DEVICE, so anything that did call one would fail loudly instead of
 * pretending a GPU exists. It is put on LD_LIBRARY_PATH of CPU servers only (through the recipe's
 * capture.sglang.server_env), never on GPU nodes, where the real driver must be found. */

typedef int CUresult;
#define CUDA_ERROR_NO_DEVICE 100

#define STUB(name) \
    CUresult name() { return CUDA_ERROR_NO_DEVICE; }

STUB(cuCtxFromGreenCtx)
STUB(cuCtxPopCurrent_v2)
STUB(cuCtxPushCurrent_v2)
STUB(cuDevResourceGenerateDesc)
STUB(cuDevSmResourceSplitByCount)
STUB(cuDeviceGetDevResource)
STUB(cuDriverGetVersion)
STUB(cuGetProcAddress_v2)
STUB(cuGreenCtxCreate)
STUB(cuGreenCtxDestroy)
STUB(cuGreenCtxGetDevResource)
STUB(cuPointerGetAttribute)
STUB(cuStreamCreate)

CUresult cuGetErrorString(CUresult error, const char **message) {
    (void)error;
    if (message) *message = "no CUDA driver: this is the CPU-only libcuda stub of dspark-recipes";
    return 0;
}
