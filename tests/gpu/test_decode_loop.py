"""The pipelined greedy decode on a CUDA device (Executor.decode_greedy through CudaLayerOps' greedy capability):
the device's argmax follows np.argmax (first index of the largest, a NaN first), the embedding row it gathers is
the host's f16 row widened bit for bit (from device memory and from the page-locked table at its mapped address),
and a whole request decodes the step loop's tokens, last logits and cache state (hits, lookups, frequencies, slot
table) on the tiny model and on a Qwen3-30B-A3B-shaped model of two layers (128 experts, top 8, hidden 2048, FFN
768, vocabulary 151936), every expert cached and half of them (misses read from mapped host memory, admissions one
step later in the pipeline). Skipped with "no CUDA device" where there is none.
"""

from __future__ import annotations

import numpy as np
import pytest

from .test_fast_paths import _cuda_device_count

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_cuda_device_count() == 0, reason="no CUDA device")]

STEPS = 16


@pytest.fixture(scope="module")
def cp():
    """cupy, imported only where a GPU is present."""
    import cupy
    return cupy


@pytest.fixture(scope="module")
def greedy(cp):
    """The greedy kernels, compiled once."""
    from strata_cuda.kernels import GreedyKernels
    return GreedyKernels()


def _argmax_cases() -> list[np.ndarray]:
    rng = np.random.default_rng(3)
    cases = [rng.standard_normal(n).astype(np.float32) for n in (1, 2, 1023, 1024, 1025, 4097, 151936)]
    tie = rng.standard_normal(151936).astype(np.float32)
    tie[[5, 70000, 151935]] = 9.0  # the first of equal maxima
    cases.append(tie)
    cases.append(np.full(3000, 1.5, np.float32))
    nan = rng.standard_normal(151936).astype(np.float32)
    nan[[90000, 1200]] = np.nan  # np.argmax: the first NaN
    cases.append(nan)
    cases.append(np.full(77, -np.inf, np.float32))
    signed_zero = np.zeros(5000, np.float32)
    signed_zero[:10] = -0.0
    cases.append(signed_zero)
    late = np.full(151936, -1e30, np.float32)
    late[-1] = np.float32(3.0)
    cases.append(late)
    return cases


def test_the_device_argmax_is_np_argmax(cp, greedy):
    out = cp.full(1, -7, dtype=cp.int32)
    for v in _argmax_cases():
        d = cp.asarray(v)
        greedy.argmax(int(d.data.ptr), v.size, int(out.data.ptr))
        assert int(out.get()[0]) == int(np.argmax(v)), (v.size, int(out.get()[0]), int(np.argmax(v)))


def _table(vocab: int, hidden: int) -> np.ndarray:
    rng = np.random.default_rng(4)
    t = (rng.standard_normal((vocab, hidden)) * 3).astype(np.float16)
    specials = np.array([0x0000, 0x8000, 0x0001, 0x83ff, 0x3c00, 0x7bff, 0xfbff, 0x7c00, 0xfc00, 0x7e00],
                        np.uint16).view(np.float16)  # zeros, subnormals, one, largest, infinities, a NaN
    t[7, :specials.size] = specials
    return t


@pytest.mark.parametrize("where", ["device", "page-locked", "registered"])
def test_the_embedding_row_is_the_hosts_row_widened_bit_for_bit(cp, greedy, where):
    from strata_core.api.backend import PinnedBudget
    from strata_cuda.cupy_device import CupyPinnedAllocator
    vocab, hidden = 300, 2048
    table = _table(vocab, hidden)
    buf = None
    if where == "device":
        dev = cp.asarray(table)
        ptr = int(dev.data.ptr)
    else:
        alloc = CupyPinnedAllocator(PinnedBudget(1 << 30, 0))
        if where == "registered":  # what CudaLayerOps.greedy_table does with the host's table
            host = table.copy()
            buf = alloc.register(host)
        else:
            buf = alloc.alloc(table.nbytes)
            host = np.ndarray(table.shape, np.float16, buffer=buf.array)
            host[...] = table
        assert buf is not None and buf.handle is not None
        ptr = int(host.ctypes.data)
    try:
        for token in (7, 0, vocab - 1):
            tok = cp.asarray([token], dtype=cp.int32)
            x = cp.full((1, hidden), np.nan, dtype=cp.float32)
            greedy.embed_row(ptr, int(tok.data.ptr), hidden, int(x.data.ptr))
            want = table[token].astype(np.float32)
            assert np.array_equal(x.get()[0].view(np.uint32), want.view(np.uint32)), token
    finally:
        if buf is not None:
            alloc.free(buf)


# --- whole requests: the pipeline against the step loop --------------------------------------------------------

def _target_and_settings(sets: list[str], spec=None):
    from strata_core.cli import build_parser
    from strata_core.commands.run import resolve_run_model
    from strata_core.config.settings import settings_from_args
    from strata_core.planner.model_defaults import with_model_defaults
    from strata_core.registry import load_from_settings
    argv = ["run", "--backend", "cuda"]
    for s in sets:
        argv += ["--set", s]
    args = build_parser().parse_args(argv)
    loaded = settings_from_args(args)
    plugins = load_from_settings(loaded.settings)
    target = plugins.resolve_target(loaded.settings)
    if spec is None:
        spec, load, settings = resolve_run_model(None, loaded, 0)
        return plugins, target, spec, load, settings
    return plugins, target, spec, None, with_model_defaults(loaded, spec).settings


