"""Platforms: detection, host memory (with cgroup limits), dtype defaults, and the
NVML / amdsmi process queries with those modules replaced at their import boundary."""

import os
import sys
import types

import pytest
import torch

import vllm.platforms as platforms
from vllm import envs
from vllm.device_allocator.gpu_vmm import CudaVmmDriver, HipVmmDriver
from vllm.device_allocator.host_vmm import HostVmmDriver
from vllm.platforms.cpu import DEFAULT_CPU_KV_CACHE_BYTES, CpuPlatform, read_host_memory
from vllm.platforms.cuda import CudaPlatform, parse_pci_bus_id
from vllm.platforms.interface import DeviceProcess
from vllm.platforms.rocm import RocmPlatform

GiB = 1 << 30


# ---------------------------------------------------------------- detection


def test_detect_platform_follows_torch(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert isinstance(platforms.detect_platform(), CpuPlatform)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.version, "hip", None)
    assert isinstance(platforms.detect_platform(), CudaPlatform)
    monkeypatch.setattr(torch.version, "hip", "7.12.0")
    assert isinstance(platforms.detect_platform(), RocmPlatform)


def test_current_platform_is_chosen_once():
    first = platforms.current_platform
    assert platforms.current_platform is first
    from vllm.platforms import current_platform

    assert current_platform is first
    if not torch.cuda.is_available():
        assert isinstance(first, CpuPlatform)


def test_platform_vmm_drivers():
    cpu = CpuPlatform()
    d = cpu.get_vmm_driver()
    assert isinstance(d, HostVmmDriver) and d.probe() is None
    assert cpu.get_vmm_driver() is d
    assert isinstance(CudaPlatform().get_vmm_driver(1), CudaVmmDriver)
    assert isinstance(RocmPlatform().get_vmm_driver(0), HipVmmDriver)
    assert CudaPlatform().device(1) == torch.device("cuda", 1)
    assert cpu.device(3) == torch.device("cpu")


# -------------------------------------------------------------- host memory


def _meminfo(tmp_path, total_kb, avail_kb):
    p = tmp_path / "meminfo"
    p.write_text(f"MemTotal:       {total_kb} kB\nMemFree:        1 kB\n"
                 f"MemAvailable:   {avail_kb} kB\n")
    return p


def test_host_memory_without_cgroup_limit(tmp_path):
    mem = read_host_memory(_meminfo(tmp_path, 16 * 1024 * 1024, 10 * 1024 * 1024),
                           tmp_path / "nocgroup", tmp_path / "nocgroupfile")
    assert (mem.available, mem.total) == (10 * GiB, 16 * GiB)


def test_host_memory_honours_cgroup_v2_limit(tmp_path):
    root = tmp_path / "cg"
    (root / "engine.slice").mkdir(parents=True)
    (root / "cgroup.controllers").write_text("cpu memory\n")
    d = root / "engine.slice"
    (d / "memory.max").write_text(f"{8 * GiB}\n")
    (d / "memory.current").write_text(f"{5 * GiB}\n")
    (d / "memory.stat").write_text(f"anon 1\ninactive_file {1 * GiB}\n")
    self_cg = tmp_path / "self_cgroup"
    self_cg.write_text("0::/engine.slice\n")
    mem = read_host_memory(_meminfo(tmp_path, 64 * 1024 * 1024, 60 * 1024 * 1024), root, self_cg)
    assert (mem.available, mem.total) == (4 * GiB, 8 * GiB)  # 8 - (5 - 1)
    (d / "memory.max").write_text("max\n")
    mem = read_host_memory(_meminfo(tmp_path, 64 * 1024 * 1024, 60 * 1024 * 1024), root, self_cg)
    assert (mem.available, mem.total) == (60 * GiB, 64 * GiB)


