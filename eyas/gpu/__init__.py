"""eyas.gpu: stage processes in their own process groups, teardown, orphan records and NVML queries.

`procs` starts, records and ends stage processes (Linux /proc, no third-party code); `nvml` asks the
NVIDIA driver which processes hold memory (nvidia-ml-py, imported lazily); `devices` turns --gpus and
CUDA_VISIBLE_DEVICES into NVML indices. No model code here.
"""
