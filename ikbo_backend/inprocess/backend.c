/* Triton backend "python_inprocess": runs a model's model.py (a TritonPythonModel, as the python
 * backend does) inside tritonserver's own process. This file starts the interpreter, forwards
 * Triton's five entry points to ikbo_backend/inprocess/driver.py, which does the work through
 * Triton's C API (ctypes), and gives it one helper: all inputs of a request in one call. After an
 * execute it reports the statistics, sends the responses the driver built and releases the requests
 * itself, with the GIL released. No stub process, no shared-memory IPC: what the python backend
 * spends on two process wake-ups and the copies into its shared memory per request is gone.
 *
 * Build (ikbo_backend/inprocess/__init__.py does it):
 *   cc -O2 -shared -fPIC -DIKBO_LIBPYTHON='"<libpython3.X.so.1.0>"' backend.c -ldl -pthread -o libtriton_python_inprocess.so
 * The TRITONSERVER_* symbols resolve at load time from tritonserver's own libtritonserver.so.
 * The Python C API is looked up with dlsym in libpython, loaded RTLD_GLOBAL so that extension
 * modules (torch, numpy) find its symbols. */
#include <dlfcn.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <stdio.h>
#include <time.h>

#ifndef IKBO_LIBPYTHON
#error "define IKBO_LIBPYTHON as the path of the libpython to embed"
#endif

typedef struct TRITONSERVER_Error TRITONSERVER_Error;
typedef struct TRITONBACKEND_Backend TRITONBACKEND_Backend;
typedef struct TRITONBACKEND_ModelInstance TRITONBACKEND_ModelInstance;
typedef struct TRITONBACKEND_Request TRITONBACKEND_Request;
typedef struct TRITONBACKEND_Input TRITONBACKEND_Input;
typedef struct TRITONBACKEND_Response TRITONBACKEND_Response;
enum { TRITONSERVER_ERROR_INTERNAL = 1 };  /* tritonserver.h, TRITONSERVER_Error_Code */
enum { TRITONSERVER_LOG_ERROR = 2 };       /* TRITONSERVER_LogLevel */
enum { TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1, TRITONSERVER_REQUEST_RELEASE_ALL = 1 };
enum { TRITONSERVER_MEMORY_CPU = 0, TRITONSERVER_MEMORY_GPU = 2 }; /* TRITONSERVER_MemoryType */
extern TRITONSERVER_Error *TRITONSERVER_ErrorNew(int code, const char *msg);
extern void TRITONSERVER_ErrorDelete(TRITONSERVER_Error *error);
extern const char *TRITONSERVER_ErrorMessage(TRITONSERVER_Error *error);
extern TRITONSERVER_Error *TRITONSERVER_LogMessage(int level, const char *filename, const int line, const char *msg);
extern TRITONSERVER_Error *TRITONBACKEND_ModelInstanceReportStatistics(TRITONBACKEND_ModelInstance *instance, TRITONBACKEND_Request *request,
                                                                       const bool success, const uint64_t exec_start_ns,
                                                                       const uint64_t compute_start_ns, const uint64_t compute_end_ns,
                                                                       const uint64_t exec_end_ns);
extern TRITONSERVER_Error *TRITONBACKEND_ModelInstanceReportBatchStatistics(TRITONBACKEND_ModelInstance *instance, const uint64_t batch_size,
                                                                            const uint64_t exec_start_ns, const uint64_t compute_start_ns,
                                                                            const uint64_t compute_end_ns, const uint64_t exec_end_ns);
extern TRITONSERVER_Error *TRITONBACKEND_ResponseSend(TRITONBACKEND_Response *response, const uint32_t send_flags, TRITONSERVER_Error *error);
extern TRITONSERVER_Error *TRITONBACKEND_ResponseDelete(TRITONBACKEND_Response *response);
extern TRITONSERVER_Error *TRITONBACKEND_RequestRelease(TRITONBACKEND_Request *request, uint32_t release_flags);
extern TRITONSERVER_Error *TRITONBACKEND_RequestInputCount(TRITONBACKEND_Request *request, uint32_t *count);
extern TRITONSERVER_Error *TRITONBACKEND_RequestInputByIndex(TRITONBACKEND_Request *request, uint32_t index, TRITONBACKEND_Input **input);
extern TRITONSERVER_Error *TRITONBACKEND_InputProperties(TRITONBACKEND_Input *input, const char **name, int *datatype, const int64_t **shape,
                                                         uint32_t *dims_count, uint64_t *byte_size, uint32_t *buffer_count);