def test_host_memory_honours_cgroup_v1_limit_at_the_mount_root(tmp_path):
    # As in containers: /proc/self/cgroup names a path that is not under the
    # mount, whose root is the container's own cgroup.
    root = tmp_path / "cg"
    (root / "memory").mkdir(parents=True)
    (root / "memory" / "memory.limit_in_bytes").write_text(f"{6 * GiB}\n")
    (root / "memory" / "memory.usage_in_bytes").write_text(f"{2 * GiB}\n")
    (root / "memory" / "memory.stat").write_text("total_inactive_file 0\n")
    self_cg = tmp_path / "self_cgroup"
    self_cg.write_text("5:devices:/\n4:memory:/process_api/abc\n0::/\n")
    mem = read_host_memory(_meminfo(tmp_path, 32 * 1024 * 1024, 3 * 1024 * 1024), root, self_cg)
    assert (mem.available, mem.total) == (3 * GiB, 6 * GiB)  # MemAvailable is smaller
    (root / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    mem = read_host_memory(_meminfo(tmp_path, 32 * 1024 * 1024, 3 * 1024 * 1024), root, self_cg)
    assert mem.total == 32 * GiB  # "unlimited"


def test_host_memory_on_this_machine():
    free, total = CpuPlatform().mem_get_info()
    with open("/proc/meminfo") as f:
        info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
    assert 0 < free <= total <= info["MemTotal"]
    assert free <= info["MemAvailable"] + 256 * (1 << 20)


def test_host_memory_rejects_broken_meminfo(tmp_path):
    p = tmp_path / "meminfo"
    p.write_text("MemFree: 1 kB\n")
    with pytest.raises(RuntimeError, match="no MemTotal/MemAvailable"):
        read_host_memory(p, tmp_path, tmp_path / "x")


def _set_kv_cache_space(monkeypatch, gib: str) -> None:
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", gib)
    envs.reset()  # parsed once per process: this test changes it after a read


def test_cpu_kv_cache_cap(monkeypatch):
    cpu = CpuPlatform()
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    monkeypatch.setattr(cpu, "mem_get_info", lambda device_index=0: (100 * GiB, 128 * GiB))
    assert cpu.default_kv_cache_bytes_cap() == DEFAULT_CPU_KV_CACHE_BYTES == 4 * GiB
    monkeypatch.setattr(cpu, "mem_get_info", lambda device_index=0: (3 * GiB, 128 * GiB))
    assert cpu.default_kv_cache_bytes_cap() == 3 * GiB
    _set_kv_cache_space(monkeypatch, "6")
    assert cpu.default_kv_cache_bytes_cap() == 6 * GiB
    _set_kv_cache_space(monkeypatch, "0.5")
    assert cpu.default_kv_cache_bytes_cap() == GiB // 2
    _set_kv_cache_space(monkeypatch, "0")
    assert cpu.default_kv_cache_bytes_cap() == 3 * GiB
    _set_kv_cache_space(monkeypatch, "lots")
    with pytest.raises(ValueError, match="VLLM_CPU_KVCACHE_SPACE='lots'"):
        cpu.default_kv_cache_bytes_cap()
    assert CudaPlatform().default_kv_cache_bytes_cap() is None


def test_cpu_kv_cache_cap_is_named_for_the_sizing_line(monkeypatch):
    cpu = CpuPlatform()
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    assert cpu.default_kv_cache_cap_name().startswith("the CPU default min(4 GiB, available")
    assert "set VLLM_CPU_KVCACHE_SPACE" in cpu.default_kv_cache_cap_name()
    _set_kv_cache_space(monkeypatch, "0")
    assert cpu.default_kv_cache_cap_name().startswith("the CPU default")
    _set_kv_cache_space(monkeypatch, "6")
    assert cpu.default_kv_cache_cap_name() == "VLLM_CPU_KVCACHE_SPACE=6 GiB"


# ------------------------------------------------------------------- dtypes


def test_cpu_dtypes():
    cpu = CpuPlatform()
    for dt in (None, torch.float32, torch.bfloat16, torch.float16):
        assert cpu.default_dtype(dt) == torch.float32
    assert torch.float32 in cpu.supported_dtypes()


@pytest.mark.parametrize("bf16", [True, False])
def test_cuda_default_dtype(monkeypatch, bf16):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16)
    p = CudaPlatform()
    want = torch.bfloat16 if bf16 else torch.float16
    assert p.default_dtype(None) == want
    assert p.default_dtype(torch.float32) == want
    assert p.default_dtype(torch.bfloat16) == want
    assert p.default_dtype(torch.float16) == torch.float16
    assert (torch.bfloat16 in p.supported_dtypes()) is bf16


# --------------------------------------------------------------------- NVML