def _serve(plugins, target, spec, weights, settings, prompt: np.ndarray, pipelined: bool) -> dict:
    from strata_core.planner import plan_for_machine
    from strata_core.runtime.engine import Engine
    from strata_core.runtime.runlog import RunLog
    plan = plan_for_machine(plugins, target, spec, settings)
    eng = Engine.open(target, plan, weights, RunLog(), seed=0)
    try:
        ex = eng.executor
        ex.greedy_pipeline = pipelined
        assert ex.pipelines_greedy == pipelined
        last = {}
        step, pipe = ex.decode_step, ex.decode_greedy
        ex.decode_step = lambda tok: last.__setitem__("logits", step(tok)) or last["logits"]
        ex.decode_greedy = lambda *a: last.__setitem__("logits", pipe(*a)) or last["logits"]
        res = eng.serve(prompt, STEPS)
        assert res.completed and res.decode_steps == STEPS, res.refused_reason
        return dict(tokens=list(res.tokens), logits=last["logits"], hits=eng.cache.hits, lookups=eng.cache.lookups,
                    freq=eng.cache.freq.copy(), slot_of=eng.cache.slot_of.copy(), counts=dict(ex.ops.counts),
                    admitted=ex.stats.experts_admitted, hit_rate=res.decode_hits / max(1, res.decode_lookups),
                    loan_slots=res.loan_slots)
    finally:
        eng.close()


def _same_as_the_step_loop(plugins, target, spec, weights, settings, prompt, all_cached: bool) -> tuple[dict, dict]:
    """Both loops on fresh engines: the same tokens and last logits; with every expert cached (no admission) the
    same cache state too. With misses, whether a step admits depends on whether the previous admission's copy has
    landed (a timing, in either loop), so only the tokens, logits and lookups must agree: a missed expert read
    from host memory gives the same bits as its cached copy."""
    plain = _serve(plugins, target, spec, weights, settings, prompt, False)
    piped = _serve(plugins, target, spec, weights, settings, prompt, True)
    assert piped["tokens"] == plain["tokens"] and len(piped["tokens"]) == STEPS + 1
    assert np.array_equal(piped["logits"], plain["logits"])
    assert piped["lookups"] == plain["lookups"]
    if all_cached:
        assert piped["hits"] == plain["hits"] == plain["lookups"]
        assert np.array_equal(piped["freq"], plain["freq"]) and np.array_equal(piped["slot_of"], plain["slot_of"])
        assert piped["admitted"] == plain["admitted"]
    assert piped["counts"].get("greedy_steps") == STEPS and piped["counts"].get("decode_deferred_steps") == STEPS
    assert "greedy_steps" not in plain["counts"] and "decode_deferred_steps" not in plain["counts"]
    assert piped["counts"]["decode_graph_steps"] == plain["counts"]["decode_graph_steps"] == STEPS
    return plain, piped


def test_the_tiny_model_decodes_the_step_loops_tokens_and_cache_state(cp):
    plugins, target, spec, load, settings = _target_and_settings([])
    weights = load()
    prompt = np.random.default_rng(0).integers(0, weights.vocab, 200)
    _same_as_the_step_loop(plugins, target, spec, weights, settings, prompt, all_cached=False)


@pytest.fixture(scope="module")
def qwen3_shaped():
    """A Qwen3-30B-A3B-shaped model of two layers (f16 experts), generated once."""
    from strata_core.models.synthetic import generate_weights, model_spec
    spec = model_spec("qwen3-shaped-2", 2, 128, 8, 2048, 768, 151936, dtype="f16", source="preset, generated")
    return spec, generate_weights(spec, 0, dtype="f16")


@pytest.mark.parametrize("cached", ["all", "half"])
def test_a_qwen3_shaped_model_decodes_the_step_loops_tokens_and_cache_state(cp, qwen3_shaped, cached):
    spec, weights = qwen3_shaped
    slots = 2 * 128 + 64 if cached == "all" else 128
    plugins, target, _, _, settings = _target_and_settings(
        [f"memory.expert_cache={slots}", "prefill.chunk=64"], spec=spec)
    prompt = np.random.default_rng(1).integers(0, weights.vocab, 64)
    plain, piped = _same_as_the_step_loop(plugins, target, spec, weights, settings, prompt,
                                          all_cached=cached == "all")
    if cached == "all":
        assert plain["hit_rate"] == 1.0
    else:
        # decode admits its misses by copies (CudaLayerOps.decode_landing off by default)
        assert plain["hit_rate"] < 1.0 and piped["counts"].get("decode_admitted", 0) > 0, piped["counts"]
        # a top-up fills only slots a prompt's loan gave back (this chunk takes none: its misses are admitted), the
        # same in both loops
        tops = [r["counts"].get("decode_topped_up", 0) for r in (plain, piped)]
        assert tops[0] == tops[1] and all(t <= r["loan_slots"] for t, r in zip(tops, (plain, piped))), tops
