"""How well could a half cache serve the half-skewed decode? A CPU replay of the cache's policies (no GPU).

The skew-depth model of bench/skew_depth.py (48 layers, 128 experts, top 8, hidden 512, expert FFN 64, the
generator's popularity skew 1) routes a 4096-token prompt and 128 decode tokens (random tokens: with no attention a
greedy decode's tokens are a function of the last one, so they rarely repeat within 128). The runtime's ExpertCache
(3072 slots, half the experts) is warmed as Engine._warm does, a prompt loan of 154 slots is lent and given back, the
prompt's layers are looked up and admitted from the ring as CudaLayerOps._admit_from_ring does, and decode's misses are
admitted as _admit_decode_misses does (at most 6 a step), with variants: by copy (the expert admitted at once, its
bytes re-sent over the link) or by landing (a reserved slot filled when the expert is next read from host memory). Also the hit rate of the best static half
cache (the top half of (layer, expert) pairs by the prompt's counts) and of an oracle (by the decode's own counts).
Writes decode_cache_replay.json under --out.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from strata_core.models.synthetic import generate_weights, model_spec
from strata_core.reference.kernels import linear, moe_grouped_ffn, rmsnorm, route_topk, scatter_add
from strata_core.runtime.cache import EMPTY, ExpertCache
from strata_core.runtime.engine import warm_frequency, warm_order

L, E, K, H, F, V = 48, 128, 8, 512, 64, 4096
PROMPT, DECODE, LOAN, RING, BUDGET = 4096, 128, 154, 87, 6


def skew_model():
    """The skew-depth model's generated weights (skew 1), as bench/skew_depth.py makes them."""
    return generate_weights(model_spec("skew-depth", L, E, K, H, F, V), 0, popularity_skew=1.0)