class FakeNvml(types.ModuleType):
    """The slice of pynvml the CUDA platform uses: two GPUs with processes."""

    def __init__(self, devices, fail_init=False):
        super().__init__("pynvml")
        self.devices = devices  # list of dicts: uuid, bus, compute, graphics
        self.fail_init = fail_init
        self.init_count = 0

    def nvmlInit(self):
        if self.fail_init:
            raise RuntimeError("NVML Shared Library Not Found")
        self.init_count += 1

    def nvmlShutdown(self):
        self.init_count -= 1

    def nvmlDeviceGetCount(self):
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, i):
        return ("handle", i)

    def nvmlDeviceGetHandleByUUID(self, uuid):
        for i, d in enumerate(self.devices):
            if d["uuid"] == uuid:
                return ("handle", i)
        raise RuntimeError("NVML_ERROR_NOT_FOUND")

    def nvmlDeviceGetUUID(self, h):
        return self.devices[h[1]]["uuid"].encode()

    def nvmlDeviceGetPciInfo(self, h):
        return types.SimpleNamespace(busId=self.devices[h[1]]["bus"].encode())

    def nvmlDeviceGetComputeRunningProcesses(self, h):
        return [types.SimpleNamespace(pid=p, usedGpuMemory=m)
                for p, m in self.devices[h[1]]["compute"]]

    def nvmlDeviceGetGraphicsRunningProcesses(self, h):
        return [types.SimpleNamespace(pid=p, usedGpuMemory=m)
                for p, m in self.devices[h[1]]["graphics"]]

    def nvmlSystemGetProcessName(self, pid):
        if pid == 4242:
            raise RuntimeError("NVML_ERROR_NOT_FOUND")  # exited mid-query
        return f"proc{pid}".encode()


UUID0 = "GPU-aaaaaaaa-0000-0000-0000-000000000000"
UUID1 = "GPU-bbbbbbbb-1111-1111-1111-111111111111"


def _two_gpus():
    me = os.getpid()
    return [
        {"uuid": UUID0, "bus": "00000000:17:00.0", "compute": [(111, 5 * GiB)], "graphics": []},
        {"uuid": UUID1, "bus": "00000000:65:00.0",
         "compute": [(me, 70 * GiB), (222, 1 * GiB), (333, None), (4242, 2)],
         "graphics": [(222, 3 * GiB), (777, 9)]},
    ]


def _fake_props(monkeypatch, uuid=None, pci=None):
    def props(index):
        ns = types.SimpleNamespace()
        if uuid is not None:
            ns.uuid = uuid  # torch prints the UUID without the GPU- prefix
        if pci is not None:
            ns.pci_domain_id, ns.pci_bus_id, ns.pci_device_id = pci
        return ns

    monkeypatch.setattr(torch.cuda, "get_device_properties", props)


def test_nvml_foreign_processes_matched_by_uuid(monkeypatch):
    fake = FakeNvml(_two_gpus())
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    # torch's cuda:0 is NVML's device 1 (e.g. CUDA_VISIBLE_DEVICES=1).
    _fake_props(monkeypatch, uuid=UUID1[len("GPU-"):])
    p = CudaPlatform()
    p.register_engine_pid(777)  # e.g. this engine's worker process
    procs = p.get_foreign_device_processes(0)
    assert procs == [
        DeviceProcess(222, 3 * GiB, "proc222"),  # in both lists: once, larger figure
        DeviceProcess(333, None, "proc333"),
        DeviceProcess(4242, 2, ""),
    ]
    assert fake.init_count == 0  # every nvmlInit was shut down


def test_nvml_matched_by_pci_bus_id_when_no_uuid(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml(_two_gpus()))
    _fake_props(monkeypatch, pci=(0, 0x17, 0))
    assert CudaPlatform().get_foreign_device_processes(0) == [DeviceProcess(111, 5 * GiB,
                                                                            "proc111")]


@pytest.mark.parametrize(("visible", "expected_pid"), [("1", 222), (UUID0, 111)])
def test_nvml_falls_back_to_cuda_visible_devices(monkeypatch, visible, expected_pid):
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml(_two_gpus()))
    _fake_props(monkeypatch)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    procs = CudaPlatform().get_foreign_device_processes(0)
    assert procs[0].pid == expected_pid


