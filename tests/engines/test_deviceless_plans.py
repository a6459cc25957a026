"""cuDNN execution plans without a GPU (``cudnn_attn.graphs.deviceless``), for described devices.

* The shipped device descriptions (A100, H100, H200, B200) are what cuDNN reads; a user's JSON
  works the same way; malformed ones are refused with the reason.
* The libcuda stand-in: compiled by the C compiler, it is enough for cuDNN's runtime-compiled
  engine library to load (every symbol it links resolves), every device entry point answers
  ``CUDA_ERROR_NO_DEVICE`` and it records the kernels cuDNN asks for.
* Every graph family the engine emits (``deviceless_plans.FAMILIES``), in each direction
  (inference forward, training forward with stats, backward), on sm_80/sm_90/sm_100: the engine
  claims it exactly when cuDNN plans it (through ``check_support``); where cuDNN refuses, the
  engine declares the limit. A sample (every family once) builds its plan and names the kernel
  for the right architecture; ``CUDNN_ATTN_FULL_SWEEP=1`` builds the whole matrix.
"""

import ctypes
import json
import os
import re
import subprocess
import sys

import pytest
import torch
from deviceless_plans import (FAMILIES, FULL, TARGETS, assert_plans, cases, deviceless,  # noqa: F401
                              directions, needs_fe, problem_for)

import cudnn_attn as ca
from cudnn_attn.core.caches import cache_sizes, clear_caches
from cudnn_attn.graphs import driver_standin
from cudnn_attn.graphs.targets import SHIPPED_TARGETS, DeviceTarget, target

ARCH = {"a100": (80, 108, "NVIDIA A100-SXM4-80GB"), "h100": (90, 132, "NVIDIA H100 80GB HBM3"),
        "h200": (90, 132, "NVIDIA H200"), "b200": (100, 148, "NVIDIA B200")}


# ---------------------------------------------------------------------------------------------
# device descriptions
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", SHIPPED_TARGETS)
def test_shipped_descriptions_name_their_device(name):
    device = target(name.upper())  # any case
    assert (device.sm, device.sm_count, device.device_name) == ARCH[name]
    env = device.environment()
    assert env["gpu_name"] == ARCH[name][2] and env["sm_count"] == ARCH[name][1]
    assert env["compute_capability"] == f"{ARCH[name][0] // 10}.{ARCH[name][0] % 10}"


@needs_fe
@pytest.mark.parametrize("name", SHIPPED_TARGETS)
def test_cudnn_reads_each_shipped_description(name, deviceless):
    device = target(name)
    echoed = json.loads(device.properties().serialize())
    assert echoed == json.loads(device.description)


def test_a_users_description_file_is_a_target(tmp_path):
    data = json.loads(target("h100").description)
    data.update(deviceName="NVIDIA H100 PCIe", multiProcessorCount=114)
    path = tmp_path / "h100-pcie.json"
    path.write_text(json.dumps(data))
    device = target(str(path))
    assert (device.name, device.sm, device.sm_count) == ("h100-pcie", 90, 114)
    assert target(device) is device


@pytest.mark.parametrize("text,fragment", [
    ("not json", "is not JSON"),
    ("[1, 2]", "must be a JSON object"),
    ('{"deviceVer": 900}', "lacks the keys cuDNN reads"),
])
def test_malformed_descriptions_are_refused_with_the_reason(text, fragment):
    with pytest.raises(ValueError, match=fragment):
        DeviceTarget.from_json(text, "bad")


def test_unknown_targets_are_refused_naming_the_choices(tmp_path):
    with pytest.raises(ValueError, match="neither a shipped device .*a100, h100, h200, b200"):
        target("v100")
    with pytest.raises(TypeError, match="target must be"):
        target(90)
    data = json.loads(target("a100").description)
    data["smCountOrigin"] = 1
    with pytest.raises(ValueError, match="smCountOrigin must be 0"):
        DeviceTarget.from_json(json.dumps(data))


# ---------------------------------------------------------------------------------------------
# the libcuda stand-in
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def standin(tmp_path_factory):
    try:
        return driver_standin.compile_standin(tmp_path_factory.mktemp("standin"))
    except driver_standin.DriverUnavailable as exc:
        pytest.fail(str(exc), pytrace=False)


