/* A stand-in for the CUDA driver (libcuda.so.1) on a machine without one, so that cuDNN's
 * runtime-compiled engine library loads and cuDNN can plan graphs for a *described* device
 * (cudnn_attn.graphs.deviceless). Nothing here touches a GPU and nothing can run:
 *
 *  - every entry point about devices, contexts, memory or launches returns
 *    CUDA_ERROR_NO_DEVICE (100);
 *  - the library/kernel handle calls cuDNN makes while it finalizes an execution plan
 *    (cuLibraryLoadData, cuLibraryGetKernel, cuKernelGetFunction, cuLibraryUnload) succeed with
 *    opaque handles and read nothing, so a plan can be built and serialized; the kernel names
 *    cuDNN asks for are recorded (cudnn_attn_standin_kernel) - they name the kernel the plan
 *    would launch;
 *  - cuDriverGetVersion, cuGetErrorString and cuGetErrorName answer.
 * Whether a kernel image really loads on a GPU is checked only on a GPU.
 */
#include <string.h>

typedef int CUresult;
#define CUDA_SUCCESS 0
#define CUDA_ERROR_NO_DEVICE 100
#define NO_DEVICE(name) CUresult name(void) { return CUDA_ERROR_NO_DEVICE; }

static int handle_token;            /* the address every opaque handle points at */
static char kernel_names[8][512];   /* the last kernels asked for, oldest overwritten first */
static unsigned kernel_count;

CUresult cuDriverGetVersion(int *version) { if (version) *version = 12090; return CUDA_SUCCESS; }

CUresult cuGetErrorString(CUresult error, const char **text) {
    if (text) *text = error == CUDA_ERROR_NO_DEVICE
        ? "no CUDA-capable device is detected (cudnn_attn's libcuda stand-in: nothing can run)"
        : "unknown error (cudnn_attn's libcuda stand-in)";
    return CUDA_SUCCESS;
}

CUresult cuGetErrorName(CUresult error, const char **text) {
    if (text) *text = error == CUDA_ERROR_NO_DEVICE ? "CUDA_ERROR_NO_DEVICE" : "CUDA_ERROR_UNKNOWN";
    return CUDA_SUCCESS;
}

CUresult cuGetProcAddress(const char *symbol, void **fn, int version, unsigned long long flags) {
    (void)symbol; (void)version; (void)flags;
    if (fn) *fn = 0;
    return CUDA_ERROR_NO_DEVICE;
}

CUresult cuGetProcAddress_v2(const char *symbol, void **fn, int version, unsigned long long flags,
                             int *status) {
    (void)symbol; (void)version; (void)flags;
    if (fn) *fn = 0;
    if (status) *status = 1; /* CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND */
    return CUDA_ERROR_NO_DEVICE;
}

CUresult cuLibraryLoadData(void **library, const void *code, void *jit_options, void *jit_values,
                           unsigned jit_count, void *lib_options, void *lib_values,
                           unsigned lib_count) {
    (void)code; (void)jit_options; (void)jit_values; (void)jit_count;
    (void)lib_options; (void)lib_values; (void)lib_count;
    if (library) *library = &handle_token;
    return CUDA_SUCCESS;
}

CUresult cuLibraryGetKernel(void **kernel, void *library, const char *name) {
    (void)library;
    if (name) {
        strncpy(kernel_names[kernel_count % 8], name, sizeof kernel_names[0] - 1);
        kernel_count++;
    }
    if (kernel) *kernel = &handle_token;
    return CUDA_SUCCESS;
}

CUresult cuKernelGetFunction(void **function, void *kernel) {
    (void)kernel;
    if (function) *function = &handle_token;
    return CUDA_SUCCESS;
}

CUresult cuLibraryUnload(void *library) { (void)library; return CUDA_SUCCESS; }

/* How many kernel names were recorded so far, and the i-th most recent one ("" if none). */
unsigned cudnn_attn_standin_kernel_count(void) { return kernel_count; }
const char *cudnn_attn_standin_kernel(unsigned back) {
    if (back >= kernel_count || back >= 8) return "";
    return kernel_names[(kernel_count - 1 - back) % 8];
}

NO_DEVICE(cuInit)
NO_DEVICE(cuDeviceGet)
NO_DEVICE(cuDeviceGetCount)
NO_DEVICE(cuDeviceGetAttribute)
NO_DEVICE(cuDeviceGetName)
NO_DEVICE(cuDevicePrimaryCtxRetain)
NO_DEVICE(cuCtxGetCurrent)
NO_DEVICE(cuCtxSetCurrent)
NO_DEVICE(cuCtxGetDevice)
NO_DEVICE(cuCtxGetLimit)
NO_DEVICE(cuCtxPushCurrent)
NO_DEVICE(cuCtxPopCurrent)
NO_DEVICE(cuStreamGetCtx)
NO_DEVICE(cuModuleLoadData)
NO_DEVICE(cuModuleGetFunction)
NO_DEVICE(cuModuleUnload)
NO_DEVICE(cuLibraryLoadFromFile)
NO_DEVICE(cuKernelGetAttribute)
NO_DEVICE(cuKernelSetAttribute)
NO_DEVICE(cuFuncGetAttribute)
NO_DEVICE(cuFuncSetAttribute)
NO_DEVICE(cuLinkCreate)
NO_DEVICE(cuLinkAddData)
NO_DEVICE(cuLinkComplete)
NO_DEVICE(cuLinkDestroy)
NO_DEVICE(cuLaunchKernel)
NO_DEVICE(cuLaunchKernelEx)
NO_DEVICE(cuLaunchCooperativeKernel)
NO_DEVICE(cuOccupancyMaxPotentialClusterSize)
NO_DEVICE(cuTensorMapEncodeTiled)
NO_DEVICE(cuTensorMapEncodeIm2col)
NO_DEVICE(cuMemAlloc)
NO_DEVICE(cuMemFree)
NO_DEVICE(cuMemcpyHtoD)
NO_DEVICE(cuMemcpyDtoH)
