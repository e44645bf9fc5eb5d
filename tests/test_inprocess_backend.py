"""The python_inprocess backend (ikbo_backend/inprocess) with a real tritonserver on the CPU, on toy
models written here: answers equal an fp64 reference on fresh random inputs (HTTP and gRPC, several
dtypes), request parameters reach the model, a model that raises answers that request with an
INTERNAL error that hides the exception's text, a model whose initialize fails does not load (its
message says why) while the others keep serving, and Triton's per-model statistics are reported.
The rankers under this backend are tested in tests/test_server.py (the GPU configs placed on the
CPU) and tests/test_online.py (the online endpoints, both backends)."""

import os
import secrets
import threading
import time

import numpy as np
import pytest
from tritonclient.utils import InferenceServerException

from ikbo_backend.inprocess.driver import _Exclusive
from ikbo_backend.tritonserver import running_tritonserver

SEED = secrets.randbits(32)
pytestmark = pytest.mark.timeout(300)

SCALE_MODEL = '''
import ctypes
import json
import threading
import numpy as np
import torch
import triton_python_backend_utils as pb_utils

calls_on_this_thread = threading.local()


def thread_states():
    """Python thread states of this interpreter (one per thread that has called into Python)."""
    api = ctypes.pythonapi
    api.PyInterpreterState_Get.restype = api.PyInterpreterState_ThreadHead.restype = api.PyThreadState_Next.restype = ctypes.c_void_p
    api.PyInterpreterState_ThreadHead.argtypes = api.PyThreadState_Next.argtypes = [ctypes.c_void_p]
    count, state = 0, api.PyInterpreterState_ThreadHead(api.PyInterpreterState_Get())
    while state:
        count, state = count + 1, api.PyThreadState_Next(state)
    return count


def read_paths(request):
    """[1 if backend.c's one-call reader is bound and gave every present input, 1 if the per-call
    reading gives the same tensors (dtype, shape, values; None for an absent input)]."""
    native = pb_utils._read_all_inputs(request)
    present = {name for name in ("X", "IDS", "F16", "BF16") if pb_utils._read_input(request, name) is not None}
    agree = True
    for name in ("X", "IDS", "F16", "BF16"):
        per_call, one_call = pb_utils._read_input(request, name), native.get(name)
        if per_call is None or one_call is None:
            agree &= per_call is None and one_call is None
        else:
            a, b = per_call.as_torch(), one_call.as_torch()
            agree &= a.dtype == b.dtype and a.shape == b.shape and bool((a.view(-1).view(torch.uint8) == b.view(-1).view(torch.uint8)).all())
    return np.array([int(pb_utils._native_read_inputs is not None and set(native) == present), int(agree)])


class TritonPythonModel:
    def initialize(self, args):
        self.kind = args["model_instance_kind"]

    def execute(self, requests):
        calls_on_this_thread.count = getattr(calls_on_this_thread, "count", 0) + 1
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            ids = pb_utils.get_input_tensor_by_name(request, "IDS").as_numpy()
            if x.size and x.flat[0] < 0:
                raise RuntimeError("secret /internal/path")
            scale = json.loads(request.parameters()).get("scale", 2)
            halves = [pb_utils.get_input_tensor_by_name(request, name) for name in ("F16", "BF16")]
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("Y", (x.astype(np.float64) * scale).astype(np.float32)),
                pb_utils.Tensor("IDS_PLUS_ONE", ids + 1),
                pb_utils.Tensor("THREAD_CALLS", np.array([calls_on_this_thread.count])),
                pb_utils.Tensor("THREAD_STATES", np.array([thread_states()])),
                pb_utils.Tensor("READ_PATHS", read_paths(request)),
            ] + [pb_utils.Tensor(f"{t.name()}_TWICE", t.as_torch() * 2) for t in halves if t is not None]))
        return responses
'''
BROKEN_MODEL = """
class TritonPythonModel:
    def initialize(self, args):
        raise ValueError("this model cannot load: weights missing")

    def execute(self, requests):
        return []
"""
CONFIG = """
name: "{name}"
backend: "python_inprocess"
max_batch_size: 0
input [ {{ name: "X" data_type: TYPE_FP32 dims: [ -1, 3 ] }}, {{ name: "IDS" data_type: TYPE_INT64 dims: [ -1 ] }},
        {{ name: "F16" data_type: TYPE_FP16 dims: [ -1 ] optional: true }}, {{ name: "BF16" data_type: TYPE_BF16 dims: [ -1 ] optional: true }} ]
output [ {{ name: "Y" data_type: TYPE_FP32 dims: [ -1, 3 ] }}, {{ name: "IDS_PLUS_ONE" data_type: TYPE_INT64 dims: [ -1 ] }},
         {{ name: "THREAD_CALLS" data_type: TYPE_INT64 dims: [ 1 ] }}, {{ name: "THREAD_STATES" data_type: TYPE_INT64 dims: [ 1 ] }},
         {{ name: "READ_PATHS" data_type: TYPE_INT64 dims: [ 2 ] }},
         {{ name: "F16_TWICE" data_type: TYPE_FP16 dims: [ -1 ] }}, {{ name: "BF16_TWICE" data_type: TYPE_BF16 dims: [ -1 ] }} ]
instance_group [ {{ kind: KIND_CPU count: 2 }} ]
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("inprocess_repo")
    for name, source in (("scale", SCALE_MODEL), ("broken", BROKEN_MODEL)):
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "1" / "model.py").write_text(source)
        (repo / name / "config.pbtxt").write_text(CONFIG.format(name=name))
    log_path = tmp_path_factory.mktemp("server") / "tritonserver.log"
    with running_tritonserver(
        repo, log_path=log_path, extra_args=["--model-control-mode=explicit", "--load-model=scale"]
    ) as running:
        yield running


def clients(server):
    import tritonclient.grpc as grpc
    import tritonclient.http as http

    return [(http, http.InferenceServerClient(server.http_url)), (grpc, grpc.InferenceServerClient(server.grpc_url))]


def infer_result(module, client, x, ids, parameters=None):
    inputs = [module.InferInput("X", list(x.shape), "FP32"), module.InferInput("IDS", list(ids.shape), "INT64")]
    inputs[0].set_data_from_numpy(x)
    inputs[1].set_data_from_numpy(ids)
    return client.infer("scale", inputs, parameters=parameters)


def infer(module, client, x, ids, parameters=None):
    result = infer_result(module, client, x, ids, parameters)
    return result.as_numpy("Y"), result.as_numpy("IDS_PLUS_ONE")


def test_answers_equal_the_fp64_reference(server):
    rng = np.random.default_rng(SEED)
    for module, client in clients(server):
        for rows, scale in ((1, None), (17, 3), (0, None), (1000, 0.5)):
            x = rng.uniform(0.5, 2.0, (rows, 3)).astype(np.float32)
            ids = rng.integers(-(2**40), 2**40, rows)
            y, ids_plus_one = infer(module, client, x, ids, {"scale": scale} if scale is not None else None)
            want = x.astype(np.float64) * (2 if scale is None else scale)
            assert y.shape == want.shape and np.allclose(y, want, rtol=1e-7, atol=0), (
                f"{module.__name__} rows {rows} (seed {SEED})"
            )
            assert np.array_equal(ids_plus_one, ids + 1), f"{module.__name__} rows {rows} (seed {SEED})"
        client.close()


def test_16_bit_inputs_and_outputs(server):
    """FP16 and BF16 (no numpy type: its bits travel as uint16) in and out; doubling is exact in both."""
    rng = np.random.default_rng(SEED + 3)
    for module, client in clients(server):
        x, ids = rng.uniform(1, 2, (4, 3)).astype(np.float32), np.arange(4)
        f16 = rng.uniform(-4, 4, 33).astype(np.float16)
        bf16 = (rng.uniform(-4, 4, 33).astype(np.float32).view(np.uint32) & 0xFFFF0000).view(np.float32)  # bf16 values
        inputs = [module.InferInput("X", [4, 3], "FP32"), module.InferInput("IDS", [4], "INT64"),
                  module.InferInput("F16", [33], "FP16"), module.InferInput("BF16", [33], "BF16")]  # fmt: skip
        for tensor, value in zip(inputs, (x, ids, f16, bf16)):
            tensor.set_data_from_numpy(value)
        result = client.infer("scale", inputs)
        assert np.array_equal(result.as_numpy("F16_TWICE"), f16 * 2), f"{module.__name__} (seed {SEED})"
        assert np.array_equal(result.as_numpy("BF16_TWICE").astype(np.float32), bf16 * 2), (
            f"{module.__name__} (seed {SEED})"
        )
        client.close()


def test_all_inputs_come_through_one_native_call_equal_to_the_per_call_reading(server):
    """backend.c's ikbo_read_inputs gives every input of a request in one call; the per-call path
    (kept for inputs it leaves out) reads the same bytes, dtypes and shapes, and None when absent."""
    rng = np.random.default_rng(SEED + 5)
    for module, client in clients(server):
        for rows, halves in ((0, False), (1, True), (1000, False), (7, True)):
            inputs = [module.InferInput("X", [rows, 3], "FP32"), module.InferInput("IDS", [rows], "INT64")]
            values = [rng.uniform(-2, 2, (rows, 3)).astype(np.float32) + 3, rng.integers(-(2**40), 2**40, rows)]
            if halves:
                inputs += [module.InferInput("F16", [rows], "FP16"), module.InferInput("BF16", [rows], "BF16")]
                values += [rng.uniform(-4, 4, rows).astype(np.float16), rng.uniform(-4, 4, rows).astype(np.float32)]
            for tensor, value in zip(inputs, values):
                tensor.set_data_from_numpy(value)
            paths = client.infer("scale", inputs).as_numpy("READ_PATHS")
            assert paths.tolist() == [1, 1], f"{module.__name__} rows {rows} halves {halves}: {paths} (seed {SEED})"
        client.close()


def test_a_raising_model_answers_500_without_details_and_the_next_request_is_answered(server):
    rng = np.random.default_rng(SEED + 1)
    for module, client in clients(server):
        bad = -rng.uniform(1, 2, (4, 3)).astype(np.float32)
        with pytest.raises(InferenceServerException) as error:
            infer(module, client, bad, np.arange(4))
        assert "internal error (RuntimeError)" in error.value.message() and "secret" not in error.value.message(), str(
            error.value
        )
        good = rng.uniform(1, 2, (5, 3)).astype(np.float32)
        y, _ = infer(module, client, good, np.arange(5))
        assert np.allclose(y, good.astype(np.float64) * 2, rtol=1e-7, atol=0)
        client.close()
    assert "secret /internal/path" in server.log_tail(400)  # the details go to the server log


def test_a_model_whose_initialize_fails_does_not_load_and_says_why(server):
    import tritonclient.http as http

    client = http.InferenceServerClient(server.http_url)
    with pytest.raises(InferenceServerException, match="weights missing"):
        client.load_model("broken")
    assert client.is_model_ready("scale") and not client.is_model_ready("broken")
    client.close()


def test_statistics_count_each_request_and_its_compute_time(server):
    import tritonclient.http as http

    client = http.InferenceServerClient(server.http_url)
    before = client.get_inference_statistics("scale")["model_stats"][0]
    x = np.random.default_rng(SEED + 2).uniform(1, 2, (8, 3)).astype(np.float32)
    for _ in range(3):
        infer(http, client, x, np.arange(8))
    after = client.get_inference_statistics("scale")["model_stats"][0]
    client.close()
    stats = {key: (after["inference_stats"][key]["count"] - before["inference_stats"][key]["count"],
                   after["inference_stats"][key]["ns"] - before["inference_stats"][key]["ns"]) for key in ("success", "compute_infer")}  # fmt: skip
    assert stats["success"][0] == 3 and stats["compute_infer"][0] == 3
    assert 0 < stats["compute_infer"][1] < stats["success"][1]


def test_thread_local_data_lives_across_calls(server):
    """Each Triton instance thread keeps one Python thread state: a threading.local set in one execute
    is there in the next (per-call thread states lost it, and set the CUDA device again every call)."""
    import tritonclient.http as http

    client = http.InferenceServerClient(server.http_url)
    x = np.random.default_rng(SEED + 4).uniform(1, 2, (2, 3)).astype(np.float32)
    counts = []
    for _ in range(8):  # two instances (threads): one of them runs at least 4 of the 8 calls
        counts.append(int(infer_result(http, client, x, np.arange(2)).as_numpy("THREAD_CALLS")[0]))
    client.close()
    assert max(counts) >= 4, counts


def test_reloads_leave_no_thread_states_behind(server):
    """A model's instance threads end when it unloads, and their Python thread states go with them:
    12 load/unload cycles start 24 instance threads, and the interpreter's thread states grow by at
    most the few long-lived threads that run initialize/finalize (Triton's model-load pool; 3 here).
    Without the cleanup they grew by one per instance thread."""
    import tritonclient.http as http

    client = http.InferenceServerClient(server.http_url)
    x = np.random.default_rng(SEED + 5).uniform(1, 2, (2, 3)).astype(np.float32)

    def thread_states_seen():  # both instances called
        return max(int(infer_result(http, client, x, np.arange(2)).as_numpy("THREAD_STATES")[0]) for _ in range(4))

    before, cycles = thread_states_seen(), 12
    for _ in range(cycles):
        client.unload_model("scale")
        client.load_model("scale")
        thread_states_seen()
    deadline = time.monotonic() + 20
    while (after := thread_states_seen()) > before + cycles // 2 and time.monotonic() < deadline:
        time.sleep(0.2)  # old instance threads end shortly after their unload
    client.close()
    assert after - before <= cycles // 2, f"thread states {before} before {cycles} reloads, {after} after"


def test_an_exclusive_hold_waits_for_shared_ones_and_keeps_new_ones_out():
    lock, events = _Exclusive(), []

    def shared(name, seconds):
        with lock.shared():
            events.append(f"{name} in")
            time.sleep(seconds)
            events.append(f"{name} out")

    def exclusive():
        with lock.exclusive():
            events.append("exclusive in")
            time.sleep(0.05)
            events.append("exclusive out")

    first = threading.Thread(target=shared, args=("first", 0.2))
    first.start()
    time.sleep(0.05)
    writer = threading.Thread(target=exclusive)
    writer.start()
    time.sleep(0.05)
    late = threading.Thread(target=shared, args=("late", 0))
    late.start()
    for thread in (first, writer, late):
        thread.join(5)
    assert events == ["first in", "first out", "exclusive in", "exclusive out", "late in", "late out"], events


def test_the_ctypes_mirrors_match_backend_c_layouts(tmp_path):
    """pb_utils._NativeInput, driver._Reply and driver._Execution are read and written over backend.c's
    structs: every field at the same offset and the same sizes, as a library built from backend.c says
    (loaded lazily: its Triton and Python symbols are never bound)."""
    import ctypes
    import shutil
    import subprocess

    from ikbo_backend.inprocess import SOURCE
    from ikbo_backend.inprocess.driver import _Execution, _Reply
    from ikbo_backend.inprocess.pb_utils import _NativeInput

    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler")
    mirrors = {"ikbo_input": _NativeInput, "ikbo_reply": _Reply, "ikbo_execution": _Execution}
    names = [
        (f"{c} {field}", f"offsetof({c}, {field})") for c, mirror in mirrors.items() for field, _ in mirror._fields_
    ]
    names += [(f"{c} sizeof", f"sizeof({c})") for c in mirrors]
    program = tmp_path / "layout.c"
    body = "\n".join(
        f'    length += snprintf(text + length, sizeof text - length, "{name}=%zu\\n", {value});'
        for name, value in names
    )
    program.write_text(
        f'#include "{SOURCE}"\n#include <stddef.h>\n'
        f"const char *layout(void) {{\n    static char text[8192];\n    int length = 0;\n{body}\n    return text;\n}}\n"
    )
    library = tmp_path / "layout.so"
    command = [
        compiler,
        "-shared",
        "-fPIC",
        '-DIKBO_LIBPYTHON="unused"',
        str(program),
        "-ldl",
        "-pthread",
        "-o",
        str(library),
    ]
    subprocess.run(command, check=True, capture_output=True)
    layout = ctypes.CDLL(str(library), mode=os.RTLD_LAZY).layout
    layout.restype = ctypes.c_char_p
    printed = dict(line.split("=") for line in layout().decode().splitlines())
    expected = {
        f"{c} {field}": str(getattr(mirror, field).offset)
        for c, mirror in mirrors.items()
        for field, _ in mirror._fields_
    }
    expected |= {f"{c} sizeof": str(ctypes.sizeof(mirror)) for c, mirror in mirrors.items()}
    assert printed == expected


def test_the_backend_is_rebuilt_when_its_source_changes_and_only_then(tmp_path, monkeypatch):
    """Checkouts that share a backend directory (one tritonserver install) each get a library built from
    their own backend.c, older or newer: the stamp holds the source's hash, not its time."""
    import shutil

    from ikbo_backend import inprocess

    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler")
    source = tmp_path / "backend.c"
    source.write_bytes(inprocess.SOURCE.read_bytes())
    monkeypatch.setattr(inprocess, "SOURCE", source)
    library = inprocess.build(tmp_path / "backends")
    built = library.stat().st_mtime_ns
    assert (
        inprocess.build(tmp_path / "backends") == library and library.stat().st_mtime_ns == built
    )  # same source: kept
    source.write_text(source.read_text() + f"\n/* {secrets.token_hex(4)} */\n")
    os.utime(
        source, ns=(built - 10**9, built - 10**9)
    )  # older than the library, as a checkout of an older commit can be
    inprocess.build(tmp_path / "backends")
    assert library.stat().st_mtime_ns != built
    rebuilt = library.read_bytes()
    library.write_bytes(b"another checkout's library")  # replaced by a build that does not write this stamp
    stamp = library.with_suffix(".stamp")
    os.utime(stamp, ns=(stamp.stat().st_mtime_ns - 10**9,) * 2)  # written before the replacement
    inprocess.build(tmp_path / "backends")
    assert library.read_bytes() == rebuilt
