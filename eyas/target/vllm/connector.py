"""A hidden-states KV connector that runs where vLLM's example one cannot: on CPU, and on any device without
pinned host memory or CUDA streams.

vLLM's `extract_hidden_states` method stores the requested residual streams of every prompt token in a
cache-only attention layer; a KV connector reads them out when the request finishes. vLLM's example
connector does that with a CUDA copy stream into pinned memory, which fails on CPU. This one copies the
request's slots with a plain indexing copy (synchronous, so the request's blocks may be freed at once) and
leaves only the file write to the example's thread pool; the lock-file handshake with the reader
(eyas.target.vllm.capture) is the example's: the lock exists before the request's output reaches the
client, and is released when the file is complete.

vLLM imports this module by name in its worker processes (kv_transfer_config.kv_connector_module_path), so
vLLM is imported at module level here; nothing in eyas imports this module.
"""

from __future__ import annotations

import os

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    ExampleHiddenStatesConnectorMetadata,
)

CONNECTOR_NAME = "EyasHiddenStatesConnector"
NO_STATES = "eyas_no_states"  # eyas.target.vllm.engine.NO_STATES (this module must not import eyas's engine)


class EyasHiddenStatesConnector(ExampleHiddenStatesConnector):
    """Worker side: a plain copy out of the hidden-states cache; scheduler side: the example's unchanged."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._copied: set[str] = set()  # requests whose states were copied out of the cache this run

    def build_connector_meta(self, scheduler_output):
        """The example's, less the requests that asked for no states (generation through the same engine):
        without a file name they are never saved (request_finished frees their blocks at once)."""
        meta = super().build_connector_meta(scheduler_output)
        for new_req in scheduler_output.scheduled_new_reqs:
            extra = (new_req.sampling_params.extra_args or {}) if new_req.sampling_params else {}
            if (extra.get("kv_transfer_params") or {}).get(NO_STATES):
                self._request_filenames.pop(new_req.req_id, None)
                meta.new_req_filenames.pop(new_req.req_id, None)
        return meta

    def _submit_async_write(self, pending) -> None:
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None
        block_size = self._block_size
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)  # [num_blocks]
        slots = (blocks[:, None] * block_size + torch.arange(block_size)).flatten()  # [num_blocks * block_size]
        slots = slots[:pending.token_ids.shape[0]].to(self._kv_cache.device)
        # the cache is [num_blocks, num_layers, block_size, hidden]; advanced indexing copies, so the blocks
        # may be reused as soon as this returns
        states = self._kv_cache[slots // block_size, :, slots % block_size].to("cpu")  # [T, num_layers, H]
        tensors = {"hidden_states": states.contiguous(), "token_ids": pending.token_ids.clone()}
        os.makedirs(os.path.dirname(pending.filename) or ".", exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        self._executor.submit(_write, tensors, pending.filename, lock_fd)
        self._copied.add(pending.req_id)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self.has_connector_metadata():
            metadata = self._get_connector_metadata()
            if isinstance(metadata, ExampleHiddenStatesConnectorMetadata):
                for pending in metadata.pending_saves:
                    self._submit_async_write(pending)
        self._accumulated_finished_req_ids.update(finished_req_ids)
        sent = self._accumulated_finished_req_ids & self._copied
        self._copied -= sent
        for req_id in list(self._accumulated_finished_req_ids):
            lock_fd = self._lock_fds.pop(req_id, None)  # a request aborted before its states were copied
            if lock_fd is not None and req_id not in sent:
                os.close(lock_fd)
        self._accumulated_finished_req_ids.clear()
        return sent or None, None


def _write(tensors: dict, filename: str, lock_fd: int | None) -> None:
    """Write the file under a temporary name, then rename, then release the reader's lock."""
    try:
        tmp = f"{filename}.tmp"
        save_file(tensors, tmp)
        os.replace(tmp, filename)
    finally:
        if lock_fd is not None:
            os.close(lock_fd)