def routes(w, tokens: np.ndarray, inputs: list | None = None) -> np.ndarray:
    """[L, T, K] routed experts of these tokens through the layers (the runtime's math, reference kernels); each
    layer's input residual [T, H] is appended to `inputs` where one is given."""
    d = w.dense
    x = np.asarray(d.embed[tokens], dtype=np.float32)
    out = []
    for layer in range(L):
        if inputs is not None:
            inputs.append(x.copy())
        xn = rmsnorm(x, d.norms[layer])
        ids, wts = route_topk(linear(xn, d.routers[layer]), K)
        out.append(ids.copy())
        order = np.argsort(ids.ravel(), kind="stable")
        experts, starts = np.unique(ids.ravel()[order], return_index=True)
        y = moe_grouped_ffn(xn[order // K], np.append(starts, order.size), layer * E + experts, w.experts)
        scatter_add(x, order // K, y, wts.ravel()[order])
    return np.stack(out)


def best_static_half(pr: np.ndarray) -> np.ndarray:
    """[L, E] the half of all (layer, expert) pairs a prompt's routing [L, T, K] uses most."""
    counts = np.stack([np.bincount(pr[layer].ravel(), minlength=E) for layer in range(L)])
    best = np.zeros(L * E, bool)
    best[np.argsort(-counts.ravel())[: L * E // 2]] = True
    return best.reshape(L, E)


def popularity(w) -> np.ndarray:
    """Engine.expert_popularity's estimate: 256 vocabulary rows through every layer's router."""
    d = w.dense
    rows = np.random.default_rng(0).choice(V, 256, replace=False)
    x = np.asarray(d.embed[np.sort(rows)], np.float32)
    pop = np.zeros((L, E))
    for layer in range(L):
        xn = x / np.sqrt(np.mean(x * x, 1, keepdims=True) + 1e-6) * np.asarray(d.norms[layer], np.float32)
        top = np.argpartition(-(xn @ np.asarray(d.routers[layer], np.float32).T), K - 1, axis=1)[:, :K]
        c = np.bincount(top.ravel(), minlength=E).astype(float)
        pop[layer] = c / c.sum()
    return pop


def replay(pr: np.ndarray, dec: np.ndarray, pop: np.ndarray, hotter_only: bool, budget: int = BUDGET,
           landing: bool = False, expire: int = 32, cap: int = 2) -> dict:
    """Decode's hit rate, misses a step and admissions under the runtime's policy (hotter_only: worth_admitting;
    landing: CudaLayerOps' landing, a slot reserved for each admitted expert and filled only when a later step
    misses it again, at most `cap` x budget reserved, a reservation given back after `expire` steps)."""
    slots = L * E // 2
    c = ExpertCache(slots, L, E)
    order = warm_order(pop)
    c.place(order[:slots])
    c.seed_frequency(*warm_frequency(pop, K))
    lent = c.lend_run(LOAN)
    for layer in range(L):
        cnt = np.bincount(pr[layer].ravel(), minlength=E)
        used = np.flatnonzero(cnt)
        slot_map = c.slot_of[layer * E:(layer + 1) * E].copy()
        c.lookup(layer, used, cnt[used])
        miss = used[slot_map[used] < 0][:RING]
        r0, freq = layer * E, c.freq
        cand = miss[np.argsort(-freq[r0 + miss], kind="stable")]
        cached = np.flatnonzero(slot_map >= 0)
        f_vict = np.sort(freq[r0 + cached])
        n = 0
        for i in range(len(cand)):  # the i-th hottest held expert over the i-th coldest cached one
            if i >= len(f_vict) or not freq[r0 + cand[i]] > f_vict[i]:
                break
            n += 1
        if n:
            victims = cached[np.argsort(freq[r0 + cached], kind="stable")][:n]
            allowed = np.zeros(c.slots, bool)
            allowed[slot_map[victims]] = True
            c.admit(layer, cand[:n], keep=np.flatnonzero(~allowed))
    c.tick()
    c.give_back(lent)
    h0, l0, admitted = c.hits, c.lookups, 0
    reserved: dict[int, tuple[int, int]] = {}  # landing: row -> (slot, step reserved)
    for s in range(dec.shape[1]):
        missing = []
        for layer in range(L):
            ids = dec[layer, s].tolist()
            got = c.lookup_distinct(layer, ids)
            missing += [layer * E + e for e, g in zip(ids, got) if g == EMPTY]
        for r in [r for r in missing if r in reserved]:  # read from host memory into its reserved slot
            c.fill(r, reserved.pop(r)[0])
            admitted += 1
        for r in [r for r, (_, at) in reserved.items() if s - at >= expire]:
            c.give_back(np.array([reserved.pop(r)[0]]))
        if missing and budget:
            rows = np.unique(missing)
            rows = rows[np.argsort(-c.freq[rows], kind="stable")][:budget]
            if hotter_only:
                rows = c.worth_admitting(rows)
            if landing:
                rows = [r for r in rows.tolist() if r not in reserved][: max(0, min(budget, cap * budget - len(reserved)))]
                for r in rows:
                    slot = int(c.reserve(r // E, np.array([r % E]))[0])
                    if slot >= 0:
                        reserved[r] = (slot, s)
            else:
                for r in rows.tolist():
                    admitted += int((c.admit(r // E, np.array([r % E]), keep=None) >= 0).sum())
        c.tick()
    hit = (c.hits - h0) / (c.lookups - l0)
    return {"hit_rate": round(hit, 4), "misses_a_step": round((1 - hit) * L * K, 2), "admitted": admitted}


def main() -> int:
    """The replay's figures into decode_cache_replay.json."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    w = skew_model()
    rng = np.random.default_rng(1)
    pr, dec = routes(w, rng.integers(0, V, PROMPT)), routes(w, rng.integers(0, V, DECODE))
    pop = popularity(w)
    rows = np.arange(L)[:, None, None] * E + dec
    best = best_static_half(pr).reshape(-1)
    dc = np.bincount(rows.ravel(), minlength=L * E)
    oracle = np.zeros(L * E, bool)
    oracle[np.argsort(-dc)[: L * E // 2]] = True
    res = {"schema": "strata.bench.decode_cache_replay/1",
           "shape": {"layers": L, "experts": E, "top_k": K, "hidden": H, "expert_ffn": F, "prompt": PROMPT,
                     "decode": DECODE, "slots": L * E // 2, "loan": LOAN, "ring": RING, "admit_budget": BUDGET},
           "best_static_half_by_prompt_counts": {"hit_rate": round(float(best[rows].mean()), 4)},
           "oracle_half_by_decode_counts": {"hit_rate": round(float(oracle[rows].mean()), 4)},
           "runtime_policy_any_slot": replay(pr, dec, pop, hotter_only=False),
           "runtime_policy_hotter_only": replay(pr, dec, pop, hotter_only=True),
           "landing_hotter_only": replay(pr, dec, pop, hotter_only=True, landing=True),
           "landing_hotter_only_budget_12": replay(pr, dec, pop, hotter_only=True, budget=12, landing=True),
           "landing_hotter_only_never_expiring_cap_8": replay(pr, dec, pop, hotter_only=True, landing=True,
                                                               expire=10 ** 9, cap=8),
           "no_decode_admission": replay(pr, dec, pop, hotter_only=False, budget=0)}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "decode_cache_replay.json").write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
