"""`eyas gpus`: each GPU's memory and the processes holding it (the table `eyas run` refuses on)."""

from __future__ import annotations


def add_arguments(parser) -> None:
    parser.add_argument("--gpus", default=None, help="only these device indices, e.g. 0,1 (default: all)")


def main(args) -> int:
    from eyas.gpu import nvml
    from eyas.gpu.devices import parse_gpus

    devices = parse_gpus(args.gpus) if args.gpus else None
    if not nvml.available():
        print(f"eyas gpus: {nvml.why_unavailable()}; there is nothing to list (stages run on the CPU)")
        return 0
    if not nvml.gpus():
        print("eyas gpus: the NVIDIA driver is loaded but sees no GPU")
        return 0
    for g in nvml.gpus():
        if devices is None or g.index in devices:
            print(f"gpu {g.index}: {g.name}, {g.used_mib:.0f} / {g.total_mib:.0f} MiB used")
    rows = nvml.holders(devices)
    if rows:
        print(nvml.format_holders(rows))
    else:
        print("no process holds memory on these GPUs")
    return 0
