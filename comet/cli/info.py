"""``comet info``: what this machine has and which comet code path would run on it.

Meant to be the first thing pasted into a bug report, so it must never fail for lack of a
GPU or an optional package: every probe degrades to "not installed" / "none".
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from importlib import metadata

from comet.constants import kernel_identity
from comet.runtime import topology

#: Distributions whose versions matter, in display order. cuda-python became a
#: meta-package over cuda-bindings in 12.6, so both are shown.
PACKAGES = ("torch", "triton", "cuda-python", "cuda-bindings", "numpy", "transformers")

#: Variables that change comet's behaviour -> the value comet wants (None: no preference).
#: NVLink multicast must stay off for the symmetric-memory workspaces (docs/design.md).
ENV_VARS: dict[str, str | None] = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
    "COMET_TUNED_CONFIG_FOLDER": None,
    "CUDA_VISIBLE_DEVICES": None,
}

FUSED = "fused Triton kernels (CUDA, sm_90)"
REFERENCE = "CPU reference path (comet.reference)"


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _comet_version() -> str:
    import comet
    return getattr(comet, "__version__", None) or _version("comet-moe") or "unknown"


def _torch_facts() -> dict:
    try:
        import torch
    except ImportError:
        return {"cuda_build": None, "cuda_available": False}
    return {"cuda_build": torch.version.cuda, "cuda_available": bool(torch.cuda.is_available())}


def what_would_run(devices: list[dict], triton_version: str | None,
                   torch_cuda: bool) -> dict:
    """The path ``CometMoE`` takes here (``path``), why not the fused one (``reason``), and
    both in one line (``summary``)."""
    def verdict(path: str, reason: str | None) -> dict:
        summary = path if reason is None else f"{path} -- {reason}"
        return {"path": path, "reason": reason, "summary": summary}

    if not devices:
        return verdict(REFERENCE, "no CUDA GPU")
    if not torch_cuda:
        return verdict(REFERENCE, "torch is a build without CUDA")
    if triton_version is None:
        return verdict(REFERENCE, "triton is not installed")
    # The kernels use Hopper TMA and are tuned for sm_90; other archs are not a target.
    if any(d["capability"][0] == 9 for d in devices):
        return verdict(FUSED, None)
    archs = ", ".join(sorted({d["arch"] for d in devices}))
    return verdict(REFERENCE, f"the fused kernels need sm_90, found {archs}")


def collect() -> dict:
    """Everything ``comet info`` reports, as one JSON-serialisable dict."""
    packages = {name: _version(name) for name in PACKAGES}
    try:
        topo = topology.topology().to_dict()
        topo_error = None
    except Exception as e:  # a broken driver must still leave a readable report
        topo = topology.Topology(source=topology.runtime_source()).to_dict()
        topo_error = f"{type(e).__name__}: {e}"
    torch_facts = _torch_facts()
    return {
        "comet": _comet_version(),
        "kernels": kernel_identity(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "packages": packages,
        "torch_cuda_build": torch_facts["cuda_build"],
        "cuda": {**topology.cuda_versions(), "source": topo["source"],
                 "device_count": len(topo["devices"]),
                 "no_device_reason": topo["reason"], "error": topo_error},
        "gpus": topo["devices"],
        "peer_access": topo["peer_access"],
        "p2p": topo["p2p"],
        "nvlink_active_links": topo["nvlink"],
        "env": {name: os.environ.get(name) for name in ENV_VARS},
        "would_run": what_would_run(topo["devices"], packages["triton"],
                                    torch_facts["cuda_available"]),
    }


# --------------------------------------------------------------------------- text rendering
def _table(rows: list[list[str]], indent: str = "  ") -> list[str]:
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    return [indent + "  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip()
            for r in rows]


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def render(info: dict) -> str:
    """The human-readable report."""
    kernels = f"  ({info['kernels']})" if info.get("kernels") else ""
    lines = [f"comet {info['comet']}{kernels}", ""]

    pk = info["packages"]
    rows = [["python", info["python"]]]
    for name in PACKAGES:
        if name == "transformers" and pk[name] is None:
            continue  # optional extra: only worth a line when present
        v = pk[name] or "not installed"
        if name == "torch" and pk[name]:
            v += f"  (CUDA build: {info['torch_cuda_build'] or 'none'})"
        rows.append([name, v])
    lines += ["Packages", *_table(rows), ""]

    cu = info["cuda"]
    count = str(cu["device_count"])
    if cu["no_device_reason"] and not cu["device_count"]:
        count += f"  ({cu['no_device_reason']})"
    rows = [["device facts from", cu["source"]], ["CUDA driver", cu["driver"] or "none"],
            ["CUDA runtime", cu["runtime"] or "unknown"], ["GPUs", count]]
    if cu["error"]:
        rows.append(["error", cu["error"]])
    lines += ["CUDA", *_table(rows), ""]

    if info["gpus"]:
        rows = [["#", "name", "arch", "SMs", "memory", "L2", "smem/block", "PCI"]]
        for d in info["gpus"]:
            rows.append([str(d["index"]), d["name"], d["arch"], str(d["sm_count"]),
                         _size(d["total_memory"]), _size(d["l2_cache_size"]),
                         _size(d["smem_per_block_optin"]), d["pci_bus_id"] or "-"])
        lines += ["GPUs", *_table(rows), ""]
        lines += _peer_lines(info)

    rows = []
    for name, want in ENV_VARS.items():
        value = info["env"][name]
        note = ""
        if want is not None and value != want:
            note = f"comet expects {want} (NVLink multicast off)"
        rows.append([name, "(unset)" if value is None else value, note])
    lines += ["Environment", *_table(rows), ""]

    run = info["would_run"]
    lines += ["What would run", "  " + run["summary"]]
    return "\n".join(lines)


def _peer_lines(info: dict) -> list[str]:
    n = len(info["peer_access"])
    if n < 2:
        return []
    header = ["src\\dst", *map(str, range(n))]
    rows = [header]
    for i in range(n):
        row = [str(i)]
        for j in range(n):
            link = info["p2p"][i][j]
            if link is None:
                row.append(".")
            elif not link["can_access_peer"]:
                row.append("no")
            elif link["performance_rank"] is None:
                row.append("yes")
            else:
                atomics = "" if link["native_atomics"] else "*"
                row.append(f"r{link['performance_rank']}{atomics}")
        rows.append(row)
    lines = ["Peer access (rN: access with P2P performance rank N, lower is faster; "
             "*: no native atomics; no: no access)", *_table(rows)]
    links = info["nvlink_active_links"]
    if any(x is not None for x in links):
        lines.append("  NVLink active links: " + ", ".join(
            f"{i}: {'?' if x is None else x}" for i, x in enumerate(links)))
    else:
        lines.append("  NVLink: link state not reachable (NVML via cuda.bindings.nvml)")
    return lines + [""]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="comet info", description="Versions, GPUs, peer access, relevant environment "
        "variables and which comet code path would run here.")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    info = collect()
    print(json.dumps(info, indent=2) if args.json else render(info))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
