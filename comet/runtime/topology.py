"""What the GPUs of this machine are and how they reach each other.

Read through cuda-python's runtime bindings (``cuda.bindings.runtime``, or ``cuda.cudart``
in cuda-python < 12.6), imported lazily: a CPU-only install, or one without cuda-python,
still imports this module and sees zero devices. When cuda-python is missing, the numbers
come from ``torch.cuda`` instead, so kernels can always size their grids.

Every runtime call goes through :func:`_check`, which turns an error code into a
:class:`CudaError` naming the call; only "there is no usable GPU" at the first call is
treated as zero devices rather than an error.

NVLink: the CUDA runtime does not expose links, only peer access and the P2P attributes
(access supported, native atomics, relative performance rank). Link counts come from NVML
through ``cuda.bindings.nvml`` when that module and the driver's libnvidia-ml are present;
otherwise they are reported as unknown.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = [
    "CudaError", "DeviceInfo", "P2PLink", "Topology", "cuda_runtime", "runtime_source",
    "unavailable_reason", "device_count", "device_info", "devices", "sm_count",
    "peer_access_matrix", "p2p_matrix", "nvlink_links", "topology", "clear_cache",
    "cuda_versions",
]

# Errors of cudaGetDeviceCount that mean "no usable GPU here", not "something broke".
_NO_GPU_ERRORS = frozenset({
    "cudaErrorNoDevice", "cudaErrorInsufficientDriver", "cudaErrorStubLibrary",
    "cudaErrorSystemDriverMismatch", "cudaErrorCompatNotSupportedOnDevice",
    "cudaErrorDevicesUnavailable", "cudaErrorInitializationError",
    "cudaErrorCallRequiresNewerDriver",
})


class CudaError(RuntimeError):
    """A CUDA runtime call returned an error code."""

    def __init__(self, call: str, code: Any, name: str, message: str):
        super().__init__(f"{call} failed: {name} ({message})")
        self.call, self.code, self.name = call, code, name


# --------------------------------------------------------------------------- runtime access
@functools.lru_cache(maxsize=None)
def cuda_runtime():
    """The cuda-python runtime module, or None when cuda-python is not installed."""
    try:
        from cuda.bindings import runtime  # cuda-bindings >= 12.6
        return runtime
    except ImportError:
        pass
    try:
        from cuda import cudart  # older cuda-python
        return cudart
    except ImportError:
        return None


def runtime_source() -> str:
    """Where device facts come from: ``"cuda-python"``, ``"torch"`` or ``"none"``."""
    if cuda_runtime() is not None:
        return "cuda-python"
    try:
        import torch
        return "torch" if torch.cuda.is_available() else "none"
    except ImportError:
        return "none"


def _error_text(rt, err) -> tuple[str, str]:
    name = getattr(err, "name", str(err))
    try:
        e2, msg = rt.cudaGetErrorString(err)
        if _ok(rt, e2):
            return name, msg.decode() if isinstance(msg, bytes) else str(msg)
    except Exception:  # an error while describing an error: keep the name
        pass
    return name, "no description"


def _ok(rt, err) -> bool:
    return err == rt.cudaError_t.cudaSuccess


def checked(rt, call: str, result):
    """Unpack cuda-python's ``(err, value...)`` tuple, raising :class:`CudaError` on error."""
    err, *values = result if isinstance(result, tuple) else (result,)
    if not _ok(rt, err):
        raise CudaError(call, err, *_error_text(rt, err))
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def clear_cache() -> None:
    """Forget the cached runtime module and device facts (tests swap cuda-python out)."""
    cuda_runtime.cache_clear()
    _count_and_reason.cache_clear()
    device_info.cache_clear()


def cuda_versions() -> dict[str, str | None]:
    """CUDA driver and runtime versions as "major.minor" (None when unknown / no driver)."""
    rt = cuda_runtime()
    out: dict[str, str | None] = {"driver": None, "runtime": None}
    if rt is None:
        return out
    for key, call in (("driver", "cudaDriverGetVersion"), ("runtime", "cudaRuntimeGetVersion")):
        try:
            v = int(checked(rt, call, getattr(rt, call)()))
        except CudaError:
            continue
        # 0 is what the driver query reports when no driver is loaded.
        out[key] = f"{v // 1000}.{(v % 1000) // 10}" if v else None
    return out