def test_standin_answers_no_device_and_records_kernels(standin):
    lib = ctypes.CDLL(str(standin))  # a private copy: the process's driver is not touched
    count = ctypes.c_int(-1)
    assert lib.cuInit(0) == 100 and lib.cuDeviceGetCount(ctypes.byref(count)) == 100
    assert lib.cuLaunchKernel() == 100 and lib.cuMemAlloc() == 100
    version = ctypes.c_int(0)
    assert lib.cuDriverGetVersion(ctypes.byref(version)) == 0 and version.value >= 12000
    name = ctypes.c_char_p()
    assert lib.cuGetErrorName(100, ctypes.byref(name)) == 0
    assert name.value == b"CUDA_ERROR_NO_DEVICE"
    fn = ctypes.c_void_p()
    assert lib.cuGetProcAddress(b"cuInit", ctypes.byref(fn), 12000, 0) == 100 and not fn.value
    kernel = ctypes.c_void_p()
    assert lib.cuLibraryGetKernel(ctypes.byref(kernel), None, b"my_kernel") == 0 and kernel.value
    lib.cudnn_attn_standin_kernel.restype = ctypes.c_char_p
    assert lib.cudnn_attn_standin_kernel(0) == b"my_kernel"


@needs_fe
def test_standin_is_enough_for_cudnns_runtime_compiled_engines_to_load(standin):
    # A fresh process with the stand-in first on the library path: dlopen resolves every symbol
    # the sub-library links (RTLD_NOW), which is what cuDNN needs to load it.
    import nvidia.cudnn

    lib = os.path.join(list(nvidia.cudnn.__path__)[0], "lib",
                       "libcudnn_engines_runtime_compiled.so.9")
    code = (f"import ctypes; ctypes.CDLL({lib!r}, mode=ctypes.RTLD_GLOBAL); "
            f"d = ctypes.CDLL('libcuda.so.1'); print(hasattr(d, 'cudnn_attn_standin_kernel'))")
    env = dict(os.environ, LD_LIBRARY_PATH=str(standin.parent))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "True"


# ---------------------------------------------------------------------------------------------
# every family, every direction, every architecture: the engine's claims == cuDNN's plans
# ---------------------------------------------------------------------------------------------

@needs_fe
@pytest.mark.parametrize("name", list(FAMILIES))
def test_engine_claims_exactly_what_cudnn_plans(name, deviceless):
    fam = FAMILIES[name]
    claimed = 0
    for direction in directions(fam):
        for device in TARGETS:
            result = assert_plans(deviceless, problem_for(name, direction), device,
                                  backward=direction == "bwd", options=fam.options, build=False)
            if result.ok:
                claimed += 1
                assert result.engine is not None and result.engine.plan_name.startswith(
                    f"eng{result.engine.engine_id}"), result.engine
    assert claimed, f"{name}: claimed on no architecture"


SAMPLE = cases(sample=not FULL)


@needs_fe
@pytest.mark.parametrize("name,direction,device", SAMPLE, ids=["-".join(c) for c in SAMPLE])
def test_plans_build_and_name_a_kernel_for_the_architecture(name, direction, device, deviceless):
    fam = FAMILIES[name]
    problem = problem_for(name, direction)
    result = deviceless.plan_problem(problem, device, backward=direction == "bwd",
                                     options=fam.options)
    if result.reasons:  # a declared limit: cuDNN's refusal is checked above
        return
    assert result.ok and result.built.built, result
    engine = result.engine
    assert engine.kernels, "the stand-in recorded no kernel"
    # the kernel's architecture: the device's, or an older one it runs (cuDNN 9.28 serves e.g.
    # decode on sm_90 and S_q != S_kv causal or dBias on sm_100 with its sm_80 engines 7/8)
    archs = {int(m) for k in engine.kernels for m in re.findall(r"_sm(\d+)_", k)}
    assert archs and 80 <= min(archs) and max(archs) <= target(device).sm, engine.kernels
    assert len(result.built.serialize()) > 10_000  # the plan, with its kernel
    assert str(engine).startswith(f"engine {engine.engine_id} [")


@needs_fe
@pytest.mark.parametrize("device,forward,backward",
                         [("h100", 9, 6), ("h200", 9, 6), ("b200", 10, 5)])
def test_dense_graphs_get_the_architectures_flash_engines(device, forward, backward, deviceless):
    # cuDNN 9.28's own picks for plain SDPA: Hopper flash fprop/bprop (engines 9/6, on H100 and
    # H200), Blackwell (10/5), each with a kernel compiled for that architecture.
    sm = target(device).sm
    for direction, engine_id in (("fwd-stats", forward), ("bwd", backward)):
        result = deviceless.plan_problem(problem_for("dense", direction), device,
                                         backward=direction == "bwd")
        engine = result.engine
        assert engine.engine_id == engine_id, engine
        kind = "bprop" if direction == "bwd" else "fprop"
        assert any(f"_sm{sm}_flash_{kind}_" in k for k in engine.kernels), engine.kernels


