"""Host work of the engine's cycle, counted (not timed) on CPU: every device read (tolist/item/int) is a
sync on CUDA and every host-built tensor a copy that waits for the device, so their number per cycle is
what decides the engine's overhead on a GPU. Model forwards are excluded; only the engine's own calls count."""

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from eyas.speculative.engine import SpecEngine
from eyas.speculative.oracle import untrained_draft
from eyas.speculative.target import Positions, causal_mask

PROMPT = [1, 72, 101, 108, 108, 111, 32, 119, 111, 114, 108, 100, 2]
READS = {"tolist", "item", "__int__", "__float__", "__bool__", "__index__"}
BUILDS = {"tensor", "as_tensor"}


class Counter(TorchFunctionMode):
    def __init__(self, modules):
        super().__init__()
        self.reads = self.builds = 0
        self.inside = 0
        for m in modules:  # forwards of the target and the draft are not the engine's work
            m.register_forward_pre_hook(self._enter)
            m.register_forward_hook(self._leave)

    def _enter(self, *args):
        self.inside += 1

    def _leave(self, *args):
        self.inside -= 1

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if not self.inside:
            name = getattr(func, "__name__", "")
            self.reads += name in READS
            self.builds += name in BUILDS
        return func(*args, **(kwargs or {}))


def draft_for(target):
    ids = torch.randperm(target.vocab_size, generator=torch.Generator().manual_seed(0))[:200].sort().values
    return untrained_draft(target, 200, target_ids=ids)  # a real d2t offset table


@pytest.mark.parametrize("setting, static, reads, builds", [
    (None, False, 1, 0),  # plain decoding: the token itself, nothing built on the host
    (dict(steps=5), False, 1, 0),  # a greedy chain: draft tokens and target argmax in one read, nothing built
    (dict(tree=(4, 4, 12)), False, 4 + 1, 3 + 1),  # a tree: one read per level + the verdict; mask rows + inputs
    (dict(steps=5), True, 1, 0),  # the fixed-shape (CUDA graph) chain
    (dict(tree=(4, 4, 12)), True, 1, 0),  # the fixed-shape tree: ranked and walked on the device, one read
])
def test_device_reads_and_host_builds_per_cycle(tiny_target, setting, static, reads, builds):
    draft, aux = draft_for(tiny_target)
    engine = SpecEngine(tiny_target.model, draft if setting else None, aux if setting else None, static=static)
    run = (lambda: engine.plain_generate(PROMPT, 40)) if setting is None else (lambda: engine.generate(PROMPT, 40, **setting))
    ref = SpecEngine(tiny_target.model).plain_generate(PROMPT, 40).tokens
    with Counter([tiny_target.model, draft]) as c:
        res = run()
    assert res.tokens == ref
    cycles = res.num_cycles
    assert cycles >= 20
    # a constant per generation (prefill, d2t table, the first token) is allowed, not a per-cycle cost
    assert c.reads <= reads * cycles + 3, (c.reads, cycles)
    assert c.builds <= builds * cycles + 3, (c.builds, cycles)


@pytest.mark.parametrize("past, new", [(0, 5), (7, 1), (7, 4), (0, 1)])
def test_position_buffers_match_host_masks(past, new):
    pos = Positions(32, "cpu")
    assert torch.equal(pos.causal(past, new), causal_mask(past, new, "cpu"))
    assert pos.at(past, new).tolist() == [list(range(past, past + new))]


class DraftCacheWatch(TorchFunctionMode):
    """Inside the draft's forwards: torch.cat calls that build a [B, heads, S, d] tensor longer than the
    forward's new tokens (a copy of the whole KV cache), and the storage each forward's cache lives in."""

    def __init__(self, draft):
        super().__init__()
        self.new = None
        self.full_copies = 0
        self.stores = []
        draft.register_forward_pre_hook(self._enter)
        draft.register_forward_hook(self._leave)

    def _enter(self, module, args):
        self.new = args[1].shape[1]

    def _leave(self, module, args, out):
        self.new = None
        self.stores.append(out.past_key_values.k_store.data_ptr())

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.new is not None and getattr(func, "__name__", "") in ("cat", "concat") and isinstance(out, torch.Tensor):
            self.full_copies += out.dim() == 4 and out.shape[2] > self.new
        return out


@pytest.mark.parametrize("setting", [dict(steps=5), dict(tree=(4, 4, 12))])
def test_draft_cache_is_extended_in_place(tiny_target, setting):
    """No draft step copies its whole KV cache: entries are written into preallocated storage, rolled back
    by length, and the storage is replaced only when full (a few times per generation, not per step)."""
    draft, aux = draft_for(tiny_target)
    engine = SpecEngine(tiny_target.model, draft, aux)
    ref = SpecEngine(tiny_target.model).plain_generate(PROMPT, 60).tokens
    with DraftCacheWatch(draft) as w:
        res = engine.generate(PROMPT, 60, **setting)
    assert res.tokens == ref
    assert w.full_copies == 0
    assert len(w.stores) >= 2 * res.num_cycles and len(set(w.stores)) <= 3, (len(w.stores), len(set(w.stores)))


class SyncOps(TorchDispatchMode):
    """Operators that make a CUDA stream wait for the host (so that a CUDA graph capture refuses them),
    seen at the dispatcher, where C++ paths the function mode above cannot see show up too: a tensor
    indexed with a 0-dim tensor reads it (`_local_scalar_dense`), a boolean mask needs `nonzero`'s count."""

    SYNCING = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique", "_unique2",
               "unique_consecutive", "unique_dim"}

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        bool_index = name == "index" and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool
                                             for i in (args[1] if len(args) > 1 else ()) if i is not None)
        no_size = name == "repeat_interleave" and (kwargs or {}).get("output_size") is None
        if name in self.SYNCING or bool_index or no_size:
            self.seen.append(name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("setting", [None, dict(steps=4), dict(tree=(4, 4, 12)), dict(tree=(3, 1, 3))])
def test_fixed_shape_passes_never_wait_for_the_host(tiny_target, setting, monkeypatch):
    """Every pass that the GPU captures as a CUDA graph (plain step, chain or tree, verify, rebuild) run here
    eagerly under a dispatcher watch: none may read a tensor on the host or size an output by its data. On
    the H200 a tree's verify pass once indexed with a 0-dim tensor and the capture failed; this catches it
    on the CPU."""
    from eyas.speculative import graphs

    watch = SyncOps()
    passes = []

    def watched(step):
        passes.append(step.fn)
        with watch:
            step.fn()

    monkeypatch.setattr(graphs._Step, "__call__", watched)
    draft, aux = draft_for(tiny_target)
    engine = SpecEngine(tiny_target.model, draft if setting else None, aux if setting else None, static=True)
    ref = SpecEngine(tiny_target.model).plain_generate(PROMPT, 30).tokens
    res = engine.plain_generate(PROMPT, 30) if setting is None else engine.generate(PROMPT, 30, **setting)
    assert res.tokens == ref
    assert len(passes) >= res.num_cycles
    assert watch.seen == [], sorted(set(watch.seen))