extern TRITONSERVER_Error *TRITONBACKEND_InputBuffer(TRITONBACKEND_Input *input, uint32_t index, const void **buffer, uint64_t *buffer_byte_size,
                                                     int *memory_type, int64_t *memory_type_id);

/* One input of `ikbo_read_inputs` (pb_utils._NativeInput mirrors it). status 0: `data` is its one host
 * buffer; else (several buffers, more than IKBO_MAX_DIMS dims, GPU memory, an error) pb_utils reads
 * that input the per-call way, which copies or names the problem. */
#define IKBO_MAX_DIMS 8
typedef struct {
  const char *name;
  const void *data;
  uint64_t byte_size;
  int64_t shape[IKBO_MAX_DIMS];
  int32_t datatype;
  uint32_t dims;
  int32_t status;
  int32_t reserved;
} ikbo_input;

/* All inputs of a request in one call from Python (pb_utils): read the per-call way, each input cost
 * three ctypes calls. Fills min(count, capacity) slots; returns the request's input count, or -1. */
static int64_t ikbo_read_inputs(TRITONBACKEND_Request *request, ikbo_input *inputs, uint32_t capacity) {
  uint32_t count = 0;
  TRITONSERVER_Error *error = TRITONBACKEND_RequestInputCount(request, &count);
  if (error) {
    TRITONSERVER_ErrorDelete(error);
    return -1;
  }
  for (uint32_t i = 0; i < count && i < capacity; ++i) {
    ikbo_input *slot = &inputs[i];
    TRITONBACKEND_Input *input = NULL;
    const int64_t *shape = NULL;
    uint32_t buffers = 0;
    slot->name = NULL;
    slot->data = NULL;
    slot->status = 1;
    if ((error = TRITONBACKEND_RequestInputByIndex(request, i, &input)) ||
        (error = TRITONBACKEND_InputProperties(input, &slot->name, &slot->datatype, &shape, &slot->dims, &slot->byte_size, &buffers))) {
      TRITONSERVER_ErrorDelete(error);
      continue;
    }
    if (slot->dims > IKBO_MAX_DIMS || buffers > 1) continue;
    for (uint32_t d = 0; d < slot->dims; ++d) slot->shape[d] = shape[d];
    if (buffers == 1) {
      uint64_t size = 0;
      int memory = TRITONSERVER_MEMORY_CPU;
      int64_t memory_id = 0;
      if ((error = TRITONBACKEND_InputBuffer(input, 0, &slot->data, &size, &memory, &memory_id))) {
        TRITONSERVER_ErrorDelete(error);
        continue;
      }
      if (memory == TRITONSERVER_MEMORY_GPU || size != slot->byte_size) continue;
    }
    slot->status = 0;
  }
  return count;
}

/* One request's answer as the driver built it (driver._Reply mirrors it). */
typedef struct {
  TRITONBACKEND_Response *response; /* NULL: none could be built (the driver logged why) */
  TRITONSERVER_Error *error;        /* sent with the response, then deleted here; NULL: a success */
  int32_t success;                  /* for the statistics */
  int32_t reserved;
} ikbo_reply;

/* One execute call's exchange with the driver (driver._Execution mirrors it): backend.c zeroes it,
 * the driver fills it with the GIL held, and `finish_execute` acts on it after the GIL is released. */
typedef struct {
  uint64_t compute_start_ns, compute_end_ns; /* around the model's execute */
  ikbo_reply *replies;                       /* one per request */
  int32_t complete;                          /* 1 once every reply is in: else the driver failed first */
  int32_t reserved;
} ikbo_execution;

static void log_error(const char *what, TRITONSERVER_Error *error) {
  char message[1024];
  snprintf(message, sizeof message, "python_inprocess: %s: %s", what, TRITONSERVER_ErrorMessage(error));
  TRITONSERVER_ErrorDelete(error);
  TRITONSERVER_Error *failed = TRITONSERVER_LogMessage(TRITONSERVER_LOG_ERROR, __FILE__, __LINE__, message);
  if (failed) TRITONSERVER_ErrorDelete(failed);
}

/* Statistics (before the responses go: a client that has its answer finds its request counted), then
 * each response sent and its request released. Runs without the GIL: TRITONBACKEND_ResponseSend runs
 * Triton's frontend for the response (gRPC: its serialization) in this thread, ~100 us a request,
 * time in which the other instances' threads now run Python. */