# ---------------------------------------------------------------------------------------------
# declared limits found by deviceless plans, and the plumbing
# ---------------------------------------------------------------------------------------------

@needs_fe
@pytest.mark.parametrize("backend", [91900, 92000])
def test_a_cudnn_too_old_to_plan_without_a_gpu_is_refused_up_front(backend, deviceless,
                                                                    monkeypatch):
    """cuDNN 9.19.0 and 9.20.0 finalize no SDPA engine for a described device (every engine
    config refused at create_execution_plans; 9.21.0 and later plan the same graphs: measured
    with benchmarks/warm_start.py --prepare on each backend). A plan asked of such a backend
    says so, before cuDNN is asked; the installed one (9.28 here) plans."""
    from cudnn_attn.graphs import deviceless as module

    problem = problem_for("dense", "fwd-stats")
    assert deviceless.plan_problem(problem, "h200").ok  # the installed backend
    clear_caches()
    monkeypatch.setattr(module, "cudnn_versions", lambda: (backend, "1.32.0"))
    asked = []
    monkeypatch.setattr(module, "build_graph", lambda *a, **k: asked.append(a))
    result = deviceless.plan_problem(problem, "h200")
    assert not result.ok and not asked
    have = f"9.{(backend // 100) % 100}.0"
    assert result.refusal == (f"planning without a GPU needs cuDNN >= 9.21.0 (older backends "
                              f"finalize no SDPA engine for a described device), have {have}")
    clear_caches()


@needs_fe
def test_philox_dropout_without_stats_is_declared_on_sm100_only(deviceless):
    q = torch.empty(2, 4, 256, 128, dtype=torch.bfloat16, device="meta")
    inference = ca.AttnProblem.from_tensors(q, q, q, dropout_p=0.1)
    reasons = ca.graphs.cudnn_reasons(inference, 100)
    assert any("Philox dropout and no LSE output" in r for r in reasons), reasons
    assert not ca.graphs.cudnn_reasons(inference, 90)
    result = assert_plans(deviceless, inference, "b200", build=False)
    assert "create_execution_plans" in result.refusal
    training = ca.AttnProblem.from_tensors(q, q, q, dropout_p=0.1, return_lse=True)
    assert assert_plans(deviceless, training, "b200", build=False).ok


@needs_fe
def test_results_are_cached_per_process_and_cleared(deviceless):
    problem = problem_for("gqa-causal", "fwd")
    first = deviceless.plan_problem(problem, "h100", build=False)
    assert deviceless.plan_problem(problem, "h100", build=False) is first
    built = deviceless.plan_problem(problem, "h100")
    assert deviceless.plan_problem(problem, "h100", build=False) is built  # a build answers too
    assert cache_sizes()["cudnn.deviceless"] >= 2
    clear_caches()
    assert cache_sizes()["cudnn.deviceless"] == 0


@needs_fe
def test_a_declined_problem_is_not_sent_to_cudnn(deviceless):
    q = torch.empty(1, 2, 64, 256, dtype=torch.float16, device="meta")
    result = deviceless.plan_problem(ca.AttnProblem.from_tensors(q, q, q), "a100", backward=True)
    assert not result.ok and result.built is None and result.refusal is None
    assert any("up to 128" in r for r in result.reasons)
    assert "declined" in str(result)


@needs_fe
@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a CUDA driver")
def test_a_process_that_already_failed_to_load_cudnns_engines_says_why():
    code = ("import cudnn, torch, cudnn_attn as ca\n"
            "from cudnn_attn.graphs import deviceless, targets\n"
            "try:\n"
            "    cudnn.create_device_properties(targets.target('h100').description)\n"
            "except Exception as exc:\n"
            "    assert 'SUBLIBRARY_LOADING_FAILED' in str(exc), exc\n"
            "q = torch.empty(1, 2, 64, 64, dtype=torch.float16, device='meta')\n"
            "try:\n"
            "    deviceless.plan_problem(ca.AttnProblem.from_tensors(q, q, q), 'h100')\n"
            "except RuntimeError as exc:\n"
            "    print(exc)\n")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "call cudnn_attn.graphs.deviceless.prepare()" in out.stdout