# --------------------------------------------------------------------------- devices
@functools.lru_cache(maxsize=None)
def _count_and_reason() -> tuple[int, str | None]:
    rt = cuda_runtime()
    if rt is None:
        try:
            import torch
        except ImportError:
            return 0, "neither cuda-python nor torch is installed"
        if not torch.cuda.is_available():
            return 0, "cuda-python is not installed and torch sees no CUDA device"
        return torch.cuda.device_count(), None
    try:
        n = checked(rt, "cudaGetDeviceCount", rt.cudaGetDeviceCount())
    except CudaError as e:
        if e.name in _NO_GPU_ERRORS:
            return 0, str(e)
        raise
    return int(n or 0), (None if n else "cudaGetDeviceCount returned 0")


def device_count() -> int:
    """Visible CUDA devices; 0 without cuda-python+driver+GPU (see :func:`unavailable_reason`)."""
    return _count_and_reason()[0]


def unavailable_reason() -> str | None:
    """Why :func:`device_count` is 0, or None when there are devices."""
    return _count_and_reason()[1]


@dataclass(frozen=True)
class DeviceInfo:
    """Static facts about one device, as the kernels and ``comet info`` need them."""

    index: int
    name: str
    sm_count: int
    capability: tuple[int, int]
    total_memory: int                 # bytes
    l2_cache_size: int                # bytes
    smem_per_block_optin: int         # bytes a block may opt in to
    cooperative_launch: bool | None = None
    pci_bus_id: str | None = None

    @property
    def arch(self) -> str:
        return f"sm_{self.capability[0]}{self.capability[1]}"


def _attr(rt, device: int, name: str) -> int:
    attr = getattr(rt.cudaDeviceAttr, name)
    return int(checked(rt, f"cudaDeviceGetAttribute({name}, {device})",
                      rt.cudaDeviceGetAttribute(attr, device)))


def _require(index: int) -> None:
    n = device_count()
    if not 0 <= index < n:
        why = f" ({unavailable_reason()})" if n == 0 else ""
        raise ValueError(f"no CUDA device {index}: {n} visible{why}")


@functools.lru_cache(maxsize=None)
def device_info(index: int) -> DeviceInfo:
    """Facts about device ``index`` (cached: they do not change while the process runs)."""
    _require(index)
    rt = cuda_runtime()
    if rt is None:
        return _torch_device_info(index)
    prop = checked(rt, f"cudaGetDeviceProperties({index})", rt.cudaGetDeviceProperties(index))
    name = prop.name.decode(errors="replace") if isinstance(prop.name, bytes) else str(prop.name)
    bus = checked(rt, f"cudaDeviceGetPCIBusId({index})", rt.cudaDeviceGetPCIBusId(32, index))
    bus = bus.decode(errors="replace") if isinstance(bus, bytes) else str(bus)
    return DeviceInfo(
        index=index,
        name=name.split("\x00", 1)[0].strip(),
        sm_count=_attr(rt, index, "cudaDevAttrMultiProcessorCount"),
        capability=(_attr(rt, index, "cudaDevAttrComputeCapabilityMajor"),
                    _attr(rt, index, "cudaDevAttrComputeCapabilityMinor")),
        total_memory=int(prop.totalGlobalMem),
        l2_cache_size=_attr(rt, index, "cudaDevAttrL2CacheSize"),
        smem_per_block_optin=_attr(rt, index, "cudaDevAttrMaxSharedMemoryPerBlockOptin"),
        cooperative_launch=bool(_attr(rt, index, "cudaDevAttrCooperativeLaunch")),
        pci_bus_id=bus.split("\x00", 1)[0].strip() or None,
    )


def _torch_device_info(index: int) -> DeviceInfo:
    import torch
    p = torch.cuda.get_device_properties(index)
    return DeviceInfo(
        index=index, name=p.name, sm_count=int(p.multi_processor_count),
        capability=(int(p.major), int(p.minor)), total_memory=int(p.total_memory),
        l2_cache_size=int(getattr(p, "L2_cache_size", 0)),
        smem_per_block_optin=int(getattr(p, "shared_memory_per_block_optin", 0)),
    )


def devices() -> list[DeviceInfo]:
    """:class:`DeviceInfo` of every visible device (empty without a GPU)."""
    return [device_info(i) for i in range(device_count())]


def sm_count(device_index: int | None = None) -> int:
    """Streaming multiprocessors of a device (default: torch's current device).

    The persistent kernels size their grid from this; it is read from the device, never
    assumed. Raises ``ValueError`` when there is no such device.
    """
    if device_index is None:
        import torch
        if not torch.cuda.is_available():
            raise ValueError(f"no current CUDA device ({unavailable_reason()})")
        device_index = torch.cuda.current_device()
    # device_info reads multiProcessorCount through cuda-python, or through torch's
    # device properties when cuda-python is missing.
    return device_info(device_index).sm_count