def test_nvml_unknown_device_or_failure_is_none(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml(_two_gpus()))
    _fake_props(monkeypatch, uuid="ffffffff-0000-0000-0000-000000000000")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert CudaPlatform().get_foreign_device_processes(0) is None
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml(_two_gpus(), fail_init=True))
    assert CudaPlatform().get_foreign_device_processes(0) is None
    monkeypatch.setitem(sys.modules, "pynvml", None)  # not installed
    assert CudaPlatform().get_foreign_device_processes(0) is None


def test_fake_nvml_matches_the_real_pynvml_names():
    real = pytest.importorskip("pynvml")
    used = [n for n in vars(FakeNvml) if n.startswith("nvml")]
    assert len(used) == 10
    assert [n for n in used if not hasattr(real, n)] == []


def test_real_nvml_without_a_gpu_is_unknown():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present; test_cuda_platform_on_gpu covers the real query")
    pytest.importorskip("pynvml")
    assert CudaPlatform().get_foreign_device_processes(0) is None


def test_parse_pci_bus_id():
    assert parse_pci_bus_id(b"00000000:65:00.0") == (0, 0x65, 0)
    assert parse_pci_bus_id("0001:c1:1f.3") == (1, 0xC1, 0x1F)
    with pytest.raises(ValueError, match="not a PCI bus id"):
        parse_pci_bus_id("65:00")


def test_engine_pids_include_this_process():
    p = CpuPlatform()
    p.register_engine_pid(12345)
    assert p.engine_pids() == frozenset({os.getpid(), 12345})
    assert p.get_foreign_device_processes() is None


# ------------------------------------------------------------------- amdsmi


class FakeAmdsmi(types.ModuleType):
    def __init__(self, new_style: bool):
        super().__init__("amdsmi")
        self.new_style = new_style
        self.inits = 0
        me = os.getpid()
        self.procs = {
            "gpuA": [{"name": "other", "pid": 501, "mem": 7,
                      "memory_usage": {"vram_mem": 2 * GiB, "gtt_mem": 0}},
                     {"name": "self", "pid": me, "mem": 1, "memory_usage": {"vram_mem": 1}}],
            "gpuB": [{"name": "b", "pid": 600, "mem": 3 * GiB}],
        }

    def amdsmi_init(self, *flags):
        self.inits += 1

    def amdsmi_shut_down(self):
        self.inits -= 1

    def amdsmi_get_processor_handles(self):
        return ["gpuA", "gpuB"]

    def amdsmi_get_gpu_device_bdf(self, h):
        return {"gpuA": "0000:c1:00.0", "gpuB": "0000:03:00.0"}[h]

    def amdsmi_get_gpu_process_list(self, h):
        if self.new_style:
            return list(self.procs[h])
        return [("proc", h, i) for i in range(len(self.procs[h]))]

    def amdsmi_get_gpu_process_info(self, h, entry):
        return self.procs[h][entry[2]]


@pytest.mark.parametrize("new_style", [True, False])
def test_amdsmi_foreign_processes(monkeypatch, new_style):
    fake = FakeAmdsmi(new_style)
    monkeypatch.setitem(sys.modules, "amdsmi", fake)
    _fake_props(monkeypatch, pci=(0, 0xC1, 0))
    assert RocmPlatform().get_foreign_device_processes(0) == [DeviceProcess(501, 2 * GiB,
                                                                            "other")]
    _fake_props(monkeypatch, pci=(0, 0x03, 0))
    assert RocmPlatform().get_foreign_device_processes(0) == [DeviceProcess(600, 3 * GiB, "b")]
    assert fake.inits == 0
    monkeypatch.setitem(sys.modules, "amdsmi", None)
    assert RocmPlatform().get_foreign_device_processes(0) is None


# ---------------------------------------------------------------------- GPU


@pytest.mark.cuda
def test_cuda_platform_on_gpu():
    p = platforms.current_platform
    assert isinstance(p, CudaPlatform)
    idx = torch.cuda.current_device()
    x = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")  # this process is on the GPU
    free, total = p.mem_get_info(idx)
    assert 0 < free < total
    procs = p.get_foreign_device_processes(idx)
    assert procs is not None, "NVML should list the device's processes"
    assert os.getpid() not in {q.pid for q in procs}
    assert p.get_vmm_driver(idx).probe() is None
    assert p.default_dtype(torch.float32) == torch.bfloat16  # H100/H200 support bf16
    del x