static void finish_execute(TRITONBACKEND_ModelInstance *instance, TRITONBACKEND_Request **requests, uint32_t count,
                           const ikbo_execution *execution, uint64_t exec_start_ns) {
  struct timespec now;
  clock_gettime(CLOCK_MONOTONIC, &now);
  uint64_t exec_end_ns = (uint64_t)now.tv_sec * 1000000000u + (uint64_t)now.tv_nsec;
  TRITONSERVER_Error *error;
  for (uint32_t i = 0; i < count; ++i)
    if ((error = TRITONBACKEND_ModelInstanceReportStatistics(instance, requests[i], execution->replies[i].success, exec_start_ns,
                                                              execution->compute_start_ns, execution->compute_end_ns, exec_end_ns)))
      log_error("reporting a request's statistics failed", error);
  if ((error = TRITONBACKEND_ModelInstanceReportBatchStatistics(instance, count, exec_start_ns, execution->compute_start_ns,
                                                                 execution->compute_end_ns, exec_end_ns)))
    log_error("reporting the batch statistics failed", error);
  for (uint32_t i = 0; i < count; ++i) {
    const ikbo_reply *reply = &execution->replies[i];
    if (reply->response && (error = TRITONBACKEND_ResponseSend(reply->response, TRITONSERVER_RESPONSE_COMPLETE_FINAL, reply->error)))
      log_error("sending a response failed", error);
    if (reply->error) TRITONSERVER_ErrorDelete(reply->error); /* ResponseSend does not take it */
    if ((error = TRITONBACKEND_RequestRelease(requests[i], TRITONSERVER_REQUEST_RELEASE_ALL)))
      log_error("releasing a request failed", error);
  }
}

/* The driver failed before every reply was in: Triton answers and releases the requests itself when
 * execute returns an error, so what was built is deleted unsent. */
static void drop_replies(const ikbo_execution *execution, uint32_t count) {
  for (uint32_t i = 0; i < count; ++i) {
    TRITONSERVER_Error *error;
    if (execution->replies[i].response && (error = TRITONBACKEND_ResponseDelete(execution->replies[i].response)))
      log_error("deleting an unsent response failed", error);
    if (execution->replies[i].error) TRITONSERVER_ErrorDelete(execution->replies[i].error);
  }
}

typedef struct _object PyObject;
static PyObject *driver; /* the ikbo_backend.inprocess.driver module */
static PyObject *(*Import)(const char *);
static PyObject *(*GetAttr)(PyObject *, const char *);
static PyObject *(*Call)(PyObject *, const char *, ...);
static const char *(*AsUTF8)(PyObject *);
static PyObject *None; /* &_Py_NoneStruct */
static void (*DecRef)(PyObject *);
static void (*PrintError)(void);
static int (*GILEnsure)(void);
static void *(*SaveThread)(void);
static void (*RestoreThread)(void *);
static void (*ThreadStateClear)(void *);
static void (*DeleteCurrentThreadState)(void);
/* Each Triton thread's Python thread state, kept from its first call until the thread ends (the key's
 * destructor drops it: instances come and go with model loads). PyGILState_Ensure/Release around
 * each call would create and destroy one per call (8 us against 0.4 us per call on the CPU machine)
 * and lose the thread's threading.local data every time. */
static pthread_key_t thread_state_key;

static void drop_thread_state(void *thread_state) {
  RestoreThread(thread_state); /* the GIL, with the ending thread's own state */
  ThreadStateClear(thread_state);
  DeleteCurrentThreadState(); /* and the GIL released */
}

#define FIND(sym, name)                                     \
  if (!(*(void **)&sym = dlsym(lib, name)))                 \
    return TRITONSERVER_ErrorNew(TRITONSERVER_ERROR_INTERNAL, \
                                 "python_inprocess: " name " not found in " IKBO_LIBPYTHON);