# --------------------------------------------------------------------------- peers and links
@dataclass(frozen=True)
class P2PLink:
    """How device ``src`` reaches device ``dst`` (``src != dst``)."""

    src: int
    dst: int
    can_access_peer: bool
    access_supported: bool | None = None
    native_atomics: bool | None = None
    performance_rank: int | None = None   # lower is faster; 0 is the best link kind


def peer_access_matrix() -> list[list[bool]]:
    """``m[i][j]``: can device i map device j's memory (diagonal True); ``[]`` without GPUs."""
    n = device_count()
    if n == 0:
        return []
    rt = cuda_runtime()
    if rt is None:
        import torch
        return [[i == j or bool(torch.cuda.can_device_access_peer(i, j)) for j in range(n)]
                for i in range(n)]
    return [[i == j or bool(checked(rt, f"cudaDeviceCanAccessPeer({i}, {j})",
                                    rt.cudaDeviceCanAccessPeer(i, j)))
             for j in range(n)] for i in range(n)]


def _p2p_attr(rt, name: str, src: int, dst: int) -> int:
    enum = getattr(rt, "cudaDeviceP2PAttr", None) or getattr(rt, "cudaDevP2PAttr")
    return int(checked(rt, f"cudaDeviceGetP2PAttribute({name}, {src}, {dst})",
                      rt.cudaDeviceGetP2PAttribute(getattr(enum, name), src, dst)))


def p2p_matrix() -> list[list[P2PLink | None]]:
    """``m[i][j]``: the :class:`P2PLink` from i to j, None on the diagonal; ``[]`` without GPUs.

    Without cuda-python only ``can_access_peer`` is known (from torch).
    """
    access = peer_access_matrix()
    rt = cuda_runtime()
    n = len(access)
    out: list[list[P2PLink | None]] = []
    for i in range(n):
        row: list[P2PLink | None] = []
        for j in range(n):
            if i == j:
                row.append(None)
            elif rt is None:
                row.append(P2PLink(i, j, access[i][j]))
            else:
                row.append(P2PLink(
                    i, j, access[i][j],
                    access_supported=bool(_p2p_attr(rt, "cudaDevP2PAttrAccessSupported", i, j)),
                    native_atomics=bool(_p2p_attr(rt, "cudaDevP2PAttrNativeAtomicSupported", i, j)),
                    performance_rank=_p2p_attr(rt, "cudaDevP2PAttrPerformanceRank", i, j)))
        out.append(row)
    return out


def nvlink_links() -> list[int | None]:
    """Active NVLink links per device, from NVML via ``cuda.bindings.nvml``.

    Entries are None when NVML is unreachable (no module, no driver library, or the query
    is unsupported); ``[]`` without GPUs. Devices are matched to NVML by PCI bus id, since
    NVML ignores ``CUDA_VISIBLE_DEVICES``.
    """
    infos = devices()
    if not infos:
        return []
    try:
        from cuda.bindings import nvml
        nvml.init_v2()
    except Exception:  # no module, no libnvidia-ml, or init refused: simply unknown
        return [None] * len(infos)
    try:
        links: list[int | None] = []
        for d in infos:
            try:
                handle = nvml.device_get_handle_by_pci_bus_id_v2(d.pci_bus_id)
                active = 0
                for link in range(int(nvml.NVLINK_MAX_LINKS)):
                    try:
                        state = nvml.device_get_nvlink_state(handle, link)
                    except Exception:  # link index not present on this GPU
                        break
                    active += int(state) == int(nvml.EnableState.FEATURE_ENABLED)
                links.append(active)
            except Exception:
                links.append(None)
        return links
    finally:
        try:
            nvml.shutdown()
        except Exception:
            pass


# --------------------------------------------------------------------------- everything at once
@dataclass
class Topology:
    """One snapshot of the above, for ``comet info`` and logs."""

    source: str
    devices: list[DeviceInfo] = field(default_factory=list)
    peer_access: list[list[bool]] = field(default_factory=list)
    p2p: list[list[P2PLink | None]] = field(default_factory=list)
    nvlink: list[int | None] = field(default_factory=list)
    reason: str | None = None

    def to_dict(self) -> dict:
        d = asdict(self)
        for dev, info in zip(d["devices"], self.devices):
            dev["capability"] = list(info.capability)
            dev["arch"] = info.arch
        return d


def topology() -> Topology:
    """Devices, peer access, P2P attributes and NVLink counts of this machine."""
    return Topology(source=runtime_source(), devices=devices(),
                    peer_access=peer_access_matrix(), p2p=p2p_matrix(),
                    nvlink=nvlink_links(), reason=unavailable_reason())