TRITONSERVER_Error *TRITONBACKEND_Initialize(TRITONBACKEND_Backend *backend) {
  (void)backend;
  void *lib = dlopen(IKBO_LIBPYTHON, RTLD_NOW | RTLD_GLOBAL);
  if (!lib) return TRITONSERVER_ErrorNew(TRITONSERVER_ERROR_INTERNAL, dlerror());
  int (*IsInitialized)(void);
  void (*InitializeEx)(int);
  FIND(IsInitialized, "Py_IsInitialized");
  FIND(InitializeEx, "Py_InitializeEx");
  FIND(SaveThread, "PyEval_SaveThread");
  FIND(Import, "PyImport_ImportModule");
  FIND(GetAttr, "PyObject_GetAttrString");
  FIND(Call, "PyObject_CallMethod");
  FIND(AsUTF8, "PyUnicode_AsUTF8");
  FIND(None, "_Py_NoneStruct");
  FIND(DecRef, "Py_DecRef");
  FIND(PrintError, "PyErr_Print");
  FIND(GILEnsure, "PyGILState_Ensure");
  FIND(RestoreThread, "PyEval_RestoreThread");
  FIND(ThreadStateClear, "PyThreadState_Clear");
  FIND(DeleteCurrentThreadState, "PyThreadState_DeleteCurrent");
  if (pthread_key_create(&thread_state_key, drop_thread_state))
    return TRITONSERVER_ErrorNew(TRITONSERVER_ERROR_INTERNAL, "python_inprocess: pthread_key_create failed");
  if (IsInitialized()) return TRITONSERVER_ErrorNew(TRITONSERVER_ERROR_INTERNAL, "python_inprocess: Python already runs in this process");
  InitializeEx(0); /* 0: Triton keeps its signal handlers */
  driver = Import("ikbo_backend.inprocess.driver"); /* found through PYTHONPATH (the repository root) */
  if (!driver) PrintError();
  PyObject *result = driver ? Call(driver, "set_native_reader", "K", (uint64_t)(uintptr_t)&ikbo_read_inputs) : NULL;
  if (driver && !result) PrintError();
  if (result) DecRef(result);
  SaveThread(); /* the GIL is taken per call, from Triton's instance threads */
  return driver ? NULL : TRITONSERVER_ErrorNew(TRITONSERVER_ERROR_INTERNAL, "python_inprocess: cannot import ikbo_backend.inprocess.driver (is the repository root on PYTHONPATH?); the traceback is on stderr");
}

/* driver.<method>(args): NULL on success; else an error with the message the driver returned. */
static TRITONSERVER_Error *call_driver(const char *method, const char *format, uint64_t a, uint64_t b, uint64_t c, uint64_t d) {
  void *thread_state = pthread_getspecific(thread_state_key);
  if (thread_state)
    RestoreThread(thread_state);
  else
    GILEnsure(); /* never released: the thread state lives as long as the thread */
  TRITONSERVER_Error *error = NULL;
  PyObject *result = Call(driver, method, format, a, b, c, d);
  if (!result) {
    PrintError();
    error = TRITONSERVER_ErrorNew(TRITONSERVER_ERROR_INTERNAL, "python_inprocess: the driver raised; the traceback is on stderr");
  } else {
    if (result != None) {
      const char *message = AsUTF8(result);
      error = TRITONSERVER_ErrorNew(TRITONSERVER_ERROR_INTERNAL, message ? message : "python_inprocess: error");
    }
    DecRef(result);
  }
  pthread_setspecific(thread_state_key, SaveThread());
  return error;
}

TRITONSERVER_Error *TRITONBACKEND_ModelInstanceInitialize(TRITONBACKEND_ModelInstance *instance) {
  return call_driver("initialize", "K", (uint64_t)(uintptr_t)instance, 0, 0, 0);
}

TRITONSERVER_Error *TRITONBACKEND_ModelInstanceFinalize(TRITONBACKEND_ModelInstance *instance) {
  return call_driver("finalize", "K", (uint64_t)(uintptr_t)instance, 0, 0, 0);
}

TRITONSERVER_Error *TRITONBACKEND_ModelInstanceExecute(TRITONBACKEND_ModelInstance *instance, TRITONBACKEND_Request **requests,
                                                        const uint32_t request_count) {
  struct timespec now; /* Triton's statistics clock: steady_clock = CLOCK_MONOTONIC */
  clock_gettime(CLOCK_MONOTONIC, &now);
  uint64_t exec_start_ns = (uint64_t)now.tv_sec * 1000000000u + (uint64_t)now.tv_nsec;
  ikbo_execution execution = {0};
  if (!(execution.replies = calloc(request_count ? request_count : 1, sizeof(ikbo_reply))))
    return TRITONSERVER_ErrorNew(TRITONSERVER_ERROR_INTERNAL, "python_inprocess: out of memory for the replies");
  TRITONSERVER_Error *error = call_driver("execute", "KKKK", (uint64_t)(uintptr_t)instance, (uint64_t)(uintptr_t)requests, request_count,
                                          (uint64_t)(uintptr_t)&execution);
  if (!error && !execution.complete)
    error = TRITONSERVER_ErrorNew(TRITONSERVER_ERROR_INTERNAL, "python_inprocess: the driver returned before every reply was built");
  if (error)
    drop_replies(&execution, request_count);
  else
    finish_execute(instance, requests, request_count, &execution, exec_start_ns);
  free(execution.replies);
  return error;
}
